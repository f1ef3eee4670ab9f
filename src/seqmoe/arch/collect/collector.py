"""Run a transformers MoE model over requests and record its routing as a `RoutingTrace`.

    model, tok = load_model("seqmoe-tiny")
    trace = collect_trace(model, ["First request.", "Second one."], tok, pregate=2)
    trace = collect_trace(model, [[1, 17, 9], [1, 44]], mode="decode", new_tokens=32)

Each request runs alone (batch 1, no padding).
- `mode="prompt"`: one forward over the request's tokens; the trace holds their routing.
- `mode="decode"`: greedy `model.generate` of `new_tokens` tokens after the request (KV cache);
  the trace holds the prompt positions (routed together in the prefill forward) followed by every
  generated token (routed one per decode step; the last one by one more cached forward, so that it
  has a routing too). `meta.extra["prompt_tokens"]` says how many leading tokens of each request
  were prompt.
Both modes route the same sequence the same way (up to float noise): routing depends only on the
tokens before each position.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from seqmoe.arch import cache_kwarg, model_arch, output_cache
from seqmoe.arch.collect.routers import RouterRecorder
from seqmoe.base.errors import UserError
from seqmoe.trace.schema import RoutingTrace, TraceMeta

MODES = ("prompt", "decode")


SPLITS = ("paragraph", "file")


def read_text_requests(path: str | os.PathLike, split: str = "paragraph") -> tuple[list[str], list[str]]:
    """(texts, labels) of the requests in a UTF-8 text file, or in every `*.txt` file under a folder (sorted).

    split="paragraph": one request per blank-line-separated paragraph (label `FILE#N`, N from 0);
    split="file": one request per file (label `FILE`). Whitespace-only requests are dropped.
    """
    if split not in SPLITS:
        raise UserError(f"unknown request split {split!r}; choose from {', '.join(SPLITS)}")
    path = Path(path)
    if not path.exists():
        raise UserError(f"no such text file or folder: {path}")
    files = sorted(p for p in path.rglob("*.txt") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise UserError(f"no *.txt files under {path}; give a text file or a folder of .txt files")
    texts, labels = [], []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {f} as UTF-8 text: {e}") from None
        name = str(f.relative_to(path)) if path.is_dir() else f.name
        chunks = re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")) if split == "paragraph" else [text]
        chunks = [c.strip() for c in chunks if c.strip()]
        texts += chunks
        labels += [f"{name}#{i}" for i in range(len(chunks))] if split == "paragraph" else [name] * len(chunks)
    if not texts:
        raise UserError(f"{path} holds no text")
    return texts, labels


def tokenize(requests: Sequence[str | Sequence[int]], tokenizer=None) -> list[list[int]]:
    """Token ids of every request: strings go through `tokenizer` (special tokens added; whitespace-only
    strings give no tokens), id sequences pass as they are."""
    out = []
    for req in requests:
        if isinstance(req, str):
            if tokenizer is None:
                raise UserError("requests are text but there is no tokenizer; give one, or pass token ids")
            out.append(list(tokenizer(req)["input_ids"]) if req.strip() else [])
        else:
            out.append([int(t) for t in req])
    return out


def collect_trace(
    model,
    requests: Sequence[str | Sequence[int]],
    tokenizer=None,
    *,
    pregate: int = 0,
    router_logits: bool = False,
    mode: str = "prompt",
    new_tokens: int = 32,
    max_tokens: int | None = None,
    labels: Sequence[str] | None = None,
    model_name: str | None = None,
    source: str | None = None,
    progress: bool = False,
) -> RoutingTrace:
    """Record the routing of `model` (a transformers MoE causal LM) over `requests`.

    Args:
        requests: texts (need `tokenizer`) or token id lists; one request each. Empty ones are skipped.
        pregate: H >= 0: also record `pregate_logits` [T, L, H, E] (see `RoutingTrace`).
        router_logits: also record each router's own logits, `router_logits` [T, L, E] (what the
            simulator's cache-aware routing compares experts by).
        mode: "prompt" or "decode" (see the module docstring).
        new_tokens: tokens to generate per request in decode mode (fewer if EOS comes first).
        max_tokens: keep at most this many prompt tokens per request (default: the model's
            `max_position_embeddings`, less `new_tokens` in decode mode).
        labels: a name per request (file, paragraph), kept in `meta.extra["requests"]`.
        model_name, source: for `TraceMeta` (defaults: the model's name_or_path, "seqmoe.arch.collect (MODE)").
        progress: show a tqdm bar over tokens.

    Returns:
        A trace with expert_ids, gate_weights (as the MoE block applies them), token_ids and,
        when asked, pregate_logits and router_logits. Its L axis is MoE layers only;
        `meta.extra["moe_layers"]` maps it to decoder layer indices.
    """
    if mode not in MODES:
        raise UserError(f"unknown collection mode {mode!r}; choose from {', '.join(MODES)}")
    if mode == "decode" and new_tokens < 1:
        raise UserError(f"decode mode needs new_tokens >= 1, got {new_tokens}")
    arch = model_arch(model)
    layers = list(arch.moe)
    config = model.config
    limit = max_tokens
    if limit is None:
        context = getattr(config, "max_position_embeddings", None) or 1 << 30
        limit = context - (new_tokens if mode == "decode" else 0)
    if limit < 1:
        raise UserError(f"max_tokens must be positive (and leave room for new_tokens), got {limit}")
    token_lists = tokenize(requests, tokenizer)
    names = list(labels) if labels is not None else [str(i) for i in range(len(token_lists))]
    if len(names) != len(token_lists):
        raise UserError(f"{len(names)} labels for {len(token_lists)} requests; give one label per request")
    kept = [(name, ids[:limit]) for name, ids in zip(names, token_lists) if ids]
    if not kept:
        raise UserError("no tokens to route: every request is empty")
    truncated = sum(len(ids) > limit for ids in token_lists)
    device = next(model.parameters()).device

    parts, prompt_lengths = [], []
    bar = tqdm(total=sum(len(ids) for _, ids in kept), unit="tok", disable=not progress, desc=f"collect ({mode})")
    with RouterRecorder(layers, pregate=pregate, router_logits=router_logits) as rec, torch.no_grad():
        for _, ids in kept:
            input_ids = torch.tensor([ids], dtype=torch.long, device=device)
            if mode == "prompt":
                model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
                seq = ids
            else:
                seq = _generate(model, input_ids, new_tokens)
            routed = rec.take()
            if routed[0].shape[0] != len(seq):
                raise RuntimeError(f"routed {routed[0].shape[0]} positions for a request of {len(seq)} tokens")
            parts.append((np.asarray(seq, dtype=np.int32), *routed))
            prompt_lengths.append(len(ids))
            bar.update(len(ids))
    bar.close()

    lengths = [len(p[0]) for p in parts]
    extra = {
        "architecture": getattr(config, "model_type", "unknown"),
        "family": arch.family.name,
        "router": type(layers[0].router).__name__,
        "moe_layers": [m.layer_index for m in layers],
        "num_decoder_layers": int(getattr(config, "num_hidden_layers", 0) or 0),
        "mode": mode,
        "requests": [name for name, _ in kept],
        "truncated_requests": truncated,
        "max_tokens": int(limit),
    }
    if mode == "decode":
        extra.update(prompt_tokens=prompt_lengths, new_tokens=new_tokens)
    if pregate:
        extra["pregate_horizon"] = pregate
    return RoutingTrace(
        expert_ids=np.concatenate([p[1] for p in parts]),
        gate_weights=np.concatenate([p[2] for p in parts]),
        pregate_logits=np.concatenate([p[3] for p in parts]) if pregate else None,
        router_logits=np.concatenate([p[4] for p in parts]) if router_logits else None,
        token_ids=np.concatenate([p[0] for p in parts]),
        request_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        meta=TraceMeta(
            model=model_name or str(getattr(config, "_name_or_path", "") or extra["architecture"]),
            num_experts=layers[0].num_experts,
            source=source or f"seqmoe.arch.collect ({mode})",
            extra=extra,
        ),
    )


def _generate(model, input_ids, new_tokens: int) -> list[int]:
    """Greedy decode with KV cache; route the last generated token too. Returns prompt + generated ids."""
    config = model.config
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        eos = getattr(config, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, list) else eos
    out = model.generate(
        input_ids,
        attention_mask=input_ids.new_ones(input_ids.shape),
        max_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad,
        return_dict_in_generate=True,
        use_cache=True,
    )
    seq = out.sequences
    # generate never feeds its last token back; one cached forward routes it.
    model(input_ids=seq[:, -1:], use_cache=True, logits_to_keep=1, **{cache_kwarg(model): output_cache(out)})
    return seq[0].tolist()
