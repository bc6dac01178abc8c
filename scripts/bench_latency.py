#!/usr/bin/env python
"""Batch-1 latency of camshaft against its peers on SmolLM2-135M-Instruct (CPU, fp32).

Systems: camshaft's Session on an onnxruntime fp32 engine, transformers fp32 (a manual KV-cached greedy loop), and
onnxruntime-genai fp32 (a model made by its own builder). Every system gets the same prompt ids
(`benchmark_prompt`), generates the same number of tokens greedily with the end id ignored, and runs on the same
number of threads, each in a process of its own. Rounds are interleaved (each round runs every system once, in a
rotating order) and medians are
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
import dataclasses
import inspect
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np

from camshaft.models import default_model_dir, fetch_model
from camshaft.runtime.bench import benchmark_prompt
from camshaft.runtime.throughput_plot import save_figure

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
MD_BEGIN = "<!-- latency:begin -->"
MD_END = "<!-- latency:end -->"
MD_HEADER = ("# Benchmarks\n\nMeasured numbers, each section written by the script it names. The machine is shared "
             "and noisy: compare systems through the ratios measured in the same run, not across runs.\n")
CAMSHAFT = "camshaft"
# Before each run: the previous system's worker threads (torch's OpenMP, ONNX Runtime's pools) may still spin on the
# two cores for a while after it returns, and would slow the first part of the next run (its TTFT) otherwise.
PAUSE_S = 0.5
CAMSHAFT_BATCH = "camshaft on its batch graph"
TRANSFORMERS = "transformers fp32"
ORT_GENAI = "onnxruntime-genai fp32"


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


# --------------------------------------------------------------------------------------------------- machine info

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict:
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
        memory_gb = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        physical, memory_gb = None, None
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "available_cores": len(os.sched_getaffinity(0)),
        "memory_gb": memory_gb,
        "python": platform.python_version(),
        "versions": {name: version(name) for name in
                     ("camshaft", "onnxruntime", "onnxruntime-genai", "torch", "transformers", "numpy")},
    }


# --------------------------------------------------------------------------------------------------------- builds

def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure_command(cmd: list[str]) -> dict:
    """Run a build command as a child process: wall time and peak RSS (GNU time -v, else the children's rusage)."""
    gnu_time = shutil.which("time", path="/usr/bin:/bin")
    full = [gnu_time, "-v", *cmd] if gnu_time else cmd
    started = time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"build command failed ({proc.returncode}): {show_cmd(cmd)}")
    peak_kb = None
    if gnu_time:
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        peak_kb = int(match.group(1)) if match else None
    if peak_kb is None:  # Linux reports ru_maxrss in KiB: the largest child so far (builds run first, one at a time)
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"command": show_cmd(cmd), "wall_s": round(wall, 2), "peak_rss_mb": round(peak_kb / 1024, 1),
            "peak_rss_source": "/usr/bin/time -v" if gnu_time else "getrusage(RUSAGE_CHILDREN)"}


def camshaft_cli() -> list[str]:
    script = Path(sys.executable).parent / "camshaft"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from camshaft.cli import main; main()"]


def engine_usable(engine_dir: Path, min_seq_len: int) -> bool:
    from camshaft.errors import CamshaftError
    from camshaft.manifest import KVCacheLayout, read_manifest
    from camshaft.runtime.backends.onnxruntime import check_compatible

    if not engine_dir.is_dir():
        return False
    try:
        manifest = read_manifest(engine_dir)
        check_compatible(manifest)
    except CamshaftError:
        return False
    # An engine from an older builder with another KV layout loads but fails at the first step: compare layouts.
    current_layout = next((f.default for f in dataclasses.fields(KVCacheLayout) if f.name == "layout"), None)
    if isinstance(current_layout, str) and getattr(manifest.kv_cache, "layout", current_layout) != current_layout:
        return False
    return (manifest.target == "onnxruntime" and manifest.dtype == "float32"
            and manifest.sequence_graph is not None and manifest.limits.max_seq_len >= min_seq_len)


def graph_hash(engine_dir: Path) -> str | None:
    try:
        return json.loads((engine_dir / "manifest.json").read_text()).get("graph_sha256")
    except (OSError, ValueError):
        return None


def ortgenai_present(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in ("genai_config.json", "model.onnx", "model.onnx.data"))


def camshaft_build_cmd(model_dir: Path, out: Path, max_seq_len: int) -> list[str]:
    return [*camshaft_cli(), "build", "--model", str(model_dir), "--output", str(out),
            "--max-seq-len", str(max_seq_len)]


def ortgenai_build_cmd(model_dir: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out),
            "-p", "fp32", "-e", "cpu"]


def ensure_builds(args, model_dir: Path, engine_dir: Path, ortgenai_dir: Path, previous: dict | None) -> dict:
    """Build what is missing; measure each build (into a scratch directory when the artifact already exists)."""
    work = Path(args.work_dir)
    builds: dict = {}
    need = args.prompt_len + args.new_tokens
    jobs = [
        ("camshaft", engine_dir, engine_usable(engine_dir, need),
         lambda out: camshaft_build_cmd(model_dir, out, args.max_seq_len)),
        ("onnxruntime-genai", ortgenai_dir, ortgenai_present(ortgenai_dir),
         lambda out: ortgenai_build_cmd(model_dir, out)),
    ]
    for name, target, present, make_cmd in jobs:
        present = present and not args.rebuild
        if present and args.skip_build_measure:
            log(f"{name}: using {rel(target)}; build not re-measured")
            old = (previous or {}).get("builds", {}).get(name)
            if old:
                builds[name] = {**old, "reused_from_previous_run": True}
            continue
        if present:
            out = work / f".build-probe-{name}"
            shutil.rmtree(out, ignore_errors=True)
            log(f"{name}: {rel(target)} exists; measuring a fresh build into {rel(out)}")
        else:
            out = target
            if out.exists():
                log(f"{name}: {rel(out)} is stale or incomplete; rebuilding it")
                shutil.rmtree(out)
            log(f"{name}: building {rel(out)}")
        result = measure_command(make_cmd(out))
        result["size_mb"] = round(dir_bytes(out) / 1e6, 1)
        if present and name == "camshaft" and graph_hash(out) != graph_hash(target):
            log(f"camshaft: {rel(target)} differs from what the current builder makes; replacing it with the new build")
            shutil.rmtree(target)
            os.replace(out, target)
        elif present:
            shutil.rmtree(out, ignore_errors=True)
        builds[name] = result
        log(f"{name}: built in {result['wall_s']} s, peak RSS {result['peak_rss_mb']} MB, {result['size_mb']} MB")
    return builds


def set_ortgenai_threads(model_dir: Path, threads: int) -> None:
    path = model_dir / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    if options.get("intra_op_num_threads") != threads:
        options["intra_op_num_threads"] = threads
        path.write_text(json.dumps(config, indent=4) + "\n")
    print(f"onnxruntime-genai: genai_config.json model.decoder.session_options.intra_op_num_threads = {threads} "
          f"(the thread count camshaft uses)")


# -------------------------------------------------------------------------------------------------------- systems
# Each system's run() returns {"ttft_s", "total_s", "token_ids"}: TTFT is prompt in -> first token out; the decode
# rate is (new_tokens - 1) / (total_s - ttft_s), the definition camshaft's Timings use.


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
        # transformers 5.25 renamed forward's `past_key_values` to `cache` (the old name warns); accept either.
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _cache(self, out):
        return getattr(out, "cache", None) if self.cache_arg == "cache" else out.past_key_values

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


def run_rounds(systems: list, rounds: int, prompt_len: int) -> tuple[dict, dict]:
    """Warm each system once, then `rounds` rounds in rotating order. Returns per-system runs and token ids."""
    for system in systems:
        log(f"warm-up: {system.name}")
        system.run()
    per_round: dict[str, list[dict]] = {s.name: [] for s in systems}
    tokens: dict[str, list[int]] = {}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        shift = r % len(systems)
        order = systems[shift:] + systems[:shift]
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
    result["weight_bytes"] = weights
    result["weight_bytes_per_run_gb_s"] = round(weights / (result["pieces_ms"]["run"] / 1000) / 1e9, 1)
    return result


PIECE_LABELS = {
    "prepare": "inputs: the token and lengths written into the {n} bound input buffers (`SequenceEngine.prepare`)",
    "run": "`InferenceSession.run_with_iobinding` (the sequence graph)",
    "sample": "sampling: `SequenceSampler.sample` (greedy argmax)",
    "detokenize": "detokenizing: `TextStream.append`",
}


# ------------------------------------------------------------------------------------------------- plot and text

def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    names = list(summary)
    colors = ["#2b6cb0" if n == CAMSHAFT else "#a0aec0" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = [("decode_tok_s", "decode tokens/s (higher is better)", "{:.1f}"),
              ("ttft_ms", "time to first token, ms (lower is better)", "{:.0f}")]
    for ax, (key, title, fmt) in zip(axes, panels, strict=True):
        med = [summary[n][key]["median"] for n in names]
        low = [summary[n][key]["median"] - summary[n][key]["min"] for n in names]
        high = [summary[n][key]["max"] - summary[n][key]["median"] for n in names]
        bars = ax.bar(range(len(names)), med, color=colors, yerr=[low, high], capsize=6,
                      error_kw={"elinewidth": 1.2, "ecolor": "#1a202c"})
        pad = 0.015 * max(m + h for m, h in zip(med, high, strict=True))
        for bar, value, up in zip(bars, med, high, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, value + up + pad, fmt.format(value), ha="center", va="bottom",
                    fontsize=9)
        ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, max(m + h for m, h in zip(med, high, strict=True)) * 1.18)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    cfg = results["config"]
    m = results["machine"]
    save_figure(fig, path, f"SmolLM2-135M-Instruct, batch 1, {cfg['prompt_len']} prompt + {cfg['new_tokens']} new "
                f"tokens, greedy, fp32, {cfg['threads']} threads — {m['cpu']}\nmedian of {cfg['rounds']} interleaved "
                "round(s); error bars: min–max")


def fmt_range(s: dict, digits: int) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(results: dict, plot_ref: str) -> str:
    cfg, m, summary, ratios = results["config"], results["machine"], results["summary"], results["ratios"]
    v = m["versions"]
    loads = results["rounds"].get("_load_1min") or [0.0]
    load_text = f"{min(loads):.2f}–{max(loads):.2f}"
    cores = f"{m['logical_cores']} logical cores"
    if m.get("physical_cores"):
        cores += f" ({m['physical_cores']} physical)"
    out = [
        MD_BEGIN,
        "## Latency: SmolLM2-135M-Instruct, batch 1, CPU",
        "",
        f"Machine: {m['cpu']}, {cores}, {m['memory_gb']} GB; Python {m['python']}, onnxruntime {v['onnxruntime']}, "
        f"onnxruntime-genai {v['onnxruntime-genai']}, torch {v['torch']}, transformers {v['transformers']}, "
        f"camshaft {v['camshaft']}.",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Workload: the same {cfg['prompt_len']} prompt ids for every system (`benchmark_prompt`, seed 0), "
        f"{cfg['new_tokens']} new tokens, greedy, end id ignored, fp32, {cfg['threads']} threads everywhere "
        f"(camshaft `Session(threads={cfg['threads']})`, `torch.set_num_threads({cfg['threads']})`, "
        f"onnxruntime-genai `intra_op_num_threads: {cfg['threads']}` in genai_config.json). "
        f"Each system runs in {cfg.get('processes', 1)} process(es) of its own (spawned; the others wait idle while "
        f"one runs; where a process lands in memory moves its speed by a few per cent for its whole life), {PAUSE_S} s "
        "after the previous run (so no worker thread of the previous system still spins on the cores). "
        f"One warm-up run each, then {cfg['rounds']} round(s); each round runs every system once (each of its "
        "processes in turn; their mean time), in rotating order. "
        "Medians, (min–max) over rounds. TTFT = prompt in → first token out; decode tok/s = "
        f"({cfg['new_tokens']} − 1) / (time after the first token). transformers runs a KV-cached greedy loop "
        "(`model(...)` + argmax per token); onnxruntime-genai runs `append_tokens` then `generate_next_token` "
        "(TTFT = `append_tokens` + the first `generate_next_token`) on a model from its own builder "
        "(`-p fp32 -e cpu`). camshaft runs the engine's sequence graph (contiguous cache, GroupQueryAttention: "
        "what `Session` picks); \"camshaft on its batch graph\" is the same engine through `Session(graph=\"batch\")`: "
        "the paged graph the in-flight batcher runs.",
        "",
        "| system | decode tok/s | TTFT ms | prefill tok/s | camshaft ÷ system, decode tok/s | "
        "camshaft ÷ system, TTFT | greedy tokens equal to camshaft's |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        r = ratios.get(name)
        cells = [f"**{name}**" if name == CAMSHAFT else name, fmt_range(s["decode_tok_s"], 1),
                 fmt_range(s["ttft_ms"], 1), fmt_range(s["prefill_tok_s"], 0)]
        if r:
            cells += [f"{r['decode_tok_s']['median']:.2f}×", f"{r['ttft']['median']:.2f}×",
                      f"{r['greedy_tokens_equal_to_camshaft']}/{cfg['new_tokens']}"]
        else:
            cells += ["—", "—", "—"]
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "Ratios are the median over rounds of the ratio within each round (both systems measured seconds apart). "
        "Decode ratio > 1: camshaft generates faster; TTFT ratio < 1: camshaft answers sooner. "
        f"1-minute load average at the round boundaries: {load_text} (this benchmark alone accounts for about "
        f"{cfg['threads']}; more means other work shared the cores and the absolute numbers suffer).",
        "",
        f"![latency]({plot_ref})",
        "",
    ]
    builds = results.get("builds") or {}
    if builds:
        out += ["### Build", "",
                "| builder | wall time | peak RSS | output on disk | command |", "|---|---|---|---|---|"]
        for name, b in builds.items():
            note = " (previous run)" if b.get("reused_from_previous_run") else ""
            out.append(f"| {name}{note} | {b['wall_s']:.1f} s | {b['peak_rss_mb']:.0f} MB | {b['size_mb']:.0f} MB "
                       f"| `{b['command']}` |")
        source = next(iter(builds.values()))["peak_rss_source"]
        out += ["", f"One child process per build, timed with wall clock; peak RSS from `{source}`.", ""]
    bd = results.get("decode_breakdown")
    if bd:
        session_ms = 1000 / summary[CAMSHAFT]["decode_tok_s"]["median"]
        out += [
            "### Where the time goes: one camshaft decode step",
            "",
            f"A loop that mirrors `Session._run` over the same prompt times each piece of the {bd['steps_per_pass']} "
            f"decode steps (mean per step; median of {bd['passes']} pass(es) after a warm-up pass; runtime code "
            f"unchanged; greedy tokens equal to the Session's: {bd['tokens_equal_to_session']}/{cfg['new_tokens']}).",
            "",
            "| piece | ms / step | share |",
            "|---|---|---|",
        ]
        total = bd["step_ms"]
        num_feeds = results.get("num_feeds", "N")
        for piece, ms in bd["pieces_ms"].items():
            out.append(f"| {PIECE_LABELS[piece].format(n=num_feeds)} | {ms:.3f} | {100 * ms / total:.1f} % |")
        out.append(f"| **step total (timed loop)** | **{total:.3f}** | 100 % |")
        out.append(f"| Session decode step in the rounds above (1000 / median decode tok/s) | {session_ms:.3f} | "
                   f"{100 * session_ms / total:.1f} % |")
        if "weight_bytes_per_run_gb_s" in bd:
            out += ["", f"The model call reads the {bd['weight_bytes'] / 1e6:.0f} MB of fp32 weights once per "
                    f"step: {bd['weight_bytes_per_run_gb_s']} GB/s of weights per `run_with_iobinding`. Everything "
                    f"outside the model call costs "
                    f"{total - bd['pieces_ms']['run']:.3f} ms a step "
                    f"({100 * (total - bd['pieces_ms']['run']) / total:.1f} %)."]
        out.append("")
    out.append(MD_END)
    return "\n".join(out)


def write_markdown(path: Path, section: str, begin_marker: str = MD_BEGIN, end_marker: str = MD_END) -> None:
    """Replace the section between the markers in BENCHMARKS.md (or append it), leaving the rest as it is."""
    text = path.read_text() if path.exists() else MD_HEADER
    begin, end = text.find(begin_marker), text.find(end_marker)
    if begin != -1 and end > begin:
        text = text[:begin] + section + text[end + len(end_marker):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


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
    p.add_argument("--new-tokens", type=int, default=128)
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
        p.error("--rounds, --processes, --threads, --prompt-len must be >= 1 and --new-tokens >= 2")
    return args


def command_line(argv: list[str]) -> str:
    return show_cmd([sys.executable, str(Path(sys.argv[0]).resolve()), *argv])


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
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.plot)
    plot_ref = os.path.relpath(args.plot.resolve(), args.md.resolve().parent)
    section = markdown(results, plot_ref)
    print(section)
    if args.write_md:
        write_markdown(args.md, section)
        log(f"updated {rel(args.md)}")
    log(f"wrote {rel(json_path)} and {rel(args.plot)}")


if __name__ == "__main__":
    main()
