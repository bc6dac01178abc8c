"""Throughput benchmark of one engine: N requests through `LLM` with at most C in flight (a closed-loop client).

Datasets: runtime/bench_data.py. Every request is greedy with the end id ignored, so it generates exactly its
max_tokens.

The client submits the first C requests at once and each further one as soon as one finishes. Per request:
TTFT = submitted -> first token sampled, inter-token latencies (ITL) = gaps between its sampled tokens, end-to-end
(E2E) = submitted -> last token sampled. Token times are taken on the batch loop thread the moment each token is
sampled (`Request.add_sample`), since text deltas skip tokens that end mid-character.

Also: output tok/s and requests/s over the whole run, peak KV usage and step count (executor counters), achieved
GFLOP/s and the Python scheduling overhead of the batch loop (runtime/step_timer.py). The results, printing and JSON:
runtime/throughput_report.py.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from pathlib import Path

from camshaft.checks import is_int, is_int_at_least
from camshaft.errors import RequestError
from camshaft.manifest import read_manifest
from camshaft.runtime.bench_data import (
    BenchRequest,
    load_dataset,
    parse_dataset_spec,
    repeat_note,
    warmup_requests,
)
from camshaft.runtime.flops import count_flops
from camshaft.runtime.kv_cache import memory_spec, pool_bytes
from camshaft.runtime.llm import LLM
from camshaft.runtime.llm_options import check_llm_options
from camshaft.runtime.outputs import RequestOutput, Sink
from camshaft.runtime.request import Request
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.step_timer import StepTimer
from camshaft.runtime.throughput_report import (
    RequestRecord,
    ThroughputResult,
    clipped_lines,
    clipped_requests,
    percentiles,
)


def run_throughput(llm: LLM, requests: list[BenchRequest], concurrency: int, *,
                   keep_token_ids: bool = False) -> ThroughputResult:
    """Run `requests` through `llm` with at most `concurrency` in flight; greedy, end id ignored."""
    if concurrency < 1:
        raise RequestError(f"concurrency must be >= 1, got {concurrency}")
    if not requests:
        raise RequestError("no requests to run")
    made = fitting_requests(llm, requests)
    executor = llm.executor
    steps_before = executor.steps_done
    preempt_before = executor.scheduler.num_preemptions
    hits_before = llm.kv_cache.prefix_hits
    drafts_before = executor.draft_tokens, executor.accepted_draft_tokens
    executor.peak_batch_size, executor.peak_kv_usage = 0, 0.0
    records = [RequestRecord(i, len(r.prompt_ids), r.max_tokens) for i, r in enumerate(requests)]
    done: queue.SimpleQueue[tuple[int, RequestOutput]] = queue.SimpleQueue()
    submitted: list = [None] * len(requests)

    def prepared(index: int) -> tuple[Request, Sink]:
        request, record = made[index], records[index]
        add_sample = request.add_sample

        def timed_add_sample(sample):  # runs on the loop thread as each token is sampled, before any is delivered
            if not record.token_times:  # others that fed an output token this step (not a prompt ending in it)
                record.decoding_at_first_token = sum(1 for other in executor.scheduler.running
                                                     if other.num_computed > len(other.prompt_ids))
            record.token_times.append(time.perf_counter())
            record.token_steps.append(executor.steps_done)  # counted once the step's samples are all taken
            return add_sample(sample)

        request.add_sample = timed_add_sample
        return request, lambda out, i=index: done.put((i, out)) if out.finished else None

    ready = [prepared(index) for index in range(len(requests))]
    timer = StepTimer(llm)

    def submit(indices: range) -> None:  # the concurrency bounds what is in flight, not the LLM's max_queue
        batch = [ready[index] for index in indices]
        for index in indices:
            submitted[index] = ready[index][0]
            records[index].submitted = time.perf_counter()
        executor.submit_groups([[request] for request, _ in batch], [[sink] for _, sink in batch], bounded=False)

    started = time.perf_counter()
    try:
        next_index = min(concurrency, len(requests))
        submit(range(next_index))  # the first C at once: they meet the loop together, whatever its timing
        for _ in range(len(requests)):
            index, output = done.get()
            if output.error is not None:
                raise output.error
            if keep_token_ids:
                records[index].token_ids = list(output.result.token_ids)
            if next_index < len(requests):
                submit(range(next_index, next_index + 1))
                next_index += 1
        wall = time.perf_counter() - started
    except BaseException:  # a failed request or Ctrl-C: the rest stop, not run on in an LLM the caller may keep
        for request in submitted:
            if request is not None:
                executor.abort(request.request_id)
        raise
    finally:
        timer.restore()
    # what each request's first admission took from the prefix cache (a readmission after preemption takes back the
    # request's own blocks, which were computed)
    reused = [(r.first_reused_blocks or 0) * llm.engine.block_size for r in submitted]
    flops = count_flops(llm.engine.manifest, requests, reused)
    total_flop = flops["linear"] + flops["lm_head"] + flops["attention"]
    output_tokens = sum(len(r.token_times) for r in records)
    joining = [r.ttft_s for r in records[concurrency:] if r.decoding_at_first_token >= concurrency - 1]
    overhead = {"all_steps": timer.overhead(), f"batch_{concurrency}": timer.overhead(concurrency)}
    return ThroughputResult(
        num_requests=len(requests), concurrency=concurrency, wall_s=wall,
        output_tokens=output_tokens, prompt_tokens=sum(r.prompt_tokens for r in records),
        output_tok_s=output_tokens / wall, requests_s=len(requests) / wall,
        ttft_ms=_ms(percentiles([r.ttft_s for r in records])),
        itl_ms=_ms(percentiles([x for r in records for x in r.itl_s])),
        e2e_ms=_ms(percentiles([r.e2e_s for r in records])),
        ttft_joining_ms=_ms(percentiles(joining)) | {"count": len(joining)},
        peak_kv_usage=executor.peak_kv_usage,
        peak_batch_size=executor.peak_batch_size, num_steps=executor.steps_done - steps_before,
        gflop={k: v / 1e9 for k, v in flops.items() if k != "tokens_fed"} | {"tokens_fed": flops["tokens_fed"]},
        gflop_s=total_flop / wall / 1e9, gflop_s_linear=(flops["linear"] + flops["lm_head"]) / wall / 1e9,
        python_overhead=overhead, preemptions=executor.scheduler.num_preemptions - preempt_before,
        prefix_hits=llm.kv_cache.prefix_hits - hits_before, config=llm_config(llm),
        draft_tokens=executor.draft_tokens - drafts_before[0],
        accepted_draft_tokens=executor.accepted_draft_tokens - drafts_before[1],
        clipped=clipped_requests(requests, llm.config.max_seq_len), records=records)


def fitting_requests(llm: LLM, requests: list[BenchRequest]) -> list[Request]:
    """The LLM's greedy requests (end id ignored) for `requests`; one the engine or its KV pool could never hold is
    refused before any runs, saying which."""
    made = []
    for index, item in enumerate(requests):
        try:
            params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
            made.extend(llm._requests(list(item.prompt_ids), params))
            llm.executor.scheduler.check(made[-1])
        except RequestError as exc:
            raise type(exc)(f"request {index + 1} of {len(requests)}: {exc}", field=exc.field) from None
    return made


def _ms(p: dict[str, float]) -> dict[str, float]:
    return {k: v * 1000 for k, v in p.items()}


def llm_config(llm: LLM) -> dict[str, str | int]:
    c = llm.config
    return {"policy": c.policy, "max_batch_size": c.max_batch_size, "max_num_tokens": c.max_num_tokens,
            "prompt_lookup": c.prompt_lookup.num_tokens if c.prompt_lookup else 0,
            "kv_pool_blocks": c.num_blocks - 1,  # usable; the bytes include the null block (the memory taken)
            "kv_pool_bytes": pool_bytes(llm.engine.manifest, c.num_blocks)}


DEFAULT_CONCURRENCY = 32  # the workload; an engine of a smaller batch runs at its batch size
WARMUP = 2  # short requests with other prompts before each measured run


def throughput_benchmark(engine_dir: str | Path, dataset: str, num_requests: int,
                         concurrency: int | list[int] | None = None, *,
                         seed: int = 0, threads: int | None = None, warmup: int = WARMUP,
                         policy: str = "guaranteed_no_evict", max_batch_size: int | None = None,
                         max_num_tokens: int | None = None, kv_cache_memory: int | float | str | None = None,
                         prompt_lookup: int = 0, progress: Callable[[str], None] = lambda _: None
                         ) -> list[ThroughputResult]:
    """Load the dataset for the engine and run it once per concurrency, each on a fresh `LLM` (an empty prefix
    cache) after `warmup` short requests with other prompts. policy, max_batch_size, max_num_tokens and
    kv_cache_memory go to every LLM (a memory fraction is resolved by the first, its pool kept for the rest), and
    prompt_lookup (its num_tokens; 0: off); `progress` hears of each level as it starts. concurrency None: the batch
    size, at most DEFAULT_CONCURRENCY."""
    levels = [] if concurrency is None else [concurrency] if is_int(concurrency) else list(concurrency)
    if concurrency is not None and (not levels or not all(is_int_at_least(c, 1) for c in levels)):
        raise RequestError(f"concurrency takes positive integers, got {concurrency!r}")
    if not is_int_at_least(num_requests, 1):
        raise RequestError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    spec = parse_dataset_spec(dataset)  # a bad spec or JSONL file is refused before the engine loads
    note = repeat_note(spec, num_requests)
    manifest = read_manifest(Path(engine_dir), check_files=False)  # LLM() below checks the files
    memory, engine_limits = memory_spec(kv_cache_memory), manifest.limits
    batch = check_llm_options(engine_limits, policy=policy, max_batch_size=max_batch_size,
                              max_num_tokens=max_num_tokens).max_batch_size
    levels = levels or [min(DEFAULT_CONCURRENCY, batch)]
    if max(levels) > batch:  # before any level runs
        raise RequestError(f"concurrency {max(levels)} exceeds the batch size {batch}; requests beyond it would only "
                           "queue: lower --concurrency or raise --max-batch-size (at most the engine's "
                           f"{engine_limits.max_batch_size})")
    if note:
        progress(note)
    results, requests = [], None
    for i, c in enumerate(levels, 1):
        progress(f"concurrency {c} ({i}/{len(levels)}): {num_requests} requests")
        with LLM(engine_dir, threads=threads, policy=policy, max_batch_size=max_batch_size,
                 max_num_tokens=max_num_tokens, kv_cache_memory=memory, prompt_lookup=prompt_lookup) as llm:
            limits, model = llm.engine.manifest.limits, llm.engine.manifest.model
            if isinstance(memory, float):  # the first level's pool, in bytes, for every level
                memory = pool_bytes(manifest, llm.engine.pool.num_blocks)
            if requests is None:
                requests = load_dataset(spec, num_requests, max_seq_len=limits.max_seq_len,
                                        vocab_size=model.vocab_size, seed=seed, tokenizer=llm.tokenizer)
                for line in clipped_lines(clipped_requests(requests, limits.max_seq_len)):  # before any request runs
                    progress(line)
            fitting_requests(llm, requests)  # the dataset's refusal, before the warm-up runs
            if warmup:
                run_throughput(llm, warmup_requests(requests, model.vocab_size, warmup), warmup)
            results.append(run_throughput(llm, requests, c))
    return results
