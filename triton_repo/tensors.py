"""Tensor names, types and shapes of the generated models, after TensorRT-LLM's triton_backend
(all_models/inflight_batcher_llm: `tensorrt_llm` for tokens, `ensemble`/`tensorrt_llm_bls` for text).

Every model has a batch dimension (max_batch_size > 0), so clients send shape [1, ...] per request, as with
tensorrtllm_backend. Inputs marked EXT are camshaft extensions the text models send the token model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton type without the TYPE_ prefix
    dims: tuple[int, ...] = (1,)
    optional: bool = True


def _s(name: str, dtype: str, dims: tuple[int, ...] = (1,), optional: bool = True) -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional)


# Sampling inputs shared by both levels: (text name, token-model name, type).
SAMPLING = (
    ("end_id", "end_id", "INT32"), ("pad_id", "pad_id", "INT32"), ("top_k", "runtime_top_k", "INT32"),
    ("top_p", "runtime_top_p", "FP32"), ("temperature", "temperature", "FP32"),
    ("length_penalty", "len_penalty", "FP32"), ("repetition_penalty", "repetition_penalty", "FP32"),
    ("min_tokens", "min_tokens", "INT32"), ("min_length", "min_length", "INT32"),  # min_length: the older name
    ("presence_penalty", "presence_penalty", "FP32"),
    ("frequency_penalty", "frequency_penalty", "FP32"), ("seed", "seed", "UINT64"),
    ("random_seed", "random_seed", "UINT64"),  # the name before TensorRT-LLM 0.12
    ("beam_width", "beam_width", "INT32"), ("num_return_sequences", "num_return_sequences", "INT32"),
    ("return_log_probs", "return_log_probs", "BOOL"), ("exclude_input_in_output", "exclude_input_in_output", "BOOL"),
    ("return_num_input_tokens", "return_num_input_tokens", "BOOL"),
    ("return_num_output_tokens", "return_num_output_tokens", "BOOL"),
    ("return_context_logits", "return_context_logits", "BOOL"),
    ("return_generation_logits", "return_generation_logits", "BOOL"),
    ("return_perf_metrics", "return_perf_metrics", "BOOL"),
    ("guided_decoding_guide_type", "guided_decoding_guide_type", "STRING"),
    ("guided_decoding_guide", "guided_decoding_guide", "STRING"),
)
TEXT_TO_TOKEN = {text: token for text, token, _ in SAMPLING} | {"max_tokens": "request_output_len",
                                                                   "stream": "streaming"}
# SamplingParams' names of what the token model takes under another, and the text models' names of the token model's
PARAMS_TO_TOKEN = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "max_tokens": "request_output_len",
                   "bad_word_ids": "bad_words_list", "stop_word_ids": "stop_words_list", "logit_bias": "embedding_bias",
                   "n": "num_return_sequences", "stop": "stop_words"}
TOKEN_TO_TEXT = {token: text for text, token in TEXT_TO_TOKEN.items() if token != text}
OPENING_ONLY = ("n", "stop")  # also plain words: renamed only where they open the message


def renamed(message: str, names: dict[str, str]) -> str:
    """An error message with the input names in `names` renamed (whole words; OPENING_ONLY where they open it)."""
    words = [name for name in names if name not in OPENING_ONLY]
    message = re.sub(rf"\b({'|'.join(map(re.escape, words))})\b", lambda m: names[m[1]], message)
    opening = next((name for name in OPENING_ONLY if name in names and message.startswith(f"{name} ")), None)
    return names[opening] + message[len(opening):] if opening else message

TOKEN_INPUTS = (
    _s("input_ids", "INT32", (-1,)),  # optional only for `stop` requests; checked by the model
    _s("input_lengths", "INT32"),
    _s("request_output_len", "INT32"),
    _s("stop_words_list", "INT32", (2, -1)), _s("bad_words_list", "INT32", (2, -1)),
    *(_s(token, dtype) for _, token, dtype in SAMPLING),
    _s("streaming", "BOOL"), _s("stop", "BOOL"),
    _s("stop_words", "STRING", (-1,)), _s("bad_words", "STRING", (-1,)),  # EXT: strings, as the text model gets them
    _s("embedding_bias", "FP32", (-1,)),
)
# Declared so that tensorrtllm_backend's stock `ensemble` (which maps them) loads over this token model: the inputs
# are refused when they ask for what camshaft lacks (protocol.check_unsupported); of the outputs, batch_index is
# sent with every response and PERF_OUTPUTS with return_perf_metrics.
STOCK_INPUTS = (
    _s("decoder_input_ids", "INT32", (-1,)), _s("decoder_input_lengths", "INT32"),
    _s("prompt_embedding_table", "FP16", (-1, -1)), _s("prompt_vocab_size", "INT32"),
    _s("prompt_table_extra_ids", "UINT64", (-1,)),
    _s("lora_task_id", "UINT64"), _s("lora_weights", "FP16", (-1, -1)), _s("lora_config", "INT32", (-1, 3)),
)
# return_perf_metrics: on a sequence's last response (times in nanoseconds of the monotonic clock)
PERF_OUTPUTS = (
    *(_s(f"kv_cache_{n}_blocks", "INT32") for n in ("alloc_new", "reused", "alloc_total")),
    *(_s(f"{n}_time_ns", "INT64") for n in ("arrival", "first_scheduled", "first_token", "last_token")),
    _s("acceptance_rate", "FP32"), _s("total_accepted_draft_tokens", "INT32"), _s("total_draft_tokens", "INT32"),
)
STOCK_OUTPUTS = (
    _s("context_logits", "FP32", (-1, -1)), _s("generation_logits", "FP32", (-1, -1, -1)),
    _s("batch_index", "INT32"),
    *PERF_OUTPUTS,
)
TOKEN_INPUTS += STOCK_INPUTS
TOKEN_OUTPUTS = (
    _s("output_ids", "INT32", (-1, -1)), _s("sequence_length", "INT32", (-1,)),
    _s("cum_log_probs", "FP32", (-1,)), _s("output_log_probs", "FP32", (-1, -1)),
    _s("num_input_tokens", "INT32"), _s("num_output_tokens", "INT32"),
    _s("text_output", "STRING", (-1,)),  # EXT: the text delta of the new tokens (stop strings applied)
    _s("finish_reason", "STRING", (-1,)),  # EXT: on the last response only: length, stop, abort
    _s("sequence_index", "INT32"),  # which of num_return_sequences a response is for
    *STOCK_OUTPUTS,
)

TEXT_INPUTS = (
    _s("text_input", "STRING", optional=False),
    _s("max_tokens", "INT32", optional=False),
    _s("bad_words", "STRING", (-1,)), _s("stop_words", "STRING", (-1,)),
    _s("embedding_bias_words", "STRING", (-1,)), _s("embedding_bias_weights", "FP32", (-1,)),
    *(_s(text, dtype) for text, _, dtype in SAMPLING),
    _s("stream", "BOOL"),
)
TEXT_OUTPUTS = (
    _s("text_output", "STRING", (-1,)), _s("sequence_index", "INT32"), _s("batch_index", "INT32"),
    _s("cum_log_probs", "FP32", (-1,)), _s("output_log_probs", "FP32", (-1, -1)),
    _s("num_input_tokens", "INT32"), _s("num_output_tokens", "INT32"),
    *PERF_OUTPUTS,
)


def config_block(kind: str, specs: tuple[TensorSpec, ...]) -> str:
    items = []
    for s in specs:
        dims = ", ".join(str(d) for d in s.dims)
        optional = "\n    optional: true" if s.optional and kind == "input" else ""
        items.append(f'  {{\n    name: "{s.name}"\n    data_type: TYPE_{s.dtype}\n    dims: [ {dims} ]{optional}\n  }}')
    return f"{kind} [\n" + ",\n".join(items) + "\n]\n"
