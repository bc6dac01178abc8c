"""Choosing indices in one row of token weights: the k largest, the nucleus (top-p), a weighted draw; each in one or
two passes over the vocabulary."""

from __future__ import annotations

import numpy as np

_BLOCK = 256
_BINS_PER_NAT = 32
_NUM_BINS = 40 * _BINS_PER_NAT


def top_k_indices(values: np.ndarray, k: int, keep_ties: bool = False) -> np.ndarray:
    """Indices of the k largest finite values, largest first (ties: lower index first); keep_ties: also those equal
    to the k-th (as transformers' and vLLM's top-k filters keep them). Avoids a full partition."""
    finite = np.count_nonzero(values > -np.inf)
    if finite <= k:
        candidates = np.flatnonzero(values > -np.inf)
    else:
        top = float(values.max())
        cap = 4 * k + 256
        near, far = 0.0, 1.0  # count(values >= top - near) < k; widen `far` until it holds at least k
        while (count := np.count_nonzero(values >= top - far)) < k:
            near, far = far, far * 2
        for _ in range(24):
            if count <= cap:
                break
            mid = (near + far) / 2
            mid_count = np.count_nonzero(values >= top - mid)
            if mid_count >= k:
                far, count = mid, mid_count
            else:
                near = mid
        candidates = np.flatnonzero(values >= top - far)  # every value tied with the k-th too
    ordered = candidates[np.argsort(-values[candidates], kind="stable")]
    if keep_ties and ordered.size > k:
        k = int(np.count_nonzero(values[ordered] >= values[ordered[k - 1]]))
    return ordered[:k]


def _search(cumulative: np.ndarray, weights: np.ndarray, target: float) -> int:
    i = int(np.searchsorted(cumulative, target, side="right"))
    if i >= weights.size:  # float rounding at the top end: take the last token with weight
        i = int(np.flatnonzero(weights > 0)[-1])
    return i


def draw(weights: np.ndarray, u: float) -> int:
    """Index i with probability weights[i] / sum, for u uniform in [0, 1). Blocked so large rows need one pass."""
    if weights.size <= 4 * _BLOCK:
        cumulative = np.cumsum(weights, dtype=np.float64)
        return _search(cumulative, weights, u * cumulative[-1])
    whole = weights.size // _BLOCK * _BLOCK
    block_sums = np.append(weights[:whole].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64),
                           weights[whole:].sum(dtype=np.float64))
    cumulative = np.cumsum(block_sums)
    target = u * cumulative[-1]
    block = _search(cumulative, block_sums, target)
    inner = weights[block * _BLOCK : (block + 1) * _BLOCK]
    inner_target = target - (cumulative[block - 1] if block else 0.0)
    return block * _BLOCK + _search(np.cumsum(inner, dtype=np.float64), inner, inner_target)


def nucleus(log_weights: np.ndarray, weights: np.ndarray, target: float, bins: np.ndarray) -> np.ndarray:
    """Indices of the smallest set of heaviest tokens whose weight sum reaches target (ties: lower index first).

    Buckets log-weights into narrow bins (one weighted bincount) so only the bin where the sum crosses is sorted.
    Overwrites log_weights and bins (scratch rows).
    """
    np.multiply(log_weights, np.float32(-_BINS_PER_NAT), out=log_weights)
    np.minimum(log_weights, np.float32(_NUM_BINS - 1), out=log_weights)
    bins[...] = log_weights
    cumulative = np.cumsum(np.bincount(bins, weights=weights, minlength=_NUM_BINS))
    edge_bin = min(int(np.searchsorted(cumulative, target)), _NUM_BINS - 1)
    edge = np.flatnonzero(bins == edge_bin)
    edge = edge[np.argsort(-weights[edge], kind="stable")]
    mass_before = (cumulative[edge_bin - 1] if edge_bin else 0.0) + np.cumsum(weights[edge], dtype=np.float64)
    mass_before -= weights[edge]
    return np.concatenate([np.flatnonzero(bins < edge_bin), edge[mass_before < target]])
