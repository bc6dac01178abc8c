"""config.json's sizes checked against the weights' headers, before anything is made from the sizes: a head_dim of
10**8 made 95 GiB rotary tables before any weight was read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from camshaft.errors import CheckpointError

if TYPE_CHECKING:
    from camshaft.builder.checkpoint import Checkpoint


def check_sizes(checkpoint: Checkpoint) -> None:
    """Layers the config counts that the weights lack, and the first layer's q/k projections against heads x
    head_dim and hidden_size (int4 checkpoints pack two output rows a byte)."""
    c = checkpoint.config
    present = {int(parts[2]) for parts in (n.split(".") for n in checkpoint.names())
               if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit()}
    if present and len(present) < c.num_layers:
        raise CheckpointError(f"{checkpoint.dir}/config.json says num_hidden_layers={c.num_layers}, but the weights "
                              f"hold {len(present)} layers; restore the checkpoint's config.json or its weights")
    for proj, rows in (("q_proj", c.num_heads * c.head_dim), ("k_proj", c.num_kv_heads * c.head_dim)):
        name = f"model.layers.0.self_attn.{proj}.weight"
        if name not in checkpoint:
            continue  # said where it is read
        shape, expected = checkpoint.stored_shape(name), (rows, c.hidden_size)
        if shape != expected and not (checkpoint.quantization and shape == (rows // 2, c.hidden_size)):
            raise CheckpointError(f"{checkpoint.file_of(name).name}: tensor {name!r} has shape {shape}, expected "
                                  f"{expected} from config.json (heads x head_dim, hidden_size); restore the "
                                  "checkpoint's config.json")


def fused_rows(checkpoint: Checkpoint) -> dict[str, tuple[str, int, int]]:
    """Phi-3 stores each layer's q/k/v and gate/up projections as one matrix each: the separate weights every other
    architecture has, as (fused tensor, first row, end row) by name (transformers splits them the same way)."""
    c = checkpoint.config
    if checkpoint.quantization is not None:
        raise CheckpointError(f"{checkpoint.dir}: a quantized {c.architecture} checkpoint (its fused qkv_proj and "
                              "gate_up_proj quantized as one) is not supported yet; build the float checkpoint")
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    parts = {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
             "mlp.gate_up_proj": (("mlp.gate_proj", c.intermediate_size), ("mlp.up_proj", c.intermediate_size))}
    rows: dict[str, tuple[str, int, int]] = {}
    for layer in range(c.num_layers):
        for fused, split in parts.items():
            name = f"model.layers.{layer}.{fused}.weight"
            if name not in checkpoint:
                continue  # its parts are missing: said where they are read
            total, shape = sum(n for _, n in split), checkpoint.stored_shape(name)
            if shape != (total, c.hidden_size):
                raise CheckpointError(f"{checkpoint.file_of(name).name}: tensor {name!r} has shape {shape}, expected "
                                      f"{(total, c.hidden_size)} from config.json; restore the checkpoint's "
                                      "config.json")
            start = 0
            for part, n in split:
                rows[f"model.layers.{layer}.{part}.weight"] = (name, start, start + n)
                start += n
    return rows
