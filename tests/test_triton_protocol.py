"""tensorrtllm_backend request tensors → SamplingParams, without a server: values a buggy client sends are refused
naming the tensor, never read as something else."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from camshaft.errors import RequestError
from camshaft.triton_repo.parameters import check_model_parameters, check_parameters
from camshaft.triton_repo.protocol import batch_rows, one, token_error_status, token_request
from camshaft.triton_repo.word_lists import text_embedding_bias

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
    ({"runtime_top_p": np.array([[2.0]], np.float32)}, "runtime_top_p must be in [0, 1] (0 turns it off), got 2.0"),
    ({"runtime_top_k": np.array([[-1]], np.int32)}, "runtime_top_k must be >= 0 (0 turns it off), got -1"),
    ({"temperature": np.array([[-5.0]], np.float32)}, "temperature must be a finite number >= 0"),  # greedy too
    ({"temperature": np.array([[np.nan]], np.float32)}, "temperature must be a finite number >= 0"),
    ({"temperature": np.array([[-1.0]], np.float32), "runtime_top_k": np.array([[5]], np.int32)},
     "temperature must be a finite number >= 0"),
    ({"request_output_len": np.array([[-1]], np.int32)}, "request_output_len must be at least 1, got -1"),
    ({"request_output_len": np.array([[3]], np.int32), "min_tokens": np.array([[10]], np.int32)},
     "min_tokens must be between 0 and request_output_len (3), got 10"),
    ({"end_id": np.array([[-5]], np.int32)}, "end_id must be a token id or -1"),
    ({"num_return_sequences": np.array([[0]], np.int32)}, "num_return_sequences must be at least 1, got 0"),
    ({"stop_words": np.array([[b"\xff\xfe"]], np.object_)}, "stop_words is not UTF-8"),
    ({"stop_words": np.array([[f"w{i}".encode() for i in range(65)]], np.object_)},
     "stop_words takes at most 64 strings"),  # SamplingParams' own name for them is stop
])
def test_bad_tensors_are_refused_naming_them(tensors, message):
    with pytest.raises(RequestError) as refused:
        request(**tensors)
    assert message in token_error_status(refused.value)[1]  # as the token model answers


def test_the_token_model_names_its_own_inputs_in_every_request_error():
    from camshaft.errors import CapacityError, ServerBusyError

    too_long = CapacityError("prompt (3 tokens) + max_tokens (1000) exceeds the engine's max_seq_len (128); pass "
                             "max_tokens <= 125 or shorten the prompt")  # the scheduler's, at submit
    assert token_error_status(too_long) == ("INVALID_ARG", "prompt (3 tokens) + request_output_len (1000) exceeds the "
                                            "engine's max_seq_len (128); pass request_output_len <= 125 or shorten "
                                            "the prompt")
    busy = ServerBusyError("server busy: top_p")  # not a request error: as it is
    assert token_error_status(busy) == ("UNAVAILABLE", "server busy: top_p")


def test_valid_word_lists_become_id_sequences(tokenizer):
    hello, hi = tokenizer.encode("hello", add_special_tokens=False), tokenizer.encode("hi", add_special_tokens=False)
    partial = next(i for i in range(VOCAB) if tokenizer.decode([i]) == "\ufffd")  # part of a character: ids match
    params = request(stop_words_list=words([9], hello, [2, partial]), bad_words_list=words(hi),
                     end_id=np.array([[-1]], np.int32)).params
    assert params.stop_word_ids == ((9,), tuple(hello), (2, partial)) and params.stop == ()
    assert params.stop_token_ids == ()
    assert params.bad_word_ids == (tuple(hi),) and params.bad_words == ()  # banned as ids, as TensorRT-LLM does
    assert params.ignore_eos


def test_end_id_replaces_every_end_id_of_an_engine_with_several():
    """TensorRT-LLM stops on the end_id it is sent alone: one of several end ids (Llama 3 Instruct's) is no
    exception; sent the engine's only end id, nothing changes."""
    def sent(end_id: int, eos: tuple[int, ...]):
        values = {"input_ids": np.array([[5, 6]], np.int32), "request_output_len": np.array([[4]], np.int32),
                  "end_id": np.array([[end_id]], np.int32)}
        return token_request(values, eos_token_ids=eos, exclude_default=False, vocab_size=VOCAB).params

    several = sent(7, (2, 7))
    assert several.ignore_eos and several.stop_token_ids == (7,)
    only = sent(2, (2,))
    assert not only.ignore_eos and only.stop_token_ids == ()


def test_invalid_utf8_text_is_refused():
    with pytest.raises(RequestError, match=r"text_input is not UTF-8 \(byte 1 of 3\)"):
        one({"text_input": np.array([[b"a\xffb"]], np.object_)}, "text_input")


def test_min_length_is_the_older_name_of_min_tokens():
    assert request(min_length=np.array([[3]], np.int32)).params.min_tokens == 3
    assert request(min_length=np.array([[3]], np.int32), min_tokens=np.array([[2]], np.int32)).params.min_tokens == 2
    with pytest.raises(RequestError, match=r"^min_length must be between 0 and max_tokens"):  # the name it was sent as
        request(min_length=np.array([[-2]], np.int32))


def test_beam_search_refusal_names_what_a_triton_client_can_send_instead():
    with pytest.raises(RequestError, match=r"beam_width 2: beam search is not supported .*num_return_sequences > 1"):
        request(beam_width=np.array([[2]], np.int32))


@pytest.mark.parametrize(("tensors", "temperature", "top_k", "top_p"), [
    ({}, 0.0, 0, 1.0),  # TensorRT-LLM: top_k and top_p both 0 is greedy
    ({"temperature": np.array([[0.7]], np.float32)}, 0.0, 0, 1.0),  # ... whatever the temperature
    ({"runtime_top_k": np.array([[0]], np.int32), "runtime_top_p": np.array([[0.0]], np.float32)}, 0.0, 0, 1.0),
    ({"runtime_top_k": np.array([[50]], np.int32)}, 1.0, 50, 1.0),  # top-k sampling at temperature 1
    ({"runtime_top_p": np.array([[0.5]], np.float32)}, 1.0, 0, 0.5),
    ({"runtime_top_k": np.array([[8]], np.int32), "temperature": np.array([[0.5]], np.float32)}, 0.5, 8, 1.0),
])
def test_greedy_or_sampled_as_tensorrt_llm_decides(tensors, temperature, top_k, top_p):
    params = request(**tensors).params
    assert (params.temperature, params.top_k, params.top_p) == pytest.approx((temperature, top_k, top_p))
    assert params.seed == 0  # TensorRT-LLM's default seed: identical requests answer alike
    assert request(**tensors, seed=np.array([[7]], np.uint64)).params.seed == 7


def test_embedding_bias_becomes_logit_bias():
    bias = np.zeros((1, VOCAB), np.float32)
    bias[0, [3, 40]] = [-100.0, 2.5]
    assert request(embedding_bias=bias).params.logit_bias == ((3, -100.0), (40, 2.5))
    assert request(embedding_bias=np.zeros((1, 0), np.float32)).params.logit_bias == ()  # empty: none
    short = np.zeros((1, 7), np.float32)
    short[0, 6] = 1.5  # a tokenizer's vocabulary, shorter than the engine's: the rest 0
    assert request(embedding_bias=short).params.logit_bias == ((6, 1.5),)
    for array, message in ((np.zeros((1, VOCAB + 1), np.float32), rf"shape \[1, {VOCAB}\], got \[1, {VOCAB + 1}\]"),
                           (np.where(np.arange(VOCAB) == 5, -1e9, 0).astype(np.float32)[None], r"\[-100, 100\]"),
                           (np.where(np.arange(VOCAB) == 5, np.nan, 0).astype(np.float32)[None], "finite")):
        with pytest.raises(RequestError, match=message):
            request(embedding_bias=array)
    values = {"input_ids": np.array([[5]], np.int32), "request_output_len": np.array([[4]], np.int32),
              "embedding_bias": np.full((1, 2000), 0.5, np.float32)}
    with pytest.raises(RequestError, match="2000 non-zero entries; send at most 1024"):
        token_request(values, eos_token_ids=(2,), exclude_default=False, vocab_size=2000)


def test_text_embedding_bias_adds_each_words_weight_to_its_tokens(tokenizer):
    words = np.array([[b"hello", b"hi", b"hello"]], np.object_)
    bias = text_embedding_bias(tokenizer, {"embedding_bias_words": words,
                                           "embedding_bias_weights": np.array([[1.5, -3.0, 0.5]], np.float32)}, VOCAB)
    expected = np.zeros(VOCAB, np.float32)
    for word, weight in (("hello", 1.5), ("hi", -3.0), ("hello", 0.5)):
        for token in tokenizer.encode(word, add_special_tokens=False):  # the stock preprocessing model's loop:
            expected[token] += weight  # hello's two l's add twice
    np.testing.assert_array_equal(bias.reshape(-1), expected)
    assert bias[0, tokenizer.convert_tokens_to_ids("l")] == 2 * (1.5 + 0.5)
    assert text_embedding_bias(tokenizer, {}, VOCAB) is None
    for weights in ([[-60.0, 1.0, -60.0]], [[np.inf, 1.0, 1.0]]):
        with pytest.raises(RequestError, match=r"embedding_bias_weights give token \d+ a bias of .*\[-100, 100\]"):
            text_embedding_bias(tokenizer, {"embedding_bias_words": words,
                                            "embedding_bias_weights": np.array(weights, np.float32)}, VOCAB)
    class OneIdEach:  # a vocabulary larger than logit_bias takes
        @staticmethod
        def encode(word, add_special_tokens):
            return [int(word)]

    many = {"embedding_bias_words": np.array([[str(i).encode() for i in range(1025)]], np.object_),
            "embedding_bias_weights": np.ones((1, 1025), np.float32)}
    with pytest.raises(RequestError, match="embedding_bias_words cover 1025 tokens; send words of at most 1024"):
        text_embedding_bias(OneIdEach, many, 2000)
    with pytest.raises(RequestError, match="holds 3 words and embedding_bias_weights 2 weights"):
        text_embedding_bias(tokenizer, {"embedding_bias_words": words,
                                        "embedding_bias_weights": np.array([[1.0, 2.0]], np.float32)}, VOCAB)


def test_request_parameters_other_than_the_id_are_refused():
    check_parameters("{}", ["text_input"])
    check_parameters('{"id": "abc"}', ["text_input"])
    with pytest.raises(RequestError, match="unknown input 'temprature'.*inputs: text_input, max_tokens"):
        check_parameters('{"temprature": 1.5, "id": "a"}', ["text_input", "max_tokens"])


def test_guided_decoding_inputs_as_tensorrt_llm_names_them():
    def guided(kind=None, guide=None):
        tensors = {}
        if kind is not None:
            tensors["guided_decoding_guide_type"] = np.array([[kind.encode()]], np.object_)
        if guide is not None:
            tensors["guided_decoding_guide"] = np.array([[guide.encode()]], np.object_)
        return request(**tensors).params.guided_decoding

    assert guided() is None
    assert json.loads(guided("json").json) == {"type": ["object", "array"]}
    assert guided("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}').json is not None
    assert guided("regex", "[0-9]+").regex == "[0-9]+"
    assert guided("ebnf_grammar", 'root ::= "a" | "b"').grammar == 'root ::= "a" | "b"'
    for kind, guide, message in (("structural_tag", "{}", "'structural_tag' is not supported"),
                                 ("regex", None, "regex needs guided_decoding_guide"),
                                 (None, "[0-9]", "guided_decoding_guide needs guided_decoding_guide_type"),
                                 ("json_schema", "{oops", "not JSON")):
        with pytest.raises(RequestError, match=message):
            guided(kind, guide)


def test_a_batch_splits_into_one_request_a_prompt_as_tensorrtllm_backend():
    values = {"input_ids": np.array([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]], np.int32),
              "input_lengths": np.array([[3], [2], [4]], np.int32),
              "request_output_len": np.array([[4], [6], [2]], np.int32),
              "runtime_top_k": np.array([[3], [3], [3]], np.int32),
              "stop_words_list": np.concatenate([words([9], [1]), words([10, 4]), words([11, 12])])}
    specs = [token_request(row, eos_token_ids=(2,), exclude_default=False, vocab_size=VOCAB)
             for row in batch_rows(values)]
    assert [s.prompt_ids for s in specs] == [[5, 6, 7], [8, 9], [1, 2, 3, 4]]  # the padding dropped
    assert [s.params.max_tokens for s in specs] == [4, 6, 2] and {s.params.top_k for s in specs} == {3}
    assert [s.params.stop_word_ids for s in specs] == [((9,), (1,)), ((10, 4),), ((11, 12),)]
    single = {"input_ids": values["input_ids"][:1], "request_output_len": np.array([[4], [6]], np.int32)}
    assert batch_rows(single) == [single]  # one prompt: passed on as sent
    with pytest.raises(RequestError, match=r"input_ids holds 3 prompts: send input_lengths, shape \[3, 1\]"):
        batch_rows({k: v for k, v in values.items() if k != "input_lengths"})
    with pytest.raises(RequestError, match="split them with batch_rows first"):
        token_request(values, eos_token_ids=(2,), exclude_default=False, vocab_size=VOCAB)


def test_config_parameters_the_model_and_the_python_backend_read_are_taken_and_others_refused():
    from camshaft.errors import CamshaftError

    known = {"engine_dir", "llm_options"}
    check_model_parameters("tensorrt_llm", {"engine_dir": "e", "EXECUTION_ENV_PATH": "env.tar.gz",
                                            "FORCE_CPU_ONLY_INPUT_TENSORS": "no"}, known)  # the backend's own
    with pytest.raises(CamshaftError, match=r"parameter\(s\) batch_scheduler_policy, token_model_decoupled are not "
                                            r"read here .*for batch_scheduler_policy use camshaft deploy --policy "
                                            r"\(llm_options key policy\) \(a repository an older camshaft wrote: "
                                            r"deploy it again\)\. It reads engine_dir, llm_options"):
        check_model_parameters("tensorrt_llm", {"engine_dir": "e", "batch_scheduler_policy": "max_utilization",
                                                "token_model_decoupled": "true"}, known)


def test_the_model_shim_says_when_it_runs_another_camshaft_than_deployed(tmp_path, monkeypatch, capsys):
    """The stub imports the installed camshaft (camshaft_path only when there is none): one that differs from the
    camshaft that deployed the repository is said in the model's log, not run silently."""
    import json
    import os
    import sys
    from pathlib import Path

    import camshaft
    from camshaft.triton_repo.model_shim import TritonPythonModel

    (tmp_path / "stand_in.py").write_text("class Model:\n    def __init__(self, args, params):\n"
                                          "        self.params = params\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = str(Path(os.path.realpath(camshaft.__file__)).parents[1])
    for path, warned in ((installed, False), (str(tmp_path / "checkout"), True)):
        config = {"parameters": {"camshaft_model": {"string_value": "stand_in:Model"},
                                 "camshaft_path": {"string_value": path}}}
        model = TritonPythonModel()
        model.initialize({"model_config": json.dumps(config)})
        assert model.impl.params["camshaft_path"] == path
        err = capsys.readouterr().err
        assert ("runs the camshaft installed in" in err and f"not the one in {path}" in err) == warned, err
    sys.modules.pop("stand_in", None)
