"""OpenAI request bodies and their translation to SamplingParams.

Unknown fields are accepted and ignored (clients send `user`, `metadata`, ...); fields that would change the output
in ways camshaft cannot honour are refused. vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens) are accepted too, and its
request `priority`
(lower is scheduled first).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, model_validator

from camshaft.errors import RequestError
from camshaft.openai_server.chat_protocol import ChatMessage, TemplateOptions
from camshaft.runtime.guided import GuidedDecodingParams
from camshaft.runtime.sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; pass temperature=0 for greedy output
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # said in a warning, as the request's own fields

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: the usage so far on every chunk (with include_usage)


class _GenerationRequest(BaseModel):
    """Fields are strict (true or "2" is refused where a number is due, 1 where a boolean is, as OpenAI refuses them;
    an integer is a number)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null takes the field's default, as OpenAI's nullable fields do ("n": null is n = 1)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}

    model: str | None = None  # vLLM's: optional, the served model
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat = 1.0
    n: StrictInt = 1
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    # vLLM's extensions
    top_k: StrictInt = 0
    min_p: StrictFloat = 0.0
    repetition_penalty: StrictFloat = 1.0
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: StrictInt = 0
    # structured output: OpenAI's response_format, vLLM's guided_* fields and their newer structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's, refused rather than ignored: camshaft cannot honour them
    use_beam_search: StrictBool = False
    prompt_logprobs: StrictInt | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def stream_usage(self) -> str | None:
        """None, "final" (include_usage) or "continuous" (and vLLM's continuous_usage_stats)."""
        options = self.stream_options
        if options is None or not options.include_usage:
            return None
        return "continuous" if options.continuous_usage_stats else "final"

    @contextmanager
    def fields_named(self) -> Iterator[None]:
        """A RequestError raised inside names the field of this request it is about (its `param`)."""
        try:
            yield
        except RequestError as exc:
            exc.field = self.sent_field(exc.field)
            raise

    def sent_field(self, field: str | None) -> str | None:
        """This request's name of a RequestError's field (a SamplingParams one, or "prompt")."""
        if field == "guided_decoding":
            sent = self.constraints_sent()
            return sent[0] if len(sent) == 1 else None
        return field

    def constraints_sent(self) -> list[str]:
        """The structured-output fields sent that constrain the output (not response_format text, nor structured_outputs
        {})."""
        return [name for name in STRUCTURED if getattr(self, name) is not None
                and (name != "structured_outputs" or self.structured_outputs)
                and (name != "response_format" or self.response_format.get("type", "text") != "text")]

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options applies to streamed responses; set stream: true or leave it out",
                               field="stream_options")
        if self.use_beam_search:
            raise RequestError("use_beam_search is not supported: camshaft has no beam search; sample (n, temperature, "
                               "seed) instead", field="use_beam_search")
        if self.guided_whitespace_pattern is not None:
            raise RequestError("guided_whitespace_pattern is not supported: guided JSON is laid out as Python's "
                               "json.dumps writes it; for another layout put {\"x-guidance\": {\"whitespace_pattern\": "
                               "...}} in the schema, or leave it out", field="guided_whitespace_pattern")
        if self.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs is not returned by this server; for the prompt's log-probs send "
                               "/v1/completions echo: true with logprobs", field="prompt_logprobs")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        model_defaults: tuple[tuple[str, float], ...] = ()) -> SamplingParams:
        """model_defaults: the model's generation_config.json sampling, for the fields the request leaves out."""
        sent = {key: getattr(self, key) for key in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
                if key in self.model_fields_set}
        chosen = {"temperature": DEFAULT_TEMPERATURE} | dict(model_defaults) | sent
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=chosen["temperature"],
            top_k=chosen.get("top_k", self.top_k), top_p=chosen.get("top_p", self.top_p),
            min_p=chosen.get("min_p", self.min_p),
            repetition_penalty=chosen.get("repetition_penalty", self.repetition_penalty),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, bad_words=self.bad_words, ignore_eos=self.ignore_eos,
            logprobs=logprobs, n=self.n, include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.token_biases(), skip_special_tokens=self.skip_special_tokens,
            guided_decoding=self.guided_decoding())

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """What the output must match, from whichever one of the structured-output fields was sent."""
        given = {}
        response_format = self.response_format or {}
        kind = response_format.get("type", "text")
        spec = response_format.get("json_schema") or {}
        if kind == "json_object":
            given["response_format"] = GuidedDecodingParams(json_object=True)
        elif kind == "json_schema":
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):  # a schema sent as its JSON text would be read as "any JSON string"
                raise RequestError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'
                                   + ("" if schema is None else f", its schema a JSON object, got {schema!r:.60}"),
                                   field="response_format")
            given["response_format"] = GuidedDecodingParams(json=schema)
        elif kind != "text":
            raise RequestError(f"response_format type {kind!r:.40} is not supported; use text, json_object or "
                               "json_schema", field="response_format")
        vllm = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                  ("choice", self.guided_choice), ("grammar", self.guided_grammar)) if v is not None}
        if vllm:
            given["guided_" + "/".join(vllm)] = GuidedDecodingParams(**vllm)
        if self.structured_outputs:
            known = {"json", "json_object", "regex", "choice", "grammar"}
            unknown = set(self.structured_outputs) - known
            if unknown:
                raise RequestError(f"structured_outputs takes one of {', '.join(sorted(known))}; got "
                                   f"{', '.join(sorted(unknown))}", field="structured_outputs")
            given["structured_outputs"] = GuidedDecodingParams(**self.structured_outputs)
        if len(given) > 1:
            raise RequestError(f"send one structured-output constraint; got {', '.join(given)}")
        return next(iter(given.values()), None)

    def token_biases(self) -> dict[int, float]:
        """logit_bias's JSON keys (token ids written as strings) as ints."""
        biases = {}
        for key, bias in (self.logit_bias or {}).items():
            if not (key.strip().isascii() and key.strip().isdigit() and len(key.strip()) <= 1000):  # int()'s cap
                raise RequestError(f"logit_bias keys are token ids (e.g. \"50256\"), got {key!r:.40}",
                                   field="logit_bias")
            biases[int(key)] = bias
        return biases


class CompletionRequest(_GenerationRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens must be at least 1 (0 only with echo: the prompt and its log-probs)",
                               field="max_tokens")
        if self.suffix:
            raise RequestError("suffix (insertion) is not supported; leave it out", field="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of {self.best_of} differs from n {self.n}; camshaft has no best_of: use n",
                               field="best_of")

    def sent_field(self, field: str | None) -> str | None:
        if field == "prompt_logprobs" and self.prompt_logprobs is None:  # echo's, from logprobs
            return "logprobs"
        return super().sent_field(field)

    def prompts(self) -> list[str | list[int]]:
        """One prompt or several; each is text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class ChatCompletionRequest(_GenerationRequest, TemplateOptions):
    messages: list[ChatMessage]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    echo: StrictBool = False  # vLLM's: the reply begins with the last message's text when that is the assistant's

    def echoed(self, messages: list[dict[str, Any]]) -> str:
        last = messages[-1] if messages else {}
        return last.get("content") or "" if self.echo and last.get("role") == "assistant" else ""

    def sent_field(self, field: str | None) -> str | None:
        if field == "guided_decoding" and not self.constraints_sent():
            return "tools"  # tool_choice's schema of the tools
        return "messages" if field == "prompt" else super().sent_field(field)

    def check_supported(self) -> None:
        super().check_supported()
        self.check_template_options()
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise RequestError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                               field="max_completion_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", field="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise RequestError(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {self.top_logprobs}",
                               field="top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
