"""A float head's greedy shortcut (the sequence graph, onnxruntime): the vocabulary screened with an int8 copy of the
head, the best rows rescored in float, the argmax certified to be the float head's.

For a greedy step whose logits nothing transforms, the runtime sets the `greedy` input. The graph then
  1. rounds the hidden state x to 8 bits twice (symmetric, per tensor: x̂ = x̂₁ + x̂₂, the second of what the first
     left, as a hidden state's outliers set a coarse first scale) and multiplies both by the head rounded to int8 per
     row (ŵ = s·q) in one MatMulInteger: approx_r = ŵ_r·x̂, reading a quarter of the float head's bytes;
  2. bounds each row's error, |w_r·x − ŵ_r·x̂| ≤ |(w_r − ŵ_r)·x| + |ŵ_r·(x − x̂)| ≤ ‖w_r − ŵ_r‖‖x‖ + ‖ŵ_r‖‖x − x̂‖
     (Cauchy–Schwarz; the two row norms are stored), so upper_r = approx_r + bound_r ≥ w_r·x;
  3. takes the K rows of largest upper bound, computes their logits in float from the head itself, and keeps them
     when the best of them exceeds every other row's upper bound (with a margin for float rounding): then no other
     row can be the argmax. The logits are those K values, −inf elsewhere.
Otherwise (not certified, or `greedy` false) the float head runs as without the shortcut. The tokens are the float
head's argmax either way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import TensorProto, numpy_helper

from camshaft.builder.graph.ops import GraphWriter

MARGIN = 1e-3  # float32 rounding of the logits and of the bounds, far below it for any real model
MOST_ROWS = 64  # rescored in float: all of SmolLM2's greedy steps on random prompts certify with 64


def screened_rows(vocab_size: int) -> int:
    """K for a vocabulary; 0 where the screen would save nothing (a tiny vocabulary)."""
    rows = min(MOST_ROWS, vocab_size // 4)
    return rows if rows >= 16 else 0


def screened_logits(g: GraphWriter, x: str, head: np.ndarray, rows_of: Callable[[str], str], greedy: str,
                    full: Callable[[], str]) -> str:
    """Logits [N, vocab] of the hidden states `x` [N, hidden]: `full()` writes the float head's nodes; `head` is its
    matrix [vocab, hidden] and `rows_of(ids)` gathers its rows [N, K, hidden] in float."""
    vocab = head.shape[0]
    k = screened_rows(vocab)
    scale, codes, error_norm, rounded_norm = _rounded_head(head)

    def screen() -> str:
        table = g.weight("lm_head.screen_codes", np.ascontiguousarray(codes.T))  # [hidden, vocab]
        codes_x, scales_x, rest = [], [], x
        for _ in range(2):  # x, then what its rounding left: a hidden state's outliers set a coarse first scale
            step = g.op("Max", [g.op("Div", [g.op("ReduceMax", [g.op("Abs", [rest])], keepdims=0),
                                             g.const(np.float32(127), "q127")]), g.const(np.float32(1e-30), "tiny")])
            level = g.op("Round", [g.op("Div", [rest, step])])  # [-127, 127]: symmetric, so one zero point (128)
            codes_x.append(g.op("Cast", [g.op("Add", [level, g.const(np.float32(128), "q128")])],
                                to=TensorProto.UINT8))
            scales_x.append(step)
            rest = g.op("Sub", [rest, g.op("Mul", [level, step])])
        zero = g.const(np.uint8(128), "zero128")
        both = g.op("MatMulInteger", [g.op("Concat", codes_x, axis=0), table, zero, zero])
        first, second = g.op("Split", [g.op("Cast", [both], to=TensorProto.FLOAT)], n_out=2, axis=0, num_outputs=2)
        approx = g.op("Mul", [g.op("Add", [g.op("Mul", [first, scales_x[0]]), g.op("Mul", [second, scales_x[1]])]),
                              g.weight("lm_head.screen_scales", scale)])
        norms = g.op("ReduceL2", [x, g.ints([1])], keepdims=1)  # [N, 1]
        off = g.op("ReduceL2", [rest, g.ints([1])], keepdims=1)
        upper = g.op("Add", [approx, g.op("Add", [
            g.op("Mul", [norms, g.weight("lm_head.screen_error_norms", error_norm)]),
            g.op("Mul", [off, g.weight("lm_head.screen_row_norms", rounded_norm)])])])
        bounds, ids = g.op("TopK", [upper, g.ints([k + 1])], n_out=2, axis=-1)
        ids = g.op("Slice", [ids, g.ints([0]), g.ints([k]), g.ints([1])])
        others = g.op("Slice", [bounds, g.ints([k]), g.ints([k + 1]), g.ints([1])])  # the best row left out
        exact = g.op("Squeeze", [g.op("MatMul", [g.op("Unsqueeze", [x, g.ints([1])]),
                                                 g.op("Transpose", [rows_of(ids)], perm=[0, 2, 1])]), g.ints([1])])
        best = g.op("ReduceMax", [exact, g.ints([1])], keepdims=1)
        margin = g.op("Add", [others, g.op("Mul", [g.op("Abs", [others]), g.const(np.float32(MARGIN), "margin")])])
        certain = g.op("ReduceMin", [g.op("Cast", [g.op("Greater", [best, g.op("Add", [
            margin, g.const(np.float32(MARGIN), "margin")])])], to=TensorProto.INT32)], keepdims=0)
        blank = g.op("ConstantOfShape", [g.op("Shape", [approx])],
                     value=numpy_helper.from_array(np.array([-np.inf], dtype=np.float32)))
        sparse = g.op("ScatterElements", [blank, ids, exact], axis=1)
        doubt = g.op("Not", [g.op("Cast", [certain], to=TensorProto.BOOL)])
        return g.branch(doubt, full, sparse, TensorProto.FLOAT)

    return g.branches(greedy, screen, full, TensorProto.FLOAT)


def _rounded_head(head: np.ndarray, chunk: int = 8192) -> tuple[np.ndarray, ...]:
    """Per row of the head: its int8 scale s, its codes q + 128 as uint8 (zero point 128: a uint8 x uint8 product is
    exact on every CPU, where uint8 x int8 sums pairs in int16 with saturation on x86 without VNNI, which would break
    the bound), and the norms of the rounding error w − s·q and of s·q; in chunks of rows (a large vocabulary's
    float64 temporaries stay small)."""
    vocab = head.shape[0]
    scale = np.empty(vocab, np.float32)
    codes = np.empty(head.shape, np.uint8)
    error_norm, rounded_norm = np.empty(vocab, np.float32), np.empty(vocab, np.float32)
    for start in range(0, vocab, chunk):
        rows = head[start: start + chunk].astype(np.float32)
        s = np.abs(rows).max(axis=1) / 127
        s[s == 0] = 1
        q = np.clip(np.rint(rows / s[:, None]), -127, 127)
        rounded = q * s[:, None]
        scale[start: start + chunk] = s
        codes[start: start + chunk] = (q + 128).astype(np.uint8)
        error_norm[start: start + chunk] = _up(np.linalg.norm(rows.astype(np.float64) - rounded, axis=1))
        rounded_norm[start: start + chunk] = _up(np.linalg.norm(rounded.astype(np.float64), axis=1))
    return scale, codes, error_norm, rounded_norm


def _up(values: np.ndarray) -> np.ndarray:
    """float32 values no smaller than `values` (float64): a bound stays a bound."""
    low = values.astype(np.float32)
    return np.where(low < values, np.nextafter(low, np.float32(np.inf)), low)
