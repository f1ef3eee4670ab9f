"""The seqmoe-tiny model card (`README.md`), loss log (`loss.csv`) and loss plot (`loss_curve.png`).

`render_card(info)` turns `metrics.json`'s contents into the card. Its "Routing statistics"
section holds only `ROUTING_MARKER`; that line is replaced by numbers from routing traces
collected with the project's collector, never written here.
"""

from __future__ import annotations

import csv
from pathlib import Path

from seqmoe.arch.tiny.corpus import psf_notice

__all__ = ["ROUTING_HEADING", "ROUTING_MARKER", "plot_loss", "render_card", "write_loss_csv"]

ROUTING_HEADING = "## Routing statistics"
ROUTING_MARKER = "<!-- routing statistics: filled by seqmoe.arch.tiny.card -->"
_COLUMNS = ("step", "tokens", "lr", "train_loss", "aux_loss", "heldout_loss", "elapsed_s")


def write_loss_csv(rows: list[dict], path: Path) -> None:
    """One line per logged step (`heldout_loss` empty where not evaluated)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_COLUMNS)
        for r in rows:
            w.writerow([("" if r.get(c) is None else f"{r[c]:.6g}" if isinstance(r[c], float) else r[c])
                        for c in _COLUMNS])


def plot_loss(rows: list[dict], path: Path) -> None:
    """A small PNG: training LM loss and held-out loss (nats/token) against tokens seen."""
    import matplotlib  # matplotlib: only when this runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when this runs

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    ax.plot([r["tokens"] / 1e6 for r in rows], [r["train_loss"] for r in rows], label="train (LM part)", lw=1)
    held = [r for r in rows if r.get("heldout_loss") is not None]
    ax.plot([r["tokens"] / 1e6 for r in held], [r["heldout_loss"] for r in held], "o-", ms=3, label="held-out (slice)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("seqmoe-tiny")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def render_card(info: dict) -> str:
    """The card for the `metrics.json` contents `info` (keys data, model, training, evaluation)."""
    d, m, t, e = info["data"], info["model"], info["training"], info.get("evaluation", {})
    part = lambda k: f"{d[k]['files']} files, {d[k]['bytes']:,} bytes, sha256 `{d[k]['sha256']}`"  # noqa: E731
    ev = (f"- held-out perplexity (seqmoe-tiny, checkpoint as shipped): **{e['heldout_perplexity']:.2f}** "
          f"({e['heldout_loss']:.4f} nats/token)\n"
          f"- add-one smoothed unigram (training-token counts, same tokenizer, same tokens): "
          f"**{e['unigram_perplexity']:.2f}**\n"
          f"- tokens scored: {e['heldout_tokens_scored']:,} (held-out stream cut into windows of {t['context']}; "
          f"the first token of each window is not scored, by either model)\n") if e else "- not evaluated\n"

    cut = "" if t["steps_run"] >= t["steps_planned"] else (
        f"- The run reached its time limit after {t['steps_run']:,} of the {t['steps_planned']:,} steps its "
        f"learning-rate schedule spans; `--steps {t['steps_planned']} --stop-at {t['steps_run']}` replays it.\n")

    notice = d.get("copyright_notice") or psf_notice()
    return f"""---
library_name: transformers
pipeline_tag: text-generation
---

# seqmoe-tiny

A small Mixture-of-Experts language model of Python source, trained from scratch on one CPU
thread by `python -m seqmoe.arch.tiny.train`. It exists so that seqmoe has a real MoE whose routing
was learned (not random) to trace, predict and simulate without downloading anything. It is far
too small to be useful as a code model.

## Data

- Text: the CPython {d['python_version']} standard library source, `Lib/**/*.py` of the interpreter that
  trained the model (docstrings and comments included), in sorted path order.
- Left out: files under folders named {', '.join(f'`{x}`' for x in d['excluded_dirs'])}.
- All: {part('all')}.
- Train: {part('train')}; {d['train_tokens']:,} tokens.
- Held out ({d['heldout_rule']}, i.e. by file): {part('heldout')}; {d['heldout_tokens']:,} tokens.
  The file list is in `metrics.json`.
- Each sha256 covers, per file in sorted order, `path NUL length NUL contents`.
- License of the text: Python Software Foundation License Version 2 (PSF-2.0); see "License" below.
- Tokenizer: byte-level BPE (`tokenizers`), {m['vocab_size']} entries, trained on the training files only;
  `<|endoftext|>` (id 0) starts every document and serves as bos/eos, `<|pad|>` (id 1) pads.

## Architecture

`OlmoeForCausalLM` (transformers), {m['parameters']:,} parameters, tied input/output embeddings:
{m['num_hidden_layers']} layers, hidden size {m['hidden_size']}, {m['num_attention_heads']} attention heads,
{m['num_experts']} experts per layer of which top-{m['num_experts_per_tok']} are used per token, expert
intermediate size {m['intermediate_size']}, context {m['max_position_embeddings']} tokens.
Weights are stored as float16 in `model.safetensors`; `config.json` says float32, so
`AutoModelForCausalLM.from_pretrained` upcasts them and the model runs in float32.

## Training

- {t['steps_run']:,} AdamW steps (planned {t['steps_planned']:,}) of {t['batch']} random windows of {t['context']}
  tokens: {t['tokens_seen']:,} tokens (about {t['tokens_seen'] / max(d['train_tokens'], 1):.1f} passes).
{cut}- Peak learning rate {t['peak_lr']}, linear warm-up, cosine decay to a tenth; betas (0.9, 0.95), weight
  decay 0.1 on matrices; gradient clipping at 1.0; seed {t['seed']}.
- Loss: cross-entropy plus {m['router_aux_loss_coef']} x OLMoE's load-balancing (router aux) loss.
- {t['seconds'] / 60:.1f} minutes on {t['threads']} CPU thread (torch {t['torch']}, experts implementation
  `{t['experts_implementation']}`); final training LM loss {t['final_train_loss']:.4f} nats/token.
- Loss curve: `loss_curve.png`, numbers in `loss.csv` (held-out loss there is on a 32-window slice).

![loss curve](loss_curve.png)

## Evaluation

{ev}
## License

The training text is part of Python, under the PSF License Agreement (Version 2), which allows
derivative works to be prepared and distributed; it is in `LICENSE-PSF.txt` (the interpreter's
`LICENSE.txt`, with the history of the software and the other licenses that cover parts of it).
{notice}.
Summary of changes (PSF License, clause 3): no Python file is redistributed or modified; this
model's weights were trained on the files' text, and its tokenizer vocabulary holds byte
fragments of that text. The weights and tokenizer ship with seqmoe under the package's license.

{ROUTING_HEADING}

{ROUTING_MARKER}
"""
