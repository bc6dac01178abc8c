"""config.json's sizes checked against the weights' headers, before anything is made from the sizes: a head_dim of
10**8 made 95 GiB rotary tables before any weight was read."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class FusedParts:
    """Phi-3's fused q/k/v and gate/up matrices read as the separate layers every other architecture has."""

    rows: dict[str, tuple[str, int, int]]  # a part's tensor → (fused tensor, first row, end row)
    shared: dict[str, str]  # a part's tensor → the fused tensor it reads whole (a scale of the whole matrix)
    modules: dict[str, str]  # a part's module → the fused module (what hf_quant_config.json's layers name)


SPLIT = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
SCALES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")


def fused_parts(checkpoint: Checkpoint) -> FusedParts:
    """Each layer's fused matrices split by rows as transformers splits them (q, k, v; gate, up), quantized ones
    too: int4 weights by their packed rows (two output rows a byte), per-row scales by rows, the rest shared."""
    c = checkpoint.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    sizes = {"self_attn.qkv_proj": (q, kv, kv), "mlp.gate_up_proj": (c.intermediate_size, c.intermediate_size)}
    parts = FusedParts({}, {}, {})
    for layer in range(c.num_layers):
        for fused, names in SPLIT.items():
            prefix, rows = f"model.layers.{layer}.{fused}", sizes[fused]
            weight, total = f"{prefix}.weight", sum(rows)
            if weight not in checkpoint:
                apart = [f"model.layers.{layer}.{n}.weight" for n in names]
                if any(name in checkpoint for name in apart):  # transformers would leave qkv_proj random
                    raise CheckpointError(f"{checkpoint.dir}: layer {layer} stores {', '.join(apart)} apart, but "
                                          f"{c.architecture} reads one {weight}, as transformers does; fuse them "
                                          "(rows in that order) or restore the checkpoint")
                raise checkpoint.missing(weight)
            shape = checkpoint.stored_shape(weight)
            packed = checkpoint.quantization is not None and shape == (total // 2, c.hidden_size)
            if packed and any(n % 2 for n in rows):
                raise CheckpointError(f"{checkpoint.file_of(weight).name}: {weight} packs two output rows a byte, "
                                      f"but its parts' rows {rows} are not all even: a byte would hold two parts; "
                                      "camshaft cannot split it (quantize the float checkpoint with camshaft)")
            if shape != (total, c.hidden_size) and not packed:
                raise CheckpointError(f"{checkpoint.file_of(weight).name}: tensor {weight!r} has shape {shape}, "
                                      f"expected {(total, c.hidden_size)} from config.json; restore the "
                                      "checkpoint's config.json")
            start = 0
            for part, n in zip(names, rows, strict=True):
                own = f"model.layers.{layer}.{part}"
                parts.modules[own] = prefix
                parts.rows[f"{own}.weight"] = (weight, start // 2, (start + n) // 2) if packed else \
                    (weight, start, start + n)
                for scale in SCALES:
                    name = f"{prefix}.{scale}"
                    if name not in checkpoint:
                        continue
                    per_row = scale == "weight_scale" and checkpoint.stored_shape(name)[:1] == (total,)
                    if per_row:
                        parts.rows[f"{own}.{scale}"] = (name, start, start + n)
                    else:
                        parts.shared[f"{own}.{scale}"] = name
                start += n
    return parts
