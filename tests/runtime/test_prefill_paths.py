"""A prompt's missing experts split between the link and the host CPU by the rows each serves
(`eager.experts._prompt_host`, `seqmoe.costs.host_cost.PromptCosts`): few-row experts go to the host,
many-row ones over the link, decided once per layer per prompt forward; greedy tokens equal full
load's; miss copy and decode steps are unchanged.
Run: pytest tests/runtime/test_prefill_paths.py -q
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from seqmoe.costs.host_cost import PromptCosts, prompt_costs
from seqmoe.costs.profiles import ModelProfile
from seqmoe.arch import model_arch
from seqmoe.runtime import offload
from seqmoe.runtime.offload import measure_profile
from tests.runtime.conftest import fresh, greedy, reference
from tests.runtime.test_host_path import HOST_HW

LONG = [1] + [(7 * i + 3) % 97 + 2 for i in range(47)]
"""A 48-token prompt: an expert serves from one row to dozens."""


def _hw(model) -> object:
    """HOST_HW with a host FLOP rate under which a copy costs what the host spends on about four
    rows of one expert: the split then sends some experts each way."""
    arch = model_arch(model)
    mp = measure_profile(model, arch, arch.layout(arch.moe[0].experts))
    link_s = prompt_costs(mp, HOST_HW).link_s
    return dataclasses.replace(HOST_HW, host_flops_per_s=4 * 2.0 * mp.expert_params / link_s)


class _Recording:
    """`PromptCosts` that keeps the rows of every split it made: (sorted missing rows, j)."""

    def __init__(self, costs: PromptCosts) -> None:
        self.costs, self.splits = costs, []
        self.link_s = costs.link_s

    def host_s(self, rows):
        return self.costs.host_s(rows)

    def on_host(self, rows):
        j = self.costs.on_host(rows)
        self.splits.append((np.asarray(rows).copy(), j))
        return j


def _missing(rt, model) -> int:
    """Run the prompt `LONG` once; the (layer, expert) pairs it routed that had no slot at its start."""
    table = rt.pool.table_host.copy()  # [L, E]: nothing moves during a prompt's forward (no queued copy here)
    with torch.no_grad():
        model(torch.tensor([LONG]))
    ids = rt.trace().expert_ids[-len(LONG):]  # [P, L, K] (the trace settles the replay)
    return sum(int((table[l][np.unique(ids[:, l])] < 0).sum()) for l in range(ids.shape[1]))


def _counts(model):
    return [m.mlp.experts.counts for m in model.model.layers]


def test_few_row_experts_go_to_the_host_many_row_ones_over_the_link():
    ref = reference("olmoe")
    want = greedy(ref.model, LONG)
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, hardware=_hw(ref.model), miss="auto")
    try:
        rec = rt.host.prompt = _Recording(rt.host.prompt)
        before, reads = rt.host.experts, rt.pool.host_reads
        missing = _missing(rt, model)
        counts = _counts(model)
        L = len(counts)
        assert [c.prompt_calls for c in counts] == [1] * L  # one choice per layer per prompt forward
        host, link = sum(c.prompt_host for c in counts), sum(c.prompt_link for c in counts)
        assert host > 0 and link > 0, (host, link)
        assert host + link == missing
        assert rt.host.experts - before == host  # what was chosen for the host ran there, each expert once
        assert rt.pool.host_reads - reads == link  # each link expert read once for all its rows
        assert len(rec.splits) == L and sum(len(r) for r, _ in rec.splits) == host + link
        for rows, j in rec.splits:
            assert (np.diff(rows) >= 0).all()  # fewest rows first: the host takes a prefix
            if 0 < j < len(rows):
                assert rows[j - 1] <= rows[j]
        assert any(0 < j < len(r) and r[j - 1] < r[-1] for r, j in rec.splits)  # a layer split by rows
        rt.synchronize()
        got = greedy(model, LONG)
        assert [c.prompt_calls for c in counts] == [2] * L  # generate's prompt; its decode steps add none
        assert torch.equal(got, want)
    finally:
        rt.restore()


@pytest.mark.parametrize("miss", ["copy", "cpu"])
def test_copy_keeps_reading_and_cpu_computes_every_miss_on_the_host(miss):
    ref = reference("olmoe")
    want = greedy(ref.model, LONG)
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, hardware=_hw(ref.model), miss=miss)
    try:
        reads = rt.pool.host_reads
        missing = _missing(rt, model)
        counts = _counts(model)
        if miss == "copy":  # every missing expert read over the link once for all its rows, never per position
            assert rt.host is None and all(c.prompt_calls == 0 for c in counts)
            assert rt.pool.host_reads - reads == missing > 0
        else:
            assert all(c.prompt_calls == 1 and c.prompt_link == 0 for c in counts)
            assert sum(c.prompt_host for c in counts) == missing > 0 and rt.pool.host_reads == reads
        rt.synchronize()
        assert torch.equal(greedy(model, LONG), want)
    finally:
        rt.restore()


def test_the_split_weighs_rows_against_one_transfer():
    costs = PromptCosts(link_s=10.0, alpha_s=1.0, read_s=2.0, row_s=1.0)
    assert costs.on_host(np.array([8])) == 1 and costs.on_host(np.array([9])) == 0  # h = 9 < 10; h = 10: the link
    assert costs.on_host(np.array([1] * 12)) == 9  # both lanes busy: 3 transfers (30) beside 9 host experts of 3
    mp = ModelProfile(name="m", num_layers=1, num_experts=8, top_k=2, expert_bytes=2000, expert_params=1000)
    c = prompt_costs(mp, HOST_HW)
    assert c.host_s(np.array([1]))[0] < c.host_s(np.array([10**6]))[0]  # the host's time grows with the rows
    assert prompt_costs(mp, dataclasses.replace(HOST_HW, host_memory_bytes_per_s=None, host_cores=None)) is None
