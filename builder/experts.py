"""A mixture of experts' weights as each architecture stores them: one matrix per expert (Qwen3-MoE and OLMoE:
mlp.experts.E.{gate,up,down}_proj; Mixtral: block_sparse_moe.experts.E.w1 / w3 / w2) or all experts stacked
(GraniteMoE: block_sparse_moe.input_linear [E, 2I, H], gate rows then up rows, and output_linear [E, H, I])."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from camshaft.model_config import ModelConfig

Weights = Callable[[str, tuple[int, ...]], np.ndarray]
PER_EXPERT = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}  # else ("mlp", gate_proj / up_proj / down_proj)


def expert_tensors(c: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s router and expert weights, by their names in the checkpoint, with their shapes."""
    h, inner, count, p = c.hidden_size, c.expert_intermediate_size, c.num_experts, f"model.layers.{layer}"
    if c.architecture == "granitemoe":
        moe = f"{p}.block_sparse_moe"
        return {f"{moe}.router.layer.weight": (count, h), f"{moe}.input_linear.weight": (count, 2 * inner, h),
                f"{moe}.output_linear.weight": (count, h, inner)}
    module, (gate, up, down) = PER_EXPERT.get(c.architecture, ("mlp", ("gate_proj", "up_proj", "down_proj")))
    shapes = {f"{p}.{module}.gate.weight": (count, h)}
    for e in range(count):
        base = f"{p}.{module}.experts.{e}"
        shapes |= {f"{base}.{gate}.weight": (inner, h), f"{base}.{up}.weight": (inner, h),
                   f"{base}.{down}.weight": (h, inner)}
    return shapes


def read_experts(c: ModelConfig, layer: int, weights: Weights,
                 dtype: np.dtype) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """(the router's name, its weight [E, H], the experts' gate and up rows interleaved [E, 2I, H] as ONNX Runtime's
    MoE takes them, their down weights [E, H, I]), the experts written straight into arrays of `dtype` (one layer's
    experts in memory once)."""
    names = list(expert_tensors(c, layer).items())
    router_name, router_shape = names[0]
    inner, count = c.expert_intermediate_size, c.num_experts
    gate_up = np.empty((count, 2 * inner, c.hidden_size), dtype)
    down = np.empty((count, c.hidden_size, inner), dtype)
    if c.architecture == "granitemoe":
        stacked = weights(*names[1])
        gate_up[:, 0::2], gate_up[:, 1::2] = stacked[:, :inner], stacked[:, inner:]
        del stacked
        down[:] = weights(*names[2])
    else:
        for e in range(count):
            (gate, gate_shape), (up, up_shape), (down_name, down_shape) = names[1 + 3 * e: 4 + 3 * e]
            gate_up[e, 0::2], gate_up[e, 1::2] = weights(gate, gate_shape), weights(up, up_shape)
            down[e] = weights(down_name, down_shape)
    return router_name, weights(router_name, router_shape), gate_up, down
