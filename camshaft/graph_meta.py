"""What an engine's ONNX graphs say about themselves, for the runtime to check against the manifest: the build limits
they were lowered for (graph metadata), and why an engine has no sequence graph."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from camshaft.errors import EngineError
from camshaft.manifest import BuildLimits
from camshaft.model_config import ModelConfig

GRAPH_LIMITS_KEY = "camshaft.build_limits"  # the ONNX graph's metadata entry: the limits it was lowered for (JSON)
BUILD_ID_KEY = "camshaft.build_id"  # and the build it belongs to (the manifest's build_id)


def graph_limits(limits: BuildLimits, batch_graph: bool) -> dict[str, str]:
    """The metadata entry naming the limits a graph depends on: the rope table's rows, max(max_seq_len,
    max_num_tokens), for both graphs, and the paged cache's block size for the batch graph."""
    values = {"max_seq_len": limits.max_seq_len, "max_num_tokens": limits.max_num_tokens}
    if batch_graph:
        values["kv_block_size"] = limits.kv_block_size
    return {GRAPH_LIMITS_KEY: json.dumps(values, sort_keys=True)}


def check_build_id(metadata: dict[str, str], build_id: str, path: Path) -> None:
    """A graph of another build than the manifest's (its files re-listed by hand) is refused: the sequence graph reads
    the batch graph's weights by offset, so a mix would run on the wrong weights. Graphs without the entry (built
    before it existed) are not compared."""
    recorded = metadata.get(BUILD_ID_KEY)
    if recorded is not None and build_id and recorded != build_id:
        raise EngineError(f"{path} belongs to build {recorded[:12]}, its manifest to {build_id[:12]}: files of two "
                          "builds were mixed; rebuild the engine")


def check_graph_limits(metadata: dict[str, str], limits: BuildLimits, path: Path) -> None:
    """A graph lowered for other limits than its manifest says is refused; a graph without the entry (built before
    it existed) is not compared."""
    recorded = metadata.get(GRAPH_LIMITS_KEY)
    if recorded is None:
        return
    wanted = asdict(limits)
    differ = {k: v for k, v in json.loads(recorded).items() if wanted.get(k) != v}
    if differ:
        says = ", ".join(f"{k} {v} (manifest: {wanted.get(k)})" for k, v in differ.items())
        raise EngineError(f"{path} was built for {says}: the manifest was edited or belongs to another build; "
                          "rebuild the engine")


def sequence_graph_support(config: ModelConfig, dtype: str, kv_dtype: str | None) -> str | None:
    """Why an engine gets no sequence graph (the Session then runs the batch graph), or None when it gets one."""
    if dtype != "float32":
        return f"it is built for {dtype}; ONNX Runtime's CPU GroupQueryAttention takes float32"
    if kv_dtype is not None:
        return f"its KV cache is {kv_dtype}; the sequence graph keeps a float cache"
    if config.head_dim % 8:
        return f"its head size {config.head_dim} is not a multiple of 8, as GroupQueryAttention requires"
    return None
