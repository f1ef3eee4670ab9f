"""Predictions made elsewhere, replayed: one predicted expert set per (token, layer) of the replayed trace.

Two layouts are read (docs/DESIGN.md, "External predictions"):

- MoE-Beyond's predicted CSVs (a folder of `prompt_N_data_predicted.csv`, natural order, one request
  per file): `Layer ID,Token,Activated Expert IDs,Predicted Expert IDs`, layer ids 1..L;
- seqmoe's: a .safetensors file holding `predicted_ids` [T, L, P] int (the P experts predicted for
  each token and layer of the trace, in its order) and `request_offsets` [R + 1] int64.

The predictions must be of the replayed trace: MoE-Beyond's files are matched to its requests by their
activated experts (each file's must equal one request's routing); seqmoe's must be in the trace's order.

    predicted = load_predictions(path, trace)             # [T, L, P] int64
    predictor = ExternalPredictor(predicted, trace.request_offsets, num_experts=E)
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import numpy as np

from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.trace.importers import files_under
from seqmoe.trace.schema import RoutingTrace, TraceError

MOE_BEYOND_HEADER = ["Layer ID", "Token", "Activated Expert IDs", "Predicted Expert IDs"]
_IDS = re.compile(r"\d+")


def load_predictions(path, trace: RoutingTrace) -> np.ndarray:
    """[T, L, P] int64 predicted expert ids for every token and layer of `trace` (checked against it)."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"no such predictions file or folder: {path}")
    if path.suffix == ".safetensors":
        predicted, offsets = _read_safetensors(path)
    else:
        predicted, offsets = _match_csvs(path, trace)
    if not np.array_equal(offsets, trace.request_offsets):
        raise TraceError(f"{path}: the predictions hold {len(offsets) - 1} requests of {np.diff(offsets)[:5].tolist()}"
                         f"... tokens, the replayed trace {trace.num_requests} of "
                         f"{np.diff(trace.request_offsets)[:5].tolist()}...: predictions must be of the replayed trace")
    if predicted.shape[1] != trace.num_layers or predicted.min() < 0 or predicted.max() >= trace.num_experts:
        raise TraceError(f"{path}: predictions of {predicted.shape[1]} layers with ids {predicted.min()}.."
                         f"{predicted.max()}, but the trace has {trace.num_layers} layers of {trace.num_experts} experts")
    return predicted


def _match_csvs(path: Path, trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """MoE-Beyond's predicted CSVs put in the order of `trace`'s requests: each file goes to the request whose
    routing equals its activated experts (their files are numbered apart from the routing's)."""
    files = files_under(path, "*.csv") if path.is_dir() else [path]
    if not files:
        raise TraceError(f"no .csv files under {path}; expected MoE-Beyond prompt_N_data_predicted.csv files")
    off = trace.request_offsets
    by_routing = {}
    for r in range(trace.num_requests):
        key = np.sort(trace.expert_ids[off[r]:off[r + 1]].astype(np.int64), axis=-1).tobytes()
        by_routing.setdefault(key, []).append(r)
    placed: dict[int, np.ndarray] = {}
    for f in files:
        predicted, actual = _read_csv(f, trace.num_layers)
        matches = by_routing.get(np.sort(actual, axis=-1).tobytes(), [])
        if not matches:
            raise TraceError(f"{f}: its activated experts match no request of the replayed trace: predictions must "
                             "be of the replayed trace")
        placed[matches.pop(0)] = predicted
    missing = [r for r in range(trace.num_requests) if r not in placed]
    if missing:
        raise TraceError(f"{path}: no predictions for {len(missing)} of the trace's {trace.num_requests} requests "
                         f"(the first: request {missing[0]})")
    return np.concatenate([placed[r] for r in range(trace.num_requests)]), off


def _read_safetensors(path: Path) -> tuple[np.ndarray, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        data = load_file(str(path))
        predicted, offsets = data["predicted_ids"], data["request_offsets"]
    except KeyError as e:
        raise TraceError(f"{path}: no tensor {e}; a predictions file holds predicted_ids [T, L, P] and "
                         "request_offsets [R + 1]") from None
    except Exception as e:  # safetensors' own errors name no file
        raise TraceError(f"{path}: not a readable .safetensors file ({e})") from None
    if predicted.ndim != 3 or offsets.ndim != 1 or offsets[0] != 0 or offsets[-1] != len(predicted):
        raise TraceError(f"{path}: predicted_ids must be [T, L, P] and request_offsets [R + 1] from 0 to T; got "
                         f"{list(predicted.shape)} and {list(offsets.shape)}")
    return predicted.astype(np.int64), offsets.astype(np.int64)


def _read_csv(path: Path, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """([T, L, P] predicted, [T, L, K] activated) of one MoE-Beyond predicted CSV."""
    try:
        rows = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))))
    except (UnicodeDecodeError, csv.Error) as e:
        raise TraceError(f"{path}: not a CSV file of text ({e})") from None
    if not rows or rows[0] != MOE_BEYOND_HEADER:
        raise TraceError(f"{path}:1: wrong header {rows[0] if rows else ''}; expected {','.join(MOE_BEYOND_HEADER)}")
    try:
        layer = np.array([int(r[0]) for r in rows[1:]]) - 1
        token = np.array([int(r[1]) for r in rows[1:]])
        actual = np.array([[int(x) for x in _IDS.findall(r[2])] for r in rows[1:]])
        predicted = np.array([[int(x) for x in _IDS.findall(r[3])] for r in rows[1:]])
    except (ValueError, IndexError):
        raise TraceError(f"{path}: every row needs a layer id, a token index and two bracketed id lists of equal "
                         "length per column") from None
    num_tokens = int(token.max()) + 1 if len(token) else 0
    if (len(rows) < 2 or layer.min() < 0 or layer.max() >= num_layers or predicted.ndim != 2 or actual.ndim != 2
            or len(rows) - 1 != num_tokens * num_layers):
        raise TraceError(f"{path}: expected one row per (layer 1..{num_layers}, token) with fixed-size id lists")
    out_p = np.zeros((num_tokens, num_layers, predicted.shape[1]), dtype=np.int64)
    out_a = np.zeros((num_tokens, num_layers, actual.shape[1]), dtype=np.int64)
    out_p[token, layer], out_a[token, layer] = predicted, actual
    return out_p, out_a


class ExternalPredictor(Predictor):
    """Replays `predicted` ([T, L, P] expert ids of the replayed trace) as a forecast with probability 1:
    at each position, the predicted sets of the next `lead` positions of the same request (at least the
    next one). Requests are counted as they begin, in the trace's order (after the last, the first again:
    a second pass), so the replay must visit them in order at batch 1, alone or with a pool reset."""

    def __init__(self, predicted: np.ndarray, request_offsets: np.ndarray, *, num_experts: int, lead: int) -> None:
        self.flat = predicted.reshape(-1, predicted.shape[2])
        self.E, self.L = num_experts, predicted.shape[1]
        self.offsets = np.asarray(request_offsets, dtype=np.int64)
        self.horizon = max(1, lead)
        self.r, self.t, self.local = -1, -1, 0  # the request; the current token's global index and its step // L

    def begin_request(self) -> None:
        self.r = (self.r + 1) % (len(self.offsets) - 1)
        self.t = int(self.offsets[self.r]) - 1

    def begin_token(self, step: int, token_id: int | None) -> None:
        self.t, self.local = self.t + 1, step // self.L
        if self.r < 0 or self.t >= self.offsets[self.r + 1]:
            raise TraceError("the replay left the predictions' request: predictions must be of the replayed trace, "
                             "replayed at batch 1 in its order")

    def observe(self, step: int, ids: np.ndarray) -> None:
        pass

    def predict(self, step: int) -> Forecast | None:
        # step is the caller's (its tokens may be numbered from anywhere: the tokens begun place it); at a token
        # start, the previous position's
        first = (self.t + step // self.L - self.local) * self.L + step % self.L + 1
        last = min(first + self.horizon, int(self.offsets[self.r + 1]) * self.L)  # not into the next request
        if last <= first:
            return None
        probs = np.zeros((last - first, self.E), dtype=np.float32)
        np.put_along_axis(probs, self.flat[first:last], 1.0, axis=1)
        return Forecast(step + 1 + np.arange(last - first, dtype=np.int64), probs)
