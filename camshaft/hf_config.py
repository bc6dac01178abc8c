"""Reads a Hugging Face config.json (+ generation_config.json) into the fields of a ModelConfig, strictly: a value of
the wrong type or out of range is a CheckpointError naming the field, never coerced (bool("false") is True)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from camshaft.checks import is_int_at_least
from camshaft.errors import CheckpointError, UnsupportedModelError
from camshaft.hf_archs import gemma_fields, granite_fields, layers_without_rope, moe_fields
from camshaft.hf_fields import Fields
from camshaft.hf_rope import phi3_rope, rope_fields

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # Llama's layers with q/k/v and gate/up stored fused (builder/checkpoint.py splits them)
    "Gemma2ForCausalLM": "gemma2",  # Gemma 2: Gemma 3's layers with softcapped attention and logits, one rope
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3's text models (1B; the larger ones' text part is saved so too)
    "SmolLM3ForCausalLM": "smollm3",  # Llama's layers, every 4th without rope (NoPE)
    "GraniteForCausalLM": "granite",  # Llama's layers with multipliers on the embedding, residual, scores, logits
    "Olmo2ForCausalLM": "olmo2",  # norms after the attention and MLP only, q/k norms over all heads
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3's attention, a mixture of experts for the MLP
    "MixtralForCausalLM": "mixtral",  # Mistral's attention, a mixture of experts (always renormalized) for the MLP
    "OlmoeForCausalLM": "olmoe",  # OLMo's q/k norms over all heads, a mixture of experts for the MLP
    "GraniteMoeForCausalLM": "granitemoe",  # Granite's multipliers, a mixture of experts (stacked) for the MLP
}
MOES = ("qwen3_moe", "mixtral", "olmoe", "granitemoe")
GEMMAS = ("gemma2", "gemma3")
# their models read config.json's layer_types (a Mistral config that lists them loads as Ministral: AutoConfig)
LAYER_TYPED = ("mistral", "qwen2", "qwen3", "gemma2", "gemma3", "smollm3")
MODEL_TYPES = {"gemma3": "gemma3_text"}  # config.json's model_type where it is not the architecture's name
FUSED_ARCHITECTURES = ("phi3",)  # q/k/v and gate/up stored as one matrix each
# transformers' config defaults
MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, "phi3": 4096, "gemma2": 8192,
                 "gemma3": 131072, "smollm3": 32768, "granite": 2048, "olmo2": 2048, "qwen3_moe": 32768,
                 "mixtral": 131072, "olmoe": 4096, "granitemoe": 2048}
DEFAULT_WINDOW = 4096  # transformers' Mistral/Qwen2/Qwen3 configs' sliding_window when config.json has none
QWEN_DEFAULT_WINDOW_LAYERS = 28  # their max_window_layers default: layers from this index on slide
# their head_dim (others: hidden / heads) and num_key_value_heads (others: one a head) when config.json has none
HEAD_DIMS = {"qwen3": 128, "gemma2": 256, "gemma3": 256}
KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32, "gemma2": 4, "gemma3": 4, "smollm3": 4, "qwen3_moe": 4,
            "mixtral": 8}
MAX_LAYERS = 4096



def architecture(hf: dict[str, Any], source: str) -> str:
    auto_map = hf.get("auto_map")
    models = sorted(k for k in auto_map if k.startswith("AutoModel")) if isinstance(auto_map, dict) else auto_map
    if models and _native_port(auto_map, models, hf.get("architectures")):
        models = []
    if models:  # custom model code; an auto_map of tokenizer or config classes alone changes no weights' meaning
        native = [a for a in (hf.get("architectures") or []) if isinstance(a, str) and a in ARCHITECTURES]
        also = (f" Its architectures name {native[0]}, which camshaft builds natively (as transformers loads it "
                "without trust_remote_code): if that is the model, remove auto_map from config.json to build it."
                if native else f" Use a checkpoint of a supported architecture: {', '.join(ARCHITECTURES)}")
        raise UnsupportedModelError(
            f"{source} asks for custom modelling code (auto_map {models!r:.120} / trust_remote_code); camshaft never "
            f"runs code from a checkpoint.{also}")
    archs = hf.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointError(f"{source}: architectures must be a list of class names, not {archs!r}")
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs and isinstance(hf.get("model_type"), str):  # speaks only when no class is named
        arch = {MODEL_TYPES.get(v, v): v for v in ARCHITECTURES.values()}.get(hf["model_type"])
    if arch is None:
        raise UnsupportedModelError(f"{source}: architecture {archs or hf.get('model_type')} is not supported; "
                                    f"supported: {', '.join(ARCHITECTURES)}")
    model_type = hf.get("model_type")
    if isinstance(model_type, str) and model_type != MODEL_TYPES.get(arch, arch):  # transformers builds model_type's
        named = next(a for a in archs if ARCHITECTURES.get(a) == arch)
        raise CheckpointError(f"{source} names {named} but model_type {model_type!r}, which transformers builds "
                              f"instead (its weights and rules differ); make the two agree (restore config.json from "
                              f"the original checkpoint)")
    return arch


def _native_port(auto_map: Any, models: list[str], archs: Any) -> bool:
    """An auto_map whose model classes are the very native class the architectures name (Phi-3's
    modeling_phi3.Phi3ForCausalLM, written before transformers took the model in): transformers then runs its own."""
    if not isinstance(auto_map, dict) or not isinstance(archs, list):
        return False
    names = [auto_map[k] for k in models]
    classes = {n.rsplit(".", 1)[-1] for n in names if isinstance(n, str)}
    return len(classes) == len(names) and all(c in ARCHITECTURES and c in archs for c in classes)


def model_fields(hf: dict[str, Any], gen: dict[str, Any], source: str) -> dict[str, Any]:
    """The keyword arguments of ModelConfig, but `rope` as a dict of RopeConfig's."""
    arch = architecture(hf, source)
    if arch == "phi3":
        hf = phi3_rope(hf, source)
    f = Fields(hf, source)
    act = hf.get("hidden_act", "silu") if arch not in GEMMAS else hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("silu", "swish", "gelu_pytorch_tanh") or (act == "gelu_pytorch_tanh") != (arch in GEMMAS):
        key = "hidden_activation" if arch in GEMMAS else "hidden_act"
        raise UnsupportedModelError(f"{source}: {key}={act!r} is not supported for {arch} (silu, and Gemma's "
                                    "gelu_pytorch_tanh)")
    hidden, heads = f.get("hidden_size", "int", least=1), f.get("num_attention_heads", "int", least=1)
    layers = f.get("num_hidden_layers", "int", least=1)
    if layers > MAX_LAYERS:  # its per-layer tables would fill the memory before the weights are looked at
        raise CheckpointError(f"{source}: num_hidden_layers={layers} is beyond any model's ({MAX_LAYERS} at most); "
                              "restore it from the original checkpoint")
    # Biases as transformers builds each architecture: Mistral has none and Qwen2 q/k/v only, whatever
    # attention_bias / mlp_bias say; Llama, Qwen3, Gemma, SmolLM3 and Granite follow attention_bias, Llama, SmolLM3
    # and Granite mlp_bias.
    bias = f.get("attention_bias", "bool", False) and arch in ("llama", "qwen3", "qwen3_moe", "smollm3", "granite",
                                                               "granitemoe", "olmo2", "olmoe", *GEMMAS)
    mlp_bias = f.get("mlp_bias", "bool", False) and arch in ("llama", "smollm3", "granite")
    window, layer_types = attention_layout(f, arch, layers)
    vocab = f.get("vocab_size", "int", least=1)
    positions = f.get("max_position_embeddings", "int", MAX_POSITIONS[arch], least=2, most=2**31 - 1)
    return dict(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=f.get("intermediate_size", "int", least=1),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads(f, arch, heads, source),
        head_dim=f.get("head_dim", "int", None, least=1) or HEAD_DIMS.get(arch) or split_heads(hidden, heads, arch,
                                                                                                  source),
        rms_norm_eps=f.get("rms_norm_eps", "number", 1e-5 if arch in ("phi3", "olmo2", "mixtral", "olmoe") else 1e-6,
                           least=0),
        max_position_embeddings=positions,
        rope=rope_fields(hf, f, source, positions, arch),
        tie_word_embeddings=f.get("tie_word_embeddings", "bool", arch in (*GEMMAS, "smollm3")),  # their configs tie
        qkv_bias=True if arch == "qwen2" else bias,
        o_bias=bias,
        mlp_bias=mlp_bias,
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3", "olmo2", "olmoe"),
        sliding_window=window,
        layer_types=layer_types,
        bos_token_id=special_id(gen, hf, "bos_token_id", source, vocab),
        eos_token_ids=eos_ids(gen, hf, source, vocab),
        sampling_defaults=sampling_defaults(gen, source),
        layers_without_rope=layers_without_rope(f, layers) if arch == "smollm3" else (),
    ) | (gemma_fields(hf, f, source, positions, hidden, arch) if arch in GEMMAS else {}) | (
        granite_fields(f) if arch in ("granite", "granitemoe") else {}) | (
        dict(pre_norms=False, sandwich_norms=True, qk_norm_per_head=False) if arch == "olmo2" else {}) | (
        dict(qk_norm_per_head=False) if arch == "olmoe" else {}) | (moe_fields(f, layers, arch) if arch in MOES else {})


def split_heads(hidden: int, heads: int, arch: str, source: str) -> int:
    """head_dim where config.json gives none: hidden_size // num_attention_heads, as transformers takes it (its
    Llama config refuses a hidden_size that is no multiple of the heads; the others round down)."""
    if hidden % heads and arch == "llama":
        raise CheckpointError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and "
                              "no head_dim is given; restore them from the original checkpoint")
    return hidden // heads


def kv_heads(f: Fields, arch: str, heads: int, source: str) -> int:
    """num_key_value_heads as transformers reads it: null means one per attention head, and an absent one Llama's
    heads but Mistral's 8 and Qwen's 32 (its config class's default)."""
    if "num_key_value_heads" in f.data or arch not in KV_HEADS:
        return f.get("num_key_value_heads", "int", heads, least=1)
    if heads % KV_HEADS[arch]:
        raise CheckpointError(f"{source} has no num_key_value_heads, so transformers takes {KV_HEADS[arch]} (its "
                              f"{arch} default), which does not divide num_attention_heads={heads}; add the "
                              "checkpoint's num_key_value_heads to config.json")
    return KV_HEADS[arch]


def attention_layout(f: Fields, arch: str, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, per-layer "full" | "sliding") as transformers reads them: Llama, Granite and the OLMos have no
    window; Phi-3's and Mixtral's slide every layer where config.json sets one; Mistral's and Gemma's default to 4096;
    Qwen2/3 slide only with use_sliding_window (window 4096 and max_window_layers 28 unless config.json says
    otherwise; layers from max_window_layers on slide); layer_types where the model reads them (LAYER_TYPED)."""
    if arch in ("llama", "granite", "granitemoe", "olmo2", "olmoe"):  # their attention has no window at all
        window = None
    elif arch in ("phi3", "mixtral"):  # slides where config.json sets a window (Phi-3-mini-4k: 2047), every layer
        window = f.get("sliding_window", "int", None, least=1)
    elif arch == "smollm3":  # its listed sliding layers slide by sliding_window (SmolLM3Model's masks); unlisted,
        # with use_sliding_window its NoPE layers
        listed = "sliding_attention" in (f.data.get("layer_types") or ())
        window = f.get("sliding_window", "int", None, least=1) if listed or f.get("use_sliding_window", "bool",
                                                                                   False) else None
        if listed and window is None:
            raise CheckpointError(f"{f.source}: layer_types lists sliding_attention layers but sliding_window is "
                                  "null (transformers cannot run them without); restore it from the original "
                                  "checkpoint")
    elif arch in ("mistral", *GEMMAS) or f.get("use_sliding_window", "bool", False):
        window = f.get("sliding_window", "int", DEFAULT_WINDOW if "sliding_window" not in f.data else None, least=1)
    else:
        window = None
    if window is None and arch in GEMMAS:
        raise CheckpointError(f"{f.source}: sliding_window is null, but Gemma's sliding layers need one "
                              "(transformers cannot run them without); restore it from the original checkpoint")
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    if f.data.get("layer_types") and arch in LAYER_TYPED:  # the others slide every layer or none, whatever it lists
        try:
            types = tuple(names[t] for t in f.data["layer_types"])
        except (KeyError, TypeError) as exc:
            raise UnsupportedModelError(f"{f.source}: layer types {f.data['layer_types']!r} are not supported "
                                        "(full_attention, sliding_attention)") from exc
        return window, (types if window is not None else ("full",) * len(types))
    if window is None:
        return None, ("full",) * layers
    if arch in GEMMAS:  # their configs: every sliding_window_pattern-th layer is full (Gemma 2: every 2nd)
        pattern = f.get("sliding_window_pattern", "int", 6, least=1) if arch == "gemma3" else 2
        return window, tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))
    if arch == "smollm3":
        nope = layers_without_rope(f, layers)
        return window, tuple("sliding" if i in nope else "full" for i in range(layers))
    if arch in ("qwen2", "qwen3"):
        first_sliding = f.get("max_window_layers", "int", QWEN_DEFAULT_WINDOW_LAYERS, least=0)
        return window, tuple("full" if i < first_sliding else "sliding" for i in range(layers))
    return window, ("sliding",) * layers


SAMPLING_DEFAULTS = {  # generation_config.json's sampling keys vLLM takes as a request's defaults, and their range
    "temperature": ("number", 0.0, math.inf), "top_p": ("number", 1e-9, 1.0), "top_k": ("int", -1, math.inf),
    "min_p": ("number", 0.0, 1.0), "repetition_penalty": ("number", 1e-9, math.inf)}


def sampling_defaults(gen: dict[str, Any], source: str) -> tuple[tuple[str, float], ...]:
    """The sampling values the model's creator recommends (generation_config.json), for what a request leaves out."""
    where = Fields(gen, str(Path(source).with_name("generation_config.json")))
    found = []
    for key, (kind, low, high) in SAMPLING_DEFAULTS.items():
        value = where.get(key, kind, None)
        if value is not None and not low <= value <= high:
            raise CheckpointError(f"{where.source}: {key} must lie in [{low:g}, {high:g}], not {value!r}; fix it or "
                                  "remove it (it is the default sampling of requests that do not set it)")
        if value is not None:
            found.append((key, value))
    return tuple(found)


def _where(gen: dict[str, Any], key: str, source: str) -> str:
    """The file a special token id is read from: generation_config.json wins over config.json, as in transformers."""
    return str(Path(source).with_name("generation_config.json")) if key in gen else source


def special_id(gen: dict[str, Any], hf: dict[str, Any], key: str, source: str, vocab: int) -> int | None:
    value = gen.get(key, hf.get(key))
    if value is not None and not (is_int_at_least(value, 0) and value < vocab):
        raise CheckpointError(f"{_where(gen, key, source)}: {key} must be a token id of the vocabulary "
                              f"(0..{vocab - 1}), not {value!r}")
    return value


def eos_ids(gen: dict[str, Any], hf: dict[str, Any], source: str, vocab: int) -> tuple[int, ...]:
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if not all(is_int_at_least(t, 0) and t < vocab for t in ids):
        raise CheckpointError(f"{_where(gen, 'eos_token_id', source)}: eos_token_id must be a token id of the "
                              f"vocabulary (0..{vocab - 1}) or a list of them, not {eos!r}")
    return tuple(ids)
