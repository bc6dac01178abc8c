"""The load of test_triton_load.py on SmolLM2-135M behind the real tritonserver: 64 concurrent gRPC streaming clients
x 3 rounds, prompts of ~5 to ~300 tokens and answers of up to 64, a quarter cancelling mid-stream; every stream not
cancelled equals the same request run alone through Session. Its own module, so no other server runs beside it."""

from __future__ import annotations

import pytest
from test_triton import PROMPTS
from test_triton_load import BATCH, run_load, serving

from camshaft.builder.build import build_engine
from camshaft.builder.config import BuildConfig

SMOLLM2_PROMPTS = [*PROMPTS, "Explain in one paragraph why the sky is blue. " * 4,
                   "Summarise: " + "The committee met on Tuesday to discuss the budget and the venue. " * 8,
                   "List the planets of the solar system in order, with one fact about each. " * 15]


@pytest.mark.slow
def test_smollm2_64_streaming_clients_three_rounds_with_cancellation(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton_load_smollm2")
    build_engine(BuildConfig(smollm2_dir, root / "engine", max_seq_len=1024, max_num_tokens=256,
                             max_batch_size=BATCH))
    with serving(root / "engine", root) as stack:
        run_load(stack, SMOLLM2_PROMPTS, (4, 16, 32, 64))
