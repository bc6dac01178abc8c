"""`camshaft bench serve`: target and SLO parsing, prompts sized by the tokenizer, Poisson arrivals, the metric
arithmetic on known timings, and a real run through an in-process LLM target with forced output lengths."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from camshaft.bench_serve.clients import Record, Target
from camshaft.bench_serve.report import Goodput, summarize
from camshaft.bench_serve.workload import arrival_times, load_requests, load_tokenizer, parse_rates
from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.cli import app
from camshaft.errors import RequestError

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_serve")
    model = make_tiny_model("llama", root / "hf")
    build_engine(BuildConfig(model, root / "engine", max_seq_len=256, max_num_tokens=64, max_batch_size=8))
    return root / "engine"


def test_targets_and_slos_parse_or_say_what_to_write():
    assert Target.parse("c=http://127.0.0.1:8000/v1/,backend=openai").url == "http://127.0.0.1:8000"  # a client's base
    t = Target.parse("camshaft=http://127.0.0.1:8000/,backend=openai,model=m")
    assert (t.name, t.url, t.backend, t.model) == ("camshaft", "http://127.0.0.1:8000", "openai", "m")
    assert Target.parse("t=127.0.0.1:8001,backend=triton-grpc").model is None
    for bad in ("nourl", "x=http://h,backend=vllm", "x=http://h", "x=http://h,backend=openai,color=red"):
        with pytest.raises(RequestError, match="NAME=URL,backend="):
            Target.parse(bad)
    with pytest.raises(RequestError, match="an llm target runs the engine directory it is given: drop model="):
        Target.parse("x=/engines/e,backend=llm,model=foo")
    assert Goodput.parse("ttft_ms=500,tpot_ms=50") == Goodput(ttft_ms=500, tpot_ms=50)
    with pytest.raises(RequestError, match="--goodput"):
        Goodput.parse("ttft=5")
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0,fast", "nan", "-inf"):
        with pytest.raises(RequestError, match="--request-rate"):
            parse_rates(bad)
    for bad in ("ttft_ms=nan", "e2e_ms=inf", "tpot_ms=0"):
        with pytest.raises(RequestError, match="--goodput"):
            Goodput.parse(bad)
    assert not Goodput().set and Goodput(e2e_ms=1.0).set


def test_poisson_arrivals_have_the_requested_rate():
    times = arrival_times(4000, 8.0, seed=1)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert 4000 / times[-1] == pytest.approx(8.0, rel=0.05)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(50, 2.0, seed=3) == arrival_times(50, 2.0, seed=3)


def test_synthetic_prompts_encode_to_about_the_requested_length(engine_dir):
    tokenizer = load_tokenizer(engine_dir)
    requests = load_requests("synthetic:in=NORMAL(60,5),out=UNIFORM(3,9)", 20, tokenizer, seed=2)
    for r in requests:
        assert r.prompt_tokens == len(tokenizer(r.prompt, add_special_tokens=False)["input_ids"])
        assert 3 <= r.max_tokens <= 9
    lengths = [r.prompt_tokens for r in requests]
    assert 40 <= np.mean(lengths) <= 75
    assert load_requests("decode-heavy", 2, tokenizer)[0].max_tokens == 256
    with pytest.raises(RequestError, match="--tokenizer"):
        load_requests("prefill-heavy", 2, None)


def test_synthetic_prompts_hold_no_special_token_text(engine_dir):
    """Tokens tokenizer.json marks special but all_special_tokens does not list (SmolLM2's <filename>, Gemma's
    <start_of_turn>) were taken as text pieces: 8 of them in 20 prompts of 400 tokens."""
    from tokenizers import AddedToken

    from camshaft.bench_serve import workload

    tokenizer = load_tokenizer(engine_dir)
    tokenizer.add_tokens([AddedToken("<filename>", special=True), AddedToken("<tool_call>", special=False)])
    assert "<filename>" not in tokenizer.all_special_tokens
    pieces = workload._text_pieces(tokenizer)
    assert "<filename>" not in pieces and "<tool_call>" in pieces  # plain added text stays



def test_a_deployed_repository_gives_its_engines_tokenizer(engine_dir, tmp_path):
    from camshaft.triton_repo.deploy import deploy_repository

    repo = deploy_repository(engine_dir, tmp_path / "repo")  # bench serve --tokenizer REPO, as its target serves
    assert load_tokenizer(repo).get_vocab() == load_tokenizer(engine_dir).get_vocab()
    import json

    from camshaft.triton_repo.deploy import MARKER

    record = json.loads((repo / MARKER).read_text())
    (repo / MARKER).write_text(json.dumps({**record, "engine_dir": str(tmp_path / "moved")}))
    with pytest.raises(RequestError, match="serves the engine .*moved, which has no tokenizer there"):
        load_tokenizer(repo)


def test_an_engines_tokenizer_is_checked_as_its_loaders_check_it(engine_dir, tmp_path):
    """Re-review: a chat template saved as UTF-16 ended bench serve in a UnicodeDecodeError traceback."""
    import shutil

    from camshaft.errors import EngineError

    copy = tmp_path / "engine"
    shutil.copytree(engine_dir, copy)
    (copy / "tokenizer" / "chat_template.jinja").write_text("{{ messages }}", encoding="utf-16")
    with pytest.raises(EngineError, match="chat_template.jinja is not UTF-8 text"):
        load_tokenizer(copy)


def test_jsonl_prompts_are_text_counted_by_the_tokenizer(engine_dir, tmp_path):
    tokenizer = load_tokenizer(engine_dir)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello there", "max_tokens": 7}) + "\n"
                    + json.dumps({"prompt": "a b c d", "max_tokens": 3}) + "\n")
    requests = load_requests(f"jsonl:{path}", 3, tokenizer)
    assert [(r.prompt, r.max_tokens) for r in requests] == [("hello there", 7), ("a b c d", 3), ("hello there", 7)]
    assert requests[1].prompt_tokens == len(tokenizer("a b c d", add_special_tokens=False)["input_ids"])
    path.write_text(json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}) + "\n")
    with pytest.raises(RequestError, match="text prompts"):
        load_requests(f"jsonl:{path}", 1, tokenizer)
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(RequestError, match="prompts.jsonl:1"):
        load_requests(f"jsonl:{path}", 1, tokenizer)


def test_metrics_follow_from_the_chunk_times():
    records = [Record(10, 3, sent=0.0, chunk_times=[0.1, 0.2, 0.4], text="abc", output_tokens=3, finished=True),
               Record(10, 3, sent=1.0, chunk_times=[1.3, 1.4, 1.5], text="abc", output_tokens=3, finished=True),
               Record(10, 3, sent=2.0, error="HTTP 503: busy")]
    result = summarize(Target.parse("t=http://h,backend=openai"), 2.0, None, records, 2.0, Goodput(ttft_ms=200))
    assert (result.completed, result.failed, result.errors) == (2, 1, {"HTTP 503: busy": 1})
    assert result.ttft_ms["mean"] == pytest.approx(200.0)
    assert result.tpot_ms["mean"] == pytest.approx((150.0 + 100.0) / 2)
    assert result.itl_ms["p50"] == pytest.approx(100.0)  # gaps 100, 200, 100, 100 ms
    assert result.e2e_ms["p50"] == pytest.approx(450.0)  # 400 and 500 ms
    assert result.output_tok_s == pytest.approx(3.0) and result.goodput_req_s == pytest.approx(0.5)
    errors = [Record(10, 3, error="HTTP 503: busy"), Record(10, 3, error="ConnectError: refused"),
              Record(10, 3, error="ConnectError: refused"), Record(10, 3)]  # the last: no output at all
    down = summarize(Target.parse("t=http://h,backend=openai"), 2.0, None, errors, 2.0, Goodput())
    assert down.errors == {"ConnectError: refused": 2, "HTTP 503: busy": 1, "no output": 1}  # most first
    assert "FAILED 4: ConnectError: refused (x2); HTTP 503: busy (x1); no output (x1)" in down.line()
    assert down.goodput_req_s is None and "goodput" not in down.line()  # no SLO: no goodput
    assert "TTFT p50/p99 —/— ms" in down.line()
    as_json = json.loads(json.dumps(down.to_dict(), allow_nan=False))  # strict JSON: no NaN
    assert as_json["ttft_ms"]["p50"] is None and as_json["errors"]["no output"] == 1


def test_an_openai_target_sends_the_api_key_from_the_environment(monkeypatch):
    """A server started with --api-key: the key in $OPENAI_API_KEY (as OpenAI's clients read it) is sent; without
    one, a 401 says what to set rather than asking whether the server is up."""
    import asyncio

    import httpx

    from camshaft.bench_serve.clients import OpenAIClient

    def server(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer sekret":
            return httpx.Response(401, json={"error": {"message": "unauthorized"}})
        if request.url.path == "/v1/models" and gateway:
            return httpx.Response(404)
        return httpx.Response(200, json={"data": [{"id": "served"}]})

    async def start(spec: str = "t=http://h,backend=openai") -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            client = OpenAIClient(Target.parse(spec), http)
            await client.start()
            return client.model

    gateway = False
    for name in ("OPENAI_API_KEY", "CAMSHAFT_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RequestError, match="wants an API key: set CAMSHAFT_API_KEY"):
        asyncio.run(start())
    monkeypatch.setenv("OPENAI_API_KEY", "sekret")
    assert asyncio.run(start()) == "served"
    monkeypatch.setenv("CAMSHAFT_API_KEY", "wrong")  # camshaft serve's own variable wins over a shell's OpenAI key
    with pytest.raises(RequestError, match=r"refused the API key from \$CAMSHAFT_API_KEY"):
        asyncio.run(start())
    monkeypatch.setenv("CAMSHAFT_API_KEY", "sekret")
    gateway = True  # a target naming its model needs no /v1/models
    assert asyncio.run(start("t=http://h,backend=openai,model=m")) == "m"


def stream_record(body: str) -> Record:
    """What OpenAIClient makes of a server-sent-event body."""
    import asyncio

    import httpx

    from camshaft.bench_serve.clients import OpenAIClient
    from camshaft.bench_serve.workload import ServeRequest

    async def run() -> Record:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as http:
            record = Record(3, 32, sent=0.0)
            await OpenAIClient(Target.parse("t=http://h,backend=openai,model=m"), http)(ServeRequest("hi", 3, 32),
                                                                                          record)
            return record

    return asyncio.run(run())


def test_an_openai_event_with_empty_text_is_output():
    """A server holding back bytes that are not yet UTF-8 sends a chunk with empty text: a token still arrived."""
    events = [{"choices": [{"index": 0, "text": ""}]}, {"choices": [{"index": 0, "text": "", "finish_reason":
              "length"}]}, {"choices": [], "usage": {"completion_tokens": 2}}]
    record = stream_record("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")
    assert record.ok and len(record.chunk_times) == 2 and record.output_tokens == 2


def test_output_is_counted_as_it_came_and_a_cut_stream_fails():
    """No usage reported: the output events are counted, not max_tokens assumed (a server that stops early would
    read as fast); a stream that ends without [DONE] was cut short and fails."""
    events = "".join(f"data: {json.dumps({'choices': [{'index': 0, 'text': t}]})}\n\n" for t in "abc")
    done, cut = stream_record(events + "data: [DONE]\n\n"), stream_record(events)
    result = summarize(Target.parse("t=http://h,backend=openai"), 1.0, None, [done, cut], 1.0, Goodput())
    assert result.output_tokens == 3 and result.completed == 1
    assert result.errors == {"the stream ended before its end marker": 1}


def test_without_usage_the_tokenizer_counts_chunks_of_several_tokens(engine_dir):
    """A server that sends no usage and several tokens a chunk: the text's tokens count (as vLLM's benchmark
    does), not the chunks."""
    from camshaft.bench_serve.run import count_output_tokens

    tokenizer = load_tokenizer(engine_dir)
    chunks = ["abcd", "efgh", "ijkl"]
    body = "".join(f"data: {json.dumps({'choices': [{'index': 0, 'text': t}]})}\n\n" for t in chunks)
    record = stream_record(body + f"data: {json.dumps({'choices': [{'index': 0, 'text': ''}]})}\n\ndata: [DONE]\n\n")
    assert record.ok and record.tokens == 4  # the chunks, the empty finishing one included
    count_output_tokens([record], tokenizer)
    assert record.tokens == len(tokenizer("abcdefghijkl", add_special_tokens=False)["input_ids"]) == 12


def test_a_mid_stream_error_as_a_string_is_reported():
    """TGI streams {"error": "...", "error_type": ...}: its message is the failure, not an AttributeError."""
    event = {"error": "Input validation error: too long", "error_type": "validation"}
    record = stream_record(f"data: {json.dumps({'choices': [{'index': 0, 'text': 'a'}]})}\n\n"
                           f"data: {json.dumps(event)}\n\n")
    assert not record.ok and record.failure == "Input validation error: too long"


def test_bench_serve_runs_the_same_requests_through_each_target(engine_dir, tmp_path, monkeypatch):
    import sys

    from typer.testing import CliRunner

    monkeypatch.setitem(sys.modules, "httpx", None)  # in-process targets need no HTTP client (the serve extra's)
    from camshaft.bench_serve import report

    drawn = {}

    def save_figure(fig, path, title):  # what the plot draws, then the real file
        drawn.update({line.get_label(): list(line.get_xdata()) for line in fig.axes[0].get_lines()})
        real_save_figure(fig, path, title)

    real_save_figure = report.save_figure
    monkeypatch.setattr(report, "save_figure", save_figure)
    out = tmp_path / "serve.json"
    result = CliRunner().invoke(app, [
        "bench", "serve", "--target", f"first={engine_dir},backend=llm", "--target", f"second={engine_dir},backend=llm",
        "--dataset", "synthetic:in=30,out=12", "--num-requests", "12", "--request-rate", "50,inf",
        "--concurrency", "2,4", "--threads", "1", "--output-json", str(out), "--plot", str(tmp_path / "serve.png")])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["results"]
    assert [(r["concurrency"], r["request_rate"], r["target"]) for r in runs] == [
        (c, rate, name) for c in (2, 4) for rate in (50.0, "inf") for name in ("first", "second")]
    for r in runs:
        assert (r["completed"], r["failed"], r["output_tokens"]) == (12, 0, 12 * 12)
        assert 0 < r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert r["prompt_tokens"] > 12 * 30  # counted as sent: each run's salt leads its prompts
        assert r["goodput_req_s"] is None
        each = r["requests"]  # the percentiles follow from each request's numbers
        assert len(each) == 12 and sum(q["output_tokens"] for q in each) == r["output_tokens"]
        assert np.percentile([q["ttft_ms"] for q in each], 50) == pytest.approx(r["ttft_ms"]["p50"])
        assert np.percentile([x for q in each for x in q["itl_ms"]], 99) == pytest.approx(r["itl_ms"]["p99"])
    settings = json.loads(out.read_text())
    assert settings["request_rate"] == [50.0, "inf"] and settings["warmup"] == 2 and settings["goodput"] is None
    assert [(t["name"], t["backend"], t["threads"]) for t in settings["targets"]] == [("first", "llm", 1),
                                                                                       ("second", "llm", 1)]
    from camshaft.manifest import read_manifest  # the build each engine held as the run began
    assert {t["build_id"] for t in settings["targets"]} == {read_manifest(engine_dir).build_id}
    assert settings["machine"]["available_cores"] >= 1
    assert "first: 12 requests, rate 50/s, concurrency 2" in result.output  # progress as each run starts
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    # one line per target and concurrency limit, through its request rates (not one line zigzagging through both)
    assert sorted(drawn) == ["first, C=2", "first, C=4", "second, C=2", "second, C=4"]
    for label, xs in drawn.items():
        name, limit = label.split(", C=")
        assert sorted(xs) == sorted(r["output_tok_s"] for r in runs if r["target"] == name
                                    and r["concurrency"] == int(limit))


def test_a_dataset_longer_than_an_engine_is_refused_before_the_run(engine_dir, capsys):
    from test_cli import camshaft

    code, _, err = camshaft(capsys, "bench", "serve", "--target", f"t={engine_dir},backend=llm", "--dataset",
                            "decode-heavy", "--num-requests", "2", "--warmup", "0")
    err = " ".join(err.split())
    assert code == 1 and "does not fit target t's context of 256 tokens" in err, err
    assert "synthetic:in=NORMAL(128,12),out=64" in err and "Traceback" not in err
    # 250 tokens fit 256 as they are, not with the salt each run puts before them: refused before any request
    code, out, err = camshaft(capsys, "bench", "serve", "--target", f"t={engine_dir},backend=llm", "--dataset",
                              "synthetic:in=200,out=50", "--num-requests", "2", "--warmup", "0")
    assert code == 1 and "with the run's salt" in " ".join(err.split()) and "FAILED" not in out, err
    for flag, value in (("--request-rate", "nan"), ("--goodput", "ttft_ms=nan")):
        code, _, err = camshaft(capsys, "bench", "serve", "--target", f"t={engine_dir},backend=llm",
                                "--num-requests", "2", flag, value)
        assert code == 1 and flag in err, err


def test_an_openai_target_is_checked_against_its_context_and_counts_prompts_by_its_usage(engine_dir, tmp_path,
                                                                                       capsys):
    """The server's /v1/models says max_model_len: a dataset longer is refused before any request, as for an
    in-process engine; without a tokenizer, the prompts' tokens are the server's usage counts, not 0."""
    from test_cli import camshaft
    from test_openai_server import running_server

    with running_server(engine_dir) as (url, _):
        code, out, err = camshaft(capsys, "bench", "serve", "--target", f"o={url},backend=openai", "--tokenizer",
                                  engine_dir, "--dataset", "decode-heavy", "--num-requests", "2", "--warmup", "0")
        assert code == 1 and "does not fit target o's context of 256 tokens" in " ".join(err.split()), err
        assert "FAILED" not in out
        data = tmp_path / "prompts.jsonl"
        data.write_text(json.dumps({"prompt": "tell me about gears", "max_tokens": 3}) + "\n")
        code, _, err = camshaft(capsys, "bench", "serve", "--target", f"o={url},backend=openai", "--dataset",
                                f"jsonl:{data}", "--num-requests", "1", "--warmup", "0", "--output-json",
                                tmp_path / "o.json")
    assert code == 0, err
    (run,) = json.loads((tmp_path / "o.json").read_text())["results"]
    assert run["prompt_tokens"] == run["requests"][0]["prompt_tokens"] > 5 and run["output_tokens"] == 3


def test_a_jsonl_dataset_shorter_than_the_run_repeats_with_a_note(engine_dir, tmp_path, capsys):
    """Repeated prompts hit the prefix cache: said, and the GFLOP/s count only what was computed."""
    from test_cli import camshaft

    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "hello " * 40, "max_tokens": 4}) + "\n")
    out = tmp_path / "t.json"
    code, _, err = camshaft(capsys, "bench", "throughput", "--engine", str(engine_dir), "--dataset", f"jsonl:{data}",
                            "--num-requests", "3", "--concurrency", "1", "--output-json", str(out))
    assert code == 0 and "holds 1 request(s); 3 requests repeat them" in " ".join(err.split()), err
    (run,) = json.loads(out.read_text())["results"]
    assert run["prefix_hits"] > 0
    assert run["gflop"]["tokens_fed"] < run["prompt_tokens"] + 3 * (4 - 1)  # the reused prompt blocks not counted
    code, _, err = camshaft(capsys, "bench", "throughput", "--engine", str(engine_dir), "--dataset",
                            f"jsonl:{tmp_path / 'missing.jsonl'}", "--num-requests", "1", "--concurrency", "1")
    assert code == 1 and "missing.jsonl" in err and "concurrency 1 (1/1)" not in err, err  # before the engine loads


def test_bench_serve_reads_triton_token_counts(engine_dir, tmp_path):
    """Both Triton clients against a real tritonserver: every request completes and the token counts are the
    server's (num_output_tokens), which equal what was asked for since min_tokens forces the length."""
    from typer.testing import CliRunner

    from camshaft.triton_repo.deploy import deploy_repository
    from camshaft.triton_repo.server import TritonServer

    out = tmp_path / "serve.json"
    with TritonServer(deploy_repository(engine_dir, tmp_path / "repo")) as server:
        e = server.endpoints
        result = CliRunner().invoke(app, [
            "bench", "serve", "--target", f"http=http://{e.http},backend=triton-generate",
            "--target", f"grpc={e.grpc},backend=triton-grpc", "--dataset", "synthetic:in=20,out=6",
            "--num-requests", "6", "--request-rate", "inf", "--concurrency", "3", "--output-json", str(out),
            "--tokenizer", str(engine_dir / "tokenizer")])
        wrong = CliRunner().invoke(app, [
            "bench", "serve", "--target", f"grpc={e.grpc},backend=triton-grpc,model=nope", "--dataset",
            "synthetic:in=20,out=6", "--num-requests", "1", "--tokenizer", str(engine_dir / "tokenizer")])
        assert server.stop() == 0  # the clients' streams closed, none cancelled once answered: nothing kept loaded
    assert result.exit_code == 0, result.output
    said = str(wrong.exception)  # the model is named, not the server blamed as down
    assert wrong.exit_code == 1 and "serves no model 'nope'" in said and "is the server up" not in said, said
    for r in json.loads(out.read_text())["results"]:
        assert (r["completed"], r["failed"], r["output_tokens"]) == (6, 0, 36), (r["target"], r["errors"])


def test_a_concurrency_sweep_at_one_rate_plots_a_line_through_its_limits():
    """Review: scripts/bench_serve.py's sweep (C = 1, 8, 32 at rate inf) drew six unconnected points, each labelled
    'inf/s'; a grid of rates and limits keeps a line per limit through the rates."""
    from types import SimpleNamespace

    from camshaft.bench_serve.report import series

    def run(target, limit, rate, tok_s):
        return SimpleNamespace(target=target, concurrency=limit, request_rate=rate, output_tok_s=tok_s)

    sweep = [run(t, c, math.inf, c * k) for t, k in (("a", 1.0), ("b", 2.0)) for c in (8, 1, 32)]
    lines = series(sweep)
    assert [(label, [r.concurrency for r in points]) for label, points, _ in lines] == [("a", [1, 8, 32]),
                                                                                       ("b", [1, 8, 32])]
    assert [lines[0][2](r) for r in lines[0][1]] == ["C=1", "C=8", "C=32"]
    grid = [run("a", c, rate, (c or 10) * rate) for c in (2, None) for rate in (50.0, 5.0)]
    lines = series(grid)
    assert [(label, [r.request_rate for r in points]) for label, points, _ in lines] == [("a, C=2", [5.0, 50.0]),
                                                                                        ("a, C=inf", [5.0, 50.0])]
    assert lines[0][2](lines[0][1][0]) == "5/s"
    (only,) = series([run("a", None, 2.0, 1.0), run("a", None, 8.0, 3.0)])
    assert only[0] == "a" and [only[2](r) for r in only[1]] == ["2/s", "8/s"]


def test_labels_of_points_close_together_are_drawn_once():
    """Review of docs/bench/serve-decode-heavy.png: four lines through the same rates wrote '0.5/s' and 'inf/s' four
    times each into one blot; a label is drawn once per cluster, above it, and still at each point far apart."""
    from camshaft.bench_serve.report import labels_apart

    cluster = [("inf/s", 193.0, 3060.0), ("inf/s", 198.0, 2950.0), ("0.5/s", 84.0, 390.0), ("0.5/s", 84.5, 350.0)]
    assert labels_apart(cluster) == [("inf/s", 193.0, 3060.0), ("0.5/s", 84.0, 390.0)]
    apart = [("C=1", 40.0, 250.0), ("C=1", 200.0, 3000.0), ("C=8", 40.5, 260.0)]
    assert labels_apart(apart) == [("C=1", 200.0, 3000.0), ("C=8", 40.5, 260.0), ("C=1", 40.0, 250.0)]
    assert labels_apart([]) == []
    failed = ("0.5/s", 0.0, math.nan)  # a point whose requests all failed (re-review: its NaN turned merging off)
    assert labels_apart([failed, *cluster]) == labels_apart(cluster)
