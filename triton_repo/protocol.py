"""tensorrtllm_backend request tensors -> camshaft SamplingParams (no Triton import: testable anywhere).

Values are numpy arrays as Triton hands them over, batch dimension first. A token-model request may hold several
prompts (input_ids [B, L] with input_lengths [B, 1]), split into one request each as tensorrtllm_backend does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from camshaft.errors import RequestError, ServerBusyError, ServerClosedError
from camshaft.runtime.guided import GuidedDecodingParams
from camshaft.runtime.outputs import RequestMetrics, RequestOutput
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.triton_repo.tensors import PARAMS_TO_TOKEN, renamed
from camshaft.triton_repo.word_lists import Values, embedding_bias, utf8_text, vocab_words


@dataclass(frozen=True)
class TokenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    streaming: bool
    exclude_input: bool
    log_probs: bool
    num_input_tokens: bool
    num_output_tokens: bool
    perf_metrics: bool = False


def error_status(exc: BaseException, names: dict[str, str] | None = None) -> tuple[str, str]:
    """(TritonError code name, message) of an exception a model answers with; `names`: the inputs a request error
    names as the model takes them (token_error_status)."""
    message = str(exc) or repr(exc)
    if names and isinstance(exc, RequestError):
        message = renamed(message, names)
    if isinstance(exc, ServerClosedError):  # the batch loop stopped: nothing this server can do until a restart
        return "UNAVAILABLE", message if "restart the server" in message else f"{message}; restart the server"
    if isinstance(exc, ServerBusyError):
        return "UNAVAILABLE", message
    return ("INVALID_ARG" if isinstance(exc, RequestError) else "INTERNAL"), message


def token_error_status(exc: BaseException) -> tuple[str, str]:
    """error_status for the token model: SamplingParams' names (max_tokens, top_p, ...) as its clients send them
    (request_output_len, runtime_top_p, ...; the text models rename them back: text_model.TOKEN_TO_TEXT)."""
    return error_status(exc, PARAMS_TO_TOKEN)


def one(values: Values, name: str):
    """The single value of a per-request scalar input, or None when it was not sent."""
    array = values.get(name)
    if array is None:
        return None
    flat = array.reshape(-1)
    if flat.size != 1:
        raise RequestError(f"{name} must hold one value a prompt (shape [1, 1]; B prompts: [B, 1]), got shape "
                           f"{list(array.shape)}")
    value = flat[0]
    return utf8_text(value, name) if isinstance(value, bytes) else value.item()


def strings(values: Values, name: str) -> tuple[str, ...]:
    array = values.get(name)
    if array is None:
        return ()
    words = [utf8_text(w, name) if isinstance(w, bytes) else str(w) for w in array.reshape(-1)]
    return tuple(w for w in words if w)


GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}


def guided(kind: str | None, guide: str | None) -> GuidedDecodingParams | None:
    """TensorRT-LLM's guided_decoding_guide_type / guided_decoding_guide as GuidedDecodingParams."""
    if kind is None:
        if guide is not None:
            raise RequestError("guided_decoding_guide needs guided_decoding_guide_type (json_schema, regex, "
                               "ebnf_grammar or json)")
        return None
    if kind not in GUIDE_TYPES:
        raise RequestError(f"guided_decoding_guide_type {kind!r} is not supported; use one of {', '.join(GUIDE_TYPES)}")
    if kind == "json":  # any JSON object or array (xgrammar's JSON grammar, which TensorRT-LLM uses): no guide
        return GuidedDecodingParams(json={"type": ["object", "array"]})
    if not guide:
        raise RequestError(f"guided_decoding_guide_type {kind} needs guided_decoding_guide (the schema, regex or "
                           "grammar text)")
    return GuidedDecodingParams(**{GUIDE_TYPES[kind]: guide})


def batch_rows(values: Values) -> list[Values]:
    """A request's prompts, each with its row of every input (Triton checks that all inputs have as many rows);
    input_lengths says where each prompt's padding starts, as tensorrtllm_backend's clients send it."""
    ids = values.get("input_ids")
    batch = ids.shape[0] if ids is not None and ids.ndim >= 2 else 1
    if batch == 1:
        return [values]
    if values.get("input_lengths") is None:
        raise RequestError(f"input_ids holds {batch} prompts: send input_lengths, shape [{batch}, 1], each prompt's "
                           "length (the rest of its row is padding)")
    return split_rows(values, batch)


def split_rows(values: Values, batch: int) -> list[Values]:
    return [{name: array[row:row + 1] for name, array in values.items()} for row in range(batch)]


def token_request(values: Values, *, eos_token_ids: Sequence[int], exclude_default: bool,
                  vocab_size: int) -> TokenRequest:
    """One prompt's request (a row of batch_rows)."""
    ids_array = values.get("input_ids")
    if ids_array is None:
        raise RequestError("input_ids is required: the prompt's token ids, shape [1, L] INT32")
    if ids_array.ndim >= 2 and ids_array.shape[0] != 1:
        raise RequestError(f"input_ids holds {ids_array.shape[0]} prompts; split them with batch_rows first")
    prompt = [int(t) for t in ids_array.reshape(-1)]
    if not prompt:
        raise RequestError("input_ids is empty; send at least one token id, shape [1, L] INT32")
    length = one(values, "input_lengths")
    if length is not None:
        if not 0 < length <= len(prompt):
            raise RequestError(f"input_lengths {length} must be in 1..{len(prompt)} (the input_ids given)")
        prompt = prompt[:length]
    max_tokens = one(values, "request_output_len")
    if max_tokens is None:
        raise RequestError("request_output_len is required: the number of tokens to generate")
    for name in ("return_context_logits", "return_generation_logits"):
        if one(values, name):
            raise RequestError(f"{name} is not supported by camshaft's Triton models; leave it false")
    check_unsupported(values)
    return TokenRequest(prompt, sampling_params(values, eos_token_ids, max_tokens, vocab_size),
                        bool(one(values, "streaming")),
                        bool(exclude_default if one(values, "exclude_input_in_output") is None
                             else one(values, "exclude_input_in_output")),
                        bool(one(values, "return_log_probs")), bool(one(values, "return_num_input_tokens")),
                        bool(one(values, "return_num_output_tokens")), bool(one(values, "return_perf_metrics")))


def perf_metrics(metrics: RequestMetrics) -> dict[str, int | float]:
    """return_perf_metrics' outputs, as TensorRT-LLM names them (times: nanoseconds of the monotonic clock, as its
    steady_clock; 0 for one not reached)."""
    times = {"arrival": metrics.arrival_time, "first_scheduled": metrics.first_scheduled_time,
             "first_token": metrics.first_token_time, "last_token": metrics.last_token_time}
    return {"kv_cache_alloc_new_blocks": metrics.kv_blocks_new, "kv_cache_reused_blocks": metrics.kv_blocks_reused,
            "kv_cache_alloc_total_blocks": metrics.kv_blocks_total,
            **{f"{name}_time_ns": 0 if t is None else round(t * 1e9) for name, t in times.items()},
            "acceptance_rate": metrics.acceptance_rate, "total_accepted_draft_tokens": metrics.accepted_draft_tokens,
            "total_draft_tokens": metrics.draft_tokens}


def check_one_response(specs: Sequence[TokenRequest]) -> None:
    """The token model deployed not decoupled (tensorrtllm_backend's decoupled_mode false): one response a request."""
    for wanted, what in ((any(s.streaming for s in specs), "streaming=true"),
                         (any(s.params.n > 1 for s in specs), "num_return_sequences > 1"),
                         (len(specs) > 1, f"a batch of {len(specs)} prompts")):
        if wanted:
            raise RequestError(f"{what} needs several responses, and tensorrt_llm is deployed not decoupled (one "
                               "response a request); leave it out, or deploy decoupled (camshaft deploy without "
                               "--no-decoupled)")


def check_unsupported(values: Values) -> None:
    """What tensorrtllm_backend's stock ensemble sends the token model: its defaults pass (the preprocessing model
    sends a one-id decoder input and an empty prompt table always); anything asking for encoder-decoder models,
    prompt tuning or LoRA, which camshaft lacks, is refused."""
    decoder_ids, decoder_length = values.get("decoder_input_ids"), one(values, "decoder_input_lengths")
    if (decoder_ids is not None and decoder_ids.size > 1) or (decoder_length or 0) > 1:
        raise RequestError("decoder_input_ids are for encoder-decoder models, which camshaft does not serve; leave "
                           "decoder_text_input out")
    for name, what in (("prompt_embedding_table", "prompt tuning (p-tuning)"), ("prompt_table_extra_ids",
                       "prompt tuning (p-tuning)"), ("lora_task_id", "LoRA"), ("lora_weights", "LoRA"),
                       ("lora_config", "LoRA")):
        if values.get(name) is not None and values[name].size:
            raise RequestError(f"{name}: {what} is not supported by camshaft; leave it out")
    if (one(values, "prompt_vocab_size") or 0) > 0:
        raise RequestError("prompt_vocab_size: prompt tuning (p-tuning) is not supported by camshaft; leave it out")


def sampling_params(values: Values, eos_token_ids: Sequence[int], max_tokens: int,
                    vocab_size: int) -> SamplingParams:
    kwargs: dict = {"max_tokens": max_tokens}
    for source, target in (("runtime_top_k", "top_k"), ("min_tokens", "min_tokens"),
                           ("repetition_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"),
                           ("frequency_penalty", "frequency_penalty"), ("beam_width", "beam_width"),
                           ("num_return_sequences", "n")):
        value = one(values, source)
        if value is not None:
            kwargs[target] = value
    if kwargs.get("n", 1) < 1:
        raise RequestError(f"num_return_sequences must be at least 1, got {kwargs['n']}")
    if kwargs.get("beam_width", 1) > 1:
        raise RequestError(f"beam_width {kwargs['beam_width']}: beam search is not supported by camshaft; send "
                           "beam_width 1 (several outputs of one prompt: num_return_sequences > 1, with top_k or "
                           "top_p to sample them)")
    top_p = one(values, "runtime_top_p")
    if top_p is not None and not 0 <= top_p <= 1:
        raise RequestError(f"runtime_top_p must be in [0, 1] (0 turns it off), got {top_p}")
    if kwargs.get("top_k", 0) < 0:
        raise RequestError(f"runtime_top_k must be >= 0 (0 turns it off), got {kwargs['top_k']}")
    if top_p is not None and top_p > 0:  # tensorrtllm_backend: 0 turns top-p off
        kwargs["top_p"] = top_p
    # TensorRT-LLM's rule: top_k and top_p both 0 (their defaults) is greedy, whatever the temperature; either one
    # above 0 samples, at temperature 1 unless sent, with seed 0 unless sent (identical requests answer alike)
    sampled = kwargs.get("top_k", 0) > 0 or "top_p" in kwargs
    temperature = one(values, "temperature")
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):  # greedy or not
        raise RequestError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    kwargs["temperature"] = (1.0 if temperature is None else temperature) if sampled else 0.0
    seed = one(values, "seed")
    seed = one(values, "random_seed") if seed is None else seed
    kwargs["seed"] = int(seed) if seed is not None else 0
    kwargs["logit_bias"] = embedding_bias(values.get("embedding_bias"), vocab_size)
    kwargs["guided_decoding"] = guided(one(values, "guided_decoding_guide_type"), one(values, "guided_decoding_guide"))
    min_length = "min_tokens" not in kwargs and one(values, "min_length") is not None  # older backend clients
    if min_length:
        kwargs["min_tokens"] = one(values, "min_length")
    if one(values, "return_log_probs"):
        kwargs["logprobs"] = 0
    stop_ids, stop = [], strings(values, "stop_words")
    stop_words = vocab_words(values.get("stop_words_list"), "stop_words_list", vocab_size)  # matched as ids
    end_id = one(values, "end_id")
    if end_id is not None and end_id < -1:
        raise RequestError(f"end_id must be a token id or -1 (never stop on an end id), got {end_id}")
    # end_id replaces the engine's end ids (TensorRT-LLM stops on it alone, also where the model has several); -1:
    # never stop on one
    if end_id is not None and (end_id not in eos_token_ids or len(eos_token_ids) > 1):
        kwargs["ignore_eos"] = True
        if end_id >= vocab_size:
            raise RequestError(f"end_id {end_id} is outside this model's vocabulary [0, {vocab_size}); pass a "
                               "token id or -1 (never stop on an end id)")
        if end_id >= 0:
            stop_ids.append(end_id)
    bad = list(strings(values, "bad_words"))
    bad_ids = vocab_words(values.get("bad_words_list"), "bad_words_list", vocab_size)  # banned as ids, as TRT-LLM
    try:
        return SamplingParams(**kwargs, stop=tuple(stop), stop_token_ids=tuple(stop_ids), bad_words=tuple(bad),
                              stop_word_ids=tuple(map(tuple, stop_words)), bad_word_ids=tuple(map(tuple, bad_ids)))
    except RequestError as exc:  # named as the client sent it
        if min_length:
            raise RequestError(renamed(str(exc), {"min_tokens": "min_length"})) from None
        raise


def ended_on_end_id(output: RequestOutput) -> bool:
    """The last token is the end id that stopped the sequence (a stop word's ids are not one)."""
    return bool(output.finished and output.token_ids and output.result is not None
                and output.result.stop_token_id is not None)


def aborted(output: RequestOutput) -> bool:
    return output.result is not None and output.result.finish_reason == "abort"
