"""Benchmark workloads: synthetic length distributions or a JSONL file of prompts, as token-id requests.

`synthetic:in=NORMAL(200,50),out=NORMAL(128,32)` draws prompt and output lengths with a seed (random prompt token
ids as in `benchmark_prompt`, clipped to the engine's max_seq_len); `jsonl:PATH` (or a path ending in .jsonl) reads
{"prompt": text or token ids, "max_tokens": n} lines. Used by `bench throughput` and `bench serve`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from camshaft.checks import is_int
from camshaft.errors import RequestError

_NUMBER = r"[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?"
_DIST = re.compile(rf"^\s*(NORMAL|UNIFORM|CONST)\s*\(\s*({_NUMBER})\s*(?:,\s*({_NUMBER})\s*)?\)\s*$", re.IGNORECASE)
PRESETS = {
    # The public cross-engine serving workloads: long prompts with short or long answers.
    "prefill-heavy": "synthetic:in=NORMAL(460,20),out=16",
    "decode-heavy": "synthetic:in=NORMAL(460,20),out=256",
    # The throughput target's workload (BENCHMARKS.md)
    "balanced": "synthetic:in=NORMAL(200,50),out=NORMAL(128,32)",
}
MAX_LENGTH = 10**9  # tokens: any length or spread beyond it is a typo, not a workload
SPEC_HELP = ("use a preset (" + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()) + "), synthetic:in=DIST,out=DIST "
             "with DIST one of NORMAL(mean,std), UNIFORM(low,high), CONST(n) or a plain integer, e.g. "
             "synthetic:in=NORMAL(200,50),out=NORMAL(128,32); or jsonl:PATH (or a path ending in .jsonl) with one "
             "{\"prompt\": ..., \"max_tokens\": ...} per line")


@dataclass(frozen=True)
class Distribution:
    kind: str  # normal | uniform | const
    a: float
    b: float = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n lengths; NORMAL's may be below 1 (load_dataset raises them to 1, and the report counts them)."""
        if self.kind == "normal":
            values = rng.normal(self.a, self.b, n)
        elif self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b), n, endpoint=True)
        else:
            values = np.full(n, self.a)
        return np.rint(np.clip(values, 0, MAX_LENGTH)).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "const":
            return f"{self.a:g}"
        return f"{self.kind.upper()}({self.a:g},{self.b:g})"


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    asked: tuple[int, int] | None = field(default=None, compare=False)  # (prompt, output) lengths before clipping


def _request(prompt_ids: list[int], max_tokens: int, asked_prompt: int, asked_output: int) -> BenchRequest:
    changed = (len(prompt_ids), max_tokens) != (asked_prompt, asked_output)
    return BenchRequest(prompt_ids, max_tokens, (asked_prompt, asked_output) if changed else None)


@dataclass(frozen=True)
class DatasetSpec:
    kind: str  # synthetic | jsonl
    prompt_len: Distribution | None = None
    output_len: Distribution | None = None
    path: Path | None = None

    def __str__(self) -> str:
        if self.kind == "jsonl":
            return f"jsonl:{self.path}"
        return f"synthetic:in={self.prompt_len},out={self.output_len}"


def parse_distribution(text: str, what: str) -> Distribution:
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        value = int(text)
        if not 1 <= value <= MAX_LENGTH:
            raise RequestError(f"{what} length must be 1..{MAX_LENGTH:.0e} tokens, got {text!r}")
        return Distribution("const", float(value))
    match = _DIST.match(text)
    if not match:
        raise RequestError(f"cannot read the {what} length distribution {text!r}; {SPEC_HELP}")
    kind, a, b = match.group(1).lower(), float(match.group(2)), match.group(3)
    if max(a, float(b or 0)) > MAX_LENGTH:
        raise RequestError(f"the {what} length distribution {text!r} reaches past {MAX_LENGTH:.0e} tokens; give "
                           "lengths (and spreads) in tokens")
    if kind == "const":
        if b is not None or a < 1:
            raise RequestError(f"CONST takes one value >= 1, got {text!r}")
        return Distribution("const", a)
    if b is None:
        raise RequestError(f"{kind.upper()} takes two values, got {text!r}; {SPEC_HELP}")
    b = float(b)
    if kind == "normal" and (a < 1 or b < 0):
        raise RequestError(f"NORMAL(mean,std) needs mean >= 1 and std >= 0, got {text!r}")
    if kind == "uniform" and not (1 <= a <= b and a.is_integer() and b.is_integer()):
        raise RequestError(f"UNIFORM(low,high) takes whole lengths with 1 <= low <= high, got {text!r}")
    return Distribution(kind, a, b)


def parse_dataset_spec(spec: str) -> DatasetSpec:
    """A preset (PRESETS), `synthetic:in=...,out=...`, `jsonl:PATH` or `PATH.jsonl`; raises RequestError naming
    what is wrong."""
    spec = PRESETS.get(spec.strip(), spec.strip())
    if spec.startswith("jsonl:") or (spec.endswith(".jsonl") and not spec.startswith("synthetic:")):
        path = Path(spec.removeprefix("jsonl:")).expanduser()  # a ~ the shell left (quoted, or a --config file's)
        if not path.is_file():
            raise RequestError(f"dataset file {path} does not exist")
        return DatasetSpec("jsonl", path=path)
    if not spec.startswith("synthetic:"):
        raise RequestError(f"unknown dataset spec {spec!r}; {SPEC_HELP}")
    body = spec.removeprefix("synthetic:")
    # Split on the commas outside parentheses: in=NORMAL(200,50),out=NORMAL(128,32)
    parts, depth, current = [], 0, ""
    for ch in body:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    fields: dict[str, Distribution] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("in", "out"):
            raise RequestError(f"cannot read {part!r} in dataset spec {spec!r}; {SPEC_HELP}")
        if key in fields:
            raise RequestError(f"{key}= given twice in dataset spec {spec!r}")
        fields[key] = parse_distribution(value, "prompt" if key == "in" else "output")
    missing = [k for k in ("in", "out") if k not in fields]
    if missing:
        raise RequestError(f"dataset spec {spec!r} lacks {', '.join(k + '=' for k in missing)}; {SPEC_HELP}")
    return DatasetSpec("synthetic", fields["in"], fields["out"])


def load_dataset(spec: str | DatasetSpec, num_requests: int, *, max_seq_len: int, vocab_size: int, seed: int = 0,
                 tokenizer=None) -> list[BenchRequest]:
    """`num_requests` requests; lengths clipped so prompt >= 1, output >= 1 and prompt + output <= max_seq_len
    (a clipped request keeps what it asked for in `asked`: see throughput_report.clipped_requests)."""
    if num_requests < 1:
        raise RequestError(f"num_requests must be >= 1, got {num_requests}")
    if max_seq_len < 2:
        raise RequestError(f"max_seq_len must be >= 2, got {max_seq_len}")
    spec = parse_dataset_spec(spec) if isinstance(spec, str) else spec
    if spec.kind == "jsonl":
        return _load_jsonl(spec.path, num_requests, max_seq_len, vocab_size, tokenizer)
    rng = np.random.default_rng(seed)
    asked_prompt = spec.prompt_len.sample(rng, num_requests)  # a NORMAL draw below 1 runs as 1, and is counted
    asked_output = spec.output_len.sample(rng, num_requests)
    prompt_lens = np.clip(asked_prompt, 1, max_seq_len - 1)
    output_lens = np.clip(asked_output, 1, max_seq_len - prompt_lens)
    high = min(vocab_size, 30000)
    low = 100 if high > 200 else 0
    return [_request(rng.integers(low, high, int(p)).tolist(), int(o), int(ap), int(ao))
            for p, o, ap, ao in zip(prompt_lens, output_lens, asked_prompt, asked_output, strict=True)]


def read_jsonl_requests(path: Path) -> list[tuple[str | list, int]]:
    """(prompt, max_tokens) per line of {"prompt": text or token ids, "max_tokens": n}; raises naming the line."""
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a BOM allowed
    except UnicodeDecodeError as exc:
        raise RequestError(f"{path} is not UTF-8 text (byte {exc.start}); a JSONL dataset holds one JSON object a "
                           "line, UTF-8") from None
    for lineno, line in enumerate(text.split("\n"), 1):  # not at U+2028 and the like, which a JSON string may hold
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, max_tokens = row["prompt"], row["max_tokens"]
        except (ValueError, RecursionError, KeyError, TypeError) as exc:
            raise RequestError(f"{path}:{lineno}: expected {{\"prompt\": ..., \"max_tokens\": n}} "
                               f"({str(exc)[:200]})") from exc
        if not is_int(max_tokens) or not 1 <= max_tokens <= MAX_LENGTH:
            raise RequestError(f"{path}:{lineno}: max_tokens must be a whole number of tokens >= 1, got "
                               f"{max_tokens!r:.40}")
        if not prompt:
            raise RequestError(f"{path}:{lineno}: the prompt is empty")
        rows.append((prompt, max_tokens))
    if not rows:
        raise RequestError(f"{path} holds no requests")
    return rows


def _load_jsonl(path: Path, num_requests: int, max_seq_len: int, vocab_size: int, tokenizer) -> list[BenchRequest]:
    rows = []
    for prompt, max_tokens in read_jsonl_requests(path):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise RequestError(f"{path}: a text prompt needs the engine's tokenizer")
            ids = tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list) and all(is_int(t) and 0 <= t < vocab_size for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(f"{path}: prompt must be text or token ids in [0, {vocab_size}), got {prompt!r:.80}")
        kept = ids[-(max_seq_len - 1):]  # keep the end of a prompt that is too long
        rows.append(_request(kept, min(max_tokens, max_seq_len - len(kept)), len(ids), max_tokens))
    return [rows[i % len(rows)] for i in range(num_requests)]


def repeat_note(spec: DatasetSpec, num_requests: int) -> str | None:
    """For a JSONL dataset with fewer requests than asked for (read and checked now): a note that they repeat."""
    if spec.kind != "jsonl":
        return None
    rows = len(read_jsonl_requests(spec.path))
    if rows >= num_requests:
        return None
    return (f"note: {spec.path} holds {rows} request(s); {num_requests} requests repeat them in order, and a repeated "
            "prompt is served from the prefix cache (TTFT and throughput read better than for as many different "
            "prompts)")


def warmup_requests(requests: list[BenchRequest], vocab_size: int, count: int = 4) -> list[BenchRequest]:
    """Short requests with other prompt ids than `requests` (so the prefix cache cannot help the measured run)."""
    rng = np.random.default_rng(12345)
    return [BenchRequest(rng.integers(0, vocab_size, len(r.prompt_ids)).tolist(), min(r.max_tokens, 4))
            for r in requests[:count]]
