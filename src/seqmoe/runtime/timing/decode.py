"""`seqmoe bench-runtime`: greedy decode speed of the offloading runtime against the full model, on the CPU.

    result = bench_runtime(model, tokenizer, residencies=(0.25, 0.45, 0.65))
    print(format_table(result))

Each run decodes every prompt greedily for `new_tokens` tokens with a manual loop (one prompt
forward, then one forward per token, EOS ignored) and times the decode forwards only; tokens/s is
decode tokens over decode seconds, from the fastest of `repeats` passes over the prompts. The
full-load run is the plain model; each offloaded run offloads the same model instance, checks
that it generates the full model's tokens (with quantized experts: those of the full model with
the same quantized weights, `quantize_experts`), and restores it. The full model is timed again right
before each offloaded run and `vs_full` divides by that (other load on the machine drifts). Host overhead is the time the model
thread spends in the runtime's hooks, control plane and experts wrapper (`OffloadRuntime.host_s`)
per decode token; the gathers of routed rows (data plane, `gather_s`) are reported apart.

The link (the pool's emulated host->device link: copies and in-place reads of missed rows cost
link time, a miss waits for its copy; and the cost model's bandwidth) is scaled to the model: one expert copy takes `link_ratio` times one layer's routed-expert compute as measured
on the full model on this CPU (default 1: about the regime of a small MoE on a GPU over PCIe,
where a copy costs roughly one layer's compute or more). The cost model's memory rate is set so that
its full-load token time equals the measured one, so the control plane's virtual clock runs at
the speed of this CPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import tempfile
import time

import torch

from seqmoe.arch import cache_kwarg, model_arch, moe_layers
from seqmoe.arch.collect import collect_trace
from seqmoe.arch.quant import quantize_experts
from seqmoe.base.errors import UserError
from seqmoe.brain.manager.systems import SYSTEMS as ALL, check_live_system
from seqmoe.brain.predict.checkpoints import load_seq_predictor
from seqmoe.brain.predict.train import train_seq_predictor
from seqmoe.config import COMPARED_RESIDENCIES, COMPARED_SYSTEMS, OffloadConfig, check_bench
from seqmoe.costs.host_cost import host_fields
from seqmoe.costs.profiles import HardwareProfile, ModelProfile, full_load_token_s
from seqmoe.runtime.eager.host_exec import model_host_expert_s
from seqmoe.runtime.offload import measure_profile, offload
from seqmoe.trace.schema import RoutingTrace

PROMPTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "import os\n\n\ndef list_files(path):\n    for name in os.listdir(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "with open(filename) as f:\n    for line in f:\n        line = line.strip()\n",
)
"""Short Python snippets (seqmoe-tiny is trained on Python standard library source)."""
TRAIN_PROMPTS = (
    "def read_config(path):\n    import json\n    with open(path) as f:\n",
    "class Node:\n    def __init__(self, value, next=None):\n        self.value = value\n",
    "for i, item in enumerate(items):\n    if item is None:\n        continue\n",
    "try:\n    import threading\nexcept ImportError:\n    threading = None\n",
    "def __repr__(self):\n    return '%s(%r)' % (self.__class__.__name__, self.args)\n",
    "import re\n\npattern = re.compile(r'\\d+')\nfor match in pattern.finditer(text):\n",
    "if __name__ == '__main__':\n    import sys\n    main(sys.argv[1:])\n",
    "def _check_arg(value, name):\n    if not isinstance(value, int):\n        raise TypeError(",
)
"""Prompts of the routing trace a forecaster is trained on when none is given (disjoint from `PROMPTS`)."""


def greedy_decode(model, ids: list[int], new_tokens: int, runtime=None) -> tuple[list[int], float, tuple[float, float]]:
    """(generated ids, seconds of the decode forwards, (runtime host, gather) seconds during them) of
    batch-1 greedy decode."""
    from transformers import DynamicCache  # transformers: only when this runs

    key = cache_kwarg(model)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor([ids]), use_cache=True, **{key: cache})
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = [int(nxt)]
        host0 = (runtime.host_s, runtime.gather_s) if runtime is not None else (0.0, 0.0)
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(nxt, use_cache=True, **{key: cache})
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
        wall = time.perf_counter() - t0
        host = (runtime.host_s - host0[0], runtime.gather_s - host0[1]) if runtime is not None else (0.0, 0.0)
    return tokens, wall, host


def time_to_first_token(model, length: int, repeats: int = 2, runtime=None) -> float:
    """Seconds of the prompt forward of a `length`-token prompt (seeded ids: timing only) up to its
    logits, the fastest of `repeats` (with a runtime, it settles between them: its replay, its copies)."""
    from transformers import DynamicCache  # transformers: only when this runs

    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = torch.randint(vocab, (1, length), generator=torch.Generator().manual_seed(length))
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            cache = DynamicCache(config=model.config)
            t0 = time.perf_counter()
            model(ids, use_cache=True, **{cache_kwarg(model): cache}, **keep)
            best = min(best, time.perf_counter() - t0)
            if runtime is not None:
                runtime.synchronize()
    return best


def _timed_passes(model, prompts: list[list[int]], new_tokens: int, repeats: int, runtime=None) -> dict:
    """Decode every prompt `repeats` times; the tokens and the fastest pass's numbers."""
    best = None
    for _ in range(repeats):
        outs = [greedy_decode(model, p, new_tokens, runtime) for p in prompts]
        wall = sum(o[1] for o in outs)
        if best is None or wall < best["wall_s"]:
            best = {"tokens": [o[0] for o in outs], "wall_s": wall, "host_s": sum(o[2][0] for o in outs),
                    "gather_s": sum(o[2][1] for o in outs)}
    n = len(prompts) * (new_tokens - 1)
    return {**best, "decode_tokens": n, "tokens_per_s": n / best["wall_s"]}


def expert_layer_seconds(layers, run) -> float:
    """Median seconds of one MoE layer's routed-expert compute for one token while `run()` decodes
    with the full model (its first L calls, the prompt forward, left out)."""
    times: list[float] = []
    start: list[float] = []
    experts = [m.experts for m in layers]
    handles = [x.register_forward_pre_hook(lambda *a: start.append(time.perf_counter())) for x in experts]
    handles += [x.register_forward_hook(lambda *a: times.append(time.perf_counter() - start.pop())) for x in experts]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    decode = sorted(times[len(layers):])
    return decode[len(decode) // 2]


def measured_hardware(mp: ModelProfile, token_s: float, copy_s: float, overhead_s: float = 0.0,
                      name: str = "cpu (measured)", host_s: float | None = None) -> HardwareProfile:
    """A cost model of the machine at hand: full-load token time `token_s`, one expert copy `copy_s`
    of which `overhead_s` is fixed per copy, and (when given) `host_s` per expert on the host CPU."""
    host = host_fields(mp.expert_bytes, host_s, overhead_s) if host_s is not None else {}
    unit = HardwareProfile(name=name, h2d_bytes_per_s=mp.expert_bytes / (copy_s - overhead_s),
                           copy_overhead_s=overhead_s, hbm_bytes_per_s=1.0, hbm_efficiency=1.0,
                           device_memory_bytes=1 << 40, **host)
    rate = full_load_token_s(mp, unit) / token_s  # full_load_token_s is linear in 1 / hbm rate
    return dataclasses.replace(unit, hbm_bytes_per_s=rate, source=f"measured: {1e3 * token_s:.3f} ms/token, "
                               f"{1e6 * copy_s:.1f} us/copy")


def _forecaster(train: RoutingTrace, predictor, minutes: float, log):
    if predictor is not None:
        return predictor

    log(f"training a small forecaster on the trace ({train.num_tokens} tokens, up to {60 * minutes:.0f} s)")
    with tempfile.TemporaryDirectory(prefix="seqmoe-bench-") as d:
        train_seq_predictor(train, d, epochs=20, max_minutes=minutes, hash_buckets=1024, embed_dim=64,
                            hidden_dim=64, query_dim=64, progress=False)
        return load_seq_predictor(d)


def bench_runtime(model, tokenizer=None, prompts=PROMPTS, *, residencies=COMPARED_RESIDENCIES, systems=COMPARED_SYSTEMS,
                  new_tokens: int = 32, repeats: int = 2, train: RoutingTrace | None = None, predictor=None,
                  link_ratio: float = 1.0, predictor_minutes: float = 0.5, log=lambda line: None,
                  config: OffloadConfig | None = None, online: bool = False, cache: str | None = None,
                  prompt_lengths: tuple[int, ...] = ()) -> dict:
    """Time greedy decode of the full model and of `systems` x `residencies` offloaded (see the module doc).

    Args:
        model: a transformers MoE causal LM on the CPU (offloaded and restored in turn; left as it was).
        tokenizer: encodes text `prompts`; None when `prompts` are token id lists.
        prompts: texts or token id lists, one request each.
        new_tokens: tokens generated per prompt (>= 2; the first comes from the prompt forward).
        repeats: passes over the prompts per run; the fastest is reported.
        train: routing trace of `model` (start placement, statistics, forecaster training); default:
            collected from `model` over `TRAIN_PROMPTS` (decode mode).
        predictor: forecaster of the `seqmoe*` systems (checkpoint folder or `SeqPredictor`);
            default: one trained for `predictor_minutes` on `train`.
        link_ratio: one expert copy takes this many times one layer's measured expert compute.
        log: called with progress lines.
        config: the other offload options (miss path, control, expert precision; default: `offload`'s);
            each run sets its system, residency, training trace, forecaster and the cost model below.
            The host CPU's time per expert is that of this CPU's host path, measured at start
            (`costs`), held in the host executor.
        online: a cold start: no training trace and no forecaster; every pool starts empty and the
            `seqmoe*` systems learn their forecaster online from an empty cache (a new `$SEQMOE_CACHE`
            each run); `config.learn=False` pauses that learning.
        cache: with `online`, the `$SEQMOE_CACHE` every run shares instead (a warm start from what the
            runs before learned).
        prompt_lengths: also time the first token of prompts of these lengths (`time_to_first_token`),
            full load and each run (`ttft_s`, and `ttft_vs_full` over the full model's).

    Returns:
        {"model", "new_tokens", "prompts", "link": {...}, "full": {...}, "runs": [{...}, ...]}.
    """
    for s in systems:  # a training trace and a forecaster are collected and trained when not given
        check_live_system(s, train=not online, predictor=not online)
    check_bench(new_tokens, repeats, link_ratio)
    if any(isinstance(p, str) for p in prompts) and tokenizer is None:
        raise UserError("text prompts need the model's tokenizer")
    ids = [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
    if not ids or any(len(p) == 0 for p in ids):
        raise UserError("every prompt needs at least one token")
    layers = moe_layers(model)
    greedy_decode(model, ids[0], min(new_tokens, 4))  # warm-up
    full = _timed_passes(model, ids, new_tokens, repeats)
    config = config or OffloadConfig()
    want = full["tokens"]
    if config.expert_dtype is not None:  # exact against the full model of the same quantized weights

        want = _timed_passes(quantize_experts(copy.deepcopy(model), config.expert_dtype), ids, new_tokens, 1)["tokens"]
    full["ttft_s"] = {n: time_to_first_token(model, n, repeats) for n in prompt_lengths}
    log(f"full load: {full['tokens_per_s']:.1f} tokens/s")
    expert_s = expert_layer_seconds(layers, lambda: greedy_decode(model, ids[0], new_tokens))
    if train is None and not online:
        if tokenizer is None:
            raise UserError("without train= the bench collects a trace over text prompts: give a tokenizer")
        log(f"collecting a routing trace over {len(TRAIN_PROMPTS)} training prompts")
        train = collect_trace(model, list(TRAIN_PROMPTS), tokenizer, mode="decode", new_tokens=new_tokens)
    arch = model_arch(model)
    mp = measure_profile(model, arch, arch.layout(arch.moe[0].experts))  # what offload would measure
    host_s = model_host_expert_s(model)
    hw = measured_hardware(mp, full["wall_s"] / full["decode_tokens"], link_ratio * expert_s, host_s=host_s)
    if any(ALL[s].needs_predictor for s in systems) and not online:
        predictor = _forecaster(train, predictor, predictor_minutes, log)
    elif online:
        train = predictor = None
    runs = []
    for system in systems:
        for r in residencies:
            pred = copy.deepcopy(predictor) if ALL[system].needs_predictor else None
            near = _timed_passes(model, ids, new_tokens, repeats)  # the full model again, right before: load drifts
            cold = tempfile.TemporaryDirectory() if online and cache is None else None
            try:
                with _cache_at(cold.name if cold is not None else cache):
                    rt = offload(model, r, system, config=config, train=train, predictor=pred, hardware=hw,
                                 emulate_link=True)
            except BaseException:
                if cold is not None:
                    cold.cleanup()
                raise
            try:
                greedy_decode(model, ids[0], min(new_tokens, 4), rt)  # warm-up (counted in the stats)
                res = _timed_passes(model, ids, new_tokens, repeats, rt)
                ttft = {n: time_to_first_token(model, n, repeats, rt) for n in prompt_lengths}
                rt.synchronize()
                s = rt.stats()
            finally:
                rt.restore()
                if cold is not None:
                    cold.cleanup()
            run = {"system": system, "residency": r, "capacity": s["capacity"], "miss": rt.miss, "control": rt.control,
                   "tokens_per_s": res["tokens_per_s"], "full_tokens_per_s": near["tokens_per_s"],
                   "vs_full": res["tokens_per_s"] / near["tokens_per_s"],
                   "exact": res["tokens"] == want,
                   "ttft_s": ttft, "ttft_vs_full": {n: t / full["ttft_s"][n] for n, t in ttft.items()},
                   "host_us_per_token": 1e6 * res["host_s"] / res["decode_tokens"],
                   "gather_us_per_token": 1e6 * res["gather_s"] / res["decode_tokens"],
                   **{k: s[k] for k in ("hit_rate", "ready_rate", "late_rate", "miss_rate", "prefetches",
                                        "wasted_copies", "copies", "skipped_copies", "decision_us_per_token",
                                        "misses_in_place", "misses_cpu", "forecaster")}}
            runs.append(run)
            log(f"{system} r={r}: {run['tokens_per_s']:.1f} tokens/s, hit rate {run['hit_rate']:.3f}")
    return {
        "model": str(getattr(model.config, "_name_or_path", "") or model.config.model_type),
        "new_tokens": new_tokens, "prompts": len(ids), "repeats": repeats, "threads": torch.get_num_threads(),
        "train_tokens": 0 if train is None else train.num_tokens, "online": online,
        "link": {"ratio": link_ratio, "expert_layer_s": expert_s, "copy_s": link_ratio * expert_s,
                 "bytes_per_s": hw.h2d_bytes_per_s, "expert_bytes": mp.expert_bytes, "hbm_bytes_per_s": hw.hbm_bytes_per_s,
                 "host_expert_s": host_s},
        "full": {"tokens_per_s": full["tokens_per_s"], "decode_tokens": full["decode_tokens"], "ttft_s": full["ttft_s"]},
        "runs": runs,
    }


@contextlib.contextmanager
def _cache_at(folder):
    """`$SEQMOE_CACHE` pointing at `folder` (None: unchanged) while offloading; the online learner's
    process takes it with it."""
    if folder is None:
        yield
        return
    old = os.environ.get("SEQMOE_CACHE")
    os.environ["SEQMOE_CACHE"] = str(folder)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SEQMOE_CACHE", None)
        else:
            os.environ["SEQMOE_CACHE"] = old


def format_table(result: dict) -> str:
    """The runs of `bench_runtime` as a text table, full load first."""
    head = f"{'system':<24} {'residency':>9} {'slots':>6} {'tokens/s':>9} {'vs full':>8} {'hit rate':>8} " \
           f"{'host us/tok':>11} {'gather us/tok':>13} {'exact':>5}"
    full = result["full"]
    lines = [head, "-" * len(head),
             f"{'full load':<24} {'-':>9} {'-':>6} {full['tokens_per_s']:>9.1f} {1.0:>8.2f} {'-':>8} {'-':>11} "
             f"{'-':>13} {'-':>5}"]
    for r in result["runs"]:
        lines.append(f"{r['system']:<24} {r['residency']:>9.2f} {r['capacity']:>6} {r['tokens_per_s']:>9.1f} "
                     f"{r['vs_full']:>8.2f} {r['hit_rate']:>8.3f} {r['host_us_per_token']:>11.1f} "
                     f"{r['gather_us_per_token']:>13.1f} "
                     f"{'yes' if r['exact'] else 'NO':>5}")
    for n, t in result["full"].get("ttft_s", {}).items():
        lines.append(f"time to first token, {n}-token prompt: full load {1e3 * t:.0f} ms; " + ", ".join(
            f"{r['system']} r={r['residency']:g} {1e3 * r['ttft_s'][n]:.0f} ms ({r['ttft_vs_full'][n]:.2f}x)"
            for r in result["runs"]))
    link = result["link"]
    lines.append(f"link: one expert copy = {link['ratio']:g} x one layer's expert compute = "
                 f"{1e6 * link['copy_s']:.1f} us ({link['bytes_per_s'] / 1e9:.3g} GB/s for {link['expert_bytes']} B "
                 f"experts); host CPU: {1e6 * link['host_expert_s']:.1f} us per expert (measured)")
    return "\n".join(lines)
