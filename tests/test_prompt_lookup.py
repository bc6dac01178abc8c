"""Prompt lookup decoding: drafts come from the latest earlier occurrence of the sequence's last tokens, the engine
checks several in one step (the tokens passed to it are asserted), and the output equals decoding without drafts —
greedy, seeded sampling, penalties, stop strings, grammars, log-probs — on both graphs."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from camshaft.cli import app
from camshaft.errors import EngineError, RequestError, ServerClosedError
from camshaft.runtime.guided import GuidedDecodingParams
from camshaft.runtime.prompt_lookup import PromptLookup
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session

from tiny_models import stamped, tiny_engine

PROMPTS = ["The cat sat on the mat. The cat sat on the", "abc abc abc abc abc", "one two three one two three one"]
PARAMS = [dict(temperature=0), dict(temperature=0.9, seed=7), dict(temperature=0.7, top_k=20, top_p=0.9, seed=1),
          dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.5), dict(temperature=0, stop=["ca", "e t"]),
          dict(temperature=0, logprobs=3), dict(temperature=0, min_tokens=40, max_tokens=41),
          dict(temperature=0, guided_decoding=GuidedDecodingParams(regex="(ab ){3,12}c"))]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("lookup"), max_seq_len=256, max_num_tokens=64)


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_tail():
    lookup = PromptLookup(num_tokens=3, max_ngram=2, min_ngram=1)
    assert lookup.propose([1, 2, 3, 9, 1, 2, 4, 5, 6, 1, 2], 10) == [4, 5, 6]  # "1 2" last seen before 4 5 6
    assert lookup.propose([7, 8, 5, 9, 8, 6, 6, 8], 10) == [6, 6, 8]  # "6 8" unseen: "8", latest with 3 after it
    assert lookup.propose([7, 8, 5, 9, 8, 6, 6, 8], 1) == [6]
    assert lookup.propose([1, 2, 3, 4], 10) == [] and lookup.propose([5], 4) == []
    assert PromptLookup(num_tokens=2, min_ngram=2).propose([3, 1, 4, 1], 5) == []  # only a one-token match
    assert lookup.propose([1, 2, 1, 2], 10) == [1, 2]  # the match runs to the end: what there is
    for bad in (dict(num_tokens=0), dict(num_tokens=17), dict(min_ngram=3, max_ngram=2), dict(num_tokens=2.0)):
        with pytest.raises(RequestError, match="PromptLookup"):
            PromptLookup(**bad)


@pytest.mark.parametrize("graph", ["sequence", "batch"])
def test_the_output_is_the_same_with_drafts_and_the_engine_checks_several_a_step(engine_dir, graph):
    plain, drafting = Session(engine_dir, graph=graph), Session(engine_dir, graph=graph, prompt_lookup=PromptLookup())
    feeds: list[int] = []
    feed_rows = drafting.engine.feed_rows
    drafting.engine.feed_rows = lambda tokens, start, rows: feeds.append(rows) or feed_rows(tokens, start, rows)
    with plain, drafting:
        for prompt in PROMPTS:
            for options in PARAMS:
                params = SamplingParams(**{"max_tokens": 80, **options})
                expected, got = plain.generate(prompt, params), drafting.generate(prompt, params)
                assert got.token_ids == expected.token_ids, (prompt, options)
                assert got.text == expected.text and got.finish_reason == expected.finish_reason
                assert got.stop_reason == expected.stop_reason
                if options.get("logprobs"):
                    for a, b in zip(got.logprobs, expected.logprobs, strict=True):
                        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
                        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            streamed = drafting.stream(prompt, max_tokens=60)
            deltas = []
            while True:
                try:
                    deltas.append(next(streamed))
                except StopIteration as done:
                    assert "".join(deltas) == done.value.text == plain.generate(prompt, max_tokens=60).text
                    break
    assert max(feeds) > 1 and 0 < drafting.accepted_draft_tokens <= drafting.draft_tokens
    assert sum(rows - 1 for rows in feeds) == drafting.draft_tokens  # every draft was checked by the engine


def test_a_repeating_output_takes_fewer_engine_steps(engine_dir):
    with Session(engine_dir, prompt_lookup=PromptLookup(num_tokens=8)) as session:
        steps = []
        feed_rows = session.engine.feed_rows
        session.engine.feed_rows = lambda tokens, start, rows: rows == len(tokens) and steps.append(tokens) \
            or feed_rows(tokens, start, rows)
        result = session.generate("abc abc abc abc abc abc", max_tokens=120, temperature=0, ignore_eos=True)
    # after the prompt's token, each step gives its token and the drafts taken
    assert len(result.token_ids) - 1 == len(steps) + session.accepted_draft_tokens
    assert session.accepted_draft_tokens > len(steps) and max(map(len, steps)) == 9
    metrics = result.metrics  # the request's own count, as return_perf_metrics reports it
    assert (metrics.draft_tokens, metrics.accepted_draft_tokens) == (sum(len(s) - 1 for s in steps),
                                                                     session.accepted_draft_tokens)
    assert metrics.kv_blocks_total == 0  # a Session's cache is not the batcher's pool


def test_an_engine_that_cannot_check_drafts_is_refused_and_so_are_bad_settings(engine_dir, tmp_path):
    import json
    import shutil

    for bad in (4.0, "4", True):
        with pytest.raises(RequestError, match="prompt_lookup takes a camshaft.PromptLookup or its num_tokens"):
            Session(engine_dir, prompt_lookup=bad)
    with Session(engine_dir, prompt_lookup=4) as by_number, Session(engine_dir, prompt_lookup=0) as off:
        assert by_number.prompt_lookup == PromptLookup(num_tokens=4) and off.prompt_lookup is None
    with Session(engine_dir) as session:
        assert session.engine.max_rows > 1
        session.engine.max_rows = 1  # as an engine built before prompt lookup reads
        session.engine.start(16)
        with pytest.raises(EngineError, match="gives 1 to 1"):
            session.engine.feed_rows([5, 6], 0, 2)
    older = tmp_path / "older"  # its manifest as engines built before prompt lookup wrote it
    shutil.copytree(engine_dir, older)
    raw = json.loads((older / "manifest.json").read_text())
    raw["sequence_graph"]["inputs"] = [t for t in raw["sequence_graph"]["inputs"] if t["name"] != "num_logits"]
    (older / "manifest.json").write_text(json.dumps(stamped(raw)))
    with pytest.raises(EngineError, match='one token a step, so it cannot check drafts; .*graph="batch"'):
        Session(older, prompt_lookup=PromptLookup())
    old_cli = CliRunner().invoke(app, ["run", "--engine", str(older), "--prompt", "x", "--prompt-lookup", "4"])
    assert "rebuild it with this camshaft for --prompt-lookup" in str(old_cli.exception)
    with Session(older, graph="batch", prompt_lookup=PromptLookup()) as batch, Session(engine_dir) as plain:
        assert batch.generate("abc abc abc", max_tokens=30).token_ids == \
            plain.generate("abc abc abc", max_tokens=30).token_ids
    result = CliRunner().invoke(app, ["run", "--engine", str(engine_dir), "--prompt", "abc abc abc", "--max-tokens",
                                      "20", "--prompt-lookup", "4"])
    assert result.exit_code == 0 and "drafts " in result.output and "taken" in result.output, result.output
    with Session(engine_dir) as plain:
        assert result.output.splitlines()[0] == plain.generate("abc abc abc", max_tokens=20).text.splitlines()[0]
    refused = CliRunner().invoke(app, ["run", "--engine", str(engine_dir), "--prompt", "x", "--prompt-lookup", "17"])
    assert refused.exit_code == 2 and "--prompt-lookup" in refused.output


def test_a_step_keeps_to_the_engines_token_budget_and_close_ends_a_stream(tmp_path):
    small = tiny_engine(tmp_path, max_seq_len=256, max_num_tokens=4, max_batch_size=1)
    with Session(small, prompt_lookup=PromptLookup(num_tokens=8)) as session, Session(small) as plain:
        sizes = []
        feed_rows = session.engine.feed_rows
        session.engine.feed_rows = lambda tokens, start, rows: sizes.append(len(tokens)) or \
            feed_rows(tokens, start, rows)
        assert session.generate("abc abc abc abc", max_tokens=80).token_ids == \
            plain.generate("abc abc abc abc", max_tokens=80).token_ids
        assert session.accepted_draft_tokens > 0 and max(sizes[1:]) == 4  # a token and 3 drafts: the step's budget
    for read in range(2, 14):  # closed mid-step, among drafts taken: the stream ends at its next token
        session = Session(small, prompt_lookup=PromptLookup(num_tokens=3))
        stream = session.stream("abc abc abc abc abc abc", max_tokens=100, ignore_eos=True)
        for _ in range(read):
            next(stream)
        session.close()
        with pytest.raises(ServerClosedError):
            next(stream)


@pytest.mark.parametrize("policy, memory", [("guaranteed_no_evict", None), ("max_utilization", 160 * 1024)])
def test_in_flight_batching_drafts_too_with_the_same_outputs(engine_dir, policy, memory):
    """Decodes feed their drafts in the batch's step (several tokens: the prefill group), sampled in turn; outputs
    equal plain batching's, under preemption too (a tiny pool), with every block back at the end and prefix reuse
    of blocks a drafting request filled."""
    from camshaft.runtime.llm import LLM

    params = [SamplingParams(**{"max_tokens": 60, **options}) for options in PARAMS[:6]] * 3
    params += [SamplingParams(max_tokens=50, temperature=0.8, seed=5, n=3)]
    prompts = ([*PROMPTS, "x y z", PROMPTS[0] + " and the dog sat on the mat. The cat", PROMPTS[0]] * 4)[:len(params)]
    options = dict(policy=policy, kv_cache_memory=memory)
    with LLM(engine_dir, **options) as plain:
        expected = plain.generate(prompts, params, use_tqdm=False)
    with LLM(engine_dir, prompt_lookup=PromptLookup(num_tokens=4, max_running=8), **options) as drafting:
        steps = []
        step = drafting.engine.step
        drafting.engine.step = lambda batch: steps.append(list(batch)) or step(batch)
        got = drafting.generate(prompts, params, use_tqdm=False)
        executor = drafting.executor
        assert executor.scheduler.blocks.num_used == 0 and not executor.scheduler.running
        if memory is not None:
            assert executor.scheduler.num_preemptions > 0
    for a, b in zip(got, expected, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
    chunks = [c for batch in steps for c in batch]
    drafted = [c for c in chunks if c.num_logits == len(c.token_ids) > 1]  # a token and its drafts, every row
    assert drafted and executor.accepted_draft_tokens > 0
    assert sum(len(c.token_ids) - 1 for c in drafted) == executor.draft_tokens
    metrics = [o.metrics for result in got for o in result.outputs]  # each request's own count
    assert sum(m.draft_tokens for m in metrics) == executor.draft_tokens
    assert sum(m.accepted_draft_tokens for m in metrics) == executor.accepted_draft_tokens
    # each sampling step gives one token and the drafts taken, but a request that ends on a draft taken none more
    tokens = sum(len(o.token_ids) for result in got for o in result.outputs)
    samplings = sum(1 for c in chunks if c.num_logits >= 1)  # every row sampled (no prompt log-probs asked)
    assert tokens - samplings <= executor.accepted_draft_tokens <= tokens - samplings + len(metrics)
    for batch in steps:  # drafts only in steps of decodes alone (beside a prompt chunk they would be padded to it)
        if any(c.num_logits == len(c.token_ids) > 1 for c in batch):
            assert all(len(c.token_ids) == 1 or c.num_logits == len(c.token_ids) for c in batch)


def test_in_flight_batching_drafts_only_while_few_requests_run(engine_dir):
    from camshaft.runtime.llm import LLM

    with LLM(engine_dir, prompt_lookup=PromptLookup(max_running=2)) as llm:
        steps = []
        step = llm.engine.step
        llm.engine.step = lambda batch: steps.append(list(batch)) or step(batch)
        results = llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=n, ignore_eos=True) for n in (15, 40, 90)],
                               use_tqdm=False)
    drafting = [len(batch) for batch in steps if any(c.num_logits == len(c.token_ids) > 1 for c in batch)]
    assert drafting and max(drafting) <= 2  # three ran at first: none drafted until one finished
    # ending at max_tokens, never on a draft: each sampling step gave one token and the drafts it took
    samplings = sum(1 for batch in steps for c in batch if c.num_logits >= 1)
    accepted = sum(r.outputs[0].metrics.accepted_draft_tokens for r in results)
    assert accepted > 0 and sum(len(r.token_ids) for r in results) == samplings + accepted
    assert accepted == llm.executor.accepted_draft_tokens
    with pytest.raises(RequestError, match="max_running must be an integer >= 1"):
        PromptLookup(max_running=0)


def test_a_request_asking_for_prompt_logprobs_drafts_once_they_are_recorded(engine_dir):
    from camshaft.runtime.llm import LLM

    params = SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    with LLM(engine_dir) as plain:
        expected = plain.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    with LLM(engine_dir, prompt_lookup=4) as drafting:
        got = drafting.generate([PROMPTS[1]], params, use_tqdm=False)[0]
        assert drafting.executor.accepted_draft_tokens > 0
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    (a,), (b,) = got.outputs, expected.outputs
    assert a.prompt_logprobs == b.prompt_logprobs and a.prompt_logprobs and a.logprobs == b.logprobs


def test_a_prompts_one_token_tail_is_fed_without_drafts(engine_dir):
    """A prompt of max_num_tokens + 1 tokens ends on a one-token chunk, scheduled beside decodes: it has no output
    yet to draft after (the batch loop failed on it)."""
    from camshaft.runtime.llm import LLM

    prompt = ([5, 6, 7] * 30)[:65]  # repeats: drafts would be found
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(engine_dir) as plain:
        expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(engine_dir, prompt_lookup=4) as drafting:
        assert drafting.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert drafting.alive and drafting.executor.accepted_draft_tokens > 0


def test_drafts_take_only_blocks_no_decode_of_the_step_needs():
    """One decode's drafts may not take the last free block that a later decode needs for its own token: that
    decode would be preempted (and recomputed) for a guess."""
    from camshaft.runtime.request import Request
    from camshaft.runtime.scheduler import Scheduler
    from camshaft.runtime.scheduler_config import SchedulerConfig

    for lookup in (None, PromptLookup(num_tokens=4)):
        scheduler = Scheduler(SchedulerConfig(num_blocks=6, block_size=8, max_batch_size=4, max_num_tokens=64,
                                              max_seq_len=64, policy="max_utilization", prompt_lookup=lookup))
        params = SamplingParams(max_tokens=20)
        repeating = Request("A", [1, 2, 3, 4] * 3 + [1, 2, 3], params, None, None, (2,))  # 15 tokens
        other = Request("B", list(range(10, 26)), params, None, None, (2,))  # 16: its next token needs a block
        scheduler.add(repeating)
        scheduler.add(other)
        scheduler.computed(scheduler.schedule())  # both prompts: 2 blocks each, 1 free
        repeating.output_ids.append(4)
        other.output_ids.append(99)
        step = scheduler.schedule()
        assert [(s.request.request_id, s.chunk.token_ids) for s in step] == [("A", [4]), ("B", [99])]
        assert scheduler.num_preemptions == 0 and not scheduler.waiting


def _draft_counts(metrics_text: str) -> tuple[float, float]:
    values = {line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
              if line.startswith("camshaft_spec_decode_")}
    return (values["camshaft_spec_decode_num_draft_tokens_total"],
            values["camshaft_spec_decode_num_accepted_tokens_total"])


def test_the_openai_server_and_triton_serve_prompt_lookup_and_count_its_drafts(engine_dir, tmp_path):
    """The same greedy text with drafts as without, through the OpenAI server and a real tritonserver deployed with
    --prompt-lookup; both servers' /metrics count the drafts fed and taken as the batch loop does."""
    import json

    import httpx
    import requests
    from test_openai_server import running_server

    from camshaft.triton_repo.deploy import MARKER
    from camshaft.triton_repo.server import TritonServer

    body = {"model": "engine", "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0}
    with running_server(engine_dir) as (url, _):
        expected = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        assert _draft_counts(httpx.get(f"{url}/metrics").text) == (0, 0)
    with running_server(engine_dir, prompt_lookup=4) as (url, llm):
        assert httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"] == expected
        drafted, accepted = _draft_counts(httpx.get(f"{url}/metrics").text)
        assert 0 < accepted <= drafted
        assert (drafted, accepted) == (llm.executor.draft_tokens, llm.executor.accepted_draft_tokens)
    result = CliRunner().invoke(app, ["deploy", "--engine", str(engine_dir), "--repo", str(tmp_path / "repo"),
                                      "--prompt-lookup", "3"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "repo" / MARKER).read_text())["llm_options"]["prompt_lookup"] == 3
    with TritonServer(tmp_path / "repo", log_file=tmp_path / "tritonserver.log") as server:
        answer = requests.post(f"http://{server.endpoints.http}/v2/models/ensemble/generate", timeout=60,
                               json={"text_input": PROMPTS[1], "max_tokens": 40, "exclude_input_in_output": True,
                                     "return_perf_metrics": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["text_output"] == expected
        perf = answer.json()  # the request's own drafts (return_perf_metrics, through the text model)
        assert 0 < perf["total_accepted_draft_tokens"] <= perf["total_draft_tokens"]
        assert perf["acceptance_rate"] == pytest.approx(perf["total_accepted_draft_tokens"]
                                                        / perf["total_draft_tokens"])
        deadline = time.monotonic() + 30  # the token model pushes its metrics to Triton a few times a second
        while (counts := _draft_counts(requests.get(server.endpoints.metrics_url, timeout=10).text))[1] == 0:
            assert time.monotonic() < deadline, f"Triton's /metrics never counted a draft taken: {counts}"
            time.sleep(0.1)
        assert counts[1] <= counts[0]
