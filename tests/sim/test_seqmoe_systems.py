"""The seqmoe systems (and ablations) on a tiny trained forecaster: invariants, CLI, errors.

Run: pytest tests/sim/test_seqmoe_systems.py -q
"""

from __future__ import annotations

import json

import pytest

from seqmoe.cli import main
from seqmoe.base.errors import UserError
from seqmoe.brain.predict.checkpoints import load_seq_predictor
from seqmoe.brain.manager.systems import SYSTEMS
from tests.sim.test_replay import replay

pytest.importorskip("torch")
SEQ = [n for n, spec in SYSTEMS.items() if spec.needs_predictor and not spec.needs_pregate] + ["seqmoe-markov-forecast"]


@pytest.fixture(scope="module")
def tiny(tiny_forecaster):
    return tiny_forecaster


def test_seqmoe_systems_keep_the_invariants(tiny):
    d, train, test = tiny
    pred = load_seq_predictor(d / "pred")
    for name in SEQ:
        for r in (0.3, 0.6):
            c, m = replay(name, train, test, r, predictor=pred)
            assert m["ready_rate"] + m["late_rate"] + m["miss_rate"] == pytest.approx(1.0)
            assert 0 < m["bound_fraction"] <= 1 + 1e-12 and m["full_load_fraction"] <= 1 + 1e-12
            assert c.copies >= c.misses


def test_needs_a_predictor(tiny):
    _, train, test = tiny
    with pytest.raises(UserError, match="--predictor"):
        replay("seqmoe", train, test, 0.5)


def test_cli_sim_with_predictor(tiny, capsys):
    d, _, _ = tiny
    args = ["sim", "--trace", str(d / "test.safetensors"), "--train", str(d / "train.safetensors"),
            "--model-profile", str(d / "m.json"), "--system", "seqmoe", "--predictor", str(d / "pred"), "--json"]
    (d / "m.json").write_text(json.dumps({"name": "tiny", "num_layers": 3, "num_experts": 8, "top_k": 2,
                                          "expert_bytes": 10**6, "layer_bytes": 10**6}))
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["system"] == "seqmoe" and row["config"]["predictor"] == str(d / "pred")
