#!/usr/bin/env python
"""Huge pages on vs off (`LLM(..., huge_pages=...)`): in-flight batching throughput, alternating fresh processes.

Each trial is a process of its own (spawned) that loads the engine with or without its weights on transparent huge
pages, warms up and runs the throughput workload once; trials alternate on, off, off, on, ... so neither side always
runs first. Prints each trial (with the time `LLM(...)` took to load: the collapse is part of it), then the median
of the per-pair ratios (on / off).

    .venv/bin/python scripts/ab_huge_pages.py --engine out/bench/engine-throughput --pairs 4
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def trial(engine: str, huge_pages: bool, dataset: str, num_requests: int, concurrency: int, threads: int) -> dict:
    from camshaft.manifest import read_manifest
    from camshaft.runtime.bench_data import load_dataset, warmup_requests
    from camshaft.runtime.llm import LLM
    from camshaft.runtime.throughput import run_throughput

    m = read_manifest(engine)
    start = time.perf_counter()
    with LLM(engine, threads=threads, huge_pages=huge_pages) as llm:
        load_s = time.perf_counter() - start
        requests = load_dataset(dataset, num_requests, max_seq_len=m.limits.max_seq_len,
                                vocab_size=m.model.vocab_size, seed=0, tokenizer=llm.tokenizer)
        run_throughput(llm, warmup_requests(requests, m.model.vocab_size), 4)
        r = run_throughput(llm, requests, concurrency)
        return {"huge_pages": huge_pages, "huge_page_bytes": llm.engine.backend.huge_page_bytes, "load_s": load_s,
                "output_tok_s": r.output_tok_s, "gflop_s": r.gflop_s, "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default=str(REPO / "out" / "bench" / "engine-throughput"))
    p.add_argument("--dataset", default="synthetic:in=NORMAL(200,50),out=NORMAL(128,32)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", type=int, default=4)
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    results: dict[bool, list[float]] = {True: [], False: []}
    with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per trial
        for i in range(args.pairs):
            for huge in (True, False) if i % 2 == 0 else (False, True):
                r = pool.apply(trial, (args.engine, huge, args.dataset, args.num_requests, args.concurrency,
                                       args.threads))
                results[huge].append(r["output_tok_s"])
                print(f"pair {i + 1}: huge_pages={huge}: {r['output_tok_s']:.1f} out tok/s, {r['gflop_s']:.1f} "
                      f"GFLOP/s, {r['huge_page_bytes'] >> 20} MiB on huge pages, LLM loaded in {r['load_s']:.2f} s; "
                      f"1-minute load {r['load']:.2f}", flush=True)
    ratios = [a / b for a, b in zip(results[True], results[False], strict=True)]
    print(f"on / off, output tok/s: median {statistics.median(ratios):.3f} "
          f"(pairs: {', '.join(f'{x:.3f}' for x in ratios)}); {args.num_requests} requests, C = {args.concurrency}, "
          f"{args.threads} threads, {args.engine}")


if __name__ == "__main__":
    main()
