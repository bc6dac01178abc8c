"""The text models: `<name>` (decoupled; `stream` true streams text deltas, false sends exactly one response) and
`<name>_sync` (not decoupled, for plain HTTP infer). Both tokenize, then reach the executor hosted by the token
model through BLS (always streaming, to see cancellation early) and never load the engine themselves.

Cancellation: the python backend of Triton 2.51 cannot cancel a BLS request, so when the client's request is
cancelled the model sends the token model a `stop` request with the BLS request's id (tensorrtllm_backend's
protocol), which aborts it in the executor.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from camshaft.errors import RequestError, ServerBusyError
from camshaft.runtime.engine import load_tokenizer
from camshaft.triton_repo.protocol import one
from camshaft.triton_repo.tensors import TEXT_TO_TOKEN
from camshaft.triton_repo.token_model import BLS_PARAMETER, CANCEL_CHECK_S, FINAL, error_response, tensor

PASSED_AS_IS = {"stop_words", "bad_words"}
HANDLED_HERE = {"text_input", "stream", "exclude_input_in_output"}


class TextModel:
    def __init__(self, args: dict, params: dict[str, str]) -> None:
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.name = args["model_name"]
        self.token_model = params["token_model"]
        self.tokenizer = load_tokenizer(Path(params["engine_dir"]))
        self.max_requests = int(params.get("max_requests") or 256)  # what the executor admits (batch + queue)
        self.slots = threading.BoundedSemaphore(self.max_requests)

    def execute(self, requests: list):
        if self.decoupled:
            for request in requests:
                if self.slots.acquire(blocking=False):
                    threading.Thread(target=self._stream, args=(request,), daemon=True).start()
                    continue
                busy = ServerBusyError(f"server busy: {self.name} holds {self.max_requests} requests in flight, as "
                                       "many as the executor admits; retry later or deploy with a larger --max-queue")
                try:
                    request.get_response_sender().send(error_response(busy), flags=FINAL)
                except Exception as exc:
                    pb_utils.Logger.log_warn(f"camshaft: could not respond ({exc!r})")
            return None
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(self._once, requests))

    def finalize(self) -> None:
        pass

    def _stream(self, request) -> None:
        try:
            self._stream_one(request)
        finally:
            self.slots.release()

    def _stream_one(self, request) -> None:
        sender = request.get_response_sender()

        def emit(response, final: bool) -> None:
            sender.send(response, flags=FINAL if final else 0)

        try:
            self._generate(request, emit, allow_stream=True)
        except Exception as exc:  # never leave a client waiting for its final response
            pb_utils.Logger.log_error(f"camshaft: {self.name} failed: {exc!r}")
            try:
                emit(error_response(exc), True)
            except Exception:
                pass

    def _once(self, request):
        responses = []
        try:
            self._generate(request, lambda response, final: responses.append(response), allow_stream=False)
        except Exception as exc:  # this request's failure (BLS included) must not fail the others of the batch
            pb_utils.Logger.log_error(f"camshaft: {self.name} failed: {exc!r}")
            return error_response(exc)
        return responses[-1] if responses else error_response(RuntimeError("the request was cancelled"))

    def _generate(self, request, emit: Callable, allow_stream: bool) -> None:
        try:
            values = {t.name(): t.as_numpy() for t in request.inputs()}
            text, stream, exclude = self._text(values), bool(one(values, "stream")), bool(
                one(values, "exclude_input_in_output"))
            if stream and not allow_stream:
                raise RequestError(f"{self.name} is not decoupled and cannot stream; send stream=true to the "
                                   f"decoupled model {self.name.removesuffix('_sync')}")
            bls = self._bls_request(values, text, request)
        except Exception as exc:
            emit(error_response(exc), True)
            return
        want_logprobs = bool(one(values, "return_log_probs"))
        pieces, logprobs, finished, cancelled, checked = [], [], False, False, time.monotonic()
        for response in bls.exec(decoupled=True):
            if finished or cancelled:
                continue  # drain what the token model still sends (it ends with a final response)
            if response.has_error():
                error = response.error()  # the token model's error, with its code (INVALID_ARG, UNAVAILABLE)
                code = error.code() if hasattr(error, "code") else pb_utils.TritonError.INVALID_ARG
                emit(pb_utils.InferenceResponse(error=pb_utils.TritonError(error.message(), code)), True)
                finished = True
                continue
            out = {t.name(): t.as_numpy() for t in response.output_tensors()}
            delta = one(out, "text_output") or ""
            reason = one(out, "finish_reason")
            if time.monotonic() - checked >= CANCEL_CHECK_S and reason is None:
                checked = time.monotonic()
                if request.is_cancelled():
                    self._stop(bls.request_id())
                    cancelled = True
                    continue
            extra = [tensor(n, out[n], out[n].dtype) for n in ("num_input_tokens", "num_output_tokens") if n in out]
            if want_logprobs and "output_log_probs" in out:
                logprobs.extend(out["output_log_probs"].reshape(-1).tolist())
            pieces.append(delta)
            response = None
            if stream and (delta or reason is not None or want_logprobs):
                response = self._response(delta, out.get("output_log_probs"), logprobs, want_logprobs, extra)
            elif not stream and reason is not None:
                full = "".join(pieces) if exclude else text + "".join(pieces)
                response = self._response(full, np.asarray(logprobs), logprobs, want_logprobs, extra)
            finished = reason is not None
            if response is not None:
                try:
                    emit(response, finished)
                except Exception:  # the client is gone
                    self._stop(bls.request_id())
                    cancelled, finished = True, False
        # A cancelled request gets nothing more: Triton 2.51 completes it itself, and a thread sending its final flag
        # races Triton's release of it (the stub crashed with a double free under a storm of cancellations).
        if not (cancelled or finished):
            emit(error_response(RuntimeError(f"{self.token_model} ended the request without a result")), True)

    def _text(self, values) -> str:
        array = values.get("text_input")
        if array is None:
            raise RequestError("text_input is required: the prompt, shape [1, 1] BYTES")
        if array.size != 1:
            raise RequestError(f"text_input holds {array.size} prompts (shape {list(array.shape)}); "
                               "send one prompt per request, shape [1, 1]")
        text = one(values, "text_input")
        if not text:
            raise RequestError("text_input is empty; pass some text")
        return text

    def _bls_request(self, values, text: str, request):
        ids = self.tokenizer(text)["input_ids"]
        if not ids:
            raise RequestError("text_input encodes to no tokens; pass some text")
        inputs = [tensor("input_ids", [ids], np.int32), tensor("input_lengths", [[len(ids)]], np.int32),
                  tensor("streaming", [[True]], np.bool_)]
        for name, array in values.items():
            if name in HANDLED_HERE:
                continue
            target = name if name in PASSED_AS_IS else TEXT_TO_TOKEN.get(name)
            if target is not None:
                inputs.append(pb_utils.Tensor(target, array.reshape(1, -1)))
        outputs = ["text_output", "finish_reason", "cum_log_probs", "output_log_probs", "num_input_tokens",
                   "num_output_tokens"]
        return pb_utils.InferenceRequest(model_name=self.token_model, inputs=inputs, requested_output_names=outputs,
                                         request_id=f"{self.name}-{uuid.uuid4().hex}",
                                         parameters={BLS_PARAMETER: True})

    def _stop(self, request_id: str) -> None:
        stop = pb_utils.InferenceRequest(model_name=self.token_model, request_id=request_id,
                                         inputs=[tensor("stop", [[True]], np.bool_)], requested_output_names=[])
        for _ in stop.exec(decoupled=True):
            pass

    @staticmethod
    def _response(text: str, new_logprobs, logprobs: list[float], want_logprobs: bool, extra: list):
        tensors = [tensor("text_output", [[text.encode()]], np.object_), *extra]
        if want_logprobs:
            new = [] if new_logprobs is None else np.asarray(new_logprobs, np.float32).reshape(-1).tolist()
            tensors += [tensor("cum_log_probs", [[sum(logprobs)]], np.float32),
                        tensor("output_log_probs", [[new]], np.float32)]
        return pb_utils.InferenceResponse(output_tensors=tensors)
