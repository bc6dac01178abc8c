"""The throughput benchmark's Markdown section for BENCHMARKS.md."""

from __future__ import annotations

from bench_static_peer import PEER

MD_BEGIN = "<!-- throughput:begin -->"
MD_END = "<!-- throughput:end -->"

def fmt_p(p: dict, digits: int = 0) -> str:
    from camshaft.runtime.throughput_report import fmt_percentiles

    return fmt_percentiles(p, f".{digits}f", sep=" / ")


def seconds(p_ms: dict) -> dict:
    return {k: None if x is None else x / 1000 for k, x in p_ms.items()}


def fmt_share(x: float | None) -> str:
    from camshaft.runtime.throughput_report import NO_DATA, fmt

    return NO_DATA if x is None else f"{fmt(100 * x, '.1f')} %"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def markdown(res: dict, plot_ref: str) -> str:
    cfg, m, cam, peer = res["config"], res["machine"], res["camshaft"], res["peer"]
    v = m["versions"]
    target = next(r for r in cam if r["concurrency"] == cfg["concurrency"])
    peer_t = next(p for p in peer if p["concurrency"] == cfg["concurrency"])
    idle = next((r for r in cam if r["concurrency"] == 1), None)
    peak = res["sgemm"]["peak_gflop_s"]
    cores = f"{m['logical_cores']} logical cores" + (f" ({m['physical_cores']} physical)" if m.get("physical_cores")
                                                      else "")
    out = [
        MD_BEGIN,
        "## Throughput: SmolLM2-135M-Instruct, in-flight batching, CPU",
        "",
        f"Machine: {m['cpu']}, {cores}, {m['memory_gb']} GB; Python {m['python']}, onnxruntime {v['onnxruntime']}, "
        f"torch {v['torch']}, transformers {v['transformers']}, camshaft {v['camshaft']}. {res['date']}.",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Workload: `{cfg['dataset']}` (seed {cfg['seed']}): {cfg['num_requests']} requests, prompts "
        f"{cfg['prompt_tokens_mean']:.0f} tokens on average ({cfg['prompt_tokens_min']}–{cfg['prompt_tokens_max']}), "
        f"outputs {cfg['output_tokens_mean']:.0f} ({cfg['output_tokens_min']}–{cfg['output_tokens_max']}), random "
        f"prompt ids, greedy, end id ignored, fp32, {cfg['threads']} threads for every system. camshaft: `LLM` on an "
        f"onnxruntime engine (max_seq_len {cfg['max_seq_len']}, batch {cfg['max_batch_size']}, "
        f"{cfg['max_num_tokens']} tokens a step, KV blocks of {cfg['kv_block_size']}), a closed-loop client that "
        "submits the first C requests at once and the next whenever one finishes. transformers: the same prompt ids, "
        "static batches of C requests in arrival order, left padding, each batch decoding until its longest request "
        "is done (a KV-cached `model(...)` + argmax loop), in a process of its own. TTFT counts from a request's "
        "submission (transformers: from its batch's start) to its first token; ITL = gaps between the steps that "
        "gave a request tokens; E2E = submission to last token. Output tok/s = all requests' output tokens / wall "
        "time of the run. Percentiles interpolate linearly between the nearest samples (numpy's default, as vLLM's "
        "benchmarks).",
        "",
        (f"Sweep points other than C = {cfg['concurrency']} run the first {cfg['sweep_num_requests']} requests of the "
         "same dataset (to bound the run time); the target point runs all of them." if "sweep_num_requests" in cfg else
         f"Every level runs the first {cfg['requests_per_slot']:g} × C requests of the same dataset (at least "
         f"{cfg.get('min_level_requests', 1)}, at most all of them), as many per slot as the target point (C = "
         f"{cfg['concurrency']}), so each sees the same mix of a first batch, requests joining a running one and a "
         "draining end; transformers runs the same requests at its levels."),
        "",
        "| system | C | requests | output tok/s | req/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
        "| E2E p50 / p90 / p99 s | peak KV | GFLOP/s | loop overhead |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(cam, key=lambda r: r["concurrency"]):
        o = r["python_overhead"]["all_steps"]
        e2e = seconds(r["e2e_ms"])
        out.append(f"| **camshaft** | {r['concurrency']} | {r['num_requests']} | {r['output_tok_s']:.1f} | "
                   f"{r['requests_s']:.3f} | {fmt_p(r['ttft_ms'])} | {fmt_p(r['itl_ms'], 1)} | {fmt_p(e2e, 1)} | "
                   f"{100 * r['peak_kv_usage']:.0f} % | {r['gflop_s']:.1f} | {fmt_share(o['outside_engine_step'])} |")
    for p in peer:
        e2e = seconds(p["e2e_ms"])
        out.append(f"| {PEER} | {p['concurrency']} | {p['num_requests']} | {p['output_tok_s']:.1f} | "
                   f"{p['requests_s']:.3f} | {fmt_p(p['ttft_ms'])} | {fmt_p(p['itl_ms'], 1)} | {fmt_p(e2e, 1)} | — | "
                   f"— | — |")
    g = target["gflop"]
    ov = target["python_overhead"]
    ob = ov.get(f"batch_{cfg['concurrency']}") or {}
    steps_of = f"{ob['steps']} steps" if ob.get("steps") else "all steps (none ran the whole batch)"
    ob = ob if ob.get("steps") else ov["all_steps"]
    ratio = target["output_tok_s"] / peer_t["output_tok_s"]
    out += [
        "",
        f"![throughput]({plot_ref})",
        "",
        f"### Against the targets (C = {cfg['concurrency']}, {cfg['num_requests']} requests)",
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| output tok/s ≥ 3× transformers | {target['output_tok_s']:.1f} / {peer_t['output_tok_s']:.1f} = "
        f"**{ratio:.2f}×** | {verdict(ratio >= 3)} |",
        f"| GFLOP/s ≥ 60 % of the fp32 matmul peak ({res['sgemm']['peak_shape']}) | {target['gflop_s']:.1f} / "
        f"{peak:.1f} = **{100 * target['gflop_s'] / peak:.0f} %** | {verdict(target['gflop_s'] >= 0.6 * peak)} |",
    ]
    blas = {k: v for k, v in res["sgemm"]["gflop_s"].items() if not k.startswith("onnxruntime")}
    if blas and peak > max(blas.values()):
        best = max(blas, key=blas.get)
        share = 100 * target["gflop_s"] / blas[best]
        out[-1] += (f"\n| (the same against the best torch/numpy matmul, {best}, the kind of peak the issue quotes) | "
                    f"{target['gflop_s']:.1f} / {blas[best]:.1f} = {share:.0f} % | — |")
    streamed = res.get("streamed")
    if streamed:
        out[-1] += (f"\n| (a decode step's ceiling: onnxruntime {streamed['rows']}-row matmuls over "
                    f"{streamed['weight_mb']} MB of distinct weights, each read from memory once, as the model's "
                    f"layers are) | {streamed['gflop_s']:.1f} GFLOP/s = {100 * streamed['gflop_s'] / peak:.0f} % of "
                    f"the peak ({streamed['gb_s']:.1f} GB/s of weights) | — |")
    join = target["ttft_joining_ms"]
    if idle and join.get("count"):
        jr = join["p50"] / idle["ttft_ms"]["p50"]
        out.append(f"| p50 TTFT joining a steady batch of {cfg['concurrency'] - 1} ≤ 2× idle TTFT | "
                   f"{join['p50']:.0f} ms ({join['count']} requests) / {idle['ttft_ms']['p50']:.0f} ms (C = 1) = "
                   f"**{jr:.2f}×** | {verdict(jr <= 2)} |")
    share = 100 * ob["outside_engine_step"]
    out.append(f"| Python overhead per step < 10 % at batch {cfg['concurrency']} | **{share:.1f} %**"
               f" outside `Engine.step` ({100 * ob['outside_model_call']:.1f} % outside the model call), "
               f"{steps_of} of {ob['iteration_ms']:.0f} ms | {verdict(ob['outside_engine_step'] < 0.1)} |")
    eq = res.get("greedy_equal")
    out += [
        "",
        f"What is counted. GFLOP/s = FLOPs of the run / its wall time, FLOPs = 2 × {res['linear_params'] / 1e6:.1f} M "
        f"layer matmul weights × {g['tokens_fed']} tokens fed (prompt + output − 1 per request: prefill and decode) "
        f"= {g['linear']:.0f} GFLOP, + 2 × {res['lm_head_params'] / 1e6:.1f} M LM-head weights × one logits row "
        f"per output token = {g['lm_head']:.0f} GFLOP, + attention 4 × heads × head_dim × context length per token "
        f"per layer (QKᵀ and PV) = {g['attention']:.0f} GFLOP; embeddings, norms, RoPE, softmax and activations are "
        f"not counted (without attention: {target['gflop_s_linear']:.1f} GFLOP/s). Matmul peak: fp32 ONNX Runtime "
        f"`MatMul` (the engine's kernel) and `torch.mm` on {res['sgemm']['threads']} threads and numpy `matmul` "
        f"(its BLAS on all {m['available_cores']} available cores), measured before and after camshaft's runs, "
        "median of 7 timings per shape, the better of the two per shape; the best shape counts: "
        + ", ".join(f"{k}: {x} GFLOP/s" for k, x in res["sgemm"]["gflop_s"].items()) + ".",
        "",
        "Loop overhead = the share of each batch-loop iteration (end of one `Engine.step` to the end of the next) "
        "spent outside `Engine.step` (scheduling, sampling, detokenizing, bookkeeping), median over iterations, "
        "timed by wrapping `Engine.step` and the backend call on the benchmark's engine; `Engine.step` itself also "
        "holds Python (`build_step`), so the share outside the model call is given too. Joining requests: those "
        f"after the first {cfg['concurrency']} whose prompt ran in a step beside {cfg['concurrency'] - 1} decoding "
        "others (not those that replaced requests finishing in the same step: they prefill together); idle TTFT: p50 "
        "at C = 1.",
        "",
    ]
    if eq:
        out += [f"Greedy outputs at C = {cfg['concurrency']}: {eq['equal']}/{eq['requests']} requests identical to "
                f"transformers', {100 * eq['prefix_share']:.1f} % of tokens before the first difference (fp32 "
                "batched kernels differ in summation order, so near-ties can flip).", ""]
    mem = res.get("memory")
    if mem:
        out += [
            "### Memory: requests admitted at once from one KV pool",
            "",
            f"One pool of {mem['pool_tokens']} tokens ({mem['pool_tokens'] // cfg['max_seq_len']} × max_seq_len "
            f"{cfg['max_seq_len']}); the first {mem['paged'][0]['requests']} requests of the workload submitted at "
            "once; peak requests running together (executor `peak_batch_size`) once admission settles.",
            "",
            "| KV layout | requests admitted at once | |",
            "|---|---|---|",
            f"| contiguous, max_seq_len reserved per request | {mem['contiguous']['peak_admitted']} | measured the "
            f"same way (the scheduler's `kv_reservation=\"contiguous\"`); pool_tokens // max_seq_len = "
            f"{mem['pool_tokens'] // cfg['max_seq_len']} |",
        ]
        for p in mem["paged"]:
            note = ("reserves prompt + max_tokens in blocks" if p["policy"] == "guaranteed_no_evict"
                    else "prompt blocks now, grows (preempts) later")
            times = p["peak_admitted"] / mem["contiguous"]["peak_admitted"]
            if p["peak_admitted"] >= p["requests"]:  # every request submitted ran: a floor, not paging's limit
                note += f"; all {p['requests']} submitted ran at once, so paging may admit more"
            out.append(f"| paged, `{p['policy']}` | **{p['peak_admitted']}** ({times:.1f}×) "
                       f"| {note}; peak KV use {100 * p['peak_kv_usage']:.0f} % |")
        out.append("")
    out.append(f"Load: the 1-minute load average was {res['load'][0]:.2f} before and {res['load'][1]:.2f} after "
               f"(this benchmark alone accounts for about {cfg['threads']}; more means other work shared the cores).")
    out += ["", MD_END]
    return "\n".join(out)
