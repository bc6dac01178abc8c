"""Latency benchmark of one engine: batch 1, fixed prompt ids, greedy, end id ignored."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np

from camshaft.checks import is_int_at_least
from camshaft.errors import RequestError
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session


def benchmark_prompt(vocab_size: int, prompt_len: int, seed: int = 0) -> list[int]:
    """Deterministic prompt ids shared with the peer benchmarks, so every system sees the same input."""
    return np.random.default_rng(seed).integers(100, min(vocab_size, 30000), prompt_len).tolist()


def latency_benchmark(engine_dir: str | Path, prompt_len: int = 64, max_tokens: int = 128, repeats: int = 5,
                      warmup: int = 1, session: Session | None = None,
                      progress: Callable[[str], None] = lambda _: None) -> dict[str, float | str]:
    for name, value, least in (("prompt_len", prompt_len, 1), ("max_tokens", max_tokens, 2), ("repeats", repeats, 1),
                               ("warmup", warmup, 0)):
        if not is_int_at_least(value, least):
            raise RequestError(f"{name} must be an integer >= {least}, got {value!r}")
    session = session or Session(engine_dir)
    limit = session.manifest.limits.max_seq_len
    if prompt_len + max_tokens > limit:
        raise RequestError(f"prompt_len ({prompt_len}) + max_tokens ({max_tokens}) exceed the engine's max_seq_len "
                           f"({limit}); lower them or rebuild with a larger --max-seq-len")
    prompt = benchmark_prompt(session.manifest.model.vocab_size, prompt_len)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(warmup):
        progress(f"warm-up {i + 1}/{warmup}")
        session.generate(prompt, params)
    runs = []
    for i in range(repeats):
        progress(f"run {i + 1}/{repeats}: {prompt_len} prompt tokens, {max_tokens} new")
        runs.append(session.generate(prompt, params).timings)
    return {
        "graph": session.graph,
        "huge_pages_mib": session.huge_page_bytes >> 20,
        "prompt_tokens": prompt_len,
        "output_tokens": max_tokens,
        "ttft_ms": round(statistics.median(t.ttft_s for t in runs) * 1000, 2),
        "prefill_tok_s": round(statistics.median(t.prefill_tok_s for t in runs), 1),
        "decode_tok_s": round(statistics.median(t.decode_tok_s for t in runs), 1),
        "total_s": round(statistics.median(t.total_s for t in runs), 3),
    }
