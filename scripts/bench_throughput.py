#!/usr/bin/env python
"""Throughput of camshaft's in-flight batching against transformers static batching on SmolLM2-135M-Instruct
(CPU, fp32).

camshaft: `LLM` on an onnxruntime fp32 engine (max_seq_len 1024, batch 32, 512 tokens a step), a closed-loop
client with at most C requests in flight (`camshaft.runtime.throughput`). Peer: transformers fp32, greedy, static
batches of C requests in arrival order, left padding, each batch generating until its longest request is done.
Both get the same prompt token ids and output lengths (end id ignored) and the same thread count.

Also measured in the same run: the machine's fp32 matmul peak (ONNX Runtime, torch and numpy matmuls, before and after
the runs), the Python
overhead of camshaft's batch loop, and how many requests a fixed KV pool admits at once under paging against a
contiguous max_seq_len reservation per request.

Writes out/bench/throughput.json and a plot (docs/bench/throughput.png with --write-md), prints a Markdown section,
and with --write-md replaces the section between the throughput markers in BENCHMARKS.md. Needs the `bench` extra.

    .venv/bin/python scripts/bench_throughput.py --write-md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import REPO, log, machine_info, publish, rel, show_cmd
from bench_matmul_peak import best_of, sgemm_peak, streamed_matmul
from bench_static_peer import PEER, TransformersPeer
from bench_systems import Isolated
from bench_throughput_md import MD_BEGIN, MD_END, markdown

from camshaft.models import default_model_dir, fetch_model

MODEL = "smollm2-135m-instruct"


# ----------------------------------------------------------------------------------------------------- the engine

def engine_fits(engine_dir: Path, args) -> bool:
    from camshaft.errors import CamshaftError
    from camshaft.manifest import read_manifest
    from camshaft.runtime.backends.onnxruntime import check_compatible

    try:
        manifest = read_manifest(engine_dir)
        check_compatible(manifest)
    except CamshaftError:
        return False
    limits = manifest.limits
    return (manifest.target == "onnxruntime" and manifest.dtype == "float32" and limits.max_seq_len == args.max_seq_len
            and limits.max_batch_size >= max(args.levels) and limits.max_num_tokens == args.max_num_tokens)


def ensure_engine(model_dir: Path, engine_dir: Path, args) -> None:
    if engine_dir.is_dir() and engine_fits(engine_dir, args):
        return
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    log(f"building {rel(engine_dir)}")
    build_engine(BuildConfig(model_dir, engine_dir, max_seq_len=args.max_seq_len, max_batch_size=max(args.levels),
                             max_num_tokens=args.max_num_tokens))


# ---------------------------------------------------------------------------------------------- memory: admitted

def admitted_at_once(engine_dir: Path, requests, pool_tokens: int, threads: int, policy: str,
                     reservation: str = "paged") -> dict:
    """Submit all requests at once to an LLM whose KV pool holds `pool_tokens` tokens; once the scheduler has
    admitted all it can (two steps with no prefill: every admitted request decodes), record the most requests
    running at once; abort.
    reservation "contiguous": each request holds max_seq_len tokens of the pool, as without paging."""
    from camshaft.manifest import read_manifest
    from camshaft.runtime.kv_cache import bytes_per_block
    from camshaft.runtime.llm import LLM
    from camshaft.runtime.sampling_params import SamplingParams

    manifest = read_manifest(engine_dir)
    block = manifest.limits.kv_block_size
    budget = bytes_per_block(manifest) * (pool_tokens // block + 1)  # + the null block
    with LLM(engine_dir, threads=threads, kv_cache_memory=budget, policy=policy, kv_reservation=reservation) as llm:
        built = [llm._requests(list(r.prompt_ids), SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                   ignore_eos=True))[0] for r in requests]
        ids = [request.request_id for request in built]
        llm.executor.submit_groups([[request] for request in built], [[lambda out: None]] * len(built), bounded=False)
        deadline = time.perf_counter() + 600
        while time.perf_counter() < deadline:
            stats = llm.stats
            load = llm.load()
            if len(stats) >= 2 and all(s.num_prefill_tokens == 0 for s in stats[-2:]) or \
                    stats and not (load.running or load.waiting):
                break
            time.sleep(0.05)
        stats = llm.stats
        for request_id in ids:
            llm.executor.abort(request_id)
        return {"policy": policy, "pool_tokens": (pool_tokens // block) * block, "requests": len(requests),
                "peak_admitted": llm.executor.peak_batch_size,
                "peak_kv_usage": max(s.kv_usage for s in stats), "steps_observed": len(stats),
                "still_waiting": stats[-1].queue_length}


# ------------------------------------------------------------------------------------------------- plot and text
# ----------------------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--work-dir", type=Path, default=REPO / "out" / "bench")
    p.add_argument("--model-dir", type=Path, default=None, help="SmolLM2 checkpoint (default: fetch into the cache)")
    p.add_argument("--dataset", default="synthetic:in=NORMAL(200,50),out=NORMAL(128,32)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32, help="the target point (compared with the peer)")
    p.add_argument("--sweep", default="1,8,32", help="camshaft concurrencies for the plot")
    p.add_argument("--peer-sweep", default="32", help="transformers batch sizes (each runs the requests camshaft "
                   "runs at that concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--max-num-tokens", type=int, default=512)
    p.add_argument("--memory-pool-seqs", type=int, default=8,
                   help="KV pool of the memory comparison, in max_seq_len sequences (0: skip it)")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG to write (default: docs/bench/throughput.png with --write-md, else beside the JSON)")
    p.add_argument("--md", type=Path, default=REPO / "BENCHMARKS.md")
    p.add_argument("--write-md", action="store_true", help="replace the throughput section of --md")
    args = p.parse_args(argv)
    args.levels = sorted({int(x) for x in args.sweep.split(",") if x.strip()} | {args.concurrency})
    args.peer_levels = sorted({int(x) for x in args.peer_sweep.split(",") if x.strip()} | {args.concurrency})
    return args


MIN_LEVEL_REQUESTS = 8


def level_requests(requests: list, c: int, args: argparse.Namespace) -> list:
    """The requests a sweep level runs: the first ones of the dataset, as many per slot as the target point has
    (--num-requests / --concurrency), so every level sees the same mix of first batch, joining and draining; at least
    MIN_LEVEL_REQUESTS (C = 1's p50 TTFT is the idle TTFT the joining target compares with)."""
    return requests[:max(c, MIN_LEVEL_REQUESTS, round(c * args.num_requests / args.concurrency))]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from camshaft.runtime.bench_data import load_dataset, warmup_requests
    from camshaft.runtime.flops import linear_params
    from camshaft.runtime.llm import LLM
    from camshaft.runtime.throughput import run_throughput
    from camshaft.runtime.throughput_plot import plot_sweep
    from camshaft.runtime.throughput_report import clipped_lines

    load_before = os.getloadavg()[0]
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir or fetch_model(MODEL, default_model_dir(MODEL), progress=log))
    engine_dir = work / "engine-throughput"
    ensure_engine(model_dir, engine_dir, args)

    log("fp32 matmul peak (before the run)")
    sgemm = sgemm_peak(args.threads)
    log(f"  {sgemm['gflop_s']}")

    from camshaft.manifest import read_manifest

    manifest = read_manifest(engine_dir)
    cam, tokens, requests = [], None, None
    for c in sorted(args.levels, reverse=True):
        with LLM(engine_dir, threads=args.threads) as llm:  # a fresh LLM each: an empty prefix cache
            if requests is None:
                requests = load_dataset(args.dataset, args.num_requests, max_seq_len=manifest.limits.max_seq_len,
                                        vocab_size=manifest.model.vocab_size, seed=args.seed,
                                        tokenizer=llm.tokenizer)
            run_throughput(llm, warmup_requests(requests, manifest.model.vocab_size), 4)
            subset = level_requests(requests, c, args)
            log(f"camshaft: {len(subset)} requests, concurrency {c}")
            r = run_throughput(llm, subset, c, keep_token_ids=c == args.concurrency)
        if c == args.concurrency:
            tokens = [rec.token_ids for rec in r.records]
        cam.append(r.to_dict())
        for line in clipped_lines(r.clipped):
            log(line)
        log(f"  {r.output_tok_s:.1f} out tok/s, TTFT p50 {r.ttft_ms['p50']:.0f} ms, {r.gflop_s:.1f} GFLOP/s, "
            f"overhead {100 * r.python_overhead['all_steps']['outside_engine_step']:.1f} %, "
            f"prefix hits {r.prefix_hits}, {r.wall_s:.0f} s")

    memory = None
    if args.memory_pool_seqs:
        pool = args.memory_pool_seqs * args.max_seq_len
        subset = requests[:max(args.levels)]
        paged = []
        for policy in ("guaranteed_no_evict", "max_utilization"):
            log(f"memory: {len(subset)} requests into a {pool}-token pool, {policy}")
            paged.append(admitted_at_once(engine_dir, subset, pool, args.threads, policy))
            log(f"  {paged[-1]}")
        log(f"memory: {len(subset)} requests into a {pool}-token pool, max_seq_len reserved per request")
        contiguous = admitted_at_once(engine_dir, subset, pool, args.threads, "guaranteed_no_evict", "contiguous")
        log(f"  {contiguous}")
        memory = {"pool_tokens": paged[0]["pool_tokens"], "contiguous": contiguous, "paged": paged}

    log("fp32 matmul peak (after camshaft's runs)")
    sgemm = best_of(sgemm, sgemm_peak(args.threads))
    log(f"  {sgemm['gflop_s']}")
    streamed = streamed_matmul(args.threads, 4 * linear_params(manifest)[0], rows=args.concurrency)
    log(f"  {args.concurrency}-row products over the model's layer weight bytes, streamed: {streamed}")

    log("transformers peer (in a process of its own, as camshaft's LLM had this one)")
    peer_system = Isolated(TransformersPeer, model_dir, args.threads)
    peer_system.run(warmup_requests(requests, manifest.model.vocab_size), 4)
    peer, equal = [], None
    for c in args.peer_levels:
        subset = level_requests(requests, c, args)
        log(f"transformers: {len(subset)} requests, static batches of {c}")
        p = peer_system.run(subset, c)
        peer_tokens = p.pop("token_ids")
        p["num_requests"] = len(subset)
        peer.append(p)
        log(f"  {p['output_tok_s']:.1f} out tok/s, TTFT p50 {p['ttft_ms']['p50']:.0f} ms, {p['wall_s']:.0f} s")
        if c == args.concurrency and tokens is not None:
            same = [a == b for a, b in zip(tokens, peer_tokens, strict=True)]
            prefix = 0
            for a, b in zip(tokens, peer_tokens, strict=True):
                n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                prefix += n
            equal = {"requests": len(same), "equal": sum(same), "prefix_share": prefix / sum(map(len, tokens))}
    peer_system.close()

    layers, head = linear_params(manifest)
    prompt_lens = [len(r.prompt_ids) for r in requests]
    output_lens = [r.max_tokens for r in requests]
    results = {
        "benchmark": "throughput",
        "model": MODEL,
        "command": show_cmd([sys.executable, str(Path(sys.argv[0]).resolve()), *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine_info(),
        "config": {"dataset": args.dataset, "seed": args.seed, "num_requests": args.num_requests,
                   "concurrency": args.concurrency, "levels": args.levels, "peer_levels": args.peer_levels,
                   "requests_per_slot": args.num_requests / args.concurrency,
                   "min_level_requests": MIN_LEVEL_REQUESTS, "threads": args.threads,
                   "max_seq_len": args.max_seq_len, "max_num_tokens": args.max_num_tokens,
                   "kv_block_size": manifest.limits.kv_block_size,
                   "max_batch_size": manifest.limits.max_batch_size, "engine_dir": rel(engine_dir),
                   "prompt_tokens_mean": float(np.mean(prompt_lens)), "prompt_tokens_min": min(prompt_lens),
                   "prompt_tokens_max": max(prompt_lens), "output_tokens_mean": float(np.mean(output_lens)),
                   "output_tokens_min": min(output_lens), "output_tokens_max": max(output_lens)},
        "sgemm": sgemm,
        "streamed": streamed,
        "linear_params": layers,
        "lm_head_params": head,
        "camshaft": cam,
        "peer": peer,
        "greedy_equal": equal,
        "memory": memory,
        "load": [load_before, os.getloadavg()[0]],
    }
    json_path = work / "throughput.json"
    if args.plot is None:  # the committed plot changes only with the section that shows it
        args.plot = (REPO / "docs" / "bench" if args.write_md else work) / "throughput.png"

    from types import SimpleNamespace

    points = [SimpleNamespace(concurrency=r["concurrency"], output_tok_s=r["output_tok_s"], ttft_ms=r["ttft_ms"])
              for r in cam]
    peers = {PEER: [{"concurrency": p["concurrency"], "output_tok_s": p["output_tok_s"],
                     "ttft_p50_ms": p["ttft_ms"]["p50"]} for p in peer]}
    m = results["machine"]
    title = (f"SmolLM2-135M-Instruct fp32, {args.threads} threads, {m['cpu']} — {args.dataset}, "
             f"{args.num_requests / args.concurrency:g} requests per slot ({args.num_requests} at C = "
             f"{args.concurrency})")
    publish(results, json_path, args.plot, lambda path: plot_sweep(points, path, peers, title=title), args.md,
            markdown, (MD_BEGIN, MD_END), args.write_md)


if __name__ == "__main__":
    main()
