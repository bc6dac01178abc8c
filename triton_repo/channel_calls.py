"""A text model's request inside the token model: the executor's outputs for it, sent back over the channel of
channel.py as plain values (text deltas, finish reasons, counts), one message an output."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from camshaft.runtime.outputs import RequestOutput
from camshaft.runtime.request import sequence_of
from camshaft.triton_repo.channel import Send
from camshaft.triton_repo.protocol import TokenRequest, aborted, ended_on_end_id, perf_metrics, token_error_status

if TYPE_CHECKING:
    from camshaft.runtime.llm import LLM
    from camshaft.triton_repo.metrics import Metrics


class ChannelCall:
    """The sink of one text-model request (its num_return_sequences sequences): an error ends the call and stops
    its other sequences; `count_finished` hears once when the call ends."""

    def __init__(self, spec: TokenRequest, send: Send, call_id: str, llm: LLM, metrics: Metrics,
                 count_finished: Callable[[bool], None]) -> None:
        self.spec, self.send, self.call_id = spec, send, call_id
        self.llm, self.metrics, self.count_finished = llm, metrics, count_finished
        self.generated: dict[str, int] = {}
        self.ended, self.failed = 0, False

    def __call__(self, output: RequestOutput) -> None:
        spec, n = self.spec, self.spec.params.n
        self.metrics.count("camshaft_generation_tokens_total", len(output.token_ids))
        if self.failed:  # the call has ended with an error: its other sequences' outputs are dropped
            return
        keep = len(output.token_ids) - int(ended_on_end_id(output))  # as the token model's own responses count
        self.generated[output.request_id] = self.generated.get(output.request_id, 0) + keep
        prompt_id, index = sequence_of(output.request_id, n)
        if output.error is not None:
            self.failed = True
            self.count_finished(False)
            self.llm.abort(prompt_id)
            self.send(("error", self.call_id, *token_error_status(output.error)))
            return
        self.ended += output.finished
        if output.finished and self.ended == n:
            self.count_finished(aborted(output))
        payload = {"text": output.delta, "finish_reason": None, "last": self.ended == n, "sequence_index": index,
                   "logprobs": [s.logprob for s in output.logprobs[:keep]] if spec.log_probs else []}
        if output.finished:
            payload["finish_reason"] = output.result.finish_reason
        if spec.num_input_tokens:  # on every output, as tensorrtllm_backend's responses carry them: so far
            payload["num_input_tokens"] = len(spec.prompt_ids)
        if spec.num_output_tokens:
            payload["num_output_tokens"] = self.generated[output.request_id]
        if spec.perf_metrics and output.metrics is not None:
            payload["perf"] = perf_metrics(output.metrics)
        self.send(("out", self.call_id, payload))
