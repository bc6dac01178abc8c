"""The engine's I/O signature: its graphs' inputs and the K/V cache tensors each binds as input and output, as the
manifest records them and the runtime builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from camshaft.checks import check_positive_ints


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[str | int, ...]


# Name, dtype and symbolic shape of every non-cache input; the runtime builds exactly these.
STEP_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("input_ids", "int64", ("T",)),
    TensorSpec("positions", "int64", ("T",)),
    TensorSpec("kv_write_index", "int64", ("T", 2)),
    TensorSpec("logits_index", "int64", ("N",)),
    TensorSpec("decode_token_index", "int64", ("Bd",)),
    TensorSpec("decode_block_tables", "int64", ("Bd", "NBd")),
    TensorSpec("decode_mask", "bool", ("Bd", 1, 1, "Ld")),
    TensorSpec("prefill_token_index", "int64", ("Bp", "Qp")),
    TensorSpec("prefill_block_tables", "int64", ("Bp", "NBp")),
    TensorSpec("prefill_mask", "bool", ("Bp", 1, "Qp", "Lp")),
    TensorSpec("attn_output_index", "int64", ("T",)),
)
# Whether each attention group holds sequences this step. Graphs that branch on them (the onnxruntime target) skip
# an empty group's nodes; the others compute it on a one-token dummy the runtime feeds (runtime/batch.py).
GROUP_FLAGS: tuple[TensorSpec, ...] = (
    TensorSpec("has_decode", "bool", ()),
    TensorSpec("has_prefill", "bool", ()),
)
SLIDING_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("decode_mask_sliding", "bool", ("Bd", 1, 1, "Ld")),
    TensorSpec("prefill_mask_sliding", "bool", ("Bp", 1, "Qp", "Lp")),
)
# A LongRoPE model built for sequences past its original context: per token, the first position its sequence rotates
# with the long factors (RopeConfig.long_rope_from).
LONG_ROPE_INPUTS: tuple[TensorSpec, ...] = (TensorSpec("long_rope_from", "int64", ("T",)),)
# The sequence graph's inputs besides its cache: the step's tokens, tokens in the cache after the step (- 1, then
# all), and how many of the last tokens get logits (engines built before it had one row: no prompt lookup).
SEQUENCE_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("input_ids", "int64", (1, "S")),
    TensorSpec("seqlens_k", "int32", (1,)),
    TensorSpec("total_sequence_length", "int32", ()),
    TensorSpec("num_logits", "int64", (1,)),
    TensorSpec("greedy", "bool", ()),  # a float head's greedy shortcut (builder/graph/screen.py); older engines lack it
    TensorSpec("long_rope_from", "int64", (1,)),  # as LONG_ROPE_INPUTS, for the one sequence; only where they are
)


CACHE_NAMES = ("key_inputs", "value_inputs", "key_outputs", "value_outputs")


@dataclass(frozen=True)
class CacheTensors:
    """Per layer one K and one V tensor, each bound as both a graph input and output (updated in place)."""

    num_kv_heads: int
    head_dim: int
    key_inputs: tuple[str, ...]
    value_inputs: tuple[str, ...]
    key_outputs: tuple[str, ...]
    value_outputs: tuple[str, ...]

    @staticmethod
    def names(num_layers: int, *patterns: str) -> dict[str, tuple[str, ...]]:
        """The four per-layer name tuples from patterns with `{}` for the layer (key in, value in, key out, value
        out)."""
        return {field: tuple(p.format(i) for i in range(num_layers)) for field, p in zip(CACHE_NAMES, patterns,
                                                                                         strict=True)}

    def bytes_per_token(self, itemsize: int) -> int:
        return 2 * len(self.key_inputs) * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        return cls(**{**data, **{key: tuple(data[key]) for key in CACHE_NAMES}})


@dataclass(frozen=True, kw_only=True)
class KVCacheLayout(CacheTensors):
    """The batch graph's paged cache: each tensor [num_blocks, block_size, num_kv_heads * head_dim].

    Block 0 is the null block: padding in block tables points at it and it is never allocated. `dtype` is the
    engine's float type, or int8 / float8 for a quantized cache (float8: e4m3fn bit patterns in uint8 tensors).
    """

    dtype: str
    block_size: int
    layout: str = "num_blocks,block_size,num_kv_heads*head_dim"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("num_kv_heads", "head_dim", "block_size"),
                            label=lambda name: f"KVCacheLayout.{name}")

    def bytes_per_block(self, itemsize: int) -> int:
        return self.block_size * self.bytes_per_token(itemsize)


@dataclass(frozen=True, kw_only=True)
class SequenceGraph(CacheTensors):
    """The onnxruntime target's second graph, for one sequence at a time (Session): each cache tensor
    [1, num_kv_heads, L, head_dim] of float32, contiguous, L at least the sequence's length."""

    artifact: str
    inputs: tuple[TensorSpec, ...]
    layout: str = "1,num_kv_heads,L,head_dim"

    @property
    def checks_drafts(self) -> bool:
        """Whether it returns logits for several last tokens (`num_logits`): engines built before have one row."""
        return any(spec.name == "num_logits" for spec in self.inputs)

    @property
    def screens_greedy(self) -> bool:
        """Whether a greedy step may take the float head's certified shortcut (the `greedy` input)."""
        return any(spec.name == "greedy" for spec in self.inputs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SequenceGraph:
        return super().from_dict({**data, "inputs": tensor_specs(data["inputs"])})



def tensor_specs(raw: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
    """A manifest's tensor list, each entry checked for its kinds (a ValueError: the manifest is corrupt)."""
    specs = tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in raw)
    for spec in specs:
        if not (isinstance(spec.name, str) and isinstance(spec.dtype, str)
                and all(isinstance(d, str | int) and not isinstance(d, bool) for d in spec.shape)):
            raise ValueError(f"a tensor entry is not a name, a dtype and a shape: {spec}")
    return specs
