"""What each request claims of the KV pool, for the scheduler that owns it: the blocks it holds from admission (a
cached prefix reused; a window's worth where every layer slides), the blocks guaranteed_no_evict holds back for the
running requests' growth, and the blocks a sliding window has passed, given back."""

from __future__ import annotations

from collections.abc import Container

from camshaft.runtime.block_manager import BlockManager
from camshaft.runtime.request import Request
from camshaft.runtime.scheduler_config import SchedulerConfig


class BlockClaims:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, running: list[Request]) -> None:
        self.config, self.blocks, self.running = config, blocks, running  # the scheduler's, shared

    def total(self, request: Request) -> int:
        """Blocks a request holds at its longest: prompt + max_tokens (a contiguous reservation: max_seq_len)."""
        if self.config.kv_reservation == "contiguous":
            return self.blocks.blocks_for(self.config.max_seq_len)
        return self.blocks.blocks_for(request.max_length)

    def admission(self, request: Request) -> tuple[list[int], int, int]:
        """The cached blocks a request would take, the blocks it holds at admission (those included), and the
        cached blocks before them that a sliding window will not read (null entries of its table)."""
        skipped, reused = 0, []
        if request.wants_prompt_rows:  # no reuse: the prompt's rows have no logits cached
            pass
        elif self.config.releases_blocks:
            skipped, reused = self.blocks.cached_window(request.all_ids, self.config.blocks_behind,
                                                        self.config.cache_salt(request.longest_pass))
        else:
            reused = self.blocks.cached_prefix(request.all_ids, self.config.cache_salt(request.longest_pass))
        if not self.config.releases_blocks:
            if self.config.policy == "guaranteed_no_evict" or self.config.kv_reservation == "contiguous":
                return reused, self.total(request), 0
            return reused, self.blocks.blocks_for(request.num_tokens), 0
        ahead = min(request.num_tokens, (skipped + len(reused)) * self.config.block_size + self.config.max_num_tokens)
        return reused, self.blocks.blocks_for(ahead) - skipped, skipped

    def promised(self, entries_left: int, owned: int, decoding: bool = False) -> int:
        """guaranteed_no_evict with a window: the blocks a request may still take beyond the `owned` ones it alone
        holds, with `entries_left` table entries it has not passed (`decoding`: past its prompt, it holds less); the
        pool holds them back so its growth never preempts (a block it shares frees nothing when it passes it)."""
        if self.config.policy != "guaranteed_no_evict" or not self.config.releases_blocks:
            return 0
        most = self.config.decode_window_blocks if decoding else self.config.window_blocks
        return max(0, min(entries_left, most) - owned)

    def held_back(self, request: Request | None = None, shared: Container[int] = frozenset()) -> int:
        """Free blocks promised to the running requests (but `request`); `shared`: blocks about to be shared too."""
        if self.config.policy != "guaranteed_no_evict" or not self.config.releases_blocks:
            return 0
        return sum(self.promised(self.total(r) - r.released_blocks, sum(
            1 for b in r.blocks[r.released_blocks:] if self.blocks.blocks[b].ref_count == 1 and b not in shared),
            r.num_tokens - r.num_computed <= 1) for r in self.running if r is not request)

    def slide(self, request: Request) -> None:
        """Release the request's blocks that its sliding window has passed (paged reservation only)."""
        if not self.config.releases_blocks:
            return
        behind = self.config.blocks_behind(request.num_computed)
        if behind > request.released_blocks:
            self.blocks.release(request.blocks, request.released_blocks, behind)
            request.released_blocks = behind
