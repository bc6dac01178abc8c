"""Benchmark requests as text (every endpoint takes text) and their arrival times."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from camshaft.errors import RequestError


@dataclass(frozen=True)
class ServeRequest:
    prompt: str
    prompt_tokens: int
    max_tokens: int


def load_tokenizer(path: str | Path):
    """The tokenizer of an engine directory, a Triton repository camshaft deployed (its engine's) or a Hugging Face
    checkpoint directory (local files only)."""
    from camshaft.engine_files import TOKENIZER_DIR, deployed_record
    from camshaft.runtime.engine import load_tokenizer as engine_tokenizer
    from camshaft.transformers_import import from_transformers

    path = Path(path)
    record = deployed_record(path)
    served = [Path(record["engine_dir"]) / TOKENIZER_DIR] if record else []
    for where in (path / TOKENIZER_DIR, path, *served):
        if (where / "tokenizer.json").is_file():
            if where.name == TOKENIZER_DIR and where != path:  # an engine's: checked as its loaders check it
                return engine_tokenizer(where.parent)
            return from_transformers("PreTrainedTokenizerFast").from_pretrained(str(where))
    if record:
        raise RequestError(f"{path} serves the engine {record['engine_dir']}, which has no tokenizer there (moved or "
                           "removed?); pass the engine's directory as --tokenizer, or deploy it again")
    raise RequestError(f"{path} holds no tokenizer.json; pass an engine or checkpoint directory as --tokenizer")


def load_requests(dataset: str, num_requests: int, tokenizer, *, seed: int = 0,
                  max_seq_len: int | None = None) -> list[ServeRequest]:
    """`prefill-heavy`, `decode-heavy`, `synthetic:in=DIST,out=DIST` (random text of about that many tokens) or
    `jsonl:PATH` of {"prompt": text, "max_tokens": n}. Lengths are clipped to max_seq_len when it is given
    (`bench serve` instead refuses a dataset longer than an llm target's engine)."""
    from camshaft.runtime.bench_data import parse_dataset_spec

    if num_requests < 1:
        raise RequestError(f"--num-requests must be >= 1, got {num_requests}")
    spec = parse_dataset_spec(dataset)
    if spec.kind == "jsonl":
        return _jsonl(spec.path, num_requests, tokenizer)
    if tokenizer is None:
        raise RequestError("a synthetic dataset needs a tokenizer to size its prompts: pass --tokenizer DIR")
    rng = np.random.default_rng(seed)
    limit = max_seq_len or 1 << 30
    prompt_lens = np.clip(spec.prompt_len.sample(rng, num_requests), 1, limit - 1)
    output_lens = np.clip(spec.output_len.sample(rng, num_requests), 1, limit - prompt_lens)
    pieces = _text_pieces(tokenizer)
    return [_random_text(tokenizer, rng, pieces, int(p), int(o))
            for p, o in zip(prompt_lens, output_lens, strict=True)]


def _text_pieces(tokenizer) -> list[str]:
    """Vocabulary entries that decode to printable text and encode back to themselves, special tokens left out (those
    tokenizer.json marks special too, not only the ones all_special_tokens lists: SmolLM2's <filename>)."""
    ids = range(min(len(tokenizer), 30000))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special} if backend else set()
    pieces = [tokenizer.decode([i]) for i in ids]
    good = [p for i, p in zip(ids, pieces, strict=True) if p.strip() and p.isprintable() and i not in special
            and tokenizer(p, add_special_tokens=False)["input_ids"] == [i] and p not in tokenizer.all_special_tokens]
    if len(good) < 20:
        raise RequestError("the tokenizer has too few plain-text tokens to make synthetic prompts; use a jsonl dataset")
    return good


def _random_text(tokenizer, rng: np.random.Generator, pieces: list[str], length: int,
                 max_tokens: int) -> ServeRequest:
    """Random vocabulary pieces joined until the text encodes to `length` tokens (adjacent pieces may merge)."""
    chosen: list[str] = []
    count = 0
    for _ in range(8):
        chosen += [pieces[i] for i in rng.integers(0, len(pieces), length - count)]
        count = len(tokenizer("".join(chosen), add_special_tokens=False)["input_ids"])
        while count > length:
            chosen.pop()
            count = len(tokenizer("".join(chosen), add_special_tokens=False)["input_ids"])
        if count == length:
            break
    return ServeRequest("".join(chosen), max(1, count), max_tokens)


def _jsonl(path: Path, num_prompts: int, tokenizer) -> list[ServeRequest]:
    from camshaft.runtime.bench_data import read_jsonl_requests

    rows = []
    for prompt, max_tokens in read_jsonl_requests(path):
        if not isinstance(prompt, str):
            raise RequestError(f"{path}: serving endpoints take text prompts, got {prompt!r:.80}")
        count = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if tokenizer is not None else 0
        rows.append(ServeRequest(prompt, count, max_tokens))
    return [rows[i % len(rows)] for i in range(num_prompts)]  # fewer rows repeat (bench_data.repeat_note says so)


def parse_rates(text: str) -> list[float]:
    """'inf' or comma-separated requests/s, e.g. '1,4,inf'."""
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            rate = float(part)
        except ValueError:
            rate = -1.0
        if not rate > 0:  # nan too
            raise RequestError(f"--request-rate takes positive numbers or inf, comma-separated; got {text!r}")
        rates.append(rate)
    return rates


def arrival_times(count: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start: a Poisson process of `rate` requests/s (all at 0 when rate is inf)."""
    if rate == float("inf"):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, count)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
