"""Sliding-window models: blocks behind every layer's window go back to the pool as a request moves on."""

from __future__ import annotations

import random

import pytest
from test_batching import pool_budget
from test_scheduler import config, make_request, reference_output, run, step

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CapacityError
from camshaft.model_config import ModelConfig
from camshaft.runtime.kv_cache import NULL_BLOCK
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.scheduler import Scheduler
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model


def checked_step(scheduler: Scheduler) -> list:
    return complete(scheduler, checked_schedule(scheduler))


def checked_schedule(scheduler: Scheduler) -> list:
    """A step whose every query finds the keys its window reads in real blocks, and whose requests hold no more
    than the window allows (max_utilization)."""
    size, window = scheduler.config.block_size, scheduler.config.sliding_window
    for request in scheduler.running:
        held = [b for b in request.blocks if b != NULL_BLOCK]
        if scheduler.config.policy == "max_utilization":
            assert len(held) <= scheduler.config.window_blocks
    scheduled = scheduler.schedule()
    for item in scheduled:
        table, start = item.chunk.block_table, item.chunk.start_pos
        for pos in range(start, start + item.num_tokens):
            reads = {table[k // size] for k in range(max(0, pos - window + 1), pos + 1)}
            assert NULL_BLOCK not in reads, f"position {pos} reads a released block"
    return scheduled


def complete(scheduler: Scheduler, scheduled: list) -> list:
    """The checked step of test_scheduler on what was scheduled."""
    scheduler.schedule = lambda: scheduled  # step() schedules: hand it this step's
    try:
        return step(scheduler)
    finally:
        del scheduler.schedule


def run_checked(scheduler: Scheduler, requests: list) -> list[list]:
    return run(scheduler, requests, 20_000, checked_step)


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
@pytest.mark.parametrize("window", [3, 9, 30])
def test_requests_longer_than_the_pool_finish_holding_only_their_window(window, policy):
    cfg = config(policy=policy, sliding_window=window, num_blocks=40, max_seq_len=400, max_num_tokens=16)
    assert cfg.window_blocks < 39
    scheduler = Scheduler(cfg)
    rng = random.Random(window)
    requests = [make_request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 150))], rng.randint(160, 220))
                for i in range(8)]
    assert all(scheduler.blocks.blocks_for(len(r.prompt_ids) + r.params.max_tokens) > 39 for r in requests)
    steps = run_checked(scheduler, requests)
    for request in requests:
        assert request.output_ids == reference_output(request.prompt_ids, request.params.max_tokens)
    assert scheduler.blocks.num_used == 0 and scheduler.blocks.num_free == 39
    assert max(len(s) for s in steps) > 1
    if policy == "guaranteed_no_evict":  # each admitted holding back what it may still take: never preempted
        assert scheduler.num_preemptions == 0


def test_guaranteed_no_evict_admits_by_the_window_not_the_whole_request():
    """With the pool holding back a window's blocks per request (not prompt + max_tokens), more run at once."""
    def peak(window: int | None) -> int:
        scheduler = Scheduler(config(sliding_window=window, num_blocks=71, max_seq_len=400, max_num_tokens=8,
                                     max_batch_size=8))
        rng = random.Random(7)
        requests = [make_request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(20, 40))], 100)
                    for i in range(8)]
        steps = run_checked(scheduler, requests) if window else run(scheduler, requests)
        assert scheduler.num_preemptions == 0 and scheduler.blocks.num_used == 0
        for request in requests:
            assert request.output_ids == reference_output(request.prompt_ids, 100)
        return max(len(s) for s in steps)

    assert peak(None) == 2 and peak(8) == 8  # 70 blocks of 4: 30-35 a whole request, 6 a window of 8 + a step


@pytest.mark.parametrize("num_blocks", range(25, 60, 3))
def test_guaranteed_no_evict_never_preempts_requests_sharing_blocks(num_blocks):
    """A block two running requests share frees nothing when one passes it: the pool holds back for each what it
    alone holds, or the other's growth would find no free block."""
    scheduler = Scheduler(config(sliding_window=20, block_size=1, max_num_tokens=2, num_blocks=num_blocks,
                                 max_seq_len=400))
    prompt = list(range(1, 31))
    first, second = make_request("first", prompt, 60), make_request("second", prompt, 60)
    scheduler.add(first)
    while first.num_computed < len(prompt) - 1 or not first.output_ids:
        checked_step(scheduler)
    scheduler.add(second)  # reuses the first's blocks while it runs
    while scheduler.has_work:
        checked_step(scheduler)
    assert scheduler.num_preemptions == 0 and scheduler.blocks.num_used == 0
    assert first.output_ids == second.output_ids == reference_output(prompt, 60)


def test_guaranteed_no_evict_holds_back_less_for_requests_past_their_prompt():
    """A request past its prompt steps a token (and its drafts) at a time: the pool holds back a window of those for
    it, not a window plus a whole prompt chunk."""
    scheduler = Scheduler(config(sliding_window=8, num_blocks=41, max_seq_len=400, max_num_tokens=64,
                                 max_batch_size=8))
    assert (scheduler.config.window_blocks, scheduler.config.decode_window_blocks) == (20, 5)
    requests = [make_request(f"r{i}", list(range(10 * i + 1, 10 * i + 21)), 100) for i in range(8)]
    steps = run_checked(scheduler, requests)
    assert scheduler.num_preemptions == 0 and scheduler.blocks.num_used == 0
    for request in requests:
        assert request.output_ids == reference_output(request.prompt_ids, 100)
    assert max(len(s) for s in steps) >= 6  # 3 when every running one is held back a window plus a chunk


def test_without_a_window_such_a_request_is_refused():
    request = make_request("long", list(range(1, 150)), 220)
    with pytest.raises(CapacityError, match="KV blocks"):
        Scheduler(config(policy="max_utilization", num_blocks=40, max_seq_len=400)).add(request)
    Scheduler(config(policy="max_utilization", num_blocks=40, max_seq_len=400, sliding_window=9)).add(request)


def test_a_request_the_pool_never_holds_is_told_what_would_help():
    """Review: a prompt bigger than the pool was told to lower max_tokens, which never helps; a sliding request's
    window and step were told the same; each option named now works on its own (re-review: 'lower max_num_tokens'
    where no value could, 'use paged' where paged was refused too)."""
    small = config(num_blocks=10, max_seq_len=400)  # 9 usable blocks of 4 tokens: 36 tokens of one request
    for prompt, max_tokens, fix in ((30, 20, ", or lower max_tokens to 6 or less$"),
                                    (40, 5, ", or keep prompt \\+ max_tokens within 36 tokens")):
        with pytest.raises(CapacityError, match=fix):
            Scheduler(small).add(make_request("r", list(range(1, prompt + 1)), max_tokens))
        Scheduler(small).add(make_request("r", list(range(1, min(prompt, 35) + 1)), min(max_tokens, 36 - prompt)
                                          if prompt < 36 else 1))  # following it fits
    contiguous = config(num_blocks=10, max_seq_len=400, kv_reservation="contiguous")
    with pytest.raises(CapacityError, match="or use kv_reservation='paged' .*per request\\)$"):
        Scheduler(contiguous).add(make_request("r", list(range(1, 11)), 10))
    with pytest.raises(CapacityError, match="or use kv_reservation='paged' .* and lower max_tokens to 16 or less"):
        Scheduler(contiguous).add(make_request("r", list(range(1, 21)), 30))
    long = make_request("long", list(range(1, 150)), 220)
    with pytest.raises(CapacityError, match="or lower max_num_tokens to 19 or less"):  # window 9 + a step of 24
        Scheduler(config(num_blocks=10, max_seq_len=400, sliding_window=9)).add(long)
    Scheduler(config(num_blocks=10, max_seq_len=400, sliding_window=9, max_num_tokens=19)).add(long)
    with pytest.raises(CapacityError) as info:  # no step fits a window of 30 in 9 blocks
        Scheduler(config(num_blocks=10, max_seq_len=400, sliding_window=30)).add(long)
    assert "max_num_tokens" not in str(info.value) and "keep prompt + max_tokens within 36" in str(info.value)
    sliding_contiguous = config(num_blocks=10, max_seq_len=400, sliding_window=9, kv_reservation="contiguous",
                                max_num_tokens=16)
    with pytest.raises(CapacityError) as info:  # a contiguous reservation holds max_seq_len: max_num_tokens can't help
        Scheduler(sliding_contiguous).add(long)
    assert str(info.value).endswith("or use kv_reservation='paged' (a contiguous reservation holds max_seq_len tokens "
                                    "per request)")  # paged, its window alone: enough


def test_guaranteed_no_evict_gives_passed_blocks_back_early():
    scheduler = Scheduler(config(sliding_window=5, num_blocks=80, max_seq_len=400, max_num_tokens=16))
    request = make_request("r", list(range(1, 60)), 100)
    scheduler.add(request)
    reserved = scheduler.blocks.blocks_for(159)
    free_at_start = scheduler.blocks.capacity - reserved
    while not request.finished:
        checked_step(scheduler)
        if request.num_computed > 100 and not request.finished:
            held = sum(1 for b in request.blocks if b != NULL_BLOCK)
            assert held < reserved // 2 and scheduler.blocks.num_free > free_at_start
    assert request.output_ids == reference_output(request.prompt_ids, 100)
    assert scheduler.blocks.num_free == scheduler.blocks.capacity


def test_a_shared_prefix_is_reused_from_where_the_window_starts():
    scheduler = Scheduler(config(policy="max_utilization", sliding_window=6, num_blocks=60, max_seq_len=400))
    prefix = [random.Random(3).randrange(1000) for _ in range(80)]
    first = make_request("first", prefix + [5, 6], 4)
    run_checked(scheduler, [first])
    second = make_request("second", prefix + [7, 8, 9], 30)
    scheduler.add(second)
    (item,) = checked_schedule(scheduler)
    assert item.chunk.start_pos == 80  # the prefix's 20 full blocks were cached
    assert item.chunk.block_table[:18] == [NULL_BLOCK] * 18  # those behind the window were never taken back
    assert NULL_BLOCK not in item.chunk.block_table[18:]
    complete(scheduler, [item])
    while not second.finished:
        checked_step(scheduler)
    assert second.output_ids == reference_output(second.prompt_ids, 30)
    assert scheduler.blocks.num_used == 0


def test_a_prefix_whose_early_blocks_were_evicted_is_still_reused_for_its_window():
    scheduler = Scheduler(config(policy="max_utilization", sliding_window=6, num_blocks=60, max_seq_len=400))
    prefix = [random.Random(4).randrange(1000) for _ in range(80)]
    run_checked(scheduler, [make_request("first", prefix + [5, 6], 4)])
    manager = scheduler.blocks
    held = manager.allocate(len(manager._empty) + 12)  # evicts the 12 least recently used: the prefix's first
    assert manager.evictions == 12 and manager.cached_prefix(prefix + [7]) == []
    manager.free(held)
    second = make_request("second", prefix + [7, 8, 9], 30)
    scheduler.add(second)
    (item,) = checked_step(scheduler)
    assert item.chunk.start_pos == 80 and scheduler.blocks.prefix_hits == 2
    assert second.kv_blocks_reused == 2 and second.first_reused_blocks == 20  # taken / not computed
    while not second.finished:
        checked_step(scheduler)
    assert second.output_ids == reference_output(second.prompt_ids, 30)


def test_a_prompt_preempted_by_an_earlier_prompts_growth_waits_out_the_step():
    """A higher-priority prompt growing its next chunk preempts a running prompt: that one is not scheduled in
    the same step from the waiting queue (its blocks would leak at readmission)."""
    scheduler = Scheduler(config(policy="max_utilization", sliding_window=1, num_blocks=6, max_num_tokens=7,
                                 max_seq_len=400, max_batch_size=4))
    low, high = make_request("low", list(range(1, 11)), 3, priority=1), make_request("high", list(range(500, 513)), 3)
    scheduler.add(low)
    checked_step(scheduler)
    scheduler.add(high)
    while scheduler.has_work:
        scheduled = checked_schedule(scheduler)
        assert all(item.request in scheduler.running for item in scheduled)
        complete(scheduler, scheduled)
    assert scheduler.num_preemptions > 0
    for request in (low, high):
        assert request.output_ids == reference_output(request.prompt_ids, 3)
    assert scheduler.blocks.num_used == 0


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_priorities_and_tight_pools_lose_no_block(seed, policy):
    rng = random.Random(seed)
    scheduler = Scheduler(config(policy=policy, sliding_window=rng.randint(1, 9), block_size=4,
                                 num_blocks=rng.randint(6, 12), max_num_tokens=7, max_seq_len=400))
    prompts: list[list[int]] = []
    for _ in range(12):  # half of them start with an earlier one's prompt: blocks shared while both run
        own = [rng.randrange(1000) for _ in range(rng.randint(2, 40))]
        prompts.append((rng.choice(prompts) + own[:8]) if prompts and rng.random() < 0.5 else own)
    requests = [make_request(f"r{i}", prompt, rng.randint(1, 30), priority=rng.randint(0, 2))
                for i, prompt in enumerate(prompts)]
    arrivals = sorted(rng.randrange(40) for _ in requests)
    preempted: list[str] = []
    preempt = scheduler.preempt
    scheduler.preempt = lambda request: (preempted.append(request.request_id), preempt(request))
    t = 0
    while t < 20_000 and (requests or scheduler.has_work):
        while requests and arrivals[0] <= t:
            scheduler.add(requests.pop(0))
            arrivals.pop(0)
        if scheduler.has_work:
            preempted.clear()
            scheduled = checked_schedule(scheduler)
            assert all(item.request in scheduler.running for item in scheduled)
            assert not {item.request.request_id for item in scheduled} & set(preempted)  # not readmitted at once
            complete(scheduler, scheduled)
        t += 1
    assert not scheduler.has_work and scheduler.blocks.num_used == 0
    assert policy == "max_utilization" or scheduler.num_preemptions == 0


def test_preempted_sliding_requests_recompute_the_same_tokens():
    cfg = config(policy="max_utilization", sliding_window=7, num_blocks=14, max_seq_len=400, max_num_tokens=12,
                 max_batch_size=5)
    scheduler = Scheduler(cfg)
    rng = random.Random(5)
    requests = [make_request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(5, 40))], rng.randint(20, 90))
                for i in range(10)]
    run_checked(scheduler, requests)
    assert scheduler.num_preemptions > 0
    for request in requests:
        assert request.output_ids == reference_output(request.prompt_ids, request.params.max_tokens)
    assert scheduler.blocks.num_free == scheduler.blocks.capacity


def test_an_engine_runs_requests_longer_than_its_pool_as_one_at_a_time(tmp_path):
    """The real graph: released blocks are read as the null block and masked; outputs equal the sequence graph's,
    where prompt + output of every request exceeds the whole pool."""
    model = make_tiny_model("mistral-sliding", tmp_path / "hf")  # every layer slides, window 7
    engine = tmp_path / "engine"
    build_engine(BuildConfig(model, engine, max_seq_len=256, max_num_tokens=32, kv_block_size=8, max_batch_size=4))
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(40, 110))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randint(100, 140), ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(max_tokens=120, temperature=0.9, seed=7, ignore_eos=True)
    session = Session(engine)
    expected = [session.generate(p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    with LLM(engine, policy="max_utilization", kv_cache_memory=pool_budget(engine, 14)) as llm:
        assert llm.config.sliding_window == 7 and llm.config.window_blocks <= 14
        assert all(len(p) + sp.max_tokens > 14 * 8 for p, sp in zip(prompts, params, strict=True))
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert llm.kv_cache.used == 0 and llm.executor.peak_batch_size > 1
        (whole,) = llm.generate([prompts[0]], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
        assert len(whole.token_ids) == 256 - len(prompts[0])  # all max_seq_len leaves, not what the pool holds
    with LLM(engine, kv_cache_memory=pool_budget(engine, 14)) as llm:  # guaranteed_no_evict, the default
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert llm.kv_cache.used == 0 and llm.executor.peak_batch_size > 1
        assert llm.executor.scheduler.num_preemptions == 0
    with LLM(engine, policy="max_utilization", kv_cache_memory=pool_budget(engine, 5)) as llm:  # under its window
        assert llm.config.window_blocks > 5
        (held,) = llm.generate([prompts[0][:10]], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
        assert len(held.token_ids) == 5 * 8 - 10  # what the pool holds of one request, as without a window


@pytest.mark.parametrize(("extra", "window"), [({"model_type": "mistral", "sliding_window": 64}, 64),
                                               ({"model_type": "qwen2", "use_sliding_window": True,
                                                 "sliding_window": 64, "max_window_layers": 0}, 64),
                                               ({"model_type": "qwen2", "use_sliding_window": True,
                                                 "sliding_window": 64, "max_window_layers": 1}, None),
                                               ({"model_type": "mistral", "sliding_window": None}, None)])
def test_only_a_model_whose_every_layer_slides_releases_blocks(extra, window):
    hf = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
          "architectures": [{"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[extra["model_type"]]]}
    assert ModelConfig.from_hf(hf | extra).attention_window == window


def test_inspect_says_when_passed_blocks_are_freed(tmp_path):
    from camshaft.runtime.engine_info import engine_info, info_lines

    for name, every in (("mistral-sliding", True), ("llama", False)):
        model = make_tiny_model(name, tmp_path / name / "hf")
        build_engine(BuildConfig(model, tmp_path / name / "engine", max_seq_len=64))
        info = engine_info(tmp_path / name / "engine")
        assert info["model"]["sliding_every_layer"] is every
        text = "\n".join(info_lines(info))
        assert ("sliding window 7 on every layer (the in-flight batcher frees the KV blocks it has passed)" in text) \
            is every


def test_the_servers_start_line_counts_what_a_window_frees(tmp_path):
    """The OpenAI server's start line: a sequence whose every layer slides holds its window, not max_seq_len."""
    from camshaft import LLM
    from camshaft.openai_server.server import pool_line

    model = make_tiny_model("mistral-sliding", tmp_path / "hf")
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=256, kv_block_size=4, max_num_tokens=16))
    with LLM(tmp_path / "engine") as llm:
        usable, held = llm.config.num_blocks - 1, llm.config.window_blocks
        assert held < 256 // 4
        line = pool_line(llm)
    assert f"{usable // held} sequences of 256 tokens at once (each holds its sliding window of 7)" in line, line


def test_a_server_pool_too_small_for_a_sliding_request_says_to_lower_max_num_tokens(tmp_path):
    """Review: the refusal said to rebuild with a smaller --max-seq-len, which a sliding request does not hold."""
    from camshaft.manifest import read_manifest
    from camshaft.runtime.llm_options import check_serves_full_length
    from camshaft.runtime.scheduler_config import SchedulerConfig

    model = make_tiny_model("mistral-sliding", tmp_path / "hf")
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=256, kv_block_size=4, max_num_tokens=64))
    manifest = read_manifest(tmp_path / "engine")
    tight = SchedulerConfig(10, 4, 4, 64, 256, sliding_window=manifest.model.attention_window)
    with pytest.raises(CapacityError, match="or lower max_num_tokens to 21 or less") as info:
        check_serves_full_length(manifest, tight)
    assert "--max-seq-len" not in str(info.value)
    check_serves_full_length(manifest, SchedulerConfig(10, 4, 4, 21, 256, sliding_window=7))  # a smaller step fits
    mistral_like = SchedulerConfig(300, 16, 4, 8192, 8192, sliding_window=4096)  # the whole length is under a
    with pytest.raises(CapacityError, match="or lower max_num_tokens to 656 or less"):  # window and a step (review)
        check_serves_full_length(manifest, mistral_like)
    check_serves_full_length(manifest, SchedulerConfig(300, 16, 4, 656, 8192, sliding_window=4096))
    with pytest.raises(CapacityError, match="or serve an engine built with --max-seq-len 12 or less"):
        check_serves_full_length(manifest, SchedulerConfig(4, 4, 4, 1, 256, sliding_window=7))  # no step fits
    check_serves_full_length(manifest, SchedulerConfig(4, 4, 4, 1, 12, sliding_window=7))
