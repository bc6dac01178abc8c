"""The one description of a model's architecture, normalised from a Hugging Face config.json.

Shared by the builder (which lowers it to a graph) and the runtime (which reads it back from the manifest).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from camshaft.checks import check_positive_ints, is_int, is_int_at_least
from camshaft.errors import CheckpointError, UnsupportedModelError
from camshaft.hf_config import model_fields
from camshaft.rope_config import RopeConfig, positive_number

ACTIVATIONS = ("silu", "gelu_tanh")  # x * sigmoid(x); GELU's tanh approximation (gelu_pytorch_tanh)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)
TOKENIZER_VOCABS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # at least one of these makes a tokenizer
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's unified HF checkpoint (written by `camshaft quantize`)
CAMSHAFT_QUANT_RECORD = "camshaft_quantize.json"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: tuple[tuple[str, float], ...] = ()  # generation_config.json's (temperature, top_p, ...)
    # Gemma's layers: norms scale by offset + weight, the embedding rows by embed_scale, the attention and MLP outputs
    # are normed before their residual adds (sandwich norms), the MLP gates with GELU's tanh form, queries scale by
    # attention_scale (else head_dim ** -0.5), sliding layers rotate with local_rope (else rope); Gemma 2 caps the
    # attention scores and the logits at ± their softcap (cap * tanh(x / cap))
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    activation: str = "silu"
    attention_scale: float | None = None
    local_rope: RopeConfig | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    layers_without_rope: tuple[int, ...] = ()  # SmolLM3's NoPE layers: their q and k are not rotated
    pre_norms: bool = True  # the attention's and MLP's inputs are normed (OLMo 2: only their outputs, sandwich_norms)
    qk_norm_per_head: bool = True  # qk_norm over each head (Qwen3, Gemma 3) or over all heads at once (OLMo 2)
    # Mixture of experts (Qwen3-MoE, Mixtral, OLMoE, GraniteMoE): on moe_layers the MLP is num_experts experts of
    # expert_intermediate_size, each token routed to experts_per_token of them by softmax over the router's logits
    # (renormalized over those chosen with normalize_expert_weights)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = False
    moe_layers: tuple[int, ...] = ()
    residual_scale: float = 1.0  # Granite: each attention and MLP output joins the residual stream times this
    logits_divisor: float = 1.0  # Granite's logits_scaling: the logits divided by it

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                   "num_kv_heads", "head_dim", "max_position_embeddings"), CheckpointError)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise CheckpointError(f"partial_rotary_factor {self.rope.partial_rotary_factor} rotates {self.rotary_dim} "
                                  f"of head_dim {self.head_dim}'s dimensions; it must be a positive even number")
        if self.rope.type == "longrope" and len(self.rope.short_factor) != self.rotary_dim // 2:
            raise CheckpointError(f"longrope's short_factor and long_factor need one entry per rotary frequency "
                                  f"(rotary dimensions / 2 = {self.rotary_dim // 2}), got "
                                  f"{len(self.rope.short_factor)}")
        if self.moe_layers and not (0 < self.experts_per_token <= self.num_experts
                                    and is_int_at_least(self.expert_intermediate_size, 1)):
            raise CheckpointError(f"a mixture of experts needs 0 < num_experts_per_tok <= num_experts and a positive "
                                  f"moe_intermediate_size, got {self.experts_per_token}, {self.num_experts} and "
                                  f"{self.expert_intermediate_size}")
        if not all(is_int(i) and 0 <= i < self.num_layers for i in self.layers_without_rope + self.moe_layers):
            raise CheckpointError(f"layers_without_rope {self.layers_without_rope} and moe_layers {self.moe_layers} "
                                  f"must be layer indices (0..{self.num_layers - 1})")
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {self.activation!r} is not supported ({', '.join(ACTIVATIONS)})")
        optional = (self.attention_scale, self.attn_softcap, self.logit_softcap)
        scales = (self.embed_scale, self.residual_scale, self.logits_divisor)
        if not (all(positive_number(x) for x in scales) and all(x is None or positive_number(x) for x in optional)):
            raise CheckpointError(f"the embedding, residual and logits scales, attention_scale and the softcaps must "
                                  f"be positive, got {scales} and {optional}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if len(self.layer_types) != self.num_layers:
            raise CheckpointError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = set(self.layer_types) - {"full", "sliding"}
        if bad:
            raise UnsupportedModelError(f"layer types {sorted(bad)} are not supported")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise CheckpointError("sliding-window layers need a positive sliding_window")
        special = [*self.eos_token_ids, *([] if self.bos_token_id is None else [self.bos_token_id])]
        if not all(is_int(t) and 0 <= t < self.vocab_size for t in special):
            raise CheckpointError(f"the end and bos ids {special} must be token ids of the vocabulary "
                                  f"(0..{self.vocab_size - 1})")

    @property
    def context_length(self) -> int:
        """The longest sequence the model is made for: max_position_embeddings, or what its rope scaling extends it
        to (vLLM's rule: yarn's original_max_position_embeddings x factor, linear's max_position_embeddings x
        factor)."""
        rope, positions = self.rope, self.max_position_embeddings
        if self.architecture == "gemma3":  # its max_position_embeddings already counts its linear scaling (vLLM's too)
            return positions
        scaled = {"yarn": rope.original_max_position_embeddings * rope.factor, "linear": positions * rope.factor}
        return max(positions, int(scaled.get(rope.type, 0)))

    @property
    def query_scale(self) -> float:
        """What attention scales the query-key products by."""
        return float(self.head_dim) ** -0.5 if self.attention_scale is None else self.attention_scale

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rotary embedding of layer `layer`: local_rope on a sliding layer where the model has one."""
        return self.local_rope if self.local_rope is not None and self.layer_types[layer] == "sliding" else self.rope

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that rope rotates, its first ones (all but with a partial_rotary_factor)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding" in self.layer_types

    @property
    def attention_window(self) -> int | None:
        """How far back every layer attends (sliding_window when all layers slide; None: some reads everything)."""
        return self.sliding_window if self.layer_types and set(self.layer_types) == {"sliding"} else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["rope"] = RopeConfig(**data["rope"])
        if data.get("local_rope") is not None:
            data["local_rope"] = RopeConfig(**data["local_rope"])
        data["layer_types"] = tuple(data["layer_types"])
        data["layers_without_rope"] = tuple(data.get("layers_without_rope", ()))
        data["moe_layers"] = tuple(data.get("moe_layers", ()))
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
        data["sampling_defaults"] = tuple((key, value) for key, value in data.get("sampling_defaults", ()))
        return cls(**data)

    @classmethod
    def from_hf_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file() and (Path(model_dir) / "manifest.json").is_file():
            raise CheckpointError(f"{model_dir} is a camshaft engine, not a checkpoint; pass the Hugging Face "
                                  "checkpoint directory it was built from (or use the engine with --engine)")
        if not path.is_file():
            raise CheckpointError(f"{path} not found: a Hugging Face checkpoint directory needs a config.json")
        hf = read_json_object(path)
        gen_path = Path(model_dir) / "generation_config.json"
        gen = read_json_object(gen_path) if gen_path.is_file() else {}
        return cls.from_hf(hf, gen, source=str(path))

    @classmethod
    def from_hf(cls, hf: dict[str, Any], gen: dict[str, Any] | None = None, source: str = "config.json") -> ModelConfig:
        fields = model_fields(hf, gen or {}, source)
        local = fields.get("local_rope")
        return cls(**{**fields, "rope": RopeConfig(**fields["rope"]),
                      "local_rope": None if local is None else RopeConfig(**local)})


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep, a number too long
        raise CheckpointError(f"{path} is not valid JSON ({exc}); restore it from the original checkpoint") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object; restore it from the original "
                              "checkpoint")
    return data


def require_tokenizer(model_dir: Path, error: type[Exception] = CheckpointError, name: str | None = None) -> None:
    """Raise `error` unless the directory holds a tokenizer vocabulary; `name` is how the message calls it."""
    if not any((Path(model_dir) / vocab).is_file() for vocab in TOKENIZER_VOCABS):
        raise error(f"{name or model_dir} has no tokenizer ({', '.join(TOKENIZER_VOCABS)})")


def check_tokenizer_vocab(tokenizer, vocab_size: int) -> None:
    """A fast tokenizer whose own vocabulary (added tokens aside) exceeds the model's embedding is another model's."""
    base = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    if base > vocab_size:
        raise CheckpointError(f"the tokenizer has {base} tokens but the model embeds {vocab_size}: is it another "
                              "model's tokenizer? Use the checkpoint's own")


def unreadable_quantization(model_dir: Path) -> str | None:
    """The quant_method config.json names when the checkpoint is quantized but has no hf_quant_config.json (its
    weights are codes camshaft would otherwise read as floats); None when there is nothing of the kind."""
    path = Path(model_dir) / "config.json"
    if (Path(model_dir) / HF_QUANT_CONFIG).is_file() or not path.is_file():
        return None
    quant = read_json_object(path).get("quantization_config")
    if not quant:
        return None
    return str(quant.get("quant_method", "unnamed")) if isinstance(quant, dict) else "unnamed"


def missing_checkpoint(model_dir: Path) -> str:
    """The message for a --model that is not a directory: a file, or nothing (a model hub id, org/name, is told
    camshaft reads directories)."""
    if model_dir.exists():
        return (f"{model_dir} is a file; --model takes a checkpoint directory (config.json, safetensors, "
                "tokenizer)")
    text = str(model_dir)
    hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~")) and all(text.split("/")) \
        and not Path(text.split("/")[0]).exists()  # out/model, with out/ here, is a mistyped local path
    return f"checkpoint directory {model_dir} does not exist" + (
        "; camshaft reads local checkpoint directories, not model hub ids: download the checkpoint to a directory "
        "first, or fetch a model camshaft knows (camshaft models list)" if hub_id else "")
