"""LLM's serving side: requests submitted with a sink, aborted by id, and streamed (asyncio or a plain iterator);
`camshaft.LLM` takes it with the offline side (generate, chat) in runtime/llm.py."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence

from camshaft.errors import RequestError
from camshaft.runtime.executor import Executor
from camshaft.runtime.llm_options import params_list
from camshaft.runtime.outputs import RequestOutput, Sink
from camshaft.runtime.prompts import Prompt
from camshaft.runtime.request import Request
from camshaft.runtime.sampling_params import SamplingParams


class ServingAPI:
    """What servers use of an LLM; it holds `executor` and makes a prompt's requests with `_requests`."""

    executor: Executor

    def _requests(self, prompt: Prompt, params: SamplingParams, priority: int = 0) -> list[Request]:
        raise NotImplementedError

    def get_default_sampling_params(self) -> SamplingParams:
        """What sampling_params None means (vLLM's accessor): the model's generation_config.json sampling, else
        greedy."""
        raise NotImplementedError

    def submit(self, prompt: Prompt, sampling_params: SamplingParams, sink: Sink, priority: int = 0) -> list[str]:
        """Queue one prompt's n requests; `sink` gets every RequestOutput on the batch loop's thread and must
        only hand it over. `priority`: lower is admitted first (and preempted last). Returns the request ids (the
        prompt's id when n is 1, else the prompt's id with "-0" ... "-{n-1}"; abort takes them or the prompt's
        id). Raises RequestError, CapacityError or ServerBusyError at once."""
        return self.submit_batch([(prompt, sampling_params, sink)], priority)[0]

    def submit_batch(self, items: Sequence[tuple[Prompt, SamplingParams, Sink]], priority: int = 0
                     ) -> list[list[str]]:
        """Queue several (prompt, sampling_params, sink) at once, as submit each, or none: every prompt is checked
        and its requests built before any is queued, so one bad prompt refuses them all. Returns each one's ids."""
        groups, sinks = [], []
        for prompt, sampling_params, sink in items:
            if not callable(sink):
                raise RequestError(f"sink takes each RequestOutput (a callable), got {sink!r:.80}")
            params = params_list(sampling_params, 1, self.get_default_sampling_params())[0]
            self.executor.check_outputs(params.n)  # before building n requests
            groups.append(self._requests(prompt, params, priority))
            sinks.append([sink] * len(groups[-1]))
        self.executor.submit_groups(groups, sinks)
        return [[r.request_id for r in group] for group in groups]

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (or all n of a prompt, by the prompt's id; or each of several ids) and free its KV blocks
        before the next step; its sink gets a final output. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else \
            list(request_id) if isinstance(request_id, Iterable) else None
        if ids is None or not all(isinstance(one, str) for one in ids):
            raise RequestError(f"abort takes a request id (a string, as submit returns them) or several, got "
                               f"{request_id!r:.80}")
        for one in ids:
            self.executor.abort(one)

    async def stream_outputs(self, prompt: Prompt, sampling_params: SamplingParams | None = None, priority: int = 0
                             ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) pairs for the prompt's n outputs as the batch loop produces them, each ending with a
        finished output; errors are raised; closing or cancelling the consumer aborts what is unfinished."""
        params = params_list(sampling_params, 1, self.get_default_sampling_params())[0]
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        def sink(output: RequestOutput) -> None:  # on the batch loop's thread
            if loop.is_closed():  # the consumer's loop went, without closing it (else it aborted the request)
                if not output.finished:
                    self.executor.abort(output.request_id)
                return
            loop.call_soon_threadsafe(outputs.put_nowait, output)

        ids = self.submit(prompt, params, sink, priority)
        index = {request_id: i for i, request_id in enumerate(ids)}
        unfinished = set(ids)
        try:
            while unfinished:
                output = await outputs.get()
                if output.finished:
                    unfinished.discard(output.request_id)
                if output.error is not None:
                    raise output.error
                yield index[output.request_id], output
        finally:
            for request_id in unfinished:
                self.executor.abort(request_id)

    def stream_sync(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> Iterator[str]:
        """Text deltas of one request as the batch loop produces them; closing the iterator aborts the request.
        Bad input raises here; the request is queued when iteration starts (ServerBusyError then)."""
        self.executor.check_may_wait("stream_sync()")
        request = self._single(prompt, sampling_params, priority)
        self.executor.scheduler.check(request)
        return self._deltas(request)

    def _deltas(self, request: Request) -> Iterator[str]:
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        request.arrival = time.perf_counter()
        self.executor.submit([request], [outputs.put])
        finished = False
        try:
            while not finished:
                output = outputs.get()
                finished = _check(output)
                if output.delta:
                    yield output.delta
        finally:
            if not finished:
                self.executor.abort(request.request_id)

    async def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                     priority: int = 0) -> AsyncIterator[str]:
        """`async for delta in llm.stream(prompt)`; cancelling the consumer aborts the request."""
        params = params_list(sampling_params, 1, self.get_default_sampling_params())[0]
        if params.n != 1:
            raise RequestError("streaming text gives one output; use n=1 (or stream_outputs for several)")
        async with contextlib.aclosing(self.stream_outputs(prompt, params, priority)) as outputs:
            async for _, output in outputs:  # closing this stream closes that one: the request is aborted at once
                if output.delta:
                    yield output.delta

    def _single(self, prompt: Prompt, params: SamplingParams | None, priority: int) -> Request:
        params = params_list(params, 1, self.get_default_sampling_params())[0]
        if params.n != 1:
            raise RequestError("streaming gives one output; use n=1 (or generate() for several outputs)")
        return self._requests(prompt, params, priority)[0]


def _check(output: RequestOutput) -> bool:
    if output.error is not None:
        raise output.error
    return output.finished
