"""Decode speed of seqmoe-tiny on a GPU: the full model, and offloaded with each engine.

    python benchmarks/cuda_decode.py --predictor DIR --out results/cuda_decode.jsonl

For each residency x system it decodes one prompt greedily three ways and checks the tokens against
the full model's: `inline` (model.generate, the control plane in the router hooks, which
synchronise), `thread` (model.generate, routing posted to the mailbox, a control thread), `graph`
(`DecodeGraph`: the decode step captured once as a CUDA graph and replayed). It also runs one
decode step under `torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronising
call. Expert implementation `batched_mm` (fp32, bit-comparable to the full model). Prints a table
and one JSON line per run. Needs CUDA, transformers and the packaged seqmoe-tiny.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from seqmoe.arch.collect import load_model
from seqmoe.config import COMPARED_SYSTEMS
from seqmoe.brain.manager import system_spec
from seqmoe.runtime import offload
from seqmoe.runtime.posted.graph import DecodeGraph
from seqmoe.arch.tiny.traces import TRAIN_FILE
from seqmoe.trace.io import load_trace

PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser("


def _model(impl: str):
    model, tok = load_model("seqmoe-tiny", device="cpu", dtype="float32")
    model.config._experts_implementation = impl
    return model, tok


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def run(args) -> list[dict]:
    train = load_trace(TRAIN_FILE)
    model, tok = _model(args.impl)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"].to(args.device)
    full = model.to(args.device)
    gen = lambda m: m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,  # noqa: E731
                               do_sample=False, num_beams=1, pad_token_id=0)
    with torch.no_grad():
        gen(full)
        want, wall = _timed(lambda: gen(full))
    rows = [{"engine": "full model", "residency": 1.0, "system": "-", "tokens_per_s": args.new_tokens / wall,
             "equal": True}]
    rows.append(full_graph(full, ids, want, args.new_tokens))
    full = None  # free the device memory before the offloaded runs
    for residency in args.residencies:
        for system in args.systems:
            for engine in ("inline", "thread", "graph"):
                row = {"engine": engine, "residency": residency, "system": system}
                try:
                    model, _ = _model(args.impl)
                    rt = offload(model, residency, system, device=args.device, train=train, control=(
                        "inline" if engine == "inline" else "thread"),
                        predictor=args.predictor if system_spec(system).needs_predictor else None)
                    with torch.no_grad():
                        if engine == "graph":
                            dg = DecodeGraph(rt, ids.shape[1] + args.new_tokens)
                            dg.generate(ids, args.new_tokens)  # captures
                            got, wall = _timed(lambda: dg.generate(ids, args.new_tokens))
                        else:
                            gen(model)
                            got, wall = _timed(lambda: gen(model))
                    s = rt.stats()
                    row.update(tokens_per_s=args.new_tokens / wall, equal=bool(torch.equal(got, want)),
                               hit_rate=s["hit_rate"], data_hit_rate=s["data_hit_rate"], host_reads=s["host_reads"], pool_reads=s["pool_reads"],
                               copies=s["copies"], decision_us_per_token=s["decision_us_per_token"],
                               host_us_per_token=s["host_us_per_token"])
                    rt.restore()
                except Exception as e:  # record and go on: one device run must tell everything
                    row["error"] = repr(e)[:300]
                    traceback.print_exc()
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.device == "cuda":
        rows.append(sync_check(args, train, ids))
    return rows


def full_graph(model, ids, want, new_tokens: int) -> dict:
    """The full model's own decode step captured as a CUDA graph (`DecodeGraph` on the plain model):
    the full-load speed to match."""
    row = {"engine": "full model, graph", "residency": 1.0, "system": "-"}
    try:
        dg = DecodeGraph(model, ids.shape[1] + new_tokens)
        with torch.no_grad():
            dg.generate(ids, new_tokens)  # captures
            got, wall = _timed(lambda: dg.generate(ids, new_tokens))
        row.update(tokens_per_s=new_tokens / wall, equal=bool(torch.equal(got, want)))
    except Exception as e:
        row["error"] = repr(e)[:300]
        traceback.print_exc()
    print(json.dumps(row), flush=True)
    return row


def sync_check(args, train, ids) -> dict:
    """One posted decode step under sync_debug_mode("error"): any synchronising call raises."""
    row = {"engine": "sync-debug decode step", "residency": 0.25, "system": "on-demand-lru"}
    try:
        model, _ = _model(args.impl)
        rt = offload(model, 0.25, "on-demand-lru", device="cuda", train=train, control="thread")
        dg = DecodeGraph(rt, ids.shape[1] + 8, capture=False)
        with torch.no_grad():
            dg.generate(ids, 2)
            rt.synchronize()  # the copy worker idle, and held so (its own stream syncs are not the step's)
            with rt.worker._cv:
                rt.controller.begin_posted(None)  # what DecodeGraph does around each replay
                rt.controller.graph_step = True
                torch.cuda.set_sync_debug_mode("error")
                try:
                    dg._step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    rt.controller.graph_step = False
                    rt.controller.end_posted()
        rt.synchronize()
        row.update(ok=True, tokens=rt.stats()["tokens"])
        rt.restore()
    except Exception as e:
        row.update(ok=False, error=repr(e)[:300])
        traceback.print_exc()
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--predictor", help="forecaster checkpoint of seqmoe-tiny for the seqmoe system")
    p.add_argument("--residencies", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.5, 0.25])
    p.add_argument("--systems", type=lambda s: s.split(","), default=None)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--impl", default="batched_mm", help="transformers experts implementation")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the script out")
    p.add_argument("--out", help="append the JSON lines here")
    args = p.parse_args()
    if args.systems is None:  # the compared systems that need no forecaster, the others with --predictor
        args.systems = [s for s in COMPARED_SYSTEMS if args.predictor or not system_spec(s).needs_predictor]
    rows = run(args)
    print(f"\n{'engine':<24}{'residency':>10}  {'system':<15}{'tokens/s':>10}{'equal':>7}{'hit':>7}{'data hit':>9}"
          f"{'decide us/tok':>15}")
    for r in rows:
        if "tokens_per_s" in r:
            print(f"{r['engine']:<24}{r['residency']:>10}  {r['system']:<15}{r['tokens_per_s']:>10.1f}{str(r['equal']):>7}"
                  f"{r.get('hit_rate', 1.0):>7.3f}{r.get('data_hit_rate', 1.0):>9.3f}{r.get('decision_us_per_token', 0):>15.0f}")
        else:
            print(f"{r['engine']:<24}{r['residency']:>10}  {r['system']:<15}  {r.get('error', 'ok' if r.get('ok') else '')}")
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
