"""Load, offload and wrap a model in an `Batcher`: what `seqmoe serve` does before it listens.

    served = start_batcher(LoadConfig(model="seqmoe-tiny"), OffloadConfig(residency=0.3, device="cpu"))
    app = create_app(served.batcher, served.tokenizer, model_name=served.name,
                     context_length=served.context_length, temperature=served.temperature, top_p=served.top_p)
    ...
    served.close()   # stops the batcher, then the runtime

Loading is `seqmoe generate`'s (`seqmoe.runtime.load.load_offloaded`), with no routing trace kept:
a long-running server would grow by every position's routing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from seqmoe.base.errors import UserError
from seqmoe.config import LoadConfig, OffloadConfig
from seqmoe.runtime.load import load_offloaded
from seqmoe.serve.batcher import Batcher


@dataclass
class Served:
    """A loaded, offloaded model behind its batcher, and what the HTTP side needs to know of it."""

    batcher: Batcher
    runtime: object
    tokenizer: object
    name: str
    context_length: int
    temperature: float
    top_p: float
    summary: str

    def close(self) -> None:
        self.batcher.close()
        self.runtime.close()


def start_batcher(load: LoadConfig, cfg: OffloadConfig, *, eager: bool = False, queue_limit: int = 32,
                max_batch: int = 8, context_length: int | None = None, chat_template: str | None = None, name: str | None = None,
                progress: bool = False, admission: str = "fifo") -> Served:
    """Load `load.model`, offload it as `cfg` says, start its batcher: the running batch in one static
    cache (on CUDA with thread control, one captured graph per row count), or `eager`: a growing cache
    decoded eagerly.

    Args mirror `seqmoe serve`'s flags; `chat_template` is a file with a Jinja template;
    `context_length` caps prompt + completion (default: the model's `max_position_embeddings`).
    """
    cfg = dataclasses.replace(cfg, record_trace=False)
    template = Path(chat_template).read_text() if chat_template else None
    loaded = load_offloaded(load, cfg, needs="serve needs a tokenizer", progress=progress)
    net, tok, runtime = loaded.model, loaded.tokenizer, loaded.runtime
    try:
        if template is not None:
            tok.chat_template = template
        limit = int(getattr(net.config, "max_position_embeddings", 0) or 0) or None
        if context_length is not None and limit is not None and context_length > limit:
            raise UserError(f"context_length {context_length} is past {load.model}'s context of {limit} positions "
                            f"(max_position_embeddings); give at most {limit}")
        limit = context_length if context_length is not None else limit
        if limit is None:
            raise UserError(f"{load.model}'s config has no max_position_embeddings; give --context-length")
        batcher = Batcher(runtime, tok, queue_limit=queue_limit, max_batch=max_batch, static=None if eager else limit,
                          admission=admission)
    except BaseException:
        runtime.restore()
        raise
    gc = net.generation_config
    sampled = bool(getattr(gc, "do_sample", False))
    s = runtime.stats()
    summary = (f"system {cfg.system}, residency {s['residency']:.4g}: {s['capacity']} of {s['num_layers'] * s['num_experts']} "
               f"{s['expert_dtype']} experts in slots on {s['device']}, control {s['control']}, {batcher.path} decode; "
               f"context {limit}, queue limit {queue_limit}, batch up to {batcher.max_batch}, admission {admission}"
               + (f" ({batcher.batch_note})" if batcher.batch_note and max_batch > 1 else ""))
    return Served(batcher=batcher, runtime=runtime, tokenizer=tok, name=name or Path(str(load.model)).name,
                  context_length=limit, temperature=float(gc.temperature or 1.0) if sampled else 0.0,
                  top_p=float(gc.top_p or 1.0) if sampled else 1.0, summary=summary)
