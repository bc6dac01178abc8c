#!/usr/bin/env python
"""Where a batched decode step of the batch graph goes: ONNX Runtime's profiler, time per operator type.

Fills B sequences with random prompts of L tokens through the engine's paged pool, then profiles `steps` decode steps
of all B at once (the throughput benchmark's steady state at C = 32 has contexts of ~200-330 tokens). Kernel time is
summed per operator type; `If` holds the attention groups, so the operators inside it are counted twice (once
alone, once in their If). Prints a Markdown section; --write-md replaces it in BENCHMARKS.md.

    .venv/bin/python scripts/profile_batch_step.py --engine out/bench/engine-throughput --batch 32 --context 300
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import write_markdown  # noqa: E402

from camshaft.runtime.backends import onnxruntime as ort_backend  # noqa: E402
from camshaft.runtime.batch import Chunk  # noqa: E402
from camshaft.runtime.engine import Engine  # noqa: E402

MD_BEGIN, MD_END = "<!-- batch-step-profile:begin -->", "<!-- batch-step-profile:end -->"


def profile(engine_dir: Path, batch: int, context: int, steps: int, threads: int,
            prefix: str) -> tuple[dict, float, float]:
    plain = ort_backend.session_options

    def profiling(threads_: int | None, spin_wait: bool):
        options = plain(threads_, spin_wait)
        options.enable_profiling = True
        options.profile_file_prefix = prefix
        return options

    ort_backend.session_options = profiling
    try:
        engine = Engine(engine_dir, max_sequences=batch, threads=threads)
    finally:
        ort_backend.session_options = plain
    # The pool written once, as a server's is after its first requests. Pages so far only read map the kernel's zero
    # page and their first write faults inside a step: under the profiler ~0.7 ms a ScatterND on such steps, while
    # the unprofiled step time was the same either way (scratch A/B).
    for cache in engine.backend.caches:
        cache.fill(0)
    rng = np.random.default_rng(0)
    budget = engine.limits.max_num_tokens
    sequences = []
    for _ in range(batch):
        blocks = engine.pool.allocate(-(-(context + steps) // engine.block_size))
        ids = rng.integers(0, engine.manifest.model.vocab_size, context).tolist()
        for start in range(0, context, budget):
            engine.step([Chunk(ids[start:start + budget], start, blocks, num_logits=1)])
        sequences.append([blocks, context])
    started = time.perf_counter()
    for _ in range(steps):
        engine.step([Chunk([5], pos, blocks) for blocks, pos in sequences])
        for seq in sequences:
            seq[1] += 1
    wall_ms = (time.perf_counter() - started) / steps * 1000
    trace = engine.backend.session.end_profiling()
    events = json.loads(Path(trace).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-steps:]
    by_op: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= runs[0]["ts"]:
            by_op[e["args"]["op_name"]] += e["dur"]
    run_ms = sum(r["dur"] for r in runs) / steps / 1000
    return {op: us / steps / 1000 for op, us in by_op.most_common()}, run_ms, wall_ms


def markdown(args: argparse.Namespace, ops: dict, run_ms: float, wall_ms: float) -> str:
    command = " ".join(["`.venv/bin/python scripts/profile_batch_step.py", *sys.argv[1:]]) + "`"
    out = [MD_BEGIN, f"## Where a batch-{args.batch} decode step goes (batch graph, CPU)", "",
           f"Command: {command} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). {args.batch} sequences of "
           f"{args.context} tokens decode together for {args.steps} steps under ONNX Runtime's profiler "
           f"({args.threads} threads); kernel time per operator type, per step. `If` holds the attention groups: its "
           "time includes the operators inside it (Attention, the block-table Gathers of K/V and their Reshapes), "
           "which are also listed alone.", "",
           "| operator | ms / step | share of the model run |", "|---|---|---|"]
    for op, ms in ops.items():
        if ms >= 0.1:
            out.append(f"| {op} | {ms:.1f} | {100 * ms / run_ms:.0f} % |")
    out += ["", f"Model run {run_ms:.1f} ms a step (`Engine.step` {wall_ms:.1f} ms). Linear layers are MatMul and Gemm "
            "(residual adds fused); Gather includes the K/V gathers through block tables, the embedding and the "
            "logits rows; ScatterND writes the new K/V into the paged cache.", MD_END]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-md", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ops, run_ms, wall_ms = profile(args.engine, args.batch, args.context, args.steps, args.threads,
                                       str(Path(tmp) / "profile"))
        for leftover in glob.glob(str(Path(tmp) / "profile*")):
            Path(leftover).unlink()
    section = markdown(args, ops, run_ms, wall_ms)
    print(section)
    if args.write_md:
        write_markdown(Path(__file__).resolve().parents[1] / "BENCHMARKS.md", section, MD_BEGIN, MD_END)


if __name__ == "__main__":
    main()
