#!/usr/bin/env python
"""Prompt lookup in in-flight batching: `LLM` with and without drafts on the same batch of chat requests.

The tasks of scripts/bench_prompt_lookup.py (copy, spelling, code, open), repeated to fill each --batch size, all
submitted at once (greedy, fp32, to the end id or --max-tokens); each system in a process of its own, rounds
interleaved. Output tok/s = the batch's output tokens / its wall time; the ratio is the median of per-round ratios.
Writes the section of BENCHMARKS.md between the prompt-lookup-batch markers with --write-md.

    .venv/bin/python scripts/bench_prompt_lookup_batch.py --batch 1,4,8 --rounds 3 --write-md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import PAUSE_S, REPO, command_line, log, machine_info, write_markdown  # noqa: E402
from bench_prompt_lookup import tasks  # noqa: E402
from bench_systems import Isolated  # noqa: E402

MD_BEGIN, MD_END = "<!-- prompt-lookup-batch:begin -->", "<!-- prompt-lookup-batch:end -->"


class Batch:
    def __init__(self, engine: Path, threads: int, draft: int, max_tokens: int, max_running: int | None) -> None:
        from camshaft.runtime.llm import LLM
        from camshaft.runtime.prompt_lookup import PromptLookup

        self.name = f"LLM + prompt lookup {draft}" if draft else "LLM"
        running = {} if max_running is None else {"max_running": max_running}
        self.llm = LLM(engine, threads=threads, prompt_lookup=PromptLookup(draft, **running) if draft else None)
        self.max_tokens = max_tokens

    def run(self, size: int) -> dict:
        from camshaft.runtime.sampling_params import SamplingParams

        texts = list(tasks().values())
        chats = [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(size)]
        executor = self.llm.executor
        before = executor.accepted_draft_tokens, executor.draft_tokens
        start = time.perf_counter()
        outputs = self.llm.chat(chats, SamplingParams(max_tokens=self.max_tokens), use_tqdm=False)
        wall = time.perf_counter() - start
        ids = [o.outputs[0].token_ids for o in outputs]
        return {"wall_s": wall, "tokens": sum(map(len, ids)), "token_ids": ids,
                "accepted": executor.accepted_draft_tokens - before[0], "drafted": executor.draft_tokens - before[1]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, default=REPO / "out" / "bench" / "engine-fp32")
    p.add_argument("--batch", default="1,4,8", help="requests at once, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--max-running", type=int, help="PromptLookup.max_running (default: its default)")
    p.add_argument("--write-md", action="store_true")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.batch.split(",")]
    systems = [Isolated(Batch, args.engine, args.threads, d, args.max_tokens, args.max_running)
               for d in (0, args.draft)]
    rows = []
    for size in sizes:
        for s in systems:
            s.run(size)  # warm-up
        runs: dict[str, list[dict]] = {s.name: [] for s in systems}
        for r in range(args.rounds):
            for s in systems if r % 2 == 0 else systems[::-1]:
                time.sleep(PAUSE_S)
                runs[s.name].append(s.run(size))
            log(f"batch {size} round {r + 1}: " + ", ".join(
                f"{name} {v[-1]['tokens'] / v[-1]['wall_s']:.1f} tok/s" for name, v in runs.items()))
        plain, drafting = (runs[s.name] for s in systems)
        speeds = [[run["tokens"] / run["wall_s"] for run in runs[s.name]] for s in systems]
        rows.append({"batch": size, "plain_tok_s": statistics.median(speeds[0]),
                     "draft_tok_s": statistics.median(speeds[1]),
                     "ratio": statistics.median(b / a for a, b in zip(*speeds, strict=True)),
                     "ratio_range": [min(b / a for a, b in zip(*speeds, strict=True)),
                                     max(b / a for a, b in zip(*speeds, strict=True))],
                     "same": plain[0]["token_ids"] == drafting[0]["token_ids"],
                     "taken": f"{drafting[0]['accepted']}/{drafting[0]['drafted']}"})
    for s in systems:
        s.close()
    m = machine_info()
    running = "" if args.max_running is None else f", max_running={args.max_running}"
    out = [MD_BEGIN, "## Prompt lookup in in-flight batching: SmolLM2-135M-Instruct, CPU", "",
           f"Machine: {m['cpu']}, {m['logical_cores']} logical cores. "
           f"Run ended {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC.", "",
           f"Command: `{command_line(argv)}`", "",
           f"`LLM` on one engine, the chat tasks of the section above repeated to fill each batch, all submitted at "
           f"once (greedy, fp32, to the end id or {args.max_tokens} tokens, {args.threads} threads), with and without "
           f"`PromptLookup({args.draft}{running})`, each in a process of its own, {args.rounds} interleaved rounds "
           "after a warm-up. Output tok/s = output tokens / wall time (medians); the ratio is the median of "
           "per-round ratios (min–max). Drafts: taken / proposed in the first round.", "",
           "| requests at once | output tok/s, no drafts | with drafts | ratio | drafts taken | same tokens |",
           "|---|---|---|---|---|---|"]
    for row in rows:
        out.append(f"| {row['batch']} | {row['plain_tok_s']:.1f} | {row['draft_tok_s']:.1f} | {row['ratio']:.2f}× "
                   f"({row['ratio_range'][0]:.2f}–{row['ratio_range'][1]:.2f}) | {row['taken']} | "
                   f"{'yes' if row['same'] else 'no'} |")
    section = "\n".join([*out, "", MD_END])
    print(section)
    if args.write_md:
        write_markdown(REPO / "BENCHMARKS.md", section, MD_BEGIN, MD_END)


if __name__ == "__main__":
    main()
