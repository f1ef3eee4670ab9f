"""Models whose experts stream from the checkpoint on disk (`seqmoe.load`): exact, and failing loudly."""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import seqmoe  # noqa: E402
from seqmoe.base.errors import UserError  # noqa: E402
from tests.arch.collect.tiny_models import save_tiny_checkpoint  # noqa: E402

PROMPT = torch.tensor([[1, 17, 42, 5, 88, 23]])
LOGITS_INPUT = torch.tensor([[1, 61, 9, 33, 70, 12, 4]])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{arch: (folder, the model loaded whole from it, its greedy tokens, its logits)}."""
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in ("mixtral", "qwen3_moe", "deepseek_v3"):
        folder = tmp_path_factory.mktemp(arch)
        save_tiny_checkpoint(arch, folder, tokenizer=False)
        full = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            out[arch] = (folder, full, _greedy(full), full(LOGITS_INPUT, use_cache=False).logits)
    return out


def _greedy(model):
    return model.generate(PROMPT, max_new_tokens=8, do_sample=False, num_beams=1, pad_token_id=0)


def test_without_host_memory_the_host_cache_is_what_the_free_memory_holds(checkpoints, monkeypatch):
    """A checkpoint whose experts do not fit in the free host memory streams through a host cache of what
    fits (said in a warning) instead of failing to allocate them all; one that fits holds them all."""
    import seqmoe.runtime.disk.plan as plan
    from seqmoe.arch import model_arch

    folder, full, want, _ = checkpoints["mixtral"]
    arch = model_arch(full)
    n = len(arch.moe) * arch.num_experts
    net, rt = seqmoe.load(folder, residency=0.3)
    assert rt.stats()["host_rows"] == n
    rt.close()
    dense = sum(p.numel() * p.element_size() for name, p in full.named_parameters() if ".experts." not in name)
    pool = int(0.3 * n) * (_host_bytes(full, 1.0) // n)
    free = (dense + pool + _host_bytes(full, 0.5)) / (1 - plan.FIT_MARGIN)
    monkeypatch.setattr(plan, "host_available", lambda: int(free) + 1)
    with pytest.warns(UserWarning, match=f"a host cache of \\d+ of {n} experts"):
        net, rt = seqmoe.load(folder, residency=0.3)
    try:
        rows = rt.stats()["host_rows"]
        assert n // 3 < rows < n
        assert torch.equal(_greedy(net), want)
        assert rt.stats()["disk_reads"] > rows
    finally:
        rt.close()
    monkeypatch.setattr(plan, "host_available", lambda: dense)
    with pytest.raises(UserError, match="the free host memory"):
        seqmoe.load(folder, residency=0.3)


def _host_bytes(full, share: float) -> int:
    """Host memory for `share` of the routed experts of `full` (the model loaded whole)."""
    from seqmoe.arch import model_arch

    layers = model_arch(full).moe
    experts = layers[0].experts
    one = sum(p[0].numel() * p.element_size() for p in experts.parameters())
    return int(share * len(layers) * layers[0].num_experts) * one


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("system,miss", [("on-demand-lru", "copy"), ("seqmoe", "auto"), ("seqmoe", "cpu")])
def test_streamed_model_equals_the_model_loaded_whole(checkpoints, arch, system, miss):
    folder, full, tokens, logits = checkpoints[arch]
    host = _host_bytes(full, 0.3)
    model, rt = seqmoe.load(folder, residency=0.1, host_memory=host, system=system, miss=miss)
    try:
        assert rt.pool.cache.tier.rows < rt.pool.num_layers * rt.pool.num_experts
        assert torch.equal(_greedy(model), tokens)
        with torch.no_grad():
            got = model(LOGITS_INPUT, use_cache=False).logits
        assert (got - logits).abs().max().item() <= 1e-5
        stats = rt.stats()
        assert stats["disk_reads"] > stats["host_rows"]  # the cache was too small to hold everything read
        assert stats["host_expert_bytes"] <= host
    finally:
        rt.close()


def test_a_streamed_batch_equals_the_model_loaded_whole(checkpoints):
    folder, full, _, _ = checkpoints["deepseek_v3"]
    batch = torch.tensor([[0, 0, 1, 17, 42, 5], [1, 61, 9, 33, 70, 12]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()  # left padding
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=1, pad_token_id=0)
    want = full.generate(batch, **gen)
    model, rt = seqmoe.load(folder, residency=0.1, host_memory=_host_bytes(full, 0.3), system="seqmoe", miss="copy")
    try:
        assert torch.equal(model.generate(batch, **gen), want)
    finally:
        rt.close()


def test_host_memory_without_a_checkpoint_and_too_small_are_refused(checkpoints, monkeypatch):
    folder, full, _, _ = checkpoints["mixtral"]
    with pytest.raises(UserError, match="seqmoe.load"):
        seqmoe.offload(full, residency=0.3, host_memory="1GiB")
    import seqmoe.runtime.disk.skeleton as skeleton

    def no_read(*args):
        raise AssertionError("the dense part was read before the budgets were checked")

    monkeypatch.setattr(skeleton, "_materialise", no_read)
    with pytest.raises(UserError, match="host cache needs at least"):
        seqmoe.load(folder, residency=0.3, host_memory="1KiB")
    with pytest.raises(UserError, match="expert_memory"):
        seqmoe.load(folder, expert_memory="1KiB", host_memory="1MiB")
    monkeypatch.undo()
    with pytest.raises(UserError, match="for the low-bit twins"):  # they share the host memory
        seqmoe.load(folder, residency=0.3, host_memory=_host_bytes(full, 0.2), twin="int4")


def test_restore_is_refused_and_a_closed_runtime_says_so(checkpoints):
    folder = checkpoints["mixtral"][0]
    model, rt = seqmoe.load(folder, residency=0.2, host_memory="100KiB")
    with pytest.raises(UserError, match="restore"):
        rt.restore()
    rt.close()
    with pytest.raises(UserError, match="closed"):
        _greedy(model)


@pytest.mark.parametrize("damage", ["truncate", "rewrite", "delete"])
def test_a_checkpoint_changed_while_running_fails_loudly(tmp_path, damage):
    save_tiny_checkpoint("mixtral", tmp_path, tokenizer=False)
    model, rt = seqmoe.load(tmp_path, residency=0.1, host_memory="100KiB", system="on-demand-lru", miss="copy")
    try:
        _greedy(model)  # runs from the checkpoint as it was
        path = tmp_path / "model.safetensors"
        data = path.read_bytes()
        if damage == "truncate":
            path.write_bytes(data[: len(data) // 2])
        elif damage == "rewrite":
            os.remove(path)
            path.write_bytes(data)  # the same bytes in a new file: changed since loading all the same
        else:
            os.remove(path)
        t0 = time.monotonic()
        with pytest.raises(UserError, match=r"model\.safetensors.*expert|expert.*model\.safetensors"):
            for _ in range(4):  # the next read from disk fails; rows still cached may serve a few steps
                _greedy(model)
        assert time.monotonic() - t0 < 30  # not a reader waiting out its copy's 60 s after the worker died
    finally:
        rt.close()


def test_an_int4_store_streams_from_a_checkpoint_of_the_models_dtype(checkpoints):
    """Each row quantized as it is read: the cache holds int4 rows (more of them in the same bytes),
    and the tokens are the quantized full model's."""
    import copy

    folder, full, _, _ = checkpoints["qwen3_moe"]
    want = _greedy(seqmoe.quantize_experts(copy.deepcopy(full), "int4"))
    host = _host_bytes(full, 0.3)
    plain_model, plain = seqmoe.load(folder, residency=0.1, host_memory=host, system="on-demand-lru")
    plain.close()
    model, rt = seqmoe.load(folder, residency=0.1, host_memory=host, expert_dtype="int4", system="seqmoe", miss="auto")
    try:
        assert torch.equal(_greedy(model), want)
        stats = rt.stats()
        assert stats["expert_dtype"] == "int4" and stats["expert_bytes"] < plain.pool.expert_bytes / 3
        assert rt.pool.cache.tier.rows > 3 * plain.pool.cache.tier.rows  # the same budget holds more experts
        assert stats["host_expert_bytes"] <= host and stats["disk_reads"] > 0
        # the simulated reads are priced at what a read takes from the file: the checkpoint's dtype
        file_bytes = rt.pool.cache.files.expert_nbytes(0, 0)
        assert file_bytes == plain.pool.expert_bytes > stats["expert_bytes"]
        assert stats["sim_disk_bytes"] == stats["sim_disk_reads"] * file_bytes
        assert stats["sim_disk_read_s"] == pytest.approx(rt.hardware.disk_latency_s + file_bytes / rt.hardware.disk_bytes_per_s)
    finally:
        rt.close()


@pytest.mark.parametrize("where", [None, "router", "experts"])
def test_posted_steps_wait_for_rows_on_disk_and_a_cut_step_releases_them(checkpoints, where):
    """control='thread' with a disk tier: each posted step waits (device side) for the host-cache rows
    the control thread holds for it; DecodeGraph's static-cache steps too. A step cut short by Ctrl-C
    releases its rows; a step interrupted after its last post keeps only its last layer's rows (until
    the next decision). The next generate is exact."""
    from seqmoe.runtime import DecodeGraph
    from tests.runtime.test_interrupts import _interrupt_at

    folder, full, tokens, _ = checkpoints["mixtral"]
    model, rt = seqmoe.load(folder, residency=0.1, host_memory=_host_bytes(full, 0.3), control="thread",
                            miss="in-place", learn=False)
    try:
        if where is not None:
            undo = _interrupt_at(where, rt, model, n=5)
            with pytest.raises(KeyboardInterrupt):
                model.generate(PROMPT, max_new_tokens=20, do_sample=False, num_beams=1, pad_token_id=0)
            undo()
            rt.controller.thread.catch_up()
            held = len(rt.controller.relay._held)  # the last decision's rows: released at the next one
            assert rt.pool.cache.refs.sum() == held and held <= rt.pool.num_experts
            assert held == 0 or where == "experts"  # a cut step (fewer than L layers posted) holds none
        assert torch.equal(_greedy(model), tokens)
        assert torch.equal(DecodeGraph(rt, 32).generate(PROMPT, 8), tokens)
        stats = rt.stats()
        assert stats["host_reads"] > 0 and stats["disk_reads"] > stats["host_rows"]
        assert rt.controller.relay.fallbacks == 0
    finally:
        rt.close()


def test_twins_beside_a_disk_tier_compute_the_quantized_model(checkpoints, tmp_path, monkeypatch):
    """Twins read once from the checkpoint, in host memory beside the cache (its rows fewer by their
    bytes): every miss served by its twin computes what the int4-quantized model computes."""
    import copy

    # a cold forecaster: one another test of this model kept would prefetch experts, which compute at full precision
    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path))

    from tests.runtime.test_twins import EVERY_MISS, _stepwise

    folder, full, _, _ = checkpoints["qwen3_moe"]
    want = _stepwise(seqmoe.quantize_experts(copy.deepcopy(full), "int4"))
    host = _host_bytes(full, 0.6)
    plain = seqmoe.load(folder, residency=0.2, host_memory=host)[1]
    rows = plain.stats()["host_rows"]
    plain.close()
    model, rt = seqmoe.load(folder, residency=0.2, host_memory=host, miss="copy", twin="int4",
                            twin_budget=EVERY_MISS, learn=False)
    try:
        got = _stepwise(model)
        s = rt.stats()
    finally:
        rt.close()
    assert (got - want).abs().max().item() <= 1e-4
    assert s["misses_twin"] == s["misses"] > 0 and s["host_rows"] < rows
    assert s["host_expert_bytes"] + s["host_twin_bytes"] <= host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_batch_of_int4_experts_streamed_from_disk_on_cuda(checkpoints):
    """The combination issue 40 names: a disk tier, int4 experts, thread control, a captured step of
    4 left-padded rows; each row's tokens are the int4-quantized full model's (batched_mm: grouped_mm
    in fp32 cannot be captured)."""
    import copy

    from seqmoe.runtime import DecodeGraph
    from tests.runtime.test_matrix import GEN, MASK, PROMPTS

    folder, full, _, _ = checkpoints["mixtral"]
    ids = torch.cat([PROMPTS, PROMPTS[:1]]).cuda()
    mask = torch.cat([MASK, MASK[:1]]).cuda()
    ref = seqmoe.quantize_experts(copy.deepcopy(full), "int4").cuda()
    ref.config._experts_implementation = "batched_mm"
    want = ref.generate(ids, attention_mask=mask, **GEN)
    model, rt = seqmoe.load(folder, residency=0.3, host_memory=_host_bytes(full, 0.3), expert_dtype="int4",
                            control="thread", device="cuda", learn=False)
    model.config._experts_implementation = "batched_mm"
    try:
        dg = DecodeGraph(rt, 32)
        got = dg.generate(ids, GEN["max_new_tokens"], attention_mask=mask)
        assert dg.graph is not None and rt.controller.relay.fallbacks == 0
        assert rt.stats()["disk_reads"] > 0
    finally:
        rt.close()
    assert torch.equal(got, want)


def test_a_script_streaming_from_disk_exits_when_it_ends(tmp_path):
    """The finalizer closes the copy worker while its thread may wait for a free host row: it must leave
    that wait (it hung at interpreter exit)."""
    import subprocess
    import sys
    import textwrap

    for family in ("mixtral", "qwen3_moe", "deepseek_v3"):
        save_tiny_checkpoint(family, tmp_path / family, tokenizer=False)
    script = textwrap.dedent(f"""
        import torch, seqmoe
        for family in ("mixtral", "qwen3_moe", "deepseek_v3"):
            model, rt = seqmoe.load({str(tmp_path)!r} + "/" + family, residency=0.1, host_memory="100KiB")
            with torch.no_grad():
                model.generate(torch.tensor([[1, 17, 42, 5]]), max_new_tokens=8, do_sample=False)
        print("done")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]
