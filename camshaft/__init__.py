"""camshaft: build, quantize, serve and benchmark LLM inference engines."""

from __future__ import annotations

import os
from importlib import import_module
from typing import TYPE_CHECKING

from camshaft.errors import (
    BuildConfigError,
    CamshaftError,
    CapacityError,
    CheckpointError,
    EngineError,
    FetchError,
    RequestError,
    ServerBusyError,
    ServerClosedError,
    UnsupportedModelError,
)
from camshaft.version import __version__

# ONNX Runtime (1.32 on Linux) sends usage telemetry by default, keeping a device id and an event cache in ~/.cache:
# off unless ORT_DISABLE_TELEMETRY is set (onnxruntime reads it once, as it is first imported)
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

# Imported on first use, so that `import camshaft` (and the CLI's --help) stays fast.
_LAZY = {
    "LLM": "camshaft.runtime.llm", "Session": "camshaft.runtime.session",
    "SamplingParams": "camshaft.runtime.sampling_params", "GuidedDecodingParams": "camshaft.runtime.guided",
    "PromptLookup": "camshaft.runtime.prompt_lookup",
    "GenerationResult": "camshaft.runtime.outputs",
    "Timings": "camshaft.runtime.outputs", "RequestMetrics": "camshaft.runtime.outputs",
    "PromptOutput": "camshaft.runtime.outputs",
    "RequestOutput": "camshaft.runtime.outputs", "SampleResult": "camshaft.runtime.sampler",
    "build_engine": "camshaft.builder.build", "BuildConfig": "camshaft.builder.config",
    "quantize_checkpoint": "camshaft.quantize.modelopt_adapter", "QuantSpec": "camshaft.quantize.spec",
    "QuantizeError": "camshaft.quantize.spec",
}
__all__ = [
    "__version__", "LLM", "Session", "SamplingParams", "GuidedDecodingParams", "PromptLookup", "GenerationResult",
    "Timings", "RequestMetrics",
    "PromptOutput", "RequestOutput",
    "SampleResult", "build_engine", "BuildConfig", "quantize_checkpoint", "QuantSpec", "QuantizeError",
    "BuildConfigError", "CamshaftError", "CapacityError", "CheckpointError", "EngineError", "FetchError",
    "RequestError", "ServerBusyError", "ServerClosedError", "UnsupportedModelError",
]

if TYPE_CHECKING:
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantizeError, QuantSpec
    from camshaft.runtime.guided import GuidedDecodingParams
    from camshaft.runtime.llm import LLM
    from camshaft.runtime.outputs import GenerationResult, PromptOutput, RequestMetrics, RequestOutput, Timings
    from camshaft.runtime.sampler import SampleResult
    from camshaft.runtime.sampling_params import SamplingParams
    from camshaft.runtime.session import Session


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'camshaft' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
