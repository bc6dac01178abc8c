"""The fields particular to some architectures, read from their config.json as transformers reads them (for
hf_config.model_fields): Gemma's, SmolLM3's NoPE layers, Granite's multipliers, mixtures of experts."""

from __future__ import annotations

from typing import Any

from camshaft.errors import CheckpointError, UnsupportedModelError
from camshaft.hf_fields import Fields
from camshaft.hf_rope import gemma_ropes, rope_fields

# experts and a token's by default, the key of the experts' width and its default (None: required)
MOE_DEFAULTS = {"qwen3_moe": (128, 8, "moe_intermediate_size", 768), "mixtral": (8, 2, "intermediate_size", None),
                "olmoe": (64, 8, "intermediate_size", None), "granitemoe": (8, 2, "intermediate_size", None)}


def moe_fields(f: Fields, layers: int, arch: str) -> dict[str, Any]:
    """The experts as their configs say: Qwen3-MoE's on every decoder_sparse_step-th layer not in mlp_only_layers,
    the others' on every layer; Mixtral and GraniteMoE (a softmax over the chosen experts' logits: the same)
    renormalize the chosen experts' weights always, the others with norm_topk_prob."""
    if arch == "olmoe" and f.data.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{f.source}: clip_qkv={f.data['clip_qkv']!r} is not supported (OLMoE's "
                                    "published models set none)")
    experts_default, per_token, width_key, width = MOE_DEFAULTS[arch]
    # transformers reads either key as the other (their attribute_map), but GraniteMoeConfig only num_local_experts
    keys = ("num_local_experts",) if arch == "granitemoe" else ("num_local_experts", "num_experts")
    named = next((key for key in keys if f.data.get(key) is not None), None)
    experts = f.get(named, "int", least=0) if named else experts_default
    moe = tuple(range(layers))
    if arch == "qwen3_moe":
        step = f.get("decoder_sparse_step", "int", 1, least=1)
        dense = f.data.get("mlp_only_layers") or []
        if not (isinstance(dense, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in dense)):
            raise CheckpointError(f"{f.source}: mlp_only_layers must be a list of layer indices, not {dense!r:.60}")
        moe = tuple(i for i in moe if i not in dense and experts > 0 and (i + 1) % step == 0)
    return dict(num_experts=experts, experts_per_token=f.get("num_experts_per_tok", "int", per_token, least=1),
                expert_intermediate_size=f.get(width_key, "int", least=1) if width is None else f.get(
                    width_key, "int", width, least=1),
                normalize_expert_weights=arch in ("mixtral", "granitemoe") or f.get("norm_topk_prob", "bool", False),
                moe_layers=moe)


def granite_fields(f: Fields) -> dict[str, Any]:
    """GraniteForCausalLM's multipliers (1 each by default): the embedding's, the sublayers' outputs joining the
    residual stream, the attention scores' (in place of head_dim ** -0.5), and the logits' divisor."""
    values = {key: f.get(key, "number", 1.0, least=0) for key in ("embedding_multiplier", "residual_multiplier",
                                                                  "attention_multiplier", "logits_scaling")}
    if not all(v > 0 for v in values.values()):
        raise CheckpointError(f"{f.source}: Granite's multipliers must be > 0, got {values}")
    return dict(embed_scale=float(values["embedding_multiplier"]), residual_scale=float(values["residual_multiplier"]),
                attention_scale=float(values["attention_multiplier"]), logits_divisor=float(values["logits_scaling"]))


def layers_without_rope(f: Fields, layers: int) -> tuple[int, ...]:
    """SmolLM3's NoPE layers: no_rope_layers' zeros (1: the layer rotates), else every no_rope_layer_interval-th."""
    flags = f.data.get("no_rope_layers")
    if flags is None:
        interval = f.get("no_rope_layer_interval", "int", 4, least=1)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not (isinstance(flags, list) and len(flags) == layers and all(x in (0, 1) and not isinstance(x, float)
                                                                       for x in flags)):
        raise CheckpointError(f"{f.source}: no_rope_layers must list 0 or 1 for each of the {layers} layers, not "
                              f"{flags!r:.80}")
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def gemma_fields(hf: dict[str, Any], f: Fields, source: str, positions: int, hidden: int,
                 arch: str) -> dict[str, Any]:
    """Gemma's layers as Gemma2ForCausalLM / Gemma3ForCausalLM run them (model_config.ModelConfig says what each
    field does): Gemma 2's softcaps default to 50 (attention) and 30 (logits), Gemma 3's to none, and Gemma 3's
    attention ignores its cap (Gemma3Attention keeps it, never applies it); bidirectional attention is refused."""
    if f.get("use_bidirectional_attention", "bool", False):
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention is not supported (a causal LM attends "
                                    "causally)")
    defaults = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if arch == "gemma2" else {}
    caps = {key: None if key in hf and hf[key] is None else f.get(key, "number", defaults.get(key), least=0)
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}  # null: none, as transformers reads it
    if any(cap is not None and cap <= 0 for cap in caps.values()):
        raise CheckpointError(f"{source}: the softcaps must be > 0 or null, got {caps}")
    full, local = gemma_ropes(hf, f, source, positions) if arch == "gemma3" else (
        rope_fields(hf, f, source, positions, arch), None)
    scalar = f.get("query_pre_attn_scalar", "number", 256, least=0)
    if scalar <= 0:
        raise CheckpointError(f"{source}: query_pre_attn_scalar must be > 0, got {scalar}")
    return dict(rope=full, local_rope=local, norm_offset=1.0, embed_scale=hidden ** 0.5, sandwich_norms=True,
                activation="gelu_tanh", attention_scale=scalar ** -0.5,
                attn_softcap=caps["attn_logit_softcapping"] if arch == "gemma2" else None,
                logit_softcap=caps["final_logit_softcapping"])
