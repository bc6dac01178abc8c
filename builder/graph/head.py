"""The output projection (lm_head), float or rounded to nearest at build time (`--lm-head int8|int4`).

With tied embeddings the embedding table stays float for the input Gather; a quantized head gets its own integer
copy. ONNX Runtime: one MatMulNBits; TensorRT targets: DequantizeLinear (int4 blocked, int8 per row) → MatMul.
"""

from __future__ import annotations

from camshaft.builder.graph.linear import LOWERINGS, Linears
from camshaft.builder.quantized import LM_HEAD_FORMATS, round_to_nearest
from camshaft.errors import BuildConfigError
from camshaft.model_config import ModelConfig
from camshaft.quantize.spec import check_lm_head


def head_weight_name(config: ModelConfig) -> str:
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


class Head:
    def __init__(self, linears: Linears, config: ModelConfig, lm_head: str) -> None:
        check_lm_head(lm_head, config, BuildConfigError)
        self.linears, self.c, self.dtype = linears, config, lm_head
        self.record: dict = {"dtype": "float"}

    def lower(self, x: str, embed: str) -> str:
        """Logits [N, vocab] from the final normed hidden states `x`; `embed` is the graph's embedding table."""
        linears, c = self.linears, self.c
        g = linears.g
        if self.dtype == "float":
            if c.tie_word_embeddings:
                return g.op("Gemm", [x, embed], transB=1)
            return g.op("MatMul", [x, g.weight("lm_head", linears.float_weight("lm_head.weight",
                                                                             (c.vocab_size, c.hidden_size)))])
        fmt = LM_HEAD_FORMATS[self.dtype]
        weight = linears.weights(head_weight_name(c), (c.vocab_size, c.hidden_size))
        q = round_to_nearest(weight, fmt.bits, fmt.block_size or c.hidden_size, full_range=not linears.qdq)
        if linears.qdq:
            kind, level, y = "qdq", None, linears.qdq_matmul(x, [q], "lm_head", c.hidden_size)
        else:
            level = linears.accuracy_level if fmt.accuracy_level is None else fmt.accuracy_level
            kind, y = "nbits", linears.matmul_nbits(x, [q], "lm_head", c.hidden_size, accuracy_level=level)
        self.record = {"dtype": self.dtype, "block_size": fmt.block_size,
                       "rounding": "nearest at build time, symmetric, "
                                   + ("amax / (2^(bits-1) - 1)" if linears.qdq else "full range"),
                       "lowering": LOWERINGS[kind], "accuracy_level": level,
                       "activations": "int8 per block (MatMulNBits accuracy level 4)" if level == 4 else None}
        return y

