"""The real-size harness at reduced width on the CPU: published shapes, routers forced to a trace,
the full model against offloaded systems (oracles included) on the same routing.

Run: pytest tests/runtime/timing/test_replay.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from seqmoe.base.errors import UserError
from seqmoe.runtime import offload
from seqmoe.arch.published import build_model
from seqmoe.runtime.timing.forced import ForcedRouting, layers_of
from seqmoe.runtime.timing.replay import replay_bench
from seqmoe.trace.schema import RoutingTrace, TraceMeta

DIVISOR = 32  # hidden 64: the same 26 MoE layers x 64 experts, top-6, at a CPU's pace


def _trace(lengths, L=26, E=64, K=6, seed=0, vocab=50) -> RoutingTrace:
    """Routing of requests of `lengths` tokens with a few popular experts per layer (so caching matters)."""
    rng = np.random.default_rng(seed)
    T = sum(lengths)
    popular = rng.random((L, E)) ** 4
    ids = np.stack([np.stack([rng.choice(E, K, replace=False, p=popular[l] / popular[l].sum()) for l in range(L)])
                    for _ in range(T)]).astype(np.int16)
    return RoutingTrace(expert_ids=ids, request_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                        meta=TraceMeta(model="synthetic", num_experts=E, source="test"),
                        token_ids=rng.integers(0, vocab, T).astype(np.int32))


@pytest.mark.parametrize("arch, params, expert_mb", [("deepseek-v2-lite", 15.71e9, 17.3), ("mixtral-8x7b", 46.70e9, 352.3)])
def test_the_real_shapes_have_the_published_sizes(arch, params, expert_mb):
    model = build_model(arch, device="meta", dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - params) / params < 0.003
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    assert sum(p.numel() for p in experts.parameters()) * 2 / experts.num_experts / 1e6 == pytest.approx(expert_mb, rel=0.01)


def test_routers_return_the_forced_routing_and_tokens():
    replay = _trace([5, 4])
    model = build_model("deepseek-v2-lite", width_divisor=DIVISOR, vocab_size=50)
    forced = ForcedRouting(model, replay)
    seen, inputs = [], []
    routers = [m.mlp.gate for m in model.model.layers if hasattr(m.mlp, "gate")]
    handles = [r.register_forward_hook(lambda mod, a, out: seen.append(out[2].clone())) for r in routers]
    handles.append(model.register_forward_pre_hook(lambda mod, a, kw: inputs.append(kw["input_ids"]), with_kwargs=True))
    forced.start(5)  # the second request, as one prompt forward of its 4 tokens
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 4), dtype=torch.long), cache_position=torch.arange(4), use_cache=False)
    got = torch.stack(seen, 1).numpy()  # [4, L, K]
    assert np.array_equal(got, replay.expert_ids[5:9]) and inputs[-1].tolist() == [replay.token_ids[5:9].tolist()]
    forced.remove()
    for h in handles:
        h.remove()


def test_oracles_run_live_only_on_a_replay():
    model = build_model("deepseek-v2-lite", width_divisor=DIVISOR, vocab_size=50)
    with pytest.raises(UserError, match="reads the future"):
        offload(model, 0.5, "belady")
    rt = offload(model, 0.5, "belady", train=_trace([6], seed=3), replay=_trace([3, 3]))
    rt.restore()


def test_the_cpu_harness_replays_exactly_and_belady_copies_least():
    replay, train = _trace([4, 8, 8], seed=1), _trace([30, 30], seed=2)
    model = build_model("deepseek-v2-lite", width_divisor=DIVISOR, vocab_size=50)
    result = replay_bench(model, replay, train=train, systems=("on-demand-lru", "belady"), residencies=(0.25,))
    lru, belady = result["runs"]
    assert result["timed_tokens"] == 16 and result["link"]["emulated"]
    assert lru["exact"] and belady["exact"]
    assert belady["sim_copies"] <= lru["sim_copies"] and belady["hit_rate"] >= lru["hit_rate"]
    assert all(r["sim_ms_per_token"] > 0 and r["ms_per_token"] > 0 for r in result["runs"])


def test_the_cpu_harness_runs_the_host_paths_exactly():
    replay, train = _trace([4, 8, 8], seed=1), _trace([30, 30], seed=2)
    model = build_model("deepseek-v2-lite", width_divisor=DIVISOR, vocab_size=50)
    result = replay_bench(model, replay, train=train, systems=("on-demand-lru", "cpu-all"), residencies=(0.25,),
                          miss="auto")
    auto, cpu_all = result["runs"]
    assert auto["exact"] and cpu_all["exact"] and result["link"]["host_expert_s"] > 0
    assert (auto["miss"], cpu_all["miss"]) == ("auto", "cpu") and cpu_all["misses_cpu"] > 0 == cpu_all["copies"]


def test_a_mixtral_cut_to_its_first_layers_runs_on_the_cut_trace():
    replay = layers_of(_trace([3, 3], L=32, E=8, K=2), 2)
    model = build_model("mixtral-8x7b", width_divisor=64, num_layers=2, vocab_size=50)
    result = replay_bench(model, replay, systems=("on-demand-lru",), residencies=(0.5,))
    assert result["layers"] == 2 and result["runs"][0]["exact"]


def test_the_profile_of_a_full_model_leaves_its_routed_experts_out():
    from seqmoe.arch import model_arch
    from seqmoe.runtime.offload import measure_profile

    model = build_model("deepseek-v2-lite", width_divisor=DIVISOR, vocab_size=50)
    arch = model_arch(model)
    before = measure_profile(model, arch, arch.layout(arch.moe[0].experts))
    rt = offload(model, 0.5, "on-demand-lru")
    assert rt.model_profile == before  # measured again once the routed experts are stripped
    rt.restore()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_link_measures_as_a_pcie_link():
    from seqmoe.runtime.timing.replay import measure_link

    link = measure_link(17_301_504, torch.device("cuda"))  # one DeepSeek-V2-Lite expert, bf16
    assert 1e9 < link["h2d_bytes_per_s"] < 1e11 and 0 <= link["copy_overhead_s"] < 1e-3
    assert link["in_place_read_s"] > 0


def test_a_trace_of_another_shape_is_refused():
    model = build_model("deepseek-v2-lite", width_divisor=DIVISOR, vocab_size=50)
    with pytest.raises(UserError, match="forced trace has L=26, E=8"):
        ForcedRouting(model, _trace([3], E=8, K=2))
