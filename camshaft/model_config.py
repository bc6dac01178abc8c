"""The one description of a model's architecture, normalised from a Hugging Face config.json.

Shared by the builder (which lowers it to a graph) and the runtime (which reads it back from the manifest).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from camshaft.checks import is_int_at_least
from camshaft.errors import CheckpointError, UnsupportedModelError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3")
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
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {self.type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1):
                raise CheckpointError(f"{name} must be a positive integer, not {value!r}")
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

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding" in self.layer_types

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["rope"] = RopeConfig(**data["rope"])
        data["layer_types"] = tuple(data["layer_types"])
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
        return cls(**data)

    @classmethod
    def from_hf_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path} not found: a Hugging Face checkpoint directory needs a config.json")
        hf = read_json_object(path)
        gen_path = Path(model_dir) / "generation_config.json"
        gen = read_json_object(gen_path) if gen_path.is_file() else {}
        return cls.from_hf(hf, gen, source=str(path))

    @classmethod
    def from_hf(cls, hf: dict[str, Any], gen: dict[str, Any] | None = None, source: str = "config.json") -> ModelConfig:
        gen = gen or {}
        if hf.get("auto_map"):
            raise UnsupportedModelError(
                f"{source} asks for custom modelling code (auto_map / trust_remote_code); camshaft never runs "
                "code from a checkpoint. Use a checkpoint of a supported architecture: "
                + ", ".join(ARCHITECTURES)
            )
        archs = hf.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            model_type = hf.get("model_type")
            by_type = {v: v for v in ARCHITECTURES.values()}
            arch = by_type.get(model_type)
        if arch is None:
            raise UnsupportedModelError(
                f"{source}: architecture {archs or hf.get('model_type')} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            config = dict(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            )
        except KeyError as exc:
            raise CheckpointError(f"{source} lacks required field {exc.args[0]!r}") from exc
        config["rope"] = _rope_from_hf(hf, source)
        config["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
        bias = bool(hf.get("attention_bias", False))
        config["qkv_bias"] = True if arch == "qwen2" else bias
        config["o_bias"] = bias
        config["mlp_bias"] = bool(hf.get("mlp_bias", False))
        config["qk_norm"] = arch == "qwen3"
        window, layer_types = _attention_layout(hf, arch, layers, source)
        config["sliding_window"] = window
        config["layer_types"] = layer_types
        config["bos_token_id"] = gen.get("bos_token_id", hf.get("bos_token_id"))
        eos = gen.get("eos_token_id", hf.get("eos_token_id"))
        config["eos_token_ids"] = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        return cls(**config)


def _rope_from_hf(hf: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older checkpoints write rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope scaling {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )


def _attention_layout(hf: dict[str, Any], arch: str, layers: int, source: str) -> tuple[int | None, tuple[str, ...]]:
    window = hf.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    if hf.get("layer_types"):
        try:
            types = tuple(names[t] for t in hf["layer_types"])
        except KeyError as exc:
            raise UnsupportedModelError(f"{source}: layer type {exc.args[0]!r} is not supported") from exc
        if window is None:
            types = tuple("full" for _ in types)
        return (int(window) if window else None), types
    if window is None:
        return None, ("full",) * layers
    if arch in ("qwen2", "qwen3"):
        first_full = int(hf.get("max_window_layers", layers))
        return int(window), tuple("full" if i < first_full else "sliding" for i in range(layers))
    return int(window), ("sliding",) * layers


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); restore it from the original checkpoint") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object; restore it from the original "
                              "checkpoint")
    return data


def has_tokenizer(model_dir: Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_VOCABS)


NO_TOKENIZER = f"has no tokenizer ({', '.join(TOKENIZER_VOCABS)})"
