"""Does a request decode the same batched, or with prompt-lookup drafts, as alone? Greedy replies to 8 chat prompts
(a shared ~60-token system message, 64 tokens each, end id ignored) on each engine given: one at a time through
`Session(graph="batch")`, all at once through `LLM`, and one at a time with `prompt_lookup=4`. Prints, per engine,
how many replies diverge from the one-at-a-time run and the top-2 log-prob margin at each first difference (a
margin near 0 is a near-tie that float rounding may flip; a large one is a real change of the computation).

    .venv/bin/python scripts/probe_batch_invariance.py ENGINE_DIR [ENGINE_DIR ...]
"""

from __future__ import annotations

import argparse

from camshaft import LLM, SamplingParams
from camshaft.runtime.outputs import GenerationResult
from camshaft.runtime.session import Session

SYSTEM = ("You are a helpful assistant. Answer concisely and accurately, and explain your reasoning step by step "
          "when the question asks for it. ") * 2
QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn leaves.", "Explain how a hash table works.",
             "List three prime numbers greater than 100.", "Translate 'good morning' into Spanish and German.",
             "Summarize the plot of Romeo and Juliet in two sentences.", "What is 17 times 23?",
             "Give me a Python function that reverses a string."]
TOKENS = 64


def divergences(got: list[GenerationResult], alone: list[GenerationResult]) -> list[tuple[int, float] | None]:
    """Per reply: None where equal, else (first differing position, the alone run's top-2 margin there)."""
    found = []
    for g, a in zip(got, alone, strict=True):
        at = next((i for i, (x, y) in enumerate(zip(g.token_ids, a.token_ids, strict=True)) if x != y), None)
        if at is None:
            found.append(None)
            continue
        top = a.logprobs[at].top_logprobs
        found.append((at, top[0][1] - top[1][1]))
    return found


def describe(name: str, found: list[tuple[int, float] | None]) -> str:
    margins = sorted(m for _, m in filter(None, found))
    spread = f", margins {margins[0]:.3g}-{margins[-1]:.3g}" if margins else ""
    return f"{name}: {sum(f is not None for f in found)} of {len(found)} diverge{spread}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="+")
    args = p.parse_args()
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    for engine in args.engines:
        with Session(engine, graph="batch") as session:
            prompts = [session.encode(messages=[{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": q}]) for q in QUESTIONS]
            alone = [session.generate(p, params) for p in prompts]
        with Session(engine, graph="batch", prompt_lookup=4) as session:
            drafted = [session.generate(p, params) for p in prompts]
        with LLM(engine) as llm:
            batched = [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]
        print(f"{engine} ({len(prompts[0])} prompt tokens in the first)")
        print("  " + describe("batched vs alone", divergences(batched, alone)))
        print("  " + describe("prompt lookup vs without", divergences(drafted, alone)), flush=True)


if __name__ == "__main__":
    main()
