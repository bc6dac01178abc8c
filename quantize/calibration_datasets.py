"""Calibration text from datasets read by the `datasets` library: a `save_to_disk` directory, or parquet / arrow /
csv files (a file, or a directory of one kind), local files only."""

from __future__ import annotations

import itertools
import re
import tempfile
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
    readable = TEXT_SUFFIXES + JSONL_SUFFIXES + tuple(DATA_SUFFIXES)  # x.jsonl.gz, not figures.zip
    packed = [p for p in visible if p.suffix.lower() in COMPRESSED_SUFFIXES
              and len(p.suffixes) > 1 and p.suffixes[-2].lower() in readable]
    if packed:
        raise QuantizeError(f"{path} holds compressed files ({packed[0].relative_to(path)}, ...), which calibration "
                            "does not read; decompress them (gunzip) or pass a directory without them")
    return [p for p in visible if p.suffix.lower() in suffixes]


# a split's names in file and folder names (the datasets library's keywords), each a word of its own there:
# train.jsonl, data/test-00000-of-00001-5f3a.parquet, wikitext-validation.arrow, mydata.train.jsonl, train/a.txt
SPLIT_NAMES = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
               "val": "validation", "dev": "validation", "test": "test", "testing": "test", "eval": "test",
               "evaluation": "test"}
WORDS = re.compile(r"[^a-z]+")  # separators and digits, as datasets' patterns read them


def _split_of(file: Path, root: Path) -> str | None:
    """The split the last split word of a file's path names (test_corpus-train.arrow: train), else None."""
    words = WORDS.split(str(file.relative_to(root).with_suffix("")).lower())
    return next((SPLIT_NAMES[w] for w in reversed(words) if w in SPLIT_NAMES), None)


def train_split(path: Path, files: list[Path]) -> tuple[list[Path], str]:
    """A dataset's directory, its files named as splits: its train split's files and ", split train (... left
    out)", as a test split calibrated on would leak into the evaluation; one without a train split, or with two
    splits beside a file of neither, is refused. Any other directory (documents, one of them perhaps testing.md):
    all its files and ""."""
    splits = [_split_of(f, path) for f in files]
    kinds = set(splits) - {None}
    if not kinds or kinds == {"train"} or (None in splits and len(kinds) == 1):  # all train, or documents
        return files, ""
    others = sorted(kinds - {"train"})  # type: ignore[type-var]
    if None in splits:
        stray = files[splits.index(None)]
        raise QuantizeError(f"{path} holds a dataset's splits ({', '.join(sorted(kinds))}, by their file names) and "
                            f"{stray.relative_to(path)}, which is in none of them; move it out, or pass the train "
                            "split's own file or folder")
    if "train" not in kinds:
        raise QuantizeError(f"{path} holds the splits {', '.join(others)} (by their file names) and no train split; "
                            "calibrating on a test split would leak it into the evaluation. Rename the files, or "
                            f"pass one (--calib-data {files[0]}) if that is the text to calibrate on")
    chosen = [f for f, split in zip(files, splits, strict=True) if split == "train"]
    return chosen, f", split train ({', '.join(others)} left out)" if others else ""


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
    try:  # its lock files in a directory of its own, not in ~/.cache/huggingface (a stream reads no cache)
        with tempfile.TemporaryDirectory(prefix="camshaft-datasets-") as cache:
            data = _datasets().load_dataset(kinds[0], data_files=[str(f) for f in files], split="train",
                                            streaming=True, cache_dir=cache)
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
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False  # a request to the hub's servers each load (offline: seconds)
    return datasets
