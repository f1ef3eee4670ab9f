"""Result rows as a table a person reads and as JSONL a program reads."""

from __future__ import annotations

import json
from pathlib import Path

from seqmoe.base.files import atomic_path
from seqmoe.base.errors import UserError

_COLUMNS = [  # (header, key, format)
    ("system", "system", "{}"),
    ("miss", "miss", "{}"),
    ("experts", "expert_dtype", "{}"),
    ("twin", "twin", "{}"),
    ("resid.", "residency", "{:.2f}"),
    ("hit", "hit_rate", "{:.4f}"),
    ("ready", "ready_rate", "{:.4f}"),
    ("late", "late_rate", "{:.4f}"),
    ("miss", "miss_rate", "{:.4f}"),
    ("copies", "copies", "{}"),
    ("wasted", "wasted_copies", "{}"),
    ("stall s", "stall_s", "{:.3f}"),
    ("time s", "time_s", "{:.3f}"),
    ("full-load", "full_load_fraction", "{:.3f}"),
    ("bound", "bound_fraction", "{:.3f}"),
    ("paths bound", "paths_bound_fraction", "{:.3f}"),
    ("copies/bel", "copies_per_belady", "{:.2f}"),
    ("us/tok", "decision_us_per_token", "{:.0f}"),
]


def format_table(rows: list[dict]) -> str:
    """Fixed-width table of the main metrics, one line per row."""
    cells = [[h for h, _, _ in _COLUMNS]] + [[_cell(r.get(k), fmt) for _, k, fmt in _COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)  # None: undefined (no Belady copies; a live run)


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    """Write rows as JSON Lines, whole or not at all."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL results file (UserError naming the line if one is not JSON)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"results file {str(path)!r} not found; make one with `seqmoe sweep --out FILE`")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); expected the JSONL of seqmoe sweep --out") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{i}: not a JSON line ({e.msg})") from None
    if not rows:
        raise UserError(f"{path} holds no results")
    return rows
