"""Engine memory on transparent huge pages (Linux).

A decode step streams every weight once; on 4 KiB pages that is a TLB miss every 4 KiB. ONNX Runtime copies the
weights it prepacks into memory from malloc, which the kernel backs with 4 KiB pages unless told otherwise, and
it cannot be told before the allocation. So after a load, the anonymous memory the load created (or grew) and
filled is collapsed into 2 MiB pages (`MADV_COLLAPSE`, Linux >= 6.1: synchronous, contents unchanged; SmolLM2's
530 MB of fp32 weights in 0.1-0.6 s here, 1.2-1.4 s when advised `MADV_HUGEPAGE` first, so they are not). Mostly
empty regions (thread stacks) are left alone: collapsing fills them, and so is memory a load reuses in place (a
process that freed an engine before may put the next one there: it keeps the pages it had, and is not counted).
Best effort: where the kernel cannot, nothing changes but the speed. A system whose THP mode is "never" is obeyed.
(Arrays from numpy, the KV caches among them, need none of this: numpy advises its large allocations itself.)
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25
MIN_RESIDENT = 0.5  # share of a region already in memory for it to be collapsed
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
T = TypeVar("T")


@dataclass(frozen=True)
class Region:
    start: int
    end: int
    resident: int
    huge: int


def available() -> bool:
    if sys.platform != "linux" or not THP_MODE.exists():
        return False
    return "[never]" not in THP_MODE.read_text()


def anonymous_regions() -> list[Region]:
    """Private read-write anonymous mappings of this process (the malloc heap and mmap'd blocks), from smaps."""
    with open("/proc/self/smaps") as smaps:
        return parse_smaps(list(smaps))


def parse_smaps(lines: list[str]) -> list[Region]:
    regions, header, fields = [], None, {}
    for line in [*lines, "0-0 ---- 0 0:0 0\n"]:
        parts = line.split()
        if "-" in parts[0] and not parts[0].endswith(":"):
            start, end = (int(x, 16) for x in header[0].split("-")) if header is not None else (0, 0)
            # smaps lists mappings in address order; one that goes back is a second, later view of memory the
            # kernel changed between two reads of the file: it replaces the first (the likely cause of a region's
            # huge pages counted twice here, five runs in a row after set-up)
            while regions and start < regions[-1].end:
                regions.pop()
            if header is not None and header[1] == "rw-p" and (len(header) < 6 or header[5] == "[heap]"):
                regions.append(Region(start, end, fields.get("Rss:", 0) << 10,
                                      fields.get("AnonHugePages:", 0) << 10))
            header, fields = parts, {}
        elif parts[0] in ("Rss:", "AnonHugePages:"):
            fields[parts[0]] = int(parts[1])
    return regions


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _aligned(start: int, end: int) -> tuple[int, int]:
    return -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE


def load_in_huge_pages(load: Callable[[], T], enabled: bool = True) -> tuple[T, int]:
    """Run `load`, then collapse what it allocated; returns its result and the bytes now on huge pages."""
    madvise = _madvise() if enabled and available() else None
    try:
        before = {r.start: r.end for r in anonymous_regions()} if madvise is not None else None
    except OSError:  # /proc not readable (a sandbox): leave the pages as they come
        before = None
    if madvise is None or before is None:
        return load(), 0
    value = load()
    grown = [_aligned(r.start, r.end) for r in anonymous_regions()
             if before.get(r.start) != r.end and r.resident >= MIN_RESIDENT * (r.end - r.start)]
    for lo, hi in grown:
        if hi > lo:
            madvise(lo, hi - lo, MADV_COLLAPSE)
    return value, sum(r.huge for r in anonymous_regions() if any(r.start < hi and lo < r.end for lo, hi in grown))


def release_freed_memory() -> None:
    """Give back to the system the heap a closed engine left: glibc keeps what free() returned (an engine's weights
    are most of it), so a process that closes one would otherwise stay its size larger. Best effort: elsewhere,
    nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
