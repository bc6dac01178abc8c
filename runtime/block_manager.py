"""Paged KV blocks with reference counts and prefix reuse.

A block that a request has filled is hashed by its tokens chained with the hash of the block before it, so equal
hashes mean equal prefixes. When its last owner lets go, a hashed block stays cached (evictable, least recently
used first) until its slot is needed; a new request whose tokens start with cached blocks takes them instead of
computing them again.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from camshaft.errors import CapacityError
from camshaft.runtime.kv_cache import NULL_BLOCK


def chain_hash(prefix_hash: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(prefix_hash + np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


@dataclass(frozen=True)
class BlockCounters:
    total: int
    used: int
    free: int  # never used plus cached-but-unreferenced (evictable)
    cached: int
    prefix_hits: int
    evictions: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise CapacityError(f"a KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._empty = list(range(num_blocks - 1, NULL_BLOCK, -1))  # never hashed, popped from the end
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed, unreferenced; oldest first
        self._by_hash: dict[bytes, int] = {}
        self.prefix_hits = 0
        self.evictions = 0

    @property
    def capacity(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def counters(self) -> BlockCounters:
        """A snapshot other threads may take while the batch loop runs: free is read once, so used + free = total."""
        free = self.num_free
        return BlockCounters(self.capacity, self.capacity - free, free, len(self._by_hash), self.prefix_hits,
                             self.evictions)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_blocks(self, token_ids: list[int], salt: bytes) -> Iterator[int | None]:
        """The cached block of each full block of token_ids in turn (None where it is not cached), leaving at least
        the last token to compute (its logits are needed). `salt` starts the chain: blocks computed otherwise
        (LongRoPE's long factors) are cached apart."""
        prefix_hash, size = salt, self.block_size
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            prefix_hash = chain_hash(prefix_hash, token_ids[start: start + size])
            yield self._by_hash.get(prefix_hash)

    def cached_prefix(self, token_ids: list[int], salt: bytes = b"") -> list[int]:
        """Cached blocks holding the longest run of full blocks that token_ids starts with."""
        return list(itertools.takewhile(lambda block: block is not None, self._cached_blocks(token_ids, salt)))

    def cached_window(self, token_ids: list[int], behind: Callable[[int], int],
                      salt: bytes = b"") -> tuple[int, list[int]]:
        """As cached_prefix for a sliding window: the longest run of full blocks whose last ones, from
        `behind(tokens)` on, are cached (the window never reads those before). Returns (skipped, their blocks)."""
        size, found = self.block_size, list(self._cached_blocks(token_ids, salt))
        run = 0  # cached blocks ending at each index, in a row
        runs = []
        for block_id in found:
            run = run + 1 if block_id is not None else 0
            runs.append(run)
        for count in range(len(found), 0, -1):
            skipped = behind(count * size)
            if runs[count - 1] >= count - skipped:
                return skipped, found[skipped:count]
        return 0, []

    def fits(self, new_blocks: int, reused: list[int], held_back: int = 0) -> bool:
        """Whether `new_blocks` and the idle ones of `reused` fit the free blocks, `held_back` of them promised."""
        idle_reused = sum(1 for b in reused if self.blocks[b].ref_count == 0)
        return new_blocks + idle_reused <= self.num_free - held_back

    def take_cached(self, reused: list[int]) -> list[int]:
        for block_id in reused:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
        self.prefix_hits += len(reused)
        return list(reused)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise CapacityError(f"KV cache full: {count} blocks wanted, {self.num_free} free")
        taken = []
        for _ in range(count):
            if self._empty:
                block_id = self._empty.pop()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                del self._by_hash[self.blocks[block_id].hash]
                self.blocks[block_id].hash = None
                self.evictions += 1
            self.blocks[block_id].ref_count = 1
            taken.append(block_id)
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; the last owner's release makes it free (or cached, if hashed).
        Tail blocks go first so that a prefix's later blocks are evicted before its earlier ones; a table's null
        entries (released) are skipped."""
        for block_id in reversed(block_ids):
            if block_id == NULL_BLOCK:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if self._registered(block):
                    self._evictable[block_id] = None
                else:
                    block.hash = None
                    self._empty.append(block_id)

    def release(self, block_table: list[int], start: int, stop: int) -> None:
        """Free the table's entries start..stop-1 (a sliding window has passed them); they become the null block."""
        self.free(block_table[start:stop])
        block_table[start:stop] = [NULL_BLOCK] * (stop - start)

    def register_full(self, block_table: list[int], token_ids: list[int], before: int, after: int,
                      salt: bytes = b"") -> None:
        """Hash the blocks that became full when the computed tokens went from `before` to `after` (`salt`: as
        cached_prefix's)."""
        size = self.block_size
        first, last = before // size, after // size
        if first == last:
            return
        prefix_hash = self.blocks[block_table[first - 1]].hash if first else salt
        for index in range(first, last):
            prefix_hash = chain_hash(prefix_hash, token_ids[index * size: (index + 1) * size])
            block = self.blocks[block_table[index]]
            block.hash = prefix_hash  # a duplicate of a cached block keeps its hash for the chain, unregistered
            self._by_hash.setdefault(prefix_hash, block.block_id)

    def _registered(self, block: Block) -> bool:
        return block.hash is not None and self._by_hash.get(block.hash) == block.block_id
