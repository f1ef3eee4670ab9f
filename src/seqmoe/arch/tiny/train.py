"""Train seqmoe-tiny from scratch on the CPU: a byte-level BPE tokenizer and an OLMoE model.

    python -m seqmoe.arch.tiny.train --out src/seqmoe/models/seqmoe-tiny --steps 1200 --minutes 58

The text is the interpreter's own standard library (`seqmoe.arch.tiny.corpus`). Each file becomes one
document, `<|endoftext|>` + its tokens; the training files are concatenated into one token stream
and every step draws `batch` random windows of `context` tokens from it (seeded). The loss is
the language-model cross-entropy plus `router_aux_loss_coef` times OLMoE's load-balancing loss.
AdamW, linear warm-up then cosine decay to a tenth of the peak rate, gradient clipping at 1.0.
With the same seed, corpus and library versions the run is the same (one thread).

The output folder (written next to `--out` and renamed into place at the end) holds the
checkpoint (weights stored float16, loaded as float32), tokenizer, `loss.csv`, `metrics.json`,
`loss_curve.png` and the model card `README.md`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from seqmoe.arch.tiny.card import plot_loss, render_card, write_loss_csv
from seqmoe.arch.tiny.corpus import stdlib_corpus
from seqmoe.base.errors import UserError

__all__ = ["ARCH", "EOS", "PAD", "encode_docs", "heldout_nll", "model_config", "train_model", "train_tokenizer",
           "unigram_nll"]

EOS, PAD = "<|endoftext|>", "<|pad|>"
ARCH = dict(hidden_size=160, intermediate_size=80, num_hidden_layers=8, num_attention_heads=5, num_key_value_heads=5,
            num_experts=32, num_experts_per_tok=4, max_position_embeddings=256, router_aux_loss_coef=0.01)
"""The OLMoE sizes of seqmoe-tiny (`intermediate_size` is per expert)."""
EXPERTS_IMPLEMENTATION = "grouped_mm"  # as fast as "eager" on one CPU thread, same outputs; "batched_mm" is ~30x slower


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on `texts`; ids 0, 1 are EOS, PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # tokenizers: only when this runs

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, out_dir: Path, context: int) -> None:
    """tokenizer.json + tokenizer_config.json that `AutoTokenizer.from_pretrained(out_dir)` loads."""
    from transformers import PreTrainedTokenizerFast  # transformers: only when this runs

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=context)
    fast.save_pretrained(str(out_dir))


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    """One int32 stream: per text, the EOS id then its tokens."""
    eos = tok.token_to_id(EOS)
    parts = [np.array([eos] + enc.ids, dtype=np.int32) for enc in tok.encode_batch(texts)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def model_config(vocab_size: int, **overrides):
    """`OlmoeConfig` of seqmoe-tiny (`ARCH`, tied embeddings, router logits in the loss); `overrides` win."""
    from transformers import OlmoeConfig  # transformers: only when this runs

    kw = {**ARCH, **overrides}
    cfg = OlmoeConfig(vocab_size=vocab_size, tie_word_embeddings=True, output_router_logits=True,
                      bos_token_id=0, eos_token_id=0, pad_token_id=1, **kw)
    cfg._experts_implementation = EXPERTS_IMPLEMENTATION
    return cfg


def _windows(tokens: np.ndarray, context: int) -> torch.Tensor:
    """Non-overlapping [n, context] int64 windows covering `tokens` (the tail that does not fill one is dropped)."""
    n = len(tokens) // context
    return torch.from_numpy(tokens[:n * context].astype(np.int64)).view(n, context)


@torch.no_grad()
def heldout_nll(model, tokens: np.ndarray, context: int, max_windows: int | None = None,
                batch: int = 8) -> tuple[float, int]:
    """(summed next-token NLL in nats, tokens scored) over windows of `tokens`; window starts are not scored."""
    was = model.training
    model.eval()
    x = _windows(tokens, context)[:max_windows]
    total, n = 0.0, 0
    for i in range(0, len(x), batch):
        ids = x[i:i + batch]
        logits = model(input_ids=ids, output_router_logits=False).logits[:, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                         ids[:, 1:].reshape(-1), reduction="sum"))
        n += ids[:, 1:].numel()
    model.train(was)
    return total, n


def unigram_nll(train_tokens: np.ndarray, tokens: np.ndarray, context: int, vocab_size: int) -> tuple[float, int]:
    """(summed NLL, count) of an add-one unigram of `train_tokens` on the tokens `heldout_nll` scores."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = _windows(tokens, context)[:, 1:].reshape(-1).numpy()
    return float(-logp[targets].sum()), len(targets)


def _lr_lambda(steps: int, warmup: int):
    def f(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (i - warmup) / max(1, steps - warmup))))
    return f


def train_model(model, tokens: np.ndarray, *, steps: int, batch: int = 16, context: int = 256, lr: float = 2e-3,
                seed: int = 0, warmup: int = 100, deadline: float = math.inf, stop_at: int | None = None,
                eval_fn=None, eval_every: int = 100, log_every: int = 10, progress: bool = True) -> list[dict]:
    """Train `model` in place for `steps` AdamW steps on random windows of `tokens`.

    Args:
        eval_fn: called every `eval_every` steps and after the last; returns held-out loss (nats/token).
        deadline: `time.monotonic()` value after which training stops early (the rows say so).
        stop_at: stop after this step (the schedule still spans `steps`): replays a run cut by its deadline.

    Returns:
        Rows every `log_every` steps: step, tokens, lr, mean train LM loss and aux loss over those steps,
        elapsed seconds, and `heldout_loss` where evaluated.
    """
    if len(tokens) <= context + 1:
        raise UserError(f"the training stream has {len(tokens)} tokens, fewer than one window of {context + 1}")
    rng = np.random.default_rng(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(steps, min(warmup, max(1, steps // 10))))
    coef = model.config.router_aux_loss_coef
    stream = torch.from_numpy(tokens.astype(np.int64))
    rows, acc, t0 = [], [0.0, 0.0, 0], time.monotonic()
    model.train()
    bar = tqdm(total=steps, disable=not progress, desc="train", unit="step")
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(stream) - context, size=batch)
        ids = torch.stack([stream[s:s + context] for s in starts])
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        aux = float(out.aux_loss.detach())
        acc = [acc[0] + float(out.loss.detach()) - coef * aux, acc[1] + aux, acc[2] + 1]
        bar.update(1)
        stop = time.monotonic() > deadline or step == stop_at
        if step % log_every == 0 or step == steps or stop:
            row = {"step": step, "tokens": step * batch * context, "lr": sched.get_last_lr()[0],
                   "train_loss": acc[0] / acc[2], "aux_loss": acc[1] / acc[2], "elapsed_s": time.monotonic() - t0}
            if eval_fn is not None and (step % eval_every == 0 or step == steps or stop):
                row["heldout_loss"] = eval_fn(model)
            rows.append(row)
            acc = [0.0, 0.0, 0]
            bar.set_postfix(loss=f"{row['train_loss']:.3f}", refresh=False)
        if stop:
            rows[-1]["stopped_at_deadline"] = True
            break
    bar.close()
    return rows


def _save_model(out_dir: Path, model, tok, context: int, rows: list[dict]) -> None:
    """Checkpoint (float16 weights, config dtype float32), tokenizer, loss log and plot."""
    model.half()
    model.save_pretrained(str(out_dir))
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "float32"  # from_pretrained upcasts the float16 weights to float32
    cfg.pop("output_router_logits", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tok, out_dir, context)
    write_loss_csv(rows, out_dir / "loss.csv")
    plot_loss(rows, out_dir / "loss_curve.png")


def run(out: Path, *, steps: int, minutes: float, seed: int, batch: int, context: int, lr: float,
        vocab_size: int, stop_at: int | None = None, progress: bool = True) -> dict:
    """The whole build of seqmoe-tiny into `out` (replaced atomically); returns metrics.json's contents."""
    from transformers import AutoModelForCausalLM, OlmoeForCausalLM  # transformers: only when this runs

    t_start = time.monotonic()
    torch.manual_seed(seed)
    corpus = stdlib_corpus()
    manifest = corpus.manifest()
    train_texts, held_texts = corpus.train_texts(), corpus.heldout_texts()
    tok = train_tokenizer(train_texts, vocab_size)
    train_tok, held_tok = encode_docs(tok, train_texts), encode_docs(tok, held_texts)
    model = OlmoeForCausalLM(model_config(tok.get_vocab_size(), max_position_embeddings=context))
    n_params = sum(p.numel() for p in model.parameters())
    eval_fn = lambda m: (lambda s, n: s / n)(*heldout_nll(m, held_tok, context, max_windows=32))  # noqa: E731
    rows = train_model(model, train_tok, steps=steps, batch=batch, context=context, lr=lr, seed=seed,
                       deadline=t_start + 60 * minutes, stop_at=stop_at, eval_fn=eval_fn, progress=progress)
    train_s = time.monotonic() - t_start
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        info = {"training": {"steps_run": rows[-1]["step"], "steps_planned": steps, "batch": batch, "context": context,
                             "tokens_seen": rows[-1]["tokens"], "peak_lr": lr, "seed": seed, "seconds": train_s,
                             "torch": torch.__version__, "threads": torch.get_num_threads(),
                             "experts_implementation": EXPERTS_IMPLEMENTATION,
                             "final_train_loss": rows[-1]["train_loss"]},
                "model": {"architecture": "OlmoeForCausalLM", "parameters": n_params, **ARCH,
                          "vocab_size": tok.get_vocab_size(), "max_position_embeddings": context},
                "data": {**manifest, "train_tokens": int(len(train_tok)), "heldout_tokens": int(len(held_tok))}}
        _save_model(tmp, model, tok, context, rows)
        if corpus.license_file is not None:  # the PSF license asks that it travel with derived works
            shutil.copyfile(corpus.license_file, tmp / "LICENSE-PSF.txt")
        shipped = AutoModelForCausalLM.from_pretrained(str(tmp))  # what users get: float16 weights in float32
        nll, n = heldout_nll(shipped, held_tok, context)
        u_nll, u_n = unigram_nll(train_tok, held_tok, context, tok.get_vocab_size())
        info["evaluation"] = {"heldout_tokens_scored": n, "heldout_loss": nll / n, "heldout_perplexity": math.exp(nll / n),
                              "unigram_perplexity": math.exp(u_nll / u_n), "unigram": "add-one, training-token counts"}
        info["training"]["total_seconds"] = time.monotonic() - t_start
        _save_meta(tmp, info)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the files get the usual permissions too
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return info


def _save_meta(out_dir: Path, info: dict) -> None:
    """Rewrite metrics.json and the card once the evaluation is known."""
    (out_dir / "metrics.json").write_text(json.dumps(info, indent=1) + "\n")
    (out_dir / "README.md").write_text(render_card(info))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqmoe.arch.tiny.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output folder (replaced at the end)")
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps (sets the cosine schedule)")
    p.add_argument("--minutes", type=float, default=58.0, help="stop training after this long (safety limit)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (replays a run cut by --minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    try:
        if a.steps < 1 or a.minutes <= 0 or a.batch < 1 or a.context < 8 or a.vocab < 300:
            raise UserError("--steps and --batch must be >= 1, --minutes > 0, --context >= 8 and --vocab >= 300")
        torch.set_num_threads(a.threads)
        info = run(a.out, steps=a.steps, minutes=a.minutes, seed=a.seed, batch=a.batch, context=a.context,
                   lr=a.lr, vocab_size=a.vocab, stop_at=a.stop_at)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ev = info["evaluation"]
    print(f"wrote {a.out}: held-out perplexity {ev['heldout_perplexity']:.2f} "
          f"(unigram {ev['unigram_perplexity']:.2f}), {info['training']['seconds']:.0f} s training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
