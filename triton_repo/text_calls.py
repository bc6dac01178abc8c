"""The text models' request records: a client request of B prompts is B calls (one a prompt, TensorRT-LLM's
batch_index) sharing one response sender, and the responses they send."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from camshaft.triton_repo.token_jobs import FINAL, tensor


@dataclass
class TextCall:
    """One prompt of a client request: what it asked for and what the executor has sent back so far."""

    request: object
    decoupled: bool  # else exactly one response (the sync model), sent as the decoupled ones are: execute() waits
    # for none, so a short request never waits for the long ones Triton batched with it
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    sender: object = None
    batch_index: int = 0
    batch: list[TextCall] = field(default_factory=list)  # the request's calls, this one among them
    text: str = ""
    stream: bool = False
    exclude: bool = False
    want_logprobs: bool = False
    pieces: dict[int, list[str]] = field(default_factory=dict)  # by sequence index (num_return_sequences)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    checked: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    ended: bool = False  # the executor has let all its sequences go

    def emit(self, response, final: bool) -> None:
        self.sender.send(response, flags=FINAL if final else 0)

    @property
    def others_ended(self) -> bool:
        return all(call.ended for call in self.batch if call is not self)


def text_response(text: str, new_logprobs: list[float], logprobs: list[float], want_logprobs: bool,
                  extra: list) -> pb_utils.InferenceResponse:
    tensors = [tensor("text_output", [text.encode()], np.object_), *extra]  # [1] as tensorrtllm_backend's
    if want_logprobs:
        tensors += [tensor("cum_log_probs", [[sum(logprobs)]], np.float32),
                    tensor("output_log_probs", [[list(new_logprobs)]], np.float32)]
    return pb_utils.InferenceResponse(output_tensors=tensors)
