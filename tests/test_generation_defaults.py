"""The sampling a model's generation_config.json recommends (Qwen2.5's temperature 0.7, top_p 0.8, top_k 20, ...)
is what a request that leaves those fields out gets, as in vLLM: through the OpenAI server, LLM and Session."""

from __future__ import annotations

import json

import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CheckpointError
from camshaft.model_config import ModelConfig
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model, stamped

RECOMMENDED = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
WITHOUT_TEMPERATURE = {"do_sample": True, "top_k": 64, "top_p": 0.95}  # Gemma 3's


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Engines whose generation_config.json asks for greedy output, recommends Qwen's sampling, Gemma 3's."""
    built = {}
    for name, sampling in (("greedy", {"temperature": 0.0}), ("qwen", RECOMMENDED), ("gemma3", WITHOUT_TEMPERATURE)):
        root = tmp_path_factory.mktemp(name)
        model = make_tiny_model("llama", root / "hf")
        generation = json.loads((model / "generation_config.json").read_text())
        (model / "generation_config.json").write_text(json.dumps(generation | sampling))
        build_engine(BuildConfig(model, root / "engine", max_seq_len=64))
        built[name] = root / "engine"
    return built


def test_the_models_recommendation_is_the_default_of_the_python_api(engines):
    with LLM(engines["qwen"]) as llm:
        expected = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
        assert llm.get_default_sampling_params() == expected
        seeded = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, seed=5, max_tokens=12)
        given = llm.generate([3, 4, 5], seeded, use_tqdm=False)[0].outputs[0].token_ids
    session = Session(engines["qwen"])
    assert session.generate([3, 4, 5], seed=5, max_tokens=12).token_ids == given
    assert session.generate([3, 4, 5], seed=5, max_tokens=12, temperature=0).token_ids == \
        session.generate([3, 4, 5], SamplingParams(max_tokens=12)).token_ids  # explicit params: as given


def test_a_recommendation_without_a_temperature_samples_at_vllms_default_of_one(engines, capsys):
    """vLLM lays the recommendation over SamplingParams(), whose temperature is 1: Gemma 3's top_k 64 and top_p 0.95
    sample (they did nothing at camshaft's greedy temperature 0), through the Python API and `camshaft run`."""
    from camshaft.cli import app

    with LLM(engines["gemma3"]) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=1.0, top_k=64, top_p=0.95)
    assert Session(engines["gemma3"])._params(None, {}).temperature == 1.0
    with pytest.raises(SystemExit) as done:
        app(["run", "--engine", str(engines["gemma3"]), "--prompt", "abc", "--max-tokens", "4"])
    assert done.value.code in (0, None)
    err = " ".join(capsys.readouterr().err.split())
    assert "generation_config.json recommends: top_p 0.95, top_k 64 (at temperature 1, vLLM's where it names none; " \
           "--temperature 0 for greedy decoding)" in err, err


def test_inspect_shows_the_recommendation(engines):
    from camshaft.runtime.engine_info import engine_info, info_lines

    info = engine_info(engines["qwen"])
    assert info["model"]["sampling_defaults"] == {k: v for k, v in RECOMMENDED.items() if k != "do_sample"}
    assert "temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05" in "\n".join(info_lines(info))


def test_an_openai_request_without_temperature_samples_as_the_model_recommends(engines):
    from fastapi.testclient import TestClient

    from camshaft.openai_server.app import create_app

    with LLM(engines["greedy"], spin_wait=False) as llm, TestClient(create_app(llm, "m")) as http:
        body = {"model": "m", "prompt": [3, 4, 5], "max_tokens": 8, "seed": 3, "ignore_eos": True}
        texts = {temperature: http.post("/v1/completions", json=body | (
            {} if temperature is None else {"temperature": temperature})).json()["choices"][0]["text"]
                 for temperature in (None, 0.0, 1.0)}
    assert texts[None] == texts[0.0]  # the model's temperature 0, not OpenAI's 1
    assert texts[1.0] != texts[0.0]


def test_an_engine_built_before_the_manifest_kept_them_reads_its_generation_config(engines, tmp_path):
    import shutil

    from camshaft.manifest import read_manifest

    old = tmp_path / "old"
    shutil.copytree(engines["qwen"], old)
    raw = json.loads((old / "manifest.json").read_text())
    del raw["model"]["sampling_defaults"], raw["digest"]
    (old / "manifest.json").write_text(json.dumps(stamped(raw)))
    assert read_manifest(old).model.sampling_defaults == read_manifest(engines["qwen"]).model.sampling_defaults != ()


def test_a_recommendation_out_of_range_is_refused_at_build(tmp_path):
    model = make_tiny_model("llama", tmp_path / "hf")
    (model / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(CheckpointError, match=r"generation_config.json: top_p must lie in \[1e-09, 1\], not 1.5"):
        ModelConfig.from_hf_dir(model)


def test_camshaft_run_samples_as_the_model_recommends_unless_told(engines, capsys):
    from camshaft.cli import app

    def run(*flags: str) -> tuple[str, str]:
        try:
            app(["run", "--engine", str(engines["qwen"]), "--prompt", "abc", "--max-tokens", "12", *flags])
        except SystemExit as exc:
            assert exc.code in (0, None)
        out, err = capsys.readouterr()
        return out.strip(), " ".join(err.split())

    session = Session(engines["qwen"])
    sampled, err = run("--seed", "5")
    assert sampled == session.generate("abc", seed=5, max_tokens=12).text.strip()
    assert "generation_config.json recommends: temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05" in err
    greedy, err = run("--temperature", "0")
    assert greedy == session.generate("abc", temperature=0, max_tokens=12).text.strip() != sampled
    assert "greedy decoding, with the model's generation_config.json repetition_penalty 1.05" in err
    assert "top_p" not in err and "--temperature 0 for" not in err
