"""SmolLM2-135M-Instruct end to end: greedy tokens and perplexity equal transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from camshaft.runtime.batch import Chunk
from camshaft.runtime.engine import Engine
from camshaft.runtime.session import Session

pytestmark = pytest.mark.slow

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [{"role": "user", "content": "def fibonacci(n):"}],
]
TEXT = (
    "The Python standard library is very extensive, offering a wide range of facilities. The library contains "
    "built-in modules (written in C) that provide access to system functionality such as file I/O that would "
    "otherwise be inaccessible to Python programmers, as well as modules written in Python that provide "
    "standardized solutions for many problems that occur in everyday programming. Some of these modules are "
    "explicitly designed to encourage and enhance the portability of Python programs by abstracting away "
    "platform-specifics into platform-neutral APIs."
)


def reference_greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, per step, its top-2 logit margin."""
    tokens, margins, past = [], [], None
    feed = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            out = model(feed, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            top2 = torch.topk(logits, 2).values
            tokens.append(int(logits.argmax()))
            margins.append(float(top2[0] - top2[1]))
            feed = torch.tensor([[tokens[-1]]])
    return tokens, margins


def engine_greedy(engine: Engine, ids: list[int], steps: int) -> list[int]:
    blocks = engine.pool.allocate(-(-(len(ids) + steps) // engine.block_size))
    try:
        logits = engine.step([Chunk(ids, 0, blocks)])
        tokens = []
        for pos in range(len(ids), len(ids) + steps):
            tokens.append(int(logits[0].argmax()))
            logits = engine.step([Chunk([tokens[-1]], pos, blocks)])
        return tokens
    finally:
        engine.pool.free(blocks)


@pytest.fixture(scope="module")
def references(smollm2_engine, smollm2_reference) -> dict[int, tuple[list[int], list[int], list[float]]]:
    """Per prompt: its ids, transformers' 64 greedy tokens and their top-2 margins."""
    session = Session(smollm2_engine, graph="sequence")
    out = {}
    for i, messages in enumerate(PROMPTS):
        ids = session.encode(messages=messages)
        out[i] = (ids, *reference_greedy(smollm2_reference, ids, 64))
    session.close()
    return out


def assert_same_greedy(actual: list[int], expected: list[int], margins: list[float]) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if a != e:
            assert margins[step] < 1e-4, f"diverged at step {step} where transformers' top-2 margin is {margins[step]}"
            break


@pytest.mark.parametrize("prompt", range(len(PROMPTS)), ids=["france", "haiku", "primes", "code"])
def test_greedy_tokens_equal_transformers(smollm2_engine, references, prompt):
    ids, expected, margins = references[prompt]
    assert_same_greedy(engine_greedy(Engine(smollm2_engine), ids, 64), expected, margins)


def test_session_greedy_tokens_equal_transformers(smollm2_engine, references):
    """The path `camshaft run` and Session take: the sequence graph, through generate (chat encoding included)."""
    session = Session(smollm2_engine)
    assert session.graph == "sequence"
    for prompt, messages in enumerate(PROMPTS):
        ids, expected, margins = references[prompt]
        result = session.chat(messages, max_tokens=64, ignore_eos=True)
        assert result.prompt_token_ids == ids
        assert_same_greedy(result.token_ids, expected, margins)
    session.close()


def test_perplexity_equals_transformers(smollm2_engine, smollm2_reference):
    engine = Engine(smollm2_engine)
    ids = engine.tokenizer(TEXT)["input_ids"]
    assert len(ids) > 64
    blocks = engine.pool.allocate(-(-len(ids) // engine.block_size))
    logits = engine.step([Chunk(ids, 0, blocks, num_logits=len(ids))])
    engine.pool.free(blocks)
    with torch.no_grad():
        ref = smollm2_reference(torch.tensor([ids])).logits[0].numpy()

    def ppl(scores: np.ndarray) -> float:
        x = scores[:-1].astype(np.float64)
        logz = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
        nll = logz - x[np.arange(len(x)), ids[1:]]
        return float(np.exp(nll.mean()))

    ours, theirs = ppl(logits), ppl(ref)
    assert abs(ours - theirs) / theirs < 1e-3, (ours, theirs)
    assert 1.5 < theirs < 100  # the reference itself is a sane language model on English text


@pytest.mark.parametrize("graph", ["sequence", "batch"])
def test_closing_a_session_gives_its_memory_back(smollm2_engine, graph):
    """glibc keeps the heap an engine freed: a closed Session left the process ~500 MB larger (RSS), and each
    load/close cycle of the batch graph more. In a process of its own, as a user's would be."""
    import subprocess
    import sys

    script = ("import gc, sys, psutil\nfrom camshaft import Session\nrss = lambda: psutil.Process().memory_info().rss\n"
              "before = rss()\nfor _ in range(2):\n    s = Session(sys.argv[1], graph=sys.argv[2])\n"
              "    s.generate([1, 2, 3], max_tokens=2)\n    loaded = rss()\n    s.close()\n    del s\n"
              "    gc.collect()\n"
              "print(before, loaded, rss())\n")
    done = subprocess.run([sys.executable, "-c", script, str(smollm2_engine), graph], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    before, loaded, closed = map(int, done.stdout.split())
    assert loaded - before > 300e6 and closed - before < 0.3 * (loaded - before), (before, loaded, closed)
