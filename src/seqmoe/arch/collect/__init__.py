"""Collect routing traces from transformers MoE models (needs the `hf` extra: torch, transformers).

    from seqmoe.arch.collect import collect_trace, load_model
    model, tokenizer = load_model("seqmoe-tiny")
    trace = collect_trace(model, ["Some text.", "Another request."], tokenizer, pregate=2)

CLI: `seqmoe trace collect --model PATH_OR_NAME --text FILE_OR_DIR --out TRACE.safetensors`.
"""

from seqmoe.arch.collect.collector import MODES, collect_trace, tokenize
from seqmoe.arch.collect.models import load_model, resolve_model_dir
from seqmoe.arch.collect.routers import MoeLayer, RouterRecorder, moe_layers

__all__ = [
    "MODES", "collect_trace", "tokenize", "load_model", "resolve_model_dir", "MoeLayer", "RouterRecorder", "moe_layers",
]
