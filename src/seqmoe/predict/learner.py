"""The online learner's child process (`seqmoe.predict.online.ProcessLearner`): reads its setup, then
one snapshot per message on stdin, trains a round on each (saving the checkpoint when asked) and
writes (weights, prior) back on stdout, until a None or the end of stdin. An error is written back
as a string, and the process ends.

    python -m seqmoe.predict.learner     # started by ProcessLearner; not for users
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    try:
        os.nice(19)  # below the decode step, the host expert path and the control plane
    except OSError:
        pass
    from seqmoe.predict.online import learn_round, read_message, write_message
    from seqmoe.predict.seqmodel import SeqConfig, save_checkpoint
    from seqmoe.predict.train import OnlineTrainer

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
