"""The throughput benchmark's peer: transformers fp32, greedy, static batches of C requests in arrival order, left
padding, each batch generating until its longest request is done."""

from __future__ import annotations

import time
from pathlib import Path

from bench_common import cache_keyword, returned_cache

PEER = "transformers fp32 (static batches)"

class TransformersPeer:
    """Greedy, static batches in arrival order, left padding, each batch runs until its longest request is done.
    TTFT counts from the batch's start (the client hands a batch over when the previous one is done)."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.name = PEER
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.cache_arg = cache_keyword(self.model)

    def _cache(self, out):
        return returned_cache(out, self.cache_arg)

    def run(self, requests, batch_size: int) -> dict:
        torch, model = self.torch, self.model
        ttft, e2e, itl, tokens = [], [], [], []
        started = time.perf_counter()
        with torch.inference_mode():
            for lo in range(0, len(requests), batch_size):
                batch = requests[lo: lo + batch_size]
                t0 = time.perf_counter()
                width = max(len(r.prompt_ids) for r in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for i, r in enumerate(batch):
                    ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                    mask[i, width - len(r.prompt_ids):] = 1
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                times = [[time.perf_counter()] for _ in batch]
                outs = [[int(t)] for t in token[:, 0]]
                past = self._cache(out)
                for step in range(1, max(r.max_tokens for r in batch)):
                    mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=torch.long)], dim=1)
                    positions = positions[:, -1:] + 1
                    out = model(input_ids=token, attention_mask=mask, position_ids=positions, use_cache=True,
                                **{self.cache_arg: past})
                    past = self._cache(out)
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    now = time.perf_counter()
                    for i, r in enumerate(batch):
                        if step < r.max_tokens:
                            times[i].append(now)
                            outs[i].append(int(token[i, 0]))
                for ts, o in zip(times, outs, strict=True):
                    ttft.append(ts[0] - t0)
                    e2e.append(ts[-1] - t0)
                    itl.extend(b - a for a, b in zip(ts, ts[1:], strict=False))
                    tokens.append(o)
        wall = time.perf_counter() - started
        from camshaft.runtime.throughput_report import percentiles

        output_tokens = sum(len(t) for t in tokens)
        return {"concurrency": batch_size, "wall_s": wall, "output_tokens": output_tokens,
                "output_tok_s": output_tokens / wall, "requests_s": len(requests) / wall,
                "ttft_ms": ms(percentiles(ttft)), "itl_ms": ms(percentiles(itl)), "e2e_ms": ms(percentiles(e2e)),
                "token_ids": tokens}


def ms(p: dict) -> dict:
    return {k: v * 1000 for k, v in p.items()}
