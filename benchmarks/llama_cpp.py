"""seqmoe beside llama.cpp on one GGUF file, on the CPU: tokens/s, bytes read from disk, peak memory.

    python benchmarks/llama_cpp.py --gguf /work/ckpt/qwen3moe.gguf --write      # writes the model once
    python benchmarks/llama_cpp.py --gguf FILE [--tokens 64] [--threads 2] [--residency 0.25]
        [--host-memory SIZE] [--out results/llama_cpp.json]

The model (--write; `seqmoe.arch.gguf_writer`): a Qwen3-MoE of the flags' shape (by default 8 layers
of 64 experts 768 wide, Qwen3-30B-A3B's expert shape, hidden 1024, top-8: 1.3 GiB) with seeded
random weights, routers scaled so that routing is decided, experts in Q8_0, the other matrices f16,
and a byte-level tokenizer that both read; written a tensor at a time, so it may be bigger than
memory (Qwen3-30B-A3B's layers and experts, 30 GiB: --layers 48 --experts 128 --hidden 2048). Both decode the same prompt
greedily from the model's own routing, each run in a process of its own under a measuring parent
(`getrusage` of its children: its peak RSS and the blocks it read from storage; the page cache is not
dropped, which needs root: each side runs once to warm it, then --repeats timed runs):

- llama.cpp, through llama-cpp-python (an optional extra, not a test dependency: the script says so
  and exits 0 without it): `Llama(FILE)` with its memory-mapped default, every layer on the CPU;
- `seqmoe generate --model FILE` with its default system, the experts kept in their Q8_0 blocks, a
  pool of --residency on the CPU and, with --host-memory, a host cache in front of the file.

tokens/s is generated tokens over the generate call's wall time (prompt included) for both, as
`seqmoe generate` reports it (`wall_tokens_per_s`). Prints a table; --out writes every run as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "def parse(text):"
MEASURE = r"""
import json, resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": done.returncode, "stdout": done.stdout[-20000:], "stderr": done.stderr[-4000:],
                  "maxrss_kib": u.ru_maxrss, "inblock": u.ru_inblock}))
"""
LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
path, tokens, threads, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_gpu_layers=0, verbose=False, seed=0)
t0 = time.perf_counter()
out = llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, top_k=1)
wall = time.perf_counter() - t0
n = out["usage"]["completion_tokens"]
print(json.dumps({"generated_tokens": n, "wall_s": wall, "wall_tokens_per_s": n / wall, "text": out["choices"][0]["text"]}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="the GGUF file (written by --write)")
    p.add_argument("--write", action="store_true", help="write the model to --gguf first (replaces it)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--expert-width", type=int, default=768, help="moe_intermediate_size (Qwen3-30B-A3B's: 768)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--threads", type=int, default=2, help="compute threads of both (llama.cpp's n_threads, seqmoe's --threads)")
    p.add_argument("--residency", type=float, default=0.25, help="seqmoe's pool, a share of the experts")
    p.add_argument("--host-memory", help="seqmoe's host cache in front of the file (default: every expert in host memory)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side (after one to warm the page cache)")
    p.add_argument("--out", default="results/llama_cpp.json", help="JSON of every run")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.tokens < 1:
        p.error("--repeats and --tokens must be at least 1")
    if args.write:
        _write(args)
    if not Path(args.gguf).is_file():
        print(f"{args.gguf} does not exist: write it with --write", file=sys.stderr)
        return 2
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed (pip install 'seqmoe[llama]' builds llama.cpp here); skipped",
              file=sys.stderr)
        return 0
    sides = {"llama.cpp (mmap)": [sys.executable, "-c", LLAMA_CHILD, args.gguf, str(args.tokens), str(args.threads),
                                  PROMPT],
             f"seqmoe r={args.residency}": [sys.executable, "-m", "seqmoe", "generate", "--model", args.gguf,
                                            "--prompt", PROMPT, "--max-new-tokens", str(args.tokens),
                                            "--threads", str(args.threads), "--residency", str(args.residency),
                                            "--json", "--no-progress"]
             + (["--host-memory", args.host_memory] if args.host_memory else [])}
    runs = {name: [_child(cmd) for _ in range(args.repeats + 1)][1:] for name, cmd in sides.items()}
    print(f"{Path(args.gguf).name} ({Path(args.gguf).stat().st_size / 2**30:.2f} GiB), {args.tokens} tokens, "
          f"{args.threads} threads, median of {args.repeats} warm runs")
    print(f"{'side':<22} {'tokens/s':>9} {'spread':>13} {'MiB read/token':>15} {'peak RSS MiB':>13}  text")
    for name, rs in runs.items():
        tps = [r["wall_tokens_per_s"] for r in rs]
        read = statistics.median(r["read_bytes"] / max(r["generated_tokens"], 1) for r in rs) / 2**20
        print(f"{name:<22} {statistics.median(tps):9.2f} {min(tps):6.2f}-{max(tps):<6.2f} {read:15.2f} "
              f"{statistics.median(r['peak_rss_bytes'] for r in rs) / 2**20:13.0f}  {rs[0]['text'][:24]!r}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gguf": args.gguf, "args": vars(args), "runs": runs}, indent=1))
    return 0


def _child(cmd: list[str]) -> dict:
    """Run one side under a measuring parent: its last JSON line, with its peak RSS and storage reads."""
    done = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, check=True)
    got = json.loads(done.stdout)
    if got["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd[:5])} failed:\n{got['stderr']}")
    lines = got["stdout"].strip().splitlines()
    row = json.loads(lines[-1])
    text = row.get("text", lines[0].removeprefix(PROMPT))  # seqmoe generate prints prompt + text first
    return {"text": text, "generated_tokens": row["generated_tokens"], "wall_s": row["wall_s"],
            "wall_tokens_per_s": row["wall_tokens_per_s"], "peak_rss_bytes": got["maxrss_kib"] * 1024,
            "read_bytes": got["inblock"] * 512}


def _write(args) -> None:
    """The Qwen3-MoE of the flags with seeded weights, experts in Q8_0, written to --gguf a tensor at a
    time (`write_random_gguf`: a file bigger than memory is written too)."""
    from transformers import AutoConfig

    from seqmoe.arch.gguf_writer import write_random_gguf

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=128, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4, head_dim=64,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width,
        max_position_embeddings=2048, norm_topk_prob=True, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    write_random_gguf(config, args.gguf, progress=True)
    print(f"wrote {args.gguf} ({Path(args.gguf).stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
