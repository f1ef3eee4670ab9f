"""Ctrl-C and the runtime: state changes it cannot cut in half.

    shield_on(); ...; shield_off()       # offload / close: SIGINT then waits for a `critical` section
    with critical():                     # one state-machine transition (a reveal, a replayed position)
        driver.reveal(layer, ids)
    with deferred_interrupts():          # teardown, undo: the whole block
        remove_hooks(); stop_threads(); restore_weights()

Python raises KeyboardInterrupt between any two bytecodes of the main thread, so a Ctrl-C could
stop the memory manager halfway through a decision (a slot taken, its copy never queued). While a
runtime is live its SIGINT handler raises KeyboardInterrupt at once, exactly like Python's
default, except inside a `critical` section of the main thread, where it is raised when the
section ends. Waits (for the control thread, for copies) are never critical, so Ctrl-C always gets
through. The handler is installed only over Python's default one and removed when the last
runtime closes. Only the main thread receives signals; elsewhere these are no-ops.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_MAIN = threading.main_thread().ident


class _Shield:
    depth = 0  # open critical sections of the main thread
    pending = False  # a SIGINT arrived inside one
    users = 0  # live runtimes that asked for the handler


_SHIELD = _Shield()


def _on_sigint(signum, frame) -> None:
    if _SHIELD.depth:
        _SHIELD.pending = True
    else:
        raise KeyboardInterrupt


def shield_on() -> None:
    """A runtime starts: install the deferring SIGINT handler (main thread, over the default one only)."""
    if threading.get_ident() != _MAIN:
        return
    if _SHIELD.users == 0 and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # someone else's handler: leave it alone (no deferral then)
    if _SHIELD.users == 0:
        signal.signal(signal.SIGINT, _on_sigint)
    _SHIELD.users += 1


def shield_off() -> None:
    """A runtime closed: the default handler comes back with the last one (if ours is still installed)."""
    if threading.get_ident() != _MAIN or _SHIELD.users == 0:
        return
    _SHIELD.users -= 1
    if _SHIELD.users == 0 and signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class critical:
    """A state change a SIGINT must not cut: with the shield on, KeyboardInterrupt waits for its end."""

    __slots__ = ("main",)

    def __enter__(self) -> None:
        self.main = threading.get_ident() == _MAIN
        if self.main:
            _SHIELD.depth += 1

    def __exit__(self, kind, error, tb) -> None:
        if not self.main:
            return
        _SHIELD.depth -= 1
        if _SHIELD.depth == 0 and _SHIELD.pending:
            _SHIELD.pending = False
            if kind is None:
                raise KeyboardInterrupt


@contextlib.contextmanager
def deferred_interrupts():
    """Run the block to its end; a SIGINT arriving inside is delivered (to the previous handler,
    KeyboardInterrupt by default) once it is done. Re-entrant."""
    if threading.get_ident() != _MAIN or getattr(_SHIELD, "deferring", False):
        yield
        return
    got: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    except ValueError:  # not the main interpreter
        yield
        return
    _SHIELD.deferring = True
    try:
        yield
    finally:
        _SHIELD.deferring = False
        signal.signal(signal.SIGINT, previous)
        if got:
            signal.raise_signal(signal.SIGINT)
