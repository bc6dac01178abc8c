"""The text models: `<name>` and `tensorrt_llm_bls` (decoupled unless deployed --no-decoupled; `stream` true streams
text deltas, false sends exactly one response) and `<name>_sync` (not decoupled, for plain HTTP infer). Each
tokenizes, then hands the token ids to the executor that the token model hosts, over the private channel of
channel.py, and never loads the engine itself.

One thread owns every call into Triton's python stub once execute() has handed a request over (parsing, responses,
cancellation checks) and every message to the executor; the channel's reader thread only passes on what arrives.
A cancelled request is aborted in the executor and gets its final flag once the executor has let it go, so Triton
can unload the model at shutdown.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from camshaft.errors import RequestError, ServerBusyError, ServerClosedError
from camshaft.manifest import read_manifest
from camshaft.runtime.engine import load_tokenizer
from camshaft.runtime.prompt_text import encode_text
from camshaft.triton_repo.channel import ChannelClient, channel_path
from camshaft.triton_repo.parameters import (
    TEXT_MODEL_PARAMETERS,
    check_model_parameters,
    check_parameters,
    check_same_engine,
    same_build,
)
from camshaft.triton_repo.protocol import one, split_rows
from camshaft.triton_repo.server_exit import watch_launcher
from camshaft.triton_repo.tensors import TEXT_INPUTS, TEXT_TO_TOKEN, TOKEN_TO_TEXT, renamed
from camshaft.triton_repo.text_calls import TextCall, text_response
from camshaft.triton_repo.token_jobs import CANCEL_CHECK_S, error_response, perf_tensors, tensor
from camshaft.triton_repo.word_lists import text_embedding_bias

PASSED_AS_IS = {"stop_words", "bad_words"}
HANDLED_HERE = {"text_input", "stream", "exclude_input_in_output", "embedding_bias_words",
                "embedding_bias_weights"}


class TextModel:
    def __init__(self, args: dict, params: dict[str, str]) -> None:
        check_model_parameters(args["model_name"], params, TEXT_MODEL_PARAMETERS)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.name = args["model_name"]
        manifest = read_manifest(Path(params["engine_dir"]))  # a missing engine said as such, before its tokenizer
        check_same_engine(self.name, Path(params["engine_dir"]), manifest.build_id,
                          Path(args["model_repository"]).parent / params["token_model"])
        self.tokenizer = load_tokenizer(Path(params["engine_dir"]))
        self.max_seq_len, self.vocab_size = manifest.limits.max_seq_len, manifest.model.vocab_size
        self.max_requests = int(params.get("max_requests") or 256)  # what the executor admits (batch + queue)
        self.stream_model = params.get("stream_model", "")  # the decoupled text model; "" when none is
        self.calls: dict[str, TextCall] = {}
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.engine_dir, self.build_id = Path(params["engine_dir"]), manifest.build_id
        self.channel = ChannelClient(channel_path(params["token_model"]), lambda message: self.inbox.put(message),
                                     check=self._check_hello)
        self.token_model, self.loaded = params["token_model"], False
        self.channel.open_if_listening()  # a token model loaded with another engine fails this load
        self.loaded = True
        watch_launcher(lambda: None, channel_path(params["token_model"]).parent)  # an open stream may keep it last
        self.owner = threading.Thread(target=self._own, name="camshaft-text-owner", daemon=True)
        self.owner.start()

    def _check_hello(self, hello: tuple) -> None:
        """The executor this model reaches hosts the engine it was loaded with (a reload of either may change it)."""
        _, build_id, engine = hello
        if same_build(build_id, Path(engine), self.build_id, self.engine_dir):
            return
        hosts = f"its token model {self.token_model!r} hosts {engine} (build {build_id[:12]})"
        if not self.loaded:  # this load reads the new build: the token model moves first
            raise ServerClosedError(
                f"model {self.name!r} would load the engine {self.engine_dir} (build {self.build_id[:12]}), but "
                f"{hosts}: load {self.token_model!r} onto it first (unload it, then load it), then this model (or "
                "restart the server)")
        raise ServerClosedError(
            f"model {self.name!r} was loaded with the engine {self.engine_dir} (build {self.build_id[:12]}), but "
            f"{hosts}: reload {self.name!r} so both serve one engine (or restart the server)")

    def execute(self, requests: list) -> None:
        for request in requests:
            self.inbox.put(("request", request))
        return None

    def finalize(self) -> None:
        self.inbox.put(None)
        self.owner.join(timeout=5)
        self.channel.close()

    def _own(self) -> None:
        while (message := self.inbox.get()) is not None:
            try:
                if message[0] == "request":
                    self._start(message[1])
                elif message[0] == "closed":
                    self._lost(message[1])
                elif (call := self.calls.get(message[1])) is not None:
                    self._on_executor(call, message)
            except Exception as exc:  # one request's failure must not stop the others
                pb_utils.Logger.log_error(f"camshaft: {self.name} failed: {exc!r}")

    def _start(self, request) -> None:
        first = TextCall(request, self.decoupled, sender=request.get_response_sender())
        calls = first.batch = [first]
        try:
            check_parameters(request.parameters(), [t.name for t in TEXT_INPUTS])
            rows = self._rows({t.name(): t.as_numpy() for t in request.inputs()})
            if len(self.calls) + len(rows) > self.max_requests:
                raise ServerBusyError(f"server busy: {self.name} holds {self.max_requests} requests in flight, as "
                                      "many as the executor admits; retry later or deploy with a larger --max-queue")
            if len(rows) > 1 and not first.decoupled:
                raise RequestError(f"{self.name} answers once and cannot take a batch of {len(rows)} prompts; "
                                   + self._to_stream_model("a batch of prompts"))
            calls += [TextCall(request, self.decoupled, sender=first.sender, batch_index=i, batch=calls)
                      for i in range(1, len(rows))]
            for call, values in zip(calls, rows, strict=True):
                self._read(call, values)
            inputs = [self._token_inputs(values, call.text) for call, values in zip(calls, rows, strict=True)]
            for call in calls:
                self.calls[call.id] = call
            if len(calls) == 1:
                self.channel.send(("submit", first.id, inputs[0]))
            else:  # checked whole by the token model before any prompt runs, as a stock backend refuses a batch
                self.channel.send(("submit_all", first.id, [(c.id, i) for c, i in zip(calls, inputs, strict=True)]))
        except Exception as exc:  # the prompts submitted before are stopped, unless the channel is gone
            self._final(first, error_response(exc), abort=not isinstance(exc, ServerClosedError))
            if not isinstance(exc, ServerClosedError):  # counted with the token model's refusals
                with contextlib.suppress(Exception):
                    self.channel.send(("refused", first.id))

    def _read(self, call: TextCall, values) -> None:
        """One prompt's inputs: what the text model itself handles, and what a model that answers once refuses."""
        call.text, call.stream = self._text(values), bool(one(values, "stream"))
        call.exclude, call.want_logprobs = (bool(one(values, "exclude_input_in_output")),
                                            bool(one(values, "return_log_probs")))
        returned = one(values, "num_return_sequences")
        if returned is not None and returned > 1 and not call.decoupled:
            raise RequestError(f"{self.name} answers once and cannot return {returned} sequences; "
                               + self._to_stream_model("num_return_sequences")
                               + (" (/generate_stream or a gRPC stream: /generate takes one response)"
                                  if self.stream_model else ""))
        if call.stream and not call.decoupled:
            raise RequestError(f"{self.name} is not decoupled and cannot stream; "
                               + self._to_stream_model("stream=true"))

    def _to_stream_model(self, what: str) -> str:
        if self.stream_model:
            return f"send {what} to the decoupled model {self.stream_model}"
        return f"this repository was deployed with --no-decoupled, where no model takes {what}; deploy without it"

    def _final(self, call: TextCall, response, abort: bool = True) -> None:
        """The request's last response (its prompts still running are stopped, unless `abort` is false: the channel
        is gone, and the token model stops them itself); a cancelled decoupled request gets only its final flag
        (Triton completes it)."""
        for other in call.batch:
            if self.calls.pop(other.id, None) is not None and not other.ended and abort:
                with contextlib.suppress(Exception):
                    self.channel.send(("abort", other.id))
        if call.cancelled and call.decoupled:
            response = None
        try:
            call.emit(response, True)
        except Exception as exc:
            pb_utils.Logger.log_warn(f"camshaft: could not respond ({exc!r})")

    def _lost(self, reason: str) -> None:
        for call in list(self.calls.values()):
            if call.id in self.calls:  # not ended with another prompt of its request
                self._final(call, error_response(ServerClosedError(f"{reason}; restart the server")), abort=False)

    def _on_executor(self, call: TextCall, message: tuple) -> None:
        if message[0] == "error":
            _, _, code, text = message
            text = renamed(text, TOKEN_TO_TEXT)  # the token model names its own inputs
            call.ended = True
            self._final(call, pb_utils.InferenceResponse(error=pb_utils.TritonError(text, getattr(pb_utils.TritonError,
                                                                                                  code))))
            return
        out = message[2]
        reason = out["finish_reason"]
        call.ended = out["last"]
        if call.cancelled:
            if call.ended and call.others_ended:  # the executor let all its sequences go: Triton may release it
                self._final(call, error_response(RuntimeError("the request was cancelled")))
            return
        if reason is None and time.monotonic() - call.checked >= CANCEL_CHECK_S:
            call.checked = time.monotonic()
            if call.request.is_cancelled():
                self._cancel(call)
                return
        self._deliver(call, out, reason)

    def _deliver(self, call: TextCall, out: dict, reason: str | None) -> None:
        delta, index = out["text"], out["sequence_index"]
        extra = [tensor(n, [[out[n]]], np.int32) for n in ("num_input_tokens", "num_output_tokens") if n in out]
        extra += [tensor("sequence_index", [[index]], np.int32), tensor("batch_index", [[call.batch_index]], np.int32)]
        if "perf" in out:
            extra += perf_tensors(out["perf"])
        logprobs = call.logprobs.setdefault(index, [])
        logprobs.extend(out["logprobs"])
        call.pieces.setdefault(index, []).append(delta)
        final = call.ended and call.others_ended  # the request's last sequence ended
        response = None
        if call.stream and (delta or reason is not None or call.want_logprobs):
            response = text_response(delta, out["logprobs"], logprobs, call.want_logprobs, extra)
        elif not call.stream and reason is not None:
            text = "".join(call.pieces[index])
            response = text_response(text if call.exclude else call.text + text, logprobs, logprobs,
                                     call.want_logprobs, extra)
        if response is None:
            return
        if final:
            for other in call.batch:
                self.calls.pop(other.id, None)
        try:
            call.emit(response, final)
        except Exception:  # the client is gone
            if not final:
                self._cancel(call)

    def _cancel(self, call: TextCall) -> None:
        """Every prompt of the request is stopped; the final flag waits until the executor has let them all go."""
        try:
            for other in call.batch:
                other.cancelled = True
                if not other.ended:
                    self.channel.send(("abort", other.id))
        except ServerClosedError as exc:
            self._lost(str(exc))

    @staticmethod
    def _rows(values) -> list:
        """The request's prompts, each with its row of every input (text_input [B, 1]: a batch of B prompts)."""
        array = values.get("text_input")
        if array is None:
            raise RequestError("text_input is required: the prompt, shape [1, 1] BYTES (B prompts: [B, 1])")
        batch = array.shape[0] if array.ndim else 1
        if array.size != batch:
            raise RequestError(f"text_input has shape {list(array.shape)}; send one prompt a row, shape [1, 1] "
                               "(B prompts: [B, 1])")
        return split_rows(values, batch) if batch > 1 else [values]

    @staticmethod
    def _text(values) -> str:
        text = one(values, "text_input")
        if not text:
            raise RequestError("text_input is empty; pass some text")
        return text

    def _token_inputs(self, values, text: str) -> dict[str, np.ndarray]:
        """The token model's inputs for this request, as tensorrtllm_backend names them."""
        ids = encode_text(self.tokenizer, text, self.max_seq_len, "text_input")
        if not ids:
            raise RequestError("text_input encodes to no tokens; pass some text")
        inputs = {"input_ids": np.asarray([ids], np.int32), "input_lengths": np.asarray([[len(ids)]], np.int32),
                  "streaming": np.asarray([[True]])}
        for name, array in values.items():
            target = None if name in HANDLED_HERE else name if name in PASSED_AS_IS else TEXT_TO_TOKEN.get(name)
            if target is not None:
                inputs[target] = np.asarray(array).reshape(1, -1)
        bias = text_embedding_bias(self.tokenizer, values, self.vocab_size)
        if bias is not None:
            inputs["embedding_bias"] = bias
        return inputs
