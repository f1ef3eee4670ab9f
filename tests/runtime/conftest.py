"""Shared pieces of the runtime tests: one thread, tiny models, a reference run of each, a cost model.

Each architecture's pristine model, its full-model greedy tokens and logits and a training trace
are made once per session (`reference(arch)`); tests offload deep copies of the model.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)

from seqmoe.arch.collect import collect_trace  # noqa: E402
from seqmoe.costs.profiles import HardwareProfile  # noqa: E402
from seqmoe.trace.schema import RoutingTrace  # noqa: E402
from tests.arch.collect.tiny_models import tiny_model  # noqa: E402

def run_cli(argv: list[str]) -> int:
    """Run a `seqmoe` command in-process; a UserError propagates (main() would print it and return 2)."""
    from seqmoe.cli import build_parser

    args = build_parser().parse_args(argv)
    return args.func(args)


PROMPT = [1, 17, 42, 5, 88, 23]
"""Greedy-generation prompt (batch 1)."""
LOGITS_INPUT = [1, 61, 9, 33, 70, 12, 4]
"""Input of the logits comparison (a separate forward, no cache)."""
NEW_TOKENS = 8
TRAIN_REQUESTS = [[1, 30, 31, 32, 50], [1, 7, 99, 64, 12, 3, 44], [1, 90, 2, 11]]

TEST_HW = HardwareProfile(name="test-hw", h2d_bytes_per_s=1e9, copy_overhead_s=1e-6, hbm_bytes_per_s=1e9,
                          device_memory_bytes=1 << 30)
"""A cost model under which the tiny models' copies and layers take comparable time (ready, late and
missed activations all occur)."""


@dataclass(frozen=True)
class Reference:
    model: torch.nn.Module
    tokens: torch.Tensor
    logits: torch.Tensor
    train: RoutingTrace


def greedy(model, prompt=PROMPT, new_tokens=NEW_TOKENS) -> torch.Tensor:
    return model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                          pad_token_id=0)


def logits(model, ids=LOGITS_INPUT) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits


@functools.lru_cache(maxsize=None)
def reference(arch: str) -> Reference:
    model = tiny_model(arch)
    train = collect_trace(model, TRAIN_REQUESTS, mode="decode", new_tokens=6)
    return Reference(model, greedy(model), logits(model), train)


def fresh(arch: str) -> torch.nn.Module:
    """A deep copy of the architecture's pristine model."""
    return copy.deepcopy(reference(arch).model)


def run_interpreted(module: str) -> None:
    """`python -m module` under TRITON_INTERPRET=1 (the CUDA kernels run on the CPU), which must
    print "ok"; skipped without a triton the kernels can be built with."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from seqmoe.runtime.kernels import relay as relay_kernels

    if not relay_kernels.available():
        pytest.skip("no triton with tl.atomic_load")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo),
                                                                                   os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", module], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]
