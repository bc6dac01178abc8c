"""A Hugging Face config.json's rotary embedding (rope_scaling / rope_parameters) read as transformers reads it, into
RopeConfig's fields."""

from __future__ import annotations

import math
from typing import Any

from camshaft.errors import CheckpointError, UnsupportedModelError
from camshaft.hf_fields import Fields

# dynamic: the default up to max_position_embeddings
ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn", "longrope")
ATTENTION_FACTORS = (1e-6, 1e6)  # the range of yarn's factor on cos/sin that float32 tables hold
PHI3_ORIGINAL_POSITIONS = 4096  # Phi3Config's original_max_position_embeddings
THETA_DEFAULTS = {"mixtral": 1e6, "smollm3": 2e6}  # rope_theta left out (else 10000), as transformers reads it


def phi3_rope(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """A Phi-3 config as Phi3Config reads it: su and yarn rope are longrope, other scalings are refused, and the
    top-level original_max_position_embeddings (4096 when absent) is the one longrope switches at."""
    hf = dict(hf)
    for key in ("rope_scaling", "rope_parameters"):
        section = hf.get(key)
        kind = section.get("rope_type", section.get("type", "default")) if isinstance(section, dict) else "default"
        if kind in ("su", "yarn"):
            hf[key] = {k: v for k, v in section.items() if k != "type"} | {"rope_type": "longrope"}
        elif kind not in ("default", "longrope"):
            raise UnsupportedModelError(f"{source}: Phi-3 rope scaling ({key} {kind!r}) is not one Phi-3 has; "
                                        "transformers reads only default, longrope, su and yarn (as longrope)")
    hf.setdefault("original_max_position_embeddings", PHI3_ORIGINAL_POSITIONS)
    return hf


def rope_fields(hf: dict[str, Any], f: Fields, source: str, positions: int, arch: str) -> dict[str, Any]:
    """RopeConfig's fields as transformers reads them: `rope_scaling` (old checkpoints, beside a top-level rope_theta)
    or `rope_parameters` (transformers 5); `positions`: the model's max_position_embeddings."""
    sections = {}
    for key in ("rope_parameters", "rope_scaling"):
        section = hf.get(key) or {}
        if not isinstance(section, dict):
            raise CheckpointError(f"{source}: {key} must be an object, not {section!r}")
        kind = section.get("rope_type", section.get("type", "default"))  # rope_type wins, as in transformers
        if not isinstance(kind, str):
            raise CheckpointError(f"{source}: {key}'s rope_type must be a string such as \"default\", not {kind!r}")
        sections[key] = {k: v for k, v in section.items() if k != "type"} | {"rope_type": kind} if section else {}
    params, scaling = sections["rope_parameters"], sections["rope_scaling"]
    default_theta = THETA_DEFAULTS.get(arch, 10000.0)

    def compared(section: dict) -> dict:  # a theta equal to the one transformers would use is no difference
        theta = scaling.get("rope_theta", hf.get("rope_theta", default_theta))
        return {k: v for k, v in section.items() if not (k == "rope_theta" and v == theta)}

    if params and scaling and compared(params) != compared(scaling):  # transformers would read rope_scaling alone
        kinds = {params["rope_type"], scaling["rope_type"]}
        differ = f"of different types ({sorted(kinds)})" if len(kinds) > 1 else "that differ"
        raise CheckpointError(f"{source} holds rope_parameters and rope_scaling {differ}; transformers reads only "
                              "rope_scaling (and its rope_theta from there or the top level): keep the one the model "
                              "was trained with")
    p = Fields(scaling or params, f"{source} (rope)")
    rope_type = p.data.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"{source}: rope scaling {rope_type!r} is not supported (supported: "
                                    f"{', '.join(ROPE_TYPES)})")
    partial = (p if p.data.get("partial_rotary_factor") is not None else f).get("partial_rotary_factor", "number", 1.0)
    if not 0 < partial <= 1:
        raise CheckpointError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial}")
    if partial != 1 and arch != "phi3":  # transformers' other architectures rotate whole heads (and fail on it)
        raise UnsupportedModelError(f"{source}: partial_rotary_factor={partial} (rotary embedding over part of each "
                                    f"head) is not supported for {arch}: only Phi-3's layers (Phi-4-mini) rotate part")
    if rope_type == "llama3":  # its frequency band is required, as transformers requires it
        low, high = p.get("low_freq_factor", "number", least=0), p.get("high_freq_factor", "number", least=0)
    else:
        low, high = p.get("low_freq_factor", "number", 1.0, least=0), p.get("high_freq_factor", "number", 4.0, least=0)
    if rope_type == "llama3" and not low < high:
        raise CheckpointError(f"{source}: llama3 rope needs low_freq_factor < high_freq_factor, got {low} and {high}")
    theta = (p if p.data.get("rope_theta") is not None else f).get("rope_theta", "number", default_theta, least=0)
    # as transformers: a top-level original_max_position_embeddings (Phi-3 style) wins, then the rope section's
    scaled = ("llama3", "yarn", "longrope")
    original = (f if hf.get("original_max_position_embeddings") is not None and rope_type in scaled
                else p).get("original_max_position_embeddings", "int", None, least=1) or positions
    if rope_type == "default":
        factor = p.get("factor", "number", 1.0, least=0)
    elif rope_type == "yarn" and "factor" in p.data or rope_type == "longrope":
        # null (and longrope's absent): the ratio of the context lengths (transformers)
        factor = p.get("factor", "number", positions / original, least=0)
    else:
        factor = p.get("factor", "number", least=0)  # required (linear, llama3, yarn), as transformers requires it
    if theta <= 0 or factor <= 0:
        raise CheckpointError(f"{source}: rope_theta and the rope factor must be > 0, got {theta} and {factor}")
    if rope_type == "yarn" and theta <= 1:
        raise CheckpointError(f"{source}: yarn rope needs rope_theta > 1 (its ramp divides by log(theta)), got {theta}")
    fields = dict(theta=float(theta), type=rope_type, factor=float(factor), low_freq_factor=float(low),
                  high_freq_factor=float(high), original_max_position_embeddings=original,
                  partial_rotary_factor=float(partial))
    if rope_type == "longrope":
        return fields | longrope_fields(p, float(factor), original)
    return fields | (yarn_fields(p, float(factor)) if rope_type == "yarn" else {})


def longrope_fields(p: Fields, factor: float, original: int) -> dict[str, Any]:
    """LongRoPE's per-frequency factors and the factor on cos/sin, as transformers reads them."""
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = p.data.get(key)
        if not (isinstance(value, list) and value and all(isinstance(x, int | float) and not isinstance(x, bool)
                                                          and 0 < x < math.inf for x in value)):
            raise CheckpointError(f"{p.source}: longrope's {key} must be a list of positive numbers, not "
                                  f"{value!r:.80}; restore it from the original checkpoint")
        factors[key] = tuple(float(x) for x in value)
    attention = p.get("attention_factor", "number", None, least=0)
    if attention is None and factor > 1 and original < 2:
        raise CheckpointError(f"{p.source}: longrope needs original_max_position_embeddings > 1, got {original}")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if not ATTENTION_FACTORS[0] < attention < ATTENTION_FACTORS[1]:
        raise CheckpointError(f"{p.source}: longrope's attention_factor must be between 1e-6 and 1e6, got {attention}")
    return factors | {"attention_factor": float(attention)}


def yarn_fields(p: Fields, factor: float) -> dict[str, Any]:
    """YaRN's ramp bounds and the factor on cos/sin, as transformers reads them (a 0 beta is the default)."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor", "number", None, least=0)
    m, m_all = p.get("mscale", "number", None), p.get("mscale_all_dim", "number", None)
    if attention is None and m and m_all:
        below = mscale(factor, m_all)
        attention = mscale(factor, m) / below if below else math.inf
    elif attention is None:
        attention = mscale(factor)
    raw = p.data.get("truncate")  # transformers tests its truth: 0 and 1 count too
    truncate = True if raw is None else bool(raw) if raw in (0, 1) else p.get("truncate", "bool")
    if not ATTENTION_FACTORS[0] < attention < ATTENTION_FACTORS[1]:
        raise CheckpointError(f"{p.source}: yarn's attention factor (attention_factor, or what mscale and "
                              f"mscale_all_dim make of the factor) must be between 1e-6 and 1e6, got {attention}")
    return dict(beta_fast=float(p.get("beta_fast", "number", 0.0, least=0) or 32.0),
                beta_slow=float(p.get("beta_slow", "number", 0.0, least=0) or 1.0),
                attention_factor=float(attention), truncate=truncate)


def gemma_ropes(hf: dict[str, Any], f: Fields, source: str, positions: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3's two rotary embeddings, as Gemma3TextConfig reads them: the full-attention layers' (rope_theta, 1e6
    by default, with any rope_scaling) and the sliding layers' (rope_local_base_freq, 1e4, unscaled), or
    rope_parameters' section for each layer type (transformers 5)."""
    nested = hf.get("rope_parameters")
    if isinstance(nested, dict) and ("full_attention" in nested or "sliding_attention" in nested):
        sections = {kind: nested.get(kind) or {"rope_type": "default"} for kind in ("full_attention",
                                                                                  "sliding_attention")}
    elif nested:  # Gemma3TextConfig ignores such keys; building them would make another model than transformers'
        raise CheckpointError(f"{source}: Gemma 3's rope_parameters needs a section per layer type (full_attention, "
                              "sliding_attention), as transformers 5 writes it; for the full layers' scaling alone "
                              "use rope_scaling")
    else:
        sections = {"full_attention": {"rope_type": "default", **(hf.get("rope_scaling") or {})},
                    "sliding_attention": {"rope_type": "default"}}
    thetas = {"full_attention": f.get("rope_theta", "number", 1e6, least=0),
              "sliding_attention": f.get("rope_local_base_freq", "number", 1e4, least=0)}
    ropes = []
    for kind, section in sections.items():
        if not isinstance(section, dict):
            raise CheckpointError(f"{source}: rope_parameters' {kind} must be an object, not {section!r:.60}")
        one = {"rope_parameters": {"rope_theta": thetas[kind], **section}, "rope_scaling": None,
               "max_position_embeddings": positions}
        ropes.append(rope_fields(one, Fields(one, f"{source} ({kind})"), source, positions, "gemma3"))
    if ropes[0]["type"] == "longrope":  # its long rows would index the sliding layers' tables too
        raise UnsupportedModelError(f"{source}: longrope on Gemma 3's full layers is not supported (no Gemma 3 "
                                    "uses it)")
    return ropes[0], ropes[1]
