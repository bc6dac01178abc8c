"""A Session's decode with prompt lookup: each new token fed with drafts copied from the prompt and output."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager

import numpy as np

from camshaft.runtime.outputs import GenerationResult
from camshaft.runtime.prompt_lookup import PromptLookup
from camshaft.runtime.request import Request


def decode_with_drafts(engine, lookup: PromptLookup, request: Request, logits: np.ndarray,
                       step: Callable[[], AbstractContextManager], check_open: Callable[[], None],
                       ) -> Generator[str, None, GenerationResult]:
    """Decode feeding each new token with prompt lookup's drafts (request.add_drafted samples them); the cache past
    the drafts taken is written again by the next step. `step`: the Session's guard around an engine call."""
    rows, drafts, fed_at = logits[None], [], request.num_computed - 1
    context = np.empty(len(request.prompt_ids) + request.params.max_tokens, dtype=np.int64)
    context[:len(request.prompt_ids)] = request.prompt_ids
    largest = min(lookup.num_tokens, engine.limits.max_num_tokens - 1)  # a step's token budget
    while True:
        deltas, taken = request.add_drafted(rows, drafts)
        context[request.num_tokens - len(taken): request.num_tokens] = [s.token_id for s in taken]
        for k, delta in enumerate(deltas, 1 - len(deltas)):  # k: 0 for the step's last token
            if delta:
                yield delta
            if k or not request.finished:
                check_open()  # closed while this request ran: it ends at its next token, drafts or not
        if request.finished:
            return request.result()
        request.num_computed = fed_at + len(taken)
        limit = min(largest, request.params.max_tokens - len(request.output_ids) - 1)
        drafts = lookup.propose(context[:request.num_tokens], limit)
        fed_at, tokens = request.num_computed, [request.output_ids[-1], *drafts]
        engine.screen(request.sampler.plain_greedy)
        with step():
            rows = engine.feed_rows(tokens, fed_at, len(tokens))
