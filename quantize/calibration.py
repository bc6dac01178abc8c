"""Calibration text and token samples.

The default corpus ships with every Python: the docstrings of a fixed list of standard-library modules and their
public members (stdlib_corpus.py: the same text on every run of the same Python version).
A user corpus is a text file, a JSONL file (one {"text": ...} object, string or {"messages": [...]} conversation a
line), or a directory of those; or, read through the `datasets` library, a parquet/arrow/csv file or directory of them,
or a `save_to_disk` directory. Conversations are rendered with the model's chat template.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from camshaft.checks import is_int_at_least
from camshaft.quantize.calibration_chat import CHAT_FIELD, Sample, checked_messages, render, sample_chars
from camshaft.quantize.calibration_datasets import (
    DATA_SUFFIXES,
    JSONL_SUFFIXES,
    TEXT_SUFFIXES,
    column_texts,
    open_dataset,
    text_column,
    text_files,
    train_split,
)
from camshaft.quantize.spec import QuantizeError
from camshaft.quantize.stdlib_corpus import stdlib_docstrings

DEFAULT_CALIB_SIZE = 64
DEFAULT_CALIB_SEQ_LEN = 256
LEAST_CALIB_SEQ_LEN = 8


def default_corpus() -> list[str]:
    return list(stdlib_docstrings())


def split_column(calib_data: str | Path) -> tuple[Path, str | None]:
    """PATH:COLUMN → (PATH, COLUMN) when PATH exists and PATH:COLUMN does not; anything else is a path."""
    path = Path(calib_data)
    head, sep, column = str(calib_data).rpartition(":")
    if sep and column and "/" not in column and not path.exists() and Path(head).exists():
        return Path(head), column
    return path, None


def read_text_corpus(path: Path, column: str | None = None,
                     max_chars: int | None = None) -> tuple[list[Sample], str]:
    """Texts (and conversations) of a text/JSONL file or of a directory of those, sorted by name (README files,
    dataset cards, hidden files skipped; its train split's where names mark splits, and then ", split train");
    `column`: the JSONL field (default: text, else messages). Reading stops
    after `max_chars` characters (the calibration uses the corpus from its start), so a huge file costs no more than
    what is used."""
    files, split = ([path], "") if not path.is_dir() else train_split(path, text_files(path))
    if not files:
        raise QuantizeError(f"calibration directory {path} holds no {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} or "
                            f"{'/'.join(DATA_SUFFIXES)} files and is no saved dataset (README and hidden files are "
                            "skipped)")
    if column is not None and any(f.suffix.lower() not in JSONL_SUFFIXES for f in files):
        raise QuantizeError(f"{path} holds plain text, which has no column {column}; drop :{column}")
    texts: list[Sample] = []
    left = math.inf if max_chars is None else max_chars
    for text in (t for file in files for t in _read_file(file, column, max_chars)):
        if chars := sample_chars(text):
            texts.append(text)
            left -= chars
        if left <= 0:  # the files are read lazily: nothing past this point is read
            break
    if not texts:
        raise QuantizeError(f"calibration data {path} is empty (no text found)")
    return texts, split


def _read_file(file: Path, field: str | None, max_chars: int | None) -> Iterator[Sample]:
    """A text file whole (at most max_chars), or a JSONL file's texts as they are read; UTF-8, a BOM allowed."""
    with open(file, "rb") as head:
        if head.read(2) == b"\x1f\x8b":
            raise QuantizeError(f"calibration file {file} is gzip-compressed; decompress it first (gunzip)")
    try:
        with open(file, encoding="utf-8-sig") as f:  # lines end at \n, \r\n or \r only (not U+2028 in a string)
            if file.suffix.lower() not in JSONL_SUFFIXES:
                text = f.read(-1 if max_chars is None else max_chars)
                if "\x00" in text:
                    raise QuantizeError(f"calibration file {file} holds NUL bytes: it is binary, not text")
                yield text
                return
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield _jsonl_text(line, file, number, field)
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantizeError(f"calibration file {file} could not be read as UTF-8 text: {exc}") from exc


def _jsonl_text(line: str, file: Path, number: int, field: str | None) -> Sample:
    """A line's text: a string, the `field` (default text) of an object, or its chat messages (default: the
    messages field of an object without a text field)."""
    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise QuantizeError(f"{file}:{number} is not valid JSON ({exc}); expected one JSON object a line") from exc
    if isinstance(item, str):
        return item
    value, name = None, field or "text"
    if isinstance(item, dict):
        value = item.get(name)
        if field is None and value is None:
            value, name = item.get(CHAT_FIELD), CHAT_FIELD
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return checked_messages(value, f"{file}:{number}")
    holds = f"an object with the keys {sorted(item)[:10]}" if isinstance(item, dict) else type(item).__name__
    wanted = f'a "{field}" field (a string or chat messages)' if field else 'a "text" string or "messages" list field'
    hint = (f"its {name} field holds {type(value).__name__}" if value is not None else
            f"another field: --calib-data {file}:FIELD" if isinstance(item, dict) else
            "a JSON array of records is not JSON Lines: write one record a line" if isinstance(item, list) else
            "one string or object a line")
    raise QuantizeError(f"{file}:{number}: expected a string or an object with {wanted}, found {holds} ({hint})")


@dataclass(frozen=True)
class CalibrationSet:
    """`num_samples` windows of `seq_len` tokens, cut in order from the concatenated corpus."""

    input_ids: np.ndarray  # [num_samples, seq_len] int64
    source: str

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


MAX_CHARS_PER_TOKEN = 64  # a text corpus is read up to this many characters a calibration token: far more than used


def check_sizes(num_samples: int, seq_len: int, max_positions: int | None = None) -> None:
    if not is_int_at_least(num_samples, 1):
        raise QuantizeError(f"--calib-size must be an integer >= 1, got {num_samples!r:.40}")
    if not is_int_at_least(seq_len, LEAST_CALIB_SEQ_LEN):
        raise QuantizeError(f"--calib-seq-len must be an integer >= {LEAST_CALIB_SEQ_LEN}, got {seq_len!r:.40}")
    if max_positions is not None and seq_len > max_positions:
        raise QuantizeError(f"--calib-seq-len {seq_len} exceeds the model's max_position_embeddings "
                            f"({max_positions}): it would calibrate at positions the model never saw; pass "
                            f"--calib-seq-len {max_positions} or less")


def load_texts(calib_data: str | Path | None, max_chars: int | None = None) -> tuple[Iterable[Sample], str]:
    """(non-empty texts, where they are from) of --calib-data (None: the default corpus); a dataset's are read
    lazily, in order, a text corpus's up to `max_chars` characters. PATH:COLUMN names the JSONL field or dataset
    column."""
    if calib_data is None:
        return default_corpus(), "python standard library docstrings"
    if not str(calib_data).strip():  # an unset shell variable: not the current directory's every text file
        raise QuantizeError(f"--calib-data is empty ({str(calib_data)!r}); give a file or directory, or leave it "
                            "out for the built-in corpus")
    calib_data = os.path.expanduser(calib_data)  # a ~ the shell left (quoted, or from a --config file)
    path, column = split_column(calib_data)
    if not path.exists():
        head, sep, tail = str(calib_data).rpartition(":")
        split = f" (nor {head} with the column {tail})" if sep and head and tail and "/" not in tail else ""
        raise QuantizeError(f"calibration data {path} does not exist{split}")
    opened = open_dataset(path)
    if opened is None:
        texts, split = read_text_corpus(path, column, max_chars)
        return texts, str(path) + split + (f", field {column}" if column else "")
    data, source = opened
    column = text_column(data, path, column)
    texts = column_texts(data, path, column)
    first = next(texts, None)
    if first is None:
        raise QuantizeError(f"calibration data {path} is empty (no text in its column {column})")
    return itertools.chain([first], texts), f"{source}, column {column}"


def tokenize(texts: Iterable[Sample], source: str, tokenizer, num_samples: int, seq_len: int,
             progress: Callable[[str], None] = lambda _: None) -> CalibrationSet:
    """Tokenize texts (each followed by the EOS token) and conversations (rendered by the chat template, which ends
    their turns itself) until num_samples x seq_len tokens are gathered."""
    check_sizes(num_samples, seq_len)
    needed = num_samples * seq_len
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    shown = True
    for i, sample in enumerate(texts):
        text = sample if isinstance(sample, str) else render(tokenizer, sample, source)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if eos is not None and isinstance(sample, str):
            ids.append(int(eos))
        shown = i % 200 == 0
        if shown:
            progress(f"tokenizing calibration text: {min(len(ids), needed)}/{needed} tokens")
        if len(ids) >= needed:
            break
    if not shown:  # where the count ended
        progress(f"tokenizing calibration text: {min(len(ids), needed)}/{needed} tokens")
    if len(ids) < needed:
        raise QuantizeError(
            f"calibration data ({source}) has {len(ids)} tokens, fewer than --calib-size {num_samples} x "
            f"--calib-seq-len {seq_len} = {needed}; give more text or ask for fewer/shorter samples"
        )
    array = np.asarray(ids[:needed], dtype=np.int64).reshape(num_samples, seq_len)
    return CalibrationSet(array, source)
