"""The LLM API servers build on: per-token outputs with log-probs, n outputs streamed together, a bounded queue
that refuses with ServerBusyError, and a load snapshot that returns to empty."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import ServerBusyError
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving_api")
    model = make_tiny_model("llama", root / "hf")
    build_engine(BuildConfig(model, root / "engine", max_seq_len=256, max_num_tokens=64, max_batch_size=4))
    return root / "engine"


async def _collect(llm: LLM, prompt, params):
    outputs = {}
    async for index, output in llm.stream_outputs(prompt, params):
        outputs.setdefault(index, []).append(output)
    return outputs


def test_stream_outputs_carry_every_token_and_its_logprobs(engine_dir):
    prompt = [5, 9, 17, 33, 2, 41]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    expected = Session(engine_dir).generate(prompt, params)
    with LLM(engine_dir) as llm:
        outputs = asyncio.run(_collect(llm, prompt, params))[0]
        assert llm.load().running == 0 and llm.load().kv_blocks_used == 0
    assert [t for o in outputs for t in o.token_ids] == expected.token_ids
    assert [s.logprob for o in outputs for s in o.logprobs] == pytest.approx([s.logprob for s in expected.logprobs],
                                                                             abs=1e-5)  # two graphs
    assert "".join(o.delta for o in outputs) == expected.text
    assert outputs[-1].finished and outputs[-1].result.token_ids == expected.token_ids
    assert all(not o.finished for o in outputs[:-1])


def test_n_outputs_stream_with_their_index(engine_dir):
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3, n=3)
    with LLM(engine_dir) as llm:
        outputs = asyncio.run(_collect(llm, [7, 8, 9, 10], params))
        reference = llm.generate([[7, 8, 9, 10]], params, use_tqdm=False)[0]
    assert sorted(outputs) == [0, 1, 2]
    streamed = [[t for o in outputs[i] for t in o.token_ids] for i in range(3)]
    assert streamed == [r.token_ids for r in reference.outputs]


def test_a_full_queue_refuses_with_server_busy_and_recovers(engine_dir):
    release = threading.Event()
    with LLM(engine_dir, max_batch_size=2, max_queue=1) as llm:
        step = llm.engine.step
        llm.engine.step = lambda chunks: (release.wait(), step(chunks))[1]
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        done = []
        ids = [llm.submit([3, 4, 5], params, lambda o: o.finished and done.append(o)) for _ in range(3)]
        with pytest.raises(ServerBusyError, match="server busy"):
            llm.submit([3, 4, 5], params, lambda o: None)
        load = llm.load()
        assert load.running + load.waiting == 3
        llm.abort(ids[2][0])
        release.set()
        for _ in range(200):
            if len(done) == 3:
                break
            threading.Event().wait(0.05)
        assert sorted(o.result.finish_reason for o in done) == ["abort", "length", "length"]
        assert llm.load().kv_blocks_used == 0 and llm.load().waiting == 0
        llm.submit([3, 4, 5], params, lambda o: None)  # room again


def test_abort_by_the_prompt_id_stops_all_its_outputs(engine_dir):
    release = threading.Event()
    with LLM(engine_dir, max_batch_size=2) as llm:
        step = llm.engine.step
        llm.engine.step = lambda chunks: (release.wait(), step(chunks))[1]
        finals: queue.SimpleQueue = queue.SimpleQueue()
        sink = lambda o: o.finished and finals.put(o)  # noqa: E731
        params = SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True)
        ids = llm.submit([3, 4, 5], params, sink)  # one running, two held until a place frees
        other = llm.submit([6, 7], SamplingParams(max_tokens=3, ignore_eos=True), sink)
        assert len({i.rsplit("-", 1)[0] for i in ids}) == 1 and ids[0].rsplit("-", 1)[0] not in other
        llm.abort(ids[0].rsplit("-", 1)[0])
        release.set()
        ended = {o.request_id: o.result.finish_reason for o in (finals.get(timeout=60) for _ in range(4))}
        assert ended == {**dict.fromkeys(ids, "abort"), other[0]: "length"}
        assert llm.load().kv_blocks_used == 0
        prompt_output = llm.generate([3, 4], SamplingParams(n=2, temperature=1.0, max_tokens=2), use_tqdm=False)[0]
        assert prompt_output.request_id and len(prompt_output.outputs) == 2
        llm.abort([prompt_output.request_id, "no-such-id"])  # finished or unknown ids are ignored


def test_closing_finishes_every_request_queued_held_or_running(engine_dir):
    from camshaft.errors import ServerClosedError

    release = threading.Event()
    llm = LLM(engine_dir, max_batch_size=2)
    step = llm.engine.step
    llm.engine.step = lambda chunks: (release.wait(), step(chunks))[1]
    finals = []
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=1, n=4)  # 3 siblings held
    for prompt in ([5] * 100, [6] * 20, [7] * 20):  # more than the batch: some stay queued
        llm.submit(prompt, params, lambda o: o.finished and finals.append(o))
    closer = threading.Thread(target=llm.close)
    closer.start()
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert len(finals) == 12 and len({o.request_id for o in finals}) == 12
    assert all(isinstance(o.error, ServerClosedError) or o.result is not None for o in finals)
    with pytest.raises(ServerClosedError, match="create a new LLM"):
        llm.submit([3], params, lambda o: None)


def test_results_read_as_vllms_and_a_closed_async_stream_aborts_at_once(engine_dir):
    """PromptOutput.prompt (text given, a chat's rendered text, None for ids), finished, each output's index;
    get_tokenizer; a chat error names its conversation; closing llm.stream's iterator aborts the request before
    the event loop turns again (its KV blocks freed within a step)."""
    import time

    from camshaft.errors import RequestError

    with LLM(engine_dir, max_batch_size=4) as llm:
        outs = llm.generate(["hi", [5, 6, 7], {"prompt": "x y"}],
                            SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3), use_tqdm=False)
        assert [o.prompt for o in outs] == ["hi", None, "x y"] and all(o.finished for o in outs)
        assert [[c.index for c in o.outputs] for o in outs] == [[0, 1]] * 3
        assert llm.get_tokenizer() is llm.tokenizer
        chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert chat.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # the template's text
        with pytest.raises(RequestError, match="conversation 1: chat message 0"):
            llm.chat([[{"role": "user", "content": "hi"}], ["x"]])

        step = llm.engine.step
        llm.engine.step = lambda chunks: time.sleep(0.02) or step(chunks)  # 200 tokens take 4 s or more

        async def first_delta_then_close() -> None:
            stream = llm.stream("hello", SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in stream:
                break
            await stream.aclose()
            deadline = time.monotonic() + 2.0  # blocking: the event loop does not turn; well before 200 tokens
            while llm.load().kv_blocks_used and time.monotonic() < deadline:
                time.sleep(0.01)
            assert llm.load().kv_blocks_used == 0 and llm.load().running == 0

        asyncio.run(first_delta_then_close())


def test_submit_batch_queues_every_prompt_or_none(engine_dir):
    """One prompt the executor refuses (longer than the engine allows) refuses the batch before any prompt runs;
    a good batch runs each prompt as submit would."""
    from camshaft.errors import CapacityError

    with LLM(engine_dir) as llm:
        finals: queue.SimpleQueue = queue.SimpleQueue()
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        too_long = SamplingParams(max_tokens=llm.config.max_seq_len, ignore_eos=True)
        with pytest.raises(CapacityError, match="max_seq_len"):
            llm.submit_batch([([5, 6], params, finals.put), ([7, 8], too_long, finals.put)])
        assert llm.executor.steps_done == 0 and llm.load().running == llm.load().waiting == 0 and finals.empty()
        ids = llm.submit_batch([([5, 6], params, lambda o: o.finished and finals.put(o)),
                                ([7, 8], params, lambda o: o.finished and finals.put(o))])
        outputs = {o.request_id: o for o in (finals.get(timeout=30) for _ in ids)}
        assert sorted(outputs) == sorted(i for group in ids for i in group)
        assert all(len(o.result.token_ids) == 4 for o in outputs.values())
