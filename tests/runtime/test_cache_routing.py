"""Cache-aware routing: the substitution rule, its budget, and the runtime exact when it is off.

Run: pytest tests/runtime/test_cache_routing.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from seqmoe.base.errors import UserError
from seqmoe.runtime import offload
from seqmoe.brain.rerouting import CacheAwareRouting, check_routing
from tests.runtime.conftest import fresh, logits, reference, run_interpreted

E = 6


def _router(logit_row, k=2, normalise=True):
    """(logits [1, E], weights [1, k], ids [1, k]) of a softmax top-k router."""
    lg = torch.tensor([logit_row], dtype=torch.float32)
    p = torch.softmax(lg.double(), -1)
    w, ids = p.topk(k, dim=-1)
    if normalise:
        w = w / w.sum(-1, keepdim=True)
    return lg, w.float(), ids


def _rule(max_kl, missing, resident):
    return CacheAwareRouting(max_kl, missing=lambda layer: np.array(missing), resident=lambda layer: np.array(resident))


def test_a_missing_expert_goes_to_the_most_likely_resident_one_and_the_weights_follow_the_router():
    lg, w, ids = _router([3.0, 2.0, 1.9, 0.5, 1.0, -1.0])  # top-2: experts 0, 1
    rule = _rule(10.0, [False, True, False, False, False, False], [True, False, True, True, True, True])
    new_w, new_ids = rule(0, lg, w, ids)
    assert new_ids.tolist() == [[0, 2]]  # 1 missing -> 2, the best resident expert not routed already
    p = torch.softmax(lg.double(), -1)[0]
    assert torch.allclose(new_w[0].double(), p[[0, 2]] / p[[0, 2]].sum(), atol=1e-6)
    kl = (p[1] - p[2]) * torch.log(p[1] / p[2])
    assert rule.stats()["mean_kl"] == pytest.approx(float(kl), rel=1e-9) and rule.substitutions == 1


def test_unnormalised_weights_stay_the_probabilities():
    lg, w, ids = _router([3.0, 2.0, 1.9, 0.5, 1.0, -1.0], normalise=False)
    new_w, new_ids = _rule(10.0, [False, True] + [False] * 4, [True, False] + [True] * 4)(0, lg, w, ids)
    p = torch.softmax(lg.double(), -1)[0]
    assert torch.allclose(new_w[0].double(), p[[0, 2]], atol=1e-6)


def test_the_budget_is_per_token_and_spent_cheapest_first():
    lg, w, ids = _router([3.0, 2.0, 1.9, 0.5, 1.0, -1.0])
    p = torch.softmax(lg.double(), -1)[0]
    kl = float((p[1] - p[2]) * torch.log(p[1] / p[2]))
    rule = _rule(1.5 * kl, [False, True] + [False] * 4, [True, False] + [True] * 4)
    assert rule(0, lg, w, ids)[1].tolist() == [[0, 2]]
    assert rule(1, lg, w, ids)[1].tolist() == [[0, 1]]  # the same token's second layer: the budget is spent
    assert rule(0, lg, w, ids)[1].tolist() == [[0, 2]]  # a new token (its first MoE layer): a new budget


def test_nothing_changes_without_budget_or_without_a_resident_alternative():
    lg, w, ids = _router([3.0, 2.0, 1.9, 0.5, 1.0, -1.0])
    assert _rule(0.0, [True] * E, [False, False] + [True] * 4)(0, lg, w, ids)[1].tolist() == [[0, 1]]
    assert _rule(9.0, [True] * E, [False] * E)(0, lg, w, ids)[1].tolist() == [[0, 1]]


def test_a_router_whose_weights_are_not_its_softmax_is_refused():
    lg, _, ids = _router([3.0, 2.0, 1.9, 0.5, 1.0, -1.0])
    with pytest.raises(UserError, match="softmax"):
        _rule(9.0, [False, True] + [False] * 4, [True] * E)(0, lg, torch.tensor([[0.9, 0.3]]), ids)


@pytest.mark.parametrize("routing, max_kl, match", [("fast", None, "unknown routing"), ("exact", 0.1, "exact routing has none"),
                                                    ("cache-aware", None, "needs its budget"), ("cache-aware", -1.0, "needs its budget")])
def test_bad_settings_say_what_is_wrong(routing, max_kl, match):
    with pytest.raises(UserError, match=match):
        check_routing(routing, max_kl)


def test_the_device_rule_equals_the_host_rule_under_the_triton_interpreter():
    """The kernel posted CUDA steps substitute with (`kernels.rerouting`), run on the CPU, position by
    position against `CacheAwareRouting` (`routing_interp_check`)."""
    run_interpreted("tests.runtime.routing_interp_check")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_cuda_steps_substitute_on_the_device():
    """With a budget the captured step's routing changes (counted on the device); without one it is exact."""
    from seqmoe.runtime import DecodeGraph
    from seqmoe.runtime.kernels import relay as relay_kernels
    from tests.runtime.conftest import PROMPT, TEST_HW

    if not relay_kernels.available():
        pytest.skip("no triton with tl.atomic_load")
    ids = torch.tensor([PROMPT], device="cuda")
    want = fresh("olmoe").cuda().generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    for max_kl in (0.0, 5.0):
        model = fresh("olmoe")
        rt = offload(model, 0.3, "on-demand-lru", train=reference("olmoe").train, device="cuda", control="thread",
                     routing="cache-aware", max_kl=max_kl, hardware=TEST_HW)
        try:
            dg = DecodeGraph(rt, 64)
            got = dg.generate(ids, 16)
            s = rt.stats()
            assert dg.graph is not None and s["refused"] == 0 and s["tokens"] == len(PROMPT) + 15
        finally:
            rt.restore()
        if max_kl == 0.0:
            assert torch.equal(got, want) and s["substitutions"] == 0
        else:
            assert s["substitutions"] > 0 and s["mean_kl"] <= max_kl


def test_posted_decode_steps_substitute_and_the_simulator_counts_the_same():
    posted_steps_replay(on_device=False)


def posted_steps_replay(on_device: bool) -> None:
    """control="thread" on the CPU: the router hooks of posted steps apply the rule before posting
    (`on_device`: the kernel of `kernels.rerouting`, as on CUDA), so the trace holds the routing the
    model ran, and replaying it gives the runtime's counts."""
    from seqmoe.brain.manager.systems import SystemInputs, build_system
    from seqmoe.runtime.kernels.rerouting import DeviceCacheRouting
    from seqmoe.sim import simulate
    from tests.runtime.conftest import TEST_HW, greedy

    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, control="thread", routing="cache-aware", max_kl=5.0,
                 hardware=TEST_HW)
    rule, posted = rt.controller.routing, []
    substitute = rule.substitute
    if on_device:
        rule.posted = DeviceCacheRouting(5.0, rt.pool, rt.controller.K)

    def counted(*args):  # substitutions the host rule made inside posting decode steps
        before = rule.substitutions
        out = substitute(*args)
        if rt.controller.posting:
            posted.append(rule.substitutions - before)
        return out

    rule.substitute = counted
    try:
        greedy(model, new_tokens=12)
        s, trace = rt.stats(), rt.trace()
    finally:
        rt.restore()
    on_posted = rule.posted.counts()["substitutions"] if on_device else sum(posted)
    assert s["control"] == "thread" and on_posted > 0 and (not on_device or sum(posted) == 0)
    assert s["substitutions"] == rule.substitutions + (on_posted if on_device else 0)
    system = build_system("on-demand-lru", SystemInputs(train=ref.train, test=trace, capacity=rt.capacity,
                                                        start=tuple(rt.start)), rt.miss)
    c = simulate(trace, system, model=rt.model_profile, hardware=rt.hardware, capacity=rt.capacity, start=rt.start)
    assert (s["ready"], s["late"], s["misses"]) == (c.ready, c.late, c.misses)


def test_zero_budget_is_exact_and_a_budget_saves_misses():
    ref = reference("olmoe")
    model = fresh("olmoe")
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, routing="cache-aware", max_kl=0.0)
    assert torch.equal(logits(model), ref.logits)
    exact = rt.stats()
    rt.restore()
    rt = offload(model, 0.3, "on-demand-lru", train=ref.train, routing="cache-aware", max_kl=5.0)
    logits(model)
    loose = rt.stats()
    rt.restore()
    assert exact["substitutions"] == 0 and loose["substitutions"] > 0 and loose["misses"] < exact["misses"]
