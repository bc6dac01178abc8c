#!/usr/bin/env python
"""Serving benchmark on SmolLM2-135M-Instruct (CPU, fp32): the same requests through camshaft's OpenAI server,
its Triton deployment (HTTP generate_stream and gRPC streaming) and an in-process `LLM` on the same engine.

Both servers are started with the real CLI (`camshaft serve --api openai`, `camshaft serve --engine`) as child
processes on loopback ports, one engine each; the in-process baseline shows what the servers cost. Two workloads,
like the public cross-engine benchmarks: prefill-heavy (~460 prompt tokens, 16 out) at max concurrency 1, 8 and 32
(all requests sent at once), and decode-heavy (~460 in, 256 out) at Poisson rates up to all-at-once under a
concurrency cap of 32. Targets take turns at each point so machine noise hits them alike.

Writes out/bench/serve-*.json and plots beside them; with --write-md the plots go to docs/bench/serve-*.png and
the serve section of BENCHMARKS.md is replaced (the committed plots change only with the section that shows them).
Needs the `bench` and `serve` extras.

    .venv/bin/python scripts/bench_serve.py --write-md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from bench_common import machine_info, rel, write_markdown

from camshaft.bench_serve.clients import Target
from camshaft.bench_serve.report import ServeResult, plot
from camshaft.bench_serve.run import bench_serve
from camshaft.bench_serve.workload import load_requests, load_tokenizer
from camshaft.models import default_model_dir, fetch_model
from camshaft.runtime.throughput_report import fmt, fmt_percentiles
from camshaft.triton_repo.launch import free_ports

REPO = Path(__file__).resolve().parent.parent
CAMSHAFT = str(Path(sys.executable).parent / "camshaft")
BEGIN, END = "<!-- serve:begin -->", "<!-- serve:end -->"


def build(engine: Path, model: Path) -> None:
    """Always rebuilt (a few seconds): an engine from an older camshaft would measure the older graph."""
    subprocess.run([CAMSHAFT, "build", "--model", str(model), "--output", str(engine), "--max-batch-size", "32",
                    "--max-seq-len", "1024"], check=True)


def start(cmd: list[str], ready_url: str, log: Path, timeout: float = 180.0) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{ready_url} not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _row(r: dict, base: dict | None) -> str:
    ratio = _ratio(r["output_tok_s"], base["output_tok_s"]) if base else "—"
    limit = r["concurrency"] or "∞"
    e2e_s = {k: None if v is None else v / 1000 for k, v in r["e2e_ms"].items()}
    return (f"| {r['target']} | {limit} | {r['request_rate']} | {r['completed']}/{r['completed'] + r['failed']} | "
            f"{fmt(r['output_tok_s'], '.1f')} | {ratio} | {fmt(r['requests_s'], '.2f')} | "
            f"{fmt_percentiles(r['ttft_ms'], '.0f', ' / ')} | {fmt_percentiles(r['tpot_ms'], '.1f', ' / ')} | "
            f"{fmt_percentiles(r['itl_ms'], '.1f', ' / ')} | {fmt_percentiles(e2e_s, '.2f', ' / ')} |")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "—"


def _point(r: dict) -> tuple:
    return r["concurrency"], r["request_rate"]


def _baselines(results: list[dict]) -> dict[tuple, dict]:
    """The in-process `llm` result at each point of the sweep: what the servers are compared with."""
    return {_point(r): r for r in results if r["target"] == "llm"}


def summary(results: list[dict]) -> str:
    """One line per server: its output tok/s and p50 TTFT against `llm` at each point of the sweep."""
    base = _baselines(results)
    if not base:
        return "No `llm` run to compare with."
    names = ", ".join(f"max concurrency {c or '∞'}" + ("" if rate == "inf" else f" at {rate} req/s")
                      for c, rate in base)
    lines = []
    for target in dict.fromkeys(r["target"] for r in results if r["target"] != "llm"):
        rows = {_point(r): r for r in results if r["target"] == target}
        tok = " / ".join(_ratio(rows[p]["output_tok_s"], b["output_tok_s"]) if p in rows else "—"
                         for p, b in base.items())
        ttft = " / ".join(_ratio(rows[p]["ttft_ms"]["p50"], b["ttft_ms"]["p50"]) if p in rows else "—"
                          for p, b in base.items())
        lines.append(f"{target}: output tok/s {tok}, p50 TTFT {ttft}")
    return (f"Against `llm` ({names}; tok/s above 1× is faster, TTFT above 1× is slower): " + "; ".join(lines) + ".")


def markdown(runs: dict[str, dict], command: str, load: tuple[float, float], plots: Path) -> str:
    m = machine_info()
    v = m["versions"]
    out = [BEGIN, "## Serving: SmolLM2-135M-Instruct behind Triton and the OpenAI API, CPU", "",
           f"Machine: {m['cpu']}, {m['available_cores']} cores, {m['memory_gb']} GB; Python {m['python']}, "
           f"onnxruntime {v['onnxruntime']}, camshaft {v['camshaft']}. "
           f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M')} UTC.", "", f"Command: `{command}`", "",
           "One fp32 engine (max_seq_len 1024, batch 32) served three ways, each process with its own copy: "
           "`camshaft serve --api openai` (FastAPI/uvicorn, `/v1/completions` streaming), `camshaft serve` (the "
           "bundled tritonserver 2.51, python backend; `ensemble` over HTTP `generate_stream` and over gRPC "
           "streaming), and `llm`: `LLM.stream_outputs` in the benchmark's own process (no server; it shares that "
           "process's interpreter lock and the cores with the client driving every target, so a server's ratio "
           "over it can exceed 1). Greedy, output "
           "length forced with `min_tokens` = `max_tokens`; TTFT = request sent → first text chunk; TPOT = (E2E − "
           "TTFT) / (tokens − 1); ITL = gaps between text chunks; ratio = output tok/s against `llm` at the same "
           "point. Every point of a sweep prefixes the prompts with its own tag, so no server's prefix cache serves "
           "prompts it saw at an earlier point.", "",
           f"Load: the 1-minute load average was {load[0]:.2f} before and {load[1]:.2f} after (the benchmark alone "
           "accounts for about 2; more means other work shared the cores and the ratios are noisier).", ""]
    for name, run in runs.items():
        out += [f"### {name}: `{run['dataset']}`, {run['num_prompts']} prompts", "",
                "| target | max conc. | rate req/s | done | out tok/s | vs llm | req/s | TTFT p50/p90/p99 ms | "
                "TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p90/p99 s |", "|" + "---|" * 11]
        results = run["results"]
        base = _baselines(results)
        for r in results:
            out.append(_row(r, None if r["target"] == "llm" else base.get(_point(r))))
        out += ["", summary(results), "", f"![{name}]({rel(plots / f'serve-{name}.png')})", ""]
    out.append(END)
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, default=REPO / "out" / "bench")
    p.add_argument("--prefill-prompts", type=int, default=32)
    p.add_argument("--decode-prompts", type=int, default=16)
    p.add_argument("--decode-rates", default="0.5,inf")
    p.add_argument("--md", type=Path, default=REPO / "BENCHMARKS.md")
    p.add_argument("--write-md", action="store_true")
    args = p.parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    plots = REPO / "docs" / "bench" if args.write_md else work
    model = fetch_model("smollm2-135m-instruct", default_model_dir("smollm2-135m-instruct"))
    engine = work / "serve-engine"
    build(engine, model)
    oa, http, grpc, metrics = free_ports("127.0.0.1", 4)
    servers = [start([CAMSHAFT, "serve", "--api", "openai", "--engine", str(engine), "--port", str(oa)],
                     f"http://127.0.0.1:{oa}/health", work / "serve-openai.log")]
    try:
        servers.append(start([CAMSHAFT, "serve", "--engine", str(engine), "--port", str(http), "--grpc-port",
                              str(grpc), "--metrics-port", str(metrics)],
                             f"http://127.0.0.1:{http}/v2/health/ready", work / "serve-triton.log"))
        targets = [Target("llm", str(engine), "llm"), Target("openai", f"http://127.0.0.1:{oa}", "openai"),
                   Target("triton-http", f"http://127.0.0.1:{http}", "triton-generate"),
                   Target("triton-grpc", f"127.0.0.1:{grpc}", "triton-grpc")]
        tokenizer = load_tokenizer(engine)
        plan = {"prefill-heavy": ("prefill-heavy", args.prefill_prompts, [float("inf")], [1, 8, 32]),
                "decode-heavy": ("decode-heavy", args.decode_prompts,
                                 [float(x) for x in args.decode_rates.split(",")], [32])}
        runs = {}
        load_before = os.getloadavg()[0]
        for seed, (name, (dataset, count, rates, limits)) in enumerate(plan.items()):
            requests = load_requests(dataset, count, tokenizer, seed=seed, max_seq_len=1024)
            results: list[ServeResult] = bench_serve(targets, requests, rates, concurrencies=limits,
                                                     tokenizer=tokenizer)
            runs[name] = {"dataset": dataset, "num_prompts": count, "results": [r.to_dict() for r in results]}
            (work / f"serve-{name}.json").write_text(json.dumps(runs[name], indent=2) + "\n")
            plot(results, plots / f"serve-{name}.png",
                 title=f"SmolLM2-135M fp32, CPU: {dataset}, {count} prompts")
    finally:
        for proc in servers:
            stop(proc)
    load = (load_before, os.getloadavg()[0])
    command = shlex.join([".venv/bin/python", "scripts/bench_serve.py", *sys.argv[1:]])  # what was measured
    section = markdown(runs, command, load, plots)
    print(section)
    if args.write_md:
        write_markdown(args.md, section, BEGIN, END)
        print(f"wrote {rel(args.md)}")


if __name__ == "__main__":
    main()
