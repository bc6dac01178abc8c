"""Session on a tiny model: streaming equals generate, stop strings, seeds, chat encoding, logprobs, limits."""

from __future__ import annotations

import numpy as np
import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CapacityError, RequestError, ServerClosedError
from camshaft.runtime import sequence
from camshaft.runtime.request import new_requests
from camshaft.runtime.sampler import SampleResult
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("session")
    model = make_tiny_model("llama", root / "hf")
    build_engine(BuildConfig(model, root / "engine", max_seq_len=96, max_num_tokens=16, kv_block_size=8))
    return root / "engine"


@pytest.fixture(scope="module", params=["sequence", "batch"])
def session(engine_dir, request):
    session = Session(engine_dir, graph=request.param)
    assert session.graph == request.param
    yield session
    session.close()


def test_stream_concatenates_to_generate(session):
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    result = session.generate("hello world", params)
    deltas = list(session.stream("hello world", params))
    assert "".join(deltas) == result.text
    assert len(result.token_ids) == 40 and result.finish_reason == "length"
    assert result.timings.output_tokens == 40 and result.timings.ttft_s > 0
    assert 0 <= result.timings.queued_s < result.timings.ttft_s  # a Session has no queue: only its set-up


def test_timings_count_from_the_first_delta_asked_for_and_vllm_forms(session):
    import time

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    stream = session.stream({"prompt": "hello world"}, sampling_params=params)  # created now, read later
    time.sleep(0.3)
    deltas = []
    try:
        while True:
            deltas.append(next(stream))
    except StopIteration as stop:
        result = stop.value
    assert result.timings.ttft_s < 0.3 and "".join(deltas) == result.text
    assert session.generate({"prompt_token_ids": result.prompt_token_ids}, max_tokens=4,
                            ignore_eos=True).token_ids == result.token_ids
    with pytest.raises(RequestError, match="sampling_params must be a SamplingParams"):
        session.generate("hello", {"max_tokens": 4})
    with pytest.raises(RequestError, match=r"unknown sampling parameter.*\(the SamplingParams keyword is "
                                           r"sampling_params\)"):
        session.generate("hello", params=params)


def test_seeded_sampling_is_reproducible_and_seed_dependent(session):
    runs = [session.generate("abc", max_tokens=30, temperature=1.0, seed=s).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_chunked_prefill_gives_the_same_greedy_tokens(session):
    prompt = list(range(10, 70))  # 60 tokens: 4 chunks of max_num_tokens=16
    chunked = session.generate(prompt, max_tokens=20, ignore_eos=True).token_ids
    engine = session.engine
    engine.start(80)
    logits = engine.feed(prompt, 0)  # one 60-token chunk
    tokens = []
    for pos in range(60, 80):
        tokens.append(int(np.argmax(logits)))
        logits = engine.feed([tokens[-1]], pos)
    engine.finish()
    assert chunked == tokens


def test_both_graphs_give_the_same_tokens(engine_dir, session):
    other = Session(engine_dir, graph="batch" if session.graph == "sequence" else "sequence")
    for params in (dict(max_tokens=40, ignore_eos=True), dict(max_tokens=30, temperature=0.8, top_k=20, seed=3)):
        assert session.generate("the same prompt", **params).token_ids == other.generate(
            "the same prompt", **params).token_ids
    other.close()


def test_sequence_cache_grows_with_the_request_and_is_kept(engine_dir, monkeypatch):
    monkeypatch.setattr(sequence, "GROW", 16)
    session = Session(engine_dir, graph="sequence")
    per_token = session.manifest.sequence_graph.bytes_per_token(4)
    short = session.generate("a", max_tokens=4, ignore_eos=True)
    assert session.engine.kv_cache_bytes == 16 * per_token
    long = session.generate(list(range(10, 60)), max_tokens=40, ignore_eos=True)
    assert session.engine.kv_cache_bytes == 96 * per_token  # 90 tokens round up to 96, the engine's max_seq_len
    assert session.generate("a", max_tokens=4, ignore_eos=True).token_ids == short.token_ids
    assert session.generate(list(range(10, 60)), max_tokens=40, ignore_eos=True).token_ids == long.token_ids
    session.close()


def test_graph_choice_is_checked(engine_dir, tmp_path):
    with pytest.raises(RequestError, match="graph must be one of auto, sequence, batch"):
        Session(engine_dir, graph="fast")
    assert Session(engine_dir).graph == "sequence"  # auto: the engine has one


def test_stop_string_cuts_exactly_when_streaming_too(session):
    free = session.generate("xyz", max_tokens=40, ignore_eos=True)
    assert len(free.text) > 12
    stop = free.text[5:8]
    cut = free.text[: free.text.index(stop)]
    result = session.generate("xyz", max_tokens=40, ignore_eos=True, stop=[stop])
    assert result.text == cut and result.finish_reason == "stop"
    assert "".join(session.stream("xyz", max_tokens=40, ignore_eos=True, stop=[stop])) == cut
    kept = session.generate("xyz", max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == cut + stop


def test_min_tokens_holds_back_stop_strings(session):
    free = session.generate("xyz", max_tokens=40, ignore_eos=True)
    stop = free.text[5:8]
    first = session.generate("xyz", max_tokens=40, ignore_eos=True, stop=[stop])
    later = session.generate("xyz", max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=len(first.token_ids) + 1)
    assert later.text.startswith(first.text + stop)  # the first occurrence, before min_tokens, is kept
    assert len(later.token_ids) > len(first.token_ids)


def test_stop_token_ids_and_eos(session):
    free = session.generate("q", max_tokens=30, ignore_eos=True)
    target = free.token_ids[10]
    first = free.token_ids.index(target)
    stopped = session.generate("q", max_tokens=30, ignore_eos=True, stop_token_ids=[target])
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.stop_token_id == target and free.stop_token_id is None
    before = session.tokenizer.decode(free.token_ids[:first])
    assert stopped.text == before != session.tokenizer.decode(free.token_ids[: first + 1])  # its text left out
    assert "".join(session.stream("q", max_tokens=30, ignore_eos=True, stop_token_ids=[target])) == before
    kept = session.generate("q", max_tokens=30, ignore_eos=True, stop_token_ids=[target],
                            include_stop_str_in_output=True)
    assert kept.text == session.tokenizer.decode(free.token_ids[: first + 1])


def test_special_tokens_are_left_out_of_the_text_unless_asked(session):
    start = session.tokenizer.convert_tokens_to_ids("<|im_start|>")
    params = dict(max_tokens=3, ignore_eos=True, logit_bias={start: 100})
    hidden, shown = (session.generate("q", skip_special_tokens=skip, **params) for skip in (True, False))
    assert hidden.token_ids == shown.token_ids == [start] * 3
    assert hidden.text == "" and shown.text == "<|im_start|>" * 3
    assert "".join(session.stream("q", skip_special_tokens=False, **params)) == shown.text
    with pytest.raises(RequestError, match="skip_special_tokens must be True or False"):
        SamplingParams(skip_special_tokens="no")


def test_stop_reason_is_none_for_the_end_id_even_when_listed(session):
    vocab = session.engine.manifest.model.vocab_size
    for ignore_eos, expected in ((False, None), (True, 7)):  # vLLM tests the end id first
        params = SamplingParams(max_tokens=5, stop_token_ids=[7], ignore_eos=ignore_eos)
        request = new_requests("r", [5, 6], params, session.tokenizer, (7,), vocab)[0]
        request.add_sample(SampleResult(9))
        request.add_sample(SampleResult(7))
        result = request.result()
        assert result.finish_reason == "stop" and result.stop_token_id == 7 and result.stop_reason == expected


def test_stop_word_ids_end_on_the_whole_sequence_and_keep_it(session):
    free = session.generate("q", max_tokens=30, ignore_eos=True)
    ids = free.token_ids
    k = next(k for k in range(6, 30) if (ids[k - 1], ids[k]) not in zip(ids[: k - 1], ids[1:k], strict=True))
    word = (ids[k - 1], ids[k])
    stopped = session.generate("q", max_tokens=30, ignore_eos=True, stop_word_ids=[word, (ids[k],) * 3])
    assert stopped.token_ids == ids[: k + 1] and stopped.finish_reason == "stop" and stopped.stop_token_id is None
    assert stopped.text == session.tokenizer.decode(ids[: k + 1])  # TensorRT-LLM keeps a stop word in the output
    for min_tokens in (k + 1, k + 2):  # the word ends at token k + 1: within the first min_tokens, it does not count
        later = session.generate("q", max_tokens=30, ignore_eos=True, stop_word_ids=[word], min_tokens=min_tokens)
        assert later.token_ids[: k + 1] == ids[: k + 1] and len(later.token_ids) > k + 1
    assert session.generate("q", max_tokens=30, ignore_eos=True, stop_word_ids=[word],
                            min_tokens=k).token_ids == ids[: k + 1]


def test_stop_word_ids_match_ids_even_where_text_cannot(session):
    special = session.tokenizer.convert_tokens_to_ids(session.tokenizer.eos_token)  # no text when decoded
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop_word_ids=[(special, 40)])
    request = new_requests("r", [5, 6], params, session.tokenizer, (), session.engine.manifest.model.vocab_size)[0]
    for token in (40, special, 41, special):
        request.add_sample(SampleResult(token))
        assert not request.finished
    request.add_sample(SampleResult(40))
    assert request.finish_reason == "stop" and request.output_ids == [40, special, 41, special, 40]


def test_a_stop_word_may_begin_in_the_prompt_as_in_tensorrt_llm(session):
    first = session.generate([83], max_tokens=30, ignore_eos=True).token_ids[0]
    stopped = session.generate([83], max_tokens=30, ignore_eos=True, stop_word_ids=[(83, first)])
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_stop_word_ids_take_any_sequences_of_ids_in_the_vocabulary(session):
    params = SamplingParams(stop_word_ids=[np.array([5, 6]), range(7, 9)], bad_word_ids=np.array([[5, 6]]))
    assert params.stop_word_ids == ((5, 6), (7, 8)) and params.bad_word_ids == ((5, 6),)
    with pytest.raises(RequestError, match="stop_word_ids contains a token id outside the vocabulary"):
        session.generate("q", max_tokens=3, stop_word_ids=[(5, 10**6)])


@pytest.mark.parametrize(("words", "message"), [
    ([[3], []], "stop_word_ids must be non-empty lists"),
    ([3, 4], "stop_word_ids must be non-empty lists"),
    ([[3, -1]], "non-negative token ids"),
    ([[3]] * 1025, "stop_word_ids takes at most 1024 words"),
])
def test_bad_stop_word_ids_are_refused(words, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(stop_word_ids=words)


def test_bad_words_never_appear(session):
    free = session.generate("hello", max_tokens=30, ignore_eos=True)
    banned = session.tokenizer.decode(free.token_ids[:1])
    result = session.generate("hello", max_tokens=30, ignore_eos=True, bad_words=[banned])
    assert free.token_ids[0] not in result.token_ids


def test_logprobs_are_of_the_raw_distribution(session):
    result = session.generate("hi", max_tokens=5, logprobs=3, ignore_eos=True)
    assert len(result.logprobs) == 5
    for sample, token in zip(result.logprobs, result.token_ids, strict=True):
        assert sample.token_id == token and sample.logprob <= 0
        assert len(sample.top_logprobs) == 3
        assert sample.top_logprobs[0][1] >= sample.logprob - 1e-6  # greedy: the chosen token is the top one


def test_chat_encoding_does_not_double_bos(session):
    messages = [{"role": "user", "content": "hi"}]
    ids = session.encode(messages=messages)
    bos = session.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == bos and ids[1] != bos
    assert session.chat(messages, max_tokens=3).prompt_token_ids == ids


def test_beam_search_is_refused_clearly(session):
    with pytest.raises(RequestError, match="beam search is not supported"):
        session.generate("hi", beam_width=4)


def test_limits(session):
    with pytest.raises(CapacityError, match="pass max_tokens <= "):
        session.generate("hello", max_tokens=95)
    with pytest.raises(RequestError, match="unknown sampling parameter"):
        session.generate("hello", temprature=0.5)
    with pytest.raises(RequestError, match="the prompt is None; pass text, token ids"):
        session.generate()
    with pytest.raises(RequestError, match="exactly one of a prompt or chat messages"):
        session.generate("hi", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(RequestError, match="one conversation at a time"):
        session.chat([[{"role": "user", "content": "hi"}]] * 2)
    with pytest.raises(RequestError, match="token ids"):
        session.generate([10**6])
    with pytest.raises(RequestError, match="one output per request"):
        session.generate("hello", n=2, temperature=1.0)
    with pytest.raises(RequestError, match="'role' and a 'content'"):
        session.chat([{"content": "hi"}])
    with pytest.raises(RequestError, match="content is empty"):
        session.chat([{"role": "user", "content": " "}])
    for messages in ("hello", {"role": "user", "content": "hi"}, None):  # it said "chat message 0 is 'h'"
        with pytest.raises(RequestError, match=r"messages must be a list of \{'role', 'content'\} dicts, got"):
            session.chat(messages)
    with pytest.raises(RequestError, match="only text content parts"):
        session.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    parts = session.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text",
                                                                                          "text": "there"}]}],
                         max_tokens=3)  # OpenAI's text parts, as vLLM's LLM.chat takes them: joined by newlines
    assert parts.prompt_token_ids == session.chat([{"role": "user", "content": "hi\nthere"}],
                                                  max_tokens=3).prompt_token_ids
    for prompt in ([1.9, 2.7], ["hello"], [None], 42, b"hi"):
        with pytest.raises(RequestError, match="a prompt is a string or a list of integer token ids"):
            session.generate(prompt)
    assert session.generate(np.array([5, 6, 7]), max_tokens=2).prompt_token_ids == [5, 6, 7]
    with pytest.raises(RequestError, match="temperature"):
        session.stream("hello", temperature=-1)  # raised by the call, not by the first next()
    if session.graph == "batch":
        pool = session.engine.engine.pool
        assert pool.num_free == pool.capacity  # failed requests hold no blocks


def test_one_request_at_a_time(session):
    first = session.stream("hello", max_tokens=10, ignore_eos=True)
    next(first)
    with pytest.raises(RequestError, match="one request at a time"):
        session.generate("other", max_tokens=3)
    with pytest.raises(RequestError, match="one request at a time"):
        session.stream("other", max_tokens=3)  # raised by the call, not by the first next()
    rest = list(first)
    assert len(rest) >= 1
    alone = session.generate("hello", max_tokens=10, ignore_eos=True)
    assert alone.token_ids == session.generate("hello", max_tokens=10, ignore_eos=True).token_ids
    abandoned = session.stream("hello", max_tokens=10, ignore_eos=True)
    next(abandoned)
    abandoned.close()  # closing a stream frees the session
    assert session.generate("other", max_tokens=3, ignore_eos=True).finish_reason == "length"  # it runs again
    if session.graph == "batch":
        pool = session.engine.engine.pool
        assert pool.num_free == pool.capacity


def test_tiny_temperatures_are_greedy_and_seeds_are_distinct(session):
    greedy = session.generate("abc", max_tokens=8, ignore_eos=True).token_ids
    for t in (1e-6, 1e-39, 5e-324):
        assert session.generate("abc", max_tokens=8, ignore_eos=True, temperature=t).token_ids == greedy
    with pytest.raises(RequestError, match="finite number"):
        session.generate("abc", temperature=float("inf"))
    runs = [session.generate("abc", max_tokens=20, temperature=1.0, seed=s, ignore_eos=True).token_ids
            for s in (-2, 2**64 - 1, -2, -1, -1)]
    assert runs[0] == runs[2] != runs[1]  # every integer its own stream
    assert runs[3] != runs[4]  # -1: vLLM's "no seed"


def test_a_chat_template_refusal_is_a_request_error(engine_dir, tmp_path):
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(engine_dir, copy)
    next(copy.rglob("chat_template.jinja")).write_text(  # a template like Mistral's, which has no system role
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}")
    with Session(copy) as session:
        with pytest.raises(RequestError, match="chat template refused the messages: no system role"):
            session.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])


def test_a_chat_template_given_inline_reads_the_kwargs_passed(engine_dir):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tail | default('?') }}"
    with Session(engine_dir, chat_template=template) as session:
        messages = [{"role": "user", "content": "hi"}]
        encode = session.tokenizer.encode
        assert session.encode(messages=messages) == encode("hi?", add_special_tokens=False)
        result = session.chat(messages, chat_template_kwargs={"tail": "!"}, max_tokens=2)
        assert result.prompt_token_ids == encode("hi!", add_special_tokens=False)
        generated = session.generate(messages=messages, chat_template_kwargs={"tail": "!"}, max_tokens=2)
        stream = session.stream(messages=messages, chat_template_kwargs={"tail": "!"}, max_tokens=2)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                streamed = done.value
                break
        assert generated.prompt_token_ids == streamed.prompt_token_ids == result.prompt_token_ids
        for kwargs, message in (({"add_generation_prompt": False}, "cannot set add_generation_prompt"),
                                ({"not a name": 1}, "template variable names"), ([1], "template variable names")):
            with pytest.raises(RequestError, match=message):
                session.encode(messages=messages, chat_template_kwargs=kwargs)
        with pytest.raises(RequestError, match="chat_template_kwargs go with chat messages"):
            session.encode("hi", chat_template_kwargs={"tail": "!"})
    with pytest.raises(RequestError, match="the template given is not a valid Jinja chat template: line 1"):
        Session(engine_dir, chat_template="{{ messages ")


def test_a_chat_template_as_transformers_takes_it_and_its_errors_as_request_errors(engine_dir, tmp_path):
    """Loop controls parse (transformers' extensions); a template failing on the kwargs passed, apply_chat_template's
    own arguments, an unreadable or empty file: each a RequestError, never another exception."""
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
                "{{ 1 // d | default(1) }}")
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": "unseen"}]
    with Session(engine_dir, chat_template=template) as session:
        assert session.encode(messages=messages) == session.tokenizer.encode("hi1", add_special_tokens=False)
        with pytest.raises(RequestError, match="chat template refused the messages: integer division"):
            session.encode(messages=messages, chat_template_kwargs={"d": 0})
        with pytest.raises(RequestError, match="cannot set padding, return_assistant_tokens_mask"):
            session.encode(messages=messages, chat_template_kwargs={"padding": True,
                                                                     "return_assistant_tokens_mask": True})
    (tmp_path / "latin.jinja").write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    (tmp_path / "empty.jinja").write_text(" \n")
    for name, message in (("latin.jinja", "could not be read as UTF-8"), ("empty.jinja", "is empty")):
        with pytest.raises(RequestError, match=message):
            Session(engine_dir, chat_template=tmp_path / name)


@pytest.mark.parametrize("graph", ["sequence", "batch"])
def test_a_kv_cache_budget_bounds_either_graph(engine_dir, graph):
    """kv_cache_memory holds 48 tokens (in whole 8-token blocks for the batch graph): a request needing more is
    refused before any work, one that fits runs."""
    manifest = Session(engine_dir).manifest
    per_token = manifest.sequence_graph.bytes_per_token(4)
    budget = f"{per_token * (48 + 8)}B"  # + the batch graph's null block; the same forms as LLM's (a unit here)
    session = Session(engine_dir, graph=graph, kv_cache_memory=budget)
    assert len(session.generate(list(range(10, 30)), max_tokens=20, ignore_eos=True).token_ids) == 20
    with pytest.raises(CapacityError):
        session.stream(list(range(10, 50)), max_tokens=30, ignore_eos=True)  # by the call, before the first next()
    assert len(session.generate("x", max_tokens=5, ignore_eos=True).token_ids) == 5  # nothing held after a refusal
    filled = session.generate(list(range(10, 30)), max_tokens=None, ignore_eos=True)
    budget_tokens = 48 if graph == "batch" else 56  # the sequence graph has no null block to set aside
    assert len(filled.token_ids) == budget_tokens - 20  # None: what the budget holds, not max_seq_len (96)
    session.close()
    with pytest.raises(ServerClosedError, match="this Session is closed"):
        session.stream("x", max_tokens=2)


def test_a_huge_prompt_is_refused_after_tokenizing_a_prefix(engine_dir):
    """A 2 MB prompt cannot fit 96 tokens: refused without tokenizing it all (a 50 MB one took minutes and GBs)."""
    class Spy:
        def __init__(self, inner):
            self.inner, self.lengths = inner, []

        def __call__(self, text, **kwargs):
            self.lengths.append(len(text))
            return self.inner(text, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with Session(engine_dir) as session:
        session.prompts.tokenizer = spy = Spy(session.tokenizer)
        prompt = "lorem ipsum " * 200_000
        with pytest.raises(CapacityError, match=f"the prompt has {len(prompt)} characters, more than 96 tokens"):
            session.generate(prompt, max_tokens=2)
        assert spy.lengths and max(spy.lengths) < len(prompt) // 100
        with pytest.raises(CapacityError, match="the chat has .* characters, more than 96 tokens"):
            session.chat([{"role": "user", "content": prompt}], max_tokens=2)
        assert session.generate("lorem ipsum " * 3, max_tokens=2).finish_reason == "length"


@pytest.mark.parametrize("where", ["prompt", "chat"])
def test_text_that_is_not_unicode_is_a_request_error(engine_dir, where):
    with Session(engine_dir) as session:
        with pytest.raises(RequestError, match="is not valid Unicode .a lone surrogate at character 1\\b"):
            if where == "prompt":
                session.generate("a\ud800b", max_tokens=2)
            else:  # the position in the message, not in the rendered template
                session.chat([{"role": "system", "content": "hi"}, {"role": "user", "content": "a\ud800b"}],
                             max_tokens=2)


def test_continue_final_message_leaves_the_last_message_open_as_transformers_renders_it(session):
    """vLLM's chat keywords: add_generation_prompt False ends the chat after its last message; with
    continue_final_message the model goes on with that message's text (no end-of-turn after it)."""
    messages = [{"role": "user", "content": "name a river"}, {"role": "assistant", "content": "The river"}]
    tokenizer = session.tokenizer

    def reference(**kwargs) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return tokenizer.encode(text, add_special_tokens=False)

    opened = session.encode(messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert opened == reference(continue_final_message=True)
    assert tokenizer.decode(opened).endswith("assistant\nThe river")
    closed = session.encode(messages=messages, add_generation_prompt=False)
    assert closed == reference(add_generation_prompt=False) and tokenizer.decode(closed).endswith("<|im_end|>\n")
    assert session.encode(messages=messages) == reference(add_generation_prompt=True) != closed
    continued = session.chat(messages, add_generation_prompt=False, continue_final_message=True, max_tokens=5,
                             ignore_eos=True)
    assert continued.prompt_token_ids == opened
    assert continued.token_ids == session.generate(opened, max_tokens=5, ignore_eos=True).token_ids
    for kwargs, message in (({"continue_final_message": True}, "exclude each other"),
                            ({"add_generation_prompt": "no"}, "add_generation_prompt is true or false"),
                            ({"add_generation_prompt": False, "continue_final_message": 1}, "true or false")):
        with pytest.raises(RequestError, match=message):
            session.chat(messages, max_tokens=1, **kwargs)
    with pytest.raises(RequestError, match="last message's text, and it has none"):
        session.encode(messages=[*messages[:1], {"role": "assistant", "content": ""}], add_generation_prompt=False,
                       continue_final_message=True)
    with pytest.raises(RequestError, match="add_generation_prompt go with chat messages"):
        session.encode("hi", add_generation_prompt=False)
