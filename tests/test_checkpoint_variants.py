"""Checkpoints as users bring them: a Llama-class tokenizer tokenizes in the engine as transformers does, and a
tokenizer that cannot load, a tied head stored differently, or special ids outside the vocabulary are refused at
build, naming the file."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CheckpointError
from camshaft.model_config import ModelConfig
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model


def sentencepiece_bpe(path) -> None:
    """A Llama-2 / Mistral style tokenizer.json: SentencePiece BPE with byte fallback, no pre-tokenizer."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "h", "e", "l", "o", "t", "r", "i", "▁h", "he", "ll", "▁t", "▁he", "▁hell", "▁hello", "▁th",
                  "▁the", "er", "▁ther", "▁there", "▁hi"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("h", "e"), ("l", "l"), ("▁", "t"), ("▁h", "e"), ("▁he", "ll"), ("▁hell", "o"),
              ("▁t", "h"), ("▁th", "e"), ("e", "r"), ("▁th", "er"), ("▁ther", "e"), ("▁h", "i")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.save(str(path))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("variants") / "hf")


def copy_of(model, tmp_path):
    shutil.copytree(model, tmp_path / "hf")
    return tmp_path / "hf"


def test_a_llama_class_tokenizer_encodes_as_transformers_does(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    sentencepiece_bpe(model / "tokenizer.json")
    (model / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False}))
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))
    with Session(tmp_path / "engine") as session:
        for text in (" hello there", "hi there", "hello  there"):
            assert session.encode(text) == reference(text)["input_ids"], text
        messages = [{"role": "user", "content": "hello"}]
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
        assert session.encode(messages=messages) == expected


def test_the_tokenizers_eos_ends_generation_beside_the_configs_end_ids(tiny, tmp_path):
    """A fine-tune whose config keeps its base's end id while its tokenizer (and chat template) ends turns with
    another: vLLM and TGI stop on both; camshaft ran on past the tokenizer's to max_tokens."""
    from camshaft.runtime.sampling_params import SamplingParams

    model = copy_of(tiny, tmp_path)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**data, "eos_token_id": 1}))
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64, kv_block_size=4))
    with Session(tmp_path / "engine") as session:
        assert session.engine.eos_token_ids == (2, 1)  # the tokenizer's <|im_end|> (vLLM's eos), then the config's
        ended = session.generate([5, 6, 7], SamplingParams(max_tokens=8, logit_bias={2: 100.0}))
        by_config = session.generate([5, 6, 7], SamplingParams(max_tokens=8, logit_bias={1: 100.0}))
    assert (ended.token_ids, ended.finish_reason, ended.stop_reason) == ([2], "stop", None)
    # the config's other end id: vLLM's stop_token_ids, so its stop_reason is the id (Llama 3.1's <|eom_id|>)
    assert (by_config.token_ids, by_config.finish_reason, by_config.stop_reason) == ([1], "stop", 1)
    from camshaft.runtime.engine_info import engine_info

    assert engine_info(tmp_path / "engine")["eos_token_ids"] == [2, 1]  # what inspect says it ends on


@pytest.mark.parametrize("command", ["build", "quantize"])
def test_weights_cloned_without_git_lfs_say_to_fetch_them(tiny, tmp_path, command, capsys):
    from camshaft import cli

    model = copy_of(tiny, tmp_path)
    (model / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n")
    args = ["--quant", "int8_wo", "--calib-size", "1", "--calib-seq-len", "8"] if command == "quantize" else []
    with pytest.raises(CheckpointError, match="model.safetensors is a git-lfs pointer, not the file: fetch it"):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))
    argv = sys.argv
    sys.argv = ["camshaft", command, "--model", str(model), "--output", str(tmp_path / "out"), *args]
    try:
        with pytest.raises(SystemExit) as stopped:
            cli.main()
    finally:
        sys.argv = argv
    assert stopped.value.code == 1 and "model.safetensors is a git-lfs pointer" in capsys.readouterr().err


def test_a_tokenizer_that_cannot_load_is_refused_before_the_graph(tiny, tmp_path, monkeypatch):
    from camshaft.builder import build

    model = copy_of(tiny, tmp_path)
    (model / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n")
    monkeypatch.setattr(build, "write_graph", lambda *a, **k: pytest.fail("the graph was written first"))
    with pytest.raises(CheckpointError, match="tokenizer.json is a git-lfs pointer, not the file: fetch it"):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))
    (model / "tokenizer.json").write_text("{")
    with pytest.raises(CheckpointError, match="the tokenizer in .* could not be loaded"):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))


@pytest.mark.parametrize("damage, message", [
    ("not JSON", "Expecting property name"),
    ("an eos id, not a token", "eos_token has to be either str or AddedToken"),
    ("model_max_length a string", "not supported between"),
    ("chat_template a number", r"chat_template \(tokenizer_config.json\) is 5, neither a Jinja string nor a list of "
                               "named templates"),
])
def test_tokenizer_files_an_engine_could_not_use_are_refused_at_build(tiny, tmp_path, damage, message):
    """Such an engine built and then failed on every run (or answered "rebuild the engine", which built it again)."""
    model = copy_of(tiny, tmp_path)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update({"an eos id, not a token": {"eos_token": 7}, "model_max_length a string": {"model_max_length": "big"},
                   "chat_template a number": {"chat_template": 5}}.get(damage, {}))
    path.write_text("{nope" if damage == "not JSON" else json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as info:
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))
    assert "tokenizer_config.json" in str(info.value) and not (tmp_path / "engine").exists()


def test_a_tied_head_stored_differently_is_refused(tmp_path):
    model = make_tiny_model("llama3-rope", tmp_path / "hf")  # tie_word_embeddings: true
    [weights] = model.glob("*.safetensors")
    tensors = load_file(weights)
    embed = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embed.copy()}, weights)  # equal: still one tied head
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))
    save_file({**tensors, "lm_head.weight": (embed * 2).astype(np.float32)}, weights)
    with pytest.raises(CheckpointError, match="stores a different lm_head.weight, which transformers runs instead"):
        build_engine(BuildConfig(model, tmp_path / "engine2", max_seq_len=64))


def test_special_ids_outside_the_vocabulary_name_their_file(tiny):
    hf = json.loads((tiny / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"generation_config.json: eos_token_id must be a token id of the "
                                              r"vocabulary \(0..383\)"):
        ModelConfig.from_hf(hf, {"eos_token_id": [2, 500]}, source=str(tiny / "config.json"))
    with pytest.raises(CheckpointError, match=r"config.json: bos_token_id must be a token id"):
        ModelConfig.from_hf({**hf, "bos_token_id": 384}, {}, source=str(tiny / "config.json"))
    assert ModelConfig.from_hf({**hf, "hidden_act": "swish"}).architecture == "llama"  # transformers' SiLU alias


def test_a_custom_tokenizer_class_builds_from_its_tokenizer_json_without_running_its_code(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": [None, "my_tokenizer.MyTokenizer"]})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))
    plain = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    with Session(tmp_path / "engine") as session:
        assert session.encode("hello there") == plain("hello there")["input_ids"]


def test_another_models_tokenizer_is_refused_at_build(tmp_path):
    """A tokenizer with more tokens than the model embeds gave out-of-vocabulary ids at request time."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = make_tiny_model("llama", tmp_path / "hf")
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    names = ["<unk>", "<|im_start|>", "<|im_end|>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    names += [f"w{i}" for i in range(vocab_size + 50 - len(names))]
    bigger = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(names)}, merges=[], unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=bigger, eos_token="<|im_end|>").save_pretrained(model)
    with pytest.raises(CheckpointError, match=f"the tokenizer has {vocab_size + 50} tokens but the model embeds "
                                              f"{vocab_size}"):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=32))
    assert not (tmp_path / "engine").exists()


def test_a_tied_model_saved_as_its_head_builds_with_that_head_as_its_embedding(tmp_path):
    """transformers ties a checkpoint that stores lm_head.weight alone; the engine reads the same tensor."""
    model = make_tiny_model("llama3-rope", tmp_path / "hf")  # tie_word_embeddings: true
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))
    [weights] = model.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, weights)
    build_engine(BuildConfig(model, tmp_path / "head-only", max_seq_len=64))
    with Session(tmp_path / "engine") as a, Session(tmp_path / "head-only") as b:
        assert a.generate("hello there", max_tokens=12, ignore_eos=True).token_ids == \
            b.generate("hello there", max_tokens=12, ignore_eos=True).token_ids


@pytest.mark.parametrize("weight_map, message", [
    ([], "weight_map must be an object of tensor names to shard files"),
    ({"model.norm.weight": None}, "maps to None; each shard is a file name in the checkpoint directory"),
    ({"model.norm.weight": "../elsewhere.safetensors"}, "maps to '../elsewhere.safetensors'"),
])
def test_a_malformed_index_is_one_clear_error(tiny, tmp_path, weight_map, message):
    model = copy_of(tiny, tmp_path)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=message):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))


def test_a_tensor_missing_from_its_shard_names_the_shard(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    [weights] = model.glob("*.safetensors")
    tensors = load_file(weights)
    gone = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, weights)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{k: weights.name for k in tensors if k != gone}, gone: weights.name}}))
    with pytest.raises(CheckpointError, match=f"'{gone}' is missing .*the index puts it in {weights.name}"):
        build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))


def test_weights_beyond_float16_are_refused_not_written_as_inf(tiny, tmp_path):
    from camshaft.builder.build import write_graph
    from camshaft.builder.checkpoint import Checkpoint
    from camshaft.errors import BuildConfigError
    from camshaft.manifest import read_manifest

    model = copy_of(tiny, tmp_path)
    [weights] = model.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.post_attention_layernorm.weight"][:4] = 1e5
    save_file(tensors, weights)
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64))  # float32: as the checkpoint says
    limits = read_manifest(tmp_path / "engine").limits
    import warnings

    with Checkpoint(model) as checkpoint, pytest.raises(  # the TensorRT targets' float16 graph
            BuildConfigError, match="model.layers.0.post_attention_layernorm.weight holds values beyond float16's "
                                    "range .*--dtype bfloat16"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the one clear error, no numpy overflow warning before it
        write_graph(checkpoint, limits, "float16", tmp_path)
