"""The formats checkpoints ship their experts in, one weight matrix at a time: the tensors a file
stores for it, and those tensors from and to the matrix's numbers.

    codec = SHIPPED_CODECS["mxfp4"]
    parts = codec.encode(w)                 # w [n, rows, cols] -> {"blocks": ..., "scales": ...}, as gpt-oss stores them
    codec.decode(parts, rows, cols)         # [n, rows, cols] float32: the numbers the file means
    codec.tensors(rows, cols)               # {suffix: (shape, dtype)} of one matrix; their bytes are `matrix_bytes`'

A matrix is [rows (outputs), cols (inputs)], as a linear layer's weight; each format's scales run
along its inputs (`seqmoe.costs.precision.SHIPPED` says what each holds, `matrix_bytes` prices it).
`decode` follows each format's published dequantization: FP8 blocks as DeepSeek-V3's and Qwen3-FP8's
`weight_scale_inv`, MXFP4 as the OCP MX specification and gpt-oss's checkpoints (E8M0 exponents,
e2m1 codes, the even value in the low nibble), GPTQ as AutoGPTQ's "gptq" checkpoint format (zeros
stored minus one), GGUF blocks as ggml's `dequantize_row_*`. `encode` writes the same layouts by
round to nearest (GPTQ's Hessian-guided rounding and llama.cpp's searched Q4_K scales are left out:
they choose other codes, not another layout); it is how tests write checkpoints in these formats.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from seqmoe.base.errors import UserError
from seqmoe.costs.precision import SHIPPED_BLOCK, fp8_block_size

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each 4-bit MXFP4 code."""
GPTQ_GROUP = SHIPPED_BLOCK["gptq-int4"]
READS = "fp8 with square blocks (DeepSeek-V3, Qwen3-FP8: 128 x 128), mxfp4 (gpt-oss) and gptq 4-bit in groups of 128"
"""The quantized checkpoints `shipped_precision` accepts, as its errors name them."""


def _fp4_experts(folder: Path) -> bool:
    """Whether an FP8 checkpoint packs its routed experts as FP4 (an expert linear's `weight` int8 or uint8,
    two e2m1 codes a byte, with uint8 E8M0 exponents per 32 inputs as its `weight_scale_inv`)."""
    from safetensors import safe_open  # read the header of the shard holding one expert weight

    try:
        index = folder / "model.safetensors.index.json"
        names = json.loads(index.read_text()).get("weight_map") or {} if index.is_file() else {}
        if not index.is_file() and (folder / "model.safetensors").is_file():
            with safe_open(folder / "model.safetensors", "pt") as f:
                names = dict.fromkeys(f.keys(), "model.safetensors")
        key = next((k for k in names if ".experts." in k and k.endswith(".weight")), None)
        if key is None:
            return False
        with safe_open(folder / names[key], "pt") as f:
            return f.get_slice(key).get_dtype() in ("I8", "U8")
    except Exception:  # noqa: BLE001 - a malformed or missing file: the checkpoint index says what is wrong with it
        return False


def _fp8_blocks(q: dict) -> str | None:
    """The fp8-block name of an fp8 quantization_config with square e4m3 blocks, else None."""
    side = list(q.get("weight_block_size") or ())
    if q.get("quant_method") != "fp8" or len(side) != 2 or side[0] != side[1] or q.get("fmt", "e4m3") != "e4m3":
        return None
    name = "fp8-block" if side[0] == 128 else f"fp8-block-{side[0]}"
    return name if fp8_block_size(name) else None


def _quantization_config(folder) -> dict | None:
    """config.json's quantization_config of the checkpoint in `folder` (None: it declares none; {}: not a dict)."""
    path = Path(folder) / "config.json"
    q = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    return (q if isinstance(q, dict) else {}) if q else None


def dense_fp8(folder) -> str:
    """The fp8-block name a checkpoint's FP8 dense linears are stored in (its config's blocks; default 128)."""
    return _fp8_blocks(_quantization_config(folder) or {}) or "fp8-block"


def shipped_precision(folder) -> str | None:
    """The shipped format (a `SHIPPED` name) of the checkpoint in `folder` per its config.json's
    quantization_config; None when it declares none; UserError for a quantization seqmoe does not read."""
    q = _quantization_config(folder)
    if q is None:
        return None
    method = q.get("quant_method", "?")
    fp8 = _fp8_blocks(q)
    if fp8 is not None:
        return "mxfp4" if _fp4_experts(Path(folder)) else fp8
    if method == "mxfp4":
        return "mxfp4"
    if (method == "gptq" and q.get("bits") == 4 and q.get("group_size") == GPTQ_GROUP
            and q.get("checkpoint_format", "gptq") == "gptq"):
        return "gptq-int4"
    shown = ", ".join(f"{k}={q[k]}" for k in ("weight_block_size", "fmt", "bits", "group_size", "checkpoint_format")
                      if k in q)
    raise UserError(f"{folder} is quantized by {method}{f' ({shown})' if shown else ''}; seqmoe reads {READS} "
                    "checkpoints and unquantized ones: use the model's unquantized release")


@dataclass(frozen=True)
class Codec:
    """One shipped format (see the module docstring); `name` is its `--expert-dtype` name."""

    name: str

    @property
    def block(self) -> int:
        return fp8_block_size(self.name) or SHIPPED_BLOCK[self.name]

    @property
    def kind(self) -> str:
        """The format without its block side ("fp8-block" for "fp8-block-64")."""
        return "fp8-block" if fp8_block_size(self.name) else self.name

    def tensors(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{suffix: (shape, dtype)} of the tensors a file stores for one [rows, cols] matrix."""
        b = self.block
        if self.kind == "fp8-block":
            return {"weight": ((rows, cols), torch.float8_e4m3fn),
                    "weight_scale_inv": ((-(-rows // b), -(-cols // b)), torch.float32)}
        if self.name == "mxfp4":
            return {"blocks": ((rows, cols // b, b // 2), torch.uint8), "scales": ((rows, cols // b), torch.uint8)}
        if self.name == "gptq-int4":
            return {"qweight": ((cols // 8, rows), torch.int32), "qzeros": ((cols // b, rows // 8), torch.int32),
                    "scales": ((cols // b, rows), torch.float16), "g_idx": ((cols,), torch.int32)}
        return {"": ((rows, cols // b * _GGUF_BLOCK_BYTES[self.name]), torch.uint8)}

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The file's tensors (each [n, *shape]) of n matrices `w` [n, rows, cols], rounded to nearest."""
        return _fp8_encode(w.float(), self.block) if self.kind == "fp8-block" else _ENCODE[self.name](w.float())

    def decode(self, parts: dict[str, torch.Tensor], rows: int, cols: int) -> torch.Tensor:
        """[n, rows, cols] float32: the numbers n matrices' tensors `parts` (each [n, *shape]) stand for."""
        if self.kind == "fp8-block":
            return _fp8_decode(parts, rows, cols, self.block)
        return _DECODE[self.name](parts, rows, cols)


# ---- FP8 with block scales ----------------------------------------------------------------------

def _fp8_encode(w, b):
    n, rows, cols = w.shape
    padded = w.new_zeros((n, -(-rows // b) * b, -(-cols // b) * b))
    padded[:, :rows, :cols] = w
    blocks = padded.view(n, padded.shape[1] // b, b, padded.shape[2] // b, b)
    scale = blocks.abs().amax(dim=(2, 4)) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(n, padded.shape[1], padded.shape[2])
    return {"weight": codes[:, :rows, :cols].contiguous(), "weight_scale_inv": scale}


def _fp8_decode(parts, rows, cols, b):
    scale, codes = parts["weight_scale_inv"].float(), parts["weight"]
    n = codes.shape[0]
    if rows % b == 0 and cols % b == 0:  # whole blocks: the scale broadcast over each
        w = codes.float().view(n, rows // b, b, cols // b, b) * scale[:, :, None, :, None]
        return w.view(n, rows, cols)
    full = scale.repeat_interleave(b, 1).repeat_interleave(b, 2)[:, :rows, :cols]
    return codes.float() * full


# ---- MXFP4 --------------------------------------------------------------------------------------

def _mxfp4_encode(w):
    n, rows, cols = w.shape
    x = w.view(n, rows, cols // 32, 32)
    amax = x.abs().amax(-1)
    # the shared exponent: amax's binary exponent minus e2m1's largest (6 = 1.5 x 2^2), per the OCP spec
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scaled = x / torch.exp2(exp)[..., None]
    grid = torch.tensor(FP4_VALUES[:8], device=w.device)
    mag = (scaled.abs()[..., None] - grid).abs().argmin(-1)  # nearest magnitude (ties to the smaller code)
    codes = (mag | ((scaled < 0) & (mag > 0)).to(torch.long) << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {"blocks": blocks, "scales": (exp + 127).to(torch.uint8)}


@functools.cache
def _fp4_pairs(device) -> torch.Tensor:
    """[256, 2]: the two e2m1 values of each byte (low nibble first): one lookup decodes a byte."""
    lut = torch.tensor(FP4_VALUES)
    b = torch.arange(256)
    return torch.stack((lut[b & 0xF], lut[b >> 4]), -1).to(device)


def _mxfp4_decode(parts, rows, cols):
    blocks, scales = parts["blocks"], parts["scales"]
    values = _fp4_pairs(blocks.device)[blocks.int()].view(*blocks.shape[:-1], -1)  # [n, rows, cols / 32, 32]
    values = values * torch.exp2(scales.float() - 127)[..., None]  # a power of two: exact, as ldexp
    return values.reshape(blocks.shape[0], rows, cols)


# ---- GPTQ int4 (AutoGPTQ's "gptq" checkpoint format) --------------------------------------------

def _pack_int32(nibbles: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values along `dim` into one int32 each, the first in the lowest bits."""
    v = nibbles.to(torch.int64).unflatten(dim, (-1, 8)) & 0xF
    shifts = (torch.arange(8, device=v.device) * 4).view([8 if d == dim + 1 else 1 for d in range(v.dim())])
    packed = (v << shifts).sum(dim + 1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def gptq_encode(w: torch.Tensor, sym: bool = True) -> dict[str, torch.Tensor]:
    """GPTQ's tensors of `w` [n, rows, cols] in groups of 128 inputs, rounded to nearest: symmetric
    (zero 8, scale 2 absmax / 15, as GPTQ's sym) or with a zero point per group and output."""
    n, rows, cols = w.shape
    g = w.view(n, rows, cols // GPTQ_GROUP, GPTQ_GROUP)
    if sym:
        scale = 2 * g.abs().amax(-1) / 15
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
        scale = (hi - lo) / 15
        # zeros are stored minus one, so a zero of 0 would wrap (AutoGPTQ's format): it starts at 1
        zero = torch.round(-lo / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(1, 15)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float16)
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(0, 15).view(n, rows, cols)
    return {"qweight": _pack_int32(q.transpose(1, 2), 1),                          # [n, cols/8, rows]
            "qzeros": _pack_int32((zero - 1).transpose(1, 2), 2),                   # [n, cols/128, rows/8]
            "scales": scale.transpose(1, 2).contiguous(),                           # [n, cols/128, rows]
            "g_idx": (torch.arange(cols, dtype=torch.int32, device=w.device) // GPTQ_GROUP).expand(n, cols).contiguous()}


def _gptq_decode(parts, rows, cols):
    # computed as [n, rows, cols] from the start: only the packed words and the per-group tensors transpose
    n, shifts = parts["qweight"].shape[0], torch.arange(0, 32, 4, dtype=torch.int32, device=parts["qweight"].device)
    q = ((parts["qweight"].transpose(1, 2).contiguous().unsqueeze(3) >> shifts) & 0xF).view(n, rows, cols)
    zeros = (((parts["qzeros"].unsqueeze(3) >> shifts) & 0xF).view(n, -1, rows) + 1).transpose(1, 2)  # [n, rows, groups]
    scales, g = parts["scales"].float().transpose(1, 2), parts["g_idx"]                          # [n, rows, groups]
    if torch.equal(g, (torch.arange(cols, dtype=g.dtype, device=g.device) // GPTQ_GROUP).expand(n, cols)):
        w = (q.view(n, rows, -1, GPTQ_GROUP) - zeros[..., None]).float() * scales[..., None]  # groups in order
    else:  # act-order: each input's group from g_idx
        idx = g.long()[:, None, :].expand(-1, rows, -1)
        w = (q - zeros.gather(2, idx)).float() * scales.gather(2, idx)
    return w.reshape(n, rows, cols)


# ---- GGUF blocks (ggml's Q8_0, Q5_0, Q4_K) ------------------------------------------------------

_GGUF_BLOCK_BYTES = {"q8_0": 34, "q5_0": 22, "q4_k": 144}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian) -> [...] float32."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _as_bytes(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype).contiguous().view(torch.uint8).view(*x.shape, -1)


def _gguf_blocks(parts, rows, cols, name):
    raw = parts[""]
    return raw.view(raw.shape[0], rows, cols // SHIPPED_BLOCK[name], _GGUF_BLOCK_BYTES[name])


def _q8_0_encode(w):
    n, rows, cols = w.shape
    x = w.view(n, rows, cols // 32, 32)
    d = x.abs().amax(-1) / 127  # codes from the float32 scale, the float16 one stored (as ggml)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return {"": torch.cat([_as_bytes(d, torch.float16), q.view(torch.uint8)], -1).view(n, rows, -1)}


def _q8_0_decode(parts, rows, cols):
    b = _gguf_blocks(parts, rows, cols, "q8_0")
    return (_f16(b[..., :2])[..., None] * b[..., 2:].contiguous().view(torch.int8).float()).view(b.shape[0], rows, cols)


def _q5_0_encode(w):
    n, rows, cols = w.shape
    x = w.view(n, rows, cols // 32, 32)
    big = x.gather(-1, x.abs().argmax(-1, keepdim=True))[..., 0]   # the signed value of largest magnitude (ggml)
    d = big / -16
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.floor(x * inv[..., None] + 16.5).clamp(0, 31).to(torch.int64)
    lo = (q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)
    qh = ((q >> 4) << torch.arange(32, device=w.device)).sum(-1).to(torch.int64)
    qh = torch.where(qh >= 2 ** 31, qh - 2 ** 32, qh).to(torch.int32)
    parts = [_as_bytes(d, torch.float16), _as_bytes(qh, torch.int32), lo.to(torch.uint8)]
    return {"": torch.cat(parts, -1).view(n, rows, -1)}


def _q5_0_decode(parts, rows, cols):
    b = _gguf_blocks(parts, rows, cols, "q5_0")
    qh = b[..., 2:6].contiguous().view(torch.int32)[..., 0].to(torch.int64) & 0xFFFFFFFF
    qs = b[..., 6:].to(torch.int64)
    low = torch.cat([qs & 0xF, qs >> 4], -1)
    high = ((qh[..., None] >> torch.arange(32, device=b.device)) & 1) << 4
    return (_f16(b[..., :2])[..., None] * ((low | high) - 16).float()).view(b.shape[0], rows, cols)


def _q4_k_encode(w):
    n, rows, cols = w.shape
    x = w.view(n, rows, cols // 256, 8, 32)
    lo, hi = x.amin(-1).clamp_max(0), x.amax(-1).clamp_min(0)
    scale, mins = (hi - lo) / 15, -lo
    d = (scale.amax(-1) / 63).to(torch.float16)
    dmin = (mins.amax(-1) / 63).to(torch.float16)
    sc = torch.round(scale / torch.where(d.float() > 0, d.float(), torch.ones(()))[..., None]).clamp(0, 63)
    m = torch.round(mins / torch.where(dmin.float() > 0, dmin.float(), torch.ones(()))[..., None]).clamp(0, 63)
    step = d.float()[..., None] * sc
    q = torch.round((x + (dmin.float()[..., None] * m)[..., None]) / torch.where(step > 0, step, torch.ones(()))[..., None])
    q = q.clamp(0, 15).to(torch.int64)
    sc, m = sc.to(torch.int64), m.to(torch.int64)
    packed = torch.empty((n, rows, cols // 256, 12), dtype=torch.int64, device=w.device)  # ggml's get_scale_min_k4, inverted
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    pairs = q.view(n, rows, cols // 256, 4, 2, 32)  # chunk j of 64: sub-block 2j low nibbles, 2j + 1 high
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).flatten(-2)
    return {"": torch.cat([_as_bytes(d, torch.float16), _as_bytes(dmin, torch.float16), packed.to(torch.uint8),
                           qs.to(torch.uint8)], -1).view(n, rows, -1)}


def _q4_k_decode(parts, rows, cols):
    b = _gguf_blocks(parts, rows, cols, "q4_k")
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    s = b[..., 4:16].to(torch.int64)
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 16:].view(*b.shape[:-1], 4, 32)
    q = torch.stack((qs & 0xF, qs >> 4), -2).view(*b.shape[:-1], 8, 32).float()
    step, low = d[..., None] * sc.float(), dmin[..., None] * m.float()  # ggml's d * sc and dmin * m, per sub-block
    return (step[..., None] * q - low[..., None]).reshape(b.shape[0], rows, cols)


_ENCODE = {"mxfp4": _mxfp4_encode, "gptq-int4": gptq_encode, "q8_0": _q8_0_encode,
           "q5_0": _q5_0_encode, "q4_k": _q4_k_encode}
_DECODE = {"mxfp4": _mxfp4_decode, "gptq-int4": _gptq_decode, "q8_0": _q8_0_decode,
           "q5_0": _q5_0_decode, "q4_k": _q4_k_decode}


class _Codecs(dict):
    def __missing__(self, name: str) -> Codec:  # "fp8-block-N": built on first use
        if fp8_block_size(name) is None:
            raise KeyError(name)
        self[name] = Codec(name)
        return self[name]


SHIPPED_CODECS = _Codecs({name: Codec(name) for name in SHIPPED_BLOCK})
"""Each shipped format's codec, by its `--expert-dtype` name (FP8 blocks of another side too: "fp8-block-64")."""

