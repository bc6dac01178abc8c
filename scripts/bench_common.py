"""What the benchmark scripts share: logging, the machine they ran on, stats, and writing BENCHMARKS.md sections."""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import statistics
import sys
from pathlib import Path

from camshaft.machine_info import machine_info  # noqa: F401 (the scripts import it from here)

REPO = Path(__file__).resolve().parents[1]
MD_HEADER = ("# Benchmarks\n\nMeasured numbers, each section written by the script it names. The machine is shared "
             "and noisy: compare systems through the ratios measured in the same run, not across runs.\n")
# Before each run: the previous system's worker threads (torch's OpenMP, ONNX Runtime's pools) may still spin on the
# two cores for a while after it returns, and would slow the first part of the next run (its TTFT) otherwise.
PAUSE_S = 0.5

def log(message: str) -> None:
    print(f"· {message}", file=sys.stderr, flush=True)


def show_cmd(parts: list[str]) -> str:
    """A command for people to read: repository paths relative, the home directory as ~."""
    home = str(Path.home())
    shown = []
    for part in parts:
        if part.startswith(str(REPO) + os.sep):
            part = part[len(str(REPO)) + 1:]
        elif part.startswith(home + os.sep):
            part = "~" + part[len(home):]
        shown.append(part if re.fullmatch(r"[\w@%+=:,./~-]+", part) else shlex.quote(part))
    return " ".join(shown)


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def stats(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def write_markdown(path: Path, section: str, begin_marker: str, end_marker: str) -> None:
    """Replace the section between the markers in BENCHMARKS.md (or append it), leaving the rest as it is."""
    text = path.read_text() if path.exists() else MD_HEADER
    begin, end = text.find(begin_marker), text.find(end_marker)
    if begin != -1 and end > begin:
        text = text[:begin] + section + text[end + len(end_marker):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def publish(results: dict, json_path: Path, plot: Path, draw, md: Path, markdown, markers: tuple[str, str],
            write_md: bool) -> None:
    """Write the results' JSON (first: a plot that fails loses nothing), draw the plot (`draw(plot)`), print the
    BENCHMARKS.md section (`markdown(results, plot path relative to md)`) and replace it in md when write_md is
    set."""
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    draw(plot)
    section = markdown(results, os.path.relpath(plot.resolve(), md.resolve().parent))
    print(section)
    if write_md:
        write_markdown(md, section, *markers)
        log(f"updated {rel(md)}")
    log(f"wrote {rel(json_path)} and {rel(plot)}")


def command_line(argv: list[str]) -> str:
    return show_cmd([sys.executable, str(Path(sys.argv[0]).resolve()), *argv])


def cache_keyword(model) -> str:
    """The name transformers' forward takes the KV cache under: 5.25 renamed `past_key_values` to `cache` (the old
    name warns); both are accepted."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output, keyword: str):
    """The KV cache a forward returned, under the name `cache_keyword` gave."""
    return getattr(output, "cache", None) if keyword == "cache" else output.past_key_values
