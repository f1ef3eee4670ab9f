"""Peak memory of a streamed checkpoint shipped quantized (issue 41): a Qwen3-MoE-shaped checkpoint of
more than 1 GB in FP8 with 128 x 128 block scales (DeepSeek-V3 / Qwen3-FP8 keys), written here with
random weights, loaded by `seqmoe.load` with a small host cache and decoding a few tokens, in a child
process whose peak RSS (ru_maxrss) is compared with the dense part + the host budget + 1 GiB.

    python benchmarks/shipped_memory.py [--layers 12] [--host-memory 256MiB] [--keep DIR]

Prints one table row and one JSON line. The checkpoint is written per layer (one safetensors shard
each), so the writer never holds more than a layer either.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=1024, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=128, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)


def write(folder: Path, layers: int) -> int:
    """A checkpoint of `layers` Qwen3-MoE layers, every expert linear in FP8 with its `weight_scale_inv`
    (per-expert keys, as Qwen3-FP8 ships them); the bytes of its routed experts."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from seqmoe.arch.shipped import SHIPPED_CODECS

    codec = SHIPPED_CODECS["fp8-block"]
    H, I, E = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **SHAPE)
    config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    config.save_pretrained(folder)
    gen, weight_map, expert_bytes = torch.Generator().manual_seed(0), {}, 0
    bf16 = lambda *shape: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)  # noqa: E731
    q, kv = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    for layer in range(layers):
        p, t = f"model.layers.{layer}", {}
        for name, shape in (("q_proj", (q, H)), ("k_proj", (kv, H)), ("v_proj", (kv, H)), ("o_proj", (H, q))):
            t[f"{p}.self_attn.{name}.weight"] = bf16(*shape)
        for name in ("q_norm", "k_norm"):
            t[f"{p}.self_attn.{name}.weight"] = torch.ones(SHAPE["head_dim"], dtype=torch.bfloat16)
        for name in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}.{name}.weight"] = torch.ones(H, dtype=torch.bfloat16)
        t[f"{p}.mlp.gate.weight"] = (torch.randn((E, H), generator=gen)).to(torch.bfloat16)
        for name, (rows, cols) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w = torch.randn((E, rows, cols), generator=gen) * 0.02
            for suffix, part in codec.encode(w).items():
                for e in range(E):
                    t[f"{p}.mlp.experts.{e}.{name}.{suffix}"] = part[e].clone()
                    expert_bytes += part[e].nbytes
        shard = f"layer-{layer:03d}.safetensors"
        save_file(t, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, shard))
    rest = {"model.embed_tokens.weight": bf16(SHAPE["vocab_size"], H), "lm_head.weight": bf16(SHAPE["vocab_size"], H),
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    save_file(rest, folder / "rest.safetensors", metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(rest, "rest.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return expert_bytes


def child(folder: str, host_memory: str) -> None:
    """In its own process: load streamed, decode 8 tokens, print what it measured as JSON."""
    import torch

    import seqmoe

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model, runtime = seqmoe.load(folder, host_memory=host_memory, residency=0.1, device="cpu", dtype="bfloat16")
    load_s = time.perf_counter() - t0
    with torch.no_grad():
        model.generate(torch.tensor([[1, 5, 9, 13]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    s = runtime.stats()
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "dense_bytes": dense,
                      "expert_bytes": s["expert_bytes"], "expert_dtype": s["expert_dtype"], "load_s": load_s,
                      "disk_bytes": s.get("disk_bytes")}))
    runtime.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12, help="MoE layers (12: 1.2 GB of FP8 experts)")
    p.add_argument("--host-memory", default="256MiB", help="the host cache of the streamed load")
    p.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it (default: a temporary folder)")
    p.add_argument("--child", nargs=2, metavar=("FOLDER", "HOST_MEMORY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return 0
    from seqmoe.costs.precision import parse_bytes

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        expert_bytes = write(folder, args.layers)
        out = subprocess.run([sys.executable, __file__, "--child", str(folder), args.host_memory], capture_output=True,
                             text=True, env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
    budget = parse_bytes(args.host_memory)
    bound = r["dense_bytes"] + budget + (1 << 30)
    r.update(file_expert_bytes=expert_bytes, host_memory_bytes=budget, bound_bytes=bound,
             within=r["peak_rss_bytes"] <= bound,
             row_is_the_files_bytes=r["expert_bytes"] * args.layers * SHAPE["num_experts"] == expert_bytes)
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    print("| experts in the file, fp8-block (MiB) | dense (MiB) | host cache (MiB) | peak RSS (MiB) | bound (MiB) | within |")
    print("|---|---|---|---|---|---|")
    print(f"| {mib(expert_bytes)} | {mib(r['dense_bytes'])} | {mib(budget)} | {mib(r['peak_rss_bytes'])} | "
          f"{mib(bound)} | {r['within']} |")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
