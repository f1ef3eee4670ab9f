"""`deferred_interrupts()`: a block that Ctrl-C cannot cut in half (teardown, undo).

    with deferred_interrupts():
        remove_hooks(); stop_threads(); restore_weights()    # a SIGINT here is raised after the block

Only the main thread receives signals, so elsewhere the block simply runs. Re-entrant.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_STATE = threading.local()


@contextlib.contextmanager
def deferred_interrupts():
    """Run the block to its end; a SIGINT arriving inside is delivered (to the previous handler,
    KeyboardInterrupt by default) once it is done."""
    if getattr(_STATE, "on", False) or threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    except ValueError:  # not the main interpreter's main thread
        yield
        return
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = False
        signal.signal(signal.SIGINT, previous)
        if got:
            signal.raise_signal(signal.SIGINT)
