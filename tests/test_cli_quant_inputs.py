"""`camshaft build --quant` refuses what the build after calibration would refuse, before calibrating; without --quant
it refuses the quantization options the user passed instead of ignoring them."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
from test_cli import camshaft

from tiny_models import make_tiny_model

pytest.importorskip("modelopt.torch.quantization")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("cli-quant") / "hf")


def one_line(err: str) -> str:
    return " ".join(err.split())


def nothing_quantized(engine) -> bool:
    """No quantized checkpoint (OUTPUT.ckpt) and no staging directory of one."""
    return not engine.with_name(engine.name + ".ckpt").exists() and not list(engine.parent.glob(".*.ckpt.partial-*"))


def test_a_missing_target_package_is_refused_before_calibration(tiny, tmp_path, capsys):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here")
    engine = tmp_path / "e"
    code, _, err = camshaft(capsys, "build", "--model", tiny, "--output", engine, "--target", "tensorrt",
                            "--quant", "fp8", "--calib-size", "2", "--calib-seq-len", "32")
    err = one_line(err)
    assert code == 1 and "the tensorrt target (the tensorrt Python package" in err, err
    assert "needs camshaft's tensorrt extra" in err
    assert "Traceback" not in err and nothing_quantized(engine) and not engine.exists()


def test_an_engine_output_that_cannot_be_replaced_is_refused_before_calibration(tiny, tmp_path, capsys):
    engine = tmp_path / "e"
    engine.mkdir()
    (engine / "notes.txt").write_text("mine")
    code, _, err = camshaft(capsys, "build", "--model", tiny, "--output", engine, "--quant", "int8_wo",
                            "--calib-size", "2", "--calib-seq-len", "32")
    assert code == 1 and "refusing to overwrite" in one_line(err) and nothing_quantized(engine)
    code, _, err = camshaft(capsys, "build", "--model", tiny, "--output", tmp_path / "f", "--quant", "int8_wo",
                            "--max-seq-len", "4096", "--calib-size", "2", "--calib-seq-len", "32")
    assert code == 1 and "--max-seq-len 4096 exceeds" in one_line(err) and nothing_quantized(tmp_path / "f")
    kept = tmp_path / "g.ckpt"  # the checkpoint an earlier build --quant kept, with a file of the user's added
    kept.mkdir()
    (kept / "hf_quant_config.json").write_text("{}")
    (kept / "camshaft_quantize.json").write_text('{"files": ["hf_quant_config.json"]}')
    (kept / "NOTES.txt").write_text("mine")
    code, _, err = camshaft(capsys, "build", "--model", tiny, "--output", tmp_path / "g", "--quant", "int8_wo",
                            "--calib-size", "2", "--calib-seq-len", "32")
    assert code == 1 and "the quantized checkpoint --quant keeps beside --output" in one_line(err)
    assert "NOTES.txt" in err and (kept / "NOTES.txt").read_text() == "mine"


@pytest.mark.parametrize("option", [("--group-size", "32"), ("--calib-size", "8"), ("--calib-seq-len", "32"),
                                    ("--lm-head", "float"), ("--kv-cache-dtype", "int8"), ("--exclude", "*.q_proj")])
def test_quantization_options_without_quant_are_refused(tiny, tmp_path, capsys, option):
    code, _, err = camshaft(capsys, "build", "--model", tiny, "--output", tmp_path / "e", *option)
    err = one_line(err)
    assert code == 1 and f"error: {option[0]} is a quantization option: add --quant FORMAT" in err, err
    assert not (tmp_path / "e").exists()


def test_a_quantization_option_for_a_quantized_checkpoint_says_to_quantize_the_original(tiny, tmp_path, capsys):
    quantized = tmp_path / "q"
    shutil.copytree(tiny, quantized)
    (quantized / "hf_quant_config.json").write_text("{}")  # the option alone is refused before it is read
    code, _, err = camshaft(capsys, "build", "--model", quantized, "--output", tmp_path / "e", "--kv-cache-dtype",
                            "fp8")
    assert code == 1 and f"--kv-cache-dtype is a quantization option, and {quantized} is already quantized: " \
        "quantize the original float checkpoint again with it" in one_line(err), err  # not "add --quant", refused too


def test_several_options_are_named_together(tiny, tmp_path, capsys):
    code, _, err = camshaft(capsys, "build", "--model", tiny, "--output", tmp_path / "e", "--calib-size", "8",
                            "--group-size", "auto")
    assert code == 1 and "--group-size, --calib-size are quantization options" in one_line(err)


def test_explicit_values_are_used_not_replaced_by_defaults(tiny, tmp_path, capsys):
    code, _, err = camshaft(capsys, "build", "--model", tiny, "--output", tmp_path / "e", "--quant", "int4_wo",
                            "--group-size", "64")
    assert code == 1 and "group size 64 does not divide" in one_line(err) and nothing_quantized(tmp_path / "e")


def test_a_rebuild_that_fails_keeps_the_checkpoint_its_engine_was_built_from(tiny, tmp_path, capsys, monkeypatch):
    import json
    from importlib import import_module

    from camshaft.errors import CamshaftError

    engine = tmp_path / "e"
    code, _, err = camshaft(capsys, "build", "--model", tiny, "--output", engine, "--quant", "int8_wo",
                            "--calib-size", "2", "--calib-seq-len", "32")
    assert code == 0, err
    assert f"written to {tmp_path / 'e.ckpt'} (once the engine is built)" in one_line(err) and "partial" not in err
    kept = json.loads((tmp_path / "e.ckpt" / "hf_quant_config.json").read_text())

    def full(*_args, **_kwargs):  # the disk filled up as the engine was compiled
        raise CamshaftError("No space left on device")
    monkeypatch.setattr(import_module("camshaft.builder.build"), "build_engine", full)
    code, _, err = camshaft(capsys, "build", "--model", tiny, "--output", engine, "--quant", "int4_wo",
                            "--calib-size", "2", "--calib-seq-len", "32")
    assert code == 1 and "No space left on device" in err
    assert json.loads((tmp_path / "e.ckpt" / "hf_quant_config.json").read_text()) == kept  # still the engine's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "e.ckpt"]  # no staging left
