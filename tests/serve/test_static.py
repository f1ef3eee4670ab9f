"""`StaticBatch`: requests joining and leaving one static cache decode what each decodes alone, through
the moves a small cache forces (a long prompt shifting the rows right, the end of the cache shifting
them left, leavers compacting them), on a plain and an offloaded model.
Run: pytest tests/serve/test_static.py -q
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from seqmoe.runtime import offload  # noqa: E402
from seqmoe.serve.kv import BatchKV  # noqa: E402
from seqmoe.serve import static  # noqa: E402
from seqmoe.serve.static import StaticBatch  # noqa: E402
from tests.arch.collect.tiny_models import tiny_model  # noqa: E402

# (step at which it joins, prompt, new tokens): the third prompt is longer than the shared position
# when it joins; a cache of 24 positions runs out while the second still decodes
REQUESTS = [(0, [1, 17, 42, 5, 88, 23], 9), (2, [1, 9, 3], 12), (4, [1, 61, 9, 33, 70, 12, 4, 8, 2, 7, 5, 44], 8),
            (11, [1, 50], 10)]


def _alone(model, prompt, n):
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = model.generate(ids, max_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _served(model, runtime=None, rows=3, length=24, layout="eager", graphs=None):
    """(each request's tokens decoded in one StaticBatch, joining at its step and leaving when done,
    the moves of its positions, the capacities it held). `layout`: eager, captured (its steps run
    eagerly) or cuda (captured and replayed; `graphs` receives them)."""
    from transformers import DynamicCache

    batch = StaticBatch(model, rows, length, "cache", runtime, capture=layout == "cuda")
    batch.capture = layout != "eager"
    if layout == "captured":  # the captured layout, its steps run eagerly
        batch._capture = lambda b, view: batch.graphs.__setitem__(b, None)
        batch._replay = lambda b: batch._run(b, batch._view(b)) or batch.logits[:b, None]
    live, got, step, shifts, caps = [], {}, 0, 0, set()
    pending = list(enumerate(REQUESTS))
    while pending or live:
        while pending and pending[0][1][0] <= step and len(live) < rows:
            i, (_, prompt, n) = pending.pop(0)
            cache = DynamicCache(config=model.config)
            logits = model(torch.tensor([prompt], device=batch.device), cache=cache, use_cache=True).logits
            got[i] = [int(logits[0, -1].argmax())]
            before = batch.pos
            batch = batch.join(BatchKV.alone(cache, len(prompt)))
            shifts += batch.pos != before and bool(live)
            live.append(i)
        if live:
            before = batch.pos
            ids = torch.tensor([[got[i][-1]] for i in live], device=batch.device)
            logits = batch.step(lambda run=None, cache=None, **kw: run() if run is not None else model(
                **kw, cache=cache, use_cache=True).logits, ids)
            shifts += batch.pos != before + 1
            caps.add(batch.cap)
            for row, i in enumerate(live):
                got[i].append(int(logits[row, -1].argmax()))
            done = [row for row, i in enumerate(live) if len(got[i]) >= REQUESTS[i][2]]
            if done:
                keep = [row for row in range(len(live)) if row not in done]
                before = batch.pos
                batch = batch.keep_rows(keep)
                shifts += batch.pos != before and bool(keep)
                live = [live[row] for row in keep]
        step += 1
    if graphs is not None:
        graphs.update(batch.graphs)
    return [got[i][:REQUESTS[i][2]] for i in range(len(REQUESTS))], shifts, caps


@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_requests_joining_and_leaving_a_static_cache_decode_what_they_decode_alone(arch, capture, monkeypatch):
    """Run eagerly the cache grows and shrinks by 4 positions; a captured step's holds all 24 (its
    steps run eagerly here: `_capture` needs CUDA, so the layout is tested without it)."""
    monkeypatch.setattr(static, "ROOM_STEP", 4)
    model = tiny_model(arch).eval()
    want = [_alone(model, p, n) for _, p, n in REQUESTS]
    with torch.no_grad():
        got, shifts, caps = _served(model, layout="captured" if capture else "eager")
    assert got == want
    assert shifts >= 2  # right for the long prompt, left at the end or after leavers
    assert caps == {24} if capture else len(caps) >= 3 and max(caps) <= 24


def test_an_offloaded_model_on_a_static_cache_is_exact():
    model = tiny_model("qwen3_moe").eval()
    want = [_alone(model, p, n) for _, p, n in REQUESTS]
    rt = offload(model, 0.3, "on-demand-lru", miss="auto")
    try:
        with torch.no_grad():
            got, _, _ = _served(model, rt)
        stats = rt.stats()
    finally:
        rt.restore()
    assert got == want and stats["misses"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offloaded", [False, True])
def test_captured_steps_join_and_leave_on_cuda(offloaded):
    """On CUDA each row count's step is captured once and replayed (posting through the runtime when
    offloaded), and every request decodes what it decodes alone (batched_mm: grouped_mm in fp32
    cannot be captured)."""
    model = tiny_model("mixtral").eval().to("cuda")
    model.config._experts_implementation = "batched_mm"
    want = [_alone(model, p, n) for _, p, n in REQUESTS]
    rt = offload(model, 0.3, "on-demand-lru", device="cuda", control="thread") if offloaded else None
    try:
        batch_graphs = {}
        with torch.no_grad():
            got, _, caps = _served(model, rt, layout="cuda", graphs=batch_graphs)
    finally:
        if rt is not None:
            rt.restore()
    assert got == want and caps == {24} and set(batch_graphs) >= {1, 2, 3}
