"""An engine directory's files as the build wrote them: sizes and sampled fingerprints recorded in the manifest and
checked at load, so a file from another build (same size, other bytes) or a directory replaced while it loads is an
error, never garbage."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from camshaft.errors import BuildConfigError, EngineError

MANIFEST_NAME = "manifest.json"
REPOSITORY_MARKER = "camshaft_repository.json"  # a Triton model repository camshaft deploy wrote
TOKENIZER_DIR = "tokenizer"
CHAT_TEMPLATE = "chat_template.jinja"  # editable after the build (not fingerprinted)
NAMED_TEMPLATES = "additional_chat_templates"  # transformers' named templates (tool_use, ...): editable too
TEMPLATE_RECORD = f".{CHAT_TEMPLATE}.sha256"  # the sha256s of the templates the build wrote
BUILD_OUTPUTS = ("model.onnx", "model.onnx.data", "sequence.onnx", "sequence.onnx.data", "model.plan", "graph.onnx",
                 "graph.onnx.data")
SAMPLE_BYTES = 4096
WHOLE_BELOW = 1 << 22  # smaller files (graphs, tokenizer) are hashed whole
MAX_SAMPLES = 4096  # a larger one: samples every max(1 MiB, size / 4096) bytes, ~1 % of a 500 MB file


def deployed_record(repo: Path) -> dict | None:
    """What `camshaft deploy` recorded in a Triton repository (engine_dir, name, ...), or None where it wrote none
    (not a repository of camshaft's, or an unreadable record)."""
    try:
        record = json.loads((Path(repo) / REPOSITORY_MARKER).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("engine_dir"), str) else None


def fingerprint(path: Path) -> str:
    """sha256 of the size and of the whole file, or of evenly spaced samples and the tail of a large one."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size < WHOLE_BELOW:
            digest.update(f.read())
            return digest.hexdigest()
        for offset in range(0, size, max(1 << 20, size // MAX_SAMPLES)):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
        f.seek(size - SAMPLE_BYTES)
        digest.update(f.read())
    return digest.hexdigest()


def record_files(engine_dir: Path, names: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """Sizes and fingerprints of `names` (relative to `engine_dir`) for the manifest."""
    return ({name: (engine_dir / name).stat().st_size for name in names},
            {name: fingerprint(engine_dir / name) for name in names})


def check_files(engine_dir: Path, sizes: dict[str, int], fingerprints: dict[str, str]) -> None:
    """Every file the manifest lists is there, inside the directory, with its size and (where recorded) bytes."""
    for name, size in sizes.items():
        file = engine_dir / name
        if not file.is_file():
            raise EngineError(f"{engine_dir} is missing {name}; rebuild the engine with `camshaft build`")
        if name.endswith(".data") and file.resolve().parent != engine_dir.resolve():
            raise EngineError(f"{file} links to {file.resolve()}, not a file beside its graph in the engine directory, "
                              "where ONNX Runtime reads weights from; copy the engine as real files (cp -rL)")
        if name.endswith(".data") and file.stat().st_nlink > 1:
            raise hard_linked(file)
        if file.stat().st_size != size:
            raise EngineError(
                f"{file} has {file.stat().st_size} bytes but the manifest expects {size}: the file is truncated "
                "or was replaced. Rebuild the engine with `camshaft build`."
            )
        try:
            printed = fingerprint(file) if name in fingerprints else None
        except OSError as exc:
            raise EngineError(f"{file} could not be read ({exc.strerror or exc}); make the engine directory readable "
                              "by this user") from exc
        if printed is not None and printed != fingerprints[name]:
            raise EngineError(f"{file} is not the file this engine was built with (its bytes differ from the "
                              "manifest's fingerprint: copied from another build?); rebuild the engine with "
                              "`camshaft build`")


@contextlib.contextmanager
def unchanged_while_loading(engine_dir: Path, build_id: str) -> Iterator[None]:
    """Around loading an engine's files: a rebuild that replaced the directory meanwhile is said as that ("load it
    again"), whether the load then failed on the mixed files or went through."""
    try:
        yield
    except EngineError:
        check_unchanged(engine_dir, build_id)
        raise
    check_unchanged(engine_dir, build_id)


def check_unchanged(engine_dir: Path, build_id: str) -> None:
    """After loading: the directory still holds the build that was read first (a rebuild replacing it meanwhile
    may have mixed the two builds' files)."""
    if not build_id:
        return
    try:
        now = json.loads((engine_dir / MANIFEST_NAME).read_text()).get("build_id")
    except (OSError, ValueError, RecursionError, AttributeError):
        now = None
    if now != build_id:
        raise EngineError(f"{engine_dir} was replaced while it loaded (rebuilt meanwhile?); load it again")


def engine_entries(engine_dir: Path) -> set[str] | None:
    """The names a build writes into an engine directory (what rebuilding it may replace); None where its
    manifest.json is another program's (JSON without an engine format version). One that does not parse is taken
    for a damaged engine's, which a rebuild replaces."""
    manifest = _raw_manifest(engine_dir)
    if not isinstance(manifest, dict) or manifest and "format_version" not in manifest:
        return None
    return {MANIFEST_NAME, TOKENIZER_DIR, *BUILD_OUTPUTS, *(str(name).split("/")[0] for name in _files(manifest))}


def _raw_manifest(engine_dir: Path) -> object:
    """manifest.json as JSON, unchecked ({} where it cannot be read)."""
    try:
        return json.loads((engine_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError, RecursionError):
        return {}


def _files(manifest: object) -> dict:
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return files if isinstance(files, dict) else {}


def unlisted_tokenizer_entries(engine_dir: Path, files: Iterable[str], through_link: bool = False) -> list[str]:
    """The names in the engine's tokenizer directory that the build did not write (`files`: the manifest's); none
    for engines that list no tokenizer files (the earliest), nor for a directory symlinked in unless
    `through_link` (what a load reads: a rebuild replaces the link, so it loses nothing there)."""
    path = engine_dir / TOKENIZER_DIR
    listed = {Path(str(f)).name for f in files if Path(str(f)).parent.name == TOKENIZER_DIR}
    if not listed or not path.is_dir() or path.is_symlink() and not through_link:
        return []
    return sorted(p.name for p in path.iterdir() if p.name not in listed)


def hard_linked(file: Path) -> EngineError:
    """A weights file with other hard links, which ONNX Runtime refuses (its check for subgraph weights)."""
    try:
        others = f"{file.stat().st_nlink - 1} other hard link(s)"
    except OSError:
        others = "other hard links"
    return EngineError(f"{file} has {others} (a copy made with cp -al or rsync --link-dest, or a deduplicating "
                       "tool), which ONNX Runtime refuses as a possible hardlink attack; copy the engine as real "
                       "files (cp -r)")


def user_tokenizer_entries(engine_dir: Path) -> list[str]:
    """What rebuilding `engine_dir` would delete or replace in its tokenizer directory that its build did not write:
    entries added since (chat templates, hidden files), and templates edited since (their sha256 unlike the one the
    build recorded; engines that recorded none: templates not checked, named ones counted as added)."""
    unlisted = unlisted_tokenizer_entries(engine_dir, _files(_raw_manifest(engine_dir)))
    found = [f"{TOKENIZER_DIR}/{name}" for name in unlisted if name not in (CHAT_TEMPLATE, NAMED_TEMPLATES)]
    tok_dir = engine_dir / TOKENIZER_DIR
    recorded = _recorded_templates(tok_dir / TEMPLATE_RECORD)
    if recorded is None:
        return found + ([f"{TOKENIZER_DIR}/{NAMED_TEMPLATES}"] if NAMED_TEMPLATES in unlisted else [])
    named = f"{NAMED_TEMPLATES}/"
    named_added = (tok_dir / NAMED_TEMPLATES).exists() and not any(k.startswith(named) for k in recorded)
    if named_added:  # the whole directory, said once
        found.append(f"{TOKENIZER_DIR}/{NAMED_TEMPLATES}")
    for name, digest in template_digests(tok_dir).items():
        if named_added and name.startswith(named):
            continue
        if name not in recorded:
            found.append(f"{TOKENIZER_DIR}/{name} (added since the build)")
        elif digest != recorded[name]:
            found.append(f"{TOKENIZER_DIR}/{name} (edited since the build)")
    return found


def template_digests(tok_dir: Path) -> dict[str, str]:
    """The sha256 of each chat template in a tokenizer directory: chat_template.jinja and the named ones."""
    paths = [tok_dir / CHAT_TEMPLATE, *sorted((tok_dir / NAMED_TEMPLATES).rglob("*"))]
    digests = {}
    for path in paths:
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                digests[path.relative_to(tok_dir).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def _recorded_templates(record: Path) -> dict[str, str] | None:
    """The templates a build recorded (sha256sum's lines; engines before the named ones: the bare digest of
    chat_template.jinja); None where it recorded none."""
    try:
        lines = record.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    pairs = [line.split("  ", 1) for line in lines if line.strip()]
    return {pair[1] if len(pair) == 2 else CHAT_TEMPLATE: pair[0].strip() for pair in pairs}


def refuse_user_entries(output: Path) -> None:
    """An engine being rebuilt whose tokenizer directory gained entries or whose chat template was edited since its
    build is refused before any work (the rebuild would delete or revert them)."""
    if kept := user_tokenizer_entries(output):
        raise BuildConfigError(f"--output {output} holds {', '.join(kept)}, which this build would delete or replace; "
                               "move them out of the engine first (and back after the build)")


def record_template(tok_dir: Path) -> None:
    """Beside the chat templates a build writes, their sha256s (sha256sum's format; empty where it writes none): a
    rebuild then tells one edited or added since."""
    (tok_dir / TEMPLATE_RECORD).write_text("".join(f"{digest}  {name}\n"
                                                   for name, digest in template_digests(tok_dir).items()))


def write_atomic(path: Path, data: str | bytes | memoryview, mode: int = 0o644) -> None:
    """`path` holds `data` whole or, where writing fails (a full disk), what it held before: no half-written file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)  # mkstemp makes it private; an engine is read by servers running as other users
        with os.fdopen(fd, "w" if isinstance(data, str) else "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def graph_bytes(path: Path) -> int:
    """A graph's file and the weight files it reads (a sequence graph reads the batch graph's too)."""
    files = {path.name + ".data"}
    try:
        import onnx
        from onnx.external_data_helper import _get_all_tensors

        graph = onnx.load(str(path), load_external_data=False)
        files = {e.value for t in _get_all_tensors(graph) for e in t.external_data if e.key == "location"}
    except Exception:  # onnx's own errors, or no memory for the graph either: its own data file
        pass
    return path.stat().st_size + sum((path.parent / f).stat().st_size for f in files if (path.parent / f).is_file())
