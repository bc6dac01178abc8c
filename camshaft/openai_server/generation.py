"""One API request's sequences in the batch loop: submitted at once (so refusals become HTTP errors before any
response starts), read as they come, aborted when the client goes away."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator

from camshaft.errors import ServerClosedError
from camshaft.openai_server.metrics import Metrics
from camshaft.runtime.llm import LLM
from camshaft.runtime.outputs import GenerationResult, RequestOutput
from camshaft.runtime.sampling_params import SamplingParams

LOG = logging.getLogger("camshaft.openai_server")


class Generation:
    """Prompt p's output j is choice p * n + j, as OpenAI numbers choices."""

    def __init__(self, llm: LLM, prompts: list[list[int]], params: SamplingParams, metrics: Metrics,
                 arrival: float, priority: int = 0, shows_output: bool = True,
                 loop: asyncio.AbstractEventLoop | None = None, log_id: str = "request",
                 cutting: threading.Event | None = None) -> None:
        """shows_output False: the output is not shown (echo scoring the prompt alone), nor counted. loop: the
        event loop that reads the outputs (given when this is made on another thread). log_id: the request's id in
        the line logged as it ends (finished, aborted, failed). cutting: set once the stopping server ends the
        requests still running (what is aborted then was cut by the server, not by its client)."""
        self.llm, self.metrics, self.arrival, self._counted = llm, metrics, arrival, shows_output
        self.log_id, self._generated, self._first, self._reasons = log_id, 0, None, Counter()
        self._cutting = cutting or threading.Event()
        self._prompt_lengths, self._n = [len(ids) for ids in prompts], params.n
        self.prompt_tokens = sum(self._prompt_lengths)
        self.num_choices = len(prompts) * params.n
        loop = loop or asyncio.get_running_loop()
        self._outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._index: dict[str, int] = {}
        self._unfinished: set[str] = set()  # not yet read to its end
        self._running: set[str] = set()  # not yet ended in the batch loop
        self._pending: list[RequestOutput] | None = []  # made before the request ids were known
        self._lock = threading.Lock()  # what the batch loop's thread and the reader share
        self._last: dict[int, float] = {}
        self._failed = self._errored = False

        def sink(output: RequestOutput) -> None:  # on the batch loop's thread: counted as made, however it is read
            with self._lock:
                if self._pending is None:
                    self._made(output)
                else:
                    self._pending.append(output)
            if not loop.is_closed():  # else the request was aborted with its reader
                loop.call_soon_threadsafe(self._outputs.put_nowait, output)

        # all prompts queued or none: refused (busy, too long), the response is an error and nothing ran
        submitted = llm.submit_batch([(ids, params, sink) for ids in prompts], priority)
        with self._lock:
            for p, request_ids in enumerate(submitted):
                self._unfinished.update(request_ids)
                self._running.update(request_ids)
                self._index.update({rid: p * params.n + j for j, rid in enumerate(request_ids)})
            pending, self._pending = self._pending or [], None
            for output in pending:
                self._made(output)
        metrics.prompt_tokens.inc(self.prompt_tokens)
        LOG.debug("%s: queued %d prompt(s) of %d tokens, %s, priority %d", log_id, len(prompts), self.prompt_tokens,
                  params, priority)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) for every sampled token; each choice's last output is finished."""
        while self._unfinished:
            output = await self._outputs.get()
            if output.finished:
                self._unfinished.discard(output.request_id)
            if output.error is not None:
                self.failed(output.error)  # its siblings end with the request: failed too, not aborted by the client
                raise output.error
            yield self._index[output.request_id], output

    def choice_prompt_tokens(self, index: int) -> int:
        """The prompt tokens of choice `index`'s prompt."""
        return self._prompt_lengths[index // self._n]

    async def results(self) -> list[GenerationResult]:
        """Every choice's final result, in choice order."""
        results: dict[int, GenerationResult] = {}
        async for index, output in self:
            if output.result is not None:
                results[index] = output.result
        return [results[i] for i in range(self.num_choices)]

    def abort(self, count: bool = True) -> None:
        """Stop what still runs (idempotent); the batch loop frees its KV blocks before its next step. count: each
        stopped sequence counts as finished for reason abort (the client's), or error where a sibling failed. What
        the batch loop ended first was counted as it ended, read or not."""
        with self._lock:
            running, self._running = self._running, set()
            if running and not self._failed:
                self._log_aborted("the server stopped" if self._cutting.is_set() else "the client went away")
        for request_id in running:
            self.llm.abort(request_id)
            if count:
                self.metrics.finished.labels(finished_reason="error" if self._failed else "abort").inc()
        self._unfinished.clear()

    def failed(self, error: BaseException) -> None:
        """The request ends with `error` (what is unfinished is aborted next, counted as failed)."""
        if not self._failed:
            self._failed = True
            if isinstance(error, ServerClosedError) and self.llm.executor.failure is None:  # a stop, not a failure
                self._log_aborted("the server stopped")
            else:
                LOG.warning("%s: failed after %s: %s", self.log_id, self._so_far(), error)

    def _log_aborted(self, why: str) -> None:
        LOG.info("%s: aborted (%s) after %s", self.log_id, why, self._so_far())

    def _so_far(self) -> str:
        first = "" if self._first is None else f", first token at {self._first - self.arrival:.3f} s"
        return (f"{time.perf_counter() - self.arrival:.3f} s{first}: {self.prompt_tokens} prompt tokens, "
                f"{self._generated} generated")

    def _made(self, output: RequestOutput) -> None:
        """An output as the batch loop makes it (under the lock): counted, and the request's end logged."""
        if output.request_id not in self._running:
            return  # aborted: counted as such
        if output.error is not None:
            self._running.discard(output.request_id)
            self._errored = True
            self.metrics.finished.labels(finished_reason="error").inc()
            return
        self._observe(self._index[output.request_id], output)
        if output.finished:
            self._running.discard(output.request_id)
            if not self._running and not self._errored:
                reasons = ", ".join(f"{reason} x{count}" if count > 1 else reason
                                    for reason, count in self._reasons.items())
                LOG.info("%s: finished (%s) after %s", self.log_id, reasons, self._so_far())

    def _observe(self, index: int, output: RequestOutput) -> None:
        now = time.perf_counter()
        if output.token_ids and self._counted:
            self._generated += len(output.token_ids)
            self._first = self._first or now
            self.metrics.generation_tokens.inc(len(output.token_ids))  # as they come: an aborted request's count too
            last = self._last.get(index)
            if last is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe(now - last)
            self._last[index] = now
        if output.result is not None:
            self.metrics.e2e.observe(now - self.arrival)
            self.metrics.finished.labels(finished_reason=output.result.finish_reason).inc()
            self._reasons[output.result.finish_reason] += 1
