"""Drive each target with the same requests and arrival times, rate by rate; targets take turns at each rate so a
noisy machine slows them alike."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

from camshaft.bench_serve.clients import HTTP_BACKENDS, READ_TIMEOUT_S, Record, Target, make_client
from camshaft.bench_serve.report import Goodput, ServeResult, summarize
from camshaft.bench_serve.workload import ServeRequest, arrival_times
from camshaft.errors import CamshaftError, needs_extra

PROGRESS_EVERY_S = 10.0


def run_salt(point: int, index: int) -> str:
    return f"run {point}.{index}"


def salted(requests: list[ServeRequest], salt: str, tokenizer=None) -> list[ServeRequest]:
    """The requests with `salt` leading every prompt: each point of a sweep, and each target, starts cold, since a
    server's prefix cache would otherwise serve prompts it saw before (two targets may be one server). With a
    tokenizer their prompt tokens are counted again, salt included."""
    out = []
    for r in requests:
        prompt = f"{salt}: {r.prompt}"
        count = r.prompt_tokens if tokenizer is None else len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        out.append(replace(r, prompt=prompt, prompt_tokens=count))
    return out


def check_fits(name: str, limit: int, requests: list[ServeRequest], tokenizer, points: int, targets: int) -> None:
    """Refuse, before any run, requests a target's context (max_seq_len, an OpenAI server's max_model_len) cannot
    hold: the longest as sent in the last run (each run's prompts lead with their own salt), and a BOS the server
    may add. Without a tokenizer the prompts' tokens are unknown and nothing is checked."""
    if tokenizer is None:
        return
    longest = max(salted(requests, run_salt(points - 1, targets - 1), tokenizer),
                  key=lambda r: r.prompt_tokens + r.max_tokens)
    needed = longest.prompt_tokens + 1 + longest.max_tokens
    if needed > limit:
        raise CamshaftError(
            f"the dataset's longest request ({longest.prompt_tokens} prompt tokens as sent, with the run's salt, + "
            f"{longest.max_tokens} output tokens) does not fit target {name}'s context of {limit} tokens; size the "
            f"requests to it (e.g. --dataset 'synthetic:in=NORMAL({limit // 2},{limit // 20}),out={limit // 4}') "
            f"or serve an engine built with --max-seq-len {needed} or more")


def count_output_tokens(records: list[Record], tokenizer) -> None:
    """A server that sends no usage counts: the output text's tokens (as vLLM's benchmark), not its stream events,
    which may carry several tokens each."""
    if tokenizer is None:
        return
    for record in records:
        if record.output_tokens is None and record.ok:
            record.output_tokens = len(tokenizer(record.text, add_special_tokens=False)["input_ids"])


async def _drive(client, requests: list[ServeRequest], arrivals: list[float], concurrency: int | None,
                 progress: Callable[[str], None] = lambda _: None) -> tuple[list[Record], float]:
    limit = asyncio.Semaphore(concurrency or len(requests))
    records = [Record(r.prompt_tokens, r.max_tokens) for r in requests]
    start = time.perf_counter()
    finished = 0

    async def one(request: ServeRequest, record: Record, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with limit:
            record.sent = time.perf_counter()
            try:
                await client(request, record)
            except Exception as exc:  # a failed request is a result, not a crash of the benchmark
                record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            finally:
                nonlocal finished
                finished += 1

    async def tick() -> None:  # a long run says how far it got
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            progress(f"{finished}/{len(records)} requests done, {time.perf_counter() - start:.0f} s")

    ticker = asyncio.create_task(tick())
    try:
        await asyncio.gather(*(one(q, r, t) for q, r, t in zip(requests, records, arrivals, strict=True)))
    finally:
        ticker.cancel()
    return records, time.perf_counter() - start


async def _bench(targets: list[Target], requests: list[ServeRequest], rates: list[float],
                 concurrencies: list[int | None], goodput: Goodput, seed: int, warmup: int,
                 log: Callable[[str], None], progress: Callable[[str], None], tokenizer) -> list[ServeResult]:
    results = []
    over_http = any(t.backend in HTTP_BACKENDS for t in targets)
    async with _http_client(len(requests) + 8) if over_http else contextlib.nullcontext() as http:
        clients = [make_client(t, http) for t in targets]
        try:
            for target, client in zip(targets, clients, strict=True):
                try:
                    await client.start()
                except CamshaftError:
                    raise
                except Exception as exc:  # a refused connection, an HTTP error, gRPC's own errors
                    raise CamshaftError(f"target {target.name} ({target.url}, backend {target.backend}) did not "
                                        f"answer: {type(exc).__name__}: {exc}; is the server up at that address?") \
                        from exc
                if getattr(client, "max_model_len", None):  # a server saying its context: checked before any run
                    check_fits(target.name, client.max_model_len, requests, tokenizer,
                               len(concurrencies) * len(rates), len(targets))
                if warmup:
                    progress(f"{target.name}: {warmup} warm-up request(s)")
                    short = [replace(r, max_tokens=min(r.max_tokens, 4)) for r in salted(requests[:warmup], "warm")]
                    await _drive(client, short, [0.0] * len(short), None)
            points = [(c, rate) for c in concurrencies for rate in rates]
            for point, (concurrency, rate) in enumerate(points):
                arrivals = arrival_times(len(requests), rate, seed)
                for index, (target, client) in enumerate(zip(targets, clients, strict=True)):
                    batch = salted(requests, run_salt(point, index), tokenizer)  # targets may share a server
                    progress(f"{target.name}: {len(batch)} requests, rate {rate:g}/s, concurrency "
                             f"{concurrency or 'unlimited'}")
                    records, wall = await _drive(client, batch, arrivals, concurrency, progress)
                    count_output_tokens(records, tokenizer)
                    result = summarize(target, rate, concurrency, records, wall, goodput)
                    log(result.line())
                    results.append(result)
        finally:
            for client in clients:
                await client.close()
    return results


def _http_client(connections: int):
    try:
        import httpx
    except ImportError:
        raise CamshaftError(needs_extra("bench serve's HTTP target (httpx)", "serve")) from None
    limits = httpx.Limits(max_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=10.0), limits=limits)


def bench_serve(targets: list[Target], requests: list[ServeRequest], rates: list[float], *,
                concurrencies: list[int | None] | None = None, goodput: Goodput | None = None, seed: int = 0,
                warmup: int = 2, log: Callable[[str], None] = print,
                progress: Callable[[str], None] = lambda _: None, tokenizer=None) -> list[ServeResult]:
    """Every target gets `requests` at each (max concurrency, rate) pair (requests/s, inf = all at once; None =
    no concurrency limit); results in run order, each also a `log` line; `progress` hears of each run and, every
    PROGRESS_EVERY_S, of the requests done. `tokenizer`: counts the prompts as sent (salted)."""
    return asyncio.run(_bench(targets, requests, rates, concurrencies or [None], goodput or Goodput(), seed, warmup,
                              log, progress, tokenizer))
