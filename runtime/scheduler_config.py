"""What the scheduler is given: the pool, the engine limits, the capacity policy and the KV reservation
(runtime/scheduler.py has what each means)."""

from __future__ import annotations

from dataclasses import dataclass

from camshaft.checks import check_positive_ints
from camshaft.errors import CapacityError, RequestError
from camshaft.model_config import RopeConfig
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
    sliding_window: int | None = None  # every layer attends to this many latest tokens: blocks behind are released
    long_rope: RopeConfig | None = None  # an engine switching to LongRoPE's long factors (its requests' K/V differ)

    def __post_init__(self) -> None:
        check_positive_ints(self, ("num_blocks", "block_size", "max_batch_size", "max_num_tokens", "max_seq_len"),
                            RequestError)
        if self.policy not in POLICIES:
            raise RequestError(f"unknown capacity policy {self.policy!r}; use one of {POLICIES}")
        if self.kv_reservation not in RESERVATIONS:
            raise RequestError(f"unknown KV reservation {self.kv_reservation!r}; use one of {RESERVATIONS}")
        check_prompt_lookup(self.prompt_lookup)
        if self.sliding_window is not None:
            check_positive_ints(self, ("sliding_window",), RequestError)
        if self.num_blocks < 2:
            raise CapacityError(f"a KV pool needs at least 2 blocks (one is the null block), got {self.num_blocks}")

    @property
    def window_blocks(self) -> int | None:
        """Blocks one request holds at most when every layer slides: its window (or the last full block, which chains
        the next one's hash) and a step's tokens, whatever its length. None: no window."""
        return self._window_and(self.max_num_tokens)

    @property
    def decode_window_blocks(self) -> int | None:
        """window_blocks for a request past its prompt: its steps are a token and its drafts, not a chunk."""
        return self._window_and(1 + (self.prompt_lookup.num_tokens if self.prompt_lookup is not None else 0))

    def largest_step_fitting(self, blocks: int) -> int:
        """The largest max_num_tokens whose window_blocks fit in `blocks` (0: none does; a sliding model)."""
        return max(0, (blocks - 2) * self.block_size - max(self.sliding_window or 0, self.block_size))

    def fit_advice(self, capacity: int, prompt_tokens: int, total_tokens: int) -> str:
        """What, besides more memory, lets a request of prompt_tokens (total_tokens with max_tokens) fit a pool of
        `capacity` blocks that it does not: each option named is enough on its own."""
        room = capacity * self.block_size  # the tokens of one request the pool holds (paged), window or not
        paged_need = -(-total_tokens // self.block_size)
        if self.sliding_window is not None:  # paged, it holds its window and a step at most
            paged_need = min(paged_need, self._window_and(self.max_num_tokens))
        options = []
        if self.kv_reservation != "paged":
            paged = "use kv_reservation='paged' (a contiguous reservation holds max_seq_len tokens per request)"
            if paged_need <= capacity:
                return f", or {paged}"
            paged += " and "
        else:
            paged = ""
            step = self.largest_step_fitting(capacity) if self.releases_blocks else 0
            if step >= 1:
                options.append(f"lower max_num_tokens to {step} or less (a request holds its sliding window and a "
                               "step)")
        if prompt_tokens < room:
            options.append(f"{paged}lower max_tokens to {room - prompt_tokens} or less")
        elif room >= 2:
            options.append(f"{paged}keep prompt + max_tokens within {room} tokens (the prompt alone takes them all)")
        return "".join(f", or {option}" for option in options)

    def _window_and(self, step_tokens: int) -> int | None:
        if self.sliding_window is None:
            return None
        return -(-(max(self.sliding_window, self.block_size) + step_tokens) // self.block_size) + 2

    @property
    def full_length_blocks(self) -> int:
        """Blocks one request of max_seq_len tokens holds at most (its sliding window, where it releases the rest)."""
        whole = -(-self.max_seq_len // self.block_size)
        return min(whole, self.window_blocks) if self.releases_blocks else whole

    @property
    def releases_blocks(self) -> bool:
        """Every layer slides and blocks are paged: a request gives back the blocks its window has passed and takes
        blocks for its next chunk only, as it goes (under guaranteed_no_evict the pool holds back what each running
        one may still take, at most window_blocks in all, so none is ever preempted)."""
        return self.sliding_window is not None and self.kv_reservation == "paged"

    def cache_salt(self, longest_pass: int) -> bytes:
        """What starts the prefix-cache hash chain of a request fed at most `longest_pass` tokens: its cached blocks
        are reused only by requests whose keys rotate alike (LongRoPE's long factors or its short ones)."""
        return b"long rope" if self.long_rope is not None and self.long_rope.long_rope_from(longest_pass) == 0 else b""

    def blocks_behind(self, position: int) -> int:
        """Block-table entries no query at `position` or later reads (wholly before the sliding window); the last
        full block stays, as the next block's hash chains to it."""
        return max(0, min((position - self.sliding_window + 1) // self.block_size, position // self.block_size - 1))
