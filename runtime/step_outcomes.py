"""What one engine step's logits give each scheduled request: its prompt log-prob rows, then its drafted tokens or
its one sampled token. A request whose rows cannot be read gets its error; the others go on."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from camshaft.runtime.request import Request
from camshaft.runtime.sampler import SampleResult, sample_batch
from camshaft.runtime.scheduler import Scheduled

log = logging.getLogger(__name__)


@dataclass
class StepOutcome:
    request: Request
    delta: str = ""
    samples: list[SampleResult] = field(default_factory=list)  # drafted steps: the drafts taken and the decode token
    error: Exception | None = None
    drafted: int = 0  # prompt lookup's drafts fed this step, and those equal to the token sampled in their place
    accepted: int = 0


def read_step(scheduled: list[Scheduled], logits: np.ndarray) -> list[StepOutcome]:
    """Each chunk's logits rows in order: prompt rows (prompt_logprobs), then its sampled row or drafted rows."""
    outcomes, sampled, rows, at = [], [], [], 0
    for item in scheduled:
        count, request = item.chunk.num_logits, item.request
        at += count
        stage = "recording prompt log-probs"
        try:
            if count > int(item.sample):
                request.add_prompt_rows(logits[at - count: at - int(item.sample)], item.chunk.start_pos)
            if item.drafts:
                stage, accepted = "sampling its drafts", request.accepted_draft_tokens
                deltas, taken = request.add_drafted(logits[at - count: at], item.drafts)
                outcomes.append(StepOutcome(request, "".join(deltas), taken, drafted=len(item.drafts),
                                            accepted=request.accepted_draft_tokens - accepted))
            elif item.sample:
                sampled.append(request)
                rows.append(at - 1)
        except Exception as exc:
            outcomes.append(_failed(request, exc, stage))
    results = sample_batch([r.sampler for r in sampled], logits if len(rows) == at else logits[rows])
    for request, sample in zip(sampled, results, strict=True):
        if isinstance(sample, Exception):  # this request's parameters cannot be sampled
            outcomes.append(_failed(request, sample, "sampling"))
            continue
        try:
            outcomes.append(StepOutcome(request, request.add_sample(sample), [sample]))
        except Exception as exc:
            outcomes.append(_failed(request, exc, "after sampling"))
    return outcomes


def _failed(request: Request, error: Exception, stage: str) -> StepOutcome:
    log.error("request %s failed %s; it ends with the error", request.request_id, stage, exc_info=error)
    return StepOutcome(request, error=error)
