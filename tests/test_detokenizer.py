"""TextStream: deltas concatenate to the decoded text, never split a character, and cut exactly at stop strings."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from camshaft.runtime.detokenizer import TextStream

CORPUS = [
    "Hello world. The quick brown fox jumps over the lazy dog, again and again.",
    "日本語のテキストと中文文本，还有한국어 문장.",
    "emoji 😀🎉👍🏽 and café, naïve résumé; 👨‍👩‍👧 family.",
    "hello hello world world stop STOP the end.\n\nNew paragraph:\tdone",
]
TEXT = "Hello world 😀 日本語 and 中文 — café 👍🏽 the end. STOP here, then more text 🎉 after."


def _trained_bpe(pre_tokenizer, decoder) -> PreTrainedTokenizerFast:
    """A small BPE trained on CORPUS: merged multi-character tokens and multi-byte characters split over tokens."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=not isinstance(decoder, decoders.ByteLevel)))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(decoder, decoders.ByteLevel) else []
    bytes_tokens = [] if alphabet else [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=["<|im_start|>", "<|im_end|>", *bytes_tokens])
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    return _trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())


@pytest.fixture(params=["byte_bpe", pytest.param("smollm2", marks=pytest.mark.slow)])
def tokenizer(request, byte_bpe):
    if request.param == "byte_bpe":
        return byte_bpe
    return AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_dir"))


def _stream(tokenizer, prompt_ids, ids, **kwargs) -> tuple[TextStream, list[str]]:
    stream = TextStream(tokenizer, prompt_ids, **kwargs)
    deltas = [stream.append(t) for t in ids]
    deltas.append(stream.finish())
    return stream, deltas


def _expected(tokenizer, ids, stop=(), include_stop=False, skip_special_tokens=True) -> str:
    """decode(ids) cut at the stop-string occurrence that ends first (ties: the one starting first)."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    found = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    if not found:
        return text
    end, start, _ = min(found)
    return text[:end] if include_stop else text[:start]


def test_multibyte_characters_split_over_tokens_are_never_emitted_broken(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in piece for piece in pieces), "the text should put some characters across token boundaries"
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    stream, deltas = _stream(tokenizer, prompt, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == stream.text == tokenizer.decode(ids) == TEXT
    assert not stream.stopped


def test_stop_string_split_across_tokens_cuts_exactly(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "lo wor"  # "Hello" and " world" are separate tokens
    assert all(stop not in tokenizer.decode([t]) for t in ids)
    stream, deltas = _stream(tokenizer, [], ids, stop=(stop,))
    assert stream.stopped and stream.matched_stop == stop
    assert "".join(deltas) == stream.text == "Hel"
    stream, deltas = _stream(tokenizer, [], ids, stop=(stop,), include_stop=True)
    assert "".join(deltas) == "Hello wor"


def test_stop_string_inside_one_token_cuts_mid_token(byte_bpe):
    ids = byte_bpe.encode(TEXT, add_special_tokens=False)
    assert byte_bpe.decode([ids[0]]) == "Hello"
    stream, deltas = _stream(byte_bpe, [], ids, stop=("ell",))
    assert deltas[0] == "H" and "".join(deltas) == "H"
    stream, deltas = _stream(byte_bpe, [], ids, stop=("ell",), include_stop=True)
    assert "".join(deltas) == "Hell"
    stream, deltas = _stream(byte_bpe, [], ids, stop=("Hello", "ell"))  # both end in this token: "ell" ends first
    assert "".join(deltas) == "H" and stream.matched_stop == "ell"


def test_first_occurrence_wins_and_later_tokens_are_ignored(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stops = ("more", "STOP", "the")
    stream, deltas = _stream(tokenizer, [], ids + ids, stop=stops)
    assert "".join(deltas) == stream.text == TEXT[: TEXT.index("the")]
    assert stream.matched_stop == "the"
    assert stream.append(ids[0]) == "" and stream.finish() == ""
    assert _expected(tokenizer, ids + ids, stops) == stream.text


def test_possible_stop_prefix_is_held_back_then_flushed_by_finish(tokenizer):
    ids = tokenizer.encode("Hello wor", add_special_tokens=False)
    stream = TextStream(tokenizer, [], stop=("world",))
    emitted = "".join(stream.append(t) for t in ids)
    assert emitted == stream.text == "Hello "  # "wor" may begin "world"
    assert stream.finish() == "wor"
    assert stream.text == "Hello wor" and not stream.stopped


def test_incomplete_character_at_the_end_is_flushed_as_decoded(byte_bpe):
    emoji_ids = byte_bpe.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) > 1
    stream = TextStream(byte_bpe, [])
    assert stream.append(emoji_ids[0]) == ""
    tail = stream.finish()
    assert tail == byte_bpe.decode(emoji_ids[:1]) and tail.endswith("\ufffd")


def test_special_tokens_skipped_or_kept(byte_bpe):
    ids = byte_bpe.encode("Hello world", add_special_tokens=False) + [byte_bpe.eos_token_id]
    _, deltas = _stream(byte_bpe, [], ids)
    assert "".join(deltas) == "Hello world"
    _, deltas = _stream(byte_bpe, [], ids, skip_special_tokens=False)
    assert "".join(deltas) == "Hello world<|im_end|>"


def test_prompt_context_keeps_sentencepiece_leading_space():
    tokenizer = _trained_bpe(pre_tokenizers.Metaspace(), decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]))
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    full = tokenizer.encode("Hello world again", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    generated = full[len(prompt):]
    assert tokenizer.decode(generated) == "world again"  # decoding alone drops the leading space
    _, deltas = _stream(tokenizer, prompt, generated)
    assert "".join(deltas) == " world again"


def test_a_prompt_ending_inside_a_character_still_keeps_the_leading_space():
    """The prompt's context was dropped whole when it ended inside a character (a byte-fallback token), and a
    SentencePiece decoder then stripped the first word's space."""
    from tokenizers import models, normalizers

    vocab = {t: i for i, t in enumerate(["<unk>", "▁", "H", "i", "▁there", "!", "<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>",
                                         "<0xA4>", "<0x97>"])}
    spm = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    spm.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=spm, unk_token="<unk>")
    hug = [vocab[f"<0x{b:02X}>"] for b in "🤗".encode()]
    # a window of 5 tokens beginning with 🤗's last byte (its byte group decoded to U+FFFD alone); one holding no
    # whole character (🤗's last byte, then 3 of the next one's 4); one ending in skipped special tokens
    for prompt in ([2, 3], [2, 3, vocab["<0xC3>"]], [2, 3, *hug, *hug], [2, 3, *hug, *hug[:3]],
                   [2, 3, *hug, 0, 0, 0, 0]):
        _, deltas = _stream(tokenizer, prompt, [vocab["▁there"], vocab["!"]])
        assert "".join(deltas) == " there!", prompt


def test_spaces_that_decode_to_nothing_alone_are_kept():
    """Decoders that strip a text's first space decode a lone "▁" to nothing after a prompt of special tokens; the
    spaces are still the output's (only skipped special tokens may leave the window)."""
    tokenizer = _trained_bpe(pre_tokenizers.Metaspace(), decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]))
    space = tokenizer.convert_tokens_to_ids("▁")
    ids = [space, space] + tokenizer.encode("Hello world", add_special_tokens=False)
    _, deltas = _stream(tokenizer, [tokenizer.bos_token_id], ids)
    assert "".join(deltas) == tokenizer.decode(ids) and "".join(deltas).startswith("  ")


def test_window_stays_short(byte_bpe):
    """Each step decodes a few tokens, not the whole output."""
    class Spy:
        def __init__(self, inner):
            self.inner, self.sizes = inner, []

        def decode(self, ids, skip_special_tokens=True):
            self.sizes.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

        def get_added_tokens_decoder(self):
            return self.inner.get_added_tokens_decoder()

        def get_vocab_size(self, with_added_tokens=True):
            return self.inner.get_vocab_size(with_added_tokens=with_added_tokens)

    spy = Spy(byte_bpe.backend_tokenizer)
    ids = byte_bpe.encode(TEXT * 40, add_special_tokens=False)
    stream, deltas = _stream(type("T", (), {"backend_tokenizer": spy})(), ids[:20], ids)
    assert "".join(deltas) == byte_bpe.decode(ids)
    assert len(ids) > 1000 and max(spy.sizes) <= 12
    spy.sizes.clear()  # tokens that add no text (skipped special tokens, e.g. a model repeating its end id)
    unknown = len(byte_bpe) + 7  # past the tokenizer's vocabulary, as a padded embedding row may be sampled
    silent = ids[:30] + [byte_bpe.eos_token_id] * 500 + ids[30:60] + [byte_bpe.eos_token_id, unknown] * 250
    stream, deltas = _stream(type("T", (), {"backend_tokenizer": spy})(), ids[:20], silent)
    assert "".join(deltas) == byte_bpe.decode(silent, skip_special_tokens=True)
    assert max(spy.sizes) <= 12


@pytest.mark.parametrize("seed", range(30))
def test_random_sequences_concatenate_to_the_cut_decode(tokenizer, seed):
    rng = random.Random(seed)
    vocab = len(tokenizer)
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
    skip = rng.random() < 0.5
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    stops = []
    for _ in range(rng.randrange(0, 3)):
        start = rng.randrange(len(text) + 1)
        stops.append(text[start : start + rng.randrange(1, 5)] or "zz")
    stops.append(rng.choice(["Hello", "e", "😀", "\n\n", "the end"]))
    include = rng.random() < 0.5
    stream, deltas = _stream(tokenizer, prompt, ids, stop=tuple(stops), include_stop=include,
                             skip_special_tokens=skip)
    assert "".join(deltas) == stream.text == _expected(tokenizer, ids, stops, include, skip)


@pytest.mark.parametrize("seed", range(10))
def test_random_real_text_never_emits_broken_characters(tokenizer, seed):
    rng = random.Random(seed)
    words = TEXT.split(" ") + CORPUS[1].split("、") + ["😀", "🎉", "👍🏽", "日本語", "\n"]
    text = " ".join(rng.choice(words) for _ in range(60))
    ids = tokenizer.encode(text, add_special_tokens=False)
    stops = (rng.choice(words)[:3], "zzz")
    stream, deltas = _stream(tokenizer, [], ids, stop=stops)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == _expected(tokenizer, ids, stops)


def test_stop_strings_are_not_looked_for_before_min_tokens(tokenizer):
    """vLLM's meaning: a stop string counts once more than min_tokens tokens were generated, and only where it ends
    past the first min_tokens tokens' text (one held back while it may begin a longer stop included)."""
    ids = tokenizer.encode("a. b. c. d", add_special_tokens=False)
    text = tokenizer.decode(ids)
    dots = [i for i in range(1, len(ids) + 1) if tokenizer.decode(ids[:i]).count(".") == 2]
    min_tokens = dots[0]  # the token that completes the second ".": the third is the first that may stop
    stream, deltas = _stream(tokenizer, [], ids, stop=(".",), min_tokens=min_tokens)
    assert stream.matched_stop == "."
    assert "".join(deltas) == stream.text == text[: text.rindex(".")]
    stream, _ = _stream(tokenizer, [], ids, stop=(".",), min_tokens=len(ids) + 1)
    assert not stream.stopped and stream.text == text
    stream, _ = _stream(tokenizer, [], ids, stop=(". b. c",), min_tokens=dots[0])  # across the boundary: it counts
    assert stream.matched_stop == ". b. c" and stream.text == "a"
    stream, _ = _stream(tokenizer, [], ids, stop=("b. z", "b"), min_tokens=dots[0])  # "b" was held back before
    assert not stream.stopped and stream.text == text


def test_a_stop_string_only_the_last_flush_decodes_ends_the_request_as_a_stop(byte_bpe):
    """Generation ends on max_tokens mid-character: the flush decodes the held-back bytes (U+FFFD here) and a stop
    string matches in them. The text is cut there, so the request stopped on that string, not on its length."""
    from camshaft.runtime.request import Request
    from camshaft.runtime.sampler import SampleResult, SequenceSampler
    from camshaft.runtime.sampling_params import SamplingParams

    first_byte = byte_bpe.encode("😀", add_special_tokens=False)[0]
    for stop, expected in ((None, ("length", None, "\ufffd")), ("\ufffd", ("stop", "\ufffd", ""))):
        params = SamplingParams(max_tokens=1, stop=stop, ignore_eos=True)
        request = Request("r", [1], params, SequenceSampler(params, [1], (), [], len(byte_bpe)),
                          TextStream(byte_bpe, [1], stop=params.stop), ())
        delta = request.add_sample(SampleResult(first_byte))
        assert (request.finish_reason, request.stop_reason, delta) == expected
