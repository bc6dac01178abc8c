"""The OpenAI-compatible server on a real uvicorn socket, driven by the official openai client: outputs equal the
single-request Session's, streams concatenate to the full text, errors come back in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

import camshaft
from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.openai_server.body_limit import BodyLimit, max_body_bytes
from camshaft.openai_server.server import build_server
from camshaft.runtime.session import Session

from tiny_models import fail_step, make_tiny_model

MODEL = "engine"  # the engine directory's name
PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "Hello, world"]


def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny engine per test session, shared by the OpenAI server test modules."""
    root = tmp_path_factory.getbasetemp() / "openai_server"
    if not (root / MODEL / "manifest.json").is_file():
        # long enough that a request asking for thousands of tokens is still running when its client hangs up (the
        # tiny model makes ~5 tokens a ms)
        model = make_tiny_model("llama", root / "hf", max_position_embeddings=4096)
        build_engine(BuildConfig(model, root / MODEL, max_seq_len=4096, max_num_tokens=256, max_batch_size=16))
    return root / MODEL


@contextmanager
def running_server(engine: Path, api_key: str | None = None, tool_call_parser: str | None = None,
                   chat_template: Path | None = None, allowed_origins: tuple[str, ...] = (),
                   **llm_options) -> Iterator[tuple[str, object]]:
    """(base URL, its LLM) of a uvicorn server on a free loopback port, in a thread."""
    server, llm = build_server(engine, host="127.0.0.1", port=0, llm_options=llm_options, log_level="warning",
                               api_key=api_key, tool_call_parser=tool_call_parser, chat_template=chat_template,
                               allowed_origins=allowed_origins)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", llm
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.close()


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return tiny_engine(tmp_path_factory)


@pytest.fixture(scope="module")
def served(engine_dir):
    with running_server(engine_dir) as (url, llm):
        yield url, llm


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def session(engine_dir):
    return Session(engine_dir)


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


HTTP = httpx.Client(timeout=60)  # one client: a new one costs ~0.1 s (its TLS context)


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics by its name with labels, e.g. 'camshaft_request_success_total{finished_reason="stop"}'.
    """
    lines = HTTP.get(url + "/metrics").text.splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))}


def metric(url: str, name: str) -> float:
    return scrape(url).get(name, 0.0)


def test_models_and_health(served, client):
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL] and abs(listed[0].created - time.time()) < 3600  # when it started
    assert client.models.retrieve(MODEL).id == MODEL
    assert HTTP.get(served[0] + "/v1/models/other").json()["error"]["code"] == "model_not_found"
    assert HTTP.get(served[0] + "/health").json() == {"status": "ok"}


def test_the_default_model_id_is_the_engine_path_as_given(engine_dir, tmp_path):
    """Review: a symlink (engines/current -> a build, as docs/triton.md suggests) was followed, so the served id
    changed with each flip and clients sending `current` got 404; vLLM serves the --model argument as given."""
    (tmp_path / "current").symlink_to(engine_dir)
    with running_server(tmp_path / "current") as (url, _):
        assert [m["id"] for m in HTTP.get(url + "/v1/models").json()["data"]] == ["current"]
    from camshaft.openai_server.server import served_name

    inside = subprocess.run([sys.executable, "-c", "from camshaft.openai_server.server import "
                             "served_name as s; print(s('.'), s('./'), s('../current/.'))"],
                            cwd=tmp_path / "current", env={**os.environ, "PWD": str(tmp_path / "current")},
                            capture_output=True, text=True)  # `--engine .` in the link, as a shell's cd leaves it
    assert inside.stdout.split() == ["current"] * 3, inside.stderr
    assert served_name(engine_dir) == engine_dir.name


def test_a_stalled_streams_work_is_counted_as_the_engine_does_it(served):
    """Review: outputs were counted as the HTTP writer took them, so a client reading slowly held the counters back
    (5,794 of 32,000 generated tokens counted while the engine was idle) and sequences that ran to their length
    counted as aborted once the client left; vLLM counts as the engine makes them."""
    import json
    import socket

    url = served[0]
    keys = ("camshaft_generation_tokens_total", 'camshaft_request_success_total{finished_reason="length"}',
            'camshaft_request_success_total{finished_reason="abort"}')
    before = {k: metric(url, k) for k in keys}
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1500, "min_tokens": 1500, "n": 4,
                       "logprobs": 5, "stream": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect((host, int(port)))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        deadline = time.monotonic() + 120
        while metric(url, keys[0]) < before[keys[0]] + 6000 and time.monotonic() < deadline:
            time.sleep(0.2)  # the client reads nothing meanwhile
        after = {k: metric(url, k) for k in keys}
    finally:
        client.close()
    assert after[keys[0]] - before[keys[0]] == 6000 and after[keys[1]] - before[keys[1]] == 4, (before, after)
    time.sleep(0.5)
    assert metric(url, keys[2]) == before[keys[2]]  # ended by the engine, not by the client's leaving


def test_browsers_may_call_it_from_the_allowed_origins_only(served, engine_dir):
    """Review: no CORS, so a browser page built for vLLM failed at its preflight (405). --allowed-origins opts in
    (vLLM allows any origin by default; camshaft none, so no other site's page can use a local server)."""
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    closed = HTTP.options(served[0] + "/v1/completions", headers=preflight)
    assert closed.status_code == 405 and "access-control-allow-origin" not in closed.headers
    with running_server(engine_dir, api_key="k", allowed_origins=("http://localhost:3000",)) as (url, _):
        opened = HTTP.options(url + "/v1/completions", headers=preflight)  # no key: a preflight carries none
        assert opened.status_code == 200, opened.text
        assert opened.headers["access-control-allow-origin"] == "http://localhost:3000"
        done = HTTP.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                         headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
        assert done.status_code == 200 and done.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "x-request-id" in done.headers["access-control-expose-headers"].lower()
        other = HTTP.options(url + "/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_http_metrics_label_routes_not_raw_paths(served):
    url = served[0]
    for suffix in ("/v1/models/a1", "/v1/models/b2", "/no/such/path-1", "/no/such/path-2"):
        assert HTTP.get(url + suffix).status_code == 404
    http = {k: v for k, v in scrape(url).items() if k.startswith("camshaft_http_requests_total")}
    assert not [k for k in http if "a1" in k or "b2" in k or "path-" in k]
    assert http['camshaft_http_requests_total{path="/v1/models/{model:path}",status="404"}'] >= 2
    assert http['camshaft_http_requests_total{path="other",status="404"}'] >= 2
    counted = {path: f'camshaft_http_requests_total{{path="{path}",status="200"}}'
               for path in ("/v1/models", "/v1/models/{model:path}")}
    before = {path: http.get(name, 0.0) for path, name in counted.items()}
    assert HTTP.get(url + "/v1/models").status_code == 200 and HTTP.get(url + f"/v1/models/{MODEL}").status_code == 200
    after = scrape(url)
    assert {path: after.get(name, 0.0) - before[path] for path, name in counted.items()} == dict.fromkeys(counted, 1)


def test_greedy_completion_equals_session_with_usage(client, session):
    expected = session.generate(PROMPTS[0], max_tokens=12, temperature=0)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(expected.prompt_token_ids),
                                                                      len(expected.token_ids))


def test_completion_logprobs_of_token_prompt_match_session(client, session):
    ids = [5, 9, 17, 33, 2, 41, 70, 71]
    expected = session.generate(ids, max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([s.logprob for s in expected.logprobs], abs=1e-5)
    assert len(logprobs.tokens) == len(expected.token_ids) == out.usage.completion_tokens
    for top, sample in zip(logprobs.top_logprobs, expected.logprobs, strict=True):
        assert sorted(top.values()) == pytest.approx(sorted(lp for _, lp in sample.top_logprobs), abs=1e-5)


def test_completion_logprobs_hold_the_chosen_token_and_character_offsets(client):
    """OpenAI's legacy logprobs: each top_logprobs dict holds the sampled token too, and text_offset indexes the
    choice's text (a token that ends inside a character adds no characters; the tiny model's byte tokens do)."""
    out = client.completions.create(model=MODEL, prompt="Once", max_tokens=60, temperature=1.5, seed=3, logprobs=1,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    tokens, offsets, text = choice.logprobs.tokens, choice.logprobs.text_offset, choice.text
    assert all(token in top for token, top in zip(tokens, choice.logprobs.top_logprobs, strict=True))
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    whole = [(o, t) for o, t in zip(offsets, tokens, strict=True) if not t.startswith(("bytes:", "token_id:"))]
    assert any(t.startswith("bytes:") for t in tokens) and whole
    assert all(text[o: o + len(t)] == t for o, t in whole)
    only = client.completions.create(model=MODEL, prompt="Once", max_tokens=5, temperature=1.0, seed=1, logprobs=0)
    chosen = only.choices[0].logprobs
    assert [list(top) for top in chosen.top_logprobs] == [[t] for t in chosen.tokens]


def test_text_offset_of_a_token_that_ends_a_character_and_adds_more():
    """Byte-level BPE: 'é' is C3 A9 and a merged token holds A9 plus 'a'; it points at the 'é' it completes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from camshaft.openai_server.responses import CompletionShape
    from camshaft.runtime.sampler import SampleResult

    vocab = {t: i for i, t in enumerate(["<unk>", *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    vocab["©a"] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("©", "a")], unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")
    ids = tokenizer.encode("xéab")
    logprobs = CompletionShape("m", tokenizer, [tokenizer.encode("Hi ")], 1).logprobs(
        0, [SampleResult(t, -1.0) for t in ids])
    assert logprobs["tokens"] == ["x", "bytes:\\xc3", "bytes:\\xa9\\x61", "b"]
    assert logprobs["text_offset"] == [0, 1, 1, 3]  # x, é (begun), é (completed, then a), b


def test_text_offset_of_bytes_that_continue_a_character_begun_after_a_whole_one():
    """' 日' as ' '+E6 (one token), 97, A5: the tokens holding 97 and A5 point at 日, not at the space before it; a
    byte that begins no character (a lone E6 before 'a') is a character of its own (U+FFFD) in the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from camshaft.openai_server.responses import CompletionShape
    from camshaft.openai_server.tokens import _byte_level_decoder
    from camshaft.runtime.sampler import SampleResult

    level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    space_e6 = level.pre_tokenize_str(" 日")[0][0][:2]
    vocab = {t: i for i, t in enumerate(["<unk>", *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    vocab[space_e6] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(space_e6)], unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = level, decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")
    ids = tokenizer.encode("a 日本")
    lone_e6, letter = vocab[space_e6[1]], vocab["a"]
    logprobs = CompletionShape("m", tokenizer, [tokenizer.encode("Hi")], 1).logprobs(
        0, [SampleResult(t, -1.0) for t in [*ids, lone_e6, letter]])
    assert logprobs["tokens"][:5] == ["a", "bytes:\\x20\\xe6", "bytes:\\x97", "bytes:\\xa5", "bytes:\\xe6"]
    assert logprobs["text_offset"] == [0, 1, 2, 2, 3, 3, 3, 4, 5]  # a, ' ', 日, 日, 本 (3 bytes), U+FFFD, a
    shown = {byte: char for char, byte in _byte_level_decoder().items()}  # GPT-2's printable form of each byte
    strays = [vocab[shown[b]] for b in (0x98, 0x80)]
    strays_offsets = CompletionShape("m", tokenizer, [tokenizer.encode("Hi")], 1).logprobs(
        0, [SampleResult(t, -1.0) for t in [letter, *strays, letter]])["text_offset"]
    assert strays_offsets == [0, 1, 2, 3]  # 'a', two bytes that begin no character (U+FFFD each), 'a'


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_text_offsets_point_at_the_character_each_tokens_first_byte_is_in(kind):
    """Random text of 1- to 4-byte characters, tokenized into whole and partial characters: each offset is the
    character its token's first byte belongs to (SentencePiece's byte fallback decodes each byte of an incomplete
    character to its own U+FFFD, byte-level BPE all of them to one: offsets past 3- and 4-byte characters ran ahead)."""
    import random

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from camshaft.openai_server.responses import CompletionShape
    from camshaft.openai_server.tokens import TokenText
    from camshaft.runtime.sampler import SampleResult

    if kind == "sentencepiece":
        pieces = ["<unk>", "▁", "a", "b", "é", "▁a", "▁b", *(f"<0x{b:02X}>" for b in range(256))]
        model = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(pieces)}, merges=[("▁", "a"), ("▁", "b")],
                                    unk_token="<unk>", byte_fallback=True))
        model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    else:
        level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        vocab = {t: i for i, t in enumerate(["<unk>", *sorted(pre_tokenizers.ByteLevel.alphabet())])}
        merged = [level.pre_tokenize_str(text)[0][0][:2] for text in (" 日", "é")]  # ' '+E6; C3 A9
        vocab.update({m: len(vocab) + i for i, m in enumerate(merged)})
        model = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in merged], unk_token="<unk>"))
        model.pre_tokenizer, model.decoder = level, decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    token_bytes = TokenText(tokenizer)
    rng = random.Random(0)
    for _ in range(100):
        text = "".join(rng.choice(["a", "b", " ", "é", "ß", "日", "本", "€", "한", "😀"]) for _ in range(12))
        ids = tokenizer.encode(text, add_special_tokens=False)
        raw = [bytes(token_bytes.get(t)[1]) for t in ids]
        whole, expected = b"".join(raw), []
        for start in itertools.accumulate([0, *map(len, raw[:-1])]):
            before = sum(b & 0xC0 != 0x80 for b in whole[:start])
            expected.append(before - (whole[start] & 0xC0 == 0x80))
        got = CompletionShape("m", tokenizer, [tokenizer.encode("a", add_special_tokens=False)], 1).logprobs(
            0, [SampleResult(t, -1.0) for t in ids])["text_offset"]
        assert got == expected, (text, tokenizer.convert_ids_to_tokens(ids))


def test_a_byte_level_tokenizers_added_token_keeps_its_own_space_marks():
    """DeepSeek's <｜end▁of▁sentence｜> holds "▁" as text: only SentencePiece pieces read it as a space."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from camshaft.openai_server.tokens import TokenText

    level = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                 merges=[]))
    level.pre_tokenizer, level.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    level.add_special_tokens([AddedToken("<｜end▁of▁sentence｜>", special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=level)
    end = tokenizer.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    assert TokenText(tokenizer).get(end) == ("<｜end▁of▁sentence｜>", list("<｜end▁of▁sentence｜>".encode()))


def test_sentencepiece_tokens_keep_their_leading_space():
    """SentencePiece marks a word's leading space with '▁', which decoding one token alone strips: the token strings
    and offsets must still spell the choice's text."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from camshaft.openai_server.responses import CompletionShape
    from camshaft.runtime.sampler import SampleResult

    vocab = {t: i for i, t in enumerate(["<unk>", "▁", "▁▁", "H", "i", "▁there", "!", "<0xC3>", "<0xA9>"])}
    spm = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    spm.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=spm, unk_token="<unk>")
    ids = [vocab[t] for t in ["▁there", "!", "▁", "▁▁", "▁there", "<0xC3>", "<0xA9>"]]
    logprobs = CompletionShape("m", tokenizer, [[vocab["H"], vocab["i"]]], 1).logprobs(
        0, [SampleResult(t, -1.0) for t in ids])
    assert logprobs["tokens"] == [" there", "!", " ", "  ", " there", "bytes:\\xc3", "bytes:\\xa9"]
    assert logprobs["text_offset"] == [0, 6, 7, 8, 10, 16, 16]


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/completions", '{"model": "engine", "prompt": "a\\ud800b", "max_tokens": 2}', "not valid Unicode"),
    ("/v1/chat/completions", '{"model": "engine", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "not valid Unicode"),
    ("/v1/completions", '{"model": "engine", "prompt": [1.0, 2.0], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "engine", "prompt": [true, false], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"model": "engine", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": {"a": 1}}]}]}', "text must be a string"),
])
def test_malformed_text_and_ids_are_400s(served, path, body, message):
    response = HTTP.post(served[0] + path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and message in response.text, response.text
    assert HTTP.post(served[0] + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
                     ).status_code == 200  # the connection and the server carry on


def test_null_fields_take_their_defaults(served):
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "n": None, "top_p": None, "presence_penalty": None,
            "frequency_penalty": None, "stream": None, "logprobs": None, "temperature": None, "seed": None}
    response = HTTP.post(served[0] + CHAT, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1 and response.json()["choices"][0]["logprobs"] is None
    response = HTTP.post(served[0] + "/v1/completions",
                         json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": None, "echo": None})
    assert response.status_code == 200, response.text


def test_several_prompts_in_one_completion(client, session):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [session.generate(p, max_tokens=8, temperature=0).text
                                             for p in PROMPTS[:3]]


def test_chat_equals_session_chat_with_logprobs(client, session):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
    expected = session.chat(messages, max_tokens=10, temperature=0, logprobs=2)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx([s.logprob for s in expected.logprobs],
                                                                         abs=1e-5)
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_chat_text_parts_are_joined_by_newlines(client, session):
    parts = [{"type": "text", "text": "Name a river."}, {"type": "text", "text": "One word."}]
    expected = session.chat([{"role": "user", "content": "Name a river.\nOne word."}], max_tokens=6, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=6,
                                         temperature=0)
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.choices[0].message.content == expected.text


def test_streamed_chat_and_completion_concatenate_to_the_text(client, session):
    messages = [{"role": "user", "content": PROMPTS[2]}]
    expected = session.chat(messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)

    assert all("usage" in c.model_fields_set for c in chunks)  # with include_usage: on every chunk, null but last
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]

    expected = session.generate(PROMPTS[3], max_tokens=16, temperature=0)
    pieces = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in pieces) == expected.text
    assert not any("usage" in c.model_fields_set for c in pieces)  # OpenAI's: no usage field without include_usage

    # vLLM's continuous_usage_stats: the usage so far on every chunk, counting the tokens it carries
    counted = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0,
                                             stream=True, stream_options={"include_usage": True,
                                                                          "continuous_usage_stats": True}))
    assert "".join(c.choices[0].text for c in counted if c.choices) == expected.text
    assert all(c.usage.prompt_tokens == len(expected.prompt_token_ids) for c in counted)
    so_far = [c.usage.completion_tokens for c in counted]
    assert so_far == sorted(so_far) and so_far[-2] == so_far[-1] == len(expected.token_ids)


def test_n_sampled_outputs_are_reproducible_with_a_seed(client):
    request = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7, n=3,
                   extra_body={"ignore_eos": True})
    full = client.completions.create(**request)
    assert [c.index for c in full.choices] == [0, 1, 2] and full.usage.completion_tokens == 24
    assert len({c.text for c in full.choices}) > 1
    streamed = {}
    for chunk in client.completions.create(**request, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in full.choices]
    counts: dict[int, int] = {}  # continuous_usage_stats: each choice's own count, as vLLM's
    for chunk in client.completions.create(**request, stream=True,
                                           stream_options={"include_usage": True, "continuous_usage_stats": True}):
        for c in chunk.choices:
            assert chunk.usage.completion_tokens > counts.get(c.index, 0)
            counts[c.index] = chunk.usage.completion_tokens
    assert counts == {0: 8, 1: 8, 2: 8} and chunk.usage.completion_tokens == 24  # the last: the request's


def _stop_case(session: Session) -> tuple[str, str]:
    """A prompt and a character its greedy text shows after a first one (the tiny model emits many U+FFFD)."""
    for prompt in PROMPTS:
        text = session.generate(prompt, max_tokens=24, temperature=0).text
        for i, char in enumerate(text[1:], 1):
            if char != "\ufffd" and char not in text[:i]:
                return prompt, char
    raise AssertionError("no greedy output holds a usable stop character")


def test_stop_string_ends_the_text(client, session):
    prompt, stop = _stop_case(session)
    expected = session.generate(prompt, max_tokens=24, temperature=0, stop=[stop])
    assert expected.finish_reason == "stop" and stop not in expected.text
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop)
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.choices[0].model_extra["stop_reason"] == stop  # vLLM's field: what stopped it
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].model_extra["stop_reason"] is None
    last = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                          stream=True))[-1]
    assert last.choices[0].finish_reason == "stop" and last.choices[0].model_extra["stop_reason"] == stop


def test_logit_bias_steers_tokens_and_bad_keys_are_400s(client, served):
    forced = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={"17": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == served[1].tokenizer.decode([17] * 4)
    start = str(served[1].tokenizer.convert_tokens_to_ids("<|im_start|>"))
    special = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, logit_bias={start: 100},
                                        logprobs=0, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert special.choices[0].text == "<|im_start|>" * 2
    assert special.choices[0].logprobs.text_offset == [0, len("<|im_start|>")]
    for bias, message in (({"x": 1}, "logit_bias keys are token ids"), ({"\u00b2": 1}, "logit_bias keys are token"),
                          ({"\u0661\u0662": 1}, "logit_bias keys are token ids"),
                          ({"9223372036854775808": 1}, "logit_bias contains a token id outside the vocabulary"),
                          ({"5": True}, "logit_bias"), ({"5": "1"}, "logit_bias"),
                          ({"5": 200}, "biases in [-100, 100]"),
                          ({"999999": 1}, "logit_bias contains a token id outside the vocabulary")):
        response = httpx.post(f"{served[0]}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                                 "logit_bias": bias})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
        assert response.json()["error"]["param"] == "logit_bias"
    for flag in ("skip_special_tokens", "ignore_eos", "include_stop_str_in_output"):  # true or false, as in Python
        response = httpx.post(f"{served[0]}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                                 flag: "off"})
        assert response.status_code == 400 and flag in response.text, response.text


def test_echo_returns_the_prompt_and_its_log_probs_as_transformers_computes_them(client, served, engine_dir,
                                                                                 session):
    import numpy as np
    import torch
    import transformers

    prompt = PROMPTS[0]
    ids = served[1].encode(prompt)
    reference = transformers.AutoModelForCausalLM.from_pretrained(engine_dir.parent / "hf").eval()
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].double(), -1).numpy()
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]  # lm-eval's loglikelihood request: the prompt alone, scored
    assert choice.text == prompt and scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], [logp[i - 1, ids[i]] for i in range(1, len(ids))],
                               atol=2e-5)
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    both = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=0, temperature=0,
                                     extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=0, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert both.choices[0].text == prompt + plain.choices[0].text and both.usage.completion_tokens == 4
    assert both.choices[0].logprobs.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs
    assert both.choices[0].logprobs.tokens[len(ids):] == plain.choices[0].logprobs.tokens
    stopped, stop = _stop_case(session)
    cut = client.completions.create(model=MODEL, prompt=stopped, max_tokens=24, temperature=0, stop=stop)
    echoed = client.completions.create(model=MODEL, prompt=stopped, max_tokens=24, temperature=0, stop=stop,
                                       echo=True, logprobs=0)
    assert echoed.choices[0].text == stopped + cut.choices[0].text  # the prompt as sent, the output as without echo
    assert echoed.choices[0].logprobs.text_offset[len(served[1].encode(stopped))] == len(stopped)
    response = httpx.post(f"{served[0]}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert response.status_code == 400 and "0 only with echo" in response.text, response.text


def test_echoed_text_offsets_index_the_prompt_as_sent(client, served):
    """A chat-formatted prompt sent as text keeps its special tokens' text in the echo: their characters count in
    text_offset (they counted none, so every later offset was short of where its token is)."""
    prompt = "<|im_start|>ab"
    for skip in (True, False):
        echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                           logprobs=0, extra_body={"ignore_eos": True, "skip_special_tokens": skip})
        choice = echoed.choices[0]
        assert choice.text.startswith(prompt) and choice.logprobs.tokens[:3] == ["<|im_start|>", "a", "b"]
        offsets = choice.logprobs.text_offset
        assert offsets[:3] == [0, 12, 13] and offsets[3] == len(prompt), (skip, offsets)
        spelled = zip(offsets[:3], choice.logprobs.tokens[:3], strict=True)
        assert all(choice.text[at:].startswith(token) for at, token in spelled)


def test_echoed_text_offsets_index_the_text_as_sent_where_decoding_gives_another():
    """A normalizer (Qwen2's NFC: 'e' + U+0301 decodes as 'é') or a prefix space the tokenizer adds after a written
    <s> (Llama 2's raw chat prompts) changes the decoded prompt: offsets are the tokenizer's own into the text sent
    (they indexed the decoded text, every later one shifted, some past the prompt's end)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from camshaft.openai_server.responses import CompletionShape
    from camshaft.runtime.sampler import SampleResult

    level = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                 merges=[]))
    level.normalizer, level.pre_tokenizer = normalizers.NFC(), pre_tokenizers.ByteLevel(add_prefix_space=False)
    level.decoder = decoders.ByteLevel()
    pieces = ["<unk>", "<s>", "▁", "[", "]", "/", "I", "N", "S", "T", "H", "i", *(f"<0x{b:02X}>" for b in range(256))]
    spm = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    spm.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    spm.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    for tokenizer, sent in ((PreTrainedTokenizerFast(tokenizer_object=level), "Cafe\u0301 ok"),
                            (PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", unk_token="<unk>"),
                             "<s>[INST] Hi [/INST]")):
        encoded = tokenizer(sent, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=False) != sent
        for skip in (True, False):
            shape = CompletionShape("m", tokenizer, [ids], 1, skip_special_tokens=skip, echo="prompt+output",
                                    prompt_texts=[sent])
            entries = shape._echoed(0, ids, [None, *(SampleResult(t, -1.0) for t in ids[1:])], True)[1]
            assert entries["text_offset"] == [start for start, _ in encoded["offset_mapping"]], (sent, skip)
    # spans that leave a token's leading space out (ByteLevel's trim_offsets, GPT-NeoX's tokenizer.json) and an EOS
    # the tokenizer appends (span (0, 0)): where the token's text begins, the EOS where the text ends
    level.normalizer = None
    level.add_special_tokens(["<eos>"])
    for post, extra in ((processors.ByteLevel(trim_offsets=True), []),
                        (processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", 256)]), [11])):
        level.post_processor = post
        tokenizer, sent = PreTrainedTokenizerFast(tokenizer_object=level), "Hello world"
        ids = tokenizer(sent)["input_ids"]
        shape = CompletionShape("m", tokenizer, [ids], 1, echo="prompt+output", prompt_texts=[sent])
        entries = shape._echoed(0, ids, [None, *(SampleResult(t, -1.0) for t in ids[1:])], True)[1]
        assert entries["text_offset"] == [*range(len(sent)), *extra], post


def test_a_bos_the_tokenizer_adds_takes_no_characters_of_the_echoed_prompt():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from camshaft.openai_server.responses import CompletionShape
    from camshaft.runtime.sampler import SampleResult

    vocab = {t: i for i, t in enumerate(["<s>", "<unk>", "a", "b"])}
    word = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    word.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    word.decoder = decoders.Fuse()
    word.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word, bos_token="<s>", unk_token="<unk>")
    ids = tokenizer("ab")["input_ids"]
    assert ids == [0, 2, 3]
    for skip in (True, False):
        shape = CompletionShape("m", tokenizer, [ids], 1, skip_special_tokens=skip, echo="prompt",
                                prompt_texts=["ab"])
        text, logprobs = shape._echoed(0, ids, [None, SampleResult(2, -1.0), SampleResult(3, -1.0)], True)
        assert text == "ab" and logprobs["text_offset"] == [0, 0, 1], (skip, logprobs)
    ids = tokenizer("a<s>b")["input_ids"]  # a BOS added, and one written in the text (Llama 3's raw chat prompts)
    assert ids == [0, 2, 0, 3]
    for skip in (True, False):
        shape = CompletionShape("m", tokenizer, [ids], 1, skip_special_tokens=skip, echo="prompt",
                                prompt_texts=["a<s>b"])
        samples = [None, *(SampleResult(t, -1.0) for t in ids[1:])]
        assert shape._echoed(0, ids, samples, True)[1]["text_offset"] == [0, 0, 1, 4], skip


def _streamed(client, **request) -> tuple[dict[int, dict], dict]:
    """Each choice's streamed chunks joined (text, log-prob lists, finish reason) and the usage."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                           **request):
        usage = chunk.usage or usage
        for c in chunk.choices:
            joined = choices.setdefault(c.index, {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []})
            joined["text"] += c.text
            joined["finish_reason"] = c.finish_reason or joined.get("finish_reason")
            for key in ("tokens", "token_logprobs", "text_offset"):
                joined[key] += getattr(c.logprobs, key) if c.logprobs else []
    return choices, usage


def test_streamed_echo_equals_echo_without_streaming(client, session, served):
    stopped, stop = _stop_case(session)
    before = metric(served[0], "camshaft_generation_tokens_total")
    scored = {"prompt": PROMPTS[0], "max_tokens": 0, "echo": True}
    client.completions.create(model=MODEL, **scored)
    _streamed(client, **scored)
    assert metric(served[0], "camshaft_generation_tokens_total") == before  # the prompt alone: nothing generated
    for request in ({"prompt": PROMPTS[0], "max_tokens": 0, "echo": True, "logprobs": 2},
                    {"prompt": [PROMPTS[1], stopped], "max_tokens": 12, "echo": True, "logprobs": 1, "n": 2,
                     "stop": stop, "temperature": 0},
                    {"prompt": PROMPTS[2], "max_tokens": 5, "echo": True, "temperature": 0}):
        whole = client.completions.create(model=MODEL, **request)
        streamed, usage = _streamed(client, **request)
        assert usage.completion_tokens == whole.usage.completion_tokens
        assert usage.prompt_tokens == whole.usage.prompt_tokens
        assert sorted(streamed) == [c.index for c in whole.choices]
        for choice in whole.choices:
            joined = streamed[choice.index]
            assert joined["text"] == choice.text and joined["finish_reason"] == choice.finish_reason
            if choice.logprobs is not None:
                assert joined["tokens"] == choice.logprobs.tokens
                assert joined["text_offset"] == choice.logprobs.text_offset
                assert joined["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)


def test_metrics_move_with_requests(served, client):
    url = served[0]
    before = {n: metric(url, n) for n in ("camshaft_generation_tokens_total",
                                          "camshaft_time_to_first_token_seconds_count",
                                          "camshaft_inter_token_latency_seconds_count")}
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric(url, "camshaft_generation_tokens_total") == before["camshaft_generation_tokens_total"] + 5
    assert metric(url, "camshaft_time_to_first_token_seconds_count") == \
        before["camshaft_time_to_first_token_seconds_count"] + 1
    assert metric(url, "camshaft_inter_token_latency_seconds_count") == \
        before["camshaft_inter_token_latency_seconds_count"] + 4
    assert metric(url, "camshaft_kv_cache_blocks_total") > 0 and metric(url, "camshaft_kv_cache_blocks_used") == 0
    health = metric(url, 'camshaft_http_requests_total{path="/health",status="200"}')
    assert HTTP.get(url + "/health").status_code == 200 and HTTP.get(url + "/version").status_code == 200
    samples = scrape(url)  # a health failure ratio needs its 200s too (only its 503s were counted)
    assert samples['camshaft_http_requests_total{path="/health",status="200"}'] == health + 1
    assert samples['camshaft_http_requests_total{path="/version",status="200"}'] >= 1
    assert "camshaft_num_preemptions_total" in samples  # vLLM's names: num_preemptions, finished_reason


CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, body, param", [
    (CHAT, b'{"model": "engine", "messages": [', None),
    (CHAT, {"model": MODEL, "messages": HI, "n": 1000}, "n"),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": -3}, "max_tokens"),
    (CHAT, {"model": MODEL}, "messages"),
    (CHAT, {"model": MODEL, "messages": HI, "temperature": "hot"}, "temperature"),
    (CHAT, {"model": MODEL, "messages": HI, "temperature": "0.5"}, "temperature"),
    (CHAT, {"model": MODEL, "messages": HI, "temperature": True}, "temperature"),
    (CHAT, {"model": MODEL, "messages": HI, "top_p": "1"}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "presence_penalty": "2"}, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "repetition_penalty": False}, "repetition_penalty"),
    (CHAT, {"model": MODEL, "messages": HI, "logprobs": "yes"}, "logprobs"),
    (CHAT, {"model": MODEL, "messages": HI, "logprobs": 1}, "logprobs"),
    ("/tokenize", {"model": MODEL, "prompt": "Hi", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"model": MODEL, "prompt": "Hi", "return_token_strs": 1}, "return_token_strs"),
    (CHAT, {"model": MODEL, "messages": HI, "priority": "high"}, "priority"),
    (CHAT, {"model": MODEL, "messages": HI, "priority": True}, "priority"),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": True}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"model": MODEL, "messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "stop": ""}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stop_token_ids": [10**20]}, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**20, 5]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 4200}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4200}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "guided_json": {"type": "object"},
                         "guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern"),
    (CHAT, {"model": MODEL, "messages": HI, "prompt_logprobs": 1}, "prompt_logprobs"),
    (CHAT, {"model": MODEL, "messages": HI, "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    (CHAT, {"model": MODEL, "messages": []}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "suffix": "end"}, "suffix"),
    (CHAT, {"model": MODEL, "messages": HI, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"model": MODEL, "messages": HI, "response_format": {"type": "yaml"}}, "response_format"),
    (CHAT, {"model": MODEL, "messages": HI, "documents": [{"text": "a"}],
            "chat_template_kwargs": {"documents": [{"text": "b"}]}}, "documents"),
    (CHAT, {"model": MODEL, "messages": HI, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    (CHAT, {"model": MODEL, "messages": HI, "continue_final_message": True}, "continue_final_message"),
    (CHAT, {"model": MODEL, "messages": HI, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    (CHAT, {"model": MODEL, "messages": HI, "logit_bias": {"999999": 5}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/tokenize", {"model": MODEL, "prompt": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/tokenize", {"model": MODEL, "prompt": "Hi", "documents": [{"text": "a"}]}, "documents"),
    ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    (CHAT, {"model": MODEL, "messages": [*HI, {"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                                         "arguments": "{"}}]}]},
     "messages"),
])
def test_bad_input_is_an_openai_400(served, path, body, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = HTTP.post(served[0] + path, **kwargs)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and error["param"] == param


def test_a_wrong_method_keeps_its_allow_header(served):
    response = HTTP.get(served[0] + "/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_json_body_sent_as_a_form_is_told_which_header_it_lacks(served):
    response = HTTP.post(served[0] + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                         headers={"content-type": "application/x-www-form-urlencoded"})  # curl -d's default
    assert response.status_code == 400
    assert "only with the header Content-Type: application/json (this request's: application/x-www-form-urlencoded)" \
        in response.json()["error"]["message"]


def test_a_json_body_sent_without_a_content_type_is_told_which_header_it_lacks(served):
    response = HTTP.post(served[0] + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                         headers={"content-type": ""})  # python requests' data=json.dumps(...)
    assert response.status_code == 400
    assert "only with the header Content-Type: application/json (this request sent none)" \
        in response.json()["error"]["message"]


def test_ignored_fields_are_said_in_the_log(served, caplog):
    with caplog.at_level(logging.WARNING, logger="camshaft.openai_server"):
        answer = HTTP.post(served[0] + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "temprature": 0.5,
                                                                 "user": "me"})
    assert answer.status_code == 200  # as OpenAI and vLLM: unknown fields do not fail the request
    assert f"{answer.json()['id']}: fields present in the request but ignored: temprature, user" in caplog.text


def test_each_request_has_an_id_in_its_response_and_log_lines(served, caplog):
    """vLLM's X-Request-Id: a caller's trace id becomes the response's id and names the request in the log, which
    says how each generation request ended (finished, refused, aborted by the client)."""
    url = served[0]
    with caplog.at_level(logging.INFO, logger="camshaft.openai_server"):
        traced = HTTP.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                           headers={"X-Request-Id": "trace-42"})
        assert traced.headers["x-request-id"] == "trace-42" and traced.json()["id"] == "cmpl-trace-42"
        fresh = HTTP.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "n": 2,
                                                              "ignore_eos": True})
        made = fresh.headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", made) and fresh.json()["id"] == f"chatcmpl-{made}"
        refused = HTTP.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0},
                            headers={"X-Request-Id": "bad-1"})
        assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
        invalid = HTTP.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": "x"},
                            headers={"X-Request-Id": "bad-2"})  # refused before the route: the id all the same
        assert invalid.status_code == 400 and invalid.headers["x-request-id"] == "bad-2"
        for unusable in ("a b", "", "é", "a" * 257):  # not refused over its trace id: a new one, said in the header
            answer = HTTP.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                               headers={"X-Request-Id": unusable.encode()})
            assert answer.status_code == 200 and re.fullmatch("[0-9a-f]{32}", answer.headers["x-request-id"])
        with HTTP.stream("POST", url + "/v1/completions", json={"prompt": "hi", "max_tokens": 100, "stream": True,
                                                               "ignore_eos": True},
                         headers={"X-Request-Id": "gone"}) as stream:
            assert stream.headers["x-request-id"] == "gone"
            next(stream.iter_lines())
        wait_until(lambda: "cmpl-gone: aborted" in caplog.text)
    lines = [r.getMessage() for r in caplog.records if r.name == "camshaft.openai_server"]
    assert re.fullmatch(r"cmpl-trace-42: finished \(length\) after [0-9.]+ s, first token at [0-9.]+ s: \d+ prompt "
                        r"tokens, 3 generated", lines[0]), lines
    assert re.fullmatch(rf"chatcmpl-{made}: finished \(length x2\) after .*, 4 generated", lines[1]), lines
    assert lines[2:4] == ["cmpl-bad-1: refused, 400 invalid_request_error (param max_tokens)",
                          "cmpl-bad-2: refused, 400 invalid_request_error (param max_tokens)"], lines  # no request text
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}: finished \(length\) after .*", line) for line in lines[4:8]), lines
    assert re.fullmatch(r"cmpl-gone: aborted \(the client went away\) after .*", lines[8]) and len(lines) == 9, lines


def test_a_request_failed_or_stopped_by_the_server_is_logged_once_as_such(engine_dir, caplog):
    """A step failing under a non-streamed request: one "failed" line (not also "refused"), an OpenAI error on a
    connection kept open; a request cut as the server stops is not said to be the client's doing."""
    from fastapi.testclient import TestClient

    from camshaft.openai_server.app import create_app
    from camshaft.openai_server.generation import Generation

    with camshaft.LLM(engine_dir) as llm:
        app = create_app(llm, "m", api_key="k")
        client = TestClient(app, headers={"Authorization": "Bearer k"})
        fail_step(llm, at=3)
        with caplog.at_level(logging.INFO, logger="camshaft.openai_server"):
            failed = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 20, "ignore_eos": True},
                                 headers={"X-Request-Id": "f1"})
            keyless = TestClient(app).post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "k1"})
            slashed = TestClient(app).post("/v1/completions/", json={"prompt": "hi"}, headers={"X-Request-Id": "k2"})
            app.state.cutting.set()
            with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 100, "stream": True,
                                                                "ignore_eos": True}, headers={"X-Request-Id": "s1"}):
                pass  # closed before its end, as uvicorn cuts the streams a stop leaves open
        assert failed.status_code == 500 and failed.json()["error"]["message"] == "internal server error: " \
            "RuntimeError('device lost')" and failed.headers["x-request-id"] == "f1"
        assert keyless.status_code == 401 and keyless.headers["x-request-id"] == "k1"
        assert slashed.status_code == 401 and slashed.headers["x-request-id"] == "k2"

        async def closed() -> None:  # a stop's grace ended: the batch loop closed under a running request
            generation = Generation(llm, [[5, 6]], camshaft.SamplingParams(max_tokens=100, ignore_eos=True),
                                    app.state.metrics, time.perf_counter(), log_id="cmpl-c1")
            llm.close()
            with pytest.raises(camshaft.ServerClosedError):
                await generation.results()
            generation.abort()

        with caplog.at_level(logging.INFO, logger="camshaft.openai_server"):
            asyncio.run(closed())
    lines = [r.getMessage() for r in caplog.records if r.name == "camshaft.openai_server"]
    assert len(lines) == 5 and re.fullmatch(r"cmpl-f1: failed after .*: device lost", lines[0]), lines
    assert lines[1:3] == [f"cmpl-{k}: refused, 401 invalid_request_error (code invalid_api_key)" for k in ("k1", "k2")]
    assert re.fullmatch(r"cmpl-s1: aborted \(the server stopped\) after .*", lines[3]), lines
    assert re.fullmatch(r"cmpl-c1: aborted \(the server stopped\) after .*", lines[4]), lines
    assert [r.levelname for r in caplog.records if r.name == "camshaft.openai_server"][3:] == ["INFO", "INFO"]


def test_vllms_bad_words_reach_the_sampler():
    from camshaft.openai_server.protocol import ChatCompletionRequest, CompletionRequest

    for request in (CompletionRequest(prompt="x", bad_words=["foo", "bar baz"]),
                    ChatCompletionRequest(messages=HI, bad_words=["foo", "bar baz"])):
        assert request.sampling_params(4, None).bad_words == ("foo", "bar baz")


def test_context_overflow_is_refused_in_the_words_clients_match(served):
    """vLLM's and OpenAI's "maximum context length" text (clients trim the conversation on it), code
    context_length_exceeded, param the prompt's field."""
    cases = [("/v1/completions", {"prompt": [5] * 4000, "max_tokens": 200}, "prompt",
              "However, you requested 4200 tokens (4000 in the prompt, 200 in the completion)"),
             (CHAT, {"messages": [{"role": "user", "content": "hello " * 4200}]}, "messages",
              "However, your request has "),
             ("/v1/completions", {"prompt": "word " * 40000}, "prompt", "However, your request has more")]
    for path, body, param, words in cases:
        error = HTTP.post(served[0] + path, json={"model": MODEL, **body}).json()["error"]
        assert error["message"].startswith("This model's maximum context length is 4096 tokens. ") and \
            words in error["message"], error
        assert (error["code"], error["param"]) == ("context_length_exceeded", param)


def test_developer_messages_refusals_and_no_model_as_vllm_takes_them(served, client):
    """OpenAI's `developer` role reaches a template without one as `system`; an assistant's refusal parts are its
    text; `model` may be left out or empty (vLLM: the served model)."""
    url = served[0]

    def tokens(messages: list[dict]) -> list[int]:
        return HTTP.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]

    user = {"role": "user", "content": "hi"}
    assert tokens([{"role": "developer", "content": "be brief"}, user]) == \
        tokens([{"role": "system", "content": "be brief"}, user])
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}
    assert tokens([user, refused, user]) == tokens([user, {"role": "assistant", "content": "no"}, user])
    bad = HTTP.post(url + "/tokenize", json={"messages": [{"role": "user", "content": [{"type": "refusal",
                                                                                          "refusal": "no"}]}]})
    assert bad.status_code == 400 and "only text content parts" in bad.json()["error"]["message"]
    for model in ({}, {"model": ""}):  # vLLM takes an empty name as left out
        answer = HTTP.post(url + CHAT, json={"messages": [user], "max_tokens": 3, **model})
        assert answer.status_code == 200 and answer.json()["model"] == MODEL


def test_priority_reaches_the_scheduler(served, client):
    _, llm = served
    seen, scheduler_add = [], llm.executor.scheduler.add

    def add(request, queue_order=None):
        seen.append(request.priority)
        scheduler_add(request, queue_order)

    llm.executor.scheduler.add = add
    try:
        out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": -5})
    finally:
        llm.executor.scheduler.add = scheduler_add
    assert out.choices[0].text is not None and seen == [-5]


def test_openai_client_raises_not_found_for_another_model(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # 404, as OpenAI and vLLM answer
        client.chat.completions.create(model="nope", messages=HI)


def test_a_busy_refusal_is_an_answer_not_a_server_error(engine_dir):
    from fastapi.testclient import TestClient

    from camshaft.openai_server.app import create_app
    from camshaft.runtime.llm import LLM
    from camshaft.runtime.sampling_params import SamplingParams

    with LLM(engine_dir, max_batch_size=1, max_queue=0) as llm:
        gate, step = threading.Event(), llm.engine.step
        llm.engine.step = lambda chunks: (gate.wait(), step(chunks))[1]
        llm.submit([5, 6, 7], SamplingParams(max_tokens=2), lambda output: None)  # the batch of one is full
        try:  # TestClient re-raises what reaches Starlette's server-error middleware (and the server logs it)
            with TestClient(create_app(llm, MODEL)) as http:
                busy = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        finally:
            gate.set()
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"


def test_a_full_queue_answers_503_and_the_server_recovers(engine_dir):
    with running_server(engine_dir, max_batch_size=1, max_queue=0) as (url, llm):
        gate, step = threading.Event(), llm.engine.step
        llm.engine.step = lambda chunks: (gate.wait(), step(chunks))[1]  # hold the batch loop: no request finishes
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 50, "temperature": 0, "stream": True}
        with HTTP.stream("POST", url + "/v1/completions", json=body) as first:
            assert first.status_code == 200  # headers come once the request is in the batch loop
            busy = HTTP.post(url + "/v1/completions", json={**body, "stream": False})
            gate.set()
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
        wait_until(lambda: llm.load().running + llm.load().waiting == 0)  # the closed stream's request is gone
        assert HTTP.post(url + "/v1/completions", json={**body, "stream": False}).status_code == 200
        assert llm.load().kv_blocks_used == 0
        never = HTTP.post(url + "/v1/completions", json={**body, "stream": False, "prompt": PROMPTS[:2]})
        assert never.status_code == 400 and never.json()["error"]["param"] == "prompt"  # no retry can help: not 503
        llm.close()  # the batch loop stops: health says so
        assert HTTP.get(url + "/health").status_code == 503


def test_a_served_name_may_hold_slashes(served):
    from fastapi.testclient import TestClient

    from camshaft.openai_server.app import create_app

    with TestClient(create_app(served[1], "org/model")) as http:
        assert http.get("/v1/models/org/model").json()["id"] == "org/model"
        assert http.get("/v1/models/org/other").status_code == 404


def test_a_body_over_the_limit_is_a_413_before_it_is_read(served):
    limit = max_body_bytes(4096, 16, None)
    body = b'{"model": "engine", "prompt": "' + b"a" * limit + b'"}'
    response = HTTP.post(served[0] + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413 and f"at most {limit}" in response.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "engine", "prompt": "'
        for _ in range(limit // 2**16 + 1):
            yield b"a" * 2**16
        yield b'"}'

    response = HTTP.post(served[0] + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and f"more than {limit} bytes" in response.json()["error"]["message"]
    assert 'path="/v1/completions",status="413"' in HTTP.get(served[0] + "/metrics").text
    assert HTTP.post(served[0] + "/v1/completions", json={"model": MODEL, "prompt": "Hi" * 1000, "max_tokens": 2}
                     ).status_code == 200


def test_a_body_that_trickles_in_is_a_408():
    sent: list[dict] = []

    async def app(scope, receive, send):
        raise AssertionError("the app must not see the request")

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"{", "more_body": True}

    async def send(message):
        sent.append(message)

    refusals = []
    limit = BodyLimit(app, 1000, lambda path, status: refusals.append((path, status)), timeout_s=0.3)
    asyncio.run(limit({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send))
    assert sent[0]["status"] == 408 and b"did not arrive within 0.3 s" in sent[1]["body"]
    assert refusals == [("/v1/completions", 408)]


def test_tokenize_counts_as_generation_does_and_detokenize_inverts_it(served, session):
    url, llm = served
    body = HTTP.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}).json()
    expected = session.generate(PROMPTS[0], max_tokens=1).prompt_token_ids
    assert body == {"count": len(expected), "max_model_len": 4096, "tokens": expected}
    # counted up to 4 contexts (a 6 MB body of text held ~1.5 GB while it was tokenized): past that, a 400
    assert HTTP.post(url + "/tokenize", json={"prompt": "a" * 4 * 4096}).json()["count"] == 4 * 4096
    past = HTTP.post(url + "/tokenize", json={"prompt": "a" * (4 * 4096 + 1)})
    assert past.status_code == 400 and "/tokenize counts at most 16384 tokens" in past.json()["error"]["message"]
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = HTTP.post(url + "/tokenize", json={"messages": messages}).json()  # model may be left out, as in vLLM
    assert chat["tokens"] == session.chat(messages, max_tokens=1).prompt_token_ids
    assert HTTP.post(url + "/detokenize", json={"model": MODEL, "tokens": expected}).json() == {
        "prompt": llm.tokenizer.decode(expected)}
    begun = [*messages, {"role": "assistant", "content": "The"}]
    keep_going = {"add_generation_prompt": False, "continue_final_message": True}
    opened = HTTP.post(url + "/tokenize", json={"messages": begun, **keep_going}).json()["tokens"]
    assert opened == session.encode(messages=begun, **keep_going) != session.encode(messages=begun)
    reply = HTTP.post(url + "/v1/chat/completions", json={"messages": begun, "max_tokens": 4, "temperature": 0,
                                                          **keep_going}).json()
    assert reply["usage"]["prompt_tokens"] == len(opened)
    assert reply["choices"][0]["message"]["content"] == session.generate(opened, max_tokens=4).text
    for path, bad, message in [
        ("/tokenize", {"prompt": "x", "messages": messages}, "one of prompt (text) or messages"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": False}, "takes its default only"),
        ("/tokenize", {"messages": messages, "tools": [{"type": "function"}]}, "each tool is {'type': 'function'"),
        ("/v1/chat/completions", {"model": MODEL, "messages": messages, "chat_template_kwargs": {"tools": 1}},
         "chat_template_kwargs cannot set tools"),
        ("/v1/chat/completions", {"model": MODEL, "messages": messages, "chat_template": "{{ 1 }}"},
         "a request's own chat_template is not taken"),
        ("/tokenize", {"messages": messages, "chat_template_kwargs": {"padding": True}}, "cannot set padding"),
        ("/tokenize", {"messages": messages, "chat_template_kwargs": {"d": [[[[]]]] * 3, "messages": 1}},
         "cannot set messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": messages, "continue_final_message": True},
         "add_generation_prompt and continue_final_message exclude each other"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt go with messages"),
        ("/tokenize", {"messages": messages, "add_generation_prompt": "no"}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs go with messages"),
        ("/detokenize", {"tokens": [5, 10**6]}, "token id 1000000 is outside"),
        ("/detokenize", {"tokens": [5, True]}, "tokens"),
    ]:
        response = HTTP.post(url + path, json=bad)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    other = HTTP.post(url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert other.status_code == 404 and "does not exist" in other.json()["error"]["message"], other.text
    assert HTTP.get(url + "/version").json() == {"version": camshaft.__version__}
    long = HTTP.post(url + "/tokenize", json={"prompt": "hello " * 1000, "return_token_strs": True}).json()
    assert long["count"] > long["max_model_len"] == 4096  # counted, not refused: what a client trims by
    assert long["token_strs"] == llm.tokenizer.convert_ids_to_tokens(long["tokens"])
    empty = HTTP.post(url + "/tokenize", json={"prompt": ""}).json()
    assert empty["count"] == len(llm.tokenizer("")["input_ids"])
    assert 'path="/tokenize",status="200"' in HTTP.get(url + "/metrics").text


def test_chat_echo_begins_the_reply_with_the_begun_assistant_message(served, session):
    """vLLM's chat echo: a client continuing an assistant message gets it back whole; it was ignored."""
    import json

    url, _ = served
    begun = [{"role": "user", "content": PROMPTS[1]}, {"role": "assistant", "content": "The"}]
    body = {"messages": begun, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True}
    continued = session.generate(session.encode(messages=begun, add_generation_prompt=False,
                                                continue_final_message=True), max_tokens=4).text
    whole = HTTP.post(url + "/v1/chat/completions", json=body).json()
    assert whole["choices"][0]["message"]["content"] == "The" + continued
    events = HTTP.post(url + "/v1/chat/completions", json=body | {"stream": True}).text.splitlines()
    deltas = [json.loads(e[6:])["choices"] for e in events if e.startswith("data: {")]
    assert "".join(c[0]["delta"].get("content") or "" for c in deltas if c) == "The" + continued
    asked = HTTP.post(url + "/v1/chat/completions", json={**body, "messages": begun[:1], "continue_final_message":
                                                          False, "add_generation_prompt": True}).json()
    assert not asked["choices"][0]["message"]["content"].startswith(PROMPTS[1])  # a user's last message: no echo


def test_a_chat_template_and_its_kwargs_shape_the_chat_prompt(engine_dir, tmp_path):
    """--chat-template's file replaces the engine's template for chat requests and /tokenize alike; a request's
    chat_template_kwargs reach it as variables (vLLM's, e.g. Qwen3's enable_thinking)."""
    template = tmp_path / "brief.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'ANSWER' if not brief else 'BRIEF' }}:{% endif %}")
    messages = [{"role": "user", "content": "hi there"}]
    with running_server(engine_dir, chat_template=template, max_batch_size=2) as (url, llm):
        for kwargs, suffix in (({}, "ANSWER:"), ({"chat_template_kwargs": {"brief": True}}, "BRIEF:")):
            want = llm.tokenizer.encode(f"[user:hi there]{suffix}", add_special_tokens=False)
            counted = HTTP.post(url + "/tokenize", json={"messages": messages, **kwargs}).json()
            assert counted["tokens"] == want
            body = {"model": MODEL, "messages": messages, "max_tokens": 3, **kwargs}
            assert HTTP.post(url + "/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"] == len(want)


def test_an_api_key_guards_every_route_but_the_operators(engine_dir):
    with running_server(engine_dir, api_key="s3cret", max_batch_size=2) as (url, _):
        for path in ("/health", "/metrics", "/version", "/health/"):
            assert httpx.get(url + path, follow_redirects=True).status_code == 200, path
        missing = httpx.get(f"{url}/v1/models")
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert "needs an API key" in missing.json()["error"]["message"]
        wrong = httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer s3cre"})
        assert wrong.status_code == 401 and "not this server's" in wrong.json()["error"]["message"]
        assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"},
                          headers={"authorization": "bearer  s3cret"}).status_code == 200  # the scheme in any case
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope").completions.create(model=MODEL, prompt="hi",
                                                                                   max_tokens=2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret")
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        metrics = httpx.get(f"{url}/metrics").text
        assert 'camshaft_http_requests_total{path="/v1/models",status="401"} 1.0' in metrics
        assert 'camshaft_http_requests_total{path="/v1/completions",status="401"} 1.0' in metrics


def test_structured_output_follows_its_schema_regex_or_choice(client, served):
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    value = json.loads(chat.choices[0].message.content)
    assert list(value) == ["ok", "n"] and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    assert chat.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=60, response_format={"type": "json_object"}, seed=1)
    content = anything.choices[0].message.content  # a random model's free keys may run to max_tokens
    assert content.startswith("{") and (anything.choices[0].finish_reason == "length"
                                        or isinstance(json.loads(content), dict))
    regex = r"[a-z]{3} [0-9]{2}\."
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, n=2, temperature=1.0,
                                         seed=4, extra_body=extra)
        assert all(re.fullmatch(regex, c.text) for c in done.choices), [c.text for c in done.choices]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, stream=True, extra_body={"guided_choice": ["yes", "no"]}))
    assert streamed in ("yes", "no")
    bad_pattern = {"type": "object", "properties": {"a": {"type": "string", "pattern": "a(b"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": bad_pattern}}
    for body, message, param in (
            ({"guided_regex": "a(b"}, "unclosed group", "guided_regex"),
            ({"structured_outputs": {"regex": "a(b"}}, "unclosed group", "structured_outputs"),
            ({"guided_json": bad_pattern}, "unclosed group", "guided_json"),
            ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "unclosed group",
             "tools"),
            ({"tools": [tool], "tool_choice": "required", "response_format": {"type": "text"}}, "unclosed group",
             "tools"),  # response_format text constrains nothing
            ({"guided_regex": "a(b", "structured_outputs": {}}, "unclosed group", "guided_regex"),
            ({"guided_regex": "a(b", "guided_json": {}}, "takes exactly one of", None),  # {} is a schema: two sent
            ({"guided_regex": "a", "response_format": {"type": "json_object"}},
             "send one structured-output constraint; got response_format, guided_regex", None),
            ({"response_format": {"type": "yaml"}}, "response_format type 'yaml' is not supported", "response_format"),
            ({"response_format": {"type": "json_schema"}}, "response_format json_schema needs", "response_format"),
            ({"response_format": {"type": "json_schema", "json_schema": "abc"}}, "response_format json_schema needs",
             "response_format"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
             "its schema a JSON object, got '{}'", "response_format"),
            ({"guided_json": "[" * 100_000}, "the guided json schema is not JSON", "guided_json"),
            ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs takes one of", "structured_outputs")):
        response = httpx.post(f"{served[0]}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
        error = response.json()["error"]
        assert response.status_code == 400 and message in error["message"], response.text
        assert error["param"] == param, (body, error)


def test_metrics_count_no_refused_sequence_and_count_failed_ones(engine_dir):
    """A request refused before it ran (busy) counted its submitted prompts as aborted, and its own first prompt as
    load in the busy message; a sequence the server failed was not counted at all. A request's prompts are queued
    all or none; more than could ever be in flight at once is a bad request, not a busy server."""
    import threading

    from camshaft.errors import RequestError, ServerBusyError
    from camshaft.openai_server.generation import Generation
    from camshaft.openai_server.metrics import Metrics

    def finished(metrics: Metrics, reason: str) -> float:
        return metrics.registry.get_sample_value("camshaft_request_success_total", {"finished_reason": reason}) or 0

    params = camshaft.SamplingParams(max_tokens=4, ignore_eos=True)
    with camshaft.LLM(engine_dir, max_batch_size=1, max_queue=1) as llm:
        metrics = Metrics(llm)
        step, gate = llm.engine.step, threading.Event()
        llm.engine.step = lambda chunks: (gate.wait(60), step(chunks))[1]  # the running request holds the batch

        async def refused_then_failed() -> None:
            occupant = llm.submit([3, 4], params, lambda output: None)
            with pytest.raises(ServerBusyError, match="server busy: 1 sequences in flight"):
                Generation(llm, [[5, 6], [7, 8]], params, metrics, time.perf_counter())
            with pytest.raises(RequestError, match="3 prompts .3 outputs. can never be queued at once: at most 2"):
                Generation(llm, [[5, 6], [7, 8], [9, 10]], params, metrics, time.perf_counter())
            assert llm.load().running + llm.load().waiting == 1  # nothing of the refused requests was queued
            llm.abort(occupant)
            llm.engine.step = lambda chunks: (_ for _ in ()).throw(RuntimeError("device lost"))
            gate.set()
            while llm.load().running or llm.load().waiting:
                await asyncio.sleep(0.01)
            try:
                with pytest.raises(RuntimeError, match="device lost"):
                    await Generation(llm, [[5, 6]], params, metrics, time.perf_counter()).results()
            finally:
                llm.engine.step = step

        asyncio.run(refused_then_failed())
        assert (finished(metrics, "abort"), finished(metrics, "error")) == (0, 1)


def test_a_failed_request_of_n_sequences_counts_each_as_an_error(engine_dir, caplog):
    """Its first failed sequence counted as error and its siblings as abort (the client's): an error rate n times
    too low, and disconnects that never happened."""
    from camshaft.openai_server.generation import Generation
    from camshaft.openai_server.metrics import Metrics

    with camshaft.LLM(engine_dir) as llm:
        metrics = Metrics(llm)
        fail_step(llm, at=3)

        async def failed() -> None:
            params = camshaft.SamplingParams(max_tokens=20, ignore_eos=True, n=3)
            generation = Generation(llm, [[5, 6]], params, metrics, time.perf_counter(), log_id="cmpl-f")
            try:
                with pytest.raises(RuntimeError, match="device lost"):
                    await generation.results()
            finally:
                generation.abort()  # as the route does once the response is an error

        with caplog.at_level(logging.INFO, logger="camshaft.openai_server"):
            asyncio.run(failed())
        lines = [r.getMessage() for r in caplog.records if r.name == "camshaft.openai_server"]
        assert len(lines) == 1 and re.fullmatch(r"cmpl-f: failed after [0-9.]+ s, first token at [0-9.]+ s: 2 prompt "
                                                r"tokens, \d+ generated: device lost", lines[0]), lines
        counted = {reason: metrics.registry.get_sample_value("camshaft_request_success_total",
                                                             {"finished_reason": reason}) or 0
                   for reason in ("abort", "error")}
        assert counted == {"abort": 0, "error": 3}


def test_documents_reach_a_rag_template_from_the_python_api_and_the_server(engine_dir):
    """transformers passes apply_chat_template's documents to the template (Command-R's, Granite's); they were
    refused in chat_template_kwargs and dropped as a body field."""
    from fastapi.testclient import TestClient

    from camshaft.openai_server.app import create_app

    template = ("{% for d in documents or [] %}<doc>{{ d.title }}: {{ d.text }}</doc>{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    docs = [{"title": "geo", "text": "Paris is in France"}]
    messages = [{"role": "user", "content": "Where is Paris?"}]
    with camshaft.LLM(engine_dir, chat_template=template) as llm:
        text = llm.tokenizer.apply_chat_template(messages, documents=docs, tokenize=False)
        assert "<doc>geo: Paris is in France</doc>" in text
        expected = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert llm.encode(messages=messages, chat_template_kwargs={"documents": docs}) == expected
        with TestClient(create_app(llm, MODEL)) as http:
            for extra in ({"documents": docs}, {"chat_template_kwargs": {"documents": docs}}):
                body = http.post("/tokenize", json={"messages": messages, **extra}).json()
                assert body["tokens"] == expected, body
            twice = http.post("/tokenize", json={"messages": messages, "documents": docs,
                                                  "chat_template_kwargs": {"documents": docs}})
            assert twice.status_code == 400 and "documents are given twice" in twice.json()["error"]["message"]
            bad = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"documents": "x"}})
            assert bad.status_code == 400 and "documents is a list of objects" in bad.json()["error"]["message"]


def test_an_engine_chat_template_that_does_not_parse_is_the_servers_fault(engine_dir, tmp_path, capsys):
    """The README lets users edit tokenizer/chat_template.jinja: one that no longer parses is said by inspect, and
    chat requests answer 500 (the server's files), not 400 blaming the client's messages; completions still run."""
    import shutil

    from camshaft.runtime.engine_info import engine_info, info_lines

    copy = tmp_path / "engine"
    shutil.copytree(engine_dir, copy)
    (copy / "tokenizer" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
    info = engine_info(copy)
    assert info["runs_here"] and info["chat_template_problem"].startswith("line 1: Unexpected end of template")
    assert "chat template yes (does not parse, line 1: Unexpected end" in "\n".join(info_lines(info))
    with running_server(copy) as (url, _):
        chat = HTTP.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2})
        assert chat.status_code == 500 and chat.json()["error"]["type"] == "server_error"
        assert "this engine's chat template does not parse (line 1" in chat.json()["error"]["message"]
        tokenized = HTTP.post(url + "/tokenize", json={"messages": HI})
        assert tokenized.status_code == 500 and "does not parse" in tokenized.json()["error"]["message"]
        plain = HTTP.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert plain.status_code == 200
    assert "Traceback" not in capsys.readouterr().err  # an answer, not an application error logged
    (copy / "tokenizer" / "chat_template.jinja").write_text("")  # a copy cut short: "no tokens; pass some text"
    assert engine_info(copy)["chat_template_problem"] == "it is empty"
    empty = r"chat template \(tokenizer/chat_template.jinja\) is empty; restore it, rebuild the engine"
    with camshaft.LLM(copy) as llm, pytest.raises(camshaft.EngineError, match=empty):
        llm.chat(HI)


def test_the_shared_event_loop_neither_builds_a_whole_response_nor_drains_a_stream_without_pausing(served,
                                                                                                    monkeypatch):
    """n outputs with 20 log-probs each are seconds of work: built off the event loop every client shares (one
    request held /health 17 s); a stream's queued outputs are read without waiting, so each sent one pauses once
    (a gone client's drain held the loop 4 s)."""
    import asyncio

    from camshaft.openai_server.responses import CompletionShape
    from camshaft.openai_server.streaming import events

    built_on_loop, choice = [], CompletionShape.choice

    def recorded(self, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            built_on_loop.append(True)
        except RuntimeError:
            built_on_loop.append(False)
        return choice(self, *args, **kwargs)

    monkeypatch.setattr(CompletionShape, "choice", recorded)
    url, _ = served
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 2, "logprobs": 2}
    assert HTTP.post(url + "/v1/completions", json=body).status_code == 200
    assert built_on_loop == [False, False]

    class Queued:  # a generation whose outputs have all arrived
        num_choices, prompt_tokens = 1, 1

        async def __aiter__(self):
            for i in range(50):
                yield 0, types.SimpleNamespace(token_ids=[i], finished=i == 49)

        def abort(self):
            pass

    class Shape:
        shows_output = True

        def opening(self, n):
            return []

        def chunk_choice(self, index, output, with_logprobs):
            return {"index": index}

        def chunk(self, choices, usage=None, with_usage=False):
            return {"choices": choices}

    async def drain() -> int:
        others = 0

        async def other() -> None:
            nonlocal others
            while True:
                others += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        async for _ in events(Queued(), Shape(), False, None):
            pass
        task.cancel()
        return others

    assert asyncio.run(drain()) >= 50


def test_a_stats_line_says_the_throughput_and_load_while_there_is_any(engine_dir):
    """vLLM's periodic log line ("Avg prompt throughput: ... tokens/s, ... Running: N reqs"), none while idle."""
    from fastapi.testclient import TestClient

    from camshaft.openai_server.app import create_app
    from camshaft.openai_server.stats_log import StatsLog

    with camshaft.LLM(engine_dir) as llm:
        app = create_app(llm, "m")
        stats = StatsLog(llm, app.state.metrics, start=0.0, interval_s=10.0)
        assert stats.line(5.0) is None and stats.line(10.0) is None  # not due, then nothing ran
        done = TestClient(app).post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 6,
                                                             "ignore_eos": True})
        assert done.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
        assert stats.line(12.0) is None  # 2 s since the last line
        assert stats.line(30.0) == ("prompt 0.2 tokens/s, generation 0.3 tokens/s; running 0, waiting 0; KV cache "
                                    "0.0% used")
        assert stats.line(40.0) is None  # idle again


def test_log_lines_past_a_full_queue_are_dropped_and_counted():
    import os

    from camshaft.openai_server.log_writer import LogWriter

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:  # a pipe nobody reads: full
            os.write(write_end, b"." * 4096)
    os.set_blocking(write_end, True)
    writer = LogWriter(write_end, max_lines=2)
    logger = logging.getLogger("camshaft.test_log_writer")
    logger.addHandler(writer)
    logger.propagate = False
    try:
        for i in range(10):  # the thread blocks on the first, two wait, the rest are dropped
            logger.warning("line %d", i)
            time.sleep(0.01)
        assert writer.dropped == 7
        os.set_blocking(read_end, False)
        out = b""
        deadline = time.monotonic() + 10
        while b"line 2" not in out and time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                out += os.read(read_end, 1 << 16)
        logger.warning("later")
        while b"later" not in out and time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                out += os.read(read_end, 1 << 16)
        text = out.decode().lstrip(".")  # the note where the lines were lost: after 2, before "later"
        assert text.splitlines() == ["line 0", "line 1", "line 2", "(7 log line(s) dropped: stderr was not read)",
                                     "later"], text
    finally:
        logger.removeHandler(writer)
        os.close(read_end)
        os.close(write_end)
