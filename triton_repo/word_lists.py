"""Word lists and logit biases in tensorrtllm_backend's tensor forms: stop/bad words as [1, 2, L] token ids and
offsets, embedding_bias per vocabulary entry, and the text models' bias words with their weights."""

from __future__ import annotations

import numpy as np

from camshaft.errors import RequestError
from camshaft.runtime.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_STOP_WORD_IDS

MAX_WORD_LISTS = min(MAX_BAD_WORDS, MAX_STOP_WORD_IDS)

Values = dict[str, np.ndarray]


def utf8_text(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{name} is not UTF-8 (byte {exc.start} of {len(value)}); send UTF-8 text") from None


def vocab_words(array: np.ndarray | None, name: str, vocab_size: int) -> list[list[int]]:
    """The words of a stop/bad words list, their token ids checked against the vocabulary."""
    words = word_lists(array, name)
    if len(words) > MAX_WORD_LISTS:
        raise RequestError(f"{name} holds {len(words)} words; send at most {MAX_WORD_LISTS}")
    for i, word in enumerate(words):
        if any(not 0 <= t < vocab_size for t in word):
            raise RequestError(f"{name} word {i} holds ids outside this model's vocabulary [0, {vocab_size}): {word}")
    return words


def embedding_bias(array: np.ndarray | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """TensorRT-LLM's embedding_bias (a bias per vocabulary entry, added to the logits) as SamplingParams.logit_bias
    pairs: its non-zero entries, within logit_bias' limits. Empty: none; shorter than the engine's vocabulary (the
    stock preprocessing model's, of the tokenizer's): the rest 0."""
    if array is None or array.size == 0:
        return ()
    bias = np.asarray(array, np.float64).reshape(-1)
    if bias.size > vocab_size:
        raise RequestError(f"embedding_bias must hold one value per vocabulary entry, shape [1, {vocab_size}], got "
                           f"{list(array.shape)}")
    bias = np.pad(bias, (0, vocab_size - bias.size))  # a tokenizer's vocabulary, short of the engine's padded one
    ids = np.flatnonzero(bias)
    if not np.isfinite(bias[ids]).all() or (np.abs(bias[ids]) > 100).any():
        raise RequestError("embedding_bias values must be finite and in [-100, 100] (-100 bans a token), got "
                           f"{bias[ids][~np.isfinite(bias[ids]) | (np.abs(bias[ids]) > 100)][:4].tolist()}")
    if ids.size > MAX_LOGIT_BIAS:
        raise RequestError(f"embedding_bias holds {ids.size} non-zero entries; send at most {MAX_LOGIT_BIAS}")
    return tuple((int(i), float(bias[i])) for i in ids)


def word_lists(array: np.ndarray | None, name: str) -> list[list[int]]:
    """TensorRT-LLM's [1, 2, L] stop/bad words format: concatenated ids, then end offsets padded with -1."""
    if array is None:
        return []
    if array.size == 0:
        return []
    if array.ndim < 2 or array.reshape(-1, array.shape[-1]).shape[0] != 2:
        raise RequestError(f"{name} must have shape [1, 2, L] (ids, then end offsets padded with -1), "
                           f"got {list(array.shape)}")
    ids, offsets = array.reshape(2, -1).tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if not start < end <= len(ids):
            raise RequestError(f"{name}: offsets must increase within the {len(ids)} ids, got {offsets}")
        words.append(ids[start:end])
        start = end
    return words


def text_embedding_bias(tokenizer, values: Values, vocab_size: int) -> np.ndarray | None:
    """tensorrtllm_backend's embedding_bias_words / embedding_bias_weights as the token model's embedding_bias
    [1, vocab]: each word's weight added to each of its token ids (no special tokens)."""
    array, weights = values.get("embedding_bias_words"), values.get("embedding_bias_weights")
    words = [] if array is None else [utf8_text(w, "embedding_bias_words") if isinstance(w, bytes) else str(w)
                                      for w in array.reshape(-1)]
    weights = np.zeros(0) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    if len(words) != weights.size:
        raise RequestError(f"embedding_bias_words holds {len(words)} words and embedding_bias_weights "
                           f"{weights.size} weights; send one weight per word")
    if not words:
        return None
    bias = np.zeros((1, vocab_size), np.float64)
    for word, weight in zip(words, weights, strict=True):
        np.add.at(bias[0], [t for t in tokenizer.encode(word, add_special_tokens=False) if t < vocab_size],
                  weight)  # each occurrence adds, as the stock preprocessing model's loop
    if np.count_nonzero(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"embedding_bias_words cover {np.count_nonzero(bias)} tokens; send words of at most "
                           f"{MAX_LOGIT_BIAS} tokens in all")
    wrong = np.flatnonzero(~(np.abs(bias[0]) <= 100))
    if wrong.size:
        raise RequestError(f"embedding_bias_weights give token {wrong[0]} a bias of {bias[0, wrong[0]]}; keep each "
                           "token's sum finite and in [-100, 100] (-100 bans it)")
    return bias.astype(np.float32)
