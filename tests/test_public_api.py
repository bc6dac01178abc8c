"""What `import camshaft` offers: every exported name resolves, and the result types behave as documented."""

from __future__ import annotations

import numpy as np

import camshaft
from camshaft.errors import CamshaftError

from tiny_models import tiny_engine


def test_every_exported_name_resolves_and_is_listed():
    assert set(camshaft._LAZY) <= set(camshaft.__all__)
    for name in camshaft.__all__:
        assert getattr(camshaft, name) is not None, name
    assert {"LLM", "Session", "SamplingParams", "GenerationResult", "build_engine", "quantize_checkpoint",
            "RequestError", "ServerBusyError"} <= set(dir(camshaft))
    assert issubclass(camshaft.ServerBusyError, CamshaftError) and camshaft.QuantizeError.__module__


def test_llm_takes_token_ids_in_any_sequence_and_outputs_forward_finish_reason(tmp_path):
    engine = tiny_engine(tmp_path, max_seq_len=64, max_batch_size=4)
    with camshaft.LLM(engine, threads=1) as llm:
        params = camshaft.SamplingParams(max_tokens=3, ignore_eos=True)
        as_list, as_tuple, as_array = (llm.generate(p, params, use_tqdm=False)
                                       for p in ([5, 6, 7], (5, 6, 7), np.array([5, 6, 7])))
        assert len(as_list) == len(as_tuple) == len(as_array) == 1
        assert as_list[0].token_ids == as_tuple[0].token_ids == as_array[0].token_ids
        assert as_list[0].finish_reason == "length"
