"""The latency benchmark's plot and Markdown section for BENCHMARKS.md."""

from __future__ import annotations

from pathlib import Path

from bench_common import PAUSE_S
from bench_systems import CAMSHAFT

from camshaft.runtime.throughput_plot import save_figure

MD_BEGIN = "<!-- latency:begin -->"
MD_END = "<!-- latency:end -->"

PIECE_LABELS = {
    "prepare": "inputs: the token and lengths written into the {n} bound input buffers (`SequenceEngine.prepare`)",
    "run": "`InferenceSession.run_with_iobinding` (the sequence graph)",
    "sample": "sampling: `SequenceSampler.sample` (greedy argmax)",
    "detokenize": "detokenizing: `TextStream.append`",
}


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
        "processes in turn; their mean time), each round in its own seeded order (a rotation would give every "
        "system the same predecessor). "
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
            what = ("of weights (the fp32 layers and the head's int8 screen: a certified greedy step reads no more "
                    "of the float head than its 64 best rows)" if bd.get("screened_head") else "of fp32 weights")
            out += ["", f"The model call reads the {bd['weight_bytes'] / 1e6:.0f} MB {what} once per "
                    f"step: {bd['weight_bytes_per_run_gb_s']} GB/s of weights per `run_with_iobinding`. Everything "
                    f"outside the model call costs "
                    f"{total - bd['pieces_ms']['run']:.3f} ms a step "
                    f"({100 * (total - bd['pieces_ms']['run']) / total:.1f} %)."]
        out.append("")
    out.append(MD_END)
    return "\n".join(out)
