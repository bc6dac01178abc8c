"""LLM's options on a tiny engine: the KV budget in every documented form (one parser with the CLI), scheduler limits
refused unless they are positive and within the engine, n beyond what the queue can ever hold refused at admission
(busy stays for real fullness), and the per-step queue length."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig
from camshaft.errors import CapacityError, RequestError, ServerBusyError
from camshaft.manifest import read_manifest
from camshaft.runtime import kv_cache
from camshaft.runtime.kv_cache import bytes_per_block, fraction_bytes, host_available, memory_spec
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm_inputs")
    model = make_tiny_model("llama", root / "hf")
    build_engine(BuildConfig(model, root / "engine", max_seq_len=128, max_num_tokens=32, kv_block_size=16,
                             max_batch_size=4))
    return root / "engine"


@pytest.mark.parametrize("spec, expected", [
    (4096, 4096), ("4096", 4096), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 KiB", 1536), ("64kb", 64_000),
    ("1e9", 10**9), (2e9, 2 * 10**9), ("1EiB", 2**60), ("2PB", 2 * 10**15), ("2.0", 2), ("1", 1), ("1e0", 1),
    (np.int64(4096), 4096), (None, None),
    ("2.01GB", 2_010_000_000), ("8.2GB", 8_200_000_000), ("0.00098304GB", 983040),  # exact (a review: a byte short)
    ("1.1KiB", 1126), ("0.9999999999999999999999999999999KiB", 1023),  # whole bytes below a larger unit
    ("0." + "9" * 63 + "KiB", 1023), ("1000000000000000001." + "0" * 45 + " B", 1000000000000000001),
])
def test_memory_in_bytes(spec, expected):
    assert memory_spec(spec) == expected


@pytest.mark.parametrize("spec", [0.25, "0.25", ".25", "5e-1", np.float32(0.25), 1.0, "1.0"])
def test_memory_fractions_stay_fractions(spec):
    assert isinstance(memory_spec(spec), float) and memory_spec(spec) == pytest.approx(float(spec))
    assert fraction_bytes(memory_spec(spec), 10**9) == int(float(spec) * 10**9)


def test_a_containers_cgroup_bounds_fractions_and_the_pool(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("1073741824\n")  # a 1 GiB container that holds 600 MiB, 100 of it cache
    (tmp_path / "memory.current").write_text(f"{600 * 2**20}\n")
    (tmp_path / "memory.stat").write_text(f"anon {500 * 2**20}\nfile {100 * 2**20}\ninactive_file {100 * 2**20}\n")
    (tmp_path / "self").write_text("0::/\n")  # the process's own cgroup: the mount's root (a v2 container's)
    monkeypatch.setattr(kv_cache, "SELF_CGROUP", tmp_path / "self")
    assert kv_cache.cgroup_available(tmp_path) == 524 * 2**20 and kv_cache.cgroup_limit(tmp_path) == 2**30
    monkeypatch.setattr(kv_cache, "CGROUP", tmp_path)
    assert fraction_bytes(0.5, host_available()) == 262 * 2**20  # half of what the container has left, not the host's
    assert kv_cache.host_memory() == 2**30
    (tmp_path / "memory.current").write_text(f"{2**30}\n")  # full: nothing left, not the machine's memory
    (tmp_path / "memory.stat").write_text("inactive_file 0\n")
    with pytest.raises(CapacityError, match="no memory is available for the KV cache"):  # no fraction can help
        fraction_bytes(0.5, host_available())
    with pytest.raises(RequestError, match="a KV cache budget of 1e-12 of the memory available .100 bytes. is under "
                                           "one byte"):
        fraction_bytes(1e-12, 100)
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the machine's
    assert kv_cache.cgroup_available(tmp_path) is None
    assert host_available() == pytest.approx(psutil.virtual_memory().available, rel=0.2)


def test_cgroup_v1_and_unnamespaced_v2_limits_bound_the_pool_too(tmp_path):
    """A container on a cgroup v1 host (docker --memory) and a systemd service or job under cgroup v2 without its own
    namespace (MemoryMax=): the limit is in the process's own cgroup (/proc/self/cgroup) or an ancestor, not at the
    mount's root. Those were read as no limit: a fraction of the host's memory, a pool the kernel kills."""
    own = tmp_path / "cgroup"
    own.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    v1 = tmp_path / "memory" / "docker" / "abc"
    v1.mkdir(parents=True)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")  # the host's: no limit
    (v1 / "memory.limit_in_bytes").write_text(f"{2**32}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    (v1 / "memory.stat").write_text(f"inactive_file 5\ntotal_inactive_file {2**28}\n")
    assert kv_cache.cgroup_limit(tmp_path, own) == 2**32
    assert kv_cache.cgroup_available(tmp_path, own) == 2**32 - 2**30 + 2**28
    own.write_text("0::/system.slice/camshaft.service\n")
    service = tmp_path / "system.slice" / "camshaft.service"
    service.mkdir(parents=True)
    (service / "memory.max").write_text("max\n")
    (service / "memory.current").write_text(f"{2**29}\n")
    (service / "memory.stat").write_text("inactive_file 0\n")
    assert kv_cache.cgroup_limit(tmp_path, own) is None
    for name, text in (("memory.max", f"{2**31}\n"), ("memory.current", f"{2**30}\n"), ("memory.stat", "x 1\n")):
        (tmp_path / "system.slice" / name).write_text(text)  # the slice's limit binds the service in it
    assert kv_cache.cgroup_limit(tmp_path, own) == 2**31 and kv_cache.cgroup_available(tmp_path, own) == 2**30


@pytest.mark.parametrize("spec, message", [
    ("1.5", "neither a whole number"), ("1.5B", "neither a whole number"), (1.5, "neither"),
    ("1e99999999999999999999", "1 B to 1 EiB"), ("1e999999GB", "1 B to 1 EiB"), ("1e-400", "1 B to 1 EiB"),
    ("1e300GB", "1 B to 1 EiB"), ("1e+300TB", "1 B to 1 EiB"), ("1152921504606846977e+000", "1 B to 1 EiB"),
    ("0." + "0" * 330 + "1", "1 B to 1 EiB"),  # at once (re-reviews: tracebacks, minutes, a fraction of 0.0)
    ("1." + "0" * 62 + "1 B", "neither a whole number"), ("0." + "1" * 200000, "has 200002 digits"),
    (0.0, "a number of bytes a machine holds"),
    (float("nan"), "neither"), (float("inf"), "neither"), (0, "a number of bytes a machine holds"),
    (-5, "1 B to 1 EiB"), ("0", "1 B to 1 EiB"), (10**400, "1 B to 1 EiB"), ("1" + "0" * 400, "1 B to 1 EiB"),
    (np.float32("nan"), "neither"), (np.float32("inf"), "neither"),
    ("-5", "cannot read"), ("abc", "cannot read"), ("5 parsecs", "cannot read"), ("", "cannot read"),
    (True, "must be"), ([1], "must be"),
])
def test_bad_memory_is_a_clear_error(spec, message):
    with pytest.raises(RequestError, match=message) as info:
        memory_spec(spec)
    assert "1.0 for all of it" in str(info.value)  # the rule, with examples


def test_llm_takes_the_budget_in_every_form(engine_dir):
    block = bytes_per_block(read_manifest(engine_dir))
    for budget in (block * 9, str(block * 9), f"{block * 9 / 1024}KiB"):
        with LLM(engine_dir, kv_cache_memory=budget) as llm:
            assert llm.config.num_blocks == 9 and llm.kv_cache_memory == block * 9
            assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids
    fraction = 40 * block / psutil.virtual_memory().available
    for budget in (fraction, f"{fraction:.15f}"):
        with LLM(engine_dir, kv_cache_memory=budget) as llm:
            assert 20 <= llm.config.num_blocks <= 80
    with pytest.raises(RequestError, match="1.0 for all of it"):
        LLM(engine_dir, kv_cache_memory=1)  # one byte holds no block; the error says how to write a fraction
    with pytest.raises(RequestError, match="1e-12 of the memory available"):
        LLM(engine_dir, kv_cache_memory="1e-12")


def test_a_fraction_is_of_the_memory_left_once_the_weights_are_loaded(engine_dir, tmp_path, monkeypatch):
    """As TensorRT-LLM's free_gpu_memory_fraction: measured before the weights load, 1.0 would give the pool memory
    the weights then take, and the process would be killed as the pool fills."""
    from camshaft.runtime import sequence
    from camshaft.runtime.backends import onnxruntime as backend
    from camshaft.runtime.session import Session

    block = bytes_per_block(read_manifest(engine_dir))
    available = {"bytes": 0}
    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=available["bytes"]))
    monkeypatch.setattr(kv_cache, "CGROUP", tmp_path)  # no container limit
    load = backend.load_session

    def loading(*args, **kwargs):
        available["bytes"] = 4 * block  # the weights take all but 4 blocks' worth
        return load(*args, **kwargs)

    monkeypatch.setattr(backend, "load_session", loading)
    monkeypatch.setattr(sequence, "load_session", loading)
    for graph, tokens in (("batch", 16), ("sequence", 32)):  # the batch graph's pool keeps one block empty
        available["bytes"] = 100 * block
        assert Session(engine_dir, kv_cache_memory=0.5, graph=graph).engine.token_budget == tokens
    available["bytes"] = 100 * block
    with LLM(engine_dir, kv_cache_memory=1.0) as llm:
        assert llm.config.num_blocks == 4 and llm.kv_cache_memory == 1.0
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids
    monkeypatch.setattr(backend, "load_session", load)
    available["bytes"] = 100 * block
    session = Session(engine_dir, kv_cache_memory=1.0, graph="batch")
    assert session.engine.token_budget == 128  # a budget past one full-length sequence is capped to it
    monkeypatch.setattr(sequence, "host_available", lambda: 10 * block)
    with pytest.raises(CapacityError, match=r"bytes \(0.001 of the memory available\) holds no token"):
        Session(engine_dir, kv_cache_memory=0.001, graph="sequence")


@pytest.mark.parametrize("option", ["max_batch_size", "max_num_tokens"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "2"])
def test_scheduler_limits_must_be_positive_integers(engine_dir, option, value):
    with pytest.raises(RequestError, match=f"{option} must be a positive integer up to the engine's"):
        LLM(engine_dir, **{option: value})


def test_scheduler_limits_within_the_engine_are_used(engine_dir):
    with LLM(engine_dir, max_batch_size=1, max_num_tokens=8) as llm:
        assert (llm.config.max_batch_size, llm.config.max_num_tokens) == (1, 8)
        llm.generate([[5] * 20, [6] * 20], SamplingParams(max_tokens=3), use_tqdm=False)
        assert max(s.batch_size for s in llm.stats) == 1 and max(s.num_tokens for s in llm.stats) == 8
    with pytest.raises(RequestError, match="max_queue must be an integer >= 0"):
        LLM(engine_dir, max_queue=-1)


def test_n_beyond_what_the_queue_can_hold_is_refused_not_busy(engine_dir):
    """A server's submit() refuses what could never be in flight; offline generate() waits its turn instead."""
    with LLM(engine_dir, max_batch_size=4, max_queue=2) as llm:
        with pytest.raises(RequestError, match="n=7 outputs can never be queued.*lower n") as info:
            llm.submit("Hi", SamplingParams(n=7, temperature=1, max_tokens=2), lambda output: None)
        assert not isinstance(info.value, ServerBusyError)
        assert len(llm.generate("Hi", SamplingParams(n=7, temperature=1, max_tokens=2), use_tqdm=False)[0].outputs) == 7


def test_a_full_queue_is_still_busy(engine_dir):
    with LLM(engine_dir, max_batch_size=1, max_queue=0) as llm:
        (first,) = llm.submit([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True), lambda output: None)
        with pytest.raises(ServerBusyError, match="retry later") as info:
            llm.submit([8, 9], SamplingParams(max_tokens=2), lambda output: None)
        assert not isinstance(info.value, RequestError)  # the request is fine: retry it, do not drop it as bad input
        llm.abort(first)


def test_queue_length_is_recorded_and_drains(engine_dir):
    with LLM(engine_dir, max_batch_size=2) as llm:
        prompts = [[3 + i, 10, 11] for i in range(6)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        stats = llm.stats
        assert any(s.batch_size == 2 and s.queue_length > 0 for s in stats)  # 6 requests, at most 2 running
        assert max(s.queue_length for s in stats) <= 4 and stats[-1].queue_length == 0
        assert llm.load().waiting == 0


def test_a_request_that_cannot_be_sampled_fails_alone(engine_dir):
    """Parameters that pass validation but cannot be sampled (every token banned by min_tokens + stop ids; a
    repetition penalty that overflows the logits) end that request with its error; the batch loop goes on."""
    vocab = read_manifest(engine_dir).model.vocab_size
    good = SamplingParams(max_tokens=6, ignore_eos=True)
    bad = [SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=list(range(vocab))),
           SamplingParams(max_tokens=6, temperature=1.0, repetition_penalty=1e-40, seed=0)]
    with LLM(engine_dir) as llm:
        for params, message in zip(bad, ("every token is banned", "repetition_penalty nearer 1"), strict=True):
            with pytest.raises(RequestError, match=message):
                llm.generate([[5, 6, 7], [8, 9, 10]], [params, good], use_tqdm=False)
            assert llm.alive
            alone = llm.generate([[8, 9, 10]], good, use_tqdm=False)[0]
            assert len(alone.token_ids) == 6
        assert llm.executor.scheduler.blocks.num_used == 0


def test_one_token_id_prompt_in_numpy_integers(engine_dir):
    with LLM(engine_dir) as llm:
        ids = [np.int64(5), np.int64(6), np.int64(7)]
        outputs = llm.generate(ids, SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(outputs) == 1 and outputs[0].prompt_token_ids == [5, 6, 7]


def test_a_budget_of_1_says_it_is_one_byte(engine_dir):
    from camshaft.errors import CapacityError

    with pytest.raises(CapacityError, match="1 is one byte: for all of the available memory write 1.0"):
        LLM(engine_dir, kv_cache_memory="1")


def test_a_pool_larger_than_the_machine_is_refused_before_loading(engine_dir):
    """numpy allocates lazily: such a pool loaded, and the process was killed as the cache filled."""
    from camshaft.errors import CapacityError
    from camshaft.runtime.kv_cache import host_memory

    with pytest.raises(CapacityError, match=r"larger than this machine's .* GiB of memory"):
        LLM(engine_dir, kv_cache_memory=host_memory() + 2**30)


def test_no_memory_for_the_tokenizer_is_not_told_to_rebuild_and_a_graph_counts_the_weights_it_reads(
        engine_dir, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    from camshaft.engine_files import graph_bytes
    from camshaft.runtime.engine import load_tokenizer

    def no_memory(*_args, **_kwargs):
        raise MemoryError("Cannot allocate memory")
    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", no_memory)
    with pytest.raises(MemoryError):  # not "could not be loaded; rebuild the engine": the engine is fine
        load_tokenizer(engine_dir)
    shared = (engine_dir / "model.onnx.data").stat().st_size  # the sequence graph reads the batch graph's weights
    assert graph_bytes(engine_dir / "sequence.onnx") > shared + (engine_dir / "sequence.onnx").stat().st_size


def test_a_pool_beyond_the_process_memory_is_a_clear_error(engine_dir):
    """Under an address-space limit (ulimit -v, a container's), the pool's allocation fails: a CapacityError naming
    the options to change, not numpy's MemoryError traceback."""
    script = textwrap.dedent(f"""
        import resource
        from camshaft.runtime.llm import LLM
        from camshaft.errors import CapacityError
        from camshaft.runtime.kv_cache import host_memory
        size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, size + 2**30))
        try:
            LLM({str(engine_dir)!r}, kv_cache_memory=min(8 * 2**30, host_memory() // 2))
        except CapacityError as exc:
            print("REFUSED", exc)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in run.stdout, run.stdout + run.stderr[-2000:]
    assert "does not fit this process's memory" in run.stdout and "--kv-cache-memory" in run.stdout


# --- the vLLM / TensorRT-LLM API as their users write it ---


def test_prompt_dicts_and_the_sampling_params_keyword(engine_dir):
    params = SamplingParams(max_tokens=4)
    with LLM(engine_dir) as llm:
        ids = llm.encode("river")
        expected = llm.generate(ids, params)[0].outputs[0].token_ids
        for prompt in ({"prompt_token_ids": ids}, {"prompt": "river"}):
            out = llm.generate(prompt, sampling_params=params)  # one dict is one prompt, not its keys
            assert out[0].prompt_token_ids == ids and out[0].outputs[0].token_ids == expected
        assert [o.outputs[0].token_ids for o in llm.generate([{"prompt": "river"}, ids], params)] == [expected] * 2
        with pytest.raises(RequestError, match=r'one key, "prompt" .text. or "prompt_token_ids", got the keys '
                                               r"\['multi_modal_data', 'prompt'\]"):
            llm.generate({"prompt": "river", "multi_modal_data": {}})
        assert "".join(llm.stream_sync({"prompt": "river"}, sampling_params=params)) == \
            llm.tokenizer.decode(expected)


def test_an_error_of_one_of_several_prompts_keeps_its_field(engine_dir):
    with LLM(engine_dir) as llm:
        with pytest.raises(RequestError, match="prompt 0: stop_token_ids contains a token id outside") as refused:
            llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=2, stop_token_ids=[10**6]), use_tqdm=False)
        assert refused.value.field == "stop_token_ids"


def test_counting_tokens_says_its_own_cap(engine_dir):
    from camshaft.errors import CapacityError

    with LLM(engine_dir) as llm:
        assert len(llm.encode("", for_generation=False)) <= 1  # an empty prompt is counted, not refused
        with pytest.raises(CapacityError, match=r"more than 10 tokens: counting stops at most_counted \(10\)"):
            llm.encode("word " * 1000, for_generation=False, most_counted=10)  # not "this engine allows 10"
        for wrong in (True, -1, 0, 2.5):
            with pytest.raises(RequestError, match="most_counted must be an integer >= 1 or None"):
                llm.encode("word", for_generation=False, most_counted=wrong)


@pytest.mark.parametrize("call, message", [
    (lambda llm: llm.generate(None), "prompts must be a prompt"),
    (lambda llm: llm.generate(7), "prompts must be a prompt"),
    (lambda llm: llm.generate(["a"], [None]), r"sampling_params\[0\] is None, not a SamplingParams"),
    (lambda llm: llm.generate(["a"], {"max_tokens": 2}), "sampling_params must be a SamplingParams or one per"),
    (lambda llm: llm.stream_sync("a", SamplingParams(n=2)), "use n=1"),
    (lambda llm: llm.stream_sync("w " * 200), "tokens"),  # refused at the call, not at the first next()
])
def test_bad_calls_raise_request_errors_at_the_call(engine_dir, call, message):
    with LLM(engine_dir) as llm:
        with pytest.raises(RequestError, match=message) as info:
            call(llm)
        assert isinstance(info.value, ValueError)  # what vLLM / TensorRT-LLM code catches


def test_list_parameters_take_none_and_refuse_a_bare_number():
    params = SamplingParams(stop=None, stop_token_ids=None, bad_words=None, stop_word_ids=None, bad_word_ids=None)
    assert params.stop == params.stop_token_ids == params.bad_words == params.stop_word_ids == ()
    for name, example in (("stop_token_ids", r"\[2\]"), ("stop", r"\[.*\]"), ("stop_word_ids", r"\[\[5, 6\]\]")):
        with pytest.raises(RequestError, match=f"{name} must be a list .e.g. {example}., got 2"):
            SamplingParams(**{name: 2})


def test_max_tokens_none_fills_the_context_and_a_default_that_does_not_fit_says_so(engine_dir):
    with LLM(engine_dir) as llm:
        prompt = list(range(5, 105))  # 100 of the engine's 128 tokens
        out = llm.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 28 and out.finish_reason == "length"
        with pytest.raises(RequestError, match=r"max_tokens \(128\) exceeds the engine's max_seq_len \(128\); pass "
                                               r"max_tokens <= 28 or shorten the prompt"):
            llm.generate(prompt)
        with pytest.raises(RequestError, match=r"max_tokens \(128\) exceeds"):
            llm.submit(prompt, None, lambda _: None)  # None: the defaults, as everywhere
        with pytest.raises(RequestError, match="min_tokens 40 does not fit after the prompt"):
            llm.generate(prompt, SamplingParams(max_tokens=None, min_tokens=40))
        with pytest.raises(RequestError, match="the prompt has 128 tokens; this engine.s max_seq_len allows 128"):
            llm.generate(list(range(5, 133)), SamplingParams(max_tokens=None))
        for bad in ({"prompt_token_ids": "river"}, {"prompt": [5, 6]}):
            with pytest.raises(RequestError, match='"prompt" takes text and "prompt_token_ids" a list'):
                llm.generate(bad)
        with pytest.raises(RequestError, match="messages must be a list"):
            llm.chat(m for m in [{"role": "user", "content": "hi"}])
    block = read_manifest(engine_dir).limits.kv_block_size
    with LLM(engine_dir, kv_cache_memory=4 * bytes_per_block(read_manifest(engine_dir))) as small:  # 3 usable blocks
        out = small.generate(list(range(5, 25)), SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 3 * block - 20  # None: what the pool holds for one request, not max_seq_len


def test_chat_priorities_in_numpy_and_what_stopped_a_request(engine_dir):
    messages = [{"role": "user", "content": "Name a river."}]
    with LLM(engine_dir) as llm:
        params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
        chat = llm.chat(messages, params)[0]
        assert chat.prompt_token_ids == llm.encode(messages=messages)
        assert chat.outputs[0].token_ids == llm.generate(chat.prompt_token_ids, params)[0].outputs[0].token_ids
        assert len(llm.chat([messages, messages], params, priority=np.array([1, 0]))) == 2
        begun = [*messages, {"role": "assistant", "content": "The"}]
        continued = llm.chat([messages, begun], params, add_generation_prompt=False, continue_final_message=True)
        assert [c.prompt_token_ids for c in continued] == [
            llm.encode(messages=m, add_generation_prompt=False, continue_final_message=True) for m in (messages, begun)]
        assert llm.tokenizer.decode(continued[1].prompt_token_ids).endswith("assistant\nThe")
        with pytest.raises(RequestError, match="exclude each other"):
            llm.chat(begun, params, continue_final_message=True)
        with pytest.raises(RequestError, match="messages"):
            llm.chat([])
        result = chat.outputs[0]
        assert result.stop_reason is None and result.finish_reason == "length"
        assert result.cumulative_logprob == pytest.approx(sum(s.logprob for s in result.logprobs))
        assert result.cumulative_logprob < 0
        assert llm.generate("a", SamplingParams(max_tokens=4))[0].outputs[0].cumulative_logprob is None
        first, second = result.token_ids[:2]
        by_id = llm.generate(chat.prompt_token_ids, SamplingParams(max_tokens=6, stop_token_ids=[second]))
        assert by_id[0].outputs[0].stop_reason == second and by_id[0].outputs[0].token_ids == [first, second]
        by_word = llm.generate(chat.prompt_token_ids, SamplingParams(max_tokens=6, stop_word_ids=[[first, second]]))
        assert by_word[0].outputs[0].stop_reason == (first, second)
        text = llm.tokenizer.decode(result.token_ids[:3])
        by_text = llm.generate(chat.prompt_token_ids, SamplingParams(max_tokens=6, stop=[text[-1]]))
        assert by_text[0].outputs[0].stop_reason == text[-1]


def test_a_prompt_failing_in_the_batch_loop_is_named_and_ends_the_call(engine_dir):
    """generate() returns the whole batch or raises: a request that fails while sampling (its guide and its
    bad_words leave no token) raises, naming its prompt, and the rest are cancelled."""
    from camshaft.runtime.guided import GuidedDecodingParams

    bad = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["y", "n"]), bad_words=["y", "n"])
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 4
    with LLM(engine_dir, threads=1) as llm:
        with pytest.raises(RequestError, match=r"^prompt 2: "):
            llm.generate([f"prompt {i}" for i in range(4)], params[:2] + [bad] + params[3:], use_tqdm=False)
        assert len(llm.generate(["after"], params[0])[0].outputs[0].token_ids) == 8


def test_a_request_that_can_never_fit_is_refused_before_any_runs(engine_dir):
    from camshaft.errors import CapacityError

    manifest = read_manifest(engine_dir)
    with LLM(engine_dir, threads=1, kv_cache_memory=5 * bytes_per_block(manifest)) as llm:  # 4 usable blocks of 16
        steps = llm.executor.steps_done
        fits, never = SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(max_tokens=100, ignore_eos=True)
        with pytest.raises(CapacityError, match=r"^prompt 30: the request needs \d+ KV blocks"):
            llm.generate([[5, 6, 7]] * 31, [fits] * 30 + [never], use_tqdm=False)
        assert llm.executor.steps_done == steps


def test_submit_keeps_no_sink_of_a_group_it_did_not_queue(engine_dir):
    """A group that fails while its sinks are registered (here: one sink short; in life a Ctrl-C) leaves none
    behind: they would count as requests in flight forever (a busy server with nothing running)."""
    with LLM(engine_dir, threads=1, max_queue=0) as llm:
        group = llm._requests([5, 6, 7], SamplingParams(max_tokens=2, n=2))
        with pytest.raises(ValueError):
            llm.executor.submit(group, [lambda output: None])
        assert llm.executor.load().waiting == 0
        with pytest.raises(RequestError, match="sink takes each RequestOutput"):
            llm.submit([5, 6], SamplingParams(max_tokens=2), None)
        assert len(llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=2))) == 4  # not busy


def test_an_llm_made_before_a_fork_refuses_in_the_child(engine_dir):
    import os
    import time

    from camshaft.errors import ServerClosedError

    with LLM(engine_dir, threads=1) as llm:
        pid = os.fork()
        if pid == 0:  # the child: its executor has no batch loop thread
            try:
                llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
                os._exit(1)
            except ServerClosedError as exc:
                os._exit(0 if "a fork" in str(exc) else 2)
            except BaseException:
                os._exit(3)
        for _ in range(200):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in generate()")
        assert os.waitstatus_to_exitcode(status) == 0


def test_generate_without_stderr_shows_no_bar(engine_dir, monkeypatch):
    with LLM(engine_dir, threads=1) as llm:
        monkeypatch.setattr(sys, "stderr", None)  # pythonw, some embedded interpreters
        assert len(llm.generate([[5, 6]] * 2, SamplingParams(max_tokens=2))) == 2


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": 3.5}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": {"prompt": [1]}}, "prompt"), ({"prompt": {"text": "a"}}, "prompt"), ({}, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
    ({"prompt": "a", "tools": []}, "messages"),
    ({"messages": []}, "messages"), ({"messages": "hello"}, "messages"), ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": " "}]}, "messages"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [{}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                                                     "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "w " * 2000}]}, "messages"), ({"prompt": "w " * 2000}, "prompt"),
])
def test_every_prompt_and_chat_error_names_its_field(engine_dir, kwargs, field):
    with LLM(engine_dir) as llm:
        with pytest.raises(RequestError) as refused:
            llm.encode(**kwargs)
        assert refused.value.field == field, str(refused.value)


def test_chat_template_errors_name_their_field(engine_dir, tmp_path):
    (tmp_path / "empty.jinja").write_text(" ")
    for template in (str(tmp_path / "empty.jinja"), "{% if %}", "no-such-template"):
        with pytest.raises(RequestError) as refused:
            LLM(engine_dir, chat_template=template)
        assert refused.value.field == "chat_template", str(refused.value)
    with LLM(engine_dir, chat_template="{{ raise_exception('no users') }}") as llm:
        with pytest.raises(RequestError, match="refused the messages") as refused:
            llm.chat([{"role": "user", "content": "a"}])
        assert refused.value.field == "messages"


def test_a_chats_errors_name_messages_not_the_prompt(engine_dir):
    from camshaft.runtime.session import Session

    long_chat = [{"role": "user", "content": "w " * 2000}]
    mid_chat = [{"role": "user", "content": "w " * 60}]  # fits, but not with 100 tokens more
    with LLM(engine_dir) as llm:
        for call in (lambda: llm.chat("hello"), lambda: llm.chat(long_chat),
                     lambda: llm.chat(mid_chat, SamplingParams(max_tokens=100)),
                     lambda: llm.chat([mid_chat, mid_chat], SamplingParams(max_tokens=100))):
            with pytest.raises(RequestError) as refused:
                call()
            assert refused.value.field == "messages", str(refused.value)
    with Session(engine_dir) as session:
        for call in (lambda: session.chat("hello"), lambda: session.chat([mid_chat]),
                     lambda: session.chat(long_chat), lambda: session.chat(mid_chat, max_tokens=100)):
            with pytest.raises(RequestError) as refused:
                call()
            assert refused.value.field == "messages", str(refused.value)
        with pytest.raises(RequestError) as refused:  # a prompt's stays the prompt's
            session.generate("w " * 60, max_tokens=100)
        assert refused.value.field == "prompt"
