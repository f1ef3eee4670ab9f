"""Parse one MoE-Beyond CSV file (DeepSeek-V2-Lite routing): a fast path and its reference twin.

A file holds one request; rows are grouped by layer (ids 1..L), each layer lists the same tokens::

    Layer ID,Batch Number,Token,Activated Expert IDs
    1,0,<｜begin▁of▁sentence｜>,"[8, 26, 56, 57, 60, 43]"

`parse_fast` works on the raw bytes with numpy (no Python object per row) and returns None
as soon as anything looks off; `parse_reference` walks the rows one by one and raises a
`TraceError` naming the file and line. `parse_file` runs the fast path and falls back to the
reference, so errors are precise and well-formed files are fast. The fast path accepts a subset
of what the reference accepts and must then return the same result (a single unquoted id, extra
spaces or zero-padded layer ids take the reference's way); `tests/trace/test_importers.py`
checks this on random, mutated and real files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from seqmoe.trace.schema import TraceError

HEADER = "Layer ID,Batch Number,Token,Activated Expert IDs"
_HEADER_B = HEADER.encode()
# A CSV token field: quoted with doubled inner quotes, or bare without commas and quotes.
_TOKEN = r'"(?:[^"]|"")*"|[^,"]*'
_TOKEN_RE = re.compile(_TOKEN)
# The ids field is quoted because it holds commas; a single id needs no quotes (the fast path
# only handles the quoted form and leaves the other to the reference parser).
_ROW_RE = re.compile(rf'(?P<layer>[^,"]*),(?P<batch>[^,"]*),(?P<token>{_TOKEN}),(?P<q>"?)\[(?P<ids>[^\]"]*)\](?P=q)')


@dataclass(frozen=True)
class ParsedRequest:
    """One file's routing.

    Attributes:
        expert_ids: [T, L, K] int16 expert ids, layer ids 1..L mapped to 0..L-1.
        tokens: the T token strings (CSV quoting removed).
    """

    expert_ids: np.ndarray
    tokens: list[str]


def parse_file(data: bytes, name: str, num_experts: int) -> ParsedRequest:
    """Parse one CSV file's bytes; fast when well formed, a precise `TraceError` otherwise."""
    parsed = parse_fast(data, num_experts)
    return parsed if parsed is not None else parse_reference(data, name, num_experts)


def _unquote(field: str) -> str:
    return field[1:-1].replace('""', '"') if field.startswith('"') else field


# ----------------------------------------------------------------------------- reference


def parse_reference(data: bytes, name: str, num_experts: int) -> ParsedRequest:
    """Row-by-row parser: slow, every error names `name` and the 1-based line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"{name}: not UTF-8 text (byte {e.start}); expected a MoE-Beyond CSV file") from None
    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last row
    if not lines or lines[0] != HEADER:
        got = lines[0][:80] if lines else ""
        raise TraceError(f"{name}:1: wrong header {got!r}; expected {HEADER!r}")
    if len(lines) == 1:
        raise TraceError(f"{name}: no data rows; every request needs at least one token")
    rows = [_parse_row(line, f"{name}:{i}", num_experts) for i, line in enumerate(lines[1:], start=2)]
    k = len(rows[0][2])
    for i, (_, _, ids) in enumerate(rows):
        if len(ids) != k:
            raise TraceError(f"{name}:{i + 2}: {len(ids)} expert ids, but line 2 has {k}")
    return _assemble_rows(rows, name)


def _parse_row(line: str, where: str, num_experts: int) -> tuple[int, str, list[int]]:
    m = _ROW_RE.fullmatch(line)
    if m is None:
        raise TraceError(f'{where}: malformed row {line[:80]!r}; expected layer,batch,token,"[id, ...]"')
    try:
        layer, _ = _parse_id(m["layer"], strip=False), _parse_id(m["batch"], strip=False)
    except ValueError:
        raise TraceError(f"{where}: layer id and batch number must be integers, got {line[:40]!r}") from None
    ids_text = m["ids"]
    try:
        ids = [_parse_id(x) for x in ids_text.split(",")]
    except ValueError:
        raise TraceError(f"{where}: expert ids must be integers, got [{ids_text}]") from None
    bad = [i for i in ids if not 0 <= i < num_experts]
    if bad:
        raise TraceError(f"{where}: expert id {bad[0]} out of range [0, {num_experts})")
    if len(set(ids)) != len(ids):
        raise TraceError(f"{where}: an expert id appears twice in [{ids_text}]")
    return layer, _unquote(m["token"]), ids


def _parse_id(text: str, strip: bool = True) -> int:
    if strip:
        text = text.strip(" ")
    if not text.isascii() or not text.isdigit():  # int() would also take "+1", "1_0", "١"
        raise ValueError(text)
    return int(text)


def _assemble_rows(rows: list[tuple[int, str, list[int]]], name: str) -> ParsedRequest:
    """Check the layer blocks (1..L, equal sizes, same tokens) and stack them."""
    blocks: list[list[tuple[int, str, list[int]]]] = []
    starts: list[int] = []  # line number of each block's first row
    for i, row in enumerate(rows):
        if not blocks or row[0] != blocks[-1][0][0]:
            want = len(blocks) + 1
            if row[0] != want:
                after = f"after layer {want - 1}" if blocks else "as the first layer"
                raise TraceError(
                    f"{name}:{i + 2}: layer id {row[0]} {after}; layer ids must run 1, 2, ..., L in blocks"
                )
            blocks.append([])
            starts.append(i + 2)
        blocks[-1].append(row)
    n = len(blocks[0])
    for b, block in enumerate(blocks[1:], start=1):
        if len(block) != n:
            raise TraceError(
                f"{name}:{starts[b]}: layer {b + 1} has {len(block)} rows but layer 1 has {n}; "
                "every layer must list the same tokens"
            )
        for j, (row, first) in enumerate(zip(block, blocks[0])):
            if row[1] != first[1]:
                raise TraceError(
                    f"{name}:{starts[b] + j}: token {row[1]!r} differs from layer 1's token {first[1]!r} "
                    "at the same position"
                )
    ids = np.array([[row[2] for row in block] for block in blocks], dtype=np.int16)  # [L, T, K]
    return ParsedRequest(np.ascontiguousarray(ids.transpose(1, 0, 2)), [row[1] for row in blocks[0]])


# ----------------------------------------------------------------------------- fast path


def parse_fast(data: bytes, num_experts: int) -> ParsedRequest | None:
    """Vectorised parser over the raw bytes; None when the file is not plainly well formed."""
    for eol in (b"\r\n", b"\n"):
        if data.startswith(_HEADER_B + eol):
            body = data[len(_HEADER_B) + len(eol) :]
            break
    else:
        return None
    if not body or b"\0" in body:  # NUL marks blanked bytes below
        return None
    b = np.frombuffer(body, dtype=np.uint8)
    spans = _row_spans(b)
    if spans is None:
        return None
    s, e, op = spans  # [N] row start, row end without CR/LF, position of the ids' "["
    numbers = _parse_numbers(b, s, e, op, num_experts)
    if numbers is None:
        return None
    layers, ids, c2 = numbers
    nrows, k = ids.shape
    block_starts = np.concatenate([[0], np.flatnonzero(np.diff(layers)) + 1])
    num_layers = len(block_starts)
    if nrows % num_layers or not np.array_equal(layers[block_starts], np.arange(1, num_layers + 1)):
        return None
    if np.any(np.diff(np.append(block_starts, nrows)) != nrows // num_layers):
        return None
    tokens = _tokens_if_same_per_layer(body, b, c2 + 1, op - 2, num_layers)
    if tokens is None:
        return None
    expert_ids = ids.reshape(num_layers, nrows // num_layers, k).transpose(1, 0, 2).astype(np.int16)
    return ParsedRequest(np.ascontiguousarray(expert_ids), tokens)


def _row_spans(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """[N] starts, ends (CR/LF stripped) and ids "[" positions of the rows; None if malformed."""
    nl = np.flatnonzero(b == ord("\n"))
    ends = nl if b[-1] == ord("\n") else np.append(nl, len(b))
    starts = np.concatenate([[0], ends[:-1] + 1])
    has_cr = b[np.maximum(ends - 1, 0)] == ord("\r")
    e = ends - (has_cr & (ends > starts))
    if np.any(e - starts < 8):  # shortest row: 1,0,,"[0]"
        return None
    if np.any(b[e - 1] != ord('"')) or np.any(b[e - 2] != ord("]")):
        return None
    brackets = np.flatnonzero(b == ord("["))
    j = np.searchsorted(brackets, e - 2) - 1
    if np.any(j < 0):
        return None
    op = brackets[j]
    if np.any(op - 2 <= starts) or np.any(b[op - 1] != ord('"')) or np.any(b[op - 2] != ord(",")):
        return None
    return starts, e, op


_NUMERIC = b"0123456789, \0"  # bytes allowed in the ids text once everything else is blanked
_DIGITS_TO_D = bytes.maketrans(b"0123456789", b"dddddddddd")


def _plain_number_list(text: bytes) -> bool:
    """Whether `text` (digits, commas, spaces) is a comma-separated list of one number each.

    numpy's text reader is lenient in ways the reference parser is not (it reads an element of
    only spaces as 0, and stops quietly inside "0 5"), so the fast path checks the list first,
    with C-speed bytes searches: single spaces only, no empty element, no two numbers in one.
    """
    if b"  " in text or b",," in text or b", ," in text or text.endswith((b",", b", ")):
        return False
    return b"d d" not in text.translate(_DIGITS_TO_D)


def _parse_numbers(
    b: np.ndarray, s: np.ndarray, e: np.ndarray, op: np.ndarray, num_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Layer ids [N], expert ids [N, K] and the batch field's closing comma [N]; None if off.

    Blanks out everything but the "layer,batch" fields and the ids lists, puts a comma between
    rows, and lets numpy's C text parser read all numbers of the file in one call.
    """
    commas = np.concatenate([np.flatnonzero(b == ord(",")), [len(b), len(b) + 1]])  # sentinels
    c1 = commas[np.searchsorted(commas, s)]  # ends the layer field
    c2 = commas[np.searchsorted(commas, c1 + 1)]  # ends the batch field
    ids_commas = np.searchsorted(commas, e - 2) - np.searchsorted(commas, op + 1)
    k = int(ids_commas[0]) + 1
    if np.any(c2 >= op - 2) or np.any(ids_commas != k - 1):
        return None
    if not (_all_digits(b, s, c1) and _all_digits(b, c1 + 1, c2)):
        return None
    mark = np.zeros(len(b) + 1, dtype=np.int8)
    mark[s] += 1
    mark[c2] -= 1
    mark[op + 1] += 1
    mark[e - 2] -= 1  # an empty ids list has op + 1 == e - 2 and cancels out
    keep = np.cumsum(mark[:-1], dtype=np.int8).view(bool)
    kept = b * keep  # blanked bytes become NUL (a multiply is much faster than np.where)
    kept[c2] = ord(",")
    kept[e[:-1] - 2] = ord(",")  # separates rows; the last row's "]" stays blank
    text = kept.tobytes()
    if text.translate(None, _NUMERIC):  # anything but digits, commas, spaces and blanks left
        return None
    text = text.translate(None, b"\0")  # "1,0,8, 26, 43,2,0,8, 26, 43": numbers, commas, spaces
    if not _plain_number_list(text):
        return None
    # With `count`, numpy raises on text it cannot read instead of warning and stopping early
    # (warning filters are process-global: not something to toggle in threads). Reading the
    # sentinel after the last comma proves that the whole text was read.
    count = len(s) * (k + 2)
    try:
        values = np.fromstring(text + b",0", dtype=np.int64, sep=",", count=count + 1)
    except ValueError:
        return None
    values = values[:count].reshape(len(s), k + 2)
    ids = values[:, 2:]
    if np.any(ids >= num_experts):
        return None
    srt = np.sort(ids, axis=1)
    if np.any(srt[:, 1:] == srt[:, :-1]):
        return None
    return values[:, 0], ids, c2


def _all_digits(b: np.ndarray, lo: np.ndarray, hi: np.ndarray, max_len: int = 4) -> bool:
    """Whether every field b[lo:hi] is 1..max_len ASCII digits (spaces or signs are not)."""
    n = hi - lo
    if n.min() < 1 or n.max() > max_len:
        return False
    pos = np.arange(int(n.max()))
    chars = b[np.minimum(lo[:, None] + pos, hi[:, None] - 1)]  # [N, width], short rows repeat a digit
    return bool(np.all((chars >= ord("0")) & (chars <= ord("9"))))


def _tokens_if_same_per_layer(
    body: bytes, b: np.ndarray, lo: np.ndarray, hi: np.ndarray, num_layers: int
) -> list[str] | None:
    """Token strings of the first layer, or None unless every layer repeats them byte for byte."""
    n = hi - lo
    per_layer = n.reshape(num_layers, -1)
    if np.any(per_layer != per_layer[0]):
        return None
    total = int(n.sum())
    if total:
        idx = np.arange(total) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)
        token_bytes = b[idx].reshape(num_layers, -1)
        if np.any(token_bytes != token_bytes[0]):
            return None
    tokens = []
    for start, stop in zip(lo[: per_layer.shape[1]].tolist(), hi[: per_layer.shape[1]].tolist()):
        try:
            field = body[start:stop].decode("utf-8")
        except UnicodeDecodeError:
            return None
        if _TOKEN_RE.fullmatch(field) is None:
            return None
        tokens.append(_unquote(field))
    return tokens
