"""A tensorrtllm_backend-style `platform: "ensemble"` over camshaft's tensorrt_llm model, on the real tritonserver:
it loads (every tensor the stock ensemble maps to tensorrt_llm is declared, with the stock types, and the token
model's batch size holds the ensemble's), what the stock preprocessing always sends passes, return_perf_metrics
answers, and what camshaft lacks (LoRA, prompt tuning, encoder-decoder inputs) is refused by name; deployed not
decoupled, the same ensemble takes plain infer."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from test_triton import Stream, assert_same_ids
from tritonclient.utils import InferenceServerException

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session
from camshaft.triton_repo.deploy import deploy_repository
from camshaft.triton_repo.server import TritonServer

from tiny_models import make_tiny_model

# The tensors the stock ensemble's tensorrt_llm step maps, with the stock model's types and dims.
STOCK_INPUTS = [
    ("input_ids", "INT32", [-1]), ("input_lengths", "INT32", [1]), ("request_output_len", "INT32", [-1]),
    ("decoder_input_ids", "INT32", [-1]), ("decoder_input_lengths", "INT32", [1]), ("end_id", "INT32", [1]),
    ("pad_id", "INT32", [1]), ("streaming", "BOOL", [1]), ("return_perf_metrics", "BOOL", [1]),
    ("prompt_embedding_table", "FP16", [-1, -1]), ("prompt_vocab_size", "INT32", [1]),
    ("prompt_table_extra_ids", "UINT64", [-1]), ("lora_task_id", "UINT64", [1]), ("lora_weights", "FP16", [-1, -1]),
    ("lora_config", "INT32", [-1, 3]), ("embedding_bias", "FP32", [-1]), ("runtime_top_k", "INT32", [1]),
    ("runtime_top_p", "FP32", [1]), ("temperature", "FP32", [1]), ("len_penalty", "FP32", [1]),
    ("repetition_penalty", "FP32", [1]), ("min_tokens", "INT32", [1]), ("presence_penalty", "FP32", [1]),
    ("frequency_penalty", "FP32", [1]), ("seed", "UINT64", [1]), ("return_log_probs", "BOOL", [1]),
    ("return_context_logits", "BOOL", [1]), ("return_generation_logits", "BOOL", [1]), ("beam_width", "INT32", [1]),
    ("stop_words_list", "INT32", [2, -1]), ("bad_words_list", "INT32", [2, -1]),
    ("num_return_sequences", "INT32", [1]), ("exclude_input_in_output", "BOOL", [1]),
    ("guided_decoding_guide_type", "STRING", [1]), ("guided_decoding_guide", "STRING", [1]),
    ("return_num_input_tokens", "BOOL", [1]), ("return_num_output_tokens", "BOOL", [1]),
]
STOCK_OUTPUTS = [
    ("output_ids", "INT32", [-1, -1]), ("sequence_length", "INT32", [-1]), ("context_logits", "FP32", [-1, -1]),
    ("generation_logits", "FP32", [-1, -1, -1]), ("batch_index", "INT32", [1]), ("sequence_index", "INT32", [1]),
    ("cum_log_probs", "FP32", [-1]), ("output_log_probs", "FP32", [-1, -1]),
    ("kv_cache_alloc_new_blocks", "INT32", [1]), ("kv_cache_reused_blocks", "INT32", [1]),
    ("kv_cache_alloc_total_blocks", "INT32", [1]), ("arrival_time_ns", "INT64", [1]),
    ("first_scheduled_time_ns", "INT64", [1]), ("first_token_time_ns", "INT64", [1]),
    ("last_token_time_ns", "INT64", [1]), ("acceptance_rate", "FP32", [1]),
    ("total_accepted_draft_tokens", "INT32", [1]), ("total_draft_tokens", "INT32", [1]),
    ("num_input_tokens", "INT32", [1]), ("num_output_tokens", "INT32", [1]),
]
ENSEMBLE_BATCH = 64  # TensorRT-LLM's examples' triton_max_batch_size, far above the engine's batch of 4


def ensemble_config() -> str:
    def block(kind: str, specs, optional: bool) -> str:
        items = [f'{{ name: "{n}" data_type: TYPE_{t} dims: [ {", ".join(map(str, d))} ]'
                 f'{" optional: true" if optional else ""} }}' for n, t, d in specs]
        return f"{kind} [\n  " + ",\n  ".join(items) + "\n]\n"

    maps = "".join(f'    input_map {{ key: "{n}" value: "{n}" }}\n' for n, _, _ in STOCK_INPUTS)
    maps += "".join(f'    output_map {{ key: "{n}" value: "{n}" }}\n' for n, _, _ in STOCK_OUTPUTS)
    return (f'name: "stock_ensemble"\nplatform: "ensemble"\nmax_batch_size: {ENSEMBLE_BATCH}\n'
            + block("input", STOCK_INPUTS, True) + block("output", STOCK_OUTPUTS, False)
            + 'ensemble_scheduling {\n  step [\n  {\n    model_name: "tensorrt_llm"\n    model_version: -1\n'
            + maps + "  }\n  ]\n}\n")


def stock_server(root: Path, decoupled: bool = True) -> Iterator[tuple[TritonServer, Session]]:
    build_engine(BuildConfig(make_tiny_model("llama", root / "hf"), root / "engine", max_seq_len=256,
                             max_num_tokens=64, max_batch_size=4))
    repo = deploy_repository(root / "engine", root / "repo", decoupled=decoupled)
    (repo / "stock_ensemble" / "1").mkdir(parents=True)
    (repo / "stock_ensemble" / "config.pbtxt").write_text(ensemble_config())
    with TritonServer(repo, log_file=root / "tritonserver.log") as server, Session(root / "engine") as session:
        yield server, session


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    yield from stock_server(tmp_path_factory.mktemp("stock"))


def inputs(**values):
    types = {"INT32": np.int32, "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32, "BOOL": np.bool_}
    specs = {n: t for n, t, _ in STOCK_INPUTS}
    out = []
    for name, value in values.items():
        array = np.asarray(value, dtype=types[specs[name]])
        array = array if name in ("input_ids", "input_lengths", "request_output_len") and array.ndim == 2 else \
            array[None]
        tensor = grpcclient.InferInput(name, list(array.shape), specs[name])
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def test_the_stock_ensemble_loads_and_runs_what_its_preprocessing_sends(stock):
    server, session = stock
    prompt = [5, 9, 17, 33, 2, 41]
    # what the stock preprocessing sends with every request: a one-id decoder input, its length, and a bias of the
    # tokenizer's vocabulary (here shorter than the engine's), empty without bias words
    common = dict(input_ids=prompt, input_lengths=[len(prompt)], request_output_len=[8], decoder_input_ids=[0],
                  decoder_input_lengths=[1], end_id=[2], pad_id=[2], prompt_vocab_size=[0])
    outputs, error, _ = Stream(server.endpoints.grpc).run("stock_ensemble", inputs(**common))
    assert error is None, error
    ids = outputs[0]["output_ids"].reshape(-1).tolist()
    reference = session.generate(prompt, SamplingParams(max_tokens=8, logprobs=2))
    assert ids[:len(prompt)] == prompt
    assert_same_ids(ids[len(prompt):], reference, session.engine.eos_token_ids)
    bias = np.zeros(300, np.float32)
    bias[77] = 100.0
    outputs, error, _ = Stream(server.endpoints.grpc).run("stock_ensemble", inputs(**common, embedding_bias=bias))
    assert error is None and outputs[0]["output_ids"].reshape(-1).tolist()[len(prompt):] == [77] * 8


def test_a_batch_of_prompts_runs_as_one_request_each_naming_its_batch_index(stock):
    """input_ids [B, L] padded with input_lengths [B, 1], every input a row a prompt: as tensorrtllm_backend, each
    prompt runs as its own request with its own inputs, each response names its batch_index, and the final flag
    comes only after the last prompt's last response."""
    server, session = stock
    prompts, max_tokens = [[5, 9, 17, 33, 2, 41], [8, 3], [12, 13, 14, 15]], [6, 9, 3]
    width = max(map(len, prompts))
    for streaming in (False, True):
        inputs = typed_inputs(grpcclient, input_ids=[p + [2] * (width - len(p)) for p in prompts],
                              input_lengths=[[len(p)] for p in prompts], request_output_len=[[n] for n in max_tokens],
                              streaming=[[streaming]] * 3, exclude_input_in_output=[[True]] * 3)
        outputs, error, _ = Stream(server.endpoints.grpc).run("stock_ensemble", inputs)
        assert error is None, error
        got: dict[int, list[int]] = {}
        for o in outputs:
            got.setdefault(int(o["batch_index"].reshape(-1)[0]), []).extend(o["output_ids"].reshape(-1).tolist())
        assert sorted(got) == [0, 1, 2] and (len(outputs) == 3 or streaming)
        for row, prompt in enumerate(prompts):
            reference = session.generate(prompt, SamplingParams(max_tokens=max_tokens[row], logprobs=2))
            assert_same_ids(got[row], reference, session.engine.eos_token_ids)
    _, error, _ = Stream(server.endpoints.grpc).run("stock_ensemble", typed_inputs(
        grpcclient, input_ids=[[5, 9], [6, 7]], request_output_len=[[4], [4]]))
    assert error is not None and "input_ids holds 2 prompts: send input_lengths, shape [2, 1]" in str(error), error


def test_return_perf_metrics_gives_times_and_kv_block_reuse(stock):
    """TensorRT-LLM's perf outputs on every response (the stock client reads them from each: a review's run of it
    failed on the first, which had none), the last one's monotonic-clock times in order within the request's
    window, the prompt's blocks, and a second request with the same 70-token prompt reusing its two full blocks."""
    server, _ = stock
    prompt = [(7 * i) % 250 + 3 for i in range(70)]
    block = 32  # the engine's kv_block_size (the default)
    runs = []
    for _ in range(2):
        before = time.monotonic_ns()  # CLOCK_MONOTONIC, as the server's
        outputs, error, _ = Stream(server.endpoints.grpc).run("stock_ensemble", inputs(
            input_ids=prompt, input_lengths=[len(prompt)], request_output_len=[10], return_perf_metrics=[True],
            return_num_output_tokens=[True], streaming=[True]))
        assert error is None, error
        runs.append(({k: v.item() for k, v in outputs[-1].items() if v.size == 1}, before, time.monotonic_ns()))
        assert all("arrival_time_ns" in o for o in outputs)  # (outputs sampled together come as one response)
        counts = [o["num_output_tokens"].item() for o in outputs]  # so far
        lasts = [o["last_token_time_ns"].item() for o in outputs]
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 10 and lasts == sorted(lasts)
    for perf, before, after in runs:
        times = [perf[f"{n}_time_ns"] for n in ("arrival", "first_scheduled", "first_token", "last_token")]
        assert before <= times[0] <= times[1] <= times[2] <= times[3] <= after, (before, times, after)
        assert perf["kv_cache_alloc_total_blocks"] == perf["kv_cache_alloc_new_blocks"] + perf["kv_cache_reused_blocks"]
        assert perf["kv_cache_alloc_total_blocks"] == -(-len(prompt) // block)  # the prompt's: 70 tokens, 3 blocks
        assert (perf["total_draft_tokens"], perf["total_accepted_draft_tokens"], perf["acceptance_rate"]) == (0, 0, 0)
    assert [perf["kv_cache_reused_blocks"] for perf, _, _ in runs] == [0, len(prompt) // block]


def test_a_token_model_deployed_not_decoupled_answers_plain_infer_through_the_stock_ensemble(tmp_path):
    """tensorrtllm_backend's decoupled_mode false: the stock ensemble takes plain HTTP and gRPC infer and /generate,
    one response each, equal to Session's; what needs several responses is refused by name; as in a stock
    repository deployed so, camshaft's own text models (ensemble, tensorrt_llm_bls) answer plain infer too, and
    none streams."""
    prompt = [5, 9, 17, 33, 2, 41]
    for server, session in stock_server(tmp_path, decoupled=False):
        reference = session.generate(prompt, SamplingParams(max_tokens=8, logprobs=2))
        for module in (httpclient, grpcclient):
            client = module.InferenceServerClient(server.endpoints.http if module is httpclient
                                                  else server.endpoints.grpc)
            result = client.infer("stock_ensemble", typed_inputs(module, input_ids=[prompt], input_lengths=[[6]],
                                                                  request_output_len=[[8]]))
            ids = result.as_numpy("output_ids").reshape(-1).tolist()
            assert ids[:len(prompt)] == prompt
            assert_same_ids(ids[len(prompt):], reference, session.engine.eos_token_ids)
            for extra, message in ((dict(streaming=[[True]]), "streaming=true needs several responses"),
                                   (dict(num_return_sequences=[[2]]), "num_return_sequences > 1 needs several"),
                                   (dict(input_ids=[prompt, prompt], input_lengths=[[6], [6]],
                                         request_output_len=[[8], [8]]), "a batch of 2 prompts needs several")):
                with pytest.raises(InferenceServerException, match=re.escape(message)):
                    client.infer("stock_ensemble", typed_inputs(module, **{
                        "input_ids": [prompt], "input_lengths": [[6]], "request_output_len": [[8]], **extra}))
        generated = requests.post(f"http://{server.endpoints.http}/v2/models/stock_ensemble/generate", timeout=60,
                                  json={"input_ids": prompt, "input_lengths": 6, "request_output_len": 8})
        assert generated.status_code == 200, generated.text
        assert generated.json()["output_ids"] == ids
        text = httpclient.InferenceServerClient(server.endpoints.http)
        for model in ("ensemble", "tensorrt_llm_bls"):
            answer = text.infer(model, text_inputs(text_input="hello", max_tokens=8))
            assert answer.as_numpy("text_output")[0].decode().startswith("hello")
            with pytest.raises(InferenceServerException, match="deployed with --no-decoupled, where no model takes "
                                                               "stream=true"):
                text.infer(model, text_inputs(text_input="hello", max_tokens=8, stream=True))


def text_inputs(**values) -> list:
    from test_triton import tensors

    return tensors(httpclient, **values)


def typed_inputs(module, **values) -> list:
    specs = {n: t for n, t, _ in STOCK_INPUTS}
    tensors = []
    for name, value in values.items():
        array = np.asarray(value, dtype={"INT32": np.int32, "BOOL": np.bool_}[specs[name]])
        tensor = module.InferInput(name, list(array.shape), specs[name])
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


@pytest.mark.parametrize("extra, message", [
    (dict(lora_task_id=[3]), "lora_task_id: LoRA is not supported"),
    (dict(lora_config=np.zeros((1, 3))), "lora_config: LoRA is not supported"),
    (dict(prompt_embedding_table=np.ones((2, 64))), "prompt tuning (p-tuning) is not supported"),
    (dict(prompt_vocab_size=[2]), "prompt_vocab_size: prompt tuning"),
    (dict(decoder_input_ids=[0, 5, 6], decoder_input_lengths=[3]), "encoder-decoder models"),
    (dict(embedding_bias=np.zeros(385)), "embedding_bias must hold one value per vocabulary entry"),
])
def test_what_camshaft_lacks_is_refused_by_name(stock, extra, message):
    server, _ = stock
    base = dict(input_ids=[5, 9], input_lengths=[2], request_output_len=[4])
    outputs, error, _ = Stream(server.endpoints.grpc).run("stock_ensemble", inputs(**{**base, **extra}))
    assert error is not None and message in str(error), error
