"""Prompt lookup decoding: drafts copied from the sequence itself, checked in one step.

Where the last few tokens appeared before (in the prompt or the output so far), the tokens that followed them then
are a cheap guess at what follows now. The Session feeds the new token and up to `num_tokens` such drafts at once (at
batch 1 a step's cost is reading the weights, so a few more tokens cost little: BENCHMARKS.md) and samples each
position in turn with the request's own sampler, keeping drafts while they equal what it sampled. Each position is
sampled exactly as without drafts, from the same logits and the same random stream, so the output is the same
(greedy or seeded; float rounding of a many-token step aside) and only faster where text repeats: summaries, edits,
extraction, code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from camshaft.checks import is_int
from camshaft.errors import RequestError

MAX_DRAFT = 16  # the sequence graph gives logits for a token and at most this many drafts


def check_prompt_lookup(value: object, what: str = "a camshaft.PromptLookup(num_tokens=...)") -> None:
    if value is not None and not isinstance(value, PromptLookup):
        raise RequestError(f"prompt_lookup takes {what}, got {value!r:.60}")


def as_prompt_lookup(value: PromptLookup | int | None) -> PromptLookup | None:
    """Session's and LLM's prompt_lookup: a PromptLookup, its num_tokens, or None (and 0) for none."""
    if is_int(value) and not isinstance(value, bool):
        return PromptLookup(num_tokens=int(value)) if value else None
    check_prompt_lookup(value, "a camshaft.PromptLookup or its num_tokens")
    return value


def checks_drafts(manifest) -> bool:
    """Whether an engine's Session graph can check drafts: engines built before prompt lookup have a sequence graph
    that gives logits for one token a step."""
    return manifest.sequence_graph is None or manifest.sequence_graph.checks_drafts


@dataclass(frozen=True)
class PromptLookup:
    """num_tokens: drafts a step at most; the last max_ngram .. min_ngram tokens are looked for, longest first, at
    their latest earlier place. max_running: in-flight batching drafts only while at most this many requests run (a
    larger batch's step is bound by compute: rejected drafts cost what taken ones save; BENCHMARKS.md)."""

    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    max_running: int = 4

    def __post_init__(self) -> None:
        if not (is_int(self.max_running) and self.max_running >= 1):
            raise RequestError(f"PromptLookup.max_running must be an integer >= 1, got {self.max_running!r:.40}")
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            if not is_int(getattr(self, name)):
                raise RequestError(f"PromptLookup.{name} must be an integer, got {getattr(self, name)!r:.40}")
        for name in ("num_tokens", "max_ngram", "min_ngram", "max_running"):  # numpy's: Python's (JSON, repr)
            object.__setattr__(self, name, int(getattr(self, name)))
        if not 1 <= self.num_tokens <= MAX_DRAFT:
            raise RequestError(f"PromptLookup.num_tokens must be in 1..{MAX_DRAFT}, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram <= 16:
            raise RequestError(f"PromptLookup needs 1 <= min_ngram <= max_ngram <= 16, got min_ngram "
                               f"{self.min_ngram}, max_ngram {self.max_ngram}")

    def propose(self, context: list[int] | np.ndarray, limit: int) -> list[int]:
        """Up to min(num_tokens, limit) tokens that followed the latest earlier occurrence of the context's last
        n tokens (n from max_ngram down to min_ngram); none where there is no such occurrence."""
        size = min(self.num_tokens, limit)
        if size < 1:
            return []
        ids = np.asarray(context, dtype=np.int64)
        ends = np.flatnonzero(ids[:-1] == ids[-1])  # where the last token appeared before, with a token after it
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            hits = ends[ends >= n - 1]
            for back in range(1, n):
                hits = hits[ids[hits - back] == ids[-1 - back]]
            if hits.size:
                whole = hits[hits + 1 + size <= len(ids)]  # the latest with a full draft after it, else the latest
                after = int(whole[-1] if whole.size else hits[-1]) + 1
                return ids[after: after + size].tolist()
        return []
