#!/usr/bin/env python
"""Batch 1 on the onnxruntime target: the graph `camshaft build` writes (each attention group in an If on
has_decode / has_prefill, so a step skips an empty group) against the same build without the branches (an empty
group computed on its one-token dummy), interleaved rounds in one process, per checkpoint.

The unbranched engine is an ablation built here with the branches turned off inside camshaft.builder.build; it is
not a user option. Writes the `branches` section of BENCHMARKS.md with --write-md.

    .venv/bin/python scripts/bench_branches.py --checkpoint int4_wo=out/q/int4_wo-head8 --write-md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import log, machine_info, stats, write_markdown  # noqa: E402
from bench_systems import CamshaftSystem, run_rounds  # noqa: E402

import camshaft.builder.build as build_module  # noqa: E402
from camshaft.builder.config import BuildConfig  # noqa: E402
from camshaft.models import default_model_dir, fetch_model  # noqa: E402
from camshaft.runtime.bench import benchmark_prompt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- branches:begin -->", "<!-- branches:end -->"


def build(checkpoint: Path, out: Path, branches: bool) -> Path:
    if branches:
        build_module.build_engine(BuildConfig(checkpoint, out, max_seq_len=2048))
        return out
    write_graph, step_inputs = build_module.write_graph, build_module.step_inputs
    with mock.patch.object(build_module, "write_graph", lambda *a, **k: write_graph(*a, **{**k, "branches": False})), \
            mock.patch.object(build_module, "step_inputs",
                              lambda model, limits, branches=False: step_inputs(model, limits, False)):
        build_module.build_engine(BuildConfig(checkpoint, out, max_seq_len=2048))
    return out


def measure(name: str, checkpoint: Path, work: Path, rounds: int, threads: int) -> dict:
    engines = {kind: build(checkpoint, work / f"{name}-{kind}", kind == "branched")
               for kind in ("branched", "unbranched")}
    systems = []
    for kind, engine in engines.items():
        system = CamshaftSystem(engine, [], 128, threads, graph="batch")  # the sequence graph has no branches
        system.prompt = benchmark_prompt(system.session.manifest.model.vocab_size, 64)
        system.name = kind
        systems.append(system)
    per_round, tokens = run_rounds(systems, rounds, 64)
    loads = per_round.pop("_load_1min")
    row = {"name": name, "load": (min(loads), max(loads)), "same_tokens": tokens["branched"] == tokens["unbranched"]}
    for kind in ("branched", "unbranched"):
        row[kind] = {key: stats([r[key] for r in per_round[kind]], 1) for key in ("decode_tok_s", "ttft_ms")}
    pairs = list(zip(per_round["branched"], per_round["unbranched"], strict=True))
    row["decode_ratio"] = round(statistics.median(b["decode_tok_s"] / u["decode_tok_s"] for b, u in pairs), 3)
    # A run's TTFT on this host depends on whether it came first in its round, so compare like with like
    row["ttft_first"] = {kind: round(statistics.median(r["ttft_ms"] for r in per_round[kind]
                                                       if r["position_in_round"] == 0), 1) for kind in per_round}
    row["ttft_second"] = {kind: round(statistics.median(r["ttft_ms"] for r in per_round[kind]
                                                        if r["position_in_round"] == 1), 1) for kind in per_round}
    return row


def markdown(rows: list[dict], command: str, rounds: int, threads: int) -> str:
    m = machine_info()
    out = [BEGIN, "## Skipping empty attention groups: batch 1, onnxruntime target", "",
           f"Machine: {m['cpu']}, {m['available_cores']} cores; onnxruntime {m['versions']['onnxruntime']}, "
           f"camshaft {m['versions']['camshaft']}.", "", f"Command: `{command}`", "",
           "Each checkpoint built twice: as `camshaft build` writes it (each attention group in an `If`, so a batch-1 "
           "decode step skips the prefill group and a prefill-only step the decode group) and with the branches off "
           "(an empty group computed on its one-token dummy, as the TensorRT graphs do). The batch graph "
           f"(`Session(graph=\"batch\")`: the sequence graph Session runs by default has no branches) on {threads} "
           f"threads, the same 64 prompt ids, 128 new tokens, greedy, end id ignored; {rounds} interleaved rounds "
           "after a warm-up; "
           "medians (min–max); the decode ratio is the median of the per-round ratios.", "",
           "| checkpoint | decode tok/s, branched | decode tok/s, unbranched | decode ratio | TTFT ms first in its "
           "round, branched / unbranched | TTFT ms second, branched / unbranched | same tokens | 1-min load |",
           "|" + "---|" * 8]
    for r in rows:
        b, u = r["branched"], r["unbranched"]
        first, second = r["ttft_first"], r["ttft_second"]
        out.append(f"| {r['name']} | " + " | ".join([
            fmt(b["decode_tok_s"]), fmt(u["decode_tok_s"]), f"{r['decode_ratio']:.3f}×",
            f"{first['branched']:.1f} / {first['unbranched']:.1f}", f"{second['branched']:.1f} / "
            f"{second['unbranched']:.1f}", "yes" if r["same_tokens"] else "no",
            f"{r['load'][0]:.2f}–{r['load'][1]:.2f}"]) + " |")
    out += ["", "Decode ratio > 1: the branched graph generates faster. TTFT is split by the run's position in its "
            "round because on this host the second run of a round answered much later whichever engine it was; "
            "compare the two numbers within a column.", "", END]
    return "\n".join(out)


def fmt(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", action="append", default=[], help="NAME=HF_DIR, more checkpoints besides fp32")
    p.add_argument("--work-dir", type=Path, default=REPO / "out" / "bench" / "branches")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-md", action="store_true")
    args = p.parse_args()
    model = fetch_model("smollm2-135m-instruct", default_model_dir("smollm2-135m-instruct"))
    checkpoints = {"fp32": model} | {n: Path(d) for n, d in (c.split("=", 1) for c in args.checkpoint)}
    rows = []
    for name, checkpoint in checkpoints.items():
        log(f"{name}: {checkpoint}")
        rows.append(measure(name, checkpoint, args.work_dir, args.rounds, args.threads))
    command = "scripts/bench_branches.py " + " ".join(sys.argv[1:])
    section = markdown(rows, f".venv/bin/python {command.strip()}", args.rounds, args.threads)
    print(section)
    if args.write_md:
        write_markdown(REPO / "BENCHMARKS.md", section, BEGIN, END)
        log("updated BENCHMARKS.md")
    log(f"load now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
