"""An engine directory loaded for running: manifest, backend, KV block pool and tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from camshaft.engine_files import (
    CHAT_TEMPLATE,
    NAMED_TEMPLATES,
    TOKENIZER_DIR,
    unchanged_while_loading,
    unlisted_tokenizer_entries,
)
from camshaft.errors import EngineError
from camshaft.io_signature import GROUP_FLAGS, SLIDING_INPUTS
from camshaft.manifest import Manifest, read_manifest
from camshaft.model_config import ModelConfig
from camshaft.runtime.batch import FEED_NAMES, Chunk, StepBatch, build_step
from camshaft.runtime.kv_cache import BlockPool, cache_copies, check_fits_host, fraction_bytes, pool_blocks
from camshaft.runtime.llm_options import check_threads_target
from camshaft.transformers_import import from_transformers

EDITABLE = (CHAT_TEMPLATE, NAMED_TEMPLATES)  # what a user may add or edit after the build


def check_tokenizer_files(engine_dir: Path, files: Iterable[str]) -> None:
    """A file in the tokenizer's directory that the build did not write (`files`: the manifest's) is refused:
    transformers would read it and tokenize otherwise. Chat templates and hidden files are let be."""
    extra = [name for name in unlisted_tokenizer_entries(engine_dir, files, through_link=True)
             if name not in EDITABLE and not name.startswith(".")]
    if extra:
        raise EngineError(f"{engine_dir / TOKENIZER_DIR} holds {', '.join(extra)}, which the build did not write and "
                          "which would change how text is tokenized; remove them (or rebuild the engine)")
    tokenizer = engine_dir / TOKENIZER_DIR
    for template in [tokenizer / CHAT_TEMPLATE, *sorted((tokenizer / NAMED_TEMPLATES).glob("*.jinja"))]:
        if problem := not_utf8(template):
            raise EngineError(f"{template} {problem}")


def not_utf8(template: Path) -> str | None:
    """Why a chat template is not UTF-8 text, which transformers reads it as (an editor's "Unicode" save is UTF-16:
    the tokenizer would not load), or None (UTF-8, or none: transformers says what it cannot read as it loads)."""
    try:
        template.read_bytes().decode("utf-8")
    except OSError:
        return None
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
    return None


def load_tokenizer(engine_dir: Path, files: Iterable[str] | None = None):
    """The engine's tokenizer; with `files` (the manifest's), checked by check_tokenizer_files first."""
    # The fast tokenizer class alone imports in ~1 s; AutoTokenizer pulls in torch and takes several.
    PreTrainedTokenizerFast = from_transformers("PreTrainedTokenizerFast")

    path = engine_dir / TOKENIZER_DIR
    if not (path / "tokenizer.json").is_file():
        raise EngineError(f"{engine_dir} has no {TOKENIZER_DIR}/tokenizer.json; rebuild the engine")
    check_tokenizer_files(engine_dir, files or ())
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    except MemoryError:  # the process's memory, not the tokenizer: rebuilding would not help
        raise
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        raise EngineError(f"the tokenizer in {path} could not be loaded ({exc}); rebuild the engine") from exc


def end_ids(config: ModelConfig, tokenizer) -> tuple[int, ...]:
    """The tokenizer's eos, then the model's other end ids (generation config), as vLLM and TGI stop on each (a
    fine-tune's config may keep its base's <|endoftext|> while its chat template ends turns with the tokenizer's
    <|im_end|>). The first is vLLM's eos, whose stop_reason is None; the others end as its stop_token_ids do."""
    eos = tokenizer.eos_token_id
    first = (eos,) if isinstance(eos, int) and 0 <= eos < config.vocab_size else ()
    return (*first, *(i for i in config.eos_token_ids if i not in first))


def check_model_inputs(m: Manifest, engine_dir: Path) -> None:
    """The manifest's model agrees with the graph inputs it lists, the sequence graph's too (what the runtime feeds
    follows the model)."""
    inputs = {spec.name for spec in m.inputs}
    if ({spec.name for spec in SLIDING_INPUTS} <= inputs) != m.model.has_sliding_layers:
        raise EngineError(f"{engine_dir}: its manifest's model has {'' if m.model.has_sliding_layers else 'no '}"
                          "sliding-window layers but its graph inputs say otherwise: the manifest was edited or "
                          "belongs to another build; rebuild the engine")
    long_rope = m.model.rope.switches_to_long(m.limits.max_seq_len)
    sequence_inputs = {spec.name for spec in m.sequence_graph.inputs} if m.sequence_graph else None
    if ("long_rope_from" in inputs) != long_rope or sequence_inputs is not None and (
            "long_rope_from" in sequence_inputs) != long_rope:
        raise EngineError(f"{engine_dir}: its manifest's model and limits say LongRoPE's long factors are "
                          f"{'' if long_rope else 'never '}reached but its graph inputs say otherwise: the manifest "
                          "was edited or belongs to another build; rebuild the engine")


class Engine:
    def __init__(self, engine_dir: str | Path, *, max_sequences: int = 1, kv_cache_memory: int | float | None = None,
                 most_blocks: int | None = None, threads: int | None = None, spin_wait: bool = True,
                 huge_pages: bool = True, manifest: Manifest | None = None) -> None:
        """kv_cache_memory: the pool's budget in bytes, or a fraction (kv_cache.memory_spec) of the memory free once
        the weights are loaded; most_blocks: a cap on the pool a budget gives. huge_pages: the loaded weights on
        transparent huge pages (Linux; see runtime/backends/huge_pages.py). manifest: the engine's, when the caller has
        read it (what it read is what gets checked after loading)."""
        self.dir = Path(engine_dir)
        self.manifest: Manifest = manifest or read_manifest(self.dir)
        m = self.manifest
        inputs = {spec.name for spec in m.inputs}
        unknown = inputs - FEED_NAMES
        if unknown:
            raise EngineError(f"{self.dir}: the engine takes inputs this camshaft does not produce "
                              f"({', '.join(sorted(unknown))}); upgrade camshaft or rebuild the engine with this one")
        self.group_flags = {spec.name for spec in GROUP_FLAGS} <= inputs
        check_model_inputs(m, self.dir)
        self.long_rope = m.model.rope if "long_rope_from" in inputs else None
        copies = cache_copies(m)
        if isinstance(kv_cache_memory, float):  # sized by the backend once the weights are loaded, of what is free then
            num_blocks = lambda free: pool_blocks(  # noqa: E731 - called with the free bytes it measures
                m, max_sequences, fraction_bytes(kv_cache_memory, free), copies, kv_cache_memory, most_blocks)
        else:
            num_blocks = pool_blocks(m, max_sequences, kv_cache_memory, copies, most=most_blocks)
            check_fits_host(m, num_blocks)
        with unchanged_while_loading(self.dir, m.build_id):
            self.backend = self._backend(num_blocks, threads, spin_wait, huge_pages)
            self.pool = BlockPool(self.backend.num_blocks)
            self.tokenizer = load_tokenizer(self.dir, m.files)
        config = m.model
        self.sliding_window = config.sliding_window if config.has_sliding_layers else None
        self.eos_token_ids = end_ids(config, self.tokenizer)

    def _backend(self, num_blocks: int | Callable[[int], int], threads: int | None, spin_wait: bool, huge_pages: bool):
        target = self.manifest.target
        if target == "onnxruntime":
            from camshaft.runtime.backends.onnxruntime import OnnxRuntimeBackend

            return OnnxRuntimeBackend(self.dir, self.manifest, num_blocks, threads, spin_wait, huge_pages)
        if target in ("tensorrt-rtx", "tensorrt"):  # never run on a GPU yet: see backends/tensorrt.py
            from camshaft.runtime.backends.tensorrt import TensorRTBackend

            check_threads_target(threads, target, self.dir)
            return TensorRTBackend(self.dir, self.manifest, num_blocks, threads, spin_wait, huge_pages)
        raise EngineError(f"{self.dir}: engines for target {target!r} cannot run in this build of camshaft")

    def close(self) -> None:
        """Release the backend's session and KV buffers now rather than at garbage collection."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    @property
    def limits(self):
        return self.manifest.limits

    @property
    def token_budget(self) -> int:
        """Most tokens (prompt + output) one sequence may hold: every usable block of the pool."""
        return self.pool.capacity * self.block_size

    @property
    def block_size(self) -> int:
        return self.manifest.limits.kv_block_size

    def prepare(self, chunks: list[Chunk]) -> StepBatch:
        return build_step(chunks, self.block_size, self.sliding_window, self.group_flags, self.long_rope)

    def step(self, chunks: list[Chunk]) -> np.ndarray:
        """Run one step; returns logits [rows, vocab]: each chunk's `num_logits` last tokens, in chunk order."""
        return self.backend.step(self.prepare(chunks).feeds)
