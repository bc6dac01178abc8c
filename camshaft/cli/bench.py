"""Benchmarks: bench latency, bench throughput, bench serve."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from camshaft.cli import bench_app, err, flag_names, progress
from camshaft.cli.serve import (
    LLM_FLAGS,
    BatchOption,
    LookupOption,
    MemoryOption,
    PolicyOption,
    ThreadsOption,
    TokensOption,
)
from camshaft.errors import CamshaftError
from camshaft.outdir import writable_dir
from camshaft.runtime.bench_data import PRESETS, parse_dataset_spec, repeat_note

if TYPE_CHECKING:
    from camshaft.manifest import Manifest

_PRESETS = "; ".join(f"{name}: prompts {spec.prompt_len} tokens, outputs {spec.output_len}"
                     for name, spec in ((n, parse_dataset_spec(n)) for n in PRESETS))
DatasetOption = Annotated[str, typer.Option(
    metavar="SPEC", help=f"Requests: a preset ({_PRESETS}), synthetic:in=DIST,out=DIST with DIST NORMAL(mean,sd), "
    "UNIFORM(lo,hi), CONST(n) or n, or jsonl:PATH")]


@bench_app.command("latency")
def bench_latency(
    engine: Annotated[Path, typer.Option(help="Engine directory")],
    prompt_len: Annotated[int, typer.Option(min=1, help="Prompt tokens")] = 64,
    max_tokens: Annotated[int, typer.Option(min=2, help="Tokens to generate (greedy, end id ignored; decode speed "
                                                        "needs 2 or more)")] = 128,
    repeats: Annotated[int, typer.Option(min=1, help="Measured runs (medians are reported)")] = 5,
    warmup: Annotated[int, typer.Option(min=0, help="Unmeasured runs first")] = 1,
    threads: ThreadsOption = None,
    output_json: Annotated[Path | None, typer.Option(help="Write the results as JSON")] = None,
) -> None:
    """Batch-1 latency: TTFT, prefill and decode tokens/s (medians over repeats)."""
    from camshaft.runtime.bench import latency_benchmark
    from camshaft.runtime.engine_info import cpu_threads
    from camshaft.runtime.session import Session

    require_outputs(None, output_json)
    with flag_names("prompt_len", "max_tokens", "repeats", "warmup", "threads"):
        session = Session(engine, threads=threads)
        measured = measured_with(engine, session.engine.manifest)
        report = latency_benchmark(engine, prompt_len=prompt_len, max_tokens=max_tokens, repeats=repeats,
                                   warmup=warmup, session=session, progress=progress)
    for key, value in report.items():
        typer.echo(f"{key:>22}: {value}")
    if output_json:
        write_json(output_json, {**measured, "repeats": repeats, "warmup": warmup,
                                 "threads": cpu_threads(session.engine.manifest, threads), **report})


def measured_with(engine: Path, manifest: Manifest) -> dict:
    """What a report was measured with: the engine as given and the build it held as the run began (build_id: the
    same for the same build), this machine and its software."""
    from camshaft.machine_info import machine_info

    return {"engine": str(engine), "build_id": manifest.build_id, "machine": machine_info()}


def write_json(path: Path, data: dict) -> None:
    """The results file; one that cannot be written is one line (the results are on stdout already)."""
    import json

    from camshaft.outdir import write_user_file

    def write(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_user_file(path, json.dumps(data, indent=2) + "\n")  # an earlier file stays whole if this one fails

    _written("--output-json", path, write)


def write_plot(path: Path, draw: Callable[[Path], None]) -> None:
    """The PNG `draw` writes; one that cannot be written is one line naming --plot."""
    _written("--plot", path, draw)


def _written(flag: str, path: Path, write: Callable[[Path], None]) -> None:
    try:
        write(path)
    except OSError as exc:
        raise CamshaftError(f"{flag} {path} could not be written ({exc.strerror or exc}); the results are "
                            "above") from None


def require_outputs(plot: Path | None, output_json: Path | None) -> None:
    """Refuse --plot and --output-json before any work (matplotlib missing, a path that cannot be written), and a
    closed stdout without --output-json (the results would be lost), rather than after the whole benchmark."""
    if output_json is None and sys.stdout is None:
        raise CamshaftError("stdout is closed (>&-), so the results would be lost; redirect it (> FILE) or give "
                            "--output-json FILE")
    for flag, path in (("--plot", plot), ("--output-json", output_json)):
        if path is None:
            continue
        if path.is_dir():
            raise CamshaftError(f"{flag} {path} is a directory; give a file path")
        if flag == "--plot" and path.suffix.lower() != ".png":
            raise CamshaftError(f"--plot {path}: the plot is a PNG; give a path ending in .png")
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is None or not writable_dir(parent):
            raise CamshaftError(f"{flag} {path} cannot be written ({parent} is not a writable directory)")
    if plot is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise CamshaftError("--plot needs matplotlib: pip install matplotlib (or drop --plot)") from exc


@bench_app.command("throughput")
def bench_throughput(
    engine: Annotated[Path, typer.Option(help="Engine directory")],
    dataset: DatasetOption = "balanced",
    num_requests: Annotated[int, typer.Option(min=1, help="Requests to run")] = 64,
    concurrency: Annotated[str | None, typer.Option(
        help="Most requests in flight; a comma-separated list sweeps, e.g. 1,8,32 (default: the batch size, at most "
             "32)")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the synthetic lengths and prompt ids")] = 0,
    threads: ThreadsOption = None,
    policy: PolicyOption = "guaranteed_no_evict",
    kv_cache_memory: MemoryOption = None,
    max_batch_size: BatchOption = None,
    max_num_tokens: TokensOption = None,
    prompt_lookup: LookupOption = 0,
    output_json: Annotated[Path | None, typer.Option(help="Write the results as JSON")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG: output tok/s and p50 TTFT vs concurrency")] = None,
) -> None:
    """Closed-loop throughput: N greedy requests, at most C in flight; tok/s, TTFT/ITL/E2E percentiles, GFLOP/s.

    Requests longer than the engine's max_seq_len are clipped to fit, and the report says how many."""

    from camshaft.errors import RequestError
    from camshaft.manifest import read_manifest
    from camshaft.runtime.engine_info import cpu_threads
    from camshaft.runtime.throughput import WARMUP as THROUGHPUT_WARMUP
    from camshaft.runtime.throughput import throughput_benchmark
    from camshaft.runtime.throughput_plot import plot_sweep
    from camshaft.runtime.throughput_report import report_lines

    require_outputs(plot, output_json)
    try:
        levels = None if concurrency is None else [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        levels = []
    if levels is not None and (not levels or min(levels) < 1):
        raise RequestError(f"--concurrency takes positive integers, comma-separated to sweep; got {concurrency!r}")
    options = {"policy": policy, "kv_cache_memory": kv_cache_memory, "max_batch_size": max_batch_size,
               "max_num_tokens": max_num_tokens, "prompt_lookup": prompt_lookup}
    manifest = read_manifest(engine)  # before the run: a rebuild meanwhile is not what was measured
    measured = measured_with(engine, manifest)
    with flag_names(*LLM_FLAGS):
        results = throughput_benchmark(engine, dataset, num_requests, levels, seed=seed, threads=threads,
                                       progress=progress, **options)
    for line in report_lines(results):  # warnings and notes to stderr: stdout holds the results alone
        if line.startswith(("warning:", "note:")):
            err.print(escape(line), soft_wrap=True)
        else:
            typer.echo(line)
    if output_json:
        write_json(output_json, {**measured, "dataset": dataset,
                                 "dataset_spec": str(parse_dataset_spec(dataset)), "num_requests": num_requests,
                                 "seed": seed, "options": options, "warmup": THROUGHPUT_WARMUP,
                                 "threads": cpu_threads(manifest, threads),
                                 "results": [r.to_dict(True) for r in results]})
    if plot:
        write_plot(plot, lambda path: plot_sweep(
            results, path, title=f"{Path(engine).resolve().name}: {dataset}, {num_requests} requests"))


@bench_app.command("serve")
def bench_serve(
    target: Annotated[list[str], typer.Option(
        metavar="NAME=URL,backend=B", help="An endpoint to measure (repeatable): NAME=URL,backend=B[,model=M] with "
        "B one of openai, triton-generate, triton-grpc, llm (URL: an engine directory, run in-process); M: the "
        "served model name, when it is not the server's only one")],
    dataset: DatasetOption = "prefill-heavy",
    tokenizer: Annotated[Path | None, typer.Option(help="Engine, deployed Triton repository or checkpoint directory "
                                                        "whose tokenizer sizes the synthetic prompts (default: an llm "
                                                        "target's engine)")] = None,
    num_requests: Annotated[int, typer.Option(min=1, help="Requests per run")] = 64,
    request_rate: Annotated[str, typer.Option(help="Requests/s of the Poisson arrivals, or inf; a comma-separated "
                                                   "list sweeps, e.g. 1,2,4,inf")] = "inf",
    concurrency: Annotated[str | None, typer.Option(
        help="Most requests in flight per target (default: no limit); a comma-separated list sweeps, e.g. "
             "1,8,32")] = None,
    goodput: Annotated[str | None, typer.Option(help="SLOs for goodput, e.g. ttft_ms=1000,tpot_ms=100")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the prompts and arrivals")] = 0,
    warmup: Annotated[int, typer.Option(min=0, help="Short warm-up requests per target")] = 2,
    threads: Annotated[int | None, typer.Option(
        min=1, help="Threads of the llm targets' engines (default: as --threads elsewhere); servers keep their "
                    "own")] = None,
    output_json: Annotated[Path | None, typer.Option(help="Write the results as JSON")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG: latency vs throughput, one line per target")] = None,
) -> None:
    """Serving benchmark: the same requests through several endpoints; TTFT/TPOT/ITL/E2E percentiles, goodput."""

    from camshaft.bench_serve.clients import Target
    from camshaft.bench_serve.report import Goodput
    from camshaft.bench_serve.report import plot as plot_results
    from camshaft.bench_serve.run import bench_serve as run_bench
    from camshaft.bench_serve.run import check_fits
    from camshaft.bench_serve.workload import load_requests, load_tokenizer, parse_rates
    from camshaft.machine_info import machine_info
    from camshaft.manifest import read_manifest
    from camshaft.runtime.llm_options import check_runtime_options

    require_outputs(plot, output_json)
    try:
        concurrencies = [int(c) for c in concurrency.split(",")] if concurrency else [None]
    except ValueError:
        concurrencies = [0]
    if any(c is not None and c < 1 for c in concurrencies):
        raise CamshaftError(f"--concurrency takes positive integers, comma-separated; got {concurrency!r}")
    rates, slos = parse_rates(request_rate), Goodput.parse(goodput)
    targets = [Target.parse(t) for t in target]
    if len({t.name for t in targets}) != len(targets):
        raise CamshaftError("--target names must differ")
    if threads is not None:
        if not any(t.backend == "llm" for t in targets):
            raise CamshaftError("--threads sets the engine threads of llm targets (run in this process); a server "
                                "takes its own (camshaft serve --threads): drop --threads")
        with flag_names("threads"):
            check_runtime_options(threads=threads)
        targets = [replace(t, threads=threads) if t.backend == "llm" else t for t in targets]
    spec = parse_dataset_spec(dataset)
    note = repeat_note(spec, num_requests)
    manifests = {t.name: read_manifest(Path(t.url))  # a broken engine says so before anything loads
                 for t in targets if t.backend == "llm"}
    limits = {name: manifest.limits.max_seq_len for name, manifest in manifests.items()}
    source = tokenizer or next((Path(t.url) for t in targets if t.backend == "llm"), None)
    tok = load_tokenizer(source) if source else None
    requests = load_requests(dataset, num_requests, tok, seed=seed)
    if note:
        progress(note)
    for t in targets:
        if t.name in limits:
            check_fits(t.name, limits[t.name], requests, tok, len(rates) * len(concurrencies), len(targets))
    results = run_bench(targets, requests, rates, concurrencies=concurrencies, goodput=slos, seed=seed, warmup=warmup,
                        log=typer.echo, progress=progress, tokenizer=tok)
    if output_json:
        write_json(output_json, {
            "machine": machine_info(), "dataset": dataset, "dataset_spec": str(spec), "num_requests": num_requests,
            "seed": seed, "concurrency": concurrencies, "request_rate": ["inf" if math.isinf(r) else r for r in rates],
            "warmup": warmup, "goodput": {k: v for k, v in asdict(slos).items() if v is not None} or None,
            "targets": [{**asdict(t), **({"build_id": manifests[t.name].build_id} if t.name in manifests else {})}
                        for t in targets], "results": [r.to_dict() for r in results]})
    if plot:
        write_plot(plot, lambda path: plot_results(
            results, path, title=f"{dataset}, {num_requests} requests, request rate {request_rate}, concurrency "
                                 f"{concurrency or 'unlimited'}"))
    failed = [r for r in results if r.completed == 0]
    if failed:
        raise CamshaftError(f"every request of {len(failed)} run(s) failed ({failed[0].target}: "
                            f"{failed[0].error_summary(1)}); the results above are of errors, not of a server")
    partly = [r for r in results if r.failed]
    if partly:
        progress(f"warning: {sum(r.failed for r in partly)} request(s) failed in {len(partly)} run(s) (their "
                 "lines above say why); the numbers count completed requests only")
