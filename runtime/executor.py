"""The in-flight batching loop on a background thread: schedule -> engine step -> sample -> update.

Each request's outputs (text deltas, then the final result) go to its sink as they happen; the sink is called on
the loop thread, so it must only hand the output over (put it on a queue). Aborts free a request's blocks before
the next step is scheduled.
"""

from __future__ import annotations

import logging
import threading
import time

from camshaft.errors import RequestError, ServerBusyError, ServerClosedError
from camshaft.runtime.engine import Engine
from camshaft.runtime.llm_options import check_fits_in_flight, check_max_queue
from camshaft.runtime.outputs import Load, RequestOutput, Sink, own_error
from camshaft.runtime.request import Request
from camshaft.runtime.sampler import SampleResult
from camshaft.runtime.scheduler import Scheduled, Scheduler
from camshaft.runtime.scheduler_config import SchedulerConfig
from camshaft.runtime.step_counters import StepCounters
from camshaft.runtime.step_outcomes import read_step

# A closed-loop client's next request, sent as its last one finishes, joins the next step (measured in the throughput
# benchmark's joining TTFT); the loop waits at most this long, and only after a step that finished requests.
ADMIT_WINDOW_S = 0.002

log = logging.getLogger(__name__)


class Executor(StepCounters):
    def __init__(self, engine: Engine, config: SchedulerConfig, *, max_queue: int | None = None,
                 stats_window: int = 1024, admit_window_s: float = ADMIT_WINDOW_S) -> None:
        """max_queue bounds the requests that wait beyond a full running batch; past it submit raises
        ServerBusyError. None: unbounded. admit_window_s: after a step that finished requests, with none
        waiting, how long the loop waits for new ones before it schedules the next step (0: not at all)."""
        check_max_queue(max_queue)
        self.engine = engine
        self.max_queue = max_queue
        self.admit_window_s = admit_window_s
        super().__init__(stats_window)
        self.scheduler = Scheduler(config)
        self._sinks: dict[str, Sink] = {}
        self._requests: dict[str, Request] = {}
        self._held: dict[str, list[Request]] = {}  # siblings waiting for the first sequence's prompt blocks
        self._inbox: list[list[Request]] = []
        self._aborts: list[str] = []
        self._wake = threading.Condition()
        self._closed = False
        self.failure: BaseException | None = None  # what ended the batch loop, where it failed
        self._thread = threading.Thread(target=self._loop, name="camshaft-executor", daemon=True)
        self._thread.start()

    def submit(self, group: list[Request], sinks: list[Sink], bounded: bool = True) -> None:
        """Queue requests that share a prompt (n > 1 outputs): the first computes the prompt, the others start once
        its full blocks are cached and reuse them. Raises at once: CapacityError for a request that can never fit,
        RequestError for more outputs than max_batch_size + max_queue, ServerBusyError while the queue is full.
        `bounded` False: past max_queue (offline work that waits its turn)."""
        self.submit_groups([group], [sinks], bounded)

    def submit_groups(self, groups: list[list[Request]], sinks: list[list[Sink]], bounded: bool = True) -> None:
        """Queue several prompts' groups (as submit) all at once, or none of them: every check comes first."""
        total = sum(len(group) for group in groups)
        for group in groups:
            if bounded:
                self.check_outputs(len(group))
            for request in group:
                self.scheduler.check(request)
        if bounded and len(groups) > 1:
            check_fits_in_flight(total, self.scheduler.config.max_batch_size, self.max_queue,
                                 f"{len(groups)} prompts ({total} outputs) can never be queued at once",
                                 "send fewer prompts at a time")
        batch, limit = self.scheduler.config.max_batch_size, self.max_queue if bounded else None
        with self._wake:
            if self._closed:
                raise ServerClosedError("the batch loop has stopped; create a new LLM (or restart the server)")
            if not self._thread.is_alive():  # a forked child has the executor but not its thread
                raise ServerClosedError("the batch loop does not run in this process (an LLM made before a fork?); "
                                        "create the LLM in the process that uses it")
            if limit is not None and len(self._sinks) + total > batch + limit:
                raise ServerBusyError(f"server busy: {len(self._sinks)} sequences in flight and the queue holds at "
                                      f"most {limit} beyond a running batch of {batch}; retry later or raise the "
                                      "queue limit (max_queue, --max-queue)")
            try:
                for group, group_sinks in zip(groups, sinks, strict=True):
                    for request, sink in zip(group, group_sinks, strict=True):
                        self._sinks[request.request_id] = sink
                self._inbox.extend(groups)
            except BaseException:  # Ctrl-C before the groups were queued: no sink may wait for them
                if not self._inbox or self._inbox[-1] is not groups[-1]:
                    for request in (r for group in groups for r in group):
                        self._sinks.pop(request.request_id, None)
                raise
            self._wake.notify()

    def check_may_wait(self, what: str) -> None:
        """Refuse a call that waits for the batch loop made on the loop's own thread (from a sink): it would wait
        for itself forever."""
        if threading.current_thread() is self._thread:
            raise RequestError(f"{what} waits for the batch loop, and this is the loop's thread (a sink): a sink only "
                               "hands outputs over; submit() from it, or wait on another thread")

    def check_outputs(self, n: int) -> None:
        """Refuse n outputs of one prompt that could never be in flight at once (RequestError)."""
        check_fits_in_flight(n, self.scheduler.config.max_batch_size, self.max_queue,
                             f"n={n} outputs can never be queued", "lower n")

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self.join()

    def join(self) -> None:
        """Wait until the batch loop has ended (closed or failed) and told every request's sink."""
        if threading.current_thread() is not self._thread:  # a sink may drop the last reference to its LLM
            self._thread.join()

    def ended(self) -> bool:
        """The batch loop's thread has returned (every request in flight got its final output)."""
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """The batch loop is running: False once closed or failed (health checks)."""
        return self._thread.is_alive() and not self._closed

    def load(self) -> Load:
        scheduler = self.scheduler
        with self._wake:
            in_flight = len(self._sinks)
        running = len(scheduler.running)
        counters = scheduler.blocks.counters()
        return Load(running, max(0, in_flight - running), counters.used, counters.total, counters.prefix_hits,
                    scheduler.num_preemptions, self.draft_tokens, self.accepted_draft_tokens)

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # a bug in the loop: fail every request rather than leave callers hanging
            log.critical("the batch loop stopped; every request in flight failed", exc_info=True)
            self.failure = exc  # first: what reads a request's error can tell a failure from a close
            self._fail_all(ServerClosedError(f"the batch loop failed: {exc!r}; create a new LLM (or restart the "
                                             "server)"))  # the thread ends: its traceback was logged above

    def _fail_all(self, error: Exception) -> None:
        """Finish every request not yet finished: queued, held siblings and running."""
        with self._wake:
            self._closed = True
            pending = [request for group in self._inbox for request in group]
            self._inbox = []
        pending += [request for siblings in self._held.values() for request in siblings]
        self._held.clear()
        pending += list(self._requests.values())
        for request in pending:
            if request.request_id in self._sinks:
                self._finish(request, error)

    def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._wake:
                while not (self._closed or self._inbox or self._aborts or scheduler.has_work):
                    self._wake.wait()
                if self._closed:
                    break
                groups, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for first, *rest in groups:
                self._add(first)
                if rest:
                    self._held[first.request_id] = rest
            for request_id in aborts:
                self._abort(request_id)
            if self._closed:  # a sink closed the LLM from this thread: its engine is closed too
                break
            scheduled = scheduler.schedule()
            if scheduled and self._step(scheduled) and not scheduler.waiting and self.admit_window_s > 0:
                self._admit_window()
        self._fail_all(ServerClosedError("the executor was closed before the request finished"))

    def _admit_window(self) -> None:
        """Requests finished and freed their places: give their clients a moment to send the next ones, which then
        join the next step. Without it a closed-loop client's next request always waits a whole step, as this
        thread schedules again before the client's thread gets the GIL to submit."""
        with self._wake:
            self._wake.wait_for(lambda: self._closed or self._inbox or self._aborts, timeout=self.admit_window_s)

    def _abort(self, request_id: str) -> None:
        """A request's id, or a prompt's id: all its n requests."""
        def named(request: Request) -> bool:
            return request_id in (request.request_id, request.prompt_id)

        held = [sibling for siblings in self._held.values() for sibling in siblings if named(sibling)]
        for siblings in self._held.values():
            siblings[:] = [sibling for sibling in siblings if not named(sibling)]
        for request in [r for r in self._requests.values() if named(r)] + held:
            request.finish_reason = request.finish_reason or "abort"
            self._finish(request)

    def _add(self, request: Request, queue_order: int | None = None) -> None:
        self._requests[request.request_id] = request
        self.scheduler.add(request, queue_order)

    def _step(self, scheduled: list[Scheduled]) -> int:
        """Run one step; returns how many requests it finished."""
        started = time.perf_counter()
        try:
            logits = self.engine.step([item.chunk for item in scheduled])
        except Exception as exc:  # the backend failed: the requests in this step cannot continue
            log.error("the engine step failed; its %d request(s) end with the error", len(scheduled), exc_info=True)
            for item in scheduled:
                self._finish(item.request, exc)
            return len(scheduled)
        self.scheduler.computed(scheduled)
        outcomes = read_step(scheduled, logits)
        self.count_step(scheduled, self.scheduler, started)  # before any output goes out: a caller that saw its
        # last one sees this step counted
        finished = 0
        for outcome in outcomes:
            request = outcome.request
            if outcome.error is not None:
                self._finish(request, outcome.error)
                finished += 1
                continue
            if outcome.drafted:
                self.draft_tokens += outcome.drafted
                self.accepted_draft_tokens += outcome.accepted
                if not request.finished:
                    self.scheduler.advance(request, len(outcome.samples))
            finished += self._deliver_samples(request, outcome.delta, outcome.samples)
        return finished

    def _deliver_samples(self, request: Request, delta: str, samples: list[SampleResult]) -> int:
        new = (tuple(s.token_id for s in samples), tuple(samples) if request.params.logprobs is not None else ())
        if request.finished:
            self._finish(request, delta=delta, new=new)
            return 1
        self._deliver(self._sinks[request.request_id], RequestOutput(
            request.request_id, delta, *new, prompt_logprobs=_first_prompt_logprobs(request, new),
            metrics=request.metrics()))
        self._release_held(request)
        return 0

    def _release_held(self, request: Request) -> None:
        for sibling in self._held.pop(request.request_id, []):  # in the queue where their first sequence arrived
            if request.params.prompt_logprobs is not None:  # the same prompt's: recorded once, its blocks reused
                sibling.prompt_samples = list(request.prompt_samples)
            self._add(sibling, request.queue_order)

    def _finish(self, request: Request, error: Exception | None = None, delta: str = "",
                new: tuple[tuple[int, ...], tuple[SampleResult, ...]] = ((), ())) -> None:
        self.scheduler.finish(request)
        self._requests.pop(request.request_id, None)
        if error is None:
            self._release_held(request)
        else:  # the n outputs share the prompt that failed (an abort of one output leaves the others running)
            for sibling in self._held.pop(request.request_id, []):
                self._finish(sibling, error)
        with self._wake:
            sink = self._sinks.pop(request.request_id)
        error = None if error is None else own_error(error)
        result = None if error else request.result()
        self._deliver(sink, RequestOutput(request.request_id, delta, *new, result, error,
                                          _first_prompt_logprobs(request, new),
                                          request.metrics() if result is None else result.metrics))

    def _deliver(self, sink: Sink, output: RequestOutput) -> None:
        try:
            sink(output)
        except BaseException as exc:  # the consumer is gone or failed (even SystemExit): abort it, keep the loop
            log.warning("the consumer of request %s failed taking an output (%r); the request is aborted",
                        output.request_id, exc)
            if not output.finished:
                self._aborts.append(output.request_id)


def _first_prompt_logprobs(request: Request, new: tuple[tuple[int, ...], tuple[SampleResult, ...]]
                           ) -> list[SampleResult | None] | None:
    return request.prompt_logprobs if new[0] and len(request.output_ids) == len(new[0]) else None
