"""The runtime's online learner: `ProcessLearner` (in the serving process) and the child process it
starts (`main`), talking over the child's stdin and stdout (`write_message`, `read_message`).

    learner = ProcessLearner(config, save_to=folder)    # the learner of `seqmoe.brain.predict.online.OnlineForecaster`
    python -m seqmoe.brain.predict.learner                     # the child; not for users

The child reads its setup, then one snapshot per message, trains a round on each (saving the
checkpoint when asked) and writes (weights, prior) back, until a None or the end of stdin. An
error is written back as a string, and the child ends.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import warnings

from seqmoe.brain.predict.checkpoints import save_checkpoint
from seqmoe.brain.predict.online import learn_round
from seqmoe.brain.predict.seqmodel import SeqConfig


class ProcessLearner:
    """Trains snapshots in a child process (`python -m seqmoe.brain.predict.learner`: its own interpreter,
    lowest CPU priority, one torch thread), started at the first snapshot (a short run starts none),
    and saves each round's checkpoint to `save_to` when given.

    Args:
        config: the forecaster's architecture.
        weights: the starting weights (a cached forecaster's), else fresh.
        save_to: a folder the child writes each round's checkpoint to, atomically.
        seed: the trainer's seed.
    """

    def __init__(self, config: SeqConfig, *, weights: dict | None = None, save_to=None, seed: int = 0) -> None:
        self._setup = (config.to_dict(), weights, None if save_to is None else str(save_to), seed)
        self._proc: subprocess.Popen | None = None
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._busy = False
        self._held = None  # a result `wait` took off the queue
        self.failed: str | None = None

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "seqmoe.brain.predict.learner"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        threading.Thread(target=self._read, args=(self._proc.stdout,), name="seqmoe-learner-reader", daemon=True).start()
        # A pipe holds 64 KiB: writing a snapshot blocks until the child reads it, so a thread of its
        # own writes, never the decode step.
        self._writer = threading.Thread(target=self._write, args=(self._proc.stdin,), name="seqmoe-learner-writer",
                                        daemon=True)
        self._writer.start()
        self._outbox.put(self._setup)

    def _write(self, pipe) -> None:
        while True:
            msg = self._outbox.get()
            try:
                write_message(pipe, msg)
                if msg is None:
                    pipe.close()
            except (OSError, ValueError):
                self._results.put("the learner process stopped")
                return
            if msg is None:
                return

    def _read(self, pipe) -> None:
        while True:
            try:
                msg = read_message(pipe)
            except (EOFError, OSError, ValueError, pickle.UnpicklingError):
                msg = "the learner process stopped"
            self._results.put(msg)
            if isinstance(msg, str):
                return

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            warnings.warn(f"seqmoe: online learning stopped: {why}", stacklevel=3)

    def submit(self, snapshot: tuple, tokens_learned: int) -> None:
        if self.failed is None:
            if self._proc is None:
                self._start()
            self._outbox.put((snapshot, tokens_learned))
            self._busy = True

    def wait(self, timeout: float) -> bool:
        """Block until the round in flight is done (harnesses that need a swap at a known point);
        whether it is."""
        if self._busy and self._held is None:
            try:
                self._held = self._results.get(timeout=timeout)
            except queue.Empty:
                return False
        return self._held is not None

    def result(self) -> tuple | None:
        """The finished round's (weights, prior), or None (not done yet; never blocks)."""
        if not self._busy:
            return None
        got, self._held = self._held, None
        if got is None:
            try:
                got = self._results.get_nowait()
            except queue.Empty:
                return None
        self._busy = False
        if isinstance(got, str):  # the child's error: learning stops, the run goes on
            self._fail(got)
            return None
        return got

    @property
    def keeps(self) -> bool:
        """Each round is saved (to `save_to`) for the model's next run."""
        return self._setup[2] is not None

    def close(self, timeout: float = 20.0) -> bool:
        """Let the round in flight finish (and be saved) for up to `timeout` seconds, then stop the child;
        whether the child ended on its own (every round it took was saved)."""
        proc, self._proc = self._proc, None
        failed, self.failed = self.failed, self.failed or "closed"  # nothing is submitted or started after this
        if proc is None:
            return False
        self._outbox.put(None)  # after the round in flight: the child saves it, then stops
        try:
            proc.wait(timeout=timeout if self._busy else 5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return failed is None and proc.returncode == 0


def write_message(f, msg) -> None:
    """One pickled message, length first (the learner's pipe protocol)."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("<Q", len(data)))
    f.write(data)
    f.flush()


def read_message(f):
    """The next message `write_message` wrote; EOFError at the end of the pipe."""
    head = f.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)



def main() -> int:
    try:
        os.nice(19)  # below the decode step, the host expert path and the control plane
    except OSError:
        pass
    import torch  # torch: only when this runs

    from seqmoe.brain.predict.train import OnlineTrainer

    torch.set_num_threads(1)  # one thread, at the lowest priority: torch would take every core beside the model
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        config, weights, save_to, seed = read_message(inp)
        cfg = SeqConfig.from_dict(config)
        trainer = OnlineTrainer(cfg, seed=seed, weights=weights)
        while True:
            msg = read_message(inp)
            if msg is None:
                return 0
            snapshot, tokens_learned = msg
            got = learn_round(trainer, snapshot)
            if save_to is not None:
                save_checkpoint(save_to, cfg, got[0], {"online": {"tokens_learned": tokens_learned,
                                                                  "use_rate": got[1][0].tolist()}})
            write_message(out, got)
    except EOFError:
        return 0
    except Exception as e:  # noqa: BLE001  reported to the parent, which stops learning
        write_message(out, f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
