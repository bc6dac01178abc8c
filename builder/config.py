"""Build options: frozen, validated on construction, never silently changed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from camshaft.checks import check_positive_ints, is_int_at_least
from camshaft.errors import BuildConfigError
from camshaft.manifest import ENGINE_DTYPES, TARGETS
from camshaft.model_config import ModelConfig

MOST_SEQUENCES = 2**14  # max_batch_size
MOST_STEP_TOKENS = 2**18  # max_num_tokens
DTYPES = ("auto", *ENGINE_DTYPES)
DEFAULT_KV_BLOCK = 32  # tokens per KV block unless told
# activations beyond float16's 65504 (Gemma's residual stream): NaN in a float16 engine; vLLM refuses float16 for them
FLOAT16_OVERFLOWS = ("gemma2", "gemma3")
# What each target builds; auto: the checkpoint's own type where the target builds it for the GPU (bfloat16: sm80+,
# targets/precision.py), else the first.
TARGET_DTYPES = {"onnxruntime": ("float32",), "tensorrt": ("float16", "bfloat16"),
                 "tensorrt-rtx": ("float16", "bfloat16")}
# How the onnxruntime target multiplies weight-only (int4/int8) layers: float dequantizes the weights (exact), int8
# quantizes each input row to int8 per block on the fly (MatMulNBits accuracy level 4, as onnxruntime-genai and
# llama.cpp do). auto = int8: measured on SmolLM2 in docs/quantize.md.
WEIGHT_ONLY_COMPUTE = ("auto", "float", "int8")
ACCURACY_LEVELS = {"float": 0, "int8": 4}


@dataclass(frozen=True)
class BuildConfig:
    model_dir: Path
    output_dir: Path
    target: str = "onnxruntime"
    dtype: str = "auto"
    max_batch_size: int = 32
    max_seq_len: int | None = None
    max_num_tokens: int = 512
    kv_block_size: int = DEFAULT_KV_BLOCK
    gpu_arch: str | None = None
    weight_only_compute: str = "auto"

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise BuildConfigError(f"unknown target {self.target!r}; choose one of {', '.join(TARGETS)}")
        if self.dtype not in DTYPES:
            raise BuildConfigError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.dtype != "auto" and self.dtype not in TARGET_DTYPES[self.target]:
            raise BuildConfigError(
                f"target {self.target} builds {'/'.join(TARGET_DTYPES[self.target])} engines, not {self.dtype}; "
                f"drop --dtype or pass --dtype {TARGET_DTYPES[self.target][0]}"
            )
        check_positive_ints(self, ("max_batch_size", "max_num_tokens", "kv_block_size"), BuildConfigError,
                            lambda name: f"--{name.replace('_', '-')}")
        if self.max_seq_len is not None and not is_int_at_least(self.max_seq_len, 2):
            raise BuildConfigError(f"--max-seq-len must be an integer > 1, got {self.max_seq_len!r}")
        for name in ("max_batch_size", "max_num_tokens", "kv_block_size", "max_seq_len"):  # numpy's: Python's
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        for name, most in (("max_batch_size", MOST_SEQUENCES), ("max_num_tokens", MOST_STEP_TOKENS)):
            if getattr(self, name) > most:  # tables and buffers are sized by them before anything runs
                raise BuildConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} is beyond what a CPU or GPU "
                                       f"step runs ({most} at most); pass a smaller value")
        if self.kv_block_size & (self.kv_block_size - 1):
            raise BuildConfigError(f"--kv-block-size must be a power of two, got {self.kv_block_size}")
        if self.max_seq_len is not None:
            self.check_block(self.max_seq_len)
        if self.gpu_arch is not None and not self.target.startswith("tensorrt"):
            raise BuildConfigError(f"--gpu-arch applies to the tensorrt targets, not {self.target}; drop it")
        if self.gpu_arch is not None and not isinstance(self.gpu_arch, str):
            raise BuildConfigError(f"gpu_arch is a string (e.g. \"sm89\"), got {self.gpu_arch!r:.40}")
        if self.gpu_arch is not None and not self.gpu_arch.strip():  # an unset $ARCH: not the default, silently
            raise BuildConfigError("--gpu-arch is empty; give one such as sm89, or drop it for the default")
        if self.weight_only_compute not in WEIGHT_ONLY_COMPUTE:
            raise BuildConfigError(f"unknown --weight-only-compute {self.weight_only_compute!r}; choose one of "
                                   f"{', '.join(WEIGHT_ONLY_COMPUTE)}")
        if self.weight_only_compute != "auto" and self.target != "onnxruntime":
            raise BuildConfigError(f"--weight-only-compute applies to the onnxruntime target; {self.target} picks "
                                   "its own kernels. Drop it.")
        if self.resolved_gpu_arch is not None:
            from camshaft.builder.targets.precision import check_precision
            from camshaft.builder.targets.trt_product import parse_arch

            check_precision(self.target, parse_arch(self.resolved_gpu_arch), dtype=self.resolved_dtype())
        if Path(self.model_dir).resolve() == Path(self.output_dir).resolve():
            raise BuildConfigError("--output must differ from --model: the engine would overwrite the checkpoint")

    @property
    def resolved_gpu_arch(self) -> str | None:
        """TensorRT-RTX builds ahead of time, for sm89 unless told otherwise; TensorRT builds for the local GPU."""
        if self.target == "tensorrt-rtx":
            return "sm89" if self.gpu_arch is None else self.gpu_arch
        return self.gpu_arch

    @property
    def accuracy_level(self) -> int:
        """MatMulNBits accuracy level of the onnxruntime target's weight-only layers."""
        return ACCURACY_LEVELS["int8" if self.weight_only_compute == "auto" else self.weight_only_compute]

    def resolved_dtype(self, stored: str | None = None, arch: int | None = None, architecture: str = "") -> str:
        """The engine's float type: --dtype, or for auto the checkpoint's `stored` type (the weights as stored:
        trtllm-build's auto reads config.json's instead) where the target builds it for `arch` (None: any), else the
        target's first; bfloat16 rather than float16 for an `architecture` whose activations overflow float16."""
        if self.dtype != "auto":
            return self.dtype
        from camshaft.builder.targets.precision import required_arch

        def builds(dtype: str) -> bool:
            return dtype in TARGET_DTYPES[self.target] and (arch is None or
                                                           arch >= required_arch(self.target, dtype=dtype)[0])

        picked = stored if stored is not None and builds(stored) else TARGET_DTYPES[self.target][0]
        return "bfloat16" if picked == "float16" and architecture in FLOAT16_OVERFLOWS and builds("bfloat16") \
            else picked

    def check_block(self, max_seq_len: int) -> None:
        """Every request holds whole blocks: one beyond a whole sequence (rounded up to a power of two; the default
        block is always taken) only multiplies each request's KV memory."""
        most = max(1 << (max_seq_len - 1).bit_length(), DEFAULT_KV_BLOCK)
        if self.kv_block_size > most:
            raise BuildConfigError(f"--kv-block-size {self.kv_block_size} is larger than a whole sequence "
                                   f"(--max-seq-len {max_seq_len}), and each request would hold a block of that many "
                                   f"tokens; pass --kv-block-size {most} or less")

    def resolved_max_seq_len(self, model: ModelConfig) -> int:
        longest = model.context_length
        if self.max_seq_len is None:
            self.check_block(min(longest, 4096))
            return min(longest, 4096)
        if self.max_seq_len > longest:
            scaled = f", {model.rope.type} rope scaling x{model.rope.factor:g} included" \
                if longest > model.max_position_embeddings else ""
            raise BuildConfigError(
                f"--max-seq-len {self.max_seq_len} exceeds the model's context ({longest} tokens: "
                f"max_position_embeddings {model.max_position_embeddings}{scaled}); pass --max-seq-len {longest} or "
                "less")
        return self.max_seq_len
