#!/usr/bin/env python
"""Batch-1 decode of quantized engines against the int4 peers, interleaved rounds, processes of their own.

Engines are given as NAME=ENGINE_DIR[@OPTION,...] (e.g. `--lm-head` float vs int4 vs int8, `--weight-only-compute`
float vs int8; options: `batch`, the Session on the engine's batch graph instead of its sequence graph; `small-pages`,
the Session with `huge_pages=False`); peers: an onnxruntime-genai model directory (--ortgenai) and llama.cpp on a
GGUF file through llama-cpp-python (--llamacpp). Each system runs in --processes processes of its own; each round
runs every system once (each of its processes in turn, their mean time) in a shuffled order (seeded per round: a
rotation would give every system the same predecessor each round); decode tok/s medians and per-round ratios to the
first engine are printed (the machine is shared: compare ratios). Reuses the systems of scripts/bench_systems.py.

    .venv/bin/python scripts/bench_quant_decode.py float=out/q/head-float-engine int4=out/q/head-int4-engine \
        int8=out/q/head-int8-engine --ortgenai out/q/ortgenai-int4 --llamacpp SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_builds import set_ortgenai_threads  # noqa: E402
from bench_common import PAUSE_S  # noqa: E402
from bench_systems import CamshaftSystem, OrtGenaiSystem, Replicas, summarize_run  # noqa: E402

from camshaft.runtime.bench import benchmark_prompt  # noqa: E402


class LlamaCppSystem:
    """llama.cpp through llama-cpp-python on a GGUF file: greedy, the same prompt ids (the GGUF carries the same
    tokenizer), one context reset per run."""

    def __init__(self, gguf: Path, prompt: list[int], new_tokens: int, threads: int) -> None:
        from llama_cpp import Llama

        self.name = f"llama.cpp {gguf.stem.rsplit('.', 1)[-1]}"
        self.llm = Llama(model_path=str(gguf), n_ctx=len(prompt) + new_tokens + 16, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.prompt, self.new_tokens = prompt, new_tokens

    def run(self) -> dict:
        ids: list[int] = []
        start = time.perf_counter()
        first = start
        self.llm.reset()  # generate(reset=True) keeps a matching prefix: the prompt would not be evaluated again
        for token in self.llm.generate(self.prompt, top_k=1, temp=0.0, reset=True):
            if not ids:
                first = time.perf_counter()
            ids.append(int(token))
            if len(ids) == self.new_tokens:
                break
        end = time.perf_counter()
        return {"ttft_s": first - start, "total_s": end - start, "token_ids": ids}


class Named:
    """A system under another name (built in its own process by Isolated)."""

    def __init__(self, name: str, make, *args, **kwargs) -> None:
        self.system = make(*args, **kwargs)
        self.name = name

    def run(self) -> dict:
        return self.system.run()


def ortgenai_format(model_dir: Path) -> str:
    """What the peer's graph computes with, read from the graph (its builder ignores options it does not know)."""
    import onnx

    kinds = set()
    for node in onnx.load(str(model_dir / "model.onnx"), load_external_data=False).graph.node:
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
            kinds.add(f"{'embedding' if node.op_type == 'GatherBlockQuantized' else 'matmuls'} int{a.get('bits', 4)} "
                      f"block {a['block_size']}" + (f" accuracy level {a['accuracy_level']}"
                                                   if "accuracy_level" in a else ""))
    return "; ".join(sorted(kinds)) or "float"


def llamacpp_perplexity(gguf: Path, text_file: Path, engine_dir: Path) -> float:
    """llama.cpp on the whole text at once (one window), tokenized as `camshaft eval ppl` does."""
    import math

    import numpy as np
    from llama_cpp import Llama

    from camshaft.runtime.engine import Engine
    from camshaft.runtime.perplexity import _nll, read_text

    ids = Engine(engine_dir, max_sequences=1).tokenizer(read_text(text_file))["input_ids"]
    llm = Llama(model_path=str(gguf), n_ctx=len(ids) + 8, n_batch=512, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float32)
    return math.exp(_nll(logits, ids[1:]) / (len(ids) - 1))


def pairs_dir(args) -> Path:
    return Path(args.engines[0].split("=", 1)[1])


def ortgenai_perplexity(model_dir: Path, text_file: Path, engine_dir: Path) -> float:
    """The peer's model run by ONNX Runtime on the whole text at once, tokenized as `camshaft eval ppl` does."""
    import math

    import numpy as np
    import onnxruntime as ort

    from camshaft.runtime.engine import Engine
    from camshaft.runtime.perplexity import _nll, read_text

    ids = Engine(engine_dir, max_sequences=1).tokenizer(read_text(text_file))["input_ids"]
    session = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    head_size = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, i.shape[1], 0, head_size), np.float32)
    logits = session.run(["logits"], feeds)[0][0, :-1]
    return math.exp(_nll(logits, ids[1:]) / (len(ids) - 1))


def head_kernels(vocab: int, hidden: int, threads: int, rounds: int = 7, calls: int = 50) -> None:
    """The head's product alone for one token ([1, hidden] @ [hidden, vocab]) in ONNX Runtime, as each --lm-head
    builds it (int4 in blocks of 64, and of 32 as before 2026-12-05; int8 per row; random weights: time does not
    depend on values); interleaved rounds, medians in ms."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    row_block = next(b for b in (128, 64, 32, 16) if hidden % b == 0)  # int8 per row: scales repeated per block

    def session(bits: int | None, level: int, block: int = row_block) -> ort.InferenceSession:
        if bits is None:
            inits = [numpy_helper.from_array(rng.standard_normal((vocab, hidden)).astype(np.float32), "w")]
            node = helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)
        else:
            packed = rng.integers(0, 255, (vocab, hidden // block, block * bits // 8), dtype=np.uint8)
            inits = [numpy_helper.from_array(packed, "q"),
                     numpy_helper.from_array(rng.random(vocab * hidden // block).astype(np.float32), "s")]
            node = helper.make_node("MatMulNBits", ["x", "q", "s"], ["y"], domain="com.microsoft", K=hidden,
                                    N=vocab, bits=bits, block_size=block, accuracy_level=level)
        graph = helper.make_graph([node], "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, vocab])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    kernels = {"float (Gemm)": (None, 0), "int4 blocks of 64, accuracy level 0": (4, 0, 64),
               "int4 blocks of 64, accuracy level 4": (4, 4, 64), "int4 blocks of 32, accuracy level 4": (4, 4, 32),
               "int8, accuracy level 0": (8, 0), "int8, accuracy level 4": (8, 4)}
    sessions = {name: session(*spec) for name, spec in kernels.items()}
    x = {"x": rng.standard_normal((1, hidden)).astype(np.float32)}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, sess in sessions.items():
            sess.run(None, x)
            n = 3 if "int8, accuracy level 0" in name else calls  # that kernel takes ~0.15 s a call
            start = time.perf_counter()
            for _ in range(n):
                sess.run(None, x)
            times[name].append((time.perf_counter() - start) / n * 1e3)
    print(f"\n| head product alone, [1, {hidden}] x [{hidden}, {vocab}] | ms a token (median) |")
    print("|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engines", nargs="+", help="NAME=ENGINE_DIR; the first is the baseline of the ratios")
    parser.add_argument("--ortgenai", type=Path, help="onnxruntime-genai model directory (a peer)")
    parser.add_argument("--llamacpp", type=Path, help="GGUF file for llama.cpp through llama-cpp-python (a peer)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", dest="new_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=1,
                        help="processes per system, each run once a round (memory placement differs per process)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--ppl-text", type=Path, help="also the peers' perplexity on this text (one window)")
    parser.add_argument("--kernels", action="store_true", help="also time the head's product alone per format")
    args = parser.parse_args()
    if args.ppl_text is not None and args.ortgenai is not None:
        ppl = ortgenai_perplexity(args.ortgenai, args.ppl_text, pairs_dir(args))
        print(f"onnxruntime-genai int4 perplexity: {ppl:.4f}")
    if args.ppl_text is not None and args.llamacpp is not None:
        ppl = llamacpp_perplexity(args.llamacpp, args.ppl_text, pairs_dir(args))
        print(f"llama.cpp {args.llamacpp.name} perplexity: {ppl:.4f}")
    pairs = [spec.split("=", 1) for spec in args.engines]
    from camshaft.manifest import read_manifest

    prompt = benchmark_prompt(read_manifest(pairs[0][1]).model.vocab_size, args.prompt_len)
    systems = []  # each in --processes processes of its own (bench_systems.Replicas)
    for name, spec in pairs:
        engine_dir, _, options = spec.partition("@")
        unknown = set(filter(None, options.split(","))) - {"batch", "small-pages"}
        if unknown:
            parser.error(f"unknown engine option(s) {', '.join(sorted(unknown))} in {spec!r}; use batch, small-pages")
        systems.append(Replicas(args.processes, Named, name, CamshaftSystem, Path(engine_dir), prompt,
                                args.new_tokens, args.threads, graph="batch" if "batch" in options else "auto",
                                huge_pages="small-pages" not in options))
    if args.ortgenai is not None:
        set_ortgenai_threads(args.ortgenai, args.threads)
        systems.append(Replicas(args.processes, Named, f"onnxruntime-genai ({ortgenai_format(args.ortgenai)})",
                                OrtGenaiSystem, args.ortgenai, prompt, args.new_tokens))
    if args.llamacpp is not None:
        systems.append(Replicas(args.processes, LlamaCppSystem, args.llamacpp, prompt, args.new_tokens, args.threads))
    for system in systems:
        system.run()
    rates: dict[str, list[float]] = {s.name: [] for s in systems}
    loads = []
    for r in range(args.rounds):
        order = random.Random(r).sample(systems, len(systems))  # each round its own order and predecessors
        for system in order:
            time.sleep(PAUSE_S)
            rates[system.name].append(summarize_run(system.run(), args.prompt_len)["decode_tok_s"])
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{s.name} {rates[s.name][-1]:.1f}" for s in systems)
              + f" tok/s; load {loads[-1]:.2f}", file=sys.stderr)
    base = rates[systems[0].name]
    print(f"| system | decode tok/s (median, min–max) | ratio to {systems[0].name} (median of rounds) |")
    print("|---|---|---|")
    for system in systems:
        values = rates[system.name]
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"| {system.name} | {statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f}) | "
              f"{ratio:.2f} |")
    peers = systems[len(pairs):]
    if peers:
        print("\n| camshaft engine | " + " | ".join(f"÷ {p.name} (median of rounds, min–max)" for p in peers) + " |")
        print("|---" * (1 + len(peers)) + "|")
        for system in systems[:len(pairs)]:
            cells = []
            for peer in peers:
                r = [v / b for v, b in zip(rates[system.name], rates[peer.name], strict=True)]
                cells.append(f"{statistics.median(r):.2f}× ({min(r):.2f}–{max(r):.2f})")
            print(f"| {system.name} | " + " | ".join(cells) + " |")
    for system in systems:
        system.close()
    if args.kernels:
        model = read_manifest(pairs[0][1]).model
        head_kernels(model.vocab_size, model.hidden_size, args.threads)
    print(f"\n{args.rounds} rounds × {args.processes} process(es) per system, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, "
          f"{args.threads} threads; 1-minute load {min(loads):.2f}–{max(loads):.2f}")


if __name__ == "__main__":
    main()
