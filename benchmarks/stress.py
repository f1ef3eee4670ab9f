"""Stress: random runtime configurations, checkpoint faults, corrupt caches, bad requests and bad CLI input.

    python benchmarks/stress.py --configs 120 --seed 0 --json stress.json

The rerun that issue 43 asks for, of the stress that found its defects 9-16 (that run's script was
not kept; this one follows its description):
- configs: random (architecture x live system x storage x precision x control x batch x miss path x
  residency); each generates greedily and is compared with the full model's tokens (with
  `seqmoe.quantize_experts`'s where quantized). A refusal (a UserError) is counted apart, by reason.
  Systems that need a training trace are left out (the tiny models have none), as are twins and
  cache-aware routing, whose tokens are not the full model's by design.
- faults: a checkpoint rewritten in place with its old mtime, or deleted, between two generates of
  one disk-tier run: a `CheckpointChanged` within FAULT_S seconds, or the right tokens (from rows
  read before the change), never wrong ones. (A row changed
  before its first read cannot be told from the original: digests are taken at first reads.)
- caches: a corrupt online-forecaster cache (NaN, Inf, huge weights, noise, bad use rates): a
  warning, and the full model's tokens.
- exit: a script that generates from the disk tier and returns: it ends within EXIT_S seconds.
- requests: malformed bodies to the server's app: each a 4xx JSON error, never a 5xx.
- cli: bad flags: exit 2 with one `seqmoe: error:` line, no traceback.

A table of the counts; `--json` also lists every failure. Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tiny checkpoints of tests/arch/collect

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import seqmoe  # noqa: E402
from seqmoe.base.errors import UserError  # noqa: E402
from seqmoe.costs.profiles import HardwareProfile  # noqa: E402
from seqmoe.runtime.disk.index import CheckpointChanged  # noqa: E402
from tests.arch.collect.tiny_models import ARCHS, save_tiny_checkpoint  # noqa: E402

SYSTEMS = ("on-demand-lru", "on-demand-lfu", "mixtral-offloading-style", "seqmoe")
PRECISIONS = (None, "int8", "int4", "fp8")
MISSES = ("copy", "in-place", "cpu", "auto")
HW = HardwareProfile(name="stress", h2d_bytes_per_s=1e9, copy_overhead_s=1e-6, hbm_bytes_per_s=1e9,
                     device_memory_bytes=1 << 30, host_memory_bytes_per_s=5e9, host_cores=8)
PROMPTS = torch.tensor([[0, 0, 1, 17, 42, 5], [1, 61, 9, 33, 70, 12], [0, 3, 8, 44, 2, 90]])
MASK = (torch.arange(6) >= torch.tensor([[2], [0], [1]])).long()  # left padding
GEN = dict(max_new_tokens=8, do_sample=False, num_beams=1, pad_token_id=0)
FAULT_S = 10.0
EXIT_S = 120.0  # a whole process: imports, loading, generating (about 5 s here)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=int, default=120, help="random configurations to run (default: 120)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the counts and every failure here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="seqmoe-stress-") as tmp:
        isolate_cache(Path(tmp) / "cache")
        models = Models(Path(tmp))
        results = {"configs": configs(models, rng, args.configs), "faults": faults(models, Path(tmp)),
                   "caches": caches(models, Path(tmp)), "exit": exits(models), "requests": requests(rng),
                   "cli": cli()}
    print(f"{'part':<10} {'runs':>6} {'ok':>6} {'refused':>8} {'failed':>7}")
    for part, r in results.items():
        print(f"{part:<10} {r['runs']:>6} {r['ok']:>6} {r.get('refused', 0):>8} {len(r['failures']):>7}")
    for part, r in results.items():
        for f in r["failures"]:
            print(f"FAILED {part}: {f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 1 if any(r["failures"] for r in results.values()) else 0


def isolate_cache(cache: Path) -> None:
    """The forecasters learned here go to `cache`, not the user's; the compiled kernels stay shared (a
    child process would otherwise compile them again, for most of a minute)."""
    from seqmoe.brain.manager.compiled._build_dir import build_dir

    kernels = build_dir().parent
    kernels.mkdir(parents=True, exist_ok=True)
    cache.mkdir()
    (cache / "numba").symlink_to(kernels, target_is_directory=True)
    os.environ["SEQMOE_CACHE"] = str(cache)


class Models:
    """Each architecture's tiny checkpoint, full model, and reference tokens by (precision, batch)."""

    def __init__(self, root: Path) -> None:
        self.root, self._full, self._want = root, {}, {}

    def folder(self, arch: str) -> Path:
        folder = self.root / arch
        if not folder.exists():
            save_tiny_checkpoint(arch, folder, tokenizer=False)
        return folder

    def full(self, arch: str):
        from transformers import AutoModelForCausalLM

        if arch not in self._full:
            self._full[arch] = AutoModelForCausalLM.from_pretrained(self.folder(arch)).eval()
        return self._full[arch]

    def fresh(self, arch: str):
        return copy.deepcopy(self.full(arch))

    def want(self, arch: str, precision, batch: int) -> torch.Tensor:
        key = (arch, precision, batch)
        if key not in self._want:
            model = self.full(arch) if precision is None else seqmoe.quantize_experts(self.fresh(arch), precision)
            self._want[key] = generate(model, batch)
        return self._want[key]

    def host_bytes(self, arch: str, share: float) -> int:
        from seqmoe.arch import model_arch

        layers = model_arch(self.full(arch)).moe
        one = sum(p[0].numel() * p.element_size() for p in layers[0].experts.parameters())
        return max(int(share * len(layers) * layers[0].num_experts), 2 * layers[0].num_experts) * one


def generate(model, batch: int) -> torch.Tensor:
    if batch == 1:
        return model.generate(PROMPTS[1:2], **GEN)
    return model.generate(PROMPTS, attention_mask=MASK, **GEN)


def _result() -> dict:
    return {"runs": 0, "ok": 0, "refused": 0, "reasons": {}, "failures": []}


def configs(models: Models, rng: random.Random, n: int) -> dict:
    out = _result()
    for _ in tqdm(range(n), desc="configs", leave=False):
        c = dict(arch=rng.choice(ARCHS), system=rng.choice(SYSTEMS), storage=rng.choice(("host", "disk")),
                 expert_dtype=rng.choice(PRECISIONS), control=rng.choice(("inline", "thread")),
                 batch=rng.choice((1, 3)), miss=rng.choice(MISSES), residency=round(rng.uniform(0.1, 0.9), 2))
        out["runs"] += 1
        try:
            got = _run(models, c)
        except UserError as e:
            out["refused"] += 1
            reason = str(e).split(";")[0][:100]
            out["reasons"][reason] = out["reasons"].get(reason, 0) + 1
            continue
        except Exception as e:  # a crash is a failure, whatever it is
            out["failures"].append({"config": c, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        if torch.equal(got, models.want(c["arch"], c["expert_dtype"], c["batch"])):
            out["ok"] += 1
        else:
            out["failures"].append({"config": c, "error": "wrong tokens"})
    return out


def _run(models: Models, c: dict) -> torch.Tensor:
    options = dict(residency=c["residency"], expert_dtype=c["expert_dtype"], control=c["control"], miss=c["miss"],
                   system=c["system"], hardware=HW, device="cpu")
    if c["storage"] == "disk":
        model, rt = seqmoe.load(models.folder(c["arch"]), host_memory=models.host_bytes(c["arch"], 0.3), **options)
    else:
        model = models.fresh(c["arch"])
        rt = seqmoe.offload(model, **options)
    try:
        return generate(model, c["batch"])
    finally:
        rt.close()


def faults(models: Models, tmp: Path) -> dict:
    """A checkpoint rewritten in place (its old mtime kept) or deleted while a disk-tier generate reads it."""
    out = _result()
    for arch in tqdm(ARCHS, desc="faults", leave=False):
        for how in ("rewritten", "deleted"):
            folder = tmp / f"fault-{arch}-{how}"
            shutil.copytree(models.folder(arch), folder)
            out["runs"] += 1
            model, rt = seqmoe.load(folder, residency=0.2, host_memory=models.host_bytes(arch, 0.2),
                                    system="on-demand-lru", hardware=HW, device="cpu")
            generate(model, 3)  # rows read once: the fault comes mid-run
            path = folder / "model.safetensors"
            st = os.stat(path)
            if how == "rewritten":
                data = bytearray(path.read_bytes())
                data[st.st_size // 2:] = bytes(st.st_size - st.st_size // 2)  # the experts' half: zeros
                with open(path, "r+b") as f:
                    f.write(data)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            else:
                path.unlink()
            t0 = time.monotonic()
            try:  # tokens are right only from rows read before the change (a host cache that holds them all)
                error = None if torch.equal(generate(model, 3), models.want(arch, None, 3)) else "wrong tokens"
            except CheckpointChanged:
                error = None if time.monotonic() - t0 < FAULT_S else f"CheckpointChanged after {time.monotonic() - t0:.0f} s"
            except Exception as e:
                error = f"{type(e).__name__}: {e}"[:300]
            finally:
                rt.close()
            if error:
                out["failures"].append({"arch": arch, "fault": how, "error": error})
            else:
                out["ok"] += 1
    return out


def caches(models: Models, tmp: Path) -> dict:
    """A cached online forecaster damaged each way: the next seqmoe run warns and gives the full model's tokens."""
    from safetensors.numpy import load_file, save_file

    out = _result()
    arch = "qwen3_moe"
    model = models.fresh(arch)
    rt = seqmoe.offload(model, residency=0.3, hardware=HW, device="cpu")
    model.generate(torch.randint(0, 100, (1, 200)), max_new_tokens=40, do_sample=False, pad_token_id=0)
    rt.close()  # keeps what it learned
    weights = max((Path(os.environ["SEQMOE_CACHE"]) / "online").glob("*/model.safetensors"), key=lambda w: w.stat().st_mtime)  # this model's
    good = weights.read_bytes()
    damages = {"nan": float("nan"), "inf": float("inf"), "huge": 3e38}
    for damage in (*damages, "noise", "truncated"):
        out["runs"] += 1
        if damage in damages:
            tensors = load_file(weights)
            save_file({k: v * 0 + damages[damage] for k, v in tensors.items()}, weights)
        elif damage == "noise":
            data = bytearray(good)
            start = 8 + int.from_bytes(data[:8], "little")
            data[start:] = random.Random(1).randbytes(len(data) - start)
            weights.write_bytes(bytes(data))
        else:
            weights.write_bytes(good[:1000])
        model = models.fresh(arch)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                rt = seqmoe.offload(model, residency=0.3, hardware=HW, device="cpu", learn=False)
                got = generate(model, 3)
                rt.close()
            if not torch.equal(got, models.want(arch, None, 3)):
                out["failures"].append({"damage": damage, "error": "wrong tokens"})
            elif not any("ignoring the cached forecaster" in str(w.message) for w in seen):
                out["failures"].append({"damage": damage, "error": "no warning"})
            else:
                out["ok"] += 1
        except Exception as e:
            out["failures"].append({"damage": damage, "error": f"{type(e).__name__}: {e}"[:300]})
        weights.write_bytes(good)
    return out


EXIT_SCRIPT = """
import sys, torch, seqmoe
model, rt = seqmoe.load(sys.argv[1], residency=0.3, host_memory=int(sys.argv[2]), device="cpu",
                        system="on-demand-lru", control=sys.argv[3])
model.generate(torch.tensor([[1, 61, 9, 33, 70, 12]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
"""


def exits(models: Models) -> dict:
    """A script that generates from the disk tier and returns (no close): it must end (defect 9 hung here);
    `seconds`: the longest one took."""
    out = _result()
    for arch in tqdm(ARCHS, desc="exit", leave=False):
        for control in ("inline", "thread"):
            out["runs"] += 1
            env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
            argv = [sys.executable, "-c", EXIT_SCRIPT, str(models.folder(arch)), str(models.host_bytes(arch, 0.3)),
                    control]
            t0 = time.monotonic()
            try:
                r = subprocess.run(argv, capture_output=True, text=True, timeout=EXIT_S, env=env)
                out["seconds"] = max(out.get("seconds", 0.0), round(time.monotonic() - t0, 1))
            except subprocess.TimeoutExpired:
                out["failures"].append({"arch": arch, "control": control, "error": f"no exit in {EXIT_S:.0f} s"})
                continue
            if r.returncode:
                out["failures"].append({"arch": arch, "control": control, "error": r.stderr[-300:]})
            else:
                out["ok"] += 1
    return out


BAD_BODIES = [b"", b"{", b"[]", b"null", b'"x"', b"{}", b'{"prompt": 1}', b'{"prompt": null}',
              b'{"prompt": "x", "max_tokens": -1}', b'{"prompt": "x", "max_tokens": 1e9}',
              b'{"prompt": "x", "max_tokens": "8"}', b'{"prompt": "x", "stream": "yes"}',
              b'{"prompt": "x", "temperature": -1}', b'{"prompt": "x", "top_p": 2}', b'{"prompt": "x", "n": 0}',
              b'{"prompt": "x", "seed": "a"}', b'{"prompt": "\\ud800"}', b'{"prompt": [[1, 2], "x"]}',
              b'{"prompt": [99999999]}', b'{"prompt": "x", "stop": [1]}', b'{"prompt": "x", "logprobs": 99}',
              b'{"prompt": "x", "model": "other"}', b'{"messages": []}', b'{"messages": [{"role": 1}]}',
              b'\xff\xfe', b'{"prompt": "x" ' + b" " * 100 + b"}"]


def requests(rng: random.Random) -> dict:
    """Malformed bodies, and random byte-level mutations of a good one, to both POST routes."""
    from fastapi.testclient import TestClient

    from seqmoe.config import LoadConfig, OffloadConfig
    from seqmoe.serve.api import create_app
    from seqmoe.serve.startup import start_batcher

    out = _result()
    served = start_batcher(LoadConfig(model="seqmoe-tiny", threads=1), OffloadConfig(residency=0.3, device="cpu",
                                                                                     system="on-demand-lru"))
    good = json.dumps({"model": served.name, "prompt": "def f(", "max_tokens": 2}).encode()
    bodies = list(BAD_BODIES)
    for _ in range(100):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        bodies.append(bytes(b))
    try:
        app = create_app(served.batcher, served.tokenizer, model_name=served.name,
                         context_length=served.context_length)
        with TestClient(app, raise_server_exceptions=False) as client:
            for route in ("/v1/completions", "/v1/chat/completions"):
                for body in tqdm(bodies, desc=f"requests {route}", leave=False):
                    out["runs"] += 1
                    r = client.post(route, content=body, headers={"Content-Type": "application/json"})
                    try:
                        shaped = "error" in r.json() if r.status_code >= 400 else True
                    except ValueError:
                        shaped = False
                    if r.status_code >= 500 or not shaped:
                        out["failures"].append({"route": route, "body": body[:80], "status": r.status_code,
                                                "answer": r.text[:200]})
                    else:
                        out["ok"] += 1
    finally:
        served.close()
    return out


BAD_FLAGS = [
    ["generate", "--prompt", "x", "--residency", "1.5"], ["generate", "--prompt", "x", "--residency", "0"],
    ["generate", "--prompt", "x", "--max-new-tokens", "1000"], ["generate", "--prompt", "x", "--expert-memory", "1KiB"],
    ["generate", "--prompt", "x", "--host-memory", "1"], ["generate", "--prompt", "x", "--model", "/nonexistent"],
    ["generate", "--prompt", "x", "--residency", "0.3", "--expert-memory", "1MiB"],
    ["generate", "--prompt", "x", "--miss", "teleport"], ["generate", "--prompt", "x", "--system", "nope"],
    ["generate", "--prompt", "x", "--expert-dtype", "int3"], ["generate", "--prompt", "x", "--threads", "0"],
    ["serve", "--port", "70000"], ["serve", "--replicas", "0"], ["serve", "--context-length", "1"],
    ["sim", "--trace", "/nonexistent.npz", "--residency", "0.3"], ["sim", "--residency", "2"],
    ["sweep", "--residencies", "0.1,abc"], ["calibrate", "--tokens", "0"], ["trace", "split", "/nonexistent"],
]


def cli() -> dict:
    out = _result()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for flags in tqdm(BAD_FLAGS, desc="cli", leave=False):
        r = subprocess.run([sys.executable, "-m", "seqmoe", *flags], capture_output=True, text=True, env=env,
                           timeout=120)
        lines = r.stderr.strip().splitlines()
        out["runs"] += 1
        if r.returncode == 2 and lines and lines[-1].startswith("seqmoe: error: ") and "Traceback" not in r.stderr:
            out["ok"] += 1
        else:
            out["failures"].append({"flags": flags, "status": r.returncode, "stderr": r.stderr[-300:]})
    return out


if __name__ == "__main__":
    sys.exit(main())
