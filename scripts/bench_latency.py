#!/usr/bin/env python
"""Batch-1 latency of camshaft against its peers on SmolLM2-135M-Instruct (CPU, fp32).

Systems: camshaft's Session on an onnxruntime fp32 engine, transformers fp32 (a manual KV-cached greedy loop), and
onnxruntime-genai fp32 (a model made by its own builder). Every system gets the same prompt ids
(`benchmark_prompt`), generates the same number of tokens greedily with the end id ignored, and runs on the same
number of threads, each in a process of its own. Rounds are interleaved (each round runs every system once, in
its own seeded order) and medians are
reported, with camshaft/peer ratios taken within each round, so the noise of a shared machine mostly cancels.

Also measured: the camshaft build (wall time, peak RSS, engine size), the onnxruntime-genai build for comparison,
and where the time of a camshaft decode step goes (input preparation, the backend call, sampling, detokenizing).

Writes out/bench/latency.json and a plot (docs/bench/latency.png with --write-md), prints a Markdown section, and
with --write-md replaces the section between the latency markers in BENCHMARKS.md. Needs the `bench` extra:
pip install -e '.[bench]'.

    .venv/bin/python scripts/bench_latency.py --rounds 5 --write-md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench_builds import ensure_builds, set_ortgenai_threads
from bench_common import REPO, command_line, common_prefix, log, machine_info, publish, rel, stats
from bench_latency_md import MD_BEGIN, MD_END, markdown, plot
from bench_systems import CAMSHAFT, CamshaftSystem, OrtGenaiSystem, Replicas, TransformersSystem, run_rounds

from camshaft.models import default_model_dir, fetch_model
from camshaft.runtime.bench import benchmark_prompt

MODEL = "smollm2-135m-instruct"


def summarize(per_round: dict[str, list[dict]], tokens: dict[str, list[int]]) -> tuple[dict, dict]:
    summary = {}
    for name, runs in per_round.items():
        if name.startswith("_"):
            continue
        summary[name] = {key: stats([r[key] for r in runs], 1 if key != "ttft_ms" else 2)
                         for key in ("decode_tok_s", "ttft_ms", "prefill_tok_s")}
    ratios = {}
    base = per_round[CAMSHAFT]
    for name, runs in per_round.items():
        if name == CAMSHAFT or name.startswith("_"):
            continue
        decode = [c["decode_tok_s"] / p["decode_tok_s"] for c, p in zip(base, runs, strict=True)]
        ttft = [c["ttft_ms"] / p["ttft_ms"] for c, p in zip(base, runs, strict=True)]
        ratios[name] = {
            "decode_tok_s": stats(decode, 3),
            "ttft": stats(ttft, 3),
            "decode_tok_s_ratio_of_medians": round(summary[CAMSHAFT]["decode_tok_s"]["median"]
                                                   / summary[name]["decode_tok_s"]["median"], 3),
            "ttft_ratio_of_medians": round(summary[CAMSHAFT]["ttft_ms"]["median"]
                                           / summary[name]["ttft_ms"]["median"], 3),
            "greedy_tokens_equal_to_camshaft": common_prefix(tokens[CAMSHAFT], tokens[name]),
        }
    return summary, ratios


# ------------------------------------------------------------------------------------------ where the time goes

def decode_breakdown(camshaft: CamshaftSystem, repeats: int, reference_ids: list[int]) -> dict:
    """Time the pieces of camshaft decode steps in a loop that mirrors Session._run over its sequence graph
    (runtime code untouched): SequenceEngine.feed's two lines (prepare: the token and lengths written into the
    bound inputs; InferenceSession.run_with_iobinding) around separate timers, then SequenceSampler.sample on the
    bound logits buffer and TextStream.append (the detokenizer)."""
    from camshaft.runtime.detokenizer import TextStream
    from camshaft.runtime.sampler import SequenceSampler

    session = camshaft.session
    engine = session.engine
    prompt, params = camshaft.prompt, camshaft.params
    new_tokens = params.max_tokens
    pieces = ["prepare", "run", "sample", "detokenize"]
    passes = []
    perf = time.perf_counter
    for _ in range(repeats + 1):  # the first pass warms up
        times: dict[str, list[float]] = {p: [] for p in pieces}
        step_total = []
        engine.start(len(prompt) + new_tokens)
        try:
            sampler = SequenceSampler(params, prompt, engine.eos_token_ids, [], session.manifest.model.vocab_size)
            engine.screen(sampler.plain_greedy)  # as the Session does: a float head's greedy shortcut
            text = TextStream(session.tokenizer, prompt)
            token = sampler.sample(engine.feed(prompt, 0)).token_id
            ids = [token]
            text.append(token)
            pos = len(prompt)
            for _step in range(new_tokens - 1):
                t0 = perf()
                engine.prepare([token], pos)
                t1 = perf()
                engine.session.run_with_iobinding(engine.binding)
                t2 = perf()
                token = sampler.sample(engine.logits[0]).token_id  # the Session samples the bound buffer too
                t3 = perf()
                text.append(token)
                t4 = perf()
                for piece, (a, b) in zip(pieces, [(t0, t1), (t1, t2), (t2, t3), (t3, t4)], strict=True):
                    times[piece].append(b - a)
                step_total.append(t4 - t0)
                ids.append(token)
                pos += 1
        finally:
            engine.finish()
        passes.append({"pieces_ms": {p: 1000 * statistics.fmean(v) for p, v in times.items()},
                       "step_ms": 1000 * statistics.fmean(step_total), "token_ids": ids})
    passes = passes[1:]
    result = {
        "steps_per_pass": new_tokens - 1,
        "passes": repeats,
        "pieces_ms": {p: round(statistics.median(x["pieces_ms"][p] for x in passes), 4) for p in pieces},
        "step_ms": round(statistics.median(x["step_ms"] for x in passes), 3),
        "tokens_equal_to_session": common_prefix(passes[0]["token_ids"], reference_ids),
    }
    # the sequence graph reads its weights from the batch graph's data file (and its own, for what it does not share)
    weights = sum((engine.dir / f"{name}.data").stat().st_size for name in (engine.manifest.artifact,
                                                                             engine.layout.artifact))
    if engine.layout.screens_greedy:  # a certified greedy step reads the int8 screen, not the float head
        c = engine.manifest.model
        weights -= c.vocab_size * c.hidden_size * 4
        result["screened_head"] = True
    result["weight_bytes"] = weights
    result["weight_bytes_per_run_gb_s"] = round(weights / (result["pieces_ms"]["run"] / 1000) / 1e9, 1)
    return result




# ----------------------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--work-dir", type=Path, default=REPO / "out" / "bench",
                   help="engines, the onnxruntime-genai model and latency.json go here")
    p.add_argument("--model-dir", type=Path, default=None, help="SmolLM2 checkpoint (default: fetch into the cache)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each runs every system once)")
    p.add_argument("--processes", type=int, default=3,
                   help="processes per system, each run once a round (memory placement differs per process)")
    p.add_argument("--threads", type=int, default=2, help="threads for every system")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", dest="new_tokens", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=2048, help="camshaft engine build limit")
    p.add_argument("--breakdown-passes", type=int, default=3, help="passes of the decode-step breakdown")
    p.add_argument("--rebuild", action="store_true", help="rebuild the camshaft engine and onnxruntime-genai model")
    p.add_argument("--skip-build-measure", action="store_true",
                   help="build only what is missing; reuse build numbers from the previous latency.json")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG to write (default: docs/bench/latency.png with --write-md, else beside the JSON)")
    p.add_argument("--md", type=Path, default=REPO / "BENCHMARKS.md")
    p.add_argument("--write-md", action="store_true", help="replace the latency section of --md")
    args = p.parse_args(argv)
    if min(args.rounds, args.processes, args.threads, args.prompt_len) < 1 or args.new_tokens < 2:
        p.error("--rounds, --processes, --threads, --prompt-len must be >= 1 and --max-tokens >= 2")
    return args

def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    json_path = work / "latency.json"
    if args.plot is None:  # the committed plot changes only with the section that shows it
        args.plot = (REPO / "docs" / "bench" if args.write_md else work) / "latency.png"
    previous = json.loads(json_path.read_text()) if json_path.exists() else None

    model_dir = args.model_dir or fetch_model(MODEL, default_model_dir(MODEL), progress=log)
    engine_dir = work / "engine-fp32"
    ortgenai_dir = work / "ortgenai-fp32"
    builds = ensure_builds(args, Path(model_dir), engine_dir, ortgenai_dir, previous)
    set_ortgenai_threads(ortgenai_dir, args.threads)

    from camshaft.manifest import read_manifest

    vocab = read_manifest(engine_dir).model.vocab_size
    prompt = benchmark_prompt(vocab, args.prompt_len)
    log(f"loading systems, {args.processes} process(es) each")
    k = args.processes
    systems = [
        Replicas(k, CamshaftSystem, engine_dir, prompt, args.new_tokens, args.threads),
        Replicas(k, CamshaftSystem, engine_dir, prompt, args.new_tokens, args.threads, graph="batch"),
        Replicas(k, TransformersSystem, Path(model_dir), prompt, args.new_tokens, args.threads),
        Replicas(k, OrtGenaiSystem, ortgenai_dir, prompt, args.new_tokens),
    ]
    per_round, tokens = run_rounds(systems, args.rounds, args.prompt_len)
    for system in systems:
        system.close()
    summary, ratios = summarize(per_round, tokens)

    log("decode-step breakdown")
    camshaft = CamshaftSystem(engine_dir, prompt, args.new_tokens, args.threads)
    breakdown = decode_breakdown(camshaft, args.breakdown_passes, tokens[CAMSHAFT])
    num_feeds = len(read_manifest(engine_dir).sequence_graph.inputs)

    results = {
        "benchmark": "latency",
        "model": MODEL,
        "command": command_line(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine_info(),
        "config": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "threads": args.threads,
                   "rounds": args.rounds, "processes": args.processes, "greedy": True, "ignore_eos": True,
                   "dtype": "float32", "batch": 1,
                   "model_dir": str(model_dir), "engine_dir": rel(engine_dir), "ortgenai_dir": rel(ortgenai_dir),
                   "max_seq_len": args.max_seq_len},
        "summary": summary,
        "ratios": ratios,
        "rounds": per_round,
        "builds": builds,
        "decode_breakdown": breakdown,
        "num_feeds": num_feeds,
        "notes": {
            "ratios": "camshaft / system, median over rounds of the within-round ratio; *_ratio_of_medians too",
            "ttft": "prompt in -> first token out (camshaft: Session Timings; transformers: prefill forward + argmax; "
                    "onnxruntime-genai: append_tokens + first generate_next_token)",
            "decode_tok_s": "(new_tokens - 1) / (total - ttft)",
        },
    }
    publish(results, json_path, args.plot, lambda path: plot(results, path), args.md, markdown, (MD_BEGIN, MD_END),
            args.write_md)


if __name__ == "__main__":
    main()
