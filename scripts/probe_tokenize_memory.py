"""Peak memory of tokenizing one long text with SmolLM2's tokenizer (transformers' fast tokenizer): what an unbounded
`/tokenize` request would cost the OpenAI server, and why it counts at most 4 contexts of tokens.

    .venv/bin/python scripts/probe_tokenize_memory.py [TOKENS]   (default 3,000,000: "a " repeated, ~6 MB)
"""

from __future__ import annotations

import resource
import sys

from transformers import AutoTokenizer

from camshaft.models import default_model_dir, fetch_model


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3_000_000
    model = fetch_model("smollm2-135m-instruct", default_model_dir("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer("warm up")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    text = "a " * count
    ids = tokenizer(text)["input_ids"]
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(f"{len(text) / 1e6:.1f} MB of text, {len(ids)} tokens: peak RSS +{grown / 2**20:.0f} MiB, "
          f"{grown / len(ids):.0f} bytes a token")


if __name__ == "__main__":
    main()
