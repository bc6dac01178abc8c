"""Turns the chunks scheduled for one step into the engine graph's inputs (see builder/graph/decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from camshaft.io_signature import GROUP_FLAGS, LONG_ROPE_INPUTS, SLIDING_INPUTS, STEP_INPUTS
from camshaft.model_config import RopeConfig
from camshaft.runtime.kv_cache import NULL_BLOCK

# Every graph input build_step can produce; an engine asking for another one needs a newer camshaft.
FEED_NAMES = frozenset(spec.name for spec in STEP_INPUTS + GROUP_FLAGS + SLIDING_INPUTS + LONG_ROPE_INPUTS)


@dataclass(frozen=True)
class Chunk:
    """New tokens of one sequence for this step: positions start_pos.., blocks covering all of them."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_logits: int = 1  # logits rows wanted for this chunk's last tokens (0: none; len(token_ids): all)
    longest_pass: int | None = None  # the most tokens its sequence is fed (LongRoPE's factors); None: up to this chunk

    def long_rope_from(self, rope: RopeConfig) -> int:
        end = self.start_pos + len(self.token_ids)
        return rope.long_rope_from(end if self.longest_pass is None else self.longest_pass)


@dataclass(frozen=True)
class StepBatch:
    feeds: dict[str, np.ndarray]
    num_tokens: int


def _group_masks(starts: np.ndarray, lens: np.ndarray, q_len: int, kv_len: int, window: int | None):
    q = np.arange(q_len)[None, :, None]
    k = np.arange(kv_len)[None, None, :]
    pos = starts[:, None, None] + q
    valid = q < lens[:, None, None]
    full = (k <= pos) & valid
    full[:, :, 0] |= ~valid[:, :, 0]  # padded query rows attend to one slot so softmax stays finite
    sliding = None
    if window is not None:
        sliding = full & ((pos - k < window) | ~valid)
    return full[:, None], (sliding[:, None] if sliding is not None else None)


def _block_tables(tables: list[list[int]], blocks: int) -> np.ndarray:
    out = np.full((len(tables), blocks), NULL_BLOCK, dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table[:blocks]
    return out


def split_decodes(chunks: list[Chunk], decode: list[int], block_size: int) -> tuple[list[int], list[int]]:
    """With no prefill chunk in the step the prefill group is free: the longest decodes go there (as one-token
    queries) when that cuts the K/V both groups gather, padded to each group's longest context, by a tenth."""
    order = sorted(decode, key=lambda i: chunks[i].start_pos)
    blocks = [chunks[i].start_pos // block_size + 1 for i in order]
    n = len(order)
    cost, split = min((k * blocks[k - 1] + (n - k) * blocks[-1], k) for k in range(1, n))
    if cost > 0.9 * n * blocks[-1]:
        return decode, []
    return order[:split], order[split:]


def build_step(chunks: list[Chunk], block_size: int, sliding_window: int | None,
               group_flags: bool = False, long_rope: RopeConfig | None = None) -> StepBatch:
    """The graph's inputs for one step; `group_flags` for graphs that skip an empty group (inputs has_decode,
    has_prefill); `long_rope` for graphs that take long_rope_from. An empty group is still fed as a one-token dummy
    on the null block, which keeps every shape valid."""
    ids, positions, token_seq = [], [], []
    for i, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start_pos, chunk.start_pos + n))
        token_seq.extend([i] * n)
    positions_arr = np.asarray(positions, dtype=np.int64)
    num_tokens = len(ids)
    tables = [chunks[s].block_table for s in range(len(chunks))]
    slot_blocks = np.array([tables[s][p // block_size] for s, p in zip(token_seq, positions, strict=True)],
                           dtype=np.int64)
    write_index = np.stack([slot_blocks, positions_arr % block_size], axis=1)

    offsets = np.cumsum([0] + [len(c.token_ids) for c in chunks])
    decode = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    prefill = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
    if not prefill and len(decode) > 1:
        decode, prefill = split_decodes(chunks, decode, block_size)
    logits_index = [t for i, c in enumerate(chunks) for t in range(offsets[i + 1] - c.num_logits, offsets[i + 1])]
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.asarray(ids, dtype=np.int64),
        "positions": positions_arr,
        "kv_write_index": write_index,
        "logits_index": np.asarray(logits_index, dtype=np.int64),
    }
    attn_index = np.empty(num_tokens, dtype=np.int64)

    def group(members: list[int], q_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        if not members:  # a one-token dummy group on the null block keeps the graph's shapes valid
            masks = np.zeros((1, 1, q_len, block_size), dtype=bool)
            masks[..., 0] = True
            return np.zeros((1, q_len), np.int64), np.zeros((1, 1), np.int64), masks, masks
        starts = np.array([chunks[i].start_pos for i in members], dtype=np.int64)
        lens = np.array([len(chunks[i].token_ids) for i in members], dtype=np.int64)
        blocks = int(-(-(starts + lens).max() // block_size))
        token_index = np.zeros((len(members), q_len), dtype=np.int64)
        for row, i in enumerate(members):
            token_index[row, : lens[row]] = np.arange(offsets[i], offsets[i + 1])
        full, sliding = _group_masks(starts, lens, q_len, blocks * block_size, sliding_window)
        return token_index, _block_tables([tables[i] for i in members], blocks), full, sliding

    d_index, d_tables, d_mask, d_sliding = group(decode, 1)
    feeds["decode_token_index"] = d_index[:, 0].copy()
    feeds["decode_block_tables"] = d_tables
    feeds["decode_mask"] = d_mask
    q_len = max((len(chunks[i].token_ids) for i in prefill), default=1)
    p_index, p_tables, p_mask, p_sliding = group(prefill, q_len)
    feeds["prefill_token_index"] = p_index
    feeds["prefill_block_tables"] = p_tables
    feeds["prefill_mask"] = p_mask
    if sliding_window is not None:
        feeds["decode_mask_sliding"] = d_sliding
        feeds["prefill_mask_sliding"] = p_sliding
    bd = len(d_index)
    for row, i in enumerate(decode):
        attn_index[offsets[i]] = row
    for row, i in enumerate(prefill):
        n = offsets[i + 1] - offsets[i]
        attn_index[offsets[i]: offsets[i + 1]] = bd + row * q_len + np.arange(n)
    feeds["attn_output_index"] = attn_index
    if long_rope is not None:
        feeds["long_rope_from"] = np.repeat(np.array([c.long_rope_from(long_rope) for c in chunks], np.int64),
                                            offsets[1:] - offsets[:-1])
    if group_flags:
        feeds["has_decode"] = np.array(bool(decode))
        feeds["has_prefill"] = np.array(bool(prefill))
    return StepBatch(feeds, num_tokens)
