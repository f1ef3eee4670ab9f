"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (a file, a name, a number); the message says what and how to fix it."""
