"""The TensorRT products (tensorrt-rtx, tensorrt) as build targets: importing one with an install hint, and the GPU
architectures it can build plans for."""

from __future__ import annotations

import re
from typing import Any

from camshaft.cuda_gpu import probe_gpu0, rtx_archs
from camshaft.errors import BuildConfigError, needs_extra
from camshaft.manifest import TRT_MODULES


def import_product(product: str) -> Any:
    """The product's Python module, or a BuildConfigError that says how to install it."""
    if product not in TRT_MODULES:
        raise BuildConfigError(f"unknown TensorRT product {product!r}; choose one of {', '.join(TRT_MODULES)}")
    import importlib

    try:
        return importlib.import_module(TRT_MODULES[product])
    except ImportError as exc:
        raise BuildConfigError(needs_extra(f"the {product} target (the {TRT_MODULES[product]} Python package, not "
                                           f"importable here: {exc})", product)) from exc


def parse_arch(gpu_arch: str) -> int:
    """"sm89", "sm_89", "SM89", "89" or "8.9" → 89."""
    text = gpu_arch.strip().lower()
    match = re.fullmatch(r"(?:sm_?)?(\d{2,3})", text) or re.fullmatch(r"(\d{1,2})\.(\d)", text)
    if match is None:
        raise BuildConfigError(f"{gpu_arch!r} is not a GPU architecture; write it like sm89 (or 8.9)")
    return int("".join(match.groups()))


def supported_archs(trt: Any, product: str) -> list[int]:
    """The compute capabilities a plan can be built for with this product, as integers (89 for SM 8.9)."""
    if product == "tensorrt-rtx":
        return rtx_archs(trt)
    return [_local_arch(product)]


def _local_arch(product: str) -> int:
    """The compute capability of GPU 0, probed through cuda-python (creating a TensorRT runtime without a driver can
    crash the process, so TensorRT itself is never asked)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise BuildConfigError(needs_extra(f"the {product} target (cuda-python, to find the GPU)", product)) from exc
    gpu = probe_gpu0(cudart)
    if gpu.old_driver:
        raise BuildConfigError(f"the {product} target builds plans on the GPU, and {gpu.old_driver}.")
    if gpu.arch is None:
        raise BuildConfigError(
            f"the {product} target builds plans on a GPU of the target architecture and this machine has none "
            f"({gpu.reason}). Build on such a GPU, or use the tensorrt-rtx target, which builds ahead of time "
            "without a GPU."
        )
    return gpu.arch


def check_arch(trt: Any, product: str, gpu_arch: str) -> int:
    arch = parse_arch(gpu_arch)
    supported = supported_archs(trt, product)
    if arch not in supported:
        names = ", ".join(f"sm{a}" for a in supported)
        if product == "tensorrt-rtx":
            raise BuildConfigError(
                f"{product} {trt.__version__} cannot build for sm{arch}; it supports {names}. "
                "(Datacenter GPUs such as sm90 need the tensorrt target, built on such a GPU.)"
            )
        raise BuildConfigError(
            f"{product} builds for the GPU it runs on, which is {names}, not sm{arch}: build on an sm{arch} GPU "
            f"or target {names}"
        )
    return arch
