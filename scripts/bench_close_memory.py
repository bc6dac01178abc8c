"""Process memory (RSS) after closing a Session: with camshaft's release of the freed heap (malloc_trim) and, in the
same run, without it (the peer). Each case in a process of its own: load, generate, close, twice.

    .venv/bin/python scripts/bench_close_memory.py engines/smollm2-135m-instruct
"""

from __future__ import annotations

import subprocess
import sys

CASE = """
import gc, sys, psutil
import camshaft.runtime.sequence as seq, camshaft.runtime.backends.onnxruntime as ort
if sys.argv[3] == "kept":
    seq.release_freed_memory = ort.release_freed_memory = lambda: None
from camshaft import Session
rss = lambda: psutil.Process().memory_info().rss / 2**20
before, rows = rss(), []
for _ in range(2):
    s = Session(sys.argv[1], graph=sys.argv[2])
    s.generate([1, 2, 3], max_tokens=2)
    loaded = rss()
    s.close(); del s; gc.collect()
    rows.append((loaded, rss()))
print(before, *[f"{a:.0f}/{b:.0f}" for a, b in rows])
"""


def main() -> None:
    engine = sys.argv[1]
    print("| graph | heap on close | RSS before load MiB | loaded / after close, cycle 1 | cycle 2 |")
    print("|---|---|---|---|---|")
    for graph in ("sequence", "batch"):
        for heap in ("released", "kept"):
            out = subprocess.run([sys.executable, "-c", CASE, engine, graph, heap], capture_output=True, text=True,
                                 check=True).stdout.split()
            print(f"| {graph} | {heap} | {float(out[0]):.0f} | {out[1]} | {out[2]} |")


if __name__ == "__main__":
    main()
