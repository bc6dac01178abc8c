"""The token model's request records and responses: a Triton request (`Job`) and its num_return_sequences
sequences, and the tensors tensorrtllm_backend clients read."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import triton_python_backend_utils as pb_utils

from camshaft.runtime.outputs import RequestOutput
from camshaft.runtime.request import sequence_of
from camshaft.triton_repo.protocol import TokenRequest, error_status, perf_metrics, token_error_status
from camshaft.triton_repo.tensors import PERF_OUTPUTS

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
NUMPY = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}
CANCEL_CHECK_S = 0.2  # how often a running request asks Triton whether it was cancelled (an IPC round trip)


def merge(outputs: list[RequestOutput]) -> RequestOutput:
    """One output carrying several consecutive outputs of a request."""
    if len(outputs) == 1:
        return outputs[0]
    return replace(outputs[-1], delta="".join(o.delta for o in outputs),
                   token_ids=tuple(t for o in outputs for t in o.token_ids),
                   logprobs=tuple(s for o in outputs for s in o.logprobs),
                   prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None))


def error_response(exc: BaseException, token_model: bool = False) -> pb_utils.InferenceResponse:
    """token_model: the error names the token model's inputs (protocol.token_error_status)."""
    code, message = (token_error_status if token_model else error_status)(exc)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


def tensor(name: str, value, dtype) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.asarray(value, dtype=dtype))


def perf_tensors(values: dict[str, int | float]) -> list[pb_utils.Tensor]:
    """protocol.perf_metrics' values as the [1, 1] tensors of PERF_OUTPUTS."""
    return [tensor(spec.name, [[values[spec.name]]], NUMPY[spec.dtype]) for spec in PERF_OUTPUTS]


@dataclass
class Sequence:
    """One of a prompt's num_return_sequences outputs (TensorRT-LLM's sequence_index)."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Job:
    """One Triton request: its prompts (rows) and what was sent back for them."""

    request: object
    sender: object
    client_id: str = ""
    rows: list[Row] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    finished: int = 0  # sequences ended; the response that ends the last one carries the final flag
    checked: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    failed: bool = False  # an error response (final) has gone: later outputs are dropped
    stop_requested: bool = False  # a stop request came for its client id
    counted: bool = False  # its end counted in the metrics

    @property
    def sequences_total(self) -> int:
        return sum(row.spec.params.n for row in self.rows)

    @property
    def done(self) -> bool:
        return self.failed or self.finished == self.sequences_total


@dataclass
class Row:
    """One prompt of a job (TensorRT-LLM's batch_index) and its sequences."""

    job: Job
    index: int
    spec: TokenRequest
    sequences: dict[str, Sequence] = field(default_factory=dict)

    def sequence(self, request_id: str) -> Sequence:
        """LLM.submit names a prompt's n > 1 requests "<id>-0" ... "<id>-{n-1}"."""
        if request_id not in self.sequences:
            self.sequences[request_id] = Sequence(sequence_of(request_id, self.spec.params.n)[1])
        return self.sequences[request_id]


def response(row: Row, sequence: Sequence, ids: list[int], logprobs: list[float], text: str,
             output: RequestOutput) -> pb_utils.InferenceResponse:
    """A token-model response for one sequence: its new (streaming) or all ids, as tensorrtllm_backend names them."""
    spec = row.spec
    tensors = [tensor("output_ids", [[ids]], np.int32), tensor("sequence_length", [[len(ids)]], np.int32),
               tensor("text_output", [[text.encode()]], np.object_),
               tensor("sequence_index", [[sequence.index]], np.int32), tensor("batch_index", [[row.index]], np.int32)]
    if spec.log_probs:
        tensors += [tensor("cum_log_probs", [[sum(sequence.logprobs)]], np.float32),
                    tensor("output_log_probs", [[logprobs]], np.float32)]
    if output.finished:
        tensors.append(tensor("finish_reason", [[output.result.finish_reason.encode()]], np.object_))
    # on every response, as tensorrtllm_backend writes them (its stock client reads them from each): so far
    if spec.num_input_tokens:
        tensors.append(tensor("num_input_tokens", [[len(spec.prompt_ids)]], np.int32))
    if spec.num_output_tokens:
        tensors.append(tensor("num_output_tokens", [[len(sequence.tokens)]], np.int32))
    if spec.perf_metrics and output.metrics is not None:
        tensors += perf_tensors(perf_metrics(output.metrics))
    return pb_utils.InferenceResponse(output_tensors=tensors)
