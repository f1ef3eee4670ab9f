"""Plots from results JSONL: hit rate, full-load fraction, bound fraction and copies / Belady's copies
against residency.

    seqmoe plot results.jsonl --out plots/
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from seqmoe.base.errors import UserError
from seqmoe.base.files import atomic_path
from seqmoe.brain.manager.systems import SYSTEMS

SEQMOE_COLOR = "#d62728"
"""The `seqmoe` system's line: a strong red, thick, that no other line takes."""
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79",
           "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
"""The other non-oracle lines' colours: no grey (the oracles' dashed references) and no red (seqmoe's)."""

METRICS = {
    "hit_rate": "hit rate",
    "full_load_fraction": "full-load fraction (full-load time / time)",
    "bound_fraction": "bound fraction (bound time / time)",
    "copies_per_belady": "copies / Belady's copies (1 = Belady)",
}




def plot_results(rows: list[dict], out_dir: str | Path, caption: str = "") -> list[Path]:
    """One PNG per metric, one line per system (and expert precision); returns the files written.

    Args:
        rows: result rows with `system`, `residency` and the metrics.
        out_dir: folder for the PNGs.
        caption: text under each figure (the command that produced the results).
    """
    import matplotlib  # matplotlib: only when this runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when this runs

    if any("system" not in r or "residency" not in r for r in rows):
        raise UserError("a results row lacks `system` or `residency`; is this a `seqmoe sweep` file?")
    rows = [r for r in rows if "error" not in r]  # a failed run's row has no metrics
    if not rows:
        raise UserError("every row is a failed run's (`error`): nothing to plot")
    hardware, trace = (lambda r: r.get("hardware_profile", {}).get("name")), (lambda r: r.get("config", {}).get("trace"))
    apart = [f for f in (hardware, trace) if len({f(r) for r in rows}) > 1]  # sweeps over profiles or traces
    series: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        series[" ".join([r["system"] + (f" ({r['expert_dtype']})" if r.get("expert_dtype") else "")]
                        + [str(f(r)) for f in apart])].append(r)
    first = rows[0]
    on = "each hardware profile" if hardware in apart else hardware(first) or "?"
    where = f"{first.get('model_profile', {}).get('name', '?')} on {on}, {first.get('num_tokens', '?')} tokens"
    written = []
    role = {n: SYSTEMS[s[0]["system"]].role if s[0]["system"] in SYSTEMS else "baseline"  # unknown: plain lines
            for n, s in series.items()}
    for key, label in METRICS.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        colors = iter(PALETTE * 3)
        greys = iter(["0.35", "0.6", "0.75", "0.5", "0.45"] * 4)  # oracles: grey dashed references
        for name, pts in series.items():
            pts = [p for p in pts if p.get(key) is not None]  # older rows lack a metric; None: undefined
            pts = sorted(pts, key=lambda r: r["residency"])
            if role[name] == "oracle":
                style = dict(ls="--", marker="x", color=next(greys))
            elif pts and pts[0]["system"] == "seqmoe":  # the system itself: one colour no other line takes
                style = dict(marker="o", color=SEQMOE_COLOR, lw=3.0, zorder=5)
            else:
                style = dict(marker="o", color=next(colors), lw=2.0 if role[name] == "seqmoe" else 1.5)
            ax.plot([p["residency"] for p in pts], [p[key] for p in pts], label=name, **style)
        ax.set_xlabel("residency (fraction of experts on the device)")
        ax.set_ylabel(label)
        ax.set_title(f"{label.split(' (')[0]}: {where}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        if caption:
            fig.text(0.01, 0.01, caption, fontsize=6, family="monospace", wrap=True)
        fig.tight_layout(rect=(0, 0.04 if caption else 0, 1, 1))
        path = Path(out_dir) / f"{key}.png"
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
        plt.close(fig)
        written.append(path)
    return written
