"""The control thread: runs the state machine on decode steps' routing read from the mailbox.

With `control="thread"` a decode step (one position, the model cache not empty) only posts its
routing (`Mailbox.post`, device ops); this thread reads it layer by layer (`Mailbox.wait`) and
calls `Controller.decode_layer`, which makes the same state-machine calls, in the same order, as
the inline hooks do. The decisions depend only on the routing and the virtual clock, never on when
they are made, so counts and trace equal the inline engine's and `simulate()`'s.

The model thread calls `launch()` before each decode step (it counts the step and waits while the
thread is R / 2 steps behind, so the mailbox ring never laps) and `catch_up()` before anything that
needs the state machine current (a prompt forward, stats, trace). A step cut short (its forward
raised or was interrupted after posting some layers) is `cut`: the thread reads the layers that
were posted, then drops the step (`Controller.abandon_step`) instead of waiting for the rest. An
error in the thread is raised on the model thread at its next `launch` or `catch_up`.
Where it sits in a decode step: docs/decode.md, "On CUDA: posted and captured".
"""

from __future__ import annotations

import threading

from seqmoe.runtime.posted.mailbox import Mailbox


class ControlThread:
    """Consume decode steps posted to `mailbox` into `controller` (under `lock`); `on_stop()` is
    called once it stops consuming (closed or failed): waits on the device for it then end."""

    def __init__(self, controller, mailbox: Mailbox, lock: threading.Lock, on_stop=None) -> None:
        self.controller, self.mailbox, self.lock = controller, mailbox, lock
        self._on_stop = on_stop or (lambda: None)
        self.launched = 0  # decode steps the model thread started
        self.done = 0  # decode steps fed to the state machine
        self._cv = threading.Condition()
        self._stop = False
        self._cut: dict[int, int] = {}  # step -> layers it posted, for steps cut short
        self._rows: dict[int, tuple[int, list[int] | None]] = {}  # step -> its rows and their lanes, until read
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="seqmoe-control", daemon=True)
        self._thread.start()

    def launch(self, rows: int = 1, lanes: list[int] | None = None) -> int:
        """A decode step of `rows` rows (on `lanes`, see `Controller.lanes`) is about to post (model
        thread); waits while the thread is half a ring behind. The step's number."""
        with self._cv:
            self._cv.wait_for(lambda: self.launched - self.done < self.mailbox.R // 2 or self._error or self._stop)
            self._check()
            self._rows[self.launched] = (rows, lanes)
            self.launched += 1
            self._cv.notify_all()
            return self.launched - 1

    def cut(self, step: int, posted: int) -> None:
        """Launched `step` posted only its first `posted` layers (model thread, after a failed forward)."""
        with self._cv:
            self._cut[step] = posted
            self._cv.notify_all()

    def catch_up(self, timeout: float | None = 600.0) -> None:
        """Wait until every launched decode step is in the state machine."""
        with self._cv:
            ok = self._cv.wait_for(lambda: self.done >= self.launched or self._error or self._stop, timeout)
            self._check()
            if not ok:
                raise RuntimeError(f"the control plane waited {timeout} s for decode step {self.done}'s routing, "
                                   "which the device never posted; restore() and offload the model again")

    def fail(self, error: BaseException) -> None:
        """Stop consuming: `error` is raised at the next `launch` or `catch_up` (model thread)."""
        with self._cv:
            if self._error is None:
                self._error = error
            self._stop = True
            self._cv.notify_all()
        self._on_stop()

    @property
    def stopped(self) -> bool:
        """The thread has stopped consuming (closed, or failed)."""
        return self._stop

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the control thread failed: {self._error!r}") from self._error

    def _run(self) -> None:
        L = self.mailbox.L
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self.done < self.launched or self._stop)
                if self._stop:
                    return
                step = self.done
            try:
                if not self._read_step(step, L):
                    return  # closed while waiting
            except BaseException as e:  # surfaced on the model thread
                self.fail(e)
                return
            with self._cv:
                self._cut.pop(step, None)
                self._rows.pop(step, None)
                self.done += 1
                self._cv.notify_all()

    def _read_step(self, step: int, L: int) -> bool:
        """Feed `step`'s layers to the controller as they are posted, or drop the step after the
        layers it posted if it was cut short; False if the thread was stopped meanwhile."""
        give_up = lambda layer: lambda: self._stop or self._cut.get(step, L) <= layer  # noqa: E731
        with self._cv:
            rows, lanes = self._rows[step]
        for layer in range(L):
            got = self.mailbox.wait(step, layer, give_up(layer), rows)
            if got is None:
                if self._stop:
                    return False
                with self.lock:
                    self.controller.abandon_step(layer)
                return True
            with self.lock:
                self.controller.decode_layer(layer, *got, step=step, lanes=lanes)
        return True

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._on_stop()
        self._thread.join()
