"""The `camshaft` command line: a thin layer over the builder and runtime APIs."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from camshaft.errors import CamshaftError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
                  help="Build, quantize, serve and benchmark LLM inference engines.")
models_app = typer.Typer(no_args_is_help=True, help="Fetch known models as Hugging Face checkpoints.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks.")
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(no_args_is_help=True, help="Accuracy evaluation.")
app.add_typer(eval_app, name="eval")
err = Console(stderr=True)


def _progress(message: str) -> None:
    err.print(f"[dim]·[/dim] {message}")


@models_app.command("fetch")
def models_fetch(
    name: Annotated[str, typer.Argument(help="Model name, e.g. smollm2-135m-instruct")],
    output: Annotated[Path | None, typer.Option(help="Checkpoint directory (default: the camshaft cache)")] = None,
) -> None:
    """Fetch a known model and convert it to a Hugging Face checkpoint directory."""
    from camshaft.models import default_model_dir, fetch_model

    path = fetch_model(name, output or default_model_dir(name), progress=_progress)
    typer.echo(str(path))


QuantOption = Annotated[str, typer.Option(help="fp8 | int8_sq | int8_wo | int4_wo | int4_awq | w4a8_awq")]
KVDtypeOption = Annotated[str | None, typer.Option(help="Also quantize the KV cache: fp8 | int8")]
GroupOption = Annotated[str, typer.Option(help="INT4 block size: auto | 128 | 64 | 32")]
CalibDataOption = Annotated[Path | None, typer.Option(help="Text/JSONL file or directory (default: built-in corpus)")]
CalibSizeOption = Annotated[int, typer.Option(help="Calibration samples")]
CalibLenOption = Annotated[int, typer.Option(help="Tokens per calibration sample")]
ExcludeOption = Annotated[list[str] | None, typer.Option(
    help="Module name pattern to keep unquantized (repeatable)")]
LmHeadOption = Annotated[str, typer.Option(
    help="lm_head weights: float | int8 | int4 (rounded to nearest at build; the embedding stays float)")]


@app.command()
def build(
    model: Annotated[Path, typer.Option(help="Hugging Face checkpoint directory")],
    output: Annotated[Path, typer.Option(help="Engine directory to write")],
    target: Annotated[str, typer.Option(help="onnxruntime (CPU) | tensorrt | tensorrt-rtx")] = "onnxruntime",
    dtype: Annotated[str, typer.Option(help="auto (the target's native float type) | float32 | float16")] = "auto",
    max_batch_size: Annotated[int, typer.Option(help="Most sequences in one step")] = 32,
    max_seq_len: Annotated[int | None, typer.Option(help="Most tokens per sequence, prompt + output")] = None,
    max_num_tokens: Annotated[int, typer.Option(help="Most tokens in one step (prefill chunk size)")] = 512,
    kv_block_size: Annotated[int, typer.Option(help="Tokens per KV cache block")] = 32,
    gpu_arch: Annotated[str | None, typer.Option(help="tensorrt targets: GPU architecture, e.g. sm89")] = None,
    quant: Annotated[str | None, typer.Option(
        help="Quantize first, as `camshaft quantize --quant` does (the quantized checkpoint is kept in OUTPUT.ckpt)")]
    = None,
    kv_cache_dtype: KVDtypeOption = None,
    group_size: GroupOption = "auto",
    calib_data: CalibDataOption = None,
    calib_size: CalibSizeOption = 64,
    calib_seq_len: CalibLenOption = 256,
    exclude: ExcludeOption = None,
    lm_head: LmHeadOption = "float",
) -> None:
    """Build an engine directory from a Hugging Face checkpoint (with --quant: quantize it first)."""
    from dataclasses import replace

    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    config = BuildConfig(model, output, target=target, dtype=dtype, max_batch_size=max_batch_size,
                         max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, kv_block_size=kv_block_size,
                         gpu_arch=gpu_arch)
    if quant is None and (kv_cache_dtype is not None or calib_data is not None or exclude or lm_head != "float"):
        raise CamshaftError(
            "--kv-cache-dtype, --calib-data, --exclude and --lm-head are quantization options: add --quant")
    if quant is not None:
        from camshaft.builder.build import check_quantized_target
        from camshaft.quantize.spec import QuantSpec

        spec = QuantSpec(quant, kv_cache_dtype=kv_cache_dtype, group_size=group_size, lm_head=lm_head)
        check_quantized_target(target, spec.info.checkpoint_algo, kv_cache_dtype and kv_cache_dtype.upper())
        checkpoint = output.with_name(output.name + ".ckpt")
        _quantize(model, quant, checkpoint, kv_cache_dtype, group_size, calib_data, calib_size, calib_seq_len,
                  exclude, lm_head)
        config = replace(config, model_dir=checkpoint)
    manifest = build_engine(config, progress=_progress)
    err.print(f"built {manifest.model.architecture} engine for {manifest.target} ({manifest.dtype}) in "
              f"{manifest.target_options.get('build_seconds', '?')} s")
    typer.echo(str(output))


def _quantize(model: Path, quant: str, output: Path, kv_cache_dtype: str | None, group_size: str,
              calib_data: Path | None, calib_size: int, calib_seq_len: int, exclude: list[str] | None,
              lm_head: str = "float") -> None:
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    spec = QuantSpec(quant, kv_cache_dtype=kv_cache_dtype, group_size=group_size, exclude=tuple(exclude or ()),
                     lm_head=lm_head)
    with contextlib.redirect_stdout(sys.stderr):  # ModelOpt prints; stdout carries only the output path
        result = quantize_checkpoint(model, output, spec, calib_data=calib_data, calib_size=calib_size,
                                     calib_seq_len=calib_seq_len, progress=_progress, progress_bar=True)
    err.print(f"quantized to {spec.format}" + (f" (group {result.group_size})" if result.group_size else "")
              + f" in {result.seconds['total']} s")


@app.command()
def quantize(
    model: Annotated[Path, typer.Option(help="Hugging Face checkpoint directory (float)")],
    quant: QuantOption,
    output: Annotated[Path, typer.Option(help="Quantized checkpoint directory to write")],
    kv_cache_dtype: KVDtypeOption = None,
    group_size: GroupOption = "auto",
    calib_data: CalibDataOption = None,
    calib_size: CalibSizeOption = 64,
    calib_seq_len: CalibLenOption = 256,
    exclude: ExcludeOption = None,
    lm_head: LmHeadOption = "float",
) -> None:
    """Calibrate and quantize a checkpoint with NVIDIA ModelOpt into a quantized (unified HF) checkpoint."""
    _quantize(model, quant, output, kv_cache_dtype, group_size, calib_data, calib_size, calib_seq_len, exclude,
              lm_head)
    typer.echo(str(output))


@app.command()
def run(
    engine: Annotated[Path, typer.Option(help="Engine directory")],
    prompt: Annotated[str, typer.Option(help="Prompt text")],
    chat: Annotated[bool, typer.Option(help="Wrap the prompt as a user message in the chat template")] = False,
    system: Annotated[str | None, typer.Option(help="System message (with --chat)")] = None,
    max_tokens: Annotated[int, typer.Option()] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = off")] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    stream: Annotated[bool, typer.Option(help="Print text as it is generated")] = False,
) -> None:
    """Generate text from a prompt."""
    from camshaft.runtime.sampling_params import SamplingParams
    from camshaft.runtime.session import Session

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    session = Session(engine)
    messages = None
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    kwargs = {"messages": messages} if chat else {"prompt": prompt}
    if stream:
        for delta in session.stream(params=params, **kwargs):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    result = session.generate(params=params, **kwargs)
    typer.echo(result.text)
    t = result.timings
    err.print(f"[dim]{t.output_tokens} tokens · finish {result.finish_reason} · TTFT {t.ttft_s * 1000:.0f} ms · "
              f"{t.decode_tok_s:.1f} tok/s[/dim]")


@bench_app.command("latency")
def bench_latency(
    engine: Annotated[Path, typer.Option(help="Engine directory")],
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens")] = 64,
    new_tokens: Annotated[int, typer.Option(help="Generated tokens (greedy, end id ignored)")] = 128,
    repeats: Annotated[int, typer.Option(help="Measured runs (medians are reported)")] = 5,
    warmup: Annotated[int, typer.Option()] = 1,
) -> None:
    """Batch-1 latency: TTFT, prefill and decode tokens/s (medians over repeats)."""
    from camshaft.runtime.bench import latency_benchmark

    report = latency_benchmark(engine, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, warmup=warmup)
    for key, value in report.items():
        typer.echo(f"{key:>22}: {value}")


@bench_app.command("throughput")
def bench_throughput(
    engine: Annotated[Path, typer.Option(help="Engine directory")],
    dataset: Annotated[str, typer.Option(help="synthetic:in=NORMAL(200,50),out=NORMAL(128,32) | jsonl:PATH")]
    = "synthetic:in=NORMAL(200,50),out=NORMAL(128,32)",
    num_requests: Annotated[int, typer.Option(help="Requests to run")] = 64,
    concurrency: Annotated[int, typer.Option(help="Most requests in flight")] = 32,
    sweep: Annotated[str | None, typer.Option(help="Comma-separated concurrencies instead, e.g. 1,8,32")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic lengths and prompt ids")] = 0,
    threads: Annotated[int | None, typer.Option(help="Engine threads (default: the backend's)")] = None,
    output_json: Annotated[Path | None, typer.Option(help="Write the results as JSON")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG: output tok/s and p50 TTFT vs concurrency")] = None,
) -> None:
    """Closed-loop throughput: N greedy requests, at most C in flight; tok/s, TTFT/ITL/E2E percentiles, GFLOP/s."""
    import json

    from camshaft.errors import RequestError
    from camshaft.runtime.throughput import plot_sweep, throughput_benchmark

    try:
        levels = [int(x) for x in sweep.split(",") if x.strip()] if sweep else [concurrency]
    except ValueError as exc:
        raise RequestError(f"--sweep takes comma-separated integers, got {sweep!r}") from exc
    results = throughput_benchmark(engine, dataset, num_requests, levels, seed=seed, threads=threads)
    for r in results:
        o = r.python_overhead["all_steps"]
        typer.echo(f"concurrency {r.concurrency:>3}: {r.output_tok_s:8.1f} out tok/s  {r.requests_s:6.2f} req/s  "
                   f"TTFT p50/p90/p99 {r.ttft_ms['p50']:.0f}/{r.ttft_ms['p90']:.0f}/{r.ttft_ms['p99']:.0f} ms  "
                   f"ITL p50/p90/p99 {r.itl_ms['p50']:.1f}/{r.itl_ms['p90']:.1f}/{r.itl_ms['p99']:.1f} ms  "
                   f"E2E p50 {r.e2e_ms['p50'] / 1000:.2f} s  peak KV {100 * r.peak_kv_usage:.0f}%  "
                   f"{r.gflop_s:.1f} GFLOP/s  loop overhead {100 * o['outside_engine_step']:.1f}%")
    if output_json:
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps({"engine": str(engine), "dataset": dataset, "num_requests": num_requests,
                                           "seed": seed, "results": [r.to_dict(True) for r in results]},
                                          indent=2) + "\n")
    if plot:
        plot_sweep(results, plot)


@bench_app.command("serve")
def bench_serve(
    target: Annotated[list[str], typer.Option(
        help="NAME=URL,backend={openai,triton-generate,triton-grpc,llm}[,model=NAME] (repeatable); llm takes an "
             "engine directory as URL and runs in-process")],
    dataset: Annotated[str, typer.Option(help="prefill-heavy | decode-heavy | synthetic:in=DIST,out=DIST | jsonl:PATH")]
    = "prefill-heavy",
    tokenizer: Annotated[Path | None, typer.Option(help="Engine or checkpoint directory whose tokenizer sizes the "
                                                        "synthetic prompts (default: an llm target's engine)")] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests per run")] = 64,
    request_rate: Annotated[str, typer.Option(help="Requests/s of the Poisson arrivals, or inf; a comma-separated "
                                                   "list sweeps, e.g. 1,2,4,inf")] = "inf",
    max_concurrency: Annotated[str | None, typer.Option(help="Most requests in flight per target; a "
                                                             "comma-separated list sweeps, e.g. 1,8,32")] = None,
    goodput: Annotated[str | None, typer.Option(help="SLOs for goodput, e.g. ttft_ms=1000,tpot_ms=100")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the prompts and arrivals")] = 0,
    warmup: Annotated[int, typer.Option(help="Short warm-up requests per target")] = 2,
    output_json: Annotated[Path | None, typer.Option(help="Write the results as JSON")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG: latency vs throughput, one line per target")] = None,
) -> None:
    """Serving benchmark: the same requests through several endpoints; TTFT/TPOT/ITL/E2E percentiles, goodput."""
    import json

    from camshaft.bench_serve.clients import Target
    from camshaft.bench_serve.report import Goodput
    from camshaft.bench_serve.report import plot as plot_results
    from camshaft.bench_serve.run import bench_serve as run_bench
    from camshaft.bench_serve.workload import load_requests, load_tokenizer, parse_rates

    try:
        concurrencies = [int(c) for c in max_concurrency.split(",")] if max_concurrency else [None]
    except ValueError:
        concurrencies = [0]
    if any(c is not None and c < 1 for c in concurrencies):
        raise CamshaftError(f"--max-concurrency takes positive integers, comma-separated; got {max_concurrency!r}")
    targets = [Target.parse(t) for t in target]
    if len({t.name for t in targets}) != len(targets):
        raise CamshaftError("--target names must differ")
    source = tokenizer or next((Path(t.url) for t in targets if t.backend == "llm"), None)
    requests = load_requests(dataset, num_prompts, load_tokenizer(source) if source else None, seed=seed)
    results = run_bench(targets, requests, parse_rates(request_rate), concurrencies=concurrencies,
                        goodput=Goodput.parse(goodput), seed=seed, warmup=warmup, log=typer.echo)
    if output_json:
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps({"dataset": dataset, "num_prompts": num_prompts, "seed": seed,
                                           "max_concurrency": concurrencies,
                                           "results": [r.to_dict() for r in results]}, indent=2) + "\n")
    if plot:
        plot_results(results, plot, title=f"{dataset}, {num_prompts} prompts, request rate {request_rate}, "
                                          f"max concurrency {max_concurrency or 'unlimited'}")


MemoryOption = Annotated[str | None, typer.Option(
    help="KV cache budget: bytes with a unit (512MiB, 2GB) or a fraction of available memory (0.3); "
         "default: room for max-batch-size full-length sequences")]
QueueOption = Annotated[int | None, typer.Option(help="Requests that may wait beyond a full batch before new ones "
                                                      "are refused as busy (default: unbounded)")]
BatchOption = Annotated[int | None, typer.Option(help="Most running requests (default and maximum: the engine's)")]
PolicyOption = Annotated[str, typer.Option(help="guaranteed_no_evict | max_utilization")]


def _llm_options(kv_cache_memory: str | None, max_queue: int | None, max_batch_size: int | None,
                 policy: str) -> dict:
    """The keyword arguments of camshaft.runtime.llm.LLM that servers take, validated now."""
    from camshaft.runtime.kv_cache import parse_memory
    from camshaft.runtime.scheduler import POLICIES

    if policy not in POLICIES:
        raise CamshaftError(f"unknown --policy {policy!r}; use one of {', '.join(POLICIES)}")
    if max_queue is not None and max_queue < 0:
        raise CamshaftError(f"--max-queue must be >= 0, got {max_queue}")
    return {"kv_cache_memory": parse_memory(kv_cache_memory), "max_queue": max_queue,
            "max_batch_size": max_batch_size, "policy": policy}


@app.command()
def deploy(
    engine: Annotated[Path, typer.Option(help="Engine directory")],
    repo: Annotated[Path, typer.Option(help="Triton model repository to write")],
    name: Annotated[str, typer.Option(help="Name of the text-level model")] = "ensemble",
    kv_cache_memory: MemoryOption = None,
    max_queue: QueueOption = None,
    max_batch_size: BatchOption = None,
    policy: PolicyOption = "guaranteed_no_evict",
) -> None:
    """Write a Triton model repository that serves an engine with in-flight batching."""
    from camshaft.triton_repo.deploy import deploy_repository

    deploy_repository(engine, repo, name=name,
                      llm_options=_llm_options(kv_cache_memory, max_queue, max_batch_size, policy))
    typer.echo(str(repo))


@app.command()
def serve(
    engine: Annotated[Path | None, typer.Option(help="Engine directory (Triton: deployed to a temporary repo)")]
    = None,
    repo: Annotated[Path | None, typer.Option(help="Triton: a repository written by `camshaft deploy`")] = None,
    api: Annotated[str, typer.Option(help="triton | openai")] = "triton",
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port (OpenAI API, or Triton's HTTP endpoint)")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="Triton: gRPC port")] = 8001,
    metrics_port: Annotated[int, typer.Option(help="Triton: metrics port")] = 8002,
    kv_cache_memory: MemoryOption = None,
    max_queue: QueueOption = None,
    max_batch_size: BatchOption = None,
    policy: PolicyOption = "guaranteed_no_evict",
) -> None:
    """Serve an engine: Triton Inference Server (default) or an OpenAI-compatible API."""
    options = _llm_options(kv_cache_memory, max_queue, max_batch_size, policy)
    if api == "openai":
        if engine is None or repo is not None:
            raise CamshaftError("--api openai serves an engine directory: pass --engine (not --repo)")
        from camshaft.openai_server.server import serve as serve_openai

        serve_openai(engine, host=host, port=port, llm_options=options, log=_progress)
    elif api == "triton":
        if (engine is None) == (repo is None):
            raise CamshaftError("pass exactly one of --engine (deployed to a temporary repository) or --repo")
        from camshaft.triton_repo.server import serve as serve_triton

        serve_triton(engine=engine, repo=repo, host=host, http_port=port, grpc_port=grpc_port,
                     metrics_port=metrics_port, llm_options=options, log=_progress)
    else:
        raise CamshaftError(f"unknown --api {api!r}; use triton or openai")


@eval_app.command("ppl")
def eval_ppl(
    data: Annotated[Path, typer.Option(help="UTF-8 text file")],
    engine: Annotated[Path | None, typer.Option(help="Engine directory")] = None,
    model: Annotated[Path | None, typer.Option(help="HF checkpoint: transformers fp32 reference")] = None,
    window: Annotated[int, typer.Option(help="Window (tokens) for --model; engines use their max_seq_len")] = 1024,
) -> None:
    """Perplexity of a text through an engine and/or transformers, in non-overlapping windows."""
    from camshaft.errors import RequestError
    from camshaft.runtime.perplexity import engine_perplexity, read_text, reference_perplexity

    if engine is None and model is None:
        raise RequestError("pass --engine, --model or both")
    text = read_text(data)
    results = []
    if engine is not None:
        results.append(("engine", engine_perplexity(engine, text)))
    if model is not None:
        results.append(("transformers", reference_perplexity(model, text, window)))
    for name, r in results:
        typer.echo(f"{name:<12} ppl {r.perplexity:.4f}  ({r.tokens_scored} tokens, {r.windows} windows)")


def main() -> None:
    try:
        app()
    except CamshaftError as exc:
        err.print(f"[bold red]error:[/bold red] {exc}")
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
