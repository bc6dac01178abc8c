"""The float head's certified greedy shortcut (builder/graph/screen.py) on SmolLM2's sequence graph: decode-step time
with it and without it (the same engine, `SequenceEngine.screen` on or off, interleaved pairs in one process) and how
many greedy steps it certified (a certified step's logits are −inf outside the rows it kept).

    .venv/bin/python scripts/probe_screened_head.py [--engine out/bench/engine-fp32] [--pairs 5] [--steps 64]

The engine is the latency benchmark's (scripts/bench_latency.py builds it); the prompt is its 64 random ids.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from bench_common import REPO


def decode(engine, prompt: list[int], screen: bool, steps: int) -> tuple[float, int]:
    """(ms a decode step, certified steps) of a greedy decode after `prompt`."""
    engine.start(len(prompt) + steps + 1)
    engine.screen(screen)
    try:
        logits = engine.feed(prompt, 0, copy=False)
        token, position, certified = int(logits.argmax()), len(prompt), 0
        start = time.perf_counter()
        for _ in range(steps):
            logits = engine.feed([token], position, copy=False)
            position += 1
            token = int(logits.argmax())
            certified += int(not np.isfinite(logits).all())
        return (time.perf_counter() - start) / steps * 1e3, certified
    finally:
        engine.finish()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, default=REPO / "out" / "bench" / "engine-fp32")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from camshaft.runtime.bench import benchmark_prompt
    from camshaft.runtime.sequence import SequenceEngine

    engine = SequenceEngine(args.engine, threads=args.threads)
    if not engine.layout.screens_greedy:
        raise SystemExit(f"{args.engine} has no screened head (built before it, or its head is not float)")
    prompt = benchmark_prompt(engine.manifest.model.vocab_size, 64)
    decode(engine, prompt, True, args.steps)  # warm-up, both ways
    decode(engine, prompt, False, args.steps)
    on, off, certified = [], [], 0
    for i in range(args.pairs):
        for screen in ((True, False) if i % 2 == 0 else (False, True)):
            ms, count = decode(engine, prompt, screen, args.steps)
            (on if screen else off).append(ms)
            certified += count if screen else 0
    ratio = statistics.median(b / a for a, b in zip(on, off, strict=True))
    print(f"decode step with the shortcut {statistics.median(on):.2f} ms ({min(on):.2f}-{max(on):.2f}), without it "
          f"{statistics.median(off):.2f} ms ({min(off):.2f}-{max(off):.2f}): {ratio:.2f}x by pair; certified "
          f"{certified} of {args.pairs * args.steps} greedy steps")


if __name__ == "__main__":
    main()
