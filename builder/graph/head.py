"""The embedding lookup and the output projection (lm_head), float or rounded to nearest at build time
(`--lm-head int8|int4`).

ONNX Runtime: the head is one MatMulNBits; with tied embeddings the lookup reads the same integer tensor through a
GatherBlockQuantized (one quantized matrix, as the checkpoint has one float matrix: an int4 SmolLM2 engine stores no
113 MB float table; only the scales are stored twice, in the shape each operator takes). TensorRT targets:
DequantizeLinear (int4 blocked, int8 per row) → MatMul, and the lookup's table stays float.

Float channels (int4): the head's input channels `camshaft quantize` found largest are zeroed in the rounded matrix
and multiplied in float from their own [vocab, k] columns (a Gemm that adds the rounded product; the lookup adds them
back to its rows). The rounded product's input has them zeroed too, so int8 activations (accuracy level 4) are not
scaled by them.
"""

from __future__ import annotations

import numpy as np

from camshaft.builder.checkpoint import EMBED
from camshaft.builder.graph.linear import LOWERINGS, MS_DOMAIN, Linears, nbits_block
from camshaft.builder.quantized import LM_HEAD_FORMATS, QuantizedLinear, round_to_nearest
from camshaft.errors import BuildConfigError
from camshaft.model_config import ModelConfig
from camshaft.quantize.spec import LM_HEAD_FLOAT_CHANNELS, check_lm_head


def head_weight_name(config: ModelConfig) -> str:
    return EMBED if config.tie_word_embeddings else "lm_head.weight"


def check_float_channels(lm_head: str, channels: tuple[int, ...], config: ModelConfig) -> None:
    wanted = LM_HEAD_FLOAT_CHANNELS[lm_head]
    if not wanted:
        return
    if len(channels) != wanted or len(set(channels)) != wanted or not all(
            isinstance(c, int) and 0 <= c < config.hidden_size for c in channels):
        raise BuildConfigError(
            f"--lm-head {lm_head} keeps the {wanted} largest input channels float, chosen by `camshaft quantize`; "
            f"this checkpoint records {list(channels) or 'none'} (lm_head_float_channels in its camshaft_quantize.json)"
            ". Quantize the original checkpoint again with this camshaft")


class Head:
    def __init__(self, linears: Linears, config: ModelConfig, lm_head: str,
                 float_channels: tuple[int, ...] = ()) -> None:
        check_lm_head(lm_head, config, BuildConfigError)
        check_float_channels(lm_head, float_channels, config)
        self.linears, self.c, self.dtype = linears, config, lm_head
        self.channels = tuple(float_channels) if LM_HEAD_FLOAT_CHANNELS[lm_head] else ()
        self._columns: str | None = None  # the float channels' head columns [vocab, k], once written
        self.record: dict = {"dtype": "float"}
        self.shares_embedding = config.tie_word_embeddings and lm_head != "float" and not linears.qdq
        self._table: str | None = None  # the float embedding table, once written
        self._float_head: str | None = None  # an untied float head's weight, once written
        self._quantized: QuantizedLinear | None = None
        self._tensors: tuple[str, str] | None = None  # the head's MatMulNBits tensors, once written
        self._scales: np.ndarray | None = None  # their scales, flat

    def embed(self, ids: str) -> str:
        """The embedding rows of the token ids `ids` (any shape; the rows are appended as the last axis), scaled by
        the model's embed_scale (Gemma: sqrt(hidden_size), in the float type, as transformers casts it)."""
        rows = self._rows(ids)
        if self.c.embed_scale == 1.0:
            return rows
        g = self.linears.g
        return g.op("Mul", [rows, g.const(np.array(self.c.embed_scale, self.linears.np_dtype), "embed_scale")])

    def _rows(self, ids: str) -> str:
        linears, c = self.linears, self.c
        g = linears.g
        if not self.shares_embedding:
            return g.op("Gather", [self.table(), ids], axis=0)
        q = self.quantized()
        qweight, scales = self.tensors()
        block = nbits_block(q)
        # MatMulNBits' weight [vocab, blocks, block * bits / 8] as it is; scales [vocab, blocks, 1] (its rank)
        scales = g.weight("lm_head.embedding_scales", self._scales.reshape(c.vocab_size, -1, 1))
        rows = g.op("GatherBlockQuantized", [qweight, ids, scales], domain=MS_DOMAIN, bits=q.bits, block_size=block,
                    gather_axis=0, quantize_axis=2)  # [.., blocks, block]
        rows = g.op("Reshape", [rows, g.op("Concat", [g.op("Shape", [ids]), g.ints([c.hidden_size])], axis=0)])
        if not self.channels:
            return rows
        place = np.zeros((len(self.channels), c.hidden_size), dtype=linears.np_dtype)
        place[np.arange(len(self.channels)), self.channels] = 1
        floats = g.op("MatMul", [g.op("Gather", [self.columns(), ids], axis=0), g.weight("lm_head.float_place", place)])
        return g.op("Add", [rows, floats])

    def lower(self, x: str) -> str:
        """Logits [.., vocab] from the final normed hidden states `x`."""
        linears, c = self.linears, self.c
        g = linears.g
        if self.dtype == "float":
            stored = linears.quantized("lm_head", c.vocab_size, c.hidden_size)  # not in exclude_modules
            if stored is not None and not c.tie_word_embeddings:  # as the checkpoint's other quantized layers
                before = dict(linears.counts)
                y = linears.lower_quantized(x, [stored], "lm_head", c.hidden_size)
                if y is not None:
                    kind = next(k for k, n in linears.counts.items() if n != before.get(k, 0))
                    self.record = {"dtype": "as the checkpoint quantized it", "lowering": LOWERINGS[kind]}
                    return y
            if stored is not None and "lm_head" not in linears.dequantized:
                linears.dequantized.append("lm_head")  # its dequantized weight is the head
            if c.tie_word_embeddings:
                return g.op("Gemm", [x, self.table()], transB=1)
            return g.op("MatMul", [x, self.float_head()])
        fmt = LM_HEAD_FORMATS[self.dtype]
        q = self.quantized()
        if linears.qdq:
            kind, level, y = "qdq", None, linears.qdq_matmul(x, [q], "lm_head", c.hidden_size)
        else:
            level = linears.accuracy_level if fmt.accuracy_level is None else fmt.accuracy_level
            rounded = x
            if self.channels and level == 4:  # int8 activations: the float channels must not set their scales
                keep = np.ones(c.hidden_size, dtype=linears.np_dtype)
                keep[list(self.channels)] = 0
                rounded = g.op("Mul", [x, g.weight("lm_head.rounded_channels", keep)])
            kind, y = "nbits", linears.matmul_nbits(rounded, [q], "lm_head", c.hidden_size, accuracy_level=level,
                                                    tensors=self.tensors())
        if self.channels:
            picked = g.op("Gather", [x, g.const(np.array(self.channels, dtype=np.int64), "lm_head_channels")], axis=-1)
            y = g.op("Gemm", [picked, self.columns(), y], transB=1)  # picked @ columns^T + y
        self.record = {"dtype": self.dtype, "block_size": fmt.block_size,
                       "rounding": "nearest at build time, symmetric, "
                                   + ("amax / (2^(bits-1) - 1)" if linears.qdq else "full range"),
                       "lowering": LOWERINGS[kind], "accuracy_level": level,
                       "activations": f"int8 per block of {nbits_block(q)} (MatMulNBits accuracy level 4)"
                       if level == 4 else None,
                       "float_channels": list(self.channels),
                       "embedding": "the head's tensors (GatherBlockQuantized)" if self.shares_embedding else "float"}
        return y

    def float_head(self) -> str:
        """An untied float head's weight [hidden, vocab] (MatMul's layout), once written."""
        if self._float_head is None:
            c = self.c
            weight = self.linears.float_weight("lm_head.weight", (c.vocab_size, c.hidden_size))
            self._float_head = self.linears.g.weight("lm_head", weight)
        return self._float_head

    def float_rows(self, ids: str) -> str:
        """A float head's rows `ids` [N, K] as [N, K, hidden], read from the tensor the head itself reads."""
        g = self.linears.g
        if self.c.tie_word_embeddings:
            return g.op("Gather", [self.table(), ids], axis=0)
        return g.op("Transpose", [g.op("Gather", [self.float_head(), ids], axis=1)], perm=[1, 2, 0])

    def table(self) -> str:
        if self._table is None:
            linears, c = self.linears, self.c
            weight = linears.weights(EMBED, (c.vocab_size, c.hidden_size)).astype(linears.np_dtype)
            self._table = linears.g.weight("embed_tokens", weight)
        return self._table

    def quantized(self) -> QuantizedLinear:
        if self._quantized is None:
            fmt, c = LM_HEAD_FORMATS[self.dtype], self.c
            weight = self.weight()
            if self.channels:
                weight = weight.astype(np.float32)  # a copy: the checkpoint's array stays as read
                weight[:, list(self.channels)] = 0
            self._quantized = round_to_nearest(weight, fmt.bits, fmt.block_size or c.hidden_size,
                                               full_range=not self.linears.qdq)
        return self._quantized

    def columns(self) -> str:
        """The float channels' columns of the head, [vocab, k]."""
        if self._columns is None:
            columns = np.ascontiguousarray(self.weight()[:, list(self.channels)]).astype(self.linears.np_dtype)
            self._columns = self.linears.g.weight("lm_head.float_columns", columns)
        return self._columns

    def weight(self) -> np.ndarray:
        """The checkpoint's head matrix [vocab, hidden], as read."""
        c = self.c
        return self.linears.weights(head_weight_name(c), (c.vocab_size, c.hidden_size))

    def tensors(self) -> tuple[str, str]:
        if self._tensors is None:
            q, g = self.quantized(), self.linears.g
            qweight, self._scales = self.linears.nbits_tensors([q], nbits_block(q))
            self._tensors = g.weight("lm_head.qweight", qweight), g.weight("lm_head.scales", self._scales)
        return self._tensors
