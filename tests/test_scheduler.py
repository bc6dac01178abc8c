"""Scheduler and block manager as pure logic: a fake engine step appends a deterministic token per logits row."""

from __future__ import annotations

import random

import pytest

from camshaft.errors import CapacityError, RequestError
from camshaft.runtime.block_manager import BlockManager
from camshaft.runtime.request import Request
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.scheduler import Scheduler
from camshaft.runtime.scheduler_config import SchedulerConfig


def make_request(name: str, prompt: list[int], max_tokens: int, priority: int = 0) -> Request:
    return Request(name, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, None, (),
                   priority=priority)


class RecordingScheduler(Scheduler):
    """Records which requests were preempted, in order."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.preempted: list[str] = []

    def preempt(self, request: Request) -> None:
        self.preempted.append(request.request_id)
        super().preempt(request)


def next_token(request: Request) -> int:
    return (sum(request.all_ids) * 31 + len(request.all_ids)) % 997


def run(scheduler: Scheduler, requests: list[Request], max_steps: int = 10_000, one_step=None) -> list[list]:
    for request in requests:
        scheduler.add(request)
    steps = []
    while scheduler.has_work:
        assert len(steps) < max_steps, "the scheduler stopped making progress"
        steps.append((one_step or step)(scheduler))
    return steps


def step(scheduler: Scheduler) -> list:
    """One checked step: schedule, the fake engine's tokens, finished requests released."""
    scheduled = scheduler.schedule()
    config = scheduler.config
    assert sum(s.num_tokens for s in scheduled) <= config.max_num_tokens
    assert len(scheduler.running) <= config.max_batch_size
    slots = [(item.chunk.block_table[p // config.block_size], p % config.block_size) for item in scheduled
             for p in range(item.chunk.start_pos, item.chunk.start_pos + item.num_tokens)]
    assert len(slots) == len(set(slots)), "two tokens of one step write the same KV slot"
    assert all(item.request in scheduler.running for item in scheduled)
    for item in scheduled:
        table = item.chunk.block_table
        assert len(table) * config.block_size >= item.chunk.start_pos + item.num_tokens
        assert item.chunk.token_ids == item.request.all_ids[item.chunk.start_pos: item.chunk.start_pos
                                                             + item.num_tokens]
    scheduler.computed(scheduled)
    for item in scheduled:
        request = item.request
        if item.chunk.num_logits:
            request.output_ids.append(next_token(request))
            if len(request.output_ids) == request.params.max_tokens:
                request.finish_reason = "length"
                scheduler.finish(request)
    return scheduled


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    request = make_request("ref", prompt, max_tokens)
    while len(request.output_ids) < max_tokens:
        request.output_ids.append(next_token(request))
    return request.output_ids


def config(**overrides) -> SchedulerConfig:
    base = dict(num_blocks=65, block_size=4, max_batch_size=6, max_num_tokens=24, max_seq_len=128)
    return SchedulerConfig(**{**base, **overrides})


def workload(seed: int, count: int = 24) -> list[Request]:
    rng = random.Random(seed)
    return [make_request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 60))], rng.randint(1, 40))
            for i in range(count)]


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
@pytest.mark.parametrize("num_blocks", [65, 26])
def test_every_request_finishes_complete_and_blocks_return(policy, num_blocks):
    scheduler = Scheduler(config(policy=policy, num_blocks=num_blocks))
    requests = workload(1)
    steps = run(scheduler, requests)
    for request in requests:
        assert request.output_ids == reference_output(request.prompt_ids, request.params.max_tokens)
    assert scheduler.blocks.num_used == 0 and scheduler.blocks.num_free == num_blocks - 1
    assert max(len(s) for s in steps) > 1
    if policy == "guaranteed_no_evict":
        assert scheduler.num_preemptions == 0
    elif num_blocks == 26:
        assert scheduler.num_preemptions > 0


def test_a_long_prompt_is_chunked_and_never_stalls_decodes():
    scheduler = Scheduler(config(max_num_tokens=8, num_blocks=200, max_seq_len=400))
    short = [make_request(f"s{i}", [i + 1, 2, 3], 30) for i in range(3)]
    long = make_request("long", list(range(1, 300)), 2)
    for request in short:
        scheduler.add(request)
    scheduler.schedule()  # admits the short ones
    scheduler.add(long)
    for _ in range(20):
        scheduled = scheduler.schedule()
        names = [s.request.request_id for s in scheduled]
        decoding = [r.request_id for r in scheduler.running if r is not long]
        assert set(decoding) <= set(names)
        scheduler.computed(scheduled)
        for item in scheduled:
            if item.chunk.num_logits:
                item.request.output_ids.append(7)
    assert 0 < long.num_computed < len(long.prompt_ids)


def test_guaranteed_no_evict_reserves_prompt_plus_max_tokens():
    scheduler = Scheduler(config(num_blocks=11))  # 10 usable blocks of 4 tokens
    first, second = make_request("a", [1] * 10, 10), make_request("b", [2] * 10, 10)  # 5 blocks each
    third = make_request("c", [3] * 4, 1)
    for request in (first, second, third):
        scheduler.add(request)
    scheduler.schedule()
    assert len(first.blocks) == 5 and len(second.blocks) == 5
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_max_utilization_preempts_the_newest_and_recomputes_it():
    scheduler = RecordingScheduler(config(num_blocks=9, policy="max_utilization"))  # 8 usable blocks
    old, new = make_request("old", [1] * 8, 20), make_request("new", [2] * 8, 20)  # 7 blocks each at the end
    run(scheduler, [old, new])
    assert scheduler.num_preemptions > 0 and set(scheduler.preempted) == {"new"}
    assert old.output_ids == reference_output(old.prompt_ids, 20)
    assert new.output_ids == reference_output(new.prompt_ids, 20)


def test_siblings_of_one_prompt_preempt_the_newest_admitted_first():
    """n > 1 siblings share their prompt's priority and queue order (they join once its first token is out): a full
    pool preempts the sibling admitted last, not the first sequence with the most output."""
    scheduler = RecordingScheduler(config(num_blocks=9, block_size=4, policy="max_utilization"))
    first = make_request("p-0", list(range(1, 9)), 20)
    scheduler.add(first)
    for step in range(40):
        scheduled = scheduler.schedule()
        scheduler.computed(scheduled)
        for item in scheduled:
            if item.sample:
                item.request.output_ids.append(next_token(item.request))
        if step == 3:
            for i in (1, 2):
                scheduler.add(make_request(f"p-{i}", first.prompt_ids, 20), first.queue_order)
        if scheduler.preempted:
            break
    assert scheduler.preempted[:1] == ["p-2"]


def test_priority_orders_admission_and_chooses_the_preempted():
    scheduler = RecordingScheduler(config(num_blocks=9, policy="max_utilization", max_batch_size=2))
    low = make_request("low", [1] * 8, 20, priority=1)  # arrives first
    high = make_request("high", [2] * 8, 20, priority=0)
    late = make_request("late", [3] * 4, 2, priority=0)
    for request in (low, high, late):
        scheduler.add(request)
    scheduler.schedule()
    assert [r.request_id for r in scheduler.running] == ["high", "late"]  # lower priority value first
    run(scheduler, [])
    assert scheduler.num_preemptions > 0 and set(scheduler.preempted) == {"low"}  # never the higher priority
    for request in (low, high, late):
        assert request.output_ids == reference_output(request.prompt_ids, request.params.max_tokens)


def test_a_higher_priority_request_admitted_later_preempts_one_not_yet_in_the_step():
    """low runs first; high arrives later and is admitted beside it; when the pool fills, low (not scheduled yet
    in that step, as decodes go in priority order) is the one preempted, and no KV slot is written twice."""
    # 9 usable blocks of 4: in lockstep, both need their fifth block at position 16 with one block free
    scheduler = RecordingScheduler(config(num_blocks=10, policy="max_utilization", max_batch_size=2))
    low, high = make_request("low", [1] * 8, 20, priority=1), make_request("high", [2] * 8, 20, priority=0)
    scheduler.add(low)
    scheduler.schedule()
    scheduler.add(high)
    run(scheduler, [])
    assert scheduler.num_preemptions > 0 and set(scheduler.preempted) == {"low"}
    for request in (low, high):
        assert request.output_ids == reference_output(request.prompt_ids, 20)


def test_a_higher_priority_arrival_is_not_held_behind_a_running_prompt():
    scheduler = Scheduler(config(max_num_tokens=8))
    low, high = make_request("low", [1] * 40, 4, priority=5), make_request("high", [2] * 6, 4, priority=0)
    scheduler.add(low)
    steps = [scheduler.schedule()]
    scheduler.computed(steps[0])
    scheduler.add(high)
    steps.append(scheduler.schedule())
    assert [(s.request.request_id, s.num_tokens) for s in steps[1]] == [("high", 6), ("low", 2)]
    scheduler.computed(steps[1])
    for item in steps[1]:
        if item.chunk.num_logits:
            item.request.output_ids.append(next_token(item.request))
    run(scheduler, [])
    for request in (low, high):
        assert request.output_ids == reference_output(request.prompt_ids, 4)


@pytest.mark.parametrize("short_of", ["slot", "blocks"])
def test_a_waiting_request_preempts_lower_priority_running_ones_under_max_utilization(short_of):
    """A high-priority arrival short of a batch slot or of KV blocks preempts the lower-priority running requests,
    the newest first, until it fits (as vLLM's priority policy)."""
    # blocks: 10 usable blocks of 4; after a step old holds 4 and new 5 (its prompt), high needs 3
    scheduler = RecordingScheduler(config(num_blocks=65 if short_of == "slot" else 11, policy="max_utilization",
                                          max_batch_size=2 if short_of == "slot" else 6))
    old, new = make_request("old", [1] * 15, 6, priority=1), make_request("new", [2] * 19, 20, priority=1)
    for request in (old, new):
        scheduler.add(request)
    step(scheduler)
    high = make_request("high", [3] * 10, 3, priority=0)
    scheduler.add(high)
    step(scheduler)
    assert scheduler.preempted == ["new"]  # the newest of the lower priority, and only as many as needed
    assert scheduler.running == [old, high]
    run(scheduler, [])
    for request in (old, new, high):
        assert request.output_ids == reference_output(request.prompt_ids, request.params.max_tokens)


def test_no_running_request_is_preempted_for_a_waiting_one_that_would_not_fit_anyway():
    """Blocks held by a higher-priority request keep the waiting one out even with every lower one preempted: those
    keep running rather than lose their work for nothing."""
    scheduler = RecordingScheduler(config(num_blocks=11, policy="max_utilization", max_num_tokens=64))
    top = make_request("top", [1] * 23, 8, priority=0)  # 6 of the 10 usable blocks, the next token's room too
    lows = [make_request("low1", [2] * 7, 8, priority=2), make_request("low2", [3] * 3, 8, priority=2)]  # 2 + 1
    for request in (top, *lows):
        scheduler.add(request)
    step(scheduler)
    scheduler.add(make_request("mid", [4] * 32, 2, priority=1))  # 8 blocks: 1 free + 3 of the low ones is not enough
    step(scheduler)
    assert scheduler.preempted == [] and scheduler.running == [top, *lows]
    run(scheduler, [])
    for request in (top, *lows):
        assert request.output_ids == reference_output(request.prompt_ids, 8)


def test_blocks_a_waiting_request_would_reuse_from_its_victim_are_not_counted_twice():
    """The waiting request shares the lower one's cached prompt prefix: preempting it frees those blocks only for the
    waiting request to take them back, so they make no room; with too little room, nothing is preempted."""
    scheduler = RecordingScheduler(config(num_blocks=11, policy="max_utilization", max_num_tokens=64))
    top = make_request("top", [7] * 19, 8, priority=0)  # 5 of the 10 usable blocks
    prefix = list(range(100, 116))  # 4 full blocks
    low = make_request("low", prefix, 8, priority=1)
    for request in (top, low):
        scheduler.add(request)
    step(scheduler)
    scheduler.add(make_request("high", prefix + [1] * 8, 2, priority=0))  # 6 blocks: 4 of them low's prefix
    step(scheduler)
    assert scheduler.preempted == [] and scheduler.running == [top, low]


def test_guaranteed_no_evict_keeps_running_requests_whatever_the_waiting_priority():
    scheduler = RecordingScheduler(config(max_batch_size=2))
    low = [make_request(f"low{i}", [1 + i] * 5, 8, priority=1) for i in range(2)]
    for request in low:
        scheduler.add(request)
    step(scheduler)
    high = make_request("high", [3] * 5, 2, priority=0)
    scheduler.add(high)
    step(scheduler)
    assert scheduler.running == low and scheduler.preempted == []
    run(scheduler, [])
    assert high.output_ids == reference_output(high.prompt_ids, 2) and scheduler.preempted == []


def test_equal_priority_never_preempts_to_admit():
    scheduler = RecordingScheduler(config(max_batch_size=1, policy="max_utilization"))
    first, second = make_request("first", [1] * 5, 4), make_request("second", [2] * 5, 4)
    scheduler.add(first)
    step(scheduler)
    scheduler.add(second)
    step(scheduler)
    assert scheduler.running == [first] and scheduler.preempted == []
    run(scheduler, [])
    assert first.output_ids == reference_output(first.prompt_ids, 4) and scheduler.preempted == []


@pytest.mark.parametrize("reservation", ["paged", "contiguous"])
def test_contiguous_reservation_holds_max_seq_len_per_request(reservation):
    # 32 usable blocks of 4 tokens; max_seq_len 32 = 8 blocks: a contiguous reservation admits at most 4
    scheduler = Scheduler(config(num_blocks=33, max_seq_len=32, max_batch_size=16, max_num_tokens=64,
                                 kv_reservation=reservation))
    requests = [make_request(f"r{i}", [i + 1] * 6, 4) for i in range(12)]  # 10 tokens = 3 blocks each
    steps = run(scheduler, requests)
    peak = max(len({item.request.request_id for item in step}) for step in steps)
    assert peak == (4 if reservation == "contiguous" else 10)  # paged: 32 // 3 blocks
    for request in requests:
        assert request.output_ids == reference_output(request.prompt_ids, 4)
    assert scheduler.blocks.num_used == 0


def test_prefix_blocks_are_reused_and_only_new_tokens_scheduled():
    scheduler = Scheduler(config(num_blocks=40, max_num_tokens=64))
    prefix = list(range(100, 124))  # 6 full blocks
    first = make_request("a", prefix + [1, 2], 3)
    run(scheduler, [first])
    second = make_request("b", prefix + [5, 6, 7], 3)
    scheduler.add(second)
    scheduled = scheduler.schedule()
    assert scheduled[0].chunk.start_pos == 24 and scheduled[0].chunk.token_ids == [5, 6, 7]
    assert scheduler.blocks.prefix_hits == 6
    assert second.blocks[:6] == first_blocks(scheduler, prefix)


def first_blocks(scheduler: Scheduler, prefix: list[int]) -> list[int]:
    return scheduler.blocks.cached_prefix(prefix + [0])


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler = Scheduler(config())
    prompt = list(range(1, 17))  # exactly 4 blocks
    run(scheduler, [make_request("a", prompt, 2)])
    again = make_request("b", prompt, 2)
    scheduler.add(again)
    scheduled = scheduler.schedule()
    assert scheduled[0].chunk.start_pos == 12 and scheduled[0].chunk.token_ids == prompt[12:]


def test_block_manager_refcounts_and_lru_eviction():
    manager = BlockManager(num_blocks=5, block_size=2)  # 4 usable
    a = manager.allocate(2)
    manager.register_full(a, [1, 2, 3, 4], 0, 4)
    shared = manager.take_cached(manager.cached_prefix([1, 2, 3, 4, 9]))
    assert shared == a and manager.num_used == 2
    manager.free(a)
    assert manager.num_used == 2  # still held by the second owner
    manager.free(shared)
    assert manager.num_used == 0 and manager.counters().cached == 2
    manager.allocate(3)  # two empty blocks, then the least recently freed cached one: the prefix's tail
    assert manager.evictions == 1
    assert manager.cached_prefix([1, 2, 3, 4, 9]) == a[:1]
    with pytest.raises(CapacityError, match="KV cache full"):
        manager.allocate(2)


def test_requests_that_can_never_fit_are_refused_at_admission():
    scheduler = Scheduler(config(num_blocks=9, max_seq_len=100))
    with pytest.raises(CapacityError, match="kv_cache_memory"):
        scheduler.add(make_request("big", [1] * 30, 10))  # 10 blocks > 8
    with pytest.raises(CapacityError, match="max_seq_len"):
        scheduler.add(make_request("long", [1] * 90, 20))
    assert not scheduler.has_work


def test_config_is_validated():
    with pytest.raises(RequestError, match="capacity policy"):
        config(policy="fastest")
    with pytest.raises(RequestError, match="max_batch_size"):
        config(max_batch_size=0)
    with pytest.raises(RequestError, match="unknown KV reservation"):
        config(kv_reservation="static")



def test_block_counters_are_one_snapshot_while_the_loop_moves_blocks():
    """Another thread reads the counters while the batch loop allocates: each read of the free list may see a
    different length, yet a snapshot always has used + free = total."""
    class Shrinking(list):  # each len() sees one block fewer, as if the loop took one in between
        def __len__(self) -> int:
            self.seen = getattr(self, "seen", 0) + 1
            return max(0, super().__len__() - self.seen)

    manager = BlockManager(num_blocks=9, block_size=2)
    manager._empty = Shrinking(manager._empty)
    for _ in range(3):
        c = manager.counters()
        assert c.used + c.free == c.total == 8
