"""In-flight batching end to end on a tiny engine: greedy outputs equal one-at-a-time runs under both capacity
policies and forced preemption; prefix reuse feeds only new tokens; cancellation frees blocks; hopeless requests
are refused."""

from __future__ import annotations

import asyncio
import queue
import random

import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CapacityError
from camshaft.manifest import read_manifest
from camshaft.runtime.kv_cache import bytes_per_block
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model

BLOCK = 16


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching")
    model = make_tiny_model("llama", root / "hf", max_position_embeddings=1024)
    build_engine(BuildConfig(model, root / "engine", max_seq_len=1024, max_num_tokens=64, kv_block_size=BLOCK,
                             max_batch_size=8))
    return root / "engine"


@pytest.fixture(scope="module")
def workload():
    """32 requests, prompts 5-600 tokens and outputs 1-200 (both ends present)."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(5, 600))] for _ in range(32)]
    prompts[0], prompts[1] = prompts[0][:5], [rng.randrange(3, 380) for _ in range(600)]
    params = [SamplingParams(max_tokens=rng.randint(1, 200), ignore_eos=True) for _ in prompts]
    params[0] = SamplingParams(max_tokens=200, ignore_eos=True)
    params[1] = SamplingParams(max_tokens=1, ignore_eos=True)
    return prompts, params


@pytest.fixture(scope="module")
def one_at_a_time(engine_dir, workload):
    session = Session(engine_dir)
    return [session.generate(p, sp).token_ids for p, sp in zip(*workload, strict=True)]


def pool_budget(engine_dir, usable_blocks: int) -> int:
    return bytes_per_block(read_manifest(engine_dir)) * (usable_blocks + 1)


def record_steps(llm: LLM) -> list[list]:
    steps, step = [], llm.engine.step

    def recording(chunks):
        steps.append([(list(c.token_ids), c.start_pos) for c in chunks])
        return step(chunks)

    llm.engine.step = recording
    return steps


@pytest.mark.parametrize("policy, usable_blocks", [
    ("guaranteed_no_evict", None), ("max_utilization", None), ("guaranteed_no_evict", 56), ("max_utilization", 56)])
def test_in_flight_batching_matches_one_at_a_time(engine_dir, workload, one_at_a_time, policy, usable_blocks):
    budget = pool_budget(engine_dir, usable_blocks) if usable_blocks else None
    with LLM(engine_dir, policy=policy, kv_cache_memory=budget) as llm:
        outputs = llm.generate(*workload, use_tqdm=False)
        scheduler = llm.executor.scheduler
        assert [o.token_ids for o in outputs] == one_at_a_time
        for output, params in zip(outputs, workload[1], strict=True):
            assert len(output.outputs) == 1 and output.outputs[0].finish_reason == "length"
            assert len(output.token_ids) == params.max_tokens
        assert scheduler.blocks.num_used == 0 and not scheduler.has_work
        assert llm.executor.peak_batch_size > 1
        if usable_blocks and policy == "max_utilization":
            assert scheduler.num_preemptions > 0
        if policy == "guaranteed_no_evict":
            assert scheduler.num_preemptions == 0
        stats = llm.stats
        assert stats and max(s.batch_size for s in stats) > 1 and all(s.num_tokens <= 64 for s in stats)
        assert all(0 <= s.kv_usage <= 1 and s.step_s > 0 for s in stats)


def test_step_stats_count_a_one_token_prompt_chunk_as_prefill(engine_dir):
    with LLM(engine_dir, max_num_tokens=4) as llm:
        llm.generate([list(range(10, 15))], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert [(s.num_tokens, s.num_prefill_tokens) for s in llm.stats] == [(4, 4), (1, 1), (1, 0), (1, 0)]


def test_shared_prefix_feeds_only_new_tokens(engine_dir):
    rng = random.Random(9)
    prefix = [rng.randrange(3, 380) for _ in range(256)]
    first, second = prefix + [5, 6, 7, 8], prefix + [9, 10, 11]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    session = Session(engine_dir)
    expected = session.generate(second, params).token_ids
    with LLM(engine_dir) as llm:
        llm.generate([first], params, use_tqdm=False)
        steps = record_steps(llm)
        result = llm.generate([second], params, use_tqdm=False)[0]
        fed = [chunk for step in steps for chunk in step]
        assert fed[0] == ([9, 10, 11], 256)
        assert sum(len(tokens) for tokens, _ in fed) == 3 + 19  # the new prompt tokens, then one per decode
        assert result.token_ids == expected
        assert llm.kv_cache.prefix_hits == 256 // BLOCK and llm.kv_cache.used == 0
        assert "".join(llm.stream_sync(second, params)) == result.text
    metrics = result.outputs[0].metrics  # the request's own count (TensorRT-LLM's perf metrics)
    assert (metrics.kv_blocks_reused, metrics.kv_blocks_new) == (256 // BLOCK, 1)  # the prompt's 259 tokens
    times = [metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time]
    assert None not in times and times == sorted(times)


def test_n_outputs_share_the_prompt_blocks(engine_dir):
    prompt = list(range(40, 140))  # 6 full blocks + 4 tokens
    params = SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=3, ignore_eos=True)
    with LLM(engine_dir) as llm:
        steps = record_steps(llm)
        output = llm.generate(prompt, params, use_tqdm=False)[0]
        assert len(output.outputs) == 3 and len({tuple(o.token_ids) for o in output.outputs}) == 3
        assert llm.executor.scheduler.blocks.prefix_hits == 2 * 6
        assert sorted((o.metrics.kv_blocks_reused, o.metrics.kv_blocks_new) for o in output.outputs) == [
            (0, 7), (6, 1), (6, 1)]
        prompt_tokens_fed = sum(len(tokens) for step in steps for tokens, _ in step if len(tokens) > 1)
        assert prompt_tokens_fed == 100 + 2 * 4
        again = llm.generate(prompt, params, use_tqdm=False)[0]
        assert [o.token_ids for o in again.outputs] == [o.token_ids for o in output.outputs]


def test_preemption_never_takes_a_sibling_already_in_the_step(engine_dir):
    """n siblings tie in queue order; when a decode must grow into a full pool, the victim is never one whose chunk
    this step already holds (its blocks would go to the grower while it still runs on them: wrong KV, wrong
    logits). With preemptions forced, every output and log-prob equals the run with room for all."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(20, 60))] for _ in range(16)]
    params = SamplingParams(max_tokens=40, n=3, logprobs=1, ignore_eos=True)
    with LLM(engine_dir) as roomy:
        expected = roomy.generate(prompts, params, use_tqdm=False)
    with LLM(engine_dir, policy="max_utilization", kv_cache_memory=12 * BLOCK * 512) as tight:
        got = tight.generate(prompts, params, use_tqdm=False)
        assert tight.executor.scheduler.num_preemptions > 0
    for a, b in zip(got, expected, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert max(abs(p.logprob - q.logprob) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4


def test_cancelling_a_stream_frees_its_blocks_within_one_step(engine_dir):
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    prompts = [list(range(10 + i, 60 + i)) for i in range(4)]
    session = Session(engine_dir)
    expected = [session.generate(p, params).text for p in prompts[1:]]

    with LLM(engine_dir) as llm:
        running_at_step = []
        step = llm.engine.step

        def recording(chunks):
            running_at_step.append({id(r) for r in llm.executor.scheduler.running})
            return step(chunks)

        llm.engine.step = recording

        async def collect(prompt):
            return "".join([delta async for delta in llm.stream(prompt, params)])

        async def cancel_after(prompt, deltas: int):
            stream = llm.stream(prompt, params)
            async for _ in stream:
                deltas -= 1
                if deltas == 0:
                    break
            victim = next((r for r in llm.executor._requests.values() if r.prompt_ids == prompt), None)
            await stream.aclose()  # aborts
            return len(running_at_step), victim

        async def main():
            return await asyncio.gather(cancel_after(prompts[0], 3), *(collect(p) for p in prompts[1:]))

        (steps_at_cancel, victim), *texts = asyncio.run(main())
        assert texts == expected
        assert victim is not None and victim.finish_reason == "abort" and victim.blocks == []
        assert len(victim.output_ids) < 150
        assert sum(id(victim) in running for running in running_at_step[steps_at_cancel:]) <= 1
        assert llm.executor.scheduler.blocks.num_used == 0


def test_a_request_that_can_never_fit_is_refused_not_hung(engine_dir):
    with LLM(engine_dir, kv_cache_memory=pool_budget(engine_dir, 4)) as llm:  # 4 blocks = 64 tokens
        with pytest.raises(CapacityError, match="KV blocks"):
            llm.generate([list(range(3, 60))], SamplingParams(max_tokens=20), use_tqdm=False)
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs
        with pytest.raises(CapacityError, match="max_seq_len"):
            llm.generate([[5] * 1020], SamplingParams(max_tokens=20), use_tqdm=False)


def test_limits_beyond_the_engine_are_refused(engine_dir):
    from camshaft.errors import RequestError

    with pytest.raises(RequestError, match="--max-batch-size"):
        LLM(engine_dir, max_batch_size=9)
    with pytest.raises(RequestError, match="policy must be one of guaranteed_no_evict, max_utilization"):
        LLM(engine_dir, policy="greedy")


def test_llm_is_exported_lazily():
    import camshaft

    assert camshaft.LLM is LLM


def test_shared_prefixes_in_one_batch_on_a_sliding_window_model(tmp_path):
    model = make_tiny_model("mistral-sliding", tmp_path / "hf")
    engine = tmp_path / "engine"
    build_engine(BuildConfig(model, engine, max_seq_len=256, max_num_tokens=32, kv_block_size=8, max_batch_size=6))
    rng = random.Random(1)
    shared = [rng.randrange(3, 380) for _ in range(80)]
    prompts = [shared + [rng.randrange(3, 380) for _ in range(rng.randint(1, 60))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True) for _ in prompts]
    session = Session(engine)
    expected = [session.generate(p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    # blocks behind the window go back to the pool: one this small still preempts
    with LLM(engine, policy="max_utilization", kv_cache_memory=pool_budget(engine, 12)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert llm.kv_cache.prefix_hits > 0 and llm.kv_cache.used == 0
        assert llm.executor.scheduler.num_preemptions > 0


def test_a_closed_loop_clients_next_request_joins_the_next_step(engine_dir):
    """After a step that finished a request, the loop waits briefly (admit window) for new requests: a client that
    sends its next request as soon as the last one finishes gets it prefilled in the very next step."""
    with LLM(engine_dir) as llm:
        llm.executor.admit_window_s = 0.5  # generous, so the client thread's reaction on a loaded machine fits
        steps = record_steps(llm)
        finished: queue.SimpleQueue = queue.SimpleQueue()

        def send(prompt, max_tokens):
            (request,) = llm._requests(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            llm.executor.submit([request], [lambda out: finished.put(out) if out.finished else None])

        send(list(range(20, 60)), 40)  # keeps the batch busy: the loop would go straight on to another step
        send(list(range(100, 110)), 3)
        assert finished.get(timeout=60).result.token_ids is not None  # the short one
        send([7] * 20, 2)
        for _ in range(2):
            finished.get(timeout=60)
        short_last = max(i for i, step in enumerate(steps) if any(start == 10 + 1 for _, start in step))
        joined = next(i for i, step in enumerate(steps) if ([7] * 20, 0) in step)
        assert joined == short_last + 1, (short_last, joined)


def test_n_siblings_keep_their_first_sequences_place_in_the_queue(engine_dir):
    """One running slot: the n = 2 request's second sequence, released once the first has its prompt blocks, runs
    before a request that arrived after them (it queued behind that request before)."""
    with LLM(engine_dir, max_batch_size=1) as llm:
        first = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
        later = SamplingParams(max_tokens=6, ignore_eos=True)
        outputs = llm.generate([[10, 11, 12], [20, 21]], [first, later], use_tqdm=False)
        sibling, after = outputs[0].outputs[1].timings, outputs[1].outputs[0].timings
        assert sibling.queued_s < after.queued_s and sibling.total_s < after.total_s


def test_priorities_order_the_queue(engine_dir):
    """One running slot, busy with a long request while three more arrive: they run by priority, not arrival."""
    with LLM(engine_dir, max_batch_size=1) as llm:
        blocker = llm.stream_sync([3, 4, 5], SamplingParams(max_tokens=400, ignore_eos=True))
        next(blocker)  # running now
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        outputs = llm.generate([[10, 11], [12, 13], [14, 15]], params, priority=[2, 0, 1], use_tqdm=False)
        finished = [o.outputs[0].timings.total_s for o in outputs]
        assert finished[1] < finished[2] < finished[0]
        queued = [o.outputs[0].timings.queued_s for o in outputs]  # each waited for the slot, in priority order
        assert 0 < queued[1] < queued[2] < queued[0]
        assert all(o.outputs[0].timings.queued_s < o.outputs[0].timings.ttft_s for o in outputs)
        assert len("".join(blocker)) > 0
        from camshaft.errors import RequestError

        with pytest.raises(RequestError, match="priorities for 3 prompts"):
            llm.generate([[10], [11], [12]], params, priority=[0], use_tqdm=False)


def test_an_urgent_request_preempts_a_running_one_under_max_utilization(engine_dir):
    """One running slot, busy with a long priority-1 request: a priority-0 arrival preempts it (the only way it
    could be preempted: the pool has room) and the preempted request still gives exactly what it gives alone
    (greedy; it recomputes its prompt and output when readmitted)."""
    long_params = SamplingParams(max_tokens=300, ignore_eos=True)
    with LLM(engine_dir, max_batch_size=1) as llm:
        alone = llm.generate([[3, 4, 5]], long_params, use_tqdm=False)[0].outputs[0].text
    with LLM(engine_dir, max_batch_size=1, policy="max_utilization") as llm:
        blocker = llm.stream_sync([3, 4, 5], long_params, priority=1)
        first = next(blocker)
        urgent = llm.generate([[10, 11]], SamplingParams(max_tokens=4, ignore_eos=True), priority=0, use_tqdm=False)
        assert len(urgent[0].outputs[0].token_ids) == 4 and llm.executor.scheduler.num_preemptions == 1
        assert first + "".join(blocker) == alone


@pytest.mark.parametrize("reservation", ["paged", "contiguous"])
def test_paging_admits_more_than_a_contiguous_reservation(engine_dir, reservation):
    """The same pool (128 usable blocks = two max_seq_len sequences) and workload: a contiguous reservation runs
    two requests at a time; paging runs all eight (each needs 7 blocks)."""
    prompts = [list(range(3 + i, 83 + i)) for i in range(8)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with LLM(engine_dir, kv_cache_memory=pool_budget(engine_dir, 128), kv_reservation=reservation) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 20 for o in outputs)
        assert llm.executor.peak_batch_size == (2 if reservation == "contiguous" else 8)
        assert llm.executor.scheduler.blocks.num_used == 0


def test_prompt_logprobs_are_transformers_log_softmax_through_chunks_reuse_and_preemption(engine_dir, tmp_path):
    import numpy as np
    import torch
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(engine_dir.parent / "hf").eval()
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (150, 40, 150)]
    prompts[2][:64] = prompts[0][:64]  # a cached prefix: its rows must be computed, not reused

    def expected(prompt: list[int]) -> np.ndarray:
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].double(), -1).numpy()
        return np.array([logp[i - 1, prompt[i]] for i in range(1, len(prompt))])

    params = SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=40, ignore_eos=True)
    for options in ({}, {"policy": "max_utilization", "kv_cache_memory": pool_budget(engine_dir, 16)}):
        with LLM(engine_dir, **options) as llm:
            llm.generate(prompts[0], plain)  # caches the first prompt's blocks
            outs = llm.generate(prompts, params)
            greedy = llm.generate(prompts, plain)
            preempted = llm.executor.scheduler.num_preemptions
            assert llm.kv_cache.used == 0
        for prompt, out, same in zip(prompts, outs, greedy, strict=True):
            got = out.prompt_logprobs  # vLLM's place (each output holds the same)
            assert got is out.outputs[0].prompt_logprobs
            assert got[0] is None and len(got) == len(prompt)  # 64-token steps: every prompt spans chunks
            np.testing.assert_allclose([s.logprob for s in got[1:]], expected(prompt), atol=2e-5)
            assert all(len(s.top_logprobs) == 3 and s.token_id == t for s, t in zip(got[1:], prompt[1:], strict=True))
            assert out.outputs[0].token_ids == same.outputs[0].token_ids  # sampling unchanged
            assert same.outputs[0].prompt_logprobs is None
    assert preempted > 0  # the second pool forced recomputation, which must not record a prompt twice
    with LLM(engine_dir) as llm:  # n outputs share the prompt's log-probs and blocks: the prompt runs once
        steps = record_steps(llm)
        n = llm.generate(prompts[0], SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=2, n=3,
                                                    temperature=1.0, seed=1))[0]
        assert sum(len(tokens) for step in steps for tokens, _ in step if len(tokens) > 1) == 150 + 2 * (150 % BLOCK)
        first = [s.logprob for s in n.outputs[0].prompt_logprobs[1:]]
        np.testing.assert_allclose(first, expected(prompts[0]), atol=2e-5)
        assert all([s.logprob for s in o.prompt_logprobs[1:]] == first for o in n.outputs[1:])
    with pytest.raises(Exception, match="for prompt_logprobs use camshaft.LLM"):
        Session(engine_dir).generate(prompts[1], params)


def test_a_failure_recording_prompt_logprobs_ends_that_request_only(engine_dir, monkeypatch):
    from camshaft.runtime.request import Request

    def broken(self, rows, start):
        raise ValueError("recording failed")

    monkeypatch.setattr(Request, "add_prompt_rows", broken)
    with LLM(engine_dir) as llm:
        with pytest.raises(ValueError, match="recording failed"):
            llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=3, prompt_logprobs=0))
        assert llm.alive and llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=3))[0].outputs[0].token_ids
        assert llm.kv_cache.used == 0
