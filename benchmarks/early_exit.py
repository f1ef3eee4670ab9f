"""How well an intermediate layer of seqmoe-tiny guesses the next token through the model's own head.

    python benchmarks/early_exit.py [--tokens 4000] [--out results/early_exit.json]

Held-out text (the token ids of seqmoe-tiny's held-out routing trace) goes through the full model,
teacher-forced, one forward per request. After each decoder layer l the hidden state goes through
the model's final norm and LM head (an early exit); its argmax is the guess of the next token.
Reported per layer: agreement with the last layer's argmax (the token greedy decoding emits, which
is what a drafter of the decode's next token must guess), accuracy against the text's next token,
the mean top probability (its confidence), and the share of positions whose top probability is at
least 0.5 with their agreement (a calibrated guess is used where it is likely right).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4000, help="held-out tokens (whole requests)")
    p.add_argument("--out", default="results/early_exit.json")
    args = p.parse_args(argv)
    import torch

    from seqmoe.arch.collect import load_model
    from seqmoe.arch.tiny.traces import load_demo_traces

    _, test = load_demo_traces()
    model, _ = load_model("seqmoe-tiny", device="cpu", dtype="float32")
    norm, head = model.model.norm, model.lm_head
    off, stats, n = test.request_offsets.tolist(), None, 0
    with torch.no_grad():
        for a, b in zip(off[:-1], off[1:]):
            ids = torch.tensor([test.token_ids[a:b].tolist()])
            out = model(ids, output_hidden_states=True)
            # After each decoder layer but the last through the exit; the last is the model's own logits.
            exits = [head(norm(h)) for h in out.hidden_states[1:-1]] + [out.logits]
            final = out.logits[0, :-1].argmax(-1)
            truth = ids[0, 1:]
            if stats is None:
                stats = [dict(agree=0, correct=0, conf=0.0, sure=0, sure_agree=0) for _ in exits]
            for s, logits in zip(stats, exits):
                probs = torch.softmax(logits[0, :-1], -1)
                top, guess = probs.max(-1)
                sure = top >= 0.5
                s["agree"] += int((guess == final).sum())
                s["correct"] += int((guess == truth).sum())
                s["conf"] += float(top.sum())
                s["sure"] += int(sure.sum())
                s["sure_agree"] += int((guess == final)[sure].sum())
            n += b - a - 1
            if n >= args.tokens:
                break
    rows = [{"layer": i + 1, "agrees_with_final": s["agree"] / n, "next_token_accuracy": s["correct"] / n,
             "mean_confidence": s["conf"] / n, "confident_share": s["sure"] / n,
             "confident_agreement": s["sure_agree"] / max(s["sure"], 1)} for i, s in enumerate(stats)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"positions": n, "layers": rows}, indent=1) + "\n")
    print(f"{n} held-out positions of seqmoe-tiny")
    print("| after layer | agrees with the final argmax | next-token accuracy | mean confidence | "
          "share with confidence >= 0.5 | their agreement |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['agrees_with_final']:.3f} | {r['next_token_accuracy']:.3f} | "
              f"{r['mean_confidence']:.3f} | {r['confident_share']:.3f} | {r['confident_agreement']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
