"""`camshaft deploy`: a Triton model repository for an engine, its config.pbtxt files generated from the manifest.

Models: `tensorrt_llm` (tokens; hosts the engine's one executor), `<name>` and `tensorrt_llm_bls` (text, as
tensorrtllm_backend's ensemble and BLS models take it: streaming, gRPC, /generate, /generate_stream) and `<name>_sync`
(text, not decoupled: plain HTTP/gRPC infer). With decoupled=False (tensorrtllm_backend's decoupled_mode false) none is
decoupled: one response a request, plain infer everywhere, no streaming. The text models reach the executor over a
private channel to the token model (channel.py); none loads the engine a second time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import camshaft
from camshaft.engine_files import REPOSITORY_MARKER, deployed_record
from camshaft.errors import CamshaftError, EngineError
from camshaft.manifest import read_manifest
from camshaft.outdir import check_replaceable, replace_dir, staged
from camshaft.runtime.engine_info import runs_here
from camshaft.runtime.llm_options import QUEUE_PER_BATCH
from camshaft.triton_repo.parameters import configured_engine
from camshaft.triton_repo.tensors import TEXT_INPUTS, TEXT_OUTPUTS, TOKEN_INPUTS, TOKEN_OUTPUTS, config_block
from camshaft.version import __version__

MARKER = REPOSITORY_MARKER
TOKEN_MODEL = "tensorrt_llm"
BLS_MODEL = "tensorrt_llm_bls"  # tensorrtllm_backend's text model beside the ensemble: the same text model here
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # what Triton takes as a model name (a directory)
SHIM = Path(__file__).with_name("model_shim.py")
TOKEN_MODEL_BATCH = 1024  # Triton's bound on a request's batch dimension (prompts a request)
LLM_OPTIONS = ("kv_cache_memory", "max_queue", "max_batch_size", "policy", "max_num_tokens", "threads", "prompt_lookup")
DEPLOY_FLAGS = ("kv_cache_memory", "max_batch_size", "policy", "max_num_tokens", "prompt_lookup")  # and max_queue


def _parameters(values: dict[str, str]) -> str:
    return "".join(f'parameters {{\n  key: "{k}"\n  value {{ string_value: {json.dumps(v, ensure_ascii=False)} }}\n}}\n'
                   for k, v in values.items())


def model_config(name: str, *, decoupled: bool, max_batch_size: int, token: bool, params: dict[str, str],
                 instances: int = 1) -> str:
    inputs, outputs = (TOKEN_INPUTS, TOKEN_OUTPUTS) if token else (TEXT_INPUTS, TEXT_OUTPUTS)
    batching = "" if decoupled else "dynamic_batching {\n  max_queue_delay_microseconds: 0\n}\n"
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
            f"model_transaction_policy {{\n  decoupled: {str(decoupled).lower()}\n}}\n{batching}"
            + config_block("input", inputs) + config_block("output", outputs)
            + f"instance_group [\n  {{\n    count: {instances}\n    kind: KIND_CPU\n  }}\n]\n" + _parameters(params))


def _entries(repo: Path) -> set[str]:
    """The names deploy wrote into `repo`: its marker and the model directories."""
    try:
        name = json.loads((repo / MARKER).read_text())["name"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return {MARKER, TOKEN_MODEL, BLS_MODEL}
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):  # an edited record: never a path out of `repo`
        return {MARKER, TOKEN_MODEL, BLS_MODEL}
    return {MARKER, TOKEN_MODEL, BLS_MODEL, name, f"{name}_sync"}


def _model_files(repo: Path, models) -> list[str]:
    """The files under the model directories, relative to `repo` (Python's bytecode caches, which the stubs write
    beside model.py, left out)."""
    return [str(path.relative_to(repo)) for model in sorted(models) for path in sorted((repo / model).rglob("*"))
            if path.is_file() and "__pycache__" not in path.parts]


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _file_hashes(repo: Path, models) -> dict[str, str]:
    return {name: _sha256(repo / name) for name in _model_files(repo, models)}


def _changed_files(repo: Path) -> list[str]:
    """The files of a repository deploy wrote that were edited or added since (`ensemble/config.pbtxt (edited)`);
    none for a repository of a camshaft that recorded no hashes. Only the files deploy wrote are read."""
    try:
        written = json.loads((repo / MARKER).read_text())["files"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return []
    now = _model_files(repo, [m for m in _entries(repo) - {MARKER} if (repo / m).is_dir()])
    return ([f"{path} (edited)" for path in now if path in written and _sha256(repo / path) != written[path]]
            + [f"{path} (added)" for path in now if path not in written])


def check_path(path: Path, what: str, spaces: bool = False) -> None:
    """Triton's python backend passes model paths to its stub processes split at whitespace (they then crash and
    the models never load), and its stubs read paths as ASCII (a model under 'répo' fails to load, an engine in
    'éng' reads as missing): such a path is refused before anything is written or started. spaces: whitespace is
    fine (an engine's path, which reaches the models as a parameter)."""
    both = f"{Path(path).absolute()}{Path(path).resolve()}"  # as written into the repository, and as opened
    if not spaces and any(c.isspace() for c in both):
        raise CamshaftError(f"{what} {str(path)!r} holds whitespace, which Triton's python backend cannot load models "
                            "from (its stubs crash); use a path without spaces")
    if not both.isascii():
        wide = "".join(dict.fromkeys(c for c in both if not c.isascii()))
        raise CamshaftError(f"{what} {str(path)!r} holds non-ASCII characters ({wide}), which Triton's python "
                            "backend cannot load models from (its stubs read paths as ASCII); use an ASCII path")


def check_deployed_engine(repo: Path) -> str | None:
    """The engine a repository serves, checked before a server loads it: a missing or broken engine is refused
    (CamshaftError) saying to deploy again; returns a warning when it was rebuilt since the deploy (the repository's
    batch and queue sizes were derived from the old build), else None."""
    record = deployed_record(repo)
    if record is None:
        return None  # not written by camshaft deploy: its models say what they lack
    engine = Path(record["engine_dir"])
    loaded = configured_engine(repo / TOKEN_MODEL)
    if loaded is not None and loaded != engine:  # config.pbtxt edited by hand: Triton loads what it says
        return (f"{repo}/{TOKEN_MODEL}/config.pbtxt serves the engine {loaded}, not the {engine} camshaft deploy "
                "recorded; it is not checked before loading")
    again = _deploy_again(record, repo)
    try:
        manifest = read_manifest(engine, check_files=False)
    except CamshaftError as exc:
        raise CamshaftError(f"{repo} serves the engine {engine}, which cannot be loaded ({exc}); deploy it again: "
                            f"{again.replace(shlex.quote(str(engine)), 'ENGINE')}") from None
    if why := runs_here(manifest, engine):  # a TensorRT engine without its GPU: before Triton starts, in one line
        raise EngineError(f"{repo} serves the engine {engine}, which does not run here: {why}")
    built = record.get("build_id")
    if built and manifest.build_id != built:
        return (f"{engine} was rebuilt since {repo} was deployed; its batch and queue sizes are the old build's: "
                f"{again} to match the new one")
    return None


def _deploy_again(record: dict, repo: Path) -> str:
    """The deploy command that wrote `record` (name, decoupled, the options given; a queue size deploy derived from
    the batch size is left to derive again)."""
    options = record.get("llm_options") if isinstance(record.get("llm_options"), dict) else {}
    flags = [f"--{key.replace('_', '-')} {shlex.quote(str(options[key]))}" for key in DEPLOY_FLAGS
             if options.get(key) is not None]
    name = record.get("name")
    flags += [f"--name {shlex.quote(name)}"] if isinstance(name, str) and name != "ensemble" else []
    flags += ["--no-decoupled"] if record.get("decoupled") is False else []
    return " ".join(["camshaft deploy --engine", shlex.quote(str(record["engine_dir"])), "--repo",
                     shlex.quote(str(repo)), *flags]) + " (and --max-queue N if you gave one)"


def deploy_repository(engine: Path, repo: Path, *, name: str = "ensemble", llm_options: dict | None = None,
                      decoupled: bool = True) -> Path:
    """Write (or replace) a repository serving `engine`; llm_options are LLM keyword arguments; decoupled: the
    models' transaction policy (`<name>_sync` is never decoupled)."""
    # "x/.." dropped (x may be gone when the repository is served); a symlink kept: engines/current -> v2 is followed
    engine, repo = Path(os.path.abspath(engine)), Path(repo)
    manifest = read_manifest(engine)  # refuses a missing or broken engine directory
    check_path(repo, "--repo")
    check_path(engine, "--engine", spaces=True)
    taken = (TOKEN_MODEL, BLS_MODEL)
    if not MODEL_NAME.fullmatch(name) or {name, f"{name}_sync"} & {*taken, MARKER}:
        raise CamshaftError(f"--name {name!r} must be a plain model name (letters, digits, _ . -) "
                            f"other than {', '.join(taken)} and {MARKER}")
    options = {k: v for k, v in (llm_options or {}).items() if v is not None}
    unknown = set(options) - set(LLM_OPTIONS)
    if unknown:
        raise CamshaftError(f"unknown LLM option(s) {sorted(unknown)}; known: {', '.join(LLM_OPTIONS)}")
    batch = options.get("max_batch_size") or manifest.limits.max_batch_size
    options.setdefault("max_queue", QUEUE_PER_BATCH * batch)  # as the CLI: a bounded queue the text models match
    admitted = batch + options["max_queue"]
    common = {"engine_dir": str(engine), "camshaft_path": str(Path(camshaft.__file__).resolve().parents[1])}
    text = {"camshaft_model": "camshaft.triton_repo.text_model:TextModel", "token_model": TOKEN_MODEL,
            "max_requests": str(admitted), "stream_model": name if decoupled else "", **common}
    models = {
        # a large batch bound lets any tensorrtllm_backend ensemble load (each prompt of a batch runs on its own)
        TOKEN_MODEL: model_config(TOKEN_MODEL, decoupled=decoupled, max_batch_size=TOKEN_MODEL_BATCH, token=True,
                                  params={"camshaft_model": "camshaft.triton_repo.token_model:TokenModel",
                                          "llm_options": json.dumps(options), "exclude_input_in_output": "false",
                                          **common}),
        **{model: model_config(model, decoupled=decoupled and model != f"{name}_sync", max_batch_size=batch,
                               token=False, params=text) for model in (name, f"{name}_sync", BLS_MODEL)},
    }
    if Path(engine).resolve().is_relative_to(Path(repo).resolve()):
        raise CamshaftError(f"--engine {engine} lies inside --repo {repo}, which deploy replaces as a whole; keep the "
                            "engine outside the repository")
    check_replaceable(repo, MARKER, "a camshaft Triton repository", CamshaftError, flag="--repo", owned=_entries)
    if changed := _changed_files(repo):
        raise CamshaftError(f"--repo {repo} holds {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} "
                            "since camshaft deploy wrote it, which deploying again would lose; move them aside (or "
                            "remove the repository if they are not wanted) and deploy again")
    with staged(repo, flag="--repo") as staging:
        for model, config in models.items():
            (staging / model / "1").mkdir(parents=True)
            (staging / model / "config.pbtxt").write_text(config)
            shutil.copyfile(SHIM, staging / model / "1" / "model.py")
        (staging / MARKER).write_text(json.dumps({
            "engine_dir": str(engine), "build_id": manifest.build_id, "name": name, "llm_options": options,
            "decoupled": decoupled,
            "camshaft_version": __version__, "files": _file_hashes(staging, models)},
            indent=2) + "\n")
        replace_dir(staging, repo)
    return repo
