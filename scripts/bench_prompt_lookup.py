#!/usr/bin/env python
"""Prompt lookup decoding on SmolLM2-135M-Instruct (batch 1, CPU, fp32): tasks whose answer repeats its prompt.

Systems, each in a process of its own, on the same chat prompt ids, greedy, to the end id (at most --max-tokens):
camshaft's Session without and with `PromptLookup(num_tokens=K)` for each --draft K, transformers `generate()`
without and with its own prompt lookup (`prompt_lookup_num_tokens`, the same technique), and onnxruntime-genai
(none). Tasks: copy a text, correct its spelling, add type hints to a function (text and code read at run time
from this Python's own LICENSE file and standard library), and an open question (drafts seldom match: their cost).
Rounds are interleaved; decode tok/s medians and, per round, ratios to camshaft without drafts and to
onnxruntime-genai. Writes out/bench/prompt_lookup.json, a plot, and with --write-md the section of BENCHMARKS.md.

    .venv/bin/python scripts/bench_prompt_lookup.py --rounds 3 --write-md
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_builds import set_ortgenai_threads  # noqa: E402
from bench_common import PAUSE_S, REPO, command_line, log, machine_info, write_markdown  # noqa: E402
from bench_systems import Isolated  # noqa: E402

from camshaft.models import default_model_dir, fetch_model  # noqa: E402
from camshaft.runtime.throughput_plot import save_figure  # noqa: E402

MODEL = "smollm2-135m-instruct"
MD_BEGIN, MD_END = "<!-- prompt-lookup:begin -->", "<!-- prompt-lookup:end -->"
BASE, ORT = "camshaft", "onnxruntime-genai"


def tasks() -> dict[str, str]:
    """Chat requests of this Python's own text: the PSF license's history and a standard library function."""
    license_text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    paragraph = license_text.split("\n\n")[2].replace("\n", " ")
    typos = paragraph.replace("the ", "teh ").replace("Python", "Pyhton").replace("language", "langauge")
    source = textwrap.dedent(inspect.getsource(textwrap.indent))
    return {"copy": f"Copy the following text exactly:\n\n{paragraph}",
            "spelling": f"Rewrite this text with its spelling mistakes corrected:\n\n{typos}",
            "code": f"Add type hints to this Python function:\n\n{source}",
            "open": "Write a short story about a lighthouse keeper and a storm."}


class Camshaft:
    def __init__(self, engine: Path, prompts: dict[str, list[int]], max_tokens: int, threads: int,
                 draft: int) -> None:
        from camshaft.runtime.prompt_lookup import PromptLookup
        from camshaft.runtime.session import Session

        self.name = f"{BASE} + prompt lookup {draft}" if draft else BASE
        self.session = Session(engine, threads=threads, prompt_lookup=PromptLookup(draft) if draft else None)
        self.prompts, self.max_tokens = prompts, max_tokens

    def run(self, task: str) -> dict:
        session = self.session
        before = session.accepted_draft_tokens, session.draft_tokens
        result = session.generate(self.prompts[task], max_tokens=self.max_tokens, temperature=0)
        t = result.timings
        return {"ttft_s": t.ttft_s, "total_s": t.total_s, "token_ids": list(result.token_ids),
                "accepted": session.accepted_draft_tokens - before[0], "drafted": session.draft_tokens - before[1]}


class Transformers:
    def __init__(self, model_dir: Path, prompts: dict[str, list[int]], max_tokens: int, threads: int,
                 draft: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch, self.draft = torch, draft
        self.name = f"transformers + prompt lookup {draft}" if draft else "transformers"
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.prompts, self.max_tokens = prompts, max_tokens

    def run(self, task: str) -> dict:
        from transformers.generation.streamers import BaseStreamer

        times: list[float] = []

        class Clock(BaseStreamer):
            def put(self, value) -> None:
                times.append(time.perf_counter())

            def end(self) -> None:
                pass

        ids = self.torch.tensor([self.prompts[task]])
        extra = {"prompt_lookup_num_tokens": self.draft} if self.draft else {}
        with self.torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=self.max_tokens, streamer=Clock(), **extra)
            end = time.perf_counter()
        # the streamer's first call is the prompt, its second the first new token
        return {"ttft_s": times[1] - start, "total_s": end - start, "token_ids": out[0, ids.shape[1]:].tolist()}


class OrtGenai:
    name = ORT

    def __init__(self, model_dir: Path, prompts: dict[str, list[int]], max_tokens: int) -> None:
        import numpy as np
        import onnxruntime_genai as og

        self.og, self.np, self.model = og, np, og.Model(str(model_dir))
        self.prompts, self.max_tokens = prompts, max_tokens

    def run(self, task: str) -> dict:
        prompt = self.np.asarray(self.prompts[task], dtype=self.np.int32)
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + self.max_tokens, do_sample=False)
        generator = self.og.Generator(self.model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt)
        ids, first = [], None
        while not generator.is_done() and len(ids) < self.max_tokens:
            generator.generate_next_token()
            ids.append(int(generator.get_next_tokens()[0]))
            first = first or time.perf_counter()
        end = time.perf_counter()
        return {"ttft_s": first - start, "total_s": end - start, "token_ids": ids}


def decode_tok_s(run: dict) -> float:
    n, decode = len(run["token_ids"]), run["total_s"] - run["ttft_s"]
    return (n - 1) / decode if n > 1 and decode > 0 else 0.0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, default=REPO / "out" / "bench")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--draft", type=int, action="append", help="camshaft drafts a step (repeatable; default 4)")
    p.add_argument("--engine", type=Path, help="camshaft engine (default: WORK_DIR/engine-fp32, which the latency "
                   "benchmark builds)")
    p.add_argument("--ortgenai", type=Path, help="onnxruntime-genai fp32 model (default: WORK_DIR/ortgenai-fp32)")
    p.add_argument("--write-md", action="store_true")
    args = p.parse_args(argv)
    drafts = args.draft or [4]
    model_dir = fetch_model(MODEL, default_model_dir(MODEL), progress=log)
    engine = args.engine or args.work_dir / "engine-fp32"
    ortgenai = args.ortgenai or args.work_dir / "ortgenai-fp32"
    for path, what in ((engine, "camshaft build"), (ortgenai, "scripts/bench_latency.py")):
        if not path.is_dir():
            raise SystemExit(f"{path} is missing: make it with {what} first")
    set_ortgenai_threads(ortgenai, args.threads)
    from camshaft.runtime.session import Session

    with Session(engine) as session:
        prompts = {name: session.encode(messages=[{"role": "user", "content": text}])
                   for name, text in tasks().items()}
    systems = [Isolated(Camshaft, engine, prompts, args.max_tokens, args.threads, d) for d in [0, *drafts]]
    systems += [Isolated(Transformers, model_dir, prompts, args.max_tokens, args.threads, d) for d in (0, drafts[0])]
    systems.append(Isolated(OrtGenai, ortgenai, prompts, args.max_tokens))
    runs: dict[str, dict[str, list[dict]]] = {task: {s.name: [] for s in systems} for task in prompts}
    for task in prompts:
        for s in systems:
            s.run(task)  # warm-up
    for r in range(args.rounds):
        for task in prompts:
            order = random.Random(f"{r}/{task}").sample(systems, len(systems))
            for s in order:
                time.sleep(PAUSE_S)
                runs[task][s.name].append(s.run(task))
            log(f"round {r + 1}/{args.rounds} {task}: " + ", ".join(
                f"{s.name} {decode_tok_s(runs[task][s.name][-1]):.1f}" for s in systems))
    for s in systems:
        s.close()
    results = summarize(runs, prompts, [s.name for s in systems], args, command_line(argv))
    out = args.work_dir / "prompt_lookup.json"
    out.write_text(json.dumps(results, indent=1))
    plot_path = (REPO / "docs" / "bench" if args.write_md else args.work_dir) / "prompt_lookup.png"
    plot(results, plot_path)
    section = markdown(results, plot_path)
    print(section)
    if args.write_md:
        write_markdown(REPO / "BENCHMARKS.md", section, MD_BEGIN, MD_END)


def summarize(runs: dict, prompts: dict, names: list[str], args, command: str) -> dict:
    table = {}
    for task, by_system in runs.items():
        base_ids = by_system[BASE][0]["token_ids"]
        row = {}
        for name in names:
            rounds = by_system[name]
            speeds = [decode_tok_s(run) for run in rounds]
            ratios = {key: [s / decode_tok_s(other) for s, other in zip(speeds, by_system[peer], strict=True)]
                      for key, peer in (("vs_camshaft", BASE), ("vs_ortgenai", ORT))}
            row[name] = {
                "decode_tok_s": statistics.median(speeds), "rounds_tok_s": speeds,
                **{key: statistics.median(values) for key, values in ratios.items()},
                **{f"{key}_range": [min(values), max(values)] for key, values in ratios.items()},
                "tokens": len(rounds[0]["token_ids"]),
                "same_tokens": rounds[0]["token_ids"] == base_ids,
                "accepted": rounds[0].get("accepted"), "drafted": rounds[0].get("drafted"),
            }
        table[task] = {"prompt_tokens": len(prompts[task]), "systems": row}
    return {"command": command, "machine": machine_info(), "rounds": args.rounds, "max_tokens": args.max_tokens,
            "threads": args.threads, "tasks": table, "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks_ = list(results["tasks"])
    names = list(results["tasks"][tasks_[0]]["systems"])
    fig, ax = plt.subplots(figsize=(11, 4.4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [results["tasks"][t]["systems"][name]["decode_tok_s"] for t in tasks_]
        color = "#2b6cb0" if name.startswith(BASE) and "lookup" in name else "#90cdf4" if name == BASE else \
            "#a0aec0" if "lookup" not in name else "#4a5568"
        bars = ax.bar([x + i * width for x in range(len(tasks_))], values, width, label=name, color=color)
        for bar, value in zip(bars, values, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(tasks_))], tasks_)
    ax.set_ylabel("decode tokens/s (higher is better)")
    ax.legend(fontsize=8, ncols=2)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    save_figure(fig, path, f"Prompt lookup decoding, SmolLM2-135M-Instruct, batch 1, greedy, fp32, "
                f"{results['threads']} threads — {results['machine']['cpu']}; median of {results['rounds']} "
                "interleaved rounds")


def markdown(results: dict, plot_path: Path) -> str:
    m = results["machine"]
    out = [MD_BEGIN, "## Prompt lookup decoding: SmolLM2-135M-Instruct, batch 1, CPU", "",
           f"Machine: {m['cpu']}, {m['logical_cores']} logical cores; onnxruntime {m['versions']['onnxruntime']}, "
           f"onnxruntime-genai {m['versions']['onnxruntime-genai']}, transformers {m['versions']['transformers']}.", "",
           f"Command: `{results['command']}`", "",
           f"Each task is one chat request (greedy, fp32, to the end id or {results['max_tokens']} tokens, "
           f"{results['threads']} threads), every system in a process of its own, {results['rounds']} interleaved "
           "rounds after a warm-up; decode tok/s medians (min–max over rounds); ratios are medians of the per-round "
           "ratios (their min–max). Drafts: taken / proposed in the first round. \"same tokens\": equal to "
           f"camshaft's without drafts. Run ended {results['utc']} UTC.", "",
           "| task | system | decode tok/s | ÷ camshaft without drafts | ÷ onnxruntime-genai | drafts taken | "
           "tokens | same tokens |", "|---|---|---|---|---|---|---|---|"]
    for task, entry in results["tasks"].items():
        for name, row in entry["systems"].items():
            drafts = f"{row['accepted']}/{row['drafted']}" if row.get("drafted") else "—"
            speed = f"{row['decode_tok_s']:.1f} ({min(row['rounds_tok_s']):.1f}–{max(row['rounds_tok_s']):.1f})"
            vs = [f"{row[k]:.2f}× ({row[k + '_range'][0]:.2f}–{row[k + '_range'][1]:.2f})"
                  for k in ("vs_camshaft", "vs_ortgenai")]
            out.append(f"| {task} ({entry['prompt_tokens']} prompt tokens) | {name} | {speed} | {vs[0]} | {vs[1]} | "
                       f"{drafts} | {row['tokens']} | {'yes' if row['same_tokens'] else 'no'} |")
    shown = plot_path.resolve()
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
    out += ["", f"![prompt lookup]({shown})", "", MD_END]
    return "\n".join(out)


if __name__ == "__main__":
    main()
