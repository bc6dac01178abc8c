"""The engine directory contract: atomic builds, and clear errors for anything half-written or mismatched."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import onnx
import pytest

import camshaft
from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import BuildConfigError, CheckpointError, EngineError
from camshaft.io_signature import GROUP_FLAGS, LONG_ROPE_INPUTS, SLIDING_INPUTS, STEP_INPUTS
from camshaft.manifest import read_manifest
from camshaft.model_config import RopeConfig
from camshaft.runtime.batch import FEED_NAMES, Chunk, build_step
from camshaft.runtime.engine import Engine
from camshaft.runtime.engine_info import engine_info
from camshaft.runtime.session import Session
from camshaft.version import ENGINE_FORMAT_VERSION

from tiny_models import make_tiny_model, stamped


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("enginedir")
    model = make_tiny_model("qwen2-bias", root / "hf")
    engine = root / "engine"
    build_engine(BuildConfig(model, engine, max_seq_len=64, kv_block_size=8))
    return model, engine


@pytest.fixture
def copy(built, tmp_path):
    _, engine = built
    target = tmp_path / "engine"
    shutil.copytree(engine, target)
    return target


def test_manifest_records_the_contract(built):
    _, engine = built
    m = read_manifest(engine)
    assert m.target == "onnxruntime" and m.dtype == "float32"
    assert m.model.architecture == "qwen2" and m.model.qkv_bias
    assert m.kv_cache.block_size == 8 and m.kv_cache.dtype == "float32"
    assert len(m.kv_cache.key_inputs) == m.model.num_layers
    assert {"camshaft", "onnx", "onnxruntime"} <= set(m.tools)
    assert {t.name for t in m.inputs} >= {"input_ids", "positions", "kv_write_index", "decode_block_tables"}
    assert len(m.graph_sha256) == 64
    assert set(m.files) == {"model.onnx", "model.onnx.data", "sequence.onnx", "sequence.onnx.data",
                            *(f"tokenizer/{p.name}" for p in (engine / "tokenizer").iterdir()
                              if p.name != "chat_template.jinja")}  # a chat template may be edited
    assert set(m.fingerprints) == set(m.files) and len(m.build_id) == 32 and m.format_version == ENGINE_FORMAT_VERSION
    seq = m.sequence_graph
    assert seq.artifact == "sequence.onnx" and [t.name for t in seq.inputs] == [
        "input_ids", "seqlens_k", "total_sequence_length", "num_logits", "greedy"]
    assert len(seq.key_inputs) == len(seq.value_outputs) == m.model.num_layers
    assert seq.bytes_per_token(4) == 2 * m.model.num_layers * m.model.num_kv_heads * m.model.head_dim * 4


def test_the_sequence_graph_stores_no_weight_twice(built):
    """A float engine's sequence graph reads every weight from the batch graph's data file (gate/up joined by a
    Concat folded at load), so the engine is no larger than its batch graph but for the head's int8 screen."""
    _, engine = built
    graph = onnx.load(engine / "sequence.onnx", load_external_data=False).graph
    external = {t.name: {e.key: e.value for e in t.external_data} for t in graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}
    shared = [n for n, e in external.items() if e["location"] == "model.onnx.data"]
    screen = {n: int(e["length"]) for n, e in external.items() if n.startswith("lm_head.screen_")}
    own = [e for n, e in external.items() if e["location"] == "sequence.onnx.data" and n not in screen]
    assert len(shared) > 10 and "embed_tokens" in shared
    c = read_manifest(engine).model
    assert screen["lm_head.screen_codes"] == c.vocab_size * c.hidden_size  # int8: a quarter of the float head
    # only tensors the batch artifact keeps inside its proto (ORT saves those under 1 KB inline) have a copy
    assert all(int(e["length"]) < 1024 for e in own)
    assert (engine / "sequence.onnx.data").stat().st_size < 1024 * len(own) + sum(screen.values()) + 64 * (
        len(screen) + 1)
    assert sum(node.op_type == "Concat" for node in graph.node) >= read_manifest(engine).model.num_layers


def test_a_format_1_engine_still_loads_and_runs_its_batch_graph(copy):
    raw = json.loads((copy / "manifest.json").read_text())
    del raw["sequence_graph"]
    raw["format_version"] = 1
    raw["files"] = {k: v for k, v in raw["files"].items() if not k.startswith("sequence")}
    del raw["digest"]  # format 1 manifests had none
    (copy / "manifest.json").write_text(json.dumps(raw))
    session = Session(copy)
    assert session.graph == "batch" and session.generate("hi", max_tokens=3).finish_reason == "length"
    session.close()


def test_a_sequence_graph_asking_for_an_input_this_runtime_lacks_is_refused(copy):
    raw = json.loads((copy / "manifest.json").read_text())
    raw["sequence_graph"]["inputs"].append({"name": "draft_tokens", "dtype": "int64", "shape": [1, "S"]})
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match=r"does not produce \(draft_tokens\); upgrade camshaft or rebuild"):
        Session(copy)


def test_missing_sequence_graph_file(copy):
    (copy / "sequence.onnx.data").unlink()
    with pytest.raises(EngineError, match="missing sequence.onnx.data"):
        Session(copy)


def test_corrupt_manifest(copy):
    (copy / "manifest.json").write_text("{ not json")
    with pytest.raises(EngineError, match="corrupt"):
        Engine(copy)


MANIFEST_EDITS = {
    "max_seq_len a string": (("limits", "max_seq_len"), "abc", "max_seq_len must be a positive integer"),
    "max_seq_len negative": (("limits", "max_seq_len"), -5, "max_seq_len must be a positive integer"),
    "hidden_size zero": (("model", "hidden_size"), 0, "hidden_size must be a positive integer"),
    "unknown target": (("target",), "tpu", "target 'tpu' is none of"),
    "artifact not among the files": (("artifact",), "other.onnx", "other.onnx are not among"),
    "block sizes disagree": (("kv_cache", "block_size"), 4, "block size 4 differs"),
    "files a list": (("files",), ["model.onnx"], "has a build_id and a fingerprint for each of its files"),
    "a size a string": (("files", "model.onnx"), "17355", "files maps names to sizes"),
    "complete a string": (("complete",), "no", "complete is true or false"),
    "tools a list": (("tools",), ["onnx"], "tools is an object"),
    "kv dtype unknown": (("kv_cache", "dtype"), "fp4", "kv_cache.dtype 'fp4' is neither"),
    "kv dtype another float": (("kv_cache", "dtype"), "float16", "kv_cache.dtype 'float16' is neither"),
    "a layer's cache dropped": (("kv_cache", "key_inputs"), ["past_key_0"], "does not name one cache tensor a layer"),
    "cache names a string": (("sequence_graph", "value_inputs"), "past_v", "does not name one cache tensor a layer"),
    "no build id": (("build_id",), "", "has a build_id and a fingerprint"),
    "quantization a string": (("quantization",), "int4", "quantization is an object"),
    "target_options null": (("target_options",), None, "target_options is an object"),
    "lm_head a string": (("quantization", "lm_head"), "int8", "quantization.lm_head is an object"),
    "build id a number": (("build_id",), 7, "build_id is a string"),
    "model kv heads edited": (("model", "num_kv_heads"), 1, "KVCacheLayout holds 2 KV heads"),
    "logits width edited": (("outputs",), [{"name": "logits", "dtype": "float32", "shape": ["N", 5]}],
                            "the logits output is 5 wide"),
    "an input's name null": (("inputs", 0, "name"), None, "not a name, a dtype and a shape"),  # was a TypeError
    "a sequence input's shape a dict": (("sequence_graph", "inputs", 0, "shape"), [{"a": 1}],
                                        "not a name, a dtype and a shape"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_EDITS))
def test_a_manifest_with_wrong_values_is_corrupt(copy, case):
    keys, value, needle = MANIFEST_EDITS[case]
    raw = json.loads((copy / "manifest.json").read_text())
    node = raw
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match="corrupt") as info:
        Session(copy)
    assert needle in str(info.value) and "rebuild" in str(info.value)


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_manifest_naming_files_outside_its_engine_is_refused(copy, tmp_path, where):
    """The graph and any file the manifest lists were joined to the engine directory unchecked: an absolute path or
    ../ loaded (or fingerprinted) files from elsewhere."""
    outside = tmp_path / "outside"
    shutil.copytree(copy, outside)
    raw = json.loads((copy / "manifest.json").read_text())
    name = str(outside / "model.onnx") if where == "absolute" else "../outside/model.onnx"
    raw["files"][name] = raw["files"].pop("model.onnx")
    raw["fingerprints"][name] = raw["fingerprints"].pop("model.onnx")
    raw["artifact"] = name
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match="corrupt .*outside the engine directory"):
        Engine(copy)


def test_a_manifest_pointing_the_sequence_graph_at_the_batch_graph_is_refused(copy):
    raw = json.loads((copy / "manifest.json").read_text())
    raw["sequence_graph"]["artifact"] = "model.onnx"
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match="model.onnx.s inputs differ from its manifest.s .*rebuild the engine"):
        Session(copy)


def test_a_file_is_not_an_engine_dir(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(EngineError, match="is a file"):
        Session(tmp_path / "afile")


def test_a_checkpoint_and_an_engine_swapped_say_which_is_which(built, tmp_path):
    model, engine = built
    with pytest.raises(EngineError, match=f"is a Hugging Face checkpoint, not an engine.*--model {model}"):
        Session(model)
    with pytest.raises(CheckpointError, match="is a camshaft engine, not a checkpoint"):
        build_engine(BuildConfig(engine, tmp_path / "out", max_seq_len=64))


def test_missing_manifest_means_unfinished_build(copy):
    (copy / "manifest.json").unlink()
    with pytest.raises(EngineError, match="never finished"):
        Engine(copy)


def test_weights_linked_from_outside_the_engine_say_to_copy_them(copy, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (copy / "model.onnx.data").rename(elsewhere / "model.onnx.data")
    (copy / "model.onnx.data").symlink_to(elsewhere / "model.onnx.data")
    with pytest.raises(EngineError, match=r"not a file beside its graph in the engine directory.*cp -rL"):
        Session(copy)
    (copy / "model.onnx.data").unlink()
    (copy / "model.onnx.data").symlink_to("../elsewhere/model.onnx.data")
    with pytest.raises(EngineError, match="not a file beside its graph in the engine directory"):
        Engine(copy)


def test_an_engine_copied_as_hard_links_is_refused_alike_by_every_loader(copy, tmp_path):
    import os

    backup = tmp_path / "backup"
    shutil.copytree(copy, backup, copy_function=os.link)
    for engine in (copy, backup):
        for load in (Session, Engine):
            with pytest.raises(EngineError, match=r"model.onnx.data has 1 other hard link.*cp -r"):
                load(engine)
        info = engine_info(engine)
        assert not info["runs_here"] and "other hard link" in info["runs_here_reason"]


def test_weights_with_other_hard_links_say_to_copy_them(tmp_path):
    """ONNX Runtime refuses a subgraph's weights in a file with several links (SmolLM2's batch graph has such weights;
    the tiny ones are inline), which a cp -al copy of an engine has: the error says so, not to rebuild."""
    import os

    from onnx import TensorProto, helper, numpy_helper

    from camshaft.runtime.backends.onnxruntime import load_session, session_options

    def branch(name: str, value: float) -> onnx.GraphProto:
        weight = numpy_helper.from_array(np.full(4096, value, np.float32), f"{name}_w")
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [4096])
        return helper.make_graph([helper.make_node("Identity", [f"{name}_w"], [f"{name}_out"])], name, [], [out],
                                 [weight])

    flag = helper.make_tensor_value_info("flag", TensorProto.BOOL, [])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [4096])
    node = helper.make_node("If", ["flag"], ["out"], then_branch=branch("then", 1.0), else_branch=branch("other", 2.0))
    model = helper.make_model(helper.make_graph([node], "g", [flag], [out]),
                              opset_imports=[helper.make_opsetid("", 21)])
    path = tmp_path / "model.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    session, _ = load_session(path, session_options(1, spin_wait=False), huge_pages=False)
    assert session.run(None, {"flag": np.array(False)})[0][0] == 2.0  # real files load
    os.link(tmp_path / "model.onnx.data", tmp_path / "backup.data")
    with pytest.raises(EngineError, match=r"model.onnx.data has 1 other hard link.*cp -r") as caught:
        load_session(path, session_options(1, spin_wait=False), huge_pages=False)
    assert "rebuild" not in str(caught.value)


@pytest.fixture(scope="module")
def other_build(tmp_path_factory):
    """The same architecture and limits from other weights: every file the same size as `built`'s."""
    root = tmp_path_factory.mktemp("enginedir-other")
    model = make_tiny_model("qwen2-bias", root / "hf", seed=1)
    build_engine(BuildConfig(model, root / "engine", max_seq_len=64, kv_block_size=8))
    return root / "engine"


def test_a_file_from_another_build_is_refused(copy, other_build):
    name = "model.onnx.data"
    assert (copy / name).stat().st_size == (other_build / name).stat().st_size
    shutil.copyfile(other_build / name, copy / name)
    with pytest.raises(EngineError, match=f"{name} is not the file this engine was built with"):
        Session(copy)


def test_an_edited_tokenizer_file_is_refused(copy):
    path = copy / "tokenizer" / "tokenizer_config.json"
    text = path.read_text()
    path.write_text(text.replace("<|im_end|>", "<|im_END|>", 1))
    assert path.read_text() != text
    with pytest.raises(EngineError, match="tokenizer/tokenizer_config.json is not the file this engine was built"):
        Engine(copy)


def test_a_missing_tokenizer_file_is_an_incomplete_engine(copy):
    (copy / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(EngineError, match="is missing tokenizer/tokenizer.json; rebuild"):
        Session(copy)


def test_an_engine_rebuilt_while_it_loads_is_refused(copy, other_build, monkeypatch):
    """Files are opened one by one: a rebuild swapping the directory meanwhile would mix two builds' files."""
    import camshaft.runtime.engine as engine_module

    load = engine_module.load_tokenizer

    def swap_then_load(engine_dir, files=None):
        shutil.rmtree(copy)
        shutil.copytree(other_build, copy)
        return load(engine_dir, files)
    monkeypatch.setattr(engine_module, "load_tokenizer", swap_then_load)
    with pytest.raises(EngineError, match="was replaced while it loaded"):
        Engine(copy)

    def rebuilt_then_refuse(engine_dir, files=None):  # a rebuild lands; its files fail the old manifest's checks
        raw = json.loads((copy / "manifest.json").read_text())
        (copy / "manifest.json").write_text(json.dumps({**raw, "build_id": "the next build"}))
        raise EngineError("files of two builds were mixed; rebuild the engine")
    monkeypatch.setattr(engine_module, "load_tokenizer", rebuilt_then_refuse)
    again = re.escape("was replaced while it loaded (rebuilt meanwhile?); load it again")
    with pytest.raises(EngineError, match=again):
        Engine(copy)  # the engine on disk is whole: it is told to load again, not to rebuild


def test_fingerprints_sample_large_files(tmp_path):
    from camshaft.engine_files import fingerprint

    big = tmp_path / "big.data"
    data = bytearray(np.random.default_rng(0).bytes(12 << 20))
    big.write_bytes(data)
    first = fingerprint(big)
    data[5 << 20] ^= 1  # inside a sample: every MiB from 0
    big.write_bytes(data)
    assert fingerprint(big) != first


def test_missing_artifact(copy):
    (copy / "model.onnx.data").unlink()
    with pytest.raises(EngineError, match="missing model.onnx.data"):
        Engine(copy)


def test_truncated_artifact(copy):
    data = copy / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(EngineError, match="truncated"):
        Engine(copy)


def test_other_camshaft_engine_format(copy):
    raw = json.loads((copy / "manifest.json").read_text())
    raw["format_version"], raw["camshaft_version"] = 999, "9.9.9"
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match=r"built by camshaft 9\.9\.9.*this is camshaft.*upgrade camshaft to 9\.9\.9"):
        Engine(copy)
    raw["camshaft_version"] = camshaft.__version__  # a newer format under the same version string: no circular advice
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match="upgrade camshaft to the version that built it .one that reads engine "
                                          "format 999."):
        Engine(copy)
    (copy / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # nested past Python's recursion limit
    with pytest.raises(EngineError, match="corrupt .RecursionError"):
        Engine(copy)


def test_a_graph_that_is_not_onnx_is_an_engine_error_for_inspect(copy):
    """inspect reads the graphs' inputs without loading them: a graph that is not ONNX is said, not a traceback
    (an engine of format 2 records no fingerprint that would catch it first)."""
    from camshaft.runtime.backends.onnxruntime import check_graph_io

    manifest = read_manifest(copy)
    artifact = copy / manifest.artifact
    artifact.write_bytes(b"\xff" * artifact.stat().st_size)
    with pytest.raises(EngineError, match="could not be read as ONNX"):
        check_graph_io(copy, manifest)


def test_other_onnxruntime_version(copy):
    raw = json.loads((copy / "manifest.json").read_text())
    raw["tools"]["onnxruntime"] = "1.2.0"
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match=r"onnxruntime 1\.2\.0.*installed"):
        Engine(copy)


def test_an_engine_asking_for_an_input_this_runtime_lacks_is_refused(copy):
    raw = json.loads((copy / "manifest.json").read_text())
    raw["inputs"].append({"name": "draft_tokens", "dtype": "int64", "shape": ["T"]})
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match=r"does not produce \(draft_tokens\); upgrade camshaft or rebuild"):
        Engine(copy)


def test_the_runtime_feeds_every_input_the_builder_can_declare():
    chunks = [Chunk([5, 6, 7], 0, [1]), Chunk([8], 9, [2, 3])]
    longrope = RopeConfig(type="longrope", short_factor=(1.0,), long_factor=(2.0,))
    feeds = build_step(chunks, block_size=8, sliding_window=4, group_flags=True, long_rope=longrope).feeds
    assert set(feeds) == {spec.name for spec in STEP_INPUTS + GROUP_FLAGS + SLIDING_INPUTS + LONG_ROPE_INPUTS
                          } == FEED_NAMES


def test_interrupted_build_leaves_nothing_that_loads(built, tmp_path, monkeypatch):
    model, _ = built
    out = tmp_path / "engine"
    from camshaft.builder import build as build_module

    def explode(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "_compile", explode)
    with pytest.raises(KeyboardInterrupt):
        build_engine(BuildConfig(model, out, max_seq_len=64))
    assert not out.exists()
    assert not list(tmp_path.iterdir())


def test_rebuild_replaces_an_engine_but_never_a_foreign_dir(built, tmp_path):
    model, _ = built
    out = tmp_path / "engine"
    build_engine(BuildConfig(model, out, max_seq_len=64))
    build_engine(BuildConfig(model, out, max_seq_len=32))
    assert read_manifest(out).limits.max_seq_len == 32
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(BuildConfigError, match="refusing to overwrite"):
        build_engine(BuildConfig(model, foreign, max_seq_len=64))
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_missing_tensor_and_shape_mismatch_name_file_and_tensor(built, tmp_path):
    model, _ = built
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    tensors = load_file(bad / "model.safetensors")
    q_proj = tensors["model.layers.0.self_attn.q_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = q_proj[:-1]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .*q_proj.* shape \(63, 64\)"):
        build_engine(BuildConfig(bad, tmp_path / "out", max_seq_len=64))
    tensors["model.layers.0.self_attn.q_proj.weight"] = q_proj
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="up_proj.weight' is missing"):
        build_engine(BuildConfig(bad, tmp_path / "out", max_seq_len=64))


def test_build_limits_are_validated_not_overridden(built, tmp_path):
    model, _ = built
    with pytest.raises(BuildConfigError, match="max_position_embeddings"):
        build_engine(BuildConfig(model, tmp_path / "e", max_seq_len=10_000))
    with pytest.raises(BuildConfigError, match="power of two"):
        BuildConfig(model, tmp_path / "e", kv_block_size=12)
    # review: any power of two was taken (a block of 2**30 tokens built an engine no machine loads; 2**63 a traceback)
    assert BuildConfig(model, tmp_path / "e", max_seq_len=17, kv_block_size=32).kv_block_size == 32
    assert BuildConfig(model, tmp_path / "e", max_seq_len=5).kv_block_size == 32  # the default: always taken
    assert BuildConfig(model, tmp_path / "e", max_seq_len=100, kv_block_size=128).kv_block_size == 128
    with pytest.raises(BuildConfigError, match=r"larger than a whole sequence \(--max-seq-len 17\).* 32 or less"):
        BuildConfig(model, tmp_path / "e", max_seq_len=17, kv_block_size=64)
    with pytest.raises(BuildConfigError, match=r"\(--max-seq-len 100\).* 128 or less"):
        BuildConfig(model, tmp_path / "e", max_seq_len=100, kv_block_size=256)
    with pytest.raises(BuildConfigError, match="larger than a whole sequence"):
        build_engine(BuildConfig(model, tmp_path / "e", kv_block_size=2**63))  # max_seq_len: the model's context
    with pytest.raises(BuildConfigError, match="float32"):
        BuildConfig(model, tmp_path / "e", dtype="float16")
    with pytest.raises(BuildConfigError, match="unknown target"):
        BuildConfig(model, tmp_path / "e", target="tpu")
    with pytest.raises(BuildConfigError, match="choose one of auto, float, int8"):
        BuildConfig(model, tmp_path / "e", weight_only_compute="int4")
    with pytest.raises(BuildConfigError, match="applies to the onnxruntime target"):
        BuildConfig(model, tmp_path / "e", target="tensorrt-rtx", weight_only_compute="float")
    with pytest.raises(BuildConfigError, match="weight-only checkpoints .* is not quantized"):
        build_engine(BuildConfig(model, tmp_path / "e", max_seq_len=64, weight_only_compute="int8"))
    assert not (tmp_path / "e").exists()


def test_sharded_checkpoint_builds_the_same_engine(built, tmp_path):
    from safetensors.numpy import load_file, save_file

    model, engine = built
    sharded = tmp_path / "sharded"
    shutil.copytree(model, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file)
        weight_map.update(dict.fromkeys(part, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = build_engine(BuildConfig(sharded, tmp_path / "engine", max_seq_len=64, kv_block_size=8))
    assert out.graph_sha256 == read_manifest(engine).graph_sha256
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shards that are missing: model-00002-of-00002"):
        build_engine(BuildConfig(sharded, tmp_path / "engine2", max_seq_len=64))


@pytest.mark.parametrize("changes, message", [
    ({"head_dim": 10**8}, r"'model.layers.0.self_attn.q_proj.weight' has shape .*, expected .*from config.json"),
    ({"num_attention_heads": 10**7, "num_key_value_heads": 10**7, "head_dim": 16}, r"q_proj.weight' has shape"),
    ({"num_hidden_layers": 10**9, "layer_types": None}, r"num_hidden_layers=1000000000 is beyond any model.s"),
    ({"num_hidden_layers": 7, "layer_types": None}, r"says num_hidden_layers=7, but the weights hold 2 layers"),
])
def test_config_sizes_the_weights_deny_are_refused_before_anything_is_made_of_them(built, tmp_path, changes, message):
    """A head_dim of 10**8 allocated 95 GiB of rotary tables, 10**9 layers an 8 GB tuple, before a weight was read."""
    import resource

    model, _ = built
    shutil.copytree(model, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config | changes))
    limit = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, limit[1]))  # a MemoryError, not a machine out of memory
    try:
        with pytest.raises(CheckpointError, match=message):
            build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine"))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("file, text, error", [
    ("config.json", "[" * 100_000, CheckpointError),  # nested past Python's recursion limit
    ("config.json", '{"hidden_size": ' + "9" * 5000 + "}", CheckpointError),  # past Python's digits limit
    ("generation_config.json", "[" * 100_000, CheckpointError),
    ("hf_quant_config.json", b"\xff\xfe\x00binary", CheckpointError),
    ("model.safetensors.index.json", "[" * 100_000, CheckpointError),
])
def test_a_damaged_json_file_is_one_clear_error_not_a_traceback(built, tmp_path, file, text, error):
    model, _ = built
    shutil.copytree(model, tmp_path / "ckpt")
    target = tmp_path / "ckpt" / file
    target.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(error, match=file.replace(".", "[.]")):
        build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine"))


def test_a_manifest_with_a_number_past_pythons_limit_is_corrupt(copy):
    text = (copy / "manifest.json").read_text().replace('"max_batch_size": ', '"max_batch_size": ' + "9" * 5000, 1)
    (copy / "manifest.json").write_text(text)
    with pytest.raises(EngineError, match="is corrupt .ValueError"):
        Engine(copy)


def test_a_huge_build_batch_does_not_size_the_logits_buffer(built, tmp_path):
    """The logits buffer took the build's max_batch_size rows: --max-batch-size 100000000 (then accepted) asked for
    143 GiB at load, whatever batch the LLM ran. It grows to the rows steps have; absurd limits are refused."""
    from camshaft.runtime.llm import LLM
    from camshaft.runtime.sampling_params import SamplingParams

    model, _ = built
    for flag, value in (("max_batch_size", 10**8), ("max_num_tokens", 10**8)):
        with pytest.raises(BuildConfigError, match=f"--{flag.replace('_', '-')} {value} is beyond what"):
            BuildConfig(model, tmp_path / "engine", **{flag: value})
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=64, max_batch_size=2**14, max_num_tokens=64))
    with LLM(tmp_path / "engine", max_batch_size=4, kv_cache_memory=2**20) as llm:
        outputs = llm.generate([[3, 4], [5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert all(o.outputs[0].token_ids for o in outputs)
        assert len(llm.engine.backend._logits) == 2  # the most rows a step had, not 16384


def test_remote_code_checkpoints_are_refused(built, tmp_path):
    model, _ = built
    shutil.copytree(model, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"never runs code from a checkpoint. Its architectures name "
                                              f"{config['architectures'][0]}, which camshaft builds natively"):
        build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine"))
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoTokenizer": [None, "tok.Tok"]}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))  # no model code: native weights
    build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=64))
    assert (tmp_path / "engine" / "manifest.json").is_file()


@pytest.mark.parametrize("edit", [
    lambda m: m["model"].update(hidden_size=m["model"]["hidden_size"] * 2),
    lambda m: m["model"].update(rms_norm_eps=0.5),
    lambda m: m["limits"].update(max_batch_size=1000),
    lambda m: m["model"].update(tie_word_embeddings=not m["model"]["tie_word_embeddings"]),
])
def test_a_hand_edited_manifest_is_refused_by_its_digest(copy, edit):
    """Values the runtime cannot check against the graph (the graph bakes them in, or only limits them) are still
    the build's: the manifest's digest says an edit happened."""
    raw = json.loads((copy / "manifest.json").read_text())
    edit(raw)
    (copy / "manifest.json").write_text(json.dumps(raw, indent=2))
    with pytest.raises(EngineError, match="was changed after the build .its digest no longer matches"):
        Engine(copy)
    described = engine_info(copy)  # still described as it now reads, with the reason it does not run
    assert described["runs_here"] is False and "digest no longer matches" in described["runs_here_reason"]
    del raw["digest"]  # from format 4 on, a manifest without one was edited too
    (copy / "manifest.json").write_text(json.dumps(raw, indent=2))
    with pytest.raises(EngineError, match="digest no longer matches"):
        Engine(copy)
    (copy / "manifest.json").write_text(json.dumps(stamped(raw), indent=2))  # the values alone would load
    Engine(copy).close()


def test_a_field_this_version_does_not_know_names_the_version_that_wrote_it(copy):
    """An intact manifest another camshaft wrote, with a field this one lacks: which camshaft wrote it, not
    "corrupt"; the same field added by hand: an edit, as the digest says."""
    raw = json.loads((copy / "manifest.json").read_text())
    raw["limits"]["newer_limit"] = 1
    (copy / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(EngineError, match="was changed after the build"):
        Engine(copy)
    del raw["digest"]
    raw["camshaft_version"] = "9.0.0"
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match=r"written by camshaft 9\.0\.0, and this camshaft .* cannot read it "
                                          r"\(TypeError: .*newer_limit.*use camshaft 9\.0\.0, or rebuild"):
        Engine(copy)


def _edited(copy, edit) -> None:
    raw = json.loads((copy / "manifest.json").read_text())
    edit(raw)
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))


@pytest.mark.parametrize("edit, loader, message", [
    (lambda m: m.update(inputs=[s for s in m["inputs"] if s["name"] != "has_decode"]), Engine,
     "inputs differ from its manifest's .*has_decode"),
    (lambda m: m["kv_cache"]["key_outputs"].__setitem__(0, "kv_cache_k_0_typo"), Engine,
     "outputs differ from its manifest's .*kv_cache_k_0"),
    (lambda m: m["sequence_graph"].update(inputs=[s for s in m["sequence_graph"]["inputs"]
                                                  if s["name"] != "num_logits"]), Session,
     "inputs differ from its manifest's .*num_logits"),
    (lambda m: m["sequence_graph"].update(inputs=[s for s in m["sequence_graph"]["inputs"]
                                                  if s["name"] != "greedy"]), Session,
     "inputs differ from its manifest's .*greedy"),
    (lambda m: m["model"].update(layer_types=["sliding"] * len(m["model"]["layer_types"]), sliding_window=4), Engine,
     "has sliding-window layers but its graph inputs say otherwise"),
    (lambda m: m["model"].update(eos_token_ids=["2"]), Engine, "end and bos ids .* must be token ids"),
    (lambda m: m["model"].update(eos_token_ids=[99999]), Session, "end and bos ids .* must be token ids"),
    (lambda m: m.update(dtype="float64"), Engine, "dtype 'float64' is none of float32"),
    (lambda m: m.update(format_version="3"), Session, "format_version '3' is not an integer"),
])
def test_a_manifest_edited_against_its_graph_is_refused_at_load(copy, edit, loader, message):
    """What the runtime feeds, binds and stops on comes from the manifest: one that disagrees with the graph, or
    holds values of the wrong kind, is refused when the engine loads, not mid-request."""
    _edited(copy, edit)
    with pytest.raises(EngineError, match=message):
        loader(copy)
    if "differ from its manifest" in message:  # inspect reads the graphs' names too, without loading them
        from camshaft.runtime.engine_info import engine_info

        info = engine_info(copy)
        assert not info["runs_here"] and "differ from its manifest's" in info["runs_here_reason"]


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(target="tensorrt"), "says target 'tensorrt', but sequence graphs are the onnxruntime target's"),
    (lambda m: m["model"].update(layer_types=["sliding"] * len(m["model"]["layer_types"]), sliding_window=4),
     "has sliding-window layers but its graph inputs say otherwise"),
    (lambda m: (m["limits"].update(kv_block_size=16), m["kv_cache"].update(block_size=16)),
     "disagree with its manifest"),
])
def test_the_session_refuses_what_the_batch_loaders_and_inspect_refuse(copy, edit, message):
    """The Session's sequence graph does not read these fields, but an engine whose manifest disagrees with its graphs
    gets one verdict from every command (it ran under `camshaft run` while LLM and inspect refused it)."""
    from camshaft.runtime.engine_info import engine_info

    _edited(copy, edit)
    with pytest.raises(EngineError, match=message):
        Session(copy)
    assert not engine_info(copy)["runs_here"]


def test_files_added_to_the_tokenizer_are_refused_but_a_chat_template_may_be_edited(copy):
    (copy / "tokenizer" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (copy / "tokenizer" / "additional_chat_templates").mkdir()  # transformers' named templates (tool_use, ...)
    (copy / "tokenizer" / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    (copy / "tokenizer" / ".DS_Store").write_bytes(b"\0")
    with Session(copy) as session:
        assert session.encode(messages=[{"role": "user", "content": "hi"}]) == session.tokenizer.encode(
            "hi", add_special_tokens=False)
    (copy / "tokenizer" / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<unk>"}))
    for loader in (Session, Engine):
        with pytest.raises(EngineError, match="holds special_tokens_map.json, which the build did not write"):
            loader(copy)
    from camshaft.runtime.engine_info import engine_info

    assert "special_tokens_map.json" in engine_info(copy)["runs_here_reason"]


@pytest.mark.parametrize("template", ["chat_template.jinja", "additional_chat_templates/tool_use.jinja"])
def test_a_chat_template_saved_as_utf16_is_said_by_the_loaders_and_inspect(copy, template):
    """Review: a template saved as UTF-16 (an editor's "Unicode") failed every load with "rebuild the engine" while
    inspect said it runs here (exit 0) and the template had no problem."""
    from camshaft.runtime.engine_info import engine_info

    path = copy / "tokenizer" / template
    path.parent.mkdir(exist_ok=True)
    path.write_text("{{ messages[0]['content'] }}", encoding="utf-16")
    for loader in (Session, Engine):
        with pytest.raises(EngineError, match=f"{template} is not UTF-8 text .*; save it as UTF-8"):
            loader(copy)
    info = engine_info(copy)
    assert info["runs_here"] is False and "save it as UTF-8" in info["runs_here_reason"]
    if template == "chat_template.jinja":
        from camshaft.runtime.engine_info import info_lines

        assert "is not UTF-8 text" in info["chat_template_problem"]
        said = "\n".join(info_lines(info))
        assert "save it as UTF-8; the engine does not load until then)" in said and "does not parse" not in said


def test_inspect_gives_the_end_ids_of_an_engine_that_does_not_run_here(copy):
    """Review: an engine refused here (a TensorRT-RTX one without its GPU) listed only config.json's end ids, not
    the tokenizer's eos it stops on too."""
    from camshaft.runtime.engine_info import engine_info

    raw = json.loads((copy / "manifest.json").read_text())
    raw["model"]["eos_token_ids"] = [3]  # the model's end id, not the tokenizer's eos
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    runs = engine_info(copy)["eos_token_ids"]
    assert len(runs) == 2 and runs[1] == 3, runs
    raw["tools"]["onnxruntime"] = "0.0.1"  # refused here: built by another onnxruntime
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    info = engine_info(copy)
    assert info["runs_here"] is False and info["eos_token_ids"] == runs


def test_a_file_added_to_a_tokenizer_directory_linked_in_is_refused_too(copy, tmp_path):
    """Review: a symlinked tokenizer/ skipped the check (an exemption for rebuilds, which replace the link), so an
    added_tokens.json changed tokenization unsaid."""
    from camshaft.engine_files import user_tokenizer_entries

    shared = tmp_path / "shared_tokenizer"
    (copy / "tokenizer").rename(shared)
    (copy / "tokenizer").symlink_to(shared)
    with Session(copy) as session:  # linked as it was: loads
        assert session.tokenizer is not None
    (shared / "added_tokens.json").write_text(json.dumps({"hello": 300}))
    for loader in (Session, Engine):
        with pytest.raises(EngineError, match="holds added_tokens.json, which the build did not write"):
            loader(copy)
    assert user_tokenizer_entries(copy) == []  # a rebuild replaces the link: the shared directory loses nothing


@pytest.mark.parametrize("edits, reason", [
    ({("model", "vocab_size"): 383, ("outputs",): [{"name": "logits", "dtype": "float32", "shape": ["N", 383]}]},
     "logits dimensions"),
    ({("limits", "max_seq_len"): 32}, "was built for max_seq_len"),
    ({("kv_cache", "dtype"): "int8"}, "has no int8 cache input"),
])
def test_inspect_says_an_engine_its_loaders_refuse_does_not_run(copy, edits, reason):
    """inspect reads the graphs' files (no session): it compares what a load compares — cache types and shapes, the
    logits' width, the limits the graph was built for — not only the names."""
    from camshaft.runtime.engine_info import engine_info

    raw = json.loads((copy / "manifest.json").read_text())
    for keys, value in edits.items():
        node = raw
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match=reason):
        Engine(copy)
    info = engine_info(copy)
    assert info["runs_here"] is False and reason in info["runs_here_reason"]


def test_graphs_of_another_build_relisted_in_the_manifest_are_refused(copy, other_build):
    """The graphs carry their build's id: another build's batch graph and weights, even re-listed by hand with their
    sizes and fingerprints, are refused (the sequence graph would read its weights by offset from them)."""
    from camshaft.engine_files import fingerprint

    raw = json.loads((copy / "manifest.json").read_text())
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copyfile(other_build / name, copy / name)
        raw["files"][name] = (copy / name).stat().st_size
        raw["fingerprints"][name] = fingerprint(copy / name)
    (copy / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match="files of two builds were mixed"):
        Session(copy, graph="batch")
    with pytest.raises(EngineError, match="files of two builds were mixed"):
        Session(copy)  # the sequence graph: its own file is this build's, the weights it reads are not


def test_weights_that_do_not_fit_in_memory_are_not_a_corrupt_engine(built, monkeypatch):
    """onnxruntime's std::bad_alloc while loading (a memory limit: ulimit -v, a container) says so, not "rebuild"."""
    import onnxruntime as ort

    from camshaft.errors import CapacityError

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during initialization: "
                           "std::bad_alloc")

    monkeypatch.setattr(ort, "InferenceSession", out_of_memory)
    with pytest.raises(CapacityError, match=r"model\.onnx \(\d+ MiB of graph and weights\) does not fit this "
                                            r"process's memory .*std::bad_alloc.*free memory"):
        Engine(built[1])


def test_a_private_checkpoint_gives_an_engine_other_users_can_read(tmp_path):
    """The checkpoint's file modes are not copied: a server running as another user reads the engine's tokenizer
    as it reads its graph."""
    model = make_tiny_model("llama", tmp_path / "hf")
    for file in model.iterdir():
        file.chmod(0o600)
    build_engine(BuildConfig(model, tmp_path / "engine", max_seq_len=32))
    graph_mode = (tmp_path / "engine" / "model.onnx").stat().st_mode & 0o777
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "engine" / "tokenizer").iterdir()}
    assert modes and set(modes.values()) == {graph_mode}, modes


def test_the_same_build_twice_gives_the_same_files_and_build_id(built, other_build, tmp_path):
    """build_id is what the engine holds (a content id for caches and audits: it was a random one per build, so no two
    builds were alike); the files are byte-identical but for the manifest's build_seconds."""
    model, engine = built
    again = tmp_path / "elsewhere" / "engine"
    build_engine(BuildConfig(model, again, max_seq_len=64, kv_block_size=8))
    assert read_manifest(again).build_id == read_manifest(engine).build_id != read_manifest(other_build).build_id
    names = sorted(str(p.relative_to(engine)) for p in engine.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file())
    differ = [name for name in names if (engine / name).read_bytes() != (again / name).read_bytes()]
    assert set(differ) <= {"manifest.json"}  # its build_seconds, when they differ
    first, second = (json.loads((d / "manifest.json").read_text()) for d in (engine, again))
    for raw in (first, second):
        raw.pop("digest"), raw["target_options"].pop("build_seconds")
    assert first == second
