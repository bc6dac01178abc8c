#!/usr/bin/env python
"""The throughput benchmark's transformers peer in the benchmark's process vs in a process of its own: does where it
runs move its speed? Both copies load once and warm up, then run the same static batch alternately (in-process
first in even pairs, isolated first in odd ones).

    .venv/bin/python scripts/ab_peer_process.py --pairs 2 --num-requests 32
"""

from __future__ import annotations

import argparse
import time

from bench_common import log
from bench_static_peer import TransformersPeer
from bench_systems import Isolated

from camshaft.models import default_model_dir
from camshaft.runtime.bench_data import load_dataset, parse_dataset_spec, warmup_requests

DATASET = "synthetic:in=NORMAL(200,50),out=NORMAL(128,32)"  # the throughput benchmark's


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=32, help="also the batch size: one static batch a run")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from transformers import AutoTokenizer

    model = default_model_dir("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    requests = load_dataset(parse_dataset_spec(DATASET), args.num_requests, max_seq_len=1024,
                            vocab_size=tokenizer.vocab_size, seed=0, tokenizer=tokenizer)
    systems = {"in-process": TransformersPeer(model, args.threads),
               "isolated": Isolated(TransformersPeer, model, args.threads)}
    for system in systems.values():
        system.run(warmup_requests(requests, tokenizer.vocab_size), 4)
    for pair in range(args.pairs):
        for name in (["in-process", "isolated"] if pair % 2 == 0 else ["isolated", "in-process"]):
            time.sleep(0.5)
            run = systems[name].run(requests, args.num_requests)
            log(f"pair {pair + 1}: {name} {run['output_tok_s']:.1f} out tok/s ({run['wall_s']:.1f} s)")
    systems["isolated"].close()


if __name__ == "__main__":
    main()
