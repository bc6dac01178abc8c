"""The batch-1 systems the latency scripts compare, each runnable in processes of its own, and interleaved rounds.

Each system's run() returns {"ttft_s", "total_s", "token_ids"}: TTFT is prompt in -> first token out; the decode
rate is (new_tokens - 1) / (total_s - ttft_s), the definition camshaft's Timings use.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_common import PAUSE_S, cache_keyword, log, returned_cache

CAMSHAFT = "camshaft"
CAMSHAFT_BATCH = "camshaft on its batch graph"
TRANSFORMERS = "transformers fp32"
ORT_GENAI = "onnxruntime-genai fp32"

class CamshaftSystem:
    """The Session as users get it (graph "auto": the sequence graph), or on the engine's batch graph."""

    def __init__(self, engine_dir: Path, prompt: list[int], new_tokens: int, threads: int,
                 graph: str = "auto", huge_pages: bool = True) -> None:
        from camshaft.runtime.sampling_params import SamplingParams
        from camshaft.runtime.session import Session

        self.name = CAMSHAFT if graph == "auto" else CAMSHAFT_BATCH
        self.session = Session(engine_dir, threads=threads, graph=graph, huge_pages=huge_pages)
        self.prompt = prompt
        self.params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def run(self) -> dict:
        result = self.session.generate(self.prompt, self.params)
        t = result.timings
        return {"ttft_s": t.ttft_s, "total_s": t.total_s, "token_ids": list(result.token_ids)}


class TransformersSystem:
    name = TRANSFORMERS

    def __init__(self, model_dir: Path, prompt: list[int], new_tokens: int, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.prompt = torch.tensor([prompt], dtype=torch.long)
        self.new_tokens = new_tokens
        self.cache_arg = cache_keyword(self.model)

    def _cache(self, out):
        return returned_cache(out, self.cache_arg)

    def run(self) -> dict:
        torch, model = self.torch, self.model
        with torch.inference_mode():
            start = time.perf_counter()
            out = model(input_ids=self.prompt, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            ids = [int(token)]
            first = time.perf_counter()
            past = self._cache(out)
            for _ in range(self.new_tokens - 1):
                out = model(input_ids=token, use_cache=True, **{self.cache_arg: past})
                past = self._cache(out)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                ids.append(int(token))
            end = time.perf_counter()
        return {"ttft_s": first - start, "total_s": end - start, "token_ids": ids}


class OrtGenaiSystem:
    name = ORT_GENAI

    def __init__(self, model_dir: Path, prompt: list[int], new_tokens: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(str(model_dir))
        self.prompt = np.asarray(prompt, dtype=np.int32)
        self.new_tokens = new_tokens

    def run(self) -> dict:
        og = self.og
        length = len(self.prompt) + self.new_tokens
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=length, min_length=length, do_sample=False)
        generator = og.Generator(self.model, params)
        start = time.perf_counter()
        generator.append_tokens(self.prompt)
        generator.generate_next_token()
        ids = [int(generator.get_next_tokens()[0])]
        first = time.perf_counter()
        while len(ids) < self.new_tokens and not generator.is_done():
            generator.generate_next_token()
            ids.append(int(generator.get_next_tokens()[0]))
        end = time.perf_counter()
        del generator
        return {"ttft_s": first - start, "total_s": end - start, "token_ids": ids}


class Isolated:
    """A system in a process of its own (spawned), driven over a pipe: `run()` runs it there once. Systems sharing
    one process disturb each other (thread pools, allocators: measured, the camshaft Session slowed after a peer ran
    in its process); users run one per process. While one runs, the others wait in `recv`."""

    def __init__(self, make: Callable[..., object], *args: object, **kwargs: object) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve_system, args=(child, make, args, kwargs), daemon=True)
        self.process.start()
        reply = self.conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        self.name = reply

    def run(self, *args: object) -> dict:
        """The system's run(*args), in its process."""
        self.conn.send(args)
        reply = self.conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)


class Replicas:
    """One system in `count` processes of its own (each Isolated); `run()` runs each in turn and returns their mean
    times. Where a process lands in memory moved one engine's decode speed by 4 % between processes (measured), and
    that offset persists for the process's life: rounds alone do not average it out."""

    def __init__(self, count: int, make: Callable[..., object], *args: object, **kwargs: object) -> None:
        self.replicas = [Isolated(make, *args, **kwargs) for _ in range(count)]
        self.name = self.replicas[0].name

    def run(self) -> dict:
        runs = []
        for i, replica in enumerate(self.replicas):
            if i:
                time.sleep(PAUSE_S)
            runs.append(replica.run())
        mean = {key: statistics.mean(r[key] for r in runs) for key in ("ttft_s", "total_s")}
        return {**mean, "token_ids": runs[0]["token_ids"]}

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()


def _serve_system(conn, make: Callable[..., object], args: tuple, kwargs: dict) -> None:
    try:
        system = make(*args, **kwargs)
        conn.send(system.name)
    except BaseException as exc:  # reported to the parent, which raises it
        conn.send(exc)
        return
    while (args := conn.recv()) is not None:
        try:
            conn.send(system.run(*args))
        except BaseException as exc:
            conn.send(exc)


def summarize_run(run: dict, prompt_len: int) -> dict:
    n = len(run["token_ids"])
    decode_s = run["total_s"] - run["ttft_s"]
    return {
        "ttft_ms": run["ttft_s"] * 1000,
        "prefill_tok_s": prompt_len / run["ttft_s"],
        "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        "total_s": run["total_s"],
        "new_tokens": n,
    }


def run_rounds(systems: list, rounds: int, prompt_len: int) -> tuple[dict, dict]:
    """Warm each system once, then `rounds` rounds, each in its own seeded order (a rotation would give each system
    the same predecessor every round). Returns per-system runs and token ids."""
    for system in systems:
        log(f"warm-up: {system.name}")
        system.run()
    per_round: dict[str, list[dict]] = {s.name: [] for s in systems}
    tokens: dict[str, list[int]] = {}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        order = random.Random(r).sample(systems, len(systems))  # each round its own order and predecessors
        for system in order:
            time.sleep(PAUSE_S)
            run = system.run()
            tokens.setdefault(system.name, run["token_ids"])
            summary = summarize_run(run, prompt_len)
            summary["round"] = r
            summary["position_in_round"] = order.index(system)
            per_round[system.name].append(summary)
        line = ", ".join(f"{s.name} {per_round[s.name][-1]['decode_tok_s']:.1f} tok/s "
                         f"{per_round[s.name][-1]['ttft_ms']:.0f} ms" for s in systems)
        loads.append(os.getloadavg()[0])
        log(f"round {r + 1}/{rounds} ({' -> '.join(s.name for s in order)}): {line}; load {loads[-1]:.2f}")
    per_round["_load_1min"] = [round(x, 2) for x in loads]
    threads = len(os.sched_getaffinity(0))
    if max(loads[1:]) > threads + 1:
        log(f"warning: the 1-minute load average reached {max(loads[1:]):.1f} on {threads} cores: other work shared "
            "the machine; the ratios are more trustworthy than the absolute numbers, and a rerun on a quieter machine "
            "is better still")
    return per_round, tokens
