"""One sequence at a time through the batch graph (engines without a sequence graph), behind the Session's calls
of runtime/sequence.py's SequenceEngine."""

from __future__ import annotations

import numpy as np

from camshaft.runtime.batch import Chunk
from camshaft.runtime.engine import Engine
from camshaft.runtime.sequence import MAX_ROWS, over_budget


class BatchGraphSequence:
    """One sequence at a time through the batch graph and its paged pool (engines without a sequence graph)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.manifest, self.tokenizer, self.eos_token_ids = engine.manifest, engine.tokenizer, engine.eos_token_ids
        self.blocks: list[int] = []
        self.longest_pass = 0

    @property
    def limits(self):
        return self.engine.limits

    @property
    def huge_page_bytes(self) -> int:
        return self.engine.backend.huge_page_bytes

    @property
    def token_budget(self) -> int:
        return self.engine.token_budget

    def check_fits(self, total: int) -> None:
        pool, block = self.engine.pool, self.engine.block_size
        if -(-total // block) > pool.capacity:
            raise over_budget(total, pool.capacity * block, f"{pool.capacity} blocks of {block} tokens")

    def start(self, total: int, longest_pass: int | None = None) -> None:
        self.check_fits(total)
        self.blocks = self.engine.pool.allocate(-(-total // self.engine.block_size))
        self.longest_pass = total if longest_pass is None else longest_pass

    max_rows = MAX_ROWS

    def feed(self, tokens: list[int], start: int, copy: bool = True, last: bool = True) -> np.ndarray | None:
        """As SequenceEngine.feed; a chunk that is not the prompt's `last` asks the graph for no logits (None)."""
        logits = self.engine.step([Chunk(tokens, start, self.blocks, int(last), self.longest_pass)])
        return logits[0] if last else None

    def feed_rows(self, tokens: list[int], start: int, rows: int) -> np.ndarray:
        """As SequenceEngine.feed_rows (the paged cache's positions from `start` on are written again)."""
        return self.engine.step([Chunk(tokens, start, self.blocks, rows, self.longest_pass)])

    def screen(self, greedy: bool) -> None:
        """The batch graph has no shortcut: its logits are whole."""

    def finish(self) -> None:
        self.engine.pool.free(self.blocks)
        self.blocks = []

    def close(self) -> None:
        self.engine.close()
