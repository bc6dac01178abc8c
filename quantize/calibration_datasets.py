"""Calibration text from datasets read by the `datasets` library: a `save_to_disk` directory, or parquet / arrow /
csv files (a file, or a directory of one kind), local files only."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from camshaft.errors import needs_extra
from camshaft.quantize.calibration_chat import CHAT_FIELD, Sample, checked_messages, is_chat_feature, sample_chars
from camshaft.quantize.spec import QuantizeError

DATA_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}  # → datasets' packaged loader
TEXT_SUFFIXES = (".txt", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # compared in lower case, as every suffix here
DATASET_METADATA = {"dataset_infos.json", "dataset_info.json", "dataset_dict.json", "state.json"}  # not text


COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip", ".7z")


def text_files(path: Path) -> list[Path]:
    """The calibration text files under a directory, by name: text and JSONL, not README files (dataset cards), a
    dataset's own metadata or hidden files and directories (.ipynb_checkpoints, editor copies)."""
    return [p for p in _visible_files(path, TEXT_SUFFIXES + JSONL_SUFFIXES)
            if p.name.lower().split(".")[0] != "readme" and p.name not in DATASET_METADATA]  # README.en.md too


def _visible_files(path: Path, suffixes) -> list[Path]:
    """Files under `path` with one of `suffixes` (any case), by name; hidden files and directories left out; a
    compressed file refused (it would be left out)."""
    visible = sorted(p for p in path.rglob("*") if p.is_file()
                     and not any(part.startswith(".") for part in p.relative_to(path).parts))
    packed = [p for p in visible if p.suffix.lower() in COMPRESSED_SUFFIXES]
    if packed:
        raise QuantizeError(f"{path} holds compressed files ({packed[0].relative_to(path)}, ...), which calibration "
                            "does not read; decompress them (gunzip) or pass a directory without them")
    return [p for p in visible if p.suffix.lower() in suffixes]


def train_split(path: Path, files: list[Path]) -> tuple[list[Path], str]:
    """Of a directory's files, its train split's where file or folder names mark splits as the datasets library
    reads them (train.jsonl, data/test-00000-of-00001.parquet), and ", split train" (else all, and ""): a test split
    calibrated on would leak into the evaluation."""
    if not files:
        return files, ""
    data_files = _datasets().data_files
    splits = data_files.DataFilesDict.from_patterns(data_files.get_data_patterns(str(path)), base_path=str(path))
    named = {str(name): {os.path.realpath(f) for f in found} for name, found in splits.items()}
    if set(named) == {"train"} and all(os.path.realpath(f) in named["train"] for f in files):
        return files, ""  # no split in the names
    others = sorted(set(named) - {"train"})
    stray = [f for f in files if not any(os.path.realpath(f) in found for found in named.values())]
    if stray:
        raise QuantizeError(f"{path} names splits by file name ({', '.join(sorted(named))}) and holds "
                            f"{stray[0].relative_to(path)}, in none of them; move it out, or pass the files to "
                            "calibrate on")
    if "train" not in named:
        raise QuantizeError(f"{path} holds the splits {', '.join(others)} (by their file names) and no train split; "
                            f"calibrating on a test split would leak it into the evaluation: pass the files to "
                            f"calibrate on, e.g. --calib-data {files[0]}")
    chosen = [f for f in files if os.path.realpath(f) in named["train"]]
    return chosen, f", split train ({', '.join(others)} left out)" if others else ", split train"
SAVED_DATASET_FILES = (("dataset_dict.json",), ("state.json", "dataset_info.json"))  # save_to_disk's


def open_dataset(path: Path) -> tuple[Any, str] | None:
    """(a datasets Dataset or local-file stream, its description) for a save_to_disk directory or parquet/arrow/csv
    files (a file, or a directory of one kind; nothing else in it is read); None for anything else."""
    if path.is_dir() and any(all((path / name).is_file() for name in names) for names in SAVED_DATASET_FILES):
        return _load_from_disk(path)
    if path.is_dir():
        files = _visible_files(path, DATA_SUFFIXES)
    else:
        files = [path] if path.suffix.lower() in DATA_SUFFIXES else []
    kinds = sorted({DATA_SUFFIXES[f.suffix.lower()] for f in files})
    texts = text_files(path) if path.is_dir() and files else []
    if texts:
        raise QuantizeError(f"{path} holds {kinds[0]} files and text files ({texts[0].name}, ...); one of them would "
                            "be left out: pass a directory (or file) of one kind")
    if len(kinds) > 1:
        raise QuantizeError(f"{path} holds {' and '.join(kinds)} files; pass a directory (or file) of one kind")
    if not files:
        return None
    files, split = train_split(path, files) if path.is_dir() else (files, "")
    if kinds == ["parquet"] and not _parquet_rows(files, path):  # datasets' stream fails on it with Arrow's internals
        raise QuantizeError(f"calibration data {path} is empty (parquet with no rows)")
    try:
        data = _datasets().load_dataset(kinds[0], data_files=[str(f) for f in files], split="train", streaming=True)
    except Exception as exc:  # datasets raises many types for unreadable files
        raise QuantizeError(f"{path}: the {kinds[0]} files could not be read as a dataset: {exc}") from exc
    return data, str(path) if path.is_file() else f"{path}, {len(files)} {kinds[0]} file(s){split}"


def _parquet_rows(files: list[Path], path: Path) -> int:
    import pyarrow.parquet as pq

    try:
        return sum(pq.read_metadata(f).num_rows for f in files)
    except Exception as exc:  # pyarrow: many types
        raise QuantizeError(f"{path}: the parquet files could not be read as a dataset: {exc}") from exc


def _load_from_disk(path: Path) -> tuple[Any, str]:
    """A save_to_disk directory: a Dataset, or a DatasetDict's train (or only) split."""
    datasets = _datasets()
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise QuantizeError(f"{path} looks like a saved dataset but could not be loaded: {exc}") from exc
    if not isinstance(data, datasets.DatasetDict):
        return data, str(path)
    splits = sorted(data)
    if "train" not in data and len(splits) != 1:
        raise QuantizeError(f"{path} holds the splits {', '.join(splits)}, none named train; pass one split's "
                            f"directory, e.g. --calib-data {path / splits[0]}")
    split = "train" if "train" in data else splits[0]
    return data[split], f"{path}, split {split}"


def text_column(data: Any, path: Path, column: str | None) -> str:
    """`column` if given, else the `text` column, else a `messages` column of chat messages, else the only string
    column."""
    chats: list[str] = []
    if data.features is not None:
        types = {n: getattr(f, "dtype", None) for n, f in data.features.items()}
        chats = [n for n, f in data.features.items() if is_chat_feature(f)]
    else:  # a csv stream, typed by its first rows (an empty cell reads as NaN)
        rows = _first_rows(data, path)
        if not rows:
            raise QuantizeError(f"calibration data {path} is empty (a header, no rows)")
        names = list(rows[0])
        types = {n: "string" if any(isinstance(r.get(n), str) for r in rows) else None for n in names}
    strings = [n for n, t in types.items() if t in ("string", "large_string")]
    listed = ", ".join(types) or "none"
    if column is not None and column not in strings + chats:
        raise QuantizeError(f"{path} has no string or chat messages column {column} (its columns: {listed})")
    chosen = column or ("text" if "text" in strings else CHAT_FIELD if CHAT_FIELD in chats
                        else strings[0] if len(strings) == 1 else None)
    if chosen is None and not strings and chats:
        raise QuantizeError(f"{path} has no text column, and its conversations are not named messages (its "
                            f"columns: {listed}); choose them with --calib-data {path}:{chats[0]}")
    if chosen is None:
        raise QuantizeError(f"{path} has no string column (its columns: {listed})" if not strings else
                            f"{path} has several string columns, none named text (its columns: {listed}); choose "
                            f"one with --calib-data {path}:COLUMN")
    return chosen


def _first_rows(data: Any, path: Path, count: int = 100) -> list[dict[str, Any]]:
    try:
        return list(itertools.islice(iter(data), count))
    except Exception as exc:  # pandas, pyarrow: many types
        raise QuantizeError(f"calibration data {path} could not be read: {exc}") from exc


def column_texts(data: Any, path: Path, column: str) -> Iterator[Sample]:
    where = f"{path}, column {column}"
    try:
        for batch in data.select_columns([column]).iter(batch_size=256):
            for value in batch[column]:
                if isinstance(value, str) and value.strip():
                    yield value
                elif isinstance(value, list) and sample_chars(checked_messages(value, where)):
                    yield value
    except QuantizeError:
        raise
    except Exception as exc:  # a damaged file further in
        raise QuantizeError(f"calibration data {path} could not be read: {exc}") from exc


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise QuantizeError(needs_extra(f"reading datasets (the datasets package: {exc})", "quantize")) from exc
    datasets.disable_progress_bars()
    return datasets
