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
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import machine_info, rel, show_cmd, write_markdown

from camshaft.models import default_model_dir, fetch_model

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
MD_BEGIN = "<!-- throughput:begin -->"
MD_END = "<!-- throughput:end -->"
PEER = "transformers fp32 (static batches)"


def log(message: str) -> None:
    print(f"· {message}", file=sys.stderr, flush=True)


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


# ---------------------------------------------------------------------------------------------------- matmul peak

def best_of(first: dict, second: dict) -> dict:
    """Two peak measurements (before and after the runs: this machine's speed drifts) merged, best per shape."""
    out = {k: max(first["gflop_s"][k], second["gflop_s"][k]) for k in first["gflop_s"]}
    best = max(out, key=out.get)
    return {**first, "gflop_s": out, "peak_gflop_s": out[best], "peak_shape": best}


def sgemm_peak(threads: int, repeats: int = 7) -> dict:
    """fp32 matmul GFLOP/s on `threads` threads, ONNX Runtime's MatMul (the engine's kernel, weight as an
    initializer), torch.mm and numpy (its BLAS), for the model's MLP shape at a full prefill step (512 tokens) and a
    decode step (32 tokens), and square 1024 and 2048 matmuls; median of `repeats` timings per shape; the best is
    the peak."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper, numpy_helper

    torch.set_num_threads(threads)
    shapes = {"512x576·576x1536 (prefill step, MLP up)": (512, 576, 1536),
              "32x576·576x1536 (decode step, MLP up)": (32, 576, 1536),
              "1024³": (1024, 1024, 1024), "2048³": (2048, 2048, 2048)}
    rng = np.random.default_rng(0)

    def ort_matmul(k: int, b: np.ndarray):
        graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "mm",
                                  [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                                  [numpy_helper.from_array(b, "b")])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(helper.make_model(graph).SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        return lambda a, _b: session.run(None, {"a": a})

    out = {}
    for lib in ("onnxruntime", "torch", "numpy"):
        for name, (m, k, n) in shapes.items():
            a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
            if lib == "torch":
                a, b, mm = torch.from_numpy(a), torch.from_numpy(b), torch.mm
            else:
                mm = ort_matmul(k, b) if lib == "onnxruntime" else np.matmul
            inner = max(1, int(2e9 / (2 * m * k * n)))  # about 2 GFLOP a timing
            mm(a, b)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(inner):
                    mm(a, b)
                times.append((time.perf_counter() - t0) / inner)
            out[f"{lib} {name}"] = round(2 * m * k * n / statistics.median(times) / 1e9, 1)
    best = max(out, key=out.get)
    return {"gflop_s": out, "peak_gflop_s": out[best], "peak_shape": best, "threads": threads,
            "numpy_threads": "its BLAS default: every available core"}


def streamed_matmul(threads: int, weight_bytes: int, rows: int = 32, dim: int = 576, repeats: int = 7) -> dict:
    """GFLOP/s of `rows`-row fp32 products over `weight_bytes` of distinct [dim, dim] weights chained in one ONNX
    Runtime graph: each weight is read once a run, from memory, as a decode step reads the model's layers (the
    peak above reuses one weight, which stays in the caches). The ceiling of a decode step's linear layers."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    count = max(1, weight_bytes // (dim * dim * 4))
    weights = [numpy_helper.from_array((rng.standard_normal((dim, dim)) * dim ** -0.5).astype(np.float32), f"w{i}")
               for i in range(count)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"y{i - 1}", f"w{i}"], [f"y{i}"]) for i in range(count)]
    graph = helper.make_graph(nodes, "streamed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, dim])],
                              [helper.make_tensor_value_info(f"y{count - 1}", TensorProto.FLOAT, None)], weights)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(helper.make_model(graph).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"gflop_s": round(2 * rows * dim * dim * count / seconds / 1e9, 1), "rows": rows,
            "weight_mb": round(count * dim * dim * 4 / 1e6), "gb_s": round(count * dim * dim * 4 / seconds / 1e9, 1)}


# ----------------------------------------------------------------------------------------------------------- peer

class TransformersPeer:
    """Greedy, static batches in arrival order, left padding, each batch runs until its longest request is done.
    TTFT counts from the batch's start (the client hands a batch over when the previous one is done)."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        # transformers 5.25 renamed forward's `past_key_values` to `cache`; accept either (as bench_systems does).
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _cache(self, out):
        return getattr(out, "cache", None) if self.cache_arg == "cache" else out.past_key_values

    def run(self, requests, batch_size: int) -> dict:
        torch, model = self.torch, self.model
        ttft, e2e, itl, tokens = [], [], [], []
        started = time.perf_counter()
        with torch.inference_mode():
            for lo in range(0, len(requests), batch_size):
                batch = requests[lo: lo + batch_size]
                t0 = time.perf_counter()
                width = max(len(r.prompt_ids) for r in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for i, r in enumerate(batch):
                    ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                    mask[i, width - len(r.prompt_ids):] = 1
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                times = [[time.perf_counter()] for _ in batch]
                outs = [[int(t)] for t in token[:, 0]]
                past = self._cache(out)
                for step in range(1, max(r.max_tokens for r in batch)):
                    mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=torch.long)], dim=1)
                    positions = positions[:, -1:] + 1
                    out = model(input_ids=token, attention_mask=mask, position_ids=positions, use_cache=True,
                                **{self.cache_arg: past})
                    past = self._cache(out)
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    now = time.perf_counter()
                    for i, r in enumerate(batch):
                        if step < r.max_tokens:
                            times[i].append(now)
                            outs[i].append(int(token[i, 0]))
                for ts, o in zip(times, outs, strict=True):
                    ttft.append(ts[0] - t0)
                    e2e.append(ts[-1] - t0)
                    itl.extend(b - a for a, b in zip(ts, ts[1:], strict=False))
                    tokens.append(o)
        wall = time.perf_counter() - started
        from camshaft.runtime.throughput import percentiles

        output_tokens = sum(len(t) for t in tokens)
        return {"concurrency": batch_size, "wall_s": wall, "output_tokens": output_tokens,
                "output_tok_s": output_tokens / wall, "requests_s": len(requests) / wall,
                "ttft_ms": ms(percentiles(ttft)), "itl_ms": ms(percentiles(itl)), "e2e_ms": ms(percentiles(e2e)),
                "token_ids": tokens}


def ms(p: dict) -> dict:
    return {k: v * 1000 for k, v in p.items()}


# ---------------------------------------------------------------------------------------------- memory: admitted

def admitted_at_once(engine_dir: Path, requests, pool_tokens: int, threads: int, policy: str,
                     reservation: str = "paged") -> dict:
    """Submit all requests to an LLM whose KV pool holds `pool_tokens` tokens; once the scheduler has admitted all
    it can (a step with no prefill while requests still wait), record the most requests running at once; abort.
    reservation "contiguous": each request holds max_seq_len tokens of the pool, as without paging."""
    from camshaft.manifest import read_manifest
    from camshaft.runtime.kv_cache import bytes_per_block
    from camshaft.runtime.llm import LLM
    from camshaft.runtime.sampling_params import SamplingParams

    manifest = read_manifest(engine_dir)
    block = manifest.limits.kv_block_size
    budget = bytes_per_block(manifest) * (pool_tokens // block + 1)  # + the null block
    with LLM(engine_dir, threads=threads, kv_cache_memory=budget, policy=policy, kv_reservation=reservation) as llm:
        ids = []
        for r in requests:
            (request,) = llm._requests(list(r.prompt_ids),
                                       SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
            llm.executor.submit([request], [lambda out: None])
            ids.append(request.request_id)
        deadline = time.perf_counter() + 600
        while time.perf_counter() < deadline:
            stats = llm.stats
            if len(stats) > 8 and all(s.num_prefill_tokens == 0 for s in stats[-4:]):
                break
            time.sleep(0.2)
        stats = llm.stats
        for request_id in ids:
            llm.executor.abort(request_id)
        return {"policy": policy, "pool_tokens": (pool_tokens // block) * block, "requests": len(requests),
                "peak_admitted": llm.executor.peak_batch_size,
                "peak_kv_usage": max(s.kv_usage for s in stats), "steps_observed": len(stats),
                "still_waiting": stats[-1].queue_length}


# ------------------------------------------------------------------------------------------------- plot and text

def fmt_p(p: dict, digits: int = 0) -> str:
    from camshaft.runtime.throughput_report import fmt_percentiles

    return fmt_percentiles(p, f".{digits}f", sep=" / ")


def seconds(p_ms: dict) -> dict:
    return {k: None if x is None else x / 1000 for k, x in p_ms.items()}


def fmt_share(x: float | None) -> str:
    from camshaft.runtime.throughput_report import NO_DATA, fmt

    return NO_DATA if x is None else f"{fmt(100 * x, '.1f')} %"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def markdown(res: dict, plot_ref: str) -> str:
    cfg, m, cam, peer = res["config"], res["machine"], res["camshaft"], res["peer"]
    v = m["versions"]
    target = next(r for r in cam if r["concurrency"] == cfg["concurrency"])
    peer_t = next(p for p in peer if p["concurrency"] == cfg["concurrency"])
    idle = next((r for r in cam if r["concurrency"] == 1), None)
    peak = res["sgemm"]["peak_gflop_s"]
    cores = f"{m['logical_cores']} logical cores" + (f" ({m['physical_cores']} physical)" if m.get("physical_cores")
                                                      else "")
    out = [
        MD_BEGIN,
        "## Throughput: SmolLM2-135M-Instruct, in-flight batching, CPU",
        "",
        f"Machine: {m['cpu']}, {cores}, {m['memory_gb']} GB; Python {m['python']}, onnxruntime {v['onnxruntime']}, "
        f"torch {v['torch']}, transformers {v['transformers']}, camshaft {v['camshaft']}. {res['date']}.",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Workload: `{cfg['dataset']}` (seed {cfg['seed']}): {cfg['num_requests']} requests, prompts "
        f"{cfg['prompt_tokens_mean']:.0f} tokens on average ({cfg['prompt_tokens_min']}–{cfg['prompt_tokens_max']}), "
        f"outputs {cfg['output_tokens_mean']:.0f} ({cfg['output_tokens_min']}–{cfg['output_tokens_max']}), random "
        f"prompt ids, greedy, end id ignored, fp32, {cfg['threads']} threads for every system. camshaft: `LLM` on an "
        f"onnxruntime engine (max_seq_len {cfg['max_seq_len']}, batch {cfg['max_batch_size']}, "
        f"{cfg['max_num_tokens']} tokens a step, KV blocks of {cfg['kv_block_size']}), a closed-loop client that "
        "submits the first C requests at once and the next whenever one finishes. transformers: the same prompt ids, "
        "static batches of C requests in arrival order, left padding, each batch decoding until its longest request "
        "is done (a KV-cached `model(...)` + argmax loop). TTFT counts from a request's submission (transformers: "
        "from its batch's start) to its first token; ITL = gaps between a request's tokens; E2E = submission to "
        "last token. Output tok/s = all requests' output tokens / wall time of the run.",
        "",
        f"Sweep points other than C = {cfg['concurrency']} run the first {cfg['sweep_num_requests']} requests of the "
        "same dataset (to bound the run time); the target point runs all of them.",
        "",
        "| system | C | requests | output tok/s | req/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
        "| E2E p50 / p90 / p99 s | peak KV | GFLOP/s | loop overhead |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(cam, key=lambda r: r["concurrency"]):
        o = r["python_overhead"]["all_steps"]
        e2e = seconds(r["e2e_ms"])
        out.append(f"| **camshaft** | {r['concurrency']} | {r['num_requests']} | {r['output_tok_s']:.1f} | "
                   f"{r['requests_s']:.3f} | {fmt_p(r['ttft_ms'])} | {fmt_p(r['itl_ms'], 1)} | {fmt_p(e2e, 1)} | "
                   f"{100 * r['peak_kv_usage']:.0f} % | {r['gflop_s']:.1f} | {fmt_share(o['outside_engine_step'])} |")
    for p in peer:
        e2e = seconds(p["e2e_ms"])
        out.append(f"| {PEER} | {p['concurrency']} | {p['num_requests']} | {p['output_tok_s']:.1f} | "
                   f"{p['requests_s']:.3f} | {fmt_p(p['ttft_ms'])} | {fmt_p(p['itl_ms'], 1)} | {fmt_p(e2e, 1)} | — | "
                   f"— | — |")
    g = target["gflop"]
    ov = target["python_overhead"]
    ob = ov.get(f"batch_{cfg['concurrency']}", ov["all_steps"])
    ratio = target["output_tok_s"] / peer_t["output_tok_s"]
    out += [
        "",
        f"![throughput]({plot_ref})",
        "",
        f"### Against the targets (C = {cfg['concurrency']}, {cfg['num_requests']} requests)",
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| output tok/s ≥ 3× transformers | {target['output_tok_s']:.1f} / {peer_t['output_tok_s']:.1f} = "
        f"**{ratio:.2f}×** | {verdict(ratio >= 3)} |",
        f"| GFLOP/s ≥ 60 % of the fp32 matmul peak ({res['sgemm']['peak_shape']}) | {target['gflop_s']:.1f} / "
        f"{peak:.1f} = **{100 * target['gflop_s'] / peak:.0f} %** | {verdict(target['gflop_s'] >= 0.6 * peak)} |",
    ]
    blas = {k: v for k, v in res["sgemm"]["gflop_s"].items() if not k.startswith("onnxruntime")}
    if blas and peak > max(blas.values()):
        best = max(blas, key=blas.get)
        share = 100 * target["gflop_s"] / blas[best]
        out[-1] += (f"\n| (the same against the best torch/numpy matmul, {best}, the kind of peak the issue quotes) | "
                    f"{target['gflop_s']:.1f} / {blas[best]:.1f} = {share:.0f} % | — |")
    streamed = res.get("streamed")
    if streamed:
        out[-1] += (f"\n| (a decode step's ceiling: onnxruntime {streamed['rows']}-row matmuls over "
                    f"{streamed['weight_mb']} MB of distinct weights, each read from memory once, as the model's "
                    f"layers are) | {streamed['gflop_s']:.1f} GFLOP/s = {100 * streamed['gflop_s'] / peak:.0f} % of "
                    f"the peak ({streamed['gb_s']:.1f} GB/s of weights) | — |")
    join = target["ttft_joining_ms"]
    if idle and join.get("count"):
        jr = join["p50"] / idle["ttft_ms"]["p50"]
        out.append(f"| p50 TTFT joining a steady batch of {cfg['concurrency'] - 1} ≤ 2× idle TTFT | "
                   f"{join['p50']:.0f} ms ({join['count']} requests) / {idle['ttft_ms']['p50']:.0f} ms (C = 1) = "
                   f"**{jr:.2f}×** | {verdict(jr <= 2)} |")
    share = 100 * ob["outside_engine_step"]
    out.append(f"| Python overhead per step < 10 % at batch {cfg['concurrency']} | **{share:.1f} %**"
               f" outside `Engine.step` ({100 * ob['outside_model_call']:.1f} % outside the model call), "
               f"{ob['steps']} steps of {ob['iteration_ms']:.0f} ms | {verdict(ob['outside_engine_step'] < 0.1)} |")
    eq = res.get("greedy_equal")
    out += [
        "",
        f"What is counted. GFLOP/s = FLOPs of the run / its wall time, FLOPs = 2 × {res['linear_params'] / 1e6:.1f} M "
        f"layer matmul weights × {g['tokens_fed']} tokens fed (prompt + output − 1 per request: prefill and decode) "
        f"= {g['linear']:.0f} GFLOP, + 2 × {res['lm_head_params'] / 1e6:.1f} M LM-head weights × one logits row "
        f"per output token = {g['lm_head']:.0f} GFLOP, + attention 4 × heads × head_dim × context length per token "
        f"per layer (QKᵀ and PV) = {g['attention']:.0f} GFLOP; embeddings, norms, RoPE, softmax and activations are "
        f"not counted (without attention: {target['gflop_s_linear']:.1f} GFLOP/s). Matmul peak: fp32 ONNX Runtime "
        f"`MatMul` (the engine's kernel) and `torch.mm` on {res['sgemm']['threads']} threads and numpy `matmul` "
        f"(its BLAS on all {m['available_cores']} available cores), measured before and after camshaft's runs, "
        "median of 7 timings per shape, the better of the two per shape; the best shape counts: "
        + ", ".join(f"{k}: {x} GFLOP/s" for k, x in res["sgemm"]["gflop_s"].items()) + ".",
        "",
        "Loop overhead = the share of each batch-loop iteration (end of one `Engine.step` to the end of the next) "
        "spent outside `Engine.step` (scheduling, sampling, detokenizing, bookkeeping), median over iterations, "
        "timed by wrapping `Engine.step` and the backend call on the benchmark's engine; `Engine.step` itself also "
        "holds Python (`build_step`), so the share outside the model call is given too. Joining requests: those "
        f"submitted after the start while {cfg['concurrency'] - 1} others were in flight; idle TTFT: p50 at C = 1.",
        "",
    ]
    if eq:
        out += [f"Greedy outputs at C = {cfg['concurrency']}: {eq['equal']}/{eq['requests']} requests identical to "
                f"transformers', {100 * eq['prefix_share']:.1f} % of tokens before the first difference (fp32 "
                "batched kernels differ in summation order, so near-ties can flip).", ""]
    mem = res.get("memory")
    if mem:
        out += [
            "### Memory: requests admitted at once from one KV pool",
            "",
            f"One pool of {mem['pool_tokens']} tokens ({mem['pool_tokens'] // cfg['max_seq_len']} × max_seq_len "
            f"{cfg['max_seq_len']}); the first {mem['paged'][0]['requests']} requests of the workload submitted at "
            "once; peak requests running together (executor `peak_batch_size`) once admission settles.",
            "",
            "| KV layout | requests admitted at once | |",
            "|---|---|---|",
            f"| contiguous, max_seq_len reserved per request | {mem['contiguous']['peak_admitted']} | measured the "
            f"same way (the scheduler's `kv_reservation=\"contiguous\"`); pool_tokens // max_seq_len = "
            f"{mem['pool_tokens'] // cfg['max_seq_len']} |",
        ]
        for p in mem["paged"]:
            note = ("reserves prompt + max_tokens in blocks" if p["policy"] == "guaranteed_no_evict"
                    else "prompt blocks now, grows (preempts) later")
            times = p["peak_admitted"] / mem["contiguous"]["peak_admitted"]
            if p["peak_admitted"] >= p["requests"]:  # every request submitted ran: a floor, not paging's limit
                note += f"; all {p['requests']} submitted ran at once, so paging may admit more"
            out.append(f"| paged, `{p['policy']}` | **{p['peak_admitted']}** ({times:.1f}×) "
                       f"| {note}; peak KV use {100 * p['peak_kv_usage']:.0f} % |")
        out.append("")
    out.append(f"Load: the 1-minute load average was {res['load'][0]:.2f} before and {res['load'][1]:.2f} after "
               f"(this benchmark alone accounts for about {cfg['threads']}; more means other work shared the cores).")
    out += ["", MD_END]
    return "\n".join(out)


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
    p.add_argument("--sweep-num-requests", type=int, default=16,
                   help="requests at sweep points other than --concurrency (the first ones of the dataset)")
    p.add_argument("--peer-sweep", default="32", help="transformers batch sizes (each runs --num-requests)")
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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from camshaft.runtime.bench_data import load_dataset, warmup_requests
    from camshaft.runtime.flops import linear_params
    from camshaft.runtime.llm import LLM
    from camshaft.runtime.throughput import run_throughput
    from camshaft.runtime.throughput_plot import plot_sweep
    from camshaft.runtime.throughput_report import clipped_line

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
            subset = requests if c == args.concurrency else requests[:args.sweep_num_requests]
            log(f"camshaft: {len(subset)} requests, concurrency {c}")
            r = run_throughput(llm, subset, c, keep_token_ids=c == args.concurrency)
        if c == args.concurrency:
            tokens = [rec.token_ids for rec in r.records]
        cam.append(r.to_dict())
        if clipped_line(r.clipped):
            log(clipped_line(r.clipped))
        log(f"  {r.output_tok_s:.1f} out tok/s, TTFT p50 {r.ttft_ms['p50']:.0f} ms, {r.gflop_s:.1f} GFLOP/s, "
            f"overhead {100 * r.python_overhead['all_steps']['outside_engine_step']:.1f} %, "
            f"prefix hits {r.prefix_reuse_hits}, {r.wall_s:.0f} s")

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

    log("transformers peer")
    peer_system = TransformersPeer(model_dir, args.threads)
    peer_system.run(warmup_requests(requests, manifest.model.vocab_size), 4)
    peer, equal = [], None
    for c in args.peer_levels:
        log(f"transformers: {len(requests)} requests, static batches of {c}")
        p = peer_system.run(requests, c)
        peer_tokens = p.pop("token_ids")
        p["num_requests"] = len(requests)
        peer.append(p)
        log(f"  {p['output_tok_s']:.1f} out tok/s, TTFT p50 {p['ttft_ms']['p50']:.0f} ms, {p['wall_s']:.0f} s")
        if c == args.concurrency and tokens is not None:
            same = [a == b for a, b in zip(tokens, peer_tokens, strict=True)]
            prefix = 0
            for a, b in zip(tokens, peer_tokens, strict=True):
                n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                prefix += n
            equal = {"requests": len(same), "equal": sum(same), "prefix_share": prefix / sum(map(len, tokens))}

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
                   "sweep_num_requests": args.sweep_num_requests, "threads": args.threads,
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
    json_path.write_text(json.dumps(results, indent=2) + "\n")

    from types import SimpleNamespace

    points = [SimpleNamespace(concurrency=r["concurrency"], output_tok_s=r["output_tok_s"], ttft_ms=r["ttft_ms"])
              for r in cam]
    peers = {PEER: [{"concurrency": p["concurrency"], "output_tok_s": p["output_tok_s"],
                     "ttft_p50_ms": p["ttft_ms"]["p50"]} for p in peer]}
    m = results["machine"]
    plot_sweep(points, args.plot, peers,
               title=f"SmolLM2-135M-Instruct fp32, {args.threads} threads, {m['cpu']} — {args.dataset}, "
                     f"{args.num_requests} requests at C = {args.concurrency}, {args.sweep_num_requests} elsewhere")
    plot_ref = os.path.relpath(args.plot.resolve(), args.md.resolve().parent)
    section = markdown(results, plot_ref)
    print(section)
    if args.write_md:
        write_markdown(args.md, section, MD_BEGIN, MD_END)
        log(f"updated {rel(args.md)}")
    log(f"wrote {rel(json_path)} and {rel(args.plot)}")


if __name__ == "__main__":
    main()
