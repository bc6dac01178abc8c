"""Batched decode attention in length groups: what padding every sequence to the longest context costs.

The batch graph gathers each decode group's K/V through its block tables padded to the group's longest context,
then runs ONNX Attention on it (builder/graph/decoder.py). With the contexts of a steady batch spread between a
short and a long one, splitting the sequences by length into groups, each padded to its own longest, gathers and
attends over less. This times 30 layers of the engine's gather + Attention (scripts/probe_kv_layout.py's "current"
layout, SmolLM2's heads) for one group of B sequences padded to the longest context against the same sequences
sorted into 2 and 4 equal groups; contexts spread evenly between --shortest and --longest. Medians of interleaved
runs, 2 threads. Usage: python scripts/probe_decode_groups.py [--batch 32] [--shortest 128] [--longest 512]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # as camshaft does, before onnxruntime is imported

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from probe_kv_layout import BLOCK, KV, LAYERS, PER_KV, D, graph  # noqa: E402


def session(batch: int, context: int) -> tuple[ort.InferenceSession, dict[str, np.ndarray]]:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    model = ort.InferenceSession(graph("current", batch, context).SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    nb = context // BLOCK
    blocks = batch * nb + 1
    feeds = {"q": rng.standard_normal((batch, KV * PER_KV * D), dtype=np.float32),
             "tables": rng.permutation(np.arange(1, blocks))[: batch * nb].reshape(batch, nb).astype(np.int64),
             "mask": np.ones((batch, 1, 1, context), bool)}
    for i in range(LAYERS):
        for t in "kv":
            feeds[f"{t}{i}"] = rng.standard_normal((blocks, BLOCK, KV * D), dtype=np.float32)
    return model, feeds


def plan(contexts: np.ndarray, groups: int) -> list[tuple[int, int]]:
    """(sequences, padded context) per group of the sorted contexts, each padded to whole blocks."""
    return [(len(part), int(-(-part.max() // BLOCK) * BLOCK)) for part in np.array_split(np.sort(contexts), groups)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--shortest", type=int, default=128)
    parser.add_argument("--longest", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    contexts = np.linspace(args.shortest, args.longest, args.batch).round().astype(int)
    plans = {groups: plan(contexts, groups) for groups in (1, 2, 4)}
    sessions = {groups: [session(b, c) for b, c in parts] for groups, parts in plans.items()}
    times: dict[int, list[float]] = {groups: [] for groups in plans}
    for r in range(args.rounds + 1):
        for groups in (list(plans) if r % 2 else list(plans)[::-1]):
            start = time.perf_counter()
            for model, feeds in sessions[groups]:
                model.run(None, feeds)
            if r:  # the first round warms up
                times[groups].append(time.perf_counter() - start)
    one = float(np.median(times[1]))
    print(f"batch {args.batch}, contexts {args.shortest}..{args.longest} evenly spread, {LAYERS} layers")
    print("| groups | padded K/V rows | ms (median) | ÷ one group |")
    print("|---|---|---|---|")
    for groups, parts in plans.items():
        ms = float(np.median(times[groups]))
        print(f"| {groups} | {sum(b * c for b, c in parts)} | {ms * 1000:.1f} | {ms / one:.2f} |")


if __name__ == "__main__":
    main()
