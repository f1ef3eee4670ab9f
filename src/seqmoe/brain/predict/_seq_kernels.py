"""Compiled inference of `SeqPredictor` with a forecast window (numba, float32, fastmath).

fastmath lets the dot products vectorise (about 10x faster than scalar loops); their sums are
therefore reassociated and differ from numpy's BLAS in the last bits. The reference inference
(`window=None`) keeps the numpy path.
"""

from __future__ import annotations

import functools
import math

import numba as nb
import numpy as np


@nb.njit(cache=True, fastmath=True)
def add_rows(acc, table, base, ids):
    """acc [D] += sum of table[base + ids] (ids [K] ints, rows of table [N, D])."""
    for i in ids:
        acc += table[base + i]


@nb.njit(cache=True, fastmath=True)
def _dot(w, z):
    s = np.float32(0.0)
    for i in range(z.shape[0]):
        s += w[i] * z[i]
    return s


@nb.njit(cache=True, fastmath=True)
def query(pre, norm_w, norm_b, mlp_w, mlp_b):
    """[Z] float32 pre-activation -> [Z] float32 query vector: LayerNorm, relu, residual relu MLP
    (`SeqPredictor._query`). Every scalar is float32: numba would widen a mixed expression to float64."""
    Z = pre.shape[0]
    zf = np.float32(Z)
    mean = pre.sum() / zf
    a = np.empty(Z, dtype=np.float32)
    for i in range(Z):
        a[i] = pre[i] - mean
    scale = np.float32(1.0) / np.float32(np.sqrt(_dot(a, a) / zf + np.float32(1e-5)))
    z1 = np.empty(Z, dtype=np.float32)
    for i in range(Z):
        z1[i] = max(a[i] * scale * norm_w[i] + norm_b[i], np.float32(0.0))
    z = z1.copy()
    for i in range(Z):
        h = _dot(mlp_w[i], z1) + mlp_b[i]
        if h > 0:
            z[i] += h
    return z


@nb.njit(cache=True, fastmath=True)
def _probs(row, K):
    """In place: logits [E] -> K * softmax, clipped at 1 (`seqmodel.layer_probs`)."""
    E = row.shape[0]
    top = row.max()
    s = np.float32(0.0)
    for e in range(E):
        v = np.float32(math.exp(row[e] - top))
        row[e] = v
        s += v
    scale = np.float32(K) / s
    for e in range(E):
        row[e] = min(row[e] * scale, np.float32(1.0))


@nb.njit(cache=True, fastmath=True)
def refresh_rows(base, q_acc, q_layer, norm_w, norm_b, mlp_w, mlp_b, out_w, out_b, first, count, E, K, rows):
    """rows[first .. first + count - 1] = the forecast of those positions from the query at
    `first` (pre-activation base + q_acc + q_layer): one call per layer in window mode."""
    z = query(base + q_acc + q_layer, norm_w, norm_b, mlp_w, mlp_b)
    for r in range(first, first + count):
        row = rows[r]
        for e in range(E):
            row[e] = _dot(out_w[r * E + e], z) + out_b[r * E + e]
        _probs(row, K)


@nb.njit(cache=True, fastmath=True)
def _sigmoid(x):
    return np.float32(0.5) * (np.float32(1.0) + np.float32(np.tanh(np.float32(0.5) * x)))


@nb.njit(cache=True, fastmath=True)
def gru_step(w_ih, w_hh, b_ih, b_hh, h, x):
    """One GRU step with PyTorch's gate layout (r, z, n), float32 (`seqmodel.gru_step`): [H] state,
    [D] input -> [H] new state."""
    H = h.shape[0]
    out = np.empty(H, dtype=np.float32)
    for i in range(H):
        r = _sigmoid(_dot(w_ih[i], x) + b_ih[i] + _dot(w_hh[i], h) + b_hh[i])
        z = _sigmoid(_dot(w_ih[H + i], x) + b_ih[H + i] + _dot(w_hh[H + i], h) + b_hh[H + i])
        j = 2 * H + i
        n = np.float32(np.tanh(_dot(w_ih[j], x) + b_ih[j] + r * (_dot(w_hh[j], h) + b_hh[j])))
        out[i] = (np.float32(1.0) - z) * n + z * h[i]
    return out


@nb.njit(cache=True, fastmath=True)
def token_base(q_h_w, q_h_b, q_tok_row, h):
    """[Z] the query's pre-activation fixed for a token: q_h_w h + q_h_b + q_tok[bucket]."""
    Z = q_h_b.shape[0]
    out = np.empty(Z, dtype=np.float32)
    for i in range(Z):
        out[i] = _dot(q_h_w[i], h) + q_h_b[i] + q_tok_row[i]
    return out


@nb.njit(cache=True, fastmath=True)
def drafted_rows(x_fixed, rest_probs, route_in, first_uid, w_ih, w_hh, b_ih, b_hh, h, q_h_w, q_h_b, q_fixed,
                 norm_w, norm_b, mlp_w, mlp_b, out_w, out_b, L, E, K):
    """[L, E] the next token's forecast given its guessed token (`SeqPredictor._direct`'s drafted rows):
    the GRU steps on the current token's input (x_fixed, its routing so far and token, plus the forecast
    of its layers ahead, rest_probs [R, E] from uid first_uid on), then the query at the next token
    (q_fixed = q_tok[guess] + q_layer[0]) forecasts row block 0."""
    x = x_fixed.copy()
    R = rest_probs.shape[0]
    for r in range(R):
        for e in range(E):
            p = rest_probs[r, e]
            if p != 0:
                x += p * route_in[first_uid + r * E + e]
    base = token_base(q_h_w, q_h_b, q_fixed, gru_step(w_ih, w_hh, b_ih, b_hh, h, x))
    rows = np.empty((L, E), dtype=np.float32)
    refresh_rows(base, np.zeros_like(base), np.zeros_like(base), norm_w, norm_b, mlp_w, mlp_b, out_w, out_b,
                 0, L, E, K, rows)
    return rows


@functools.cache
def warm_up() -> None:
    """Call each kernel once with the argument types `SeqPredictor` passes: numba loads a cached
    kernel at its first call (a tenth of a second), which must not land in timed decisions."""
    f32 = np.float32
    Z, E = 4, 3
    vec, mat = np.zeros(Z, f32), np.zeros((2 * E, Z), f32)
    add_rows(vec, mat, 0, np.zeros(1, np.int16))
    refresh_rows(vec, vec, vec, vec, vec, np.zeros((Z, Z), f32), vec, mat, np.zeros(2 * E, f32), 0, 1, E, 1,
                 np.zeros((2, E), f32))
    gates, gate_b = np.zeros((3 * Z, Z), f32), np.zeros(3 * Z, f32)
    gru_step(gates, gates, gate_b, gate_b, vec, vec)
    token_base(np.zeros((Z, Z), f32), vec, vec, vec)
    drafted_rows(vec, np.zeros((1, E), f32), np.zeros((2 * E, Z), f32), 0, gates, gates, gate_b, gate_b, vec,
                 np.zeros((Z, Z), f32), vec, vec, vec, vec, np.zeros((Z, Z), f32), vec, mat, np.zeros(2 * E, f32),
                 1, E, 1)
