"""Perplexity of a text through an engine, in windows of its max_seq_len, or, for reference, through transformers in
the window given (`camshaft eval ppl` gives it the engine's when both run)."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from camshaft.errors import RequestError, needs_extra
from camshaft.float_model import load_float_model, transformers_tokenizer
from camshaft.manifest import MANIFEST_NAME
from camshaft.model_config import HF_QUANT_CONFIG, ModelConfig, require_tokenizer, unreadable_quantization
from camshaft.runtime.batch import Chunk
from camshaft.runtime.engine import Engine
from camshaft.runtime.llm_options import check_runtime_options
from camshaft.weight_files import refuse_stored_codes

REFERENCE_WINDOW = 1024  # tokens a transformers window scores (--window)
NLL_ROWS = 64


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    tokens_scored: int
    windows: int


def read_text(path: str | Path) -> str:
    path = Path(path)
    if path.is_dir():
        raise RequestError(f"{path} is a directory; pass a UTF-8 text file with --data")
    if not path.exists():
        raise RequestError(f"{path} does not exist; pass a UTF-8 text file with --data")
    try:
        text = path.read_bytes().decode("utf-8-sig")  # the file's text as it is (\r\n too); a BOM is not text
    except UnicodeDecodeError as exc:
        raise RequestError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); pass a UTF-8 text file "
                           "with --data") from exc
    if not text.strip():
        raise RequestError(f"{path} is empty; perplexity needs some text")
    return text


def check_window(window: int) -> None:
    if window < 2:
        raise RequestError(f"--window must be at least 2 tokens (each window scores its tokens after the first), "
                           f"got {window}")


SAME_MODEL_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim")


def check_same_model(engine: ModelConfig, model_dir: str | Path) -> None:
    """Refuse a --model that is not the model the --engine was built from (another architecture or shape): the two
    perplexities would not compare."""
    reference = ModelConfig.from_hf_dir(Path(model_dir))
    differ = [f"{name} {getattr(engine, name)} vs {getattr(reference, name)}" for name in SAME_MODEL_FIELDS
              if getattr(engine, name) != getattr(reference, name)]
    if differ:
        raise RequestError(f"--model {model_dir} is not the model the --engine was built from ({', '.join(differ)}); "
                           "pass the checkpoint it was built from (the float one, for a quantized engine)")


def check_reference_model(model_dir: str | Path) -> None:
    """Refuse a --model directory transformers cannot score as the float reference, before loading anything."""
    path = Path(model_dir)
    if not path.is_dir():
        raise RequestError(f"--model {path} is not a directory; pass a Hugging Face checkpoint directory")
    if (path / MANIFEST_NAME).is_file():
        raise RequestError(f"--model {path} is an engine directory; pass it with --engine (--model takes the "
                           "Hugging Face checkpoint it was built from)")
    if (path / HF_QUANT_CONFIG).is_file():
        raise RequestError(f"--model {path} is a quantized checkpoint ({HF_QUANT_CONFIG}), which transformers does "
                           "not run as camshaft builds it; build an engine (camshaft build --model "
                           f"{shlex.quote(str(path))} --output ENGINE) and pass --engine ENGINE, or pass the float "
                           "checkpoint to --model")
    if not (path / "config.json").is_file():
        raise RequestError(f"--model {path} has no config.json; pass a Hugging Face checkpoint directory")
    require_tokenizer(path, RequestError, f"--model {path}")
    ModelConfig.from_hf_dir(path)  # an architecture, or config values, camshaft could not build: refused as build does
    if method := unreadable_quantization(path):
        raise RequestError(f"--model {path} is quantized (config.json's quantization_config, quant_method {method}), "
                           "which camshaft does not score as the float reference; pass the float checkpoint")
    refuse_stored_codes(path, RequestError, "pass the float checkpoint to --model")  # safetensors only, too


def reference_window(model_dir: str | Path, window: int | None, given: str = "--window") -> int:
    """The transformers reference's window: `window` (None: REFERENCE_WINDOW), refused past the positions the model
    was trained for (a meaningless perplexity otherwise), where its config.json says how many. `given`: where the
    window came from, for the message."""
    try:
        positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, RecursionError, AttributeError):
        positions = None
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 2:
        return REFERENCE_WINDOW if window is None else window
    if window is None:
        return min(REFERENCE_WINDOW, positions)
    if window > positions:
        raise RequestError(f"{given} {window} exceeds --model's max_position_embeddings ({positions}); pass "
                           f"--window {positions} or less")
    return window


def windows(ids: list[int], size: int) -> list[list[int]]:
    if len(ids) < 2:
        raise RequestError("the text encodes to fewer than 2 tokens; perplexity needs at least 2")
    return [ids[i: i + size] for i in range(0, len(ids), size) if len(ids[i: i + size]) >= 2]


def check_vocab(ids: list[int], vocab_size: int, model: str) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise RequestError(f"the text encodes to token id {bad}, outside {model}'s vocabulary (0..{vocab_size - 1}): "
                           "its tokenizer has tokens the model has no embedding for; score a text without them")


def _nll(logits: np.ndarray, targets: list[int]) -> float:
    """Summed negative log-likelihood of `targets` under the rows of `logits`, a block of rows at a time (a large
    vocabulary's window in float64 at once would take gigabytes)."""
    total = 0.0
    for i in range(0, len(targets), NLL_ROWS):
        x = logits[i: i + NLL_ROWS].astype(np.float64)
        top = x.max(-1, keepdims=True)
        logz = np.log(np.exp(x - top).sum(-1)) + top[:, 0]
        total += float((logz - x[np.arange(len(x)), targets[i: i + NLL_ROWS]]).sum())
    return total


def engine_perplexity(engine_dir: str | Path, text: str, threads: int | None = None,
                      progress: Callable[[str], None] = lambda _: None) -> PerplexityResult:
    """`progress` hears "engine: window i/N" as each window is scored."""
    check_runtime_options(threads)
    engine = Engine(engine_dir, max_sequences=1, threads=threads)
    ids = engine.tokenizer(text, verbose=False)["input_ids"]  # windowed below: no "indexing errors" warning
    check_vocab(ids, engine.manifest.model.vocab_size, "the engine")
    limits = engine.limits
    total, count, parts = 0.0, 0, windows(ids, limits.max_seq_len)
    for i, window in enumerate(parts, 1):
        blocks = engine.pool.allocate(-(-len(window) // engine.block_size))
        try:
            for start in range(0, len(window), limits.max_num_tokens):  # each piece scored as it comes
                piece = window[start: start + limits.max_num_tokens]
                logits = engine.step([Chunk(piece, start, blocks, len(piece), longest_pass=len(window))])
                targets = window[start + 1: start + len(piece) + 1]  # the window's last row predicts nothing
                total += _nll(logits[: len(targets)], targets)
        finally:
            engine.pool.free(blocks)
        count += len(window) - 1
        progress(f"engine: window {i}/{len(parts)}")
    return PerplexityResult(math.exp(total / count), count, len(parts))


def reference_perplexity(model_dir: str | Path, text: str, window: int,
                         progress: Callable[[str], None] = lambda _: None) -> PerplexityResult:
    """transformers fp32 on the same windows: the numerics reference (needs torch); `progress` as
    engine_perplexity's."""
    check_window(window)
    check_reference_model(model_dir)
    try:
        import torch
        import transformers  # noqa: F401  (the reference extra: said before loading anything)
    except ImportError as exc:
        raise RequestError(needs_extra(f"the transformers reference ({exc.name} is not installed)", "reference")) \
            from exc
    path = Path(model_dir)
    tokenizer = transformers_tokenizer(path, f"--model {path}")
    model = load_float_model(path, f"--model {path}", "score")
    ids = tokenizer(text, verbose=False)["input_ids"]
    check_vocab(ids, model.config.vocab_size, "--model")
    total, count, parts = 0.0, 0, windows(ids, window)
    with torch.no_grad():
        for i, part in enumerate(parts, 1):
            logits = model(torch.tensor([part])).logits[0, :-1].numpy()
            total += _nll(logits, part[1:])
            count += len(part) - 1
            progress(f"transformers: window {i}/{len(parts)}")
    return PerplexityResult(math.exp(total / count), count, len(parts))
