"""The parameters Triton hands a model over that are not its inputs: a request's (a /generate body's keys that are
not inputs) and the model's own config.pbtxt parameters. Both are refused when nothing reads them."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from camshaft.errors import CamshaftError, RequestError

# /generate's request id, which Triton also hands over as a parameter; the request parameter tensorrtllm_backend's
# clients (inflight_batcher_llm_client.py) send, which its backend does not read either (the stream input decides)
TRITON_PARAMETERS = {"id", "Streaming"}


def check_parameters(parameters: str, inputs: Sequence[str]) -> None:
    """Triton hands a /generate body's keys that are not inputs over as request parameters: refuse them (a typo or
    an input this model lacks would otherwise be ignored)."""
    unknown = sorted(set(json.loads(parameters or "{}")) - TRITON_PARAMETERS)
    if unknown:
        raise RequestError(f"unknown input {unknown[0]!r} (sent as a request parameter; camshaft reads none); "
                           f"this model's inputs: {', '.join(inputs)}")


# tensorrtllm_backend's config.pbtxt parameters that camshaft takes under another name (deploy writes them)
BACKEND_PARAMETERS = {
    "gpt_model_path": "engine_dir (camshaft deploy --engine)",
    "max_queue_size": "camshaft deploy --max-queue (llm_options key max_queue)",
    "batch_scheduler_policy": "camshaft deploy --policy (llm_options key policy)",
    "kv_cache_free_gpu_mem_fraction": "camshaft deploy --kv-cache-memory (llm_options key kv_cache_memory)",
    "max_tokens_in_paged_kv_cache": "camshaft deploy --kv-cache-memory (llm_options key kv_cache_memory)",
    "max_num_tokens": "camshaft deploy --max-num-tokens (llm_options key max_num_tokens)",
}


PYTHON_BACKEND_PARAMETERS = {"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"}  # Triton's python backend reads
# what camshaft deploy writes into each model's config.pbtxt, and all the model reads
COMMON_PARAMETERS = {"camshaft_model", "camshaft_path", "engine_dir"}
TOKEN_MODEL_PARAMETERS = COMMON_PARAMETERS | {"llm_options", "exclude_input_in_output"}
TEXT_MODEL_PARAMETERS = COMMON_PARAMETERS | {"token_model", "max_requests", "stream_model"}


def check_model_parameters(model: str, params: dict[str, str], known: set[str]) -> None:
    """Refuse config.pbtxt parameters neither the model nor Triton's python backend reads (they would be ignored),
    naming camshaft's equivalent of tensorrtllm_backend's."""
    unknown = sorted(set(params) - known - PYTHON_BACKEND_PARAMETERS)
    if unknown:
        said = "; ".join(f"for {key} use {BACKEND_PARAMETERS[key]}" for key in unknown if key in BACKEND_PARAMETERS)
        raise CamshaftError(f"{model}: config.pbtxt parameter(s) {', '.join(unknown)} are not read here and would "
                            f"be ignored; remove them{'; ' + said if said else ''} (a repository an older camshaft "
                            f"wrote: deploy it again). It reads {', '.join(sorted(known))}")


def configured_engine(model_dir: Path) -> Path | None:
    """The engine_dir a model's config.pbtxt gives it (as deploy writes the parameter), or None."""
    try:
        text = (model_dir / "config.pbtxt").read_text()
    except (OSError, ValueError):
        return None
    found = re.search(r'key: "engine_dir"\s*value \{ string_value: ("(?:[^"\\]|\\.)*") \}', text)
    try:
        return Path(json.loads(found.group(1))) if found else None
    except ValueError:
        return None


def same_build(build_a: str, dir_a: Path, build_b: str, dir_b: Path) -> bool:
    """Whether two engines are one build: their build ids, or their paths for engines before format 3 (none)."""
    return build_a == build_b and bool(build_a or Path(dir_a).resolve() == Path(dir_b).resolve())


def check_same_engine(model: str, engine_dir: Path, build_id: str, token_dir: Path) -> None:
    """A text model runs on the executor its token model hosts: refuse to load one deployed with another engine
    (one repository's models copied into another's answered with that one's weights, through their own tokenizer)."""
    from camshaft.manifest import read_manifest

    hosted = configured_engine(token_dir)
    if hosted is None:
        return  # not a config deploy wrote: the token model says what it lacks
    try:
        hosted_id = read_manifest(hosted, check_files=False).build_id
    except CamshaftError:
        return  # the token model's own load fails, naming it
    if not same_build(hosted_id, hosted, build_id, engine_dir):
        raise CamshaftError(f"model {model!r} was deployed with the engine {engine_dir}, but the token model "
                            f"{token_dir.name!r} it runs on hosts {hosted}: a repository serves one engine (models "
                            "copied in from another repository would answer with this one's weights); deploy each "
                            "engine into a repository of its own and serve each on its own ports")
