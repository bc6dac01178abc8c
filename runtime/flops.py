"""What a throughput run computes, in FLOPs: the basis of its achieved GFLOP/s."""

from __future__ import annotations

from camshaft.manifest import Manifest
from camshaft.runtime.bench_data import BenchRequest


def linear_params(manifest: Manifest) -> tuple[int, int]:
    """(weights of the per-token matmuls of all layers, weights of the LM head)."""
    m = manifest.model
    q = m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    attention = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
    dense = 3 * m.hidden_size * m.intermediate_size
    # a mixture of experts computes its router and the experts each token is routed to
    sparse = m.hidden_size * m.num_experts + m.experts_per_token * 3 * m.hidden_size * m.expert_intermediate_size
    moe = len(m.moe_layers)
    return attention * m.num_layers + dense * (m.num_layers - moe) + sparse * moe, m.vocab_size * m.hidden_size


def _attended(n: int, window: int | None) -> int:
    """Keys the first n tokens of a sequence attend to in all: token p attends to min(p, window) of them."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def count_flops(manifest: Manifest, requests: list[BenchRequest], reused: list[int] | None = None) -> dict[str, float]:
    """FLOPs of computing every request once (no preemption recompute): 2 x layer weights x tokens fed
    (prompt + output - 1), 2 x LM-head weights x logits rows (one per output token), and attention
    4 x heads x head_dim x context per token per layer (QK^T and PV; a sliding-window layer's context is at most its
    window). `reused`: each request's prompt tokens taken from the prefix cache, never computed. Prompt lookup's
    drafts that were fed and rejected are not counted: GFLOP/s counts useful work only."""
    m = manifest.model
    layers, head = linear_params(manifest)
    reused = reused or [0] * len(requests)
    totals = [len(r.prompt_ids) + r.max_tokens - 1 for r in requests]
    fed = sum(n - k for n, k in zip(totals, reused, strict=True))
    rows = sum(r.max_tokens for r in requests)
    sliding = sum(kind == "sliding" for kind in m.layer_types)
    attended = sum(count * sum(_attended(n, window) - _attended(k, window) for n, k in zip(totals, reused, strict=True))
                   for count, window in ((m.num_layers - sliding, None), (sliding, m.sliding_window)) if count)
    attention = 4 * m.num_heads * m.head_dim * attended
    return {"linear": 2.0 * layers * fed, "lm_head": 2.0 * head * rows, "attention": float(attention),
            "tokens_fed": fed}
