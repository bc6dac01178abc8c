"""In-flight batching: which tokens of which requests the next engine step computes.

One rule per step: every running request advances its computed tokens toward its total (prompt + output so
far) under a token budget and a batch limit. Decodes (one token to go) come first so a long prompt, fed in
chunks with whatever budget is left, never stalls them; waiting requests are admitted by priority (lower first),
then first come, first served, while KV blocks allow. Under max_utilization a full pool preempts the lowest-priority,
newest running request, and a waiting request short of blocks or a batch slot preempts running requests of lower
priority. The scheduler owns the block manager.

`kv_reservation`: "paged" takes blocks as a request grows; "contiguous" reserves max_seq_len tokens of blocks per
request at admission, as a cache with one contiguous region per request would (the memory benchmark's baseline).
When every layer of the model slides, paged requests give back the blocks their window has passed (null entries
in their tables) and take blocks for a chunk at a time (SchedulerConfig.releases_blocks); guaranteed_no_evict then
holds back the blocks each running request may still take (block_claims.py), so its growth never preempts.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter
from dataclasses import dataclass

from camshaft.errors import CapacityError
from camshaft.runtime.batch import Chunk
from camshaft.runtime.block_claims import BlockClaims
from camshaft.runtime.block_manager import BlockManager
from camshaft.runtime.kv_cache import NULL_BLOCK
from camshaft.runtime.request import Request
from camshaft.runtime.scheduler_config import SchedulerConfig


@dataclass(frozen=True)
class Scheduled:
    request: Request
    chunk: Chunk
    decode: bool = False  # the one token after the last output token; anything else is prompt (or recompute) work
    sample: bool = True  # the chunk ends the sequence: its last logits row is sampled
    drafts: tuple[int, ...] = ()  # fed after the decode token; every row sampled in turn (prompt lookup)

    @property
    def num_tokens(self) -> int:
        return len(self.chunk.token_ids)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.waiting: list[Request] = []  # sorted by queue_key
        self.running: list[Request] = []
        self.claims = BlockClaims(config, self.blocks, self.running)
        self.num_preemptions = 0
        self._arrivals = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request, queue_order: int | None = None) -> None:
        """Queue a request; `queue_order`: its place among equal priorities (an n > 1 sibling takes its first
        sequence's), default after everything queued so far."""
        self.check(request)
        request.queue_order = next(self._arrivals) if queue_order is None else queue_order
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=queue_key)

    def check(self, request: Request) -> None:
        """Refuse a request that could never fit the engine or the KV pool, rather than leave it waiting forever."""
        total = len(request.prompt_ids) + request.params.max_tokens
        limit = self.config.max_seq_len
        if total > limit:
            raise CapacityError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.params.max_tokens}) "
                                f"exceeds the engine's max_seq_len ({limit}); lower max_tokens or shorten the prompt",
                                field="prompt")
        need = self.claims.total(request)
        if self.config.releases_blocks:  # it never holds more than its window's blocks
            need = min(need, self.config.window_blocks)
        if need > self.blocks.capacity:
            fix = self.config.fit_advice(self.blocks.capacity, len(request.prompt_ids), request.max_length)
            raise CapacityError(f"the request needs {need} KV blocks but the pool holds {self.blocks.capacity}; "
                                f"give the engine a larger kv_cache_memory{fix}", field="prompt")

    def schedule(self) -> list[Scheduled]:
        budget = self.config.max_num_tokens
        scheduled: list[Scheduled] = []
        self._preempt_for_priority()
        preemptions_before = self.num_preemptions
        decodes = sorted((r for r in self.running if r.num_tokens - r.num_computed == 1), key=queue_key)
        # drafts only in a step of decodes alone: beside a prompt chunk they would be padded to its length
        lookup = self.config.prompt_lookup
        drafting = lookup is not None and not self.waiting and len(decodes) == len(self.running) <= lookup.max_running
        taken: list[Request] = []
        for request in decodes:
            # in priority order; a preemption never takes a request scheduled already (siblings tie in order)
            if len(taken) < budget and request in self.running and self._grow(request, 1, taken):
                taken.append(request)
        budget -= len(taken)
        for request in taken:  # drafts after every decode has its token's room: they take only what is left
            drafts = self._drafts(request, budget) if drafting and request.output_ids else []  # not a prompt's tail
            scheduled.append(self._chunk(request, 1) if not drafts else self._drafted(request, drafts))
            budget -= len(drafts)
        admit = self.num_preemptions == preemptions_before  # after a preemption, admitting would only thrash
        prefills = sorted((r for r in self.running if r.num_tokens - r.num_computed > 1), key=queue_key)
        for request in prefills:  # a waiting request of higher priority takes the budget before a running prompt
            if request not in self.running:  # preempted by an earlier prompt's growth in this step
                continue
            admit = admit and self.num_preemptions == preemptions_before
            if admit:
                budget = self._admit_waiting(scheduled, budget, before=queue_key(request))
            take = min(request.num_tokens - request.num_computed, budget)
            # only a sliding window's prompt grows here (it holds its next chunk's blocks, not the whole prompt's)
            if take and self._grow(request, take, [item.request for item in scheduled]):
                scheduled.append(self._chunk(request, take))
                budget -= take
        if admit and self.num_preemptions == preemptions_before:  # a prompt's growth may have preempted
            self._admit_waiting(scheduled, budget)
        return scheduled

    def _admit_waiting(self, scheduled: list[Scheduled], budget: int, before: tuple[int, int] | None = None) -> int:
        """Admit waiting requests in queue order (those ahead of `before` only) while budget, batch and blocks
        allow; returns the budget left."""
        while budget and self.waiting and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            if (before is not None and queue_key(request) >= before) or not self._admit(request):
                break
            self.running.append(self.waiting.pop(0))
            if request.admitted_at is None:
                request.admitted_at = time.perf_counter()
            scheduled.append(self._chunk(request, min(request.num_tokens - request.num_computed, budget)))
            budget -= len(scheduled[-1].chunk.token_ids)
        return budget

    def _preempt_for_priority(self) -> None:
        """max_utilization: the first waiting request, short of a batch slot or of blocks, preempts running
        requests of a lower priority (a higher value), the newest first, until it fits (as vLLM's priority policy);
        none when all of theirs would not make room."""
        if self.config.policy != "max_utilization" or not self.waiting:
            return
        request = self.waiting[0]
        lower = [r for r in self.running if r.priority > request.priority]
        if not lower:
            return
        reused, wanted, _ = self.claims.admission(request)  # preempting keeps the cached prefix cached
        if not self._room_after(lower, reused, wanted):
            return
        while lower and not (len(self.running) < self.config.max_batch_size
                             and self.blocks.fits(wanted - len(reused), reused)):
            self.preempt(max(reversed(lower), key=queue_key))
            lower = [r for r in self.running if r.priority > request.priority]

    def _room_after(self, others: list[Request], reused: list[int], wanted: int) -> bool:
        """Whether `wanted` blocks, `reused` of them cached, would fit once `others` were preempted (their blocks no
        one else holds freed; an idle reused block is taken back, not room)."""
        holders = Counter(block for other in others for block in other.blocks if block != NULL_BLOCK)
        freed = sum(1 for block, n in holders.items() if self.blocks.blocks[block].ref_count == n)
        idle = sum(1 for block in reused if self.blocks.blocks[block].ref_count == holders.get(block, 0))
        return wanted - len(reused) + idle <= self.blocks.num_free + freed

    def _chunk(self, request: Request, take: int) -> Scheduled:
        start = request.num_computed
        done = start + take == request.num_tokens
        if done and take == 1:  # no need to copy the whole sequence
            tokens = [request.output_ids[-1] if request.output_ids else request.prompt_ids[-1]]
        else:
            tokens = request.all_ids[start: start + take]
        rows = take if request.wants_prompt_rows else int(done)  # prompt log-probs want every row
        return Scheduled(request, Chunk(tokens, start, request.blocks, rows, request.longest_pass),
                         decode=done and take == 1 and bool(request.output_ids), sample=done)

    def _drafts(self, request: Request, room: int) -> list[int]:
        """Prompt lookup's drafts for a decode, within `room` more tokens of the step's budget and the blocks it
        holds or that are free (drafts never preempt); their blocks are taken."""
        if request.wants_prompt_rows:  # a decode of a prompt whose rows are not all recorded yet (it has none)
            return []
        free = self.blocks.num_free - self.claims.held_back(request)  # (another's promised blocks are not free)
        fit = (len(request.blocks) + free) * self.config.block_size - request.num_computed - 1
        limit = min(room, fit, request.params.max_tokens - len(request.output_ids) - 1)
        drafts = self.config.prompt_lookup.propose(request.all_ids, limit) if limit > 0 else []
        more = self.blocks.blocks_for(request.num_computed + 1 + len(drafts)) - len(request.blocks)
        if more > 0:
            request.blocks.extend(self.blocks.allocate(more))
        return drafts

    def _drafted(self, request: Request, drafts: list[int]) -> Scheduled:
        tokens = [request.output_ids[-1], *drafts]
        return Scheduled(request, Chunk(tokens, request.num_computed, request.blocks, len(tokens),
                                        request.longest_pass),
                         decode=True,
                         drafts=tuple(drafts))

    def _admit(self, request: Request) -> bool:
        tokens = request.all_ids
        reused, wanted, skipped = self.claims.admission(request)
        owned = wanted - len(reused) + sum(1 for b in reused if self.blocks.blocks[b].ref_count == 0)
        promised = self.claims.promised(self.claims.total(request) - skipped, owned)
        if not self.blocks.fits(wanted - len(reused) + promised, reused, self.claims.held_back(shared=set(reused))):
            return False
        request.blocks = [NULL_BLOCK] * skipped + self.blocks.take_cached(reused) + self.blocks.allocate(
            wanted - len(reused))
        request.released_blocks = skipped
        cached = skipped + len(reused)
        request.num_computed = cached * self.config.block_size
        request.kv_blocks_reused += len(reused)  # RequestMetrics: the prompt's blocks, as TensorRT-LLM counts them
        if request.first_reused_blocks is None:  # the tokens it did not compute (skipped ones too)
            request.first_reused_blocks = cached
        request.kv_blocks_new += self.blocks.blocks_for(len(tokens)) - cached
        return True

    def _grow(self, request: Request, tokens: int, scheduled: list[Request]) -> bool:
        """Make room for the request's next `tokens` tokens, preempting the lowest-priority, newest running requests
        not in this step yet (`scheduled`) if the pool is full. False if the request itself had to be preempted."""
        while self.blocks.blocks_for(request.num_computed + tokens) > len(request.blocks):
            while self.blocks.num_free == 0:
                taken = {id(r) for r in scheduled}
                # ties (n > 1 siblings share their queue order) go to the newest admitted: running is in that order
                victim = max(reversed([r for r in self.running if id(r) not in taken]), key=queue_key)
                self.preempt(victim)
                if victim is request:
                    return False
            request.blocks.extend(self.blocks.allocate(1))
        return True

    def preempt(self, request: Request) -> None:
        """Free the request's blocks and requeue it in its place (before any later arrival of its priority); it
        recomputes prompt + output when readmitted."""
        self.running.remove(request)
        self.blocks.free(request.blocks)
        request.blocks, request.released_blocks = [], 0
        request.num_computed = 0
        self._enqueue(request)
        self.num_preemptions += 1

    def computed(self, scheduled: list[Scheduled]) -> None:
        """The engine step ran: advance each request's computed tokens and hash the blocks that became full (a
        drafting decode advances once its rows are sampled: `advance`)."""
        for item in scheduled:
            if not item.drafts:
                self.advance(item.request, item.num_tokens)

    def advance(self, request: Request, tokens: int) -> None:
        """`tokens` more of the request's tokens are in the cache (a drafting decode: its token and the drafts taken;
        the rest are written again by a later step)."""
        before = request.num_computed
        request.num_computed += tokens
        if before // self.config.block_size != request.num_computed // self.config.block_size:
            self.blocks.register_full(request.blocks, request.all_ids, before, request.num_computed,
                                      self.config.cache_salt(request.longest_pass))
        self.claims.slide(request)

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's blocks at once (a waiting request just leaves the queue)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.blocks)
        request.blocks, request.released_blocks = [], 0


def queue_key(request: Request) -> tuple[int, int]:
    return request.priority, request.queue_order
