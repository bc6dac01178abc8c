"""The throughput benchmark on a tiny engine: dataset specs (good and bad), and a closed-loop run that returns every
request with consistent counts and ordered percentiles."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import RequestError
from camshaft.manifest import read_manifest
from camshaft.runtime import throughput
from camshaft.runtime.bench_data import BenchRequest, load_dataset, parse_dataset_spec, read_jsonl_requests
from camshaft.runtime.flops import count_flops
from camshaft.runtime.llm import LLM
from camshaft.runtime.throughput import run_throughput, throughput_benchmark

from tiny_models import make_tiny_model

MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("throughput")
    model = make_tiny_model("llama", root / "hf")
    build_engine(BuildConfig(model, root / "engine", max_seq_len=MAX_SEQ_LEN, max_num_tokens=64, kv_block_size=16,
                             max_batch_size=8))
    return root / "engine"


def test_synthetic_spec_is_seeded_and_clipped():
    spec = "synthetic:in=NORMAL(200,50),out=NORMAL(128,32)"
    parsed = parse_dataset_spec(spec)
    assert str(parsed) == spec
    a = load_dataset(spec, 50, max_seq_len=MAX_SEQ_LEN, vocab_size=300, seed=3)
    b = load_dataset(spec, 50, max_seq_len=MAX_SEQ_LEN, vocab_size=300, seed=3)
    assert a == b and len(a) == 50
    assert a != load_dataset(spec, 50, max_seq_len=MAX_SEQ_LEN, vocab_size=300, seed=4)
    for r in a:
        assert 1 <= len(r.prompt_ids) and 1 <= r.max_tokens and len(r.prompt_ids) + r.max_tokens <= MAX_SEQ_LEN
        assert all(0 <= t < 300 for t in r.prompt_ids)
    const = load_dataset("synthetic:in=7,out=CONST(3)", 4, max_seq_len=64, vocab_size=300)
    assert [(len(r.prompt_ids), r.max_tokens) for r in const] == [(7, 3)] * 4
    uniform = load_dataset("synthetic:out=UNIFORM(2,5), in=UNIFORM(1,3)", 200, max_seq_len=64, vocab_size=300)
    assert {len(r.prompt_ids) for r in uniform} == {1, 2, 3} and {r.max_tokens for r in uniform} == {2, 3, 4, 5}


@pytest.mark.parametrize("spec, message", [
    ("synthetic:in=NORMAL(200,50)", "lacks out="),
    ("synthetic:in=NORMAL(200),out=5", "takes two values"),
    ("synthetic:in=GAUSS(1,2),out=5", "cannot read the prompt length"),
    ("synthetic:in=5,out=5,in=6", "given twice"),
    ("synthetic:in=5,len=5", "cannot read 'len=5'"),
    ("synthetic:in=UNIFORM(9,3),out=5", "low <= high"),
    ("synthetic:in=0,out=5", "1..1e\\+09"),
    ("synthetic:in=CONST(1e30),out=2", "reaches past 1e\\+09 tokens"),
    ("synthetic:in=NORMAL(200,1e300),out=2", "reaches past"),
    ("synthetic:in=100000000000000000000,out=2", "1..1e\\+09"),
    ("synthetic:in=UNIFORM(1.5,1.6),out=2", "whole lengths"),
    ("sharegpt", "unknown dataset spec"),
    ("jsonl:/nonexistent/file.jsonl", "does not exist"),
])
def test_bad_specs_are_refused_clearly(spec, message):
    with pytest.raises(RequestError, match=message):
        load_dataset(spec, 4, max_seq_len=64, vocab_size=300)


def test_normal_draws_below_one_run_as_one_and_count_as_clipped():
    from camshaft.runtime.throughput_report import clipped_lines, clipped_requests

    rows = load_dataset("synthetic:in=NORMAL(10,100),out=2", 50, max_seq_len=400, vocab_size=300, seed=0)
    low = [r for r in rows if r.asked is not None]
    assert low and all(len(r.prompt_ids) == 1 and r.asked[0] == 0 for r in low)
    clipped = clipped_requests(rows, 400)
    assert clipped["count"] == 0 and clipped["raised_to_one"] == len(low)  # none too long: no advice to rebuild
    assert clipped_lines(clipped) == [f"note: {len(low)} of 50 requests drew a length below 1 token (a NORMAL "
                                      "distribution's tail) and ran with 1"]
    both = load_dataset("synthetic:in=NORMAL(2,20),out=64", 40, max_seq_len=64, vocab_size=300, seed=0)
    cut = [r for r in both if r.max_tokens < 64]  # a prompt raised to 1 leaves 63 for the output: cut too
    clipped = clipped_requests(both, 64)
    assert cut and clipped["count"] == len(cut) and clipped["output_tokens"]["asked"] == 64 * len(cut)
    assert clipped["raised_to_one"] == sum(min(r.asked) < 1 for r in both if r.asked)


@pytest.mark.parametrize("max_tokens", ["Infinity", "1e400", "2.9", '"7"', "true", "0"])
def test_jsonl_max_tokens_must_be_a_whole_number(tmp_path, max_tokens):
    path = tmp_path / "data.jsonl"
    path.write_text(f'{{"prompt": [5, 6], "max_tokens": {max_tokens}}}\n')
    with pytest.raises(RequestError, match="data.jsonl:1: max_tokens must be a whole number"):
        load_dataset(str(path), 1, max_seq_len=64, vocab_size=300)
    path.write_text('{"prompt": [true, false], "max_tokens": 2}\n')
    with pytest.raises(RequestError, match="prompt must be text or token ids"):
        load_dataset(str(path), 1, max_seq_len=64, vocab_size=300)
    path.write_text("[" * 100_000 + "\n")  # nested past the recursion limit: a line that is not a request
    with pytest.raises(RequestError, match="data.jsonl:1: expected"):
        load_dataset(str(path), 1, max_seq_len=64, vocab_size=300)


def test_attention_flops_of_sliding_layers_stop_at_the_window(engine_dir):
    from dataclasses import replace

    manifest = read_manifest(engine_dir)
    m = manifest.model
    requests = [BenchRequest(list(range(3, 13)), 3)]  # 12 tokens fed: token p attends to p keys, or the window's
    full = count_flops(manifest, requests)["attention"]
    assert full == 4 * m.num_heads * m.head_dim * m.num_layers * sum(range(1, 13))
    sliding = replace(manifest, model=replace(m, layer_types=("sliding",) + m.layer_types[1:], sliding_window=4))
    per_layer = 4 * m.num_heads * m.head_dim
    assert count_flops(sliding, requests)["attention"] == full - per_layer * (sum(range(1, 13)) - (10 + 8 * 4))


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": [5, 6, 7], "max_tokens": 4}) + "\n\n"
                    + json.dumps({"prompt": list(range(3, 100)), "max_tokens": 50}) + "\n")
    rows = load_dataset(str(path), 3, max_seq_len=64, vocab_size=300)
    assert rows[0] == rows[2] == BenchRequest([5, 6, 7], 4)
    assert len(rows[1].prompt_ids) == 63 and rows[1].max_tokens == 1  # clipped to the engine's max_seq_len
    exported = tmp_path / "exported.jsonl"  # json.dumps(ensure_ascii=False) keeps U+2028 raw; a BOM, CRLF
    exported.write_bytes(b"\xef\xbb\xbf" + '{"prompt": [5, 6], "max_tokens": 2}\r\n{"prompt": "a\u2028b\u0085", '
                         '"max_tokens": 3}\r\n'.encode())
    assert read_jsonl_requests(exported) == [([5, 6], 2), ("a\u2028b\u0085", 3)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1, 2]}\n')
    with pytest.raises(RequestError, match="bad.jsonl:1"):
        load_dataset(f"jsonl:{bad}", 1, max_seq_len=64, vocab_size=300)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"prompt": "caf\xe9", "max_tokens": 2}\n')
    with pytest.raises(RequestError, match="binary.jsonl is not UTF-8 text"):
        load_dataset(f"jsonl:{binary}", 1, max_seq_len=64, vocab_size=300)
    text = tmp_path / "text.jsonl"
    text.write_text('{"prompt": "hello", "max_tokens": 2}\n')
    with pytest.raises(RequestError, match="tokenizer"):
        load_dataset(f"jsonl:{text}", 1, max_seq_len=64, vocab_size=300)


def test_flops_leave_out_only_what_the_prefix_cache_saved(engine_dir):
    """A repeated prompt's cached blocks are not counted; a preempted request readmitted onto its own cached blocks
    computed them once, so they are (the count is of computing each request once)."""
    from camshaft.runtime.kv_cache import bytes_per_block

    manifest = read_manifest(engine_dir)
    requests = load_dataset("synthetic:in=48,out=40", 4, max_seq_len=MAX_SEQ_LEN,
                            vocab_size=manifest.model.vocab_size, seed=7)
    once = count_flops(manifest, requests)["tokens_fed"]
    with LLM(engine_dir, threads=1, kv_cache_memory=8 * bytes_per_block(manifest), policy="max_utilization") as llm:
        tight = run_throughput(llm, requests, concurrency=4)
    assert tight.preemptions > 0 and tight.gflop["tokens_fed"] == once
    with LLM(engine_dir, threads=1) as llm:
        repeated = run_throughput(llm, [requests[0]] * 3, concurrency=1)
    # the 2nd and 3rd take 2 of the 1st's 3 prompt blocks (the last prompt token is always computed: its logits)
    assert repeated.prefix_hits == 2 * 2
    assert repeated.gflop["tokens_fed"] == 3 * (48 + 40 - 1) - 2 * 32


def test_run_returns_every_request_with_sane_metrics(engine_dir):
    with LLM(engine_dir, threads=1) as llm:
        requests = load_dataset("synthetic:in=NORMAL(40,20),out=NORMAL(12,6)", 12, max_seq_len=MAX_SEQ_LEN,
                                vocab_size=llm.engine.manifest.model.vocab_size, seed=1)
        result = run_throughput(llm, requests, concurrency=4, keep_token_ids=True)
        assert result.num_requests == len(result.records) == 12
        assert [len(r.token_times) for r in result.records] == [r.max_tokens for r in requests]
        assert [len(r.token_ids) for r in result.records] == [r.max_tokens for r in requests]
        assert result.output_tokens == sum(r.max_tokens for r in requests)
        assert result.prompt_tokens == sum(len(r.prompt_ids) for r in requests)
        assert 1 < result.peak_batch_size <= 4 and 0 < result.peak_kv_usage <= 1
        # every token fed through the model: prompt + output - 1 per request, as counted for the FLOPs
        assert sum(s.num_tokens for s in llm.stats) == count_flops(llm.engine.manifest, requests)["tokens_fed"]
        for metric in (result.ttft_ms, result.itl_ms, result.e2e_ms):
            assert 0 <= metric["p50"] <= metric["p90"] <= metric["p99"]
        assert result.ttft_ms["p50"] <= result.e2e_ms["p50"]
        assert result.output_tok_s > 0 and result.requests_s > 0 and result.gflop_s > 0
        assert result.python_overhead["all_steps"]["steps"] > 0
        assert result.num_steps == len(llm.stats)
        assert 0 <= result.python_overhead["all_steps"]["outside_engine_step"] < 1
        assert llm.executor.scheduler.blocks.num_used == 0
        assert llm.engine.step.__name__ == "step"  # the timing wrappers are removed again


def test_a_long_lived_llm_still_counts_a_runs_steps(engine_dir):
    """The stats keep the latest steps only (a server runs for days); a run's step count and peak KV use come from
    counters, not from that window (with a full window they read 0)."""
    from collections import deque

    with LLM(engine_dir, threads=1) as llm:
        requests = load_dataset("synthetic:in=NORMAL(40,20),out=NORMAL(12,6)", 8, max_seq_len=MAX_SEQ_LEN,
                                vocab_size=llm.engine.manifest.model.vocab_size, seed=2)
        run_throughput(llm, requests, concurrency=4)
        llm.executor.stats = deque(llm.executor.stats, maxlen=5)  # as full as after days of serving
        again = run_throughput(llm, requests, concurrency=4)
        assert len(llm.stats) == 5 and again.num_steps > 5 and again.peak_kv_usage > 0


def test_benchmark_runs_a_sweep(engine_dir):
    results = throughput_benchmark(engine_dir, "synthetic:in=20,out=5", 6, [1, 3], threads=1)
    assert [r.concurrency for r in results] == [1, 3]
    assert all(r.num_requests == 6 and r.output_tokens == 30 for r in results)
    assert results[0].peak_batch_size == 1
    with pytest.raises(RequestError, match="exceeds the batch size"):
        throughput_benchmark(engine_dir, "synthetic:in=20,out=5", 6, 9, threads=1)

    def no_llm(*_args, **_kwargs):
        raise AssertionError("an LLM was loaded before the levels were checked")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(throughput, "LLM", no_llm)
        with pytest.raises(RequestError, match="concurrency 9 exceeds the batch size 2"):  # before level 1 runs
            throughput_benchmark(engine_dir, "synthetic:in=20,out=5", 6, [1, 9], threads=1, max_batch_size=2)
    assert throughput_benchmark(engine_dir, "synthetic:in=20,out=2", np.int64(2), np.int64(1), threads=1, warmup=0)


def test_cli_bench_throughput(engine_dir, tmp_path):
    from typer.testing import CliRunner

    from camshaft.cli import app

    out = tmp_path / "tp.json"
    result = CliRunner().invoke(app, ["bench", "throughput", "--engine", str(engine_dir), "--dataset",
                                      "synthetic:in=NORMAL(20,5),out=4", "--num-requests", "4", "--concurrency", "1,2",
                                      "--threads", "1", "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    assert "concurrency   1:" in result.output and "concurrency   2:" in result.output
    data = json.loads(out.read_text())
    assert [r["concurrency"] for r in data["results"]] == [1, 2]
    assert (data["threads"], data["warmup"]) == (1, 2)  # what the numbers depend on, in the file
    printed = [re.search(r"TTFT p50/p90/p99 ([\d.]+)/.* E2E p50 ([\d.]+) s", line)
               for line in result.output.splitlines() if line.startswith("concurrency")]
    for match, r in zip(printed, data["results"], strict=True):  # a fast engine's sub-millisecond TTFT is not "0"
        assert float(match[1]) == pytest.approx(r["ttft_ms"]["p50"], rel=0.06)
        assert float(match[2]) == pytest.approx(r["e2e_ms"]["p50"] / 1000, rel=0.06)
    assert all(len(r["requests"]) == 4 and r["output_tokens"] == 16 for r in data["results"])
    for r in data["results"]:  # the percentiles follow from each request's numbers
        assert all(len(q["itl_ms"]) == q["output_tokens"] - 1 for q in r["requests"])
        gaps = [x for q in r["requests"] for x in q["itl_ms"]]
        assert np.percentile(gaps, 90) == pytest.approx(r["itl_ms"]["p90"])
    bad = CliRunner().invoke(app, ["bench", "throughput", "--engine", str(engine_dir), "--dataset", "nope"])
    assert bad.exit_code != 0
    zero = CliRunner().invoke(app, ["bench", "throughput", "--engine", str(engine_dir), "--concurrency", "0"])
    assert zero.exit_code != 0 and "positive integers" in str(zero.exception)


def test_clipped_requests_are_counted_with_what_they_asked(tmp_path):
    from camshaft.runtime.throughput_report import clipped_requests

    rows = load_dataset("synthetic:in=CONST(5000),out=CONST(5)", 2, max_seq_len=64, vocab_size=300)
    assert [(len(r.prompt_ids), r.max_tokens, r.asked) for r in rows] == [(63, 1, (5000, 5))] * 2
    assert clipped_requests(rows, 64) == {"count": 2, "of": 2, "max_seq_len": 64,
                                          "prompt_tokens": {"asked": 10000, "run": 126},
                                          "output_tokens": {"asked": 10, "run": 2}, "raised_to_one": 0}
    fitting = load_dataset("synthetic:in=10,out=5", 3, max_seq_len=64, vocab_size=300)
    assert clipped_requests(fitting, 64) is None
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": [5, 6], "max_tokens": 4}) + "\n"
                    + json.dumps({"prompt": list(range(3, 100)), "max_tokens": 50}) + "\n")
    clipped = clipped_requests(load_dataset(f"jsonl:{path}", 2, max_seq_len=64, vocab_size=300), 64)
    assert clipped["count"] == 1 and clipped["prompt_tokens"] == {"asked": 97, "run": 63}


def test_cli_reports_clipping_and_prints_no_nan(engine_dir, tmp_path):
    from typer.testing import CliRunner

    from camshaft.cli import app

    out = tmp_path / "clip.json"
    result = CliRunner().invoke(app, ["bench", "throughput", "--engine", str(engine_dir), "--dataset",
                                      "synthetic:in=CONST(5000),out=CONST(5)", "--num-requests", "1",
                                      "--concurrency", "1", "--threads", "1", "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stderr.count(f"1 of 1 requests did not fit the engine's max_seq_len {MAX_SEQ_LEN}") == 2  # before
    assert "warning" not in result.stdout and "GFLOP/s" in result.stdout  # stdout: the results alone
    assert f"prompt tokens 5000 -> {MAX_SEQ_LEN - 1}, output tokens 5 -> 1" in result.output
    assert "ITL p50/p90/p99 —/—/— ms" in result.output and "nan" not in result.output
    data = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    (run,) = data["results"]
    assert run["clipped"]["count"] == 1 and run["clipped"]["prompt_tokens"] == {"asked": 5000, "run": MAX_SEQ_LEN - 1}
    assert run["itl_ms"]["p50"] is None and run["ttft_ms"]["p50"] > 0


def test_cli_bench_throughput_runs_at_the_batch_size_by_default(engine_dir):
    """The default concurrency (32) refused every engine of a smaller batch before any work."""
    from typer.testing import CliRunner

    from camshaft.cli import app

    result = CliRunner().invoke(app, ["bench", "throughput", "--engine", str(engine_dir), "--dataset",
                                      "synthetic:in=8,out=2", "--num-requests", "2", "--threads", "1",
                                      "--max-batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert "concurrency 2 (1/1): 2 requests" in result.stderr


def test_cli_bench_throughput_sets_the_llm_like_serve(engine_dir, tmp_path):
    from typer.testing import CliRunner

    from camshaft.cli import app
    from camshaft.manifest import read_manifest
    from camshaft.runtime.kv_cache import bytes_per_block

    block = bytes_per_block(read_manifest(engine_dir))
    out = tmp_path / "opts.json"
    args = ["bench", "throughput", "--engine", str(engine_dir), "--dataset", "synthetic:in=40,out=4",
            "--num-requests", "4", "--concurrency", "2", "--threads", "1", "--policy", "max_utilization",
            "--kv-cache-memory", f"{block * 12 / 1024}KiB", "--max-batch-size", "2", "--max-num-tokens", "16",
            "--output-json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "policy max_utilization, max batch size 2, max num tokens 16, KV pool 11 blocks" in result.output
    data = json.loads(out.read_text())
    assert data["options"] == {"policy": "max_utilization", "kv_cache_memory": f"{block * 12 / 1024}KiB",
                               "max_batch_size": 2, "max_num_tokens": 16, "prompt_lookup": 0}
    (run,) = data["results"]
    assert run["config"] == {"policy": "max_utilization", "max_batch_size": 2, "max_num_tokens": 16,
                             "prompt_lookup": 0, "kv_pool_blocks": 11, "kv_pool_bytes": 12 * block}
    assert (run["draft_tokens"], run["accepted_draft_tokens"]) == (0, 0)
    assert run["peak_batch_size"] <= 2 and run["output_tokens"] == 16
    # 40-token prompts under a 16-token budget: prefill is chunked
    assert run["num_steps"] >= -(-run["gflop"]["tokens_fed"] // 16)


def test_cli_bench_throughput_measures_prompt_lookup(engine_dir, tmp_path):
    """--prompt-lookup N runs the LLM with drafts (as serve and deploy take it); each level reports the drafts fed
    and taken, counted by the batch loop."""
    from typer.testing import CliRunner

    from camshaft.cli import app

    data = tmp_path / "repeats.jsonl"
    data.write_text("".join(json.dumps({"prompt": list(range(3, 120)) * 2, "max_tokens": 24}) + "\n"
                            for _ in range(3)))
    out = tmp_path / "lookup.json"
    result = CliRunner().invoke(app, ["bench", "throughput", "--engine", str(engine_dir), "--dataset", f"jsonl:{data}",
                                      "--num-requests", "3", "--concurrency", "1", "--prompt-lookup", "4",
                                      "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(out.read_text())["results"]
    assert run["config"]["prompt_lookup"] == 4 and run["draft_tokens"] > 0
    assert f"drafts {run['accepted_draft_tokens']}/{run['draft_tokens']} taken" in result.output
    assert ", prompt lookup 4" in result.output


def test_itl_counts_the_steps_that_gave_tokens_not_accepted_drafts(engine_dir):
    """With prompt lookup a step may give a request several tokens: they arrive together (one streamed chunk), so
    the inter-token latencies are the gaps between those steps, not microsecond gaps inside one."""
    requests = [BenchRequest(list(range(3, 40)) * 3, 30) for _ in range(2)]
    with LLM(engine_dir, prompt_lookup=4) as llm:
        result = run_throughput(llm, requests, concurrency=1)
    assert result.accepted_draft_tokens > 0
    for record in result.records:
        assert len(record.token_steps) == len(record.token_times) == 30
        assert len(record.itl_s) == len(set(record.token_steps)) - 1 < 29


@pytest.mark.parametrize("args, message", [
    (["throughput", "--num-requests", "0"], "--num-requests"),
    (["throughput", "--concurrency", "-2"], "positive integers"),
    (["throughput", "--threads", "0"], "--threads"),
    (["throughput", "--seed", "-1"], "--seed"),
    (["throughput", "--max-batch-size", "0"], "--max-batch-size"),
    (["throughput", "--max-batch-size", "9"], "up to the engine's 8"),
    (["throughput", "--max-num-tokens", "-1"], "--max-num-tokens"),
    (["throughput", "--kv-cache-memory", "1.5"], "neither a whole number of bytes nor a fraction"),
    (["throughput", "--policy", "greedy"], "--policy must be one of"),
    (["latency", "--repeats", "0"], "--repeats"),
    (["latency", "--prompt-len", "0"], "--prompt-len"),
    (["latency", "--max-tokens", "-1"], "--max-tokens"),
    (["latency", "--warmup", "-1"], "--warmup"),
])
def test_cli_bench_numbers_are_checked(engine_dir, args, message):
    from typer.testing import CliRunner

    from camshaft.cli import app

    result = CliRunner().invoke(app, ["bench", args[0], "--engine", str(engine_dir), *args[1:]])
    assert result.exit_code != 0
    assert message in result.output + str(result.exception)
    assert result.exception is None or isinstance(result.exception, (RequestError, SystemExit))


def test_joining_requests_are_those_whose_prompt_ran_beside_decoding_others(engine_dir):
    """TTFT "joining a steady batch of C - 1" counts a request only if C - 1 others were decoding in the step of its
    first token (a client's own count of requests in flight says nothing of what the engine ran)."""
    with LLM(engine_dir, threads=1) as llm:
        rng = np.random.default_rng(3)
        vocab = llm.engine.manifest.model.vocab_size
        mixed = [BenchRequest(rng.integers(3, vocab, 8).tolist(), n) for n in (2, 120, 2, 2)]
        steady = run_throughput(llm, mixed, concurrency=2)  # the short ones come and go beside the long one
        assert steady.records[0].decoding_at_first_token == 0  # (the second may come as the first decodes)
        assert [r.decoding_at_first_token for r in steady.records[2:]] == [1, 1]
        assert steady.ttft_joining_ms["count"] == 2
        alone = run_throughput(llm, mixed, concurrency=1)
        assert [r.decoding_at_first_token for r in alone.records] == [0] * 4


def test_a_concurrency_no_step_reached_is_said(engine_dir):
    from camshaft.runtime.throughput_report import report_lines

    with LLM(engine_dir, threads=1) as llm:
        requests = load_dataset("synthetic:in=8,out=3", 2, max_seq_len=MAX_SEQ_LEN,
                                vocab_size=llm.engine.manifest.model.vocab_size)
        few = run_throughput(llm, requests, concurrency=8)
    assert few.peak_batch_size <= 2
    assert f"note: at concurrency 8 at most {few.peak_batch_size} requests ran in one step (2 requests in all)" in (
        report_lines([few]))


def test_a_concurrency_the_token_budget_kept_from_is_said_so(engine_dir):
    """Fewer requests than the concurrency, yet fewer still ran at once (the step's token budget held them back):
    the note names the budget, not the request count."""
    from camshaft.runtime.throughput_report import report_lines

    with LLM(engine_dir, threads=1, max_num_tokens=16) as llm:
        requests = load_dataset("synthetic:in=40,out=2", 6, max_seq_len=MAX_SEQ_LEN,
                                vocab_size=llm.engine.manifest.model.vocab_size)
        held = run_throughput(llm, requests, concurrency=8)
    assert held.peak_batch_size < 6
    assert (f"note: at concurrency 8 at most {held.peak_batch_size} requests ran in one step (the KV pool or the "
            "token budget admitted no more") in "\n".join(report_lines([held]))


def test_the_first_c_requests_meet_the_loop_together(engine_dir):
    """They were submitted one by one to the running loop: a step could start with the first alone (the note "at
    concurrency 8 at most 1 requests ran in one step" came and went from run to run)."""
    import time

    with LLM(engine_dir) as llm:
        make = llm._requests

        def slowly(*args, **kwargs):  # building a request takes a while: the loop runs a step meanwhile
            time.sleep(0.05)
            return make(*args, **kwargs)

        llm._requests = slowly
        result = run_throughput(llm, [BenchRequest([3, 4, 5], 1), BenchRequest([6, 7, 8], 1)], concurrency=2)
    assert result.peak_batch_size == 2


def test_plotted_values_keep_their_digits():
    from camshaft.runtime.throughput_plot import value_label

    assert [value_label(y) for y in (0.7, 0.64, 2.0, 12.4, 192.1, 7139.0)] == ["0.7", "0.64", "2", "12", "192", "7139"]


def test_a_request_the_pool_can_never_hold_is_refused_before_any_runs(engine_dir, tmp_path):
    """Review: the dataset's one oversized request failed only when reached, after every request before it ran."""
    from camshaft.errors import CapacityError
    from camshaft.runtime.kv_cache import bytes_per_block

    manifest = read_manifest(engine_dir)
    requests = [BenchRequest([100 + i] * 16, 8) for i in range(5)] + [BenchRequest([50] * 16, 150)]
    with LLM(engine_dir, threads=1, kv_cache_memory=8 * bytes_per_block(manifest)) as llm:
        step = llm.engine.step
        with pytest.raises(CapacityError, match="request 6 of 6: the request needs 11 KV blocks but the pool holds 7;"):
            run_throughput(llm, requests, concurrency=1)
        with pytest.raises(RequestError, match="request 2 of 2: .*max_seq_len"):
            run_throughput(llm, [requests[0], BenchRequest([7] * MAX_SEQ_LEN, 1)], concurrency=1)
        assert llm.executor.steps_done == 0 and llm.engine.step == step  # its step timer not left behind (review)
        assert run_throughput(llm, requests[:5], concurrency=1).output_tokens == 5 * 8  # the LLM is still usable
        assert llm.engine.step == step
    data = tmp_path / "data.jsonl"  # refused as the dataset's request, not the warm-up's (review: "1 of 2")
    data.write_text("".join(json.dumps({"prompt": [9 + i] * 16, "max_tokens": 150}) + "\n" for i in range(10)))
    with pytest.raises(CapacityError, match="request 1 of 10: "):
        throughput_benchmark(engine_dir, f"jsonl:{data}", 10, 2, threads=1,
                             kv_cache_memory=8 * bytes_per_block(manifest))
