"""SamplingParams validation and SequenceSampler behaviour, checked against straightforward reference computations."""

from __future__ import annotations

import numpy as np
import pytest

from camshaft.errors import RequestError
from camshaft.runtime.row_select import top_k_indices
from camshaft.runtime.sampler import SequenceSampler, sample_batch, tokenize_bad_words
from camshaft.runtime.sampling_params import SamplingParams

V = 49152
EOS = 2


def _sampler(vocab: int = V, prompt=(), eos=(EOS,), bad_words=(), **params) -> SequenceSampler:
    return SequenceSampler(SamplingParams(**params), list(prompt), eos, [list(w) for w in bad_words], vocab)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def _reference_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """HF-style filtering with a full stable sort: the spec the fast path must match."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    if top_k:
        order = order[:top_k]
    p = np.exp(x[order] - x[order].max())
    p /= p.sum()
    keep = (np.cumsum(p) - p) < top_p
    keep &= p >= min_p * p.max()
    out = np.zeros(len(logits))
    out[order[keep]] = p[keep] / p[keep].sum()
    return out


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=200), "min_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.01), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(n=0), "n must"),
    (dict(beam_width=4), "beam search is not supported; use beam_width=1"),
    (dict(beam_width=0), "beam_width"),
    (dict(stop=("ok", "")), "stop"),
    (dict(stop=[f"s{i}" for i in range(65)]), "at most 64 strings"),
    (dict(stop=["x" * 5000]), "at most 64 strings of 4096 characters"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
    (dict(temperature=10**400), "temperature must be a finite number"),  # past float's range: not an OverflowError
    (dict(logit_bias={5: 10**400}), "logit_bias"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=[f"w{i}" for i in range(1025)]), "bad_words takes at most 1024 words"),
    (dict(bad_words=["x" * 40_000]), "got 1 of 40000"),
    (dict(bad_word_ids=[[3], []]), "bad_word_ids must be non-empty lists"),
    (dict(stop=["a\ud800"]), "is not valid Unicode"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(seed="7"), "seed"),
])
def test_invalid_params_are_rejected_with_the_field_named(overrides, message):
    with pytest.raises(RequestError, match=message) as refused:
        SamplingParams(**overrides)
    assert refused.value.field == next(iter(overrides))  # what a server names as the request's wrong field


def test_numpy_numbers_are_kept_as_pythons():
    import dataclasses
    import json

    from camshaft.runtime.prompt_lookup import PromptLookup

    params = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), seed=np.int32(7), logprobs=np.int8(2))
    assert json.loads(json.dumps(dataclasses.asdict(params)))["max_tokens"] == 3  # numpy's int64 is no JSON
    assert type(params.temperature) is float and type(params.seed) is int and params == SamplingParams(
        max_tokens=3, temperature=0.5, seed=7, logprobs=2)
    assert type(PromptLookup(num_tokens=np.int64(4)).num_tokens) is int


def test_params_normalise_sequences_and_report_greedy():
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[5], bad_words="x", temperature=0.8)
    assert params.stop == ("a", "b") and params.stop_token_ids == (5,) and params.bad_words == ("x",)
    assert not params.greedy and SamplingParams().greedy and SamplingParams(temperature=1.0, top_k=1).greedy
    assert SamplingParams(stop=()).stop == ()
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(5,), bad_words=("x",), temperature=0.8))


def test_out_of_vocabulary_ids_are_rejected():
    with pytest.raises(RequestError, match="stop_token_ids"):
        _sampler(vocab=100, stop_token_ids=(100,))
    with pytest.raises(RequestError, match="bad_words"):
        _sampler(vocab=100, bad_words=[[3, 400]])


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((50, V)).astype(np.float32) * 3

    def run(seed, index=0):
        s = SequenceSampler(SamplingParams(temperature=1.0, top_p=0.95, seed=seed), [], (EOS,), [], V, index)
        return [s.sample(row).token_id for row in rows]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(7, index=1) != run(7) and run(7, index=1) == run(7, index=1)
    assert run(None) != run(None)


def test_vllm_values_are_accepted():
    """top_k -1 (vLLM's "all tokens") is top_k 0; min_p 1 keeps the most likely tokens only; numpy scalars are
    numbers."""
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    row = np.array([2.0, 2.0, 1.9, -1.0], dtype=np.float32)
    assert set(np.flatnonzero(_sample_counts(row, 200, temperature=1.0, min_p=1.0))) == {0, 1}
    params = SamplingParams(temperature=np.float32(0.7), top_p=np.float32(0.9), min_p=np.float64(0.1))
    assert params.temperature == pytest.approx(0.7) and params.top_p == pytest.approx(0.9)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_a_huge_temperature_samples_the_allowed_tokens_uniformly(top_p):
    """1/T underflows float32 past ~1e38; a banned token's -inf times that 0 was NaN, which top_p turned into an
    exception that stopped the batch loop (and without top_p, one token took every draw)."""
    row = np.linspace(-1, 1, 10, dtype=np.float32)
    counts = _sample_counts(row, 4000, temperature=1e46, top_p=top_p, bad_words=[[2], [7]])
    expected = np.full(10, 1 / 8)
    expected[[2, 7]] = 0
    if top_p < 1:  # the nucleus of a flat row: the lowest ids first, until half the mass
        expected[:] = 0
        expected[[0, 1, 3, 4]] = 1 / 4
    _assert_matches(counts, expected)


def test_an_unexpected_sampling_error_fails_its_row_only(monkeypatch):
    from camshaft.runtime.sampler import sample_batch

    broken, fine = _sampler(vocab=8, temperature=1.0, seed=1), _sampler(vocab=8, temperature=1.0, seed=1)
    monkeypatch.setattr(broken, "sample", lambda row: 1 / 0)
    results = sample_batch([broken, fine], np.zeros((2, 8), dtype=np.float32))
    assert isinstance(results[0], ZeroDivisionError)  # not the client's fault: a server error for that request
    assert isinstance(results[1].token_id, int)


def _sample_counts(logits, n, **params) -> np.ndarray:
    s = _sampler(vocab=len(logits), seed=1, **params)
    return np.bincount([s.sample(logits).token_id for _ in range(n)], minlength=len(logits))


def _assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    """No excluded token drawn; Pearson chi-square within ~6 sigma, tokens expected < 5 times pooled in one cell."""
    n = counts.sum()
    assert np.all(counts[expected == 0] == 0), f"excluded tokens sampled: {np.flatnonzero(counts * (expected == 0))}"
    big = n * expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(n * expected[big], n * expected[~big].sum())
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    chi2 = ((observed - wanted) ** 2 / wanted).sum()
    dof = len(wanted) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10, f"chi-square {chi2:.1f} with {dof} degrees of freedom"


def _peaked_row(rng) -> np.ndarray:
    row = rng.standard_normal(V).astype(np.float32) - 8
    hot = rng.choice(V, 12, replace=False)  # spread over the row so the blocked draw crosses blocks
    row[hot] = np.linspace(3.0, 0.0, 12, dtype=np.float32)
    return row


@pytest.mark.parametrize("filters", [
    dict(), dict(top_k=5), dict(top_p=0.8), dict(min_p=0.3), dict(top_k=8, top_p=0.7), dict(top_k=10, min_p=0.3),
    dict(top_k=8, top_p=0.9, min_p=0.1),
])
def test_sampled_frequencies_match_the_filtered_distribution(filters):
    row = _peaked_row(np.random.default_rng(3))
    expected = _reference_distribution(row, 0.7, **filters)
    if filters:
        assert 1 < np.count_nonzero(expected) < 12  # the filters really exclude some likely tokens
    _assert_matches(_sample_counts(row, 6000, temperature=0.7, **filters), expected)


def test_top_p_on_a_flat_row_breaks_ties_by_token_id():
    row = np.zeros(V, dtype=np.float32)
    counts = _sample_counts(row, 3000, temperature=1.0, top_p=0.25)
    assert counts[V // 4 :].sum() == 0 and np.count_nonzero(counts) > 2000


@pytest.mark.parametrize("top_k", [0, 3])
def test_top_p_excludes_a_token_that_only_reaches_the_target(top_k):
    counts = _sample_counts(np.zeros(4, dtype=np.float32), 2000, temperature=1.0, top_p=0.5, top_k=top_k)
    assert counts[2:].sum() == 0 and counts[0] > 800 and counts[1] > 800


def test_exact_top_p_boundary():
    probs = np.array([0.4, 0.3, 0.2, 0.05, 0.05])
    row = np.full(V, -np.inf, dtype=np.float32)
    row[[10, 20000, 300, 49000, 7]] = np.log(probs)
    counts = _sample_counts(row, 4000, temperature=1.0, top_p=0.85)
    assert set(np.flatnonzero(counts)) == {10, 20000, 300}


def test_top_k_indices_match_a_stable_sort():
    rng = np.random.default_rng(5)
    for values in (rng.standard_normal(V).astype(np.float32), np.round(rng.standard_normal(V), 1).astype(np.float32),
                   np.zeros(V, np.float32)):
        for k in (1, 7, 20, 300):
            assert top_k_indices(values, k).tolist() == np.argsort(-values, kind="stable")[:k].tolist()
    values = np.full(100, -np.inf, dtype=np.float32)
    values[[4, 9]] = [1.0, 2.0]
    assert top_k_indices(values, 5).tolist() == [9, 4]
    tied = np.round(rng.standard_normal(V), 1).astype(np.float32)
    for k in (1, 7, 300):
        kth = np.sort(tied)[::-1][k - 1]
        assert top_k_indices(tied, k, keep_ties=True).tolist() == np.flatnonzero(tied >= kth)[
            np.argsort(-tied[tied >= kth], kind="stable")].tolist()


def test_top_k_keeps_the_tokens_tied_with_the_kth_as_transformers_does():
    import torch
    from transformers.generation.logits_process import TopKLogitsWarper

    row = np.array([5.0, 5.0, 5.0, 1.0, 0.0], dtype=np.float32)
    counts = _sample_counts(row, 3000, temperature=1.0, top_k=2)
    kept = TopKLogitsWarper(top_k=2)(None, torch.from_numpy(row[None])).isfinite()[0].numpy()
    assert kept.tolist() == [True, True, True, False, False]
    _assert_matches(counts, kept / kept.sum())


def test_penalties_give_the_defined_logits():
    row = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], dtype=np.float32)
    s = _sampler(vocab=6, prompt=[0, 1], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    force = np.full(6, -50.0, dtype=np.float32)
    for token in (2, 2, 4):
        force[:] = -50.0
        force[token] = 50.0
        assert s.sample(force).token_id == token
    expected = np.array([
        2.0 / 2,  # prompt token, positive: divided
        -1.0 * 2,  # prompt token, negative: multiplied
        0.5 / 2 - 0.5 - 0.25 * 2,  # generated twice
        3.0,  # never seen
        -2.0 * 2 - 0.5 - 0.25 * 1,  # generated once
        1.0,
    ])
    np.testing.assert_allclose(s.processed_logits(row), expected, rtol=1e-6)
    assert s.sample(row).token_id == 3


def test_logit_bias_is_added_to_the_model_logits_before_penalties():
    row = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    s = _sampler(vocab=4, prompt=[1], logit_bias={1: 4.0, 3: -100}, repetition_penalty=2.0, logprobs=0)
    np.testing.assert_allclose(s.processed_logits(row), [2.0, (-1.0 + 4.0) / 2, 0.5, 3.0 - 100], rtol=1e-6)
    sample = s.sample(row)
    assert sample.token_id == 0 and sample.logprob == pytest.approx(_log_softmax(row)[0], abs=1e-5)  # raw logits
    assert [r.token_id for r in sample_batch([_sampler(vocab=4, logit_bias={2: 100})] * 2, np.stack([row] * 2))] \
        == [2, 2]  # the batch's shared argmax leaves biased rows to their sampler
    rng = np.random.default_rng(5)
    sampled = _sampler(vocab=50, logit_bias={7: -100, 9: 100}, temperature=1.0, seed=1)
    tokens = [sampled.sample(rng.standard_normal(50).astype(np.float32)).token_id for _ in range(200)]
    assert set(tokens) == {9}
    assert SamplingParams(logit_bias=[(5, 1.0), (5, -2.0)]).logit_bias == ((5, -2.0),)  # the last of a repeat
    for huge in (4, 2**63):  # the second past int64: refused, not overflowed
        with pytest.raises(RequestError, match="logit_bias contains a token id outside the vocabulary"):
            _sampler(vocab=4, logit_bias={huge: 1.0})
    for bad in ({5: 101}, {-1: 1}, {"5": 1}, 5, {5: float("nan")}):
        with pytest.raises(RequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_bad_words_never_appear():
    rng = np.random.default_rng(11)
    s = _sampler(vocab=50, bad_words=[[5], [7, 8]], temperature=1.0, seed=3)
    tokens = []
    for _ in range(3000):
        row = rng.standard_normal(50).astype(np.float32)
        row[[5, 7, 8]] += 3.0
        tokens.append(s.sample(row).token_id)
    pairs = list(zip(tokens, tokens[1:], strict=False))
    assert 5 not in tokens and (7, 8) not in pairs
    assert tokens.count(7) > 100 and tokens.count(8) > 100  # only the banned continuation is blocked


def test_min_tokens_blocks_eos_and_stop_tokens():
    row = np.zeros(10, dtype=np.float32)
    row[[EOS, 6]] = [9.0, 8.0]
    s = _sampler(vocab=10, min_tokens=3, stop_token_ids=(6,))
    assert [s.sample(row).token_id for _ in range(4)] == [0, 0, 0, EOS]
    s = _sampler(vocab=10, min_tokens=2, stop_token_ids=(6,), ignore_eos=True)
    assert [s.sample(row).token_id for _ in range(3)] == [EOS, EOS, EOS]  # eos is not a stop then (vLLM)
    row[EOS] = 0.0
    s = _sampler(vocab=10, min_tokens=2, stop_token_ids=(6,), ignore_eos=True)
    assert [s.sample(row).token_id for _ in range(3)] == [0, 0, 6]


def test_everything_banned_is_a_request_error():
    with pytest.raises(RequestError, match="banned"):
        _sampler(vocab=3, bad_words=[[0], [1], [2]]).sample(np.zeros(3, dtype=np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("params", [dict(), dict(logprobs=0), dict(temperature=0.7, seed=1)])
def test_logits_that_are_not_finite_fail_their_row_whatever_the_path(bad, params):
    """The plain greedy rows' shared argmax took a NaN's or an infinity's index as the token; the sampled path blamed
    penalties nobody set."""
    logits = np.zeros((3, 8), dtype=np.float32)
    logits[:, 3] = 10.0
    logits[1, 5] = bad
    results = sample_batch([_sampler(vocab=8, eos=(), **params) for _ in range(3)], logits)
    assert [r.token_id for r in (results[0], results[2])] == [3, 3]
    assert isinstance(results[1], RequestError) and "the model's logits are not finite" in str(results[1])


def test_penalties_that_overflow_are_named():
    s = _sampler(vocab=4, eos=(), repetition_penalty=1e-30, temperature=0.5, seed=0, prompt=[1])
    with pytest.raises(RequestError, match="penalties pushed a logit to infinity"):
        s.sample(np.array([0.0, 1e10, 0.0, 0.0], dtype=np.float32))


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.9, top_k=40, repetition_penalty=1.3, seed=4)])
def test_logprobs_come_from_the_raw_logits(params):
    rng = np.random.default_rng(2)
    s = _sampler(prompt=[1, 2, 3], logprobs=5, **params)
    for _ in range(5):
        row = (rng.standard_normal(V) * 2).astype(np.float32)
        result = s.sample(row)
        reference = _log_softmax(row)
        assert result.logprob == pytest.approx(reference[result.token_id], abs=1e-4)
        best = np.argsort(-reference)[:5]
        assert [t for t, _ in result.top_logprobs] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in result.top_logprobs], reference[best], atol=1e-4)
    row[0] = row.max() + 5.0
    banned = _sampler(bad_words=[[0]], logprobs=3, temperature=1.0, seed=1).sample(row)
    assert banned.token_id != 0 and banned.top_logprobs[0] == (0, pytest.approx(_log_softmax(row)[0], abs=1e-4))
    chosen_only = _sampler(logprobs=0).sample(row)
    assert chosen_only.top_logprobs is None and chosen_only.logprob == pytest.approx(_log_softmax(row)[0], abs=1e-4)
    assert _sampler().sample(row).logprob is None


def test_sample_batch_matches_one_row_at_a_time():
    rng = np.random.default_rng(9)
    configs = [dict(), dict(temperature=0.8, seed=1), dict(repetition_penalty=1.2), dict(logprobs=2), dict()]
    batched = [_sampler(prompt=[4], **c) for c in configs]
    single = [_sampler(prompt=[4], **c) for c in configs]
    for _ in range(5):
        logits = rng.standard_normal((len(configs), V)).astype(np.float32)
        assert sample_batch(batched, logits) == [s.sample(row) for s, row in zip(single, logits, strict=True)]


def test_tokenize_bad_words_covers_start_and_mid_sentence():
    from test_detokenizer import _trained_bpe
    from tokenizers import decoders, pre_tokenizers

    tokenizer = _trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    words = tokenize_bad_words(tokenizer, ["world", "fox jumps"])
    decoded = [tokenizer.decode(w) for w in words]
    assert decoded == ["world", " world", "fox jumps", " fox jumps"]
    spaces = tokenize_bad_words(tokenizer, ["\n", "\t"])  # banned as they are, never as a space
    assert [tokenizer.decode(w) for w in spaces] == ["\n", "\t"]
