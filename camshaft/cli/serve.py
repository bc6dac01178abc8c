"""Serving: deploy (a Triton model repository) and serve (Triton or the OpenAI API)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from camshaft.cli import app, flag_names, flagged, progress
from camshaft.errors import CamshaftError, needs_extra
from camshaft.openai_server.tool_calls import PARSERS as TOOL_CALL_PARSERS
from camshaft.runtime.llm_options import QUEUE_PER_BATCH

MemoryOption = Annotated[str | None, typer.Option(
    help="KV cache budget: bytes, also with a unit (1000000, 1e9, 512MiB, 2GB), or a fraction of the memory "
         "available once the engine's weights are loaded: a number between 0 and 1, or 1.0 for all of it (0.3, "
         "1.0); default: room for max-batch-size full-length sequences")]
QueueOption = Annotated[int | None, typer.Option(
    min=0, help=f"Sequences that may wait beyond a full batch (a request of n outputs counts n) before new ones are "
                f"refused as busy (default: {QUEUE_PER_BATCH} x the batch size)")]
BatchOption = Annotated[int | None, typer.Option(
    min=1, help="Most sequences running at once, a request of n outputs counting n (default and maximum: the "
                "engine's)")]
PolicyOption = Annotated[str, typer.Option(help="guaranteed_no_evict | max_utilization")]
ThreadsOption = Annotated[int | None, typer.Option(
    min=1, help="Threads the engine computes on (default: as many as this process may keep busy: its CPU "
                "affinity, physical cores and cgroup CPU quota, the least)")]
LLM_FLAGS = ("kv_cache_memory", "max_queue", "max_batch_size", "max_num_tokens", "threads",
             "policy")  # the options' Python names
TRITON_PORTS = {"--grpc-port": 8001, "--metrics-port": 8002}
LOG_LEVELS = ("debug", "info", "warning", "error")
TokensOption = Annotated[int | None, typer.Option(min=1, help="Most tokens a step computes (the prefill chunk budget; "
                                                       "default and maximum: the engine's)")]
NoDecoupledOption = Annotated[bool, typer.Option(
    "--no-decoupled",
    help="Triton: no model decoupled (tensorrtllm_backend's decoupled_mode false): one response a request, so every "
         "model (and an ensemble over tensorrt_llm) takes plain infer, but none streams (default: decoupled, "
         "streaming; NAME_sync takes plain infer either way)")]
LookupOption = Annotated[int, typer.Option(
    min=0, max=16, metavar="N",
    help="Decodes also feed up to this many tokens drafted from their own prompt and output (prompt lookup: the same "
         "outputs, faster where text repeats and the batch is small); 0 = off")]


def _llm_options(engine: Path, kv_cache_memory: str | None, max_queue: int | None, max_batch_size: int | None,
                 policy: str, max_num_tokens: int | None = None, prompt_lookup: int = 0, loads_here: bool = True,
                 threads: int | None = None) -> dict:
    """The keyword arguments of camshaft.runtime.llm.LLM that servers take, checked now against the engine;
    max_queue None: QUEUE_PER_BATCH x the batch size. A fraction stays a fraction, of the memory available where
    the engine loads. A pool in bytes (or the default one) larger than this machine's memory is refused when the
    engine `loads_here`, else (deploy: a repository may be served elsewhere) said in a warning."""
    from camshaft.errors import CapacityError, EngineError
    from camshaft.manifest import read_manifest
    from camshaft.runtime.engine_info import runs_here
    from camshaft.runtime.kv_cache import cache_copies, check_fits_host, memory_spec, pool_blocks
    from camshaft.runtime.llm_options import (
        check_llm_options,
        check_runtime_options,
        check_serves_full_length,
        check_threads_target,
    )
    from camshaft.runtime.scheduler_config import SchedulerConfig

    manifest = read_manifest(Path(engine))
    if loads_here and (why := runs_here(manifest, Path(engine))):  # a TensorRT engine without its GPU: before
        raise EngineError(why)  # Triton starts (its model would fail to load with a traceback in the server's log)
    with flag_names(*LLM_FLAGS):
        check_threads_target(threads, manifest.target, engine)
        if loads_here:  # more threads than this machine's CPUs: refused here, not where a repository is served
            check_runtime_options(threads=threads)
        limits = check_llm_options(manifest.limits, policy=policy, max_batch_size=max_batch_size,
                                   max_num_tokens=max_num_tokens, max_queue=max_queue)
        memory = memory_spec(kv_cache_memory)
        if not isinstance(memory, float):  # bytes, or the default pool: checked now; a fraction depends on the
            # machine that loads the engine
            blocks = pool_blocks(manifest, limits.max_batch_size, memory, cache_copies(manifest))
            check_serves_full_length(manifest, SchedulerConfig(
                blocks, manifest.limits.kv_block_size, limits.max_batch_size, limits.max_num_tokens,
                manifest.limits.max_seq_len, sliding_window=manifest.model.attention_window))
            try:
                check_fits_host(manifest, blocks)
            except CapacityError as exc:
                if loads_here:
                    raise
                typer.echo(f"warning: {flagged(str(exc), *LLM_FLAGS)}; the machine that serves this repository "
                           "needs that much", err=True)
    return {"kv_cache_memory": memory,
            "max_queue": QUEUE_PER_BATCH * limits.max_batch_size if max_queue is None else max_queue,
            "max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens, "policy": policy,
            "prompt_lookup": prompt_lookup or None, "threads": threads}


@app.command()
def deploy(
    engine: Annotated[Path, typer.Option(help="Engine directory")],
    repo: Annotated[Path, typer.Option(help="Triton model repository to write")],
    name: Annotated[str, typer.Option(help="Served model name: the Triton text model (and NAME_sync; "
                                           "tensorrt_llm_bls is another)")] = "ensemble",
    kv_cache_memory: MemoryOption = None,
    max_queue: QueueOption = None,
    max_batch_size: BatchOption = None,
    max_num_tokens: TokensOption = None,
    policy: PolicyOption = "guaranteed_no_evict",
    prompt_lookup: LookupOption = 0,
    threads: ThreadsOption = None,
    no_decoupled: NoDecoupledOption = False,
) -> None:
    """Write a Triton model repository that serves an engine with in-flight batching."""
    from camshaft.triton_repo.deploy import deploy_repository

    shown = repo.absolute()  # now: a repository written over "." replaces the working directory
    deploy_repository(engine, repo, name=name, llm_options=_llm_options(
        engine, kv_cache_memory, max_queue, max_batch_size, policy, max_num_tokens, prompt_lookup, loads_here=False,
        threads=threads),
        decoupled=not no_decoupled)
    typer.echo(str(shown))


@app.command()
def serve(
    engine: Annotated[Path | None, typer.Option(help="Engine directory (Triton: deployed to a temporary repo)")]
    = None,
    repo: Annotated[Path | None, typer.Option(help="Triton: a repository written by `camshaft deploy`")] = None,
    api: Annotated[str, typer.Option(help="triton | openai")] = "triton",
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="HTTP port (OpenAI API, or Triton's HTTP endpoint)")]
    = 8000,
    grpc_port: Annotated[int | None, typer.Option(min=1, max=65535, help="Triton: gRPC port (default 8001)")] = None,
    metrics_port: Annotated[int | None, typer.Option(min=1, max=65535, help="Triton: metrics port (default 8002)")]
    = None,
    name: Annotated[str | None, typer.Option(help="Served model name: the OpenAI model id (default: the engine "
                                                  "directory's name) or the Triton text model deployed from "
                                                  "--engine (default: ensemble; --repo keeps its own)")] = None,
    kv_cache_memory: MemoryOption = None,
    max_queue: QueueOption = None,
    max_batch_size: BatchOption = None,
    max_num_tokens: TokensOption = None,
    policy: Annotated[str | None, typer.Option(help="guaranteed_no_evict | max_utilization (default: "
                                                    "guaranteed_no_evict)")] = None,
    prompt_lookup: LookupOption = 0,
    threads: ThreadsOption = None,
    api_key: Annotated[str | None, typer.Option(
        envvar="CAMSHAFT_API_KEY", show_envvar=False,
        help="OpenAI API: clients must send it as a bearer token (also from $CAMSHAFT_API_KEY, kept out of the "
             "process list); /health, /metrics and /version stay open")] = None,
    tool_call_parser: Annotated[str | None, typer.Option(
        help="OpenAI API: how tool calls the model writes are read, enabling tool_choice auto: hermes (<tool_call> "
             "blocks: Qwen2.5/3, Hermes, camshaft's own tool prompt), llama3_json (Llama 3.1-3.3), mistral "
             "([TOOL_CALLS])")] = None,
    chat_template: Annotated[str | None, typer.Option(
        help="OpenAI API: a Jinja chat template (a file, or the template itself) used in place of the engine's")]
    = None,
    no_decoupled: NoDecoupledOption = False,
    allowed_origins: Annotated[list[str] | None, typer.Option(
        "--allowed-origins", metavar="ORIGIN",
        help="OpenAI API: a web page origin browsers may call it from (CORS; repeat it for several, * for any: "
             "vLLM's default; none by default, so no other site's page can use it)")] = None,
    log_level: Annotated[str, typer.Option(
        help="debug | info | warning | error: what the server logs (OpenAI API: to stderr, each request's end with "
             "its id at info; Triton: to its log file)")] = "info",
) -> None:
    """Serve an engine: Triton Inference Server (default) or an OpenAI-compatible API."""
    if log_level not in LOG_LEVELS:
        raise CamshaftError(f"unknown --log-level {log_level!r}; use {', '.join(LOG_LEVELS)}")
    given = {"--kv-cache-memory": kv_cache_memory, "--max-queue": max_queue, "--max-batch-size": max_batch_size,
             "--max-num-tokens": max_num_tokens, "--policy": policy, "--prompt-lookup": prompt_lookup or None,
             "--threads": threads}
    if repo is not None and any(v is not None for v in given.values()):
        names = ", ".join(k for k, v in given.items() if v is not None)
        raise CamshaftError(f"--repo serves the options `camshaft deploy` wrote into it, so {names} would be ignored; "
                            "pass them to camshaft deploy (and serve the new repository), or serve --engine with them")
    if name is not None and not name.strip():
        raise CamshaftError("--name is empty; give the served model name, or drop --name for the default")
    if api == "openai" and (engine is None or repo is not None):
        raise CamshaftError("--api openai serves an engine directory: pass --engine (not --repo)")
    if api_key is not None and api != "openai":
        raise CamshaftError("--api-key (or $CAMSHAFT_API_KEY) guards the OpenAI API; Triton has no API keys: put it "
                            "behind a gateway that checks them, or unset it")
    if tool_call_parser is not None and api != "openai":
        raise CamshaftError("--tool-call-parser reads tool calls for the OpenAI API (--api openai); drop it")
    if no_decoupled and (api != "triton" or repo is not None):
        raise CamshaftError("--no-decoupled sets how Triton's models are deployed: it goes with --engine (Triton); a "
                            "--repo keeps what camshaft deploy wrote, and the OpenAI API has no such models")
    if allowed_origins and api != "openai":
        raise CamshaftError("--allowed-origins lets web pages call the OpenAI API (--api openai); Triton's HTTP "
                            "endpoint takes no CORS settings: drop it")
    if chat_template is not None and api != "openai":
        raise CamshaftError("--chat-template renders chat messages for the OpenAI API (--api openai); Triton's models "
                            "take text: drop it")
    if tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        raise CamshaftError(f"unknown --tool-call-parser {tool_call_parser!r}; use {', '.join(TOOL_CALL_PARSERS)}")
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise CamshaftError("--api-key is empty or starts or ends with spaces; give the key clients send")
    triton_ports = {"--grpc-port": grpc_port, "--metrics-port": metrics_port}
    if api == "openai" and any(v is not None for v in triton_ports.values()):
        given = [k for k, v in triton_ports.items() if v is not None]
        verb, them = ("set", "them") if len(given) > 1 else ("sets", "it")
        raise CamshaftError(f"--api openai listens on --port only; {' and '.join(given)} {verb} Triton's ports: "
                            f"drop {them}")
    grpc_port, metrics_port = (TRITON_PORTS[k] if v is None else v for k, v in triton_ports.items())
    if api == "triton" and len({port, grpc_port, metrics_port}) < 3:
        raise CamshaftError(f"Triton needs three different ports: --port {port}, --grpc-port {grpc_port}, "
                            f"--metrics-port {metrics_port}")
    if (engine is None) == (repo is None):
        raise CamshaftError("pass exactly one of --engine (deployed to a temporary repository) or --repo")
    options = {} if engine is None else _llm_options(engine, kv_cache_memory, max_queue, max_batch_size,
                                                     policy or "guaranteed_no_evict", max_num_tokens, prompt_lookup,
                                                     threads=threads)
    if api == "openai":
        try:
            from camshaft.openai_server.server import serve as serve_openai
        except ImportError as exc:  # fastapi, uvicorn: the serve extra
            raise CamshaftError(needs_extra(f"the OpenAI server ({exc.name} is not installed)", "serve")) from None

        with flag_names(*LLM_FLAGS):
            serve_openai(engine, host=host, port=port, llm_options=options, log=progress, model_name=name,
                         api_key=api_key, tool_call_parser=tool_call_parser, chat_template=chat_template,
                         allowed_origins=tuple(allowed_origins or ()),
                         log_level=log_level)
    elif api == "triton":
        from camshaft.triton_repo.serve import serve as serve_triton

        serve_triton(engine=engine, repo=repo, host=host, http_port=port, grpc_port=grpc_port,
                     metrics_port=metrics_port, llm_options=options, log=progress, name=name,
                     decoupled=not no_decoupled, log_level=log_level)
    else:
        raise CamshaftError(f"unknown --api {api!r}; use triton or openai")


