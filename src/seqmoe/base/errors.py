"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (a file, a name, a number); the message says what and how to fix it."""


class Note(UserWarning):
    """Something the user should know that is not an error (a default that had to give way); the CLI
    prints it as one `seqmoe: note:` line."""


def needs_extra(what: str, extra: str, error: ImportError | None = None) -> UserError:
    """The error for a missing optional dependency: `what` needs the `extra`, with the install line
    for an installed package and for a checkout (the README's commands install from one)."""
    why = f" ({error})" if error is not None else ""
    return UserError(f"{what}{why}; install it: pip install 'seqmoe[{extra}]' (from a checkout: "
                     f"pip install -e '.[{extra}]')")
