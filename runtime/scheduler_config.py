"""What the scheduler is given: the pool, the engine limits, the capacity policy and the KV reservation
(runtime/scheduler.py has what each means)."""

from __future__ import annotations

from dataclasses import dataclass

from camshaft.checks import check_positive_ints
from camshaft.errors import CapacityError, RequestError
from camshaft.runtime.prompt_lookup import PromptLookup, check_prompt_lookup

POLICIES = ("guaranteed_no_evict", "max_utilization")
RESERVATIONS = ("paged", "contiguous")


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    policy: str = "guaranteed_no_evict"
    kv_reservation: str = "paged"
    prompt_lookup: PromptLookup | None = None  # decodes also feed drafts (runtime/prompt_lookup.py)

    def __post_init__(self) -> None:
        check_positive_ints(self, ("num_blocks", "block_size", "max_batch_size", "max_num_tokens", "max_seq_len"),
                            RequestError)
        if self.policy not in POLICIES:
            raise RequestError(f"unknown capacity policy {self.policy!r}; use one of {POLICIES}")
        if self.kv_reservation not in RESERVATIONS:
            raise RequestError(f"unknown KV reservation {self.kv_reservation!r}; use one of {RESERVATIONS}")
        check_prompt_lookup(self.prompt_lookup)
        if self.num_blocks < 2:
            raise CapacityError(f"a KV pool needs at least 2 blocks (one is the null block), got {self.num_blocks}")
