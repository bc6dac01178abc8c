"""Engine memory on transparent huge pages: collapsed after load, contents unchanged, off when asked."""

from __future__ import annotations

import json
import mmap
import platform
import subprocess
import sys

import numpy as np
import pytest

from camshaft.runtime.backends.huge_pages import (
    THP_MODE,
    Region,
    anonymous_regions,
    available,
    load_in_huge_pages,
    parse_smaps,
)

MiB = 1 << 20
PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)  # malloc-like memory (not shared)


def _collapse_supported() -> bool:
    release = tuple(int(p) for p in platform.release().split("-")[0].split(".")[:2] if p.isdigit())
    return available() and release >= (6, 1)  # MADV_COLLAPSE


needs_collapse = pytest.mark.skipif(not _collapse_supported(), reason="needs Linux >= 6.1 with THP not 'never'")
# in THP mode "always" the kernel may put memory nobody advised on huge pages by itself
needs_madvise_mode = pytest.mark.skipif(available() and "[always]" in THP_MODE.read_text(),
                                        reason="THP mode 'always' gives small allocations huge pages unasked")


def _isolated(size: int, dtype: type = np.uint8) -> np.ndarray:
    """Anonymous private memory in a mapping of its own: a guard page at each end, advised differently, keeps the
    kernel from merging it with a neighbouring mapping (whose pages _pages would then count too)."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, size + 2 * page, flags=PRIVATE)
    for start in (0, size + page):
        region.madvise(mmap.MADV_NOHUGEPAGE, start, page)
    return np.frombuffer(region, dtype=dtype, count=size // np.dtype(dtype).itemsize, offset=page)


def _unadvised(size: int) -> np.ndarray:
    """Filled anonymous memory nobody advised (like the malloc'd memory onnxruntime prepacks weights into; numpy's
    own arrays are advised by numpy)."""
    array = _isolated(size, np.float32)
    array[:] = np.arange(len(array), dtype=np.float32)
    return array


def _pages(array: np.ndarray) -> tuple[int, int]:
    """Resident and huge-page bytes of the regions under an array."""
    lo, hi = array.ctypes.data, array.ctypes.data + array.nbytes
    under = [r for r in anonymous_regions() if r.start < hi and lo < r.end]
    return sum(r.resident for r in under), sum(r.huge for r in under)


def test_regions_hold_filled_memory():
    if sys.platform != "linux":
        pytest.skip("reads /proc/self/smaps")
    array = _unadvised(8 * MiB)
    assert _pages(array)[0] >= array.nbytes


@needs_collapse
def test_load_collapses_what_it_filled_and_keeps_contents():
    free = _free_huge_blocks()
    data, huge = load_in_huge_pages(lambda: _unadvised(64 * MiB))
    np.testing.assert_array_equal(data, np.arange(16 * MiB, dtype=np.float32))
    _assert_collapsed(huge, 64 * MiB, free)  # skips where memory was too fragmented to tell
    assert huge == _pages(data)[1]


@needs_collapse
@needs_madvise_mode
def test_disabled_leaves_small_pages():
    data, huge = load_in_huge_pages(lambda: _unadvised(64 * MiB), enabled=False)
    assert huge == 0
    assert _pages(data) == (64 * MiB, 0)


@needs_collapse
@needs_madvise_mode
def test_empty_regions_are_left_alone():
    """A region mostly not in memory (a thread stack, a reserved arena) would be filled by collapsing it."""
    array = _isolated(64 * MiB)
    _, huge = load_in_huge_pages(lambda: array[: 4 * MiB].fill(1))
    assert huge == 0
    assert _pages(array) == (4 * MiB, 0)


def _fresh_session(engine, huge: bool, graph: str) -> tuple[int, list[int]]:
    """Load the engine in a fresh process, as users do (a process that loaded and freed an engine before reuses
    that memory in place, and only regions a load creates or grows are collapsed); bytes on huge pages, tokens."""
    code = (
        "import json, sys\n"
        "from camshaft.runtime.session import Session\n"
        "from camshaft.runtime.sampling_params import SamplingParams\n"
        "s = Session(sys.argv[1], huge_pages=sys.argv[2] == 'on', graph=sys.argv[3])\n"
        "ids = s.generate('The capital of France is', SamplingParams(max_tokens=16, ignore_eos=True)).token_ids\n"
        "print(json.dumps([s.huge_page_bytes, list(ids)]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(engine), "on" if huge else "off", graph],
                            capture_output=True, text=True, timeout=300, check=True)
    huge_bytes, ids = json.loads(result.stdout.strip().splitlines()[-1])
    return huge_bytes, ids


@needs_collapse
def test_smollm2_weights_on_huge_pages_same_tokens(smollm2_engine):
    weights = (smollm2_engine / "model.onnx.data").stat().st_size
    free = _free_huge_blocks()
    on, off = _fresh_session(smollm2_engine, True, "sequence"), _fresh_session(smollm2_engine, False, "sequence")
    assert off[0] == 0
    assert on[1] == off[1]  # the tokens first: a fragmented host skips the collapse check below, not this
    batch_free = _free_huge_blocks()
    batch = _fresh_session(smollm2_engine, True, "batch")  # the batch graph's backend: what LLM and servers load
    assert batch[1] == off[1]
    _assert_collapsed(on[0], weights, free)
    _assert_collapsed(batch[0], weights, batch_free)


def _free_huge_blocks() -> int:
    """Free 2 MiB blocks the kernel holds (/proc/buddyinfo, orders 9 and up)."""
    blocks = 0
    with open("/proc/buddyinfo") as f:
        for line in f:
            counts = [int(c) for c in line.split()[4:]]
            blocks += sum(n << (order - 9) for order, n in enumerate(counts) if order >= 9)
    return blocks


def _assert_collapsed(huge: int, weights: int, free_before: int) -> None:
    """At least 3/4 of the weights on huge pages, unless the machine's memory was too fragmented to hold them (after
    gigabytes of fresh installs and page cache it can be: the kernel then leaves them on small pages, as designed)."""
    if huge < 0.75 * weights and free_before < weights // 2**21:
        pytest.skip(f"{huge} of {weights} bytes on huge pages with {free_before} free 2 MiB blocks before the load: "
                    "memory too fragmented to tell")
    assert huge >= 0.75 * weights


def test_a_region_smaps_shows_twice_counts_once_as_its_later_view():
    """/proc/self/smaps is read in pieces: a mapping that changes between two reads can be listed again, later and
    larger; the later view replaces the first, so no huge page is counted twice."""
    def entry(start: int, end: int, rss_kb: int, huge_kb: int, perms: str = "rw-p") -> list[str]:
        return [f"{start:x}-{end:x} {perms} 00000000 00:00 0\n", f"Rss: {rss_kb} kB\n",
                f"AnonHugePages: {huge_kb} kB\n"]
    a, m = 0x7F0000000000, MiB
    lines = [*entry(a, a + 4 * m, 4096, 0), *entry(a + 8 * m, a + 9 * m, 1024, 0),
             *entry(a, a + 68 * m, 69632, 65536), *entry(a + 80 * m, a + 81 * m, 1024, 0, "r--p")]
    assert parse_smaps(lines) == [Region(a, a + 68 * m, 68 * m, 64 * m)]
