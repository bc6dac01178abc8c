"""tensorrtllm_backend request tensors → SamplingParams, without a server: values a buggy client sends are refused
naming the tensor, never read as something else."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from camshaft.errors import RequestError
from camshaft.triton_repo.protocol import one, token_request

from tiny_models import tokenizer_json

VOCAB = 384


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    tokenizer_json(root, VOCAB)
    return PreTrainedTokenizerFast.from_pretrained(str(root))


def request(**tensors):
    values = {"input_ids": np.array([[5, 6, 7]], np.int32), "request_output_len": np.array([[4]], np.int32)}
    values.update({k: np.asarray(v) for k, v in tensors.items()})
    return token_request(values, eos_token_ids=(2,), exclude_default=False, vocab_size=VOCAB)


def words(*word_ids: list[int]) -> np.ndarray:
    flat = [t for w in word_ids for t in w]
    ends = list(np.cumsum([len(w) for w in word_ids]))
    return np.array([[flat, ends + [-1] * (len(flat) - len(ends))]], np.int32)


@pytest.mark.parametrize(("tensors", "message"), [
    ({"stop_words_list": words([5, 100_000])}, "stop_words_list word 0 holds ids outside this model's vocabulary"),
    ({"bad_words_list": words([40, 41], [-3, 5])}, "bad_words_list word 1 holds ids outside"),
    ({"stop_words_list": words(*[[7]] * 1025)}, "stop_words_list holds 1025 words; send at most 1024"),
    ({"runtime_top_p": np.array([[-0.5]], np.float32)}, "runtime_top_p must be in [0, 1]"),
    ({"end_id": np.array([[-5]], np.int32)}, "end_id must be a token id or -1"),
    ({"num_return_sequences": np.array([[0]], np.int32)}, "num_return_sequences must be 1, got 0"),
    ({"stop_words": np.array([[b"\xff\xfe"]], np.object_)}, "stop_words is not UTF-8"),
])
def test_bad_tensors_are_refused_naming_them(tensors, message):
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        request(**tensors)


def test_valid_word_lists_become_id_sequences(tokenizer):
    hello, hi = tokenizer.encode("hello", add_special_tokens=False), tokenizer.encode("hi", add_special_tokens=False)
    partial = next(i for i in range(VOCAB) if tokenizer.decode([i]) == "\ufffd")  # part of a character: ids match
    params = request(stop_words_list=words([9], hello, [2, partial]), bad_words_list=words(hi),
                     end_id=np.array([[-1]], np.int32)).params
    assert params.stop_word_ids == ((9,), tuple(hello), (2, partial)) and params.stop == ()
    assert params.stop_token_ids == ()
    assert params.bad_word_ids == (tuple(hi),) and params.bad_words == ()  # banned as ids, as TensorRT-LLM does
    assert params.ignore_eos


def test_invalid_utf8_text_is_refused():
    with pytest.raises(RequestError, match=r"text_input is not UTF-8 \(byte 1 of 3\)"):
        one({"text_input": np.array([[b"a\xffb"]], np.object_)}, "text_input")


def test_min_length_is_the_older_name_of_min_tokens():
    assert request(min_length=np.array([[3]], np.int32)).params.min_tokens == 3
    assert request(min_length=np.array([[3]], np.int32), min_tokens=np.array([[2]], np.int32)).params.min_tokens == 2
