"""The `tensorrt_llm` model (decoupled): token ids in, token ids out. It hosts the engine's one executor, so every
request of every model shares one running batch (in-flight batching).

execute() only parses and submits; the executor's sinks put outputs on one queue that a responder thread turns
into Triton responses. A cancelled request (gRPC stream cancelled, client gone) or a `stop` request with the same
request id aborts the request in the executor, which frees its KV blocks before the next step. The text models
reach the same executor over the channel of channel.py.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import triton_python_backend_utils as pb_utils

from camshaft.errors import RequestError
from camshaft.runtime.llm import LLM
from camshaft.runtime.llm_options import check_serves_full_length
from camshaft.runtime.outputs import RequestOutput
from camshaft.triton_repo.channel import ChannelServer, Send, channel_path
from camshaft.triton_repo.channel_calls import ChannelCall
from camshaft.triton_repo.instance_lock import InstanceLock
from camshaft.triton_repo.metrics import Metrics
from camshaft.triton_repo.parameters import TOKEN_MODEL_PARAMETERS, check_model_parameters, check_parameters
from camshaft.triton_repo.protocol import (
    TokenRequest,
    aborted,
    batch_rows,
    check_one_response,
    ended_on_end_id,
    one,
    token_request,
)
from camshaft.triton_repo.server_exit import drain_s, exit_failed, watch_launcher
from camshaft.triton_repo.tensors import TOKEN_INPUTS
from camshaft.triton_repo.token_jobs import (
    CANCEL_CHECK_S,
    FINAL,
    Job,
    Row,
    error_response,
    merge,
    response,
)


class TokenModel:
    def __init__(self, args: dict, params: dict[str, str]) -> None:
        check_model_parameters(args["model_name"], params, TOKEN_MODEL_PARAMETERS)
        self.instance = InstanceLock(channel_path(args["model_name"]), args["model_name"], wait_s=drain_s() + 5)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        try:
            self.llm = LLM(params["engine_dir"], spin_wait=False, **json.loads(params.get("llm_options") or "{}"))
        except BaseException:
            self.instance.release()
            raise
        try:
            check_serves_full_length(self.llm.engine.manifest, self.llm.config)  # a fraction's pool: known only now
        except BaseException:
            self.llm.close()
            self.instance.release()
            raise
        self.exclude_default = params.get("exclude_input_in_output", "false") == "true"
        self.by_client_id: dict[str, Job] = {}
        self.metrics = Metrics(self.llm, args["model_name"], stoppable=lambda: len(self.by_client_id))
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.responder = threading.Thread(target=self._respond, name="camshaft-responder", daemon=True)
        self.responder.start()
        self.channel = ChannelServer(channel_path(args["model_name"]), self._from_channel, self.llm.abort,
                                     lambda: self.metrics.count("camshaft_requests_refused_total"),
                                     drain=self.llm.close,  # each request in flight gets a final error response
                                     hello=("hello", self.llm.engine.manifest.build_id, params["engine_dir"]))
        watch_launcher(self.llm.close, self.channel.path.parent)

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._start(request, sender)
            except Exception as exc:
                self.metrics.count("camshaft_requests_refused_total")
                self.outputs.put((sender, error_response(exc, token_model=True)))
        return None

    def _start(self, request, sender) -> None:
        check_parameters(request.parameters(), [t.name for t in TOKEN_INPUTS])
        values = {t.name(): t.as_numpy() for t in request.inputs()}
        client_id = request.request_id()
        if one(values, "stop"):  # tensorrtllm_backend's way to stop a request: same request id, stop=true
            with self.lock:
                job = self.by_client_id.get(client_id)
                if job is not None:
                    job.stop_requested = True  # seen after its submit returns, if it has not yet
                ids = list(job.request_ids) if job else []
            self.llm.abort(ids)
            self.outputs.put((sender, pb_utils.InferenceResponse(output_tensors=[])))
            return
        engine = self.llm.engine
        specs = [token_request(row, eos_token_ids=engine.eos_token_ids, vocab_size=engine.manifest.model.vocab_size,
                               exclude_default=self.exclude_default) for row in batch_rows(values)]
        self._check_sequences(specs)
        if not self.decoupled:
            check_one_response(specs)
        job = Job(request, sender, client_id)
        job.rows = [Row(job, index, spec) for index, spec in enumerate(specs)]
        with self.lock:  # registered before it can finish: the responder forgets it only once it is registered
            if client_id:
                self.by_client_id[client_id] = job
        try:  # not under the lock: submit may compile a guided grammar, and the responder needs the lock
            ids = [i for group in self.llm.submit_batch([  # every row checked before any is queued
                (row.spec.prompt_ids, row.spec.params, lambda out, row=row: self.outputs.put((row, out)))
                for row in job.rows]) for i in group]
        except BaseException:  # no row was queued: the request fails as a whole
            with self.lock:
                first = self._end(job)
                if first:
                    job.counted = True  # its outputs are dropped; execute() counts it as refused
                self._forget(job)
            if not first:  # something else ended it meanwhile (a stop request): its final response went
                self.metrics.count("camshaft_requests_total")
                return
            raise
        with self.lock:  # an error, a cancel or a stop request may have ended the job while its rows were queued
            job.request_ids, stop = ids, job.stop_requested or job.failed or job.cancelled
        if stop:
            self.llm.abort(ids)
        self.metrics.count("camshaft_requests_total")

    def _check_sequences(self, specs: list[TokenRequest]) -> None:
        """Sequences that could never be in flight at once: refused before anything is built."""
        n, batch, queue_ = sum(s.params.n for s in specs), self.llm.config.max_batch_size, self.llm.executor.max_queue
        if queue_ is not None and n > batch + queue_:
            what = f"num_return_sequences {n}" if len(specs) == 1 else f"{len(specs)} prompts with {n} sequences"
            raise RequestError(f"{what} can never be in flight: this server holds {batch + queue_} sequences (batch "
                               f"{batch} + queue {queue_}); lower it, or deploy with a larger --max-queue")

    @staticmethod
    def _end(job: Job) -> bool:
        """Call with the lock held: claims the job's one error response (False when another thread has)."""
        first, job.failed = not job.failed, True
        return first

    def _forget(self, job: Job) -> None:
        """Call with the lock held."""
        if job.client_id and self.by_client_id.get(job.client_id) is job:
            del self.by_client_id[job.client_id]

    def _respond(self) -> None:
        """The one thread that talks to Triton after execute() returns: responses (under load a request's queued
        outputs go out as one response) and metrics. Triton 2.51's stub hung when several threads did so at once."""
        running = True
        while running:
            try:
                items = [self.outputs.get(timeout=self.metrics.period_s)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(self.outputs.get_nowait())
                except queue.Empty:
                    break
            running = None not in items
            grouped: dict[tuple[int, str], tuple[Row, list[RequestOutput]]] = {}
            for first, second in filter(None, items):
                if isinstance(first, Row):
                    grouped.setdefault((id(first), second.request_id), (first, []))[1].append(second)
                else:  # a response execute() produced: an error, or the final flag of a stop request
                    try:
                        first.send(second, flags=FINAL)
                    except Exception as exc:
                        pb_utils.Logger.log_warn(f"camshaft: could not respond ({exc!r})")
            for row, outputs in grouped.values():
                self._send(row, merge(outputs))  # per sequence: a job's prompts and their n sequences kept apart
            self.metrics.tick()
            executor = self.llm.executor
            if executor.failure is not None and executor.ended() and self.outputs.empty():  # its requests answered
                exit_failed(executor.failure, pb_utils.Logger.log_error)

    def _send(self, row: Row, output: RequestOutput) -> None:
        job = row.job
        try:
            self._deliver(row, output)
        except Exception as exc:  # a client gone mid-send: stop its request, keep serving the others
            pb_utils.Logger.log_warn(f"camshaft: could not respond ({exc!r}); aborting the request")
            if not output.finished:
                job.cancelled = True
                self.llm.abort(job.request_ids)
        job.finished += output.finished
        if job.done and not job.counted:  # once a request, however many sequences it has
            job.counted = True
            self._count_finished(aborted=not job.failed and (job.cancelled or aborted(output)))
            with self.lock:
                self._forget(job)

    def _count_finished(self, aborted: bool) -> None:
        self.metrics.count("camshaft_requests_finished_total")
        if aborted:
            self.metrics.count("camshaft_requests_aborted_total")

    def _deliver(self, row: Row, output: RequestOutput) -> None:
        job = row.job
        self.metrics.count("camshaft_generation_tokens_total", len(output.token_ids))
        last = output.finished and job.finished + 1 == job.sequences_total  # this output ends the job
        if job.failed:
            return
        if job.cancelled:  # Triton 2.51 unloads a model only once its cancelled requests got their final flag
            if last:  # alone if decoupled; else the one response a request gets
                job.sender.send(None if self.decoupled else error_response(RuntimeError("the request was cancelled")),
                                flags=FINAL)
            return
        if output.error is not None:  # the whole request ends with it; its other sequences are stopped
            with self.lock:
                first = self._end(job)
            if first:
                self.llm.abort(job.request_ids)
                job.sender.send(error_response(output.error, token_model=True), flags=FINAL)
            return
        now = time.monotonic()
        if not output.finished and now - job.checked >= CANCEL_CHECK_S:
            job.checked = now
            if job.request.is_cancelled():
                job.cancelled = True
                self.llm.abort(job.request_ids)
                return
        spec, sequence = row.spec, row.sequence(output.request_id)
        # TensorRT-LLM leaves the end id that stops a sequence out of output_ids (stop words stay)
        keep = len(output.token_ids) - int(ended_on_end_id(output))
        new = list(output.token_ids[:keep])
        sequence.tokens.extend(new)
        sequence.logprobs.extend(s.logprob for s in output.logprobs[:keep])
        if spec.streaming:
            job.sender.send(response(row, sequence, new, sequence.logprobs[len(sequence.logprobs) - len(new):],
                                           output.delta, output), flags=FINAL if last else 0)
        elif output.finished:
            ids = sequence.tokens if spec.exclude_input else [*spec.prompt_ids, *sequence.tokens]
            job.sender.send(response(row, sequence, ids, sequence.logprobs, output.result.text, output),
                            flags=FINAL if last else 0)

    def _from_channel(self, send: Send, calls: list[tuple[str, dict]]) -> list[list[str]]:
        """A text model's prompt, or its batch's, all checked and queued together or none (one refusal counted);
        outputs go back over the channel as plain values (see channel_calls.py)."""
        try:
            engine = self.llm.engine
            specs = [token_request(values, eos_token_ids=engine.eos_token_ids,
                                   vocab_size=engine.manifest.model.vocab_size, exclude_default=self.exclude_default)
                     for _, values in calls]
            self._check_sequences(specs)
            ids = self.llm.submit_batch([(spec.prompt_ids, spec.params,
                                          ChannelCall(spec, send, call_id, self.llm, self.metrics,
                                                      self._count_finished))
                                         for spec, (call_id, _) in zip(specs, calls, strict=True)])
        except Exception:
            self.metrics.count("camshaft_requests_refused_total")
            raise
        self.metrics.count("camshaft_requests_total", len(calls))
        return ids

    def _in_flight(self) -> int:
        load = self.llm.load()
        return load.running + load.waiting

    def finalize(self) -> None:
        # Triton unloads this model once its own requests are done, but the text models' requests reach it over the
        # channel: they may finish until shortly before the server's exit timeout, then end with an error response
        self.instance.draining()  # a next instance (unload, then load) waits for this one
        deadline = time.monotonic() + drain_s()
        while time.monotonic() < deadline and self.llm.alive and (self._in_flight() or self.channel.in_flight()):
            time.sleep(0.05)
        self.llm.close()  # unfinished requests get an error output, which the responder and the channel still send
        self.channel.close()
        self.instance.release()
        self.outputs.put(None)
        self.responder.join()
        self.metrics.close()
