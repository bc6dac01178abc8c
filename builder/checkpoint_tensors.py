"""Every tensor the lowering reads, checked against the weights' headers before the build writes anything (a missing
or misshapen tensor of the last layer was found only once every layer before it was lowered), and the stored float
tensors the config leaves unread (transformers ignores them too, and says so)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from camshaft.builder.experts import expert_tensors
from camshaft.errors import CheckpointError
from camshaft.weight_files import EMBED

if TYPE_CHECKING:
    from camshaft.builder.checkpoint import Checkpoint

HEAD = "lm_head.weight"


def expected_tensors(checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
    """The float shape of every weight the lowering reads (a quantized layer's weight is stored packed)."""
    c = checkpoint.config
    q, kv, d, hidden, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim, c.hidden_size, \
        c.intermediate_size
    shapes = {EMBED: (c.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        shapes[HEAD] = (c.vocab_size, hidden)
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        linears = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                   "self_attn.o_proj": (hidden, q)}
        if i in c.moe_layers:  # a router and the experts' gated MLPs
            shapes |= expert_tensors(c, i)
        else:
            linears |= {"mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                        "mlp.down_proj": (hidden, inter)}
        shapes |= {f"{p}.{name}.weight": shape for name, shape in linears.items()}
        norms = (("input_layernorm",) if c.pre_norms else ()) + ("post_attention_layernorm",) + (
            ("pre_feedforward_layernorm",) if c.pre_norms and c.sandwich_norms else ()) + (
            ("post_feedforward_layernorm",) if c.sandwich_norms else ())
        shapes |= {f"{p}.{norm}.weight": (hidden,) for norm in norms}
        biased = [n for n, on in (("self_attn.q_proj", c.qkv_bias), ("self_attn.k_proj", c.qkv_bias),
                                  ("self_attn.v_proj", c.qkv_bias), ("self_attn.o_proj", c.o_bias),
                                  ("mlp.gate_proj", c.mlp_bias), ("mlp.up_proj", c.mlp_bias),
                                  ("mlp.down_proj", c.mlp_bias)) if on]
        shapes |= {f"{p}.{name}.bias": linears[name][:1] for name in biased if name in linears}
        if c.qk_norm:  # per head, or over all of q's / k's heads (OLMo 2)
            shapes |= {f"{p}.self_attn.{n}_norm.weight": (d,) if c.qk_norm_per_head else (width,)
                       for n, width in (("q", q), ("k", kv))}
    return shapes


def check_tensors(checkpoint: Checkpoint, stored: set[str]) -> list[str]:
    """Refuse a tensor the lowering would find missing or misshapen; returns the stored float tensors (`stored`: the
    files' names) that it never reads."""
    expected = expected_tensors(checkpoint)
    for name, shape in expected.items():
        if name not in checkpoint:
            raise checkpoint.missing(name)
        prefix = name.removesuffix(".weight")
        if len(shape) == 2 and checkpoint.layer_algo(prefix) and f"{prefix}.weight_scale" in checkpoint:
            continue  # stored packed: checked with its scales where it is read
        found = checkpoint.stored_shape(name)
        if found != shape:
            raise CheckpointError(f"{checkpoint.file_of(name).name}: tensor {name!r} has shape {found}, expected "
                                  f"{shape} from config.json; restore the checkpoint's config.json or its weights")
    read = set(expected) | {checkpoint.stored_name(name) for name in expected} | {HEAD}  # a tied head: checked same
    return sorted(n for n in stored - read if n.endswith((".weight", ".bias")))
