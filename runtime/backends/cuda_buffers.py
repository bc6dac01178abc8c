"""Device memory and CUDA calls through cuda-python's runtime, for the TensorRT backend."""

from __future__ import annotations

from typing import Any

import numpy as np

from camshaft.errors import EngineError


def check_cuda(cudart: Any, result: tuple, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise EngineError(f"CUDA {what} failed: {getattr(err, 'name', err)}")
    return rest[0] if len(rest) == 1 else rest


class DeviceBuffer:
    def __init__(self, cudart: Any, nbytes: int) -> None:
        self.cudart = cudart
        self.nbytes = max(int(nbytes), 1)
        self.ptr = int(check_cuda(cudart, cudart.cudaMalloc(self.nbytes), f"cudaMalloc({self.nbytes})"))

    def free(self) -> None:
        if self.ptr:
            self.cudart.cudaFree(self.ptr)
            self.ptr = 0


def numpy_dtype(trt, dtype) -> np.dtype:
    """numpy's view of a TensorRT tensor type; trt.nptype has no bfloat16 (ml_dtypes provides it)."""
    bf16 = getattr(getattr(trt, "DataType", None), "BF16", None)
    if bf16 is not None and dtype == bf16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(trt.nptype(dtype))
