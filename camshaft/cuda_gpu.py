"""GPU 0 as cuda-python's runtime sees it. Nothing of TensorRT is touched: creating a TensorRT runtime on a machine
without a driver can crash the process instead of raising."""

from __future__ import annotations

from typing import Any, NamedTuple


class GpuProbe(NamedTuple):
    arch: int | None  # GPU 0's compute capability (89 for SM 8.9); None when no GPU is usable
    reason: str = ""  # why none is: the CUDA error, or "no CUDA device"
    old_driver: str = ""  # a driver is there but older than this cuda-python's CUDA: what to do about it


def _cuda_version(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def probe_gpu0(cudart: Any) -> GpuProbe:
    success = cudart.cudaError_t.cudaSuccess
    err, count = cudart.cudaGetDeviceCount()
    if err != success or not count:
        reason = getattr(err, "name", str(err)) if err != success else "no CUDA device"
        if reason != "cudaErrorInsufficientDriver":
            return GpuProbe(None, reason)
        driver_err, driver = cudart.cudaDriverGetVersion()  # 0: no driver at all
        if driver_err == success and driver:
            _, runtime = cudart.cudaRuntimeGetVersion()
            return GpuProbe(None, reason, (
                f"the NVIDIA driver here supports CUDA {_cuda_version(driver)}, older than the CUDA "
                f"{_cuda_version(runtime)} cuda-python runs on ({reason}); update the driver to one for CUDA "
                f"{_cuda_version(runtime)} or later"))
        return GpuProbe(None, reason)
    attr = cudart.cudaDeviceAttr
    (err, major), (err_minor, minor) = (cudart.cudaDeviceGetAttribute(a, 0) for a in (
        attr.cudaDevAttrComputeCapabilityMajor, attr.cudaDevAttrComputeCapabilityMinor))
    if err != success or err_minor != success:
        failed = err if err != success else err_minor
        return GpuProbe(None, f"GPU 0's compute capability: {getattr(failed, 'name', failed)}")
    return GpuProbe(major * 10 + minor)


def rtx_archs(trt: Any) -> list[int]:
    """The compute capabilities TensorRT-RTX (its module `trt`) builds plans for, as integers."""
    return sorted(int(m.value) for name, m in trt.ComputeCapability.__members__.items() if name.startswith("SM"))
