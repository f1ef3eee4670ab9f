"""Load, offload and wrap a model in an `Engine`: what `seqmoe serve` does before it listens.

    served = load_engine("seqmoe-tiny", residency=0.3, system="on-demand-lru", device="cpu")
    app = create_app(served.engine, served.tokenizer, model_name=served.name,
                     context_length=served.context_length, temperature=served.temperature, top_p=served.top_p)
    ...
    served.close()   # stops the engine, then the runtime

Loading follows `seqmoe generate` (src/seqmoe/cli/runtime.py): the model is loaded on the CPU,
then `seqmoe.offload` packs its routed experts into host memory and moves only the dense rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from seqmoe.config import DEFAULT_RUNTIME_RESIDENCY, DEFAULT_SYSTEM
from seqmoe.errors import UserError
from seqmoe.serve.engine import Engine


@dataclass
class Served:
    """A loaded, offloaded model behind its engine, and what the HTTP side needs to know of it."""

    engine: Engine
    runtime: object
    tokenizer: object
    name: str
    context_length: int
    temperature: float
    top_p: float
    summary: str

    def close(self) -> None:
        self.engine.close()
        self.runtime.close()


def load_engine(model: str, *, residency: float = DEFAULT_RUNTIME_RESIDENCY, system: str = DEFAULT_SYSTEM,
                train: str | None = None, predictor: str | None = None, device: str | None = None,
                dtype: str = "auto", control: str | None = None, graph: bool = False, threads: int | None = None,
                queue_limit: int = 32, context_length: int | None = None, chat_template: str | None = None,
                name: str | None = None, progress: bool = False, miss: str | None = None) -> Served:
    """Load `model` (a folder or seqmoe-tiny), offload it, start its engine.

    Args mirror `seqmoe serve`'s flags; `chat_template` is a file with a Jinja template;
    `context_length` caps prompt + completion (default: the model's `max_position_embeddings`).
    """
    from tqdm import tqdm

    from seqmoe.collect import load_model
    from seqmoe.manager import system_spec
    from seqmoe.predict.checkpoints import seq_predictor_for
    from seqmoe.runtime import offload
    from seqmoe.trace.io import load_trace

    import torch

    if threads:
        torch.set_num_threads(threads)
    if graph and control == "inline":
        raise UserError("--graph needs --control thread")
    bar = tqdm(total=3, desc="seqmoe serve", unit="step", disable=not progress, leave=False)
    bar.set_postfix_str("predictor")
    train_trace = load_trace(train) if train else None
    if system_spec(system).needs_predictor:
        if train_trace is None:
            raise UserError(f"--system {system} needs --train TRACE (and --predictor DIR, or one is trained on it)")
        predictor = seq_predictor_for(predictor, train_trace)
    bar.update()
    bar.set_postfix_str("load model")
    net, tok = load_model(model, device="cpu", dtype=dtype)
    if tok is None:
        raise UserError(f"{model} has no tokenizer files; serve needs a tokenizer")
    if chat_template:
        tok.chat_template = Path(chat_template).read_text()
    bar.update()
    bar.set_postfix_str("offload")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    runtime = offload(net, residency, system, device=device, train=train_trace, predictor=predictor,
                      control="thread" if graph else control, miss=miss, record_trace=False)
    limit = int(getattr(net.config, "max_position_embeddings", 0) or 0) or None
    if context_length is not None:
        limit = min(limit, context_length) if limit else context_length
    if limit is None:
        raise UserError(f"{model}'s config has no max_position_embeddings; give --context-length")
    decode_graph = None
    if graph:
        from seqmoe.runtime import DecodeGraph

        decode_graph = DecodeGraph(runtime, limit)
    engine = Engine(runtime, tok, queue_limit=queue_limit, graph=decode_graph)
    bar.update()
    bar.close()
    gc = net.generation_config
    sampled = bool(getattr(gc, "do_sample", False))
    s = runtime.stats()
    summary = (f"system {system}, residency {residency}: {s['capacity']} of {s['num_layers'] * s['num_experts']} "
               f"experts in slots on {s['device']}, control {s['control']}{', graph' if graph else ''}; "
               f"context {limit}, queue limit {queue_limit}")
    return Served(engine=engine, runtime=runtime, tokenizer=tok, name=name or Path(str(model)).name,
                  context_length=limit, temperature=float(gc.temperature or 1.0) if sampled else 0.0,
                  top_p=float(gc.top_p or 1.0) if sampled else 1.0, summary=summary)
