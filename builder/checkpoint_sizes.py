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
