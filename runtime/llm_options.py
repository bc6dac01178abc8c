"""The options of an LLM (and of the servers built on it), checked against the engine before it loads, and the
arguments of its calls (prompts, sampling params, priorities) in every form they accept."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from camshaft.checks import is_int, is_int_at_least
from camshaft.errors import CapacityError, RequestError
from camshaft.manifest import BuildLimits, Manifest
from camshaft.runtime.kv_cache import pool_bytes
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.scheduler_config import POLICIES, RESERVATIONS, SchedulerConfig

QUEUE_PER_BATCH = 4  # servers' default max_queue: this many x the batch size may wait beyond a full batch


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int
    max_num_tokens: int


def check_llm_options(limits: BuildLimits, *, policy: str, kv_reservation: str = "paged",
                      max_batch_size: int | None = None, max_num_tokens: int | None = None,
                      max_queue: int | None = None) -> BatchLimits:
    """The batch limits to run with (unset: the engine's); every option refused before any memory is allocated."""
    if policy not in POLICIES:
        raise RequestError(f"policy must be one of {', '.join(POLICIES)} (the capacity policies); got {policy!r:.60}")
    if kv_reservation not in RESERVATIONS:
        raise RequestError(f"unknown KV reservation {kv_reservation!r}; use one of {', '.join(RESERVATIONS)}")
    check_max_queue(max_queue)
    return BatchLimits(_limit("max_batch_size", max_batch_size, limits.max_batch_size),
                       _limit("max_num_tokens", max_num_tokens, limits.max_num_tokens))


def _limit(name: str, value: int | None, engine_limit: int) -> int:
    if value is None:
        return engine_limit
    if not is_int_at_least(value, 1) or value > engine_limit:
        raise RequestError(f"{name} must be a positive integer up to the engine's {engine_limit}, got {value!r}; "
                           f"pass 1..{engine_limit} (unset: the engine's) or rebuild the engine with a larger "
                           f"--{name.replace('_', '-')}")
    return int(value)


def check_serves_full_length(manifest: Manifest, config: SchedulerConfig) -> None:
    """A server announces the engine's max_seq_len as its context (max_model_len): its pool must hold one request of
    that length, or it would refuse requests the context admits (vLLM refuses to start so too)."""
    usable, need = config.num_blocks - 1, config.full_length_blocks  # block 0 is the null block
    if usable >= need:
        return
    least = pool_bytes(manifest, need + 1)
    step = config.largest_step_fitting(usable) if config.releases_blocks else 0
    other = (f"lower max_num_tokens to {step} or less (a request holds its sliding window and a step's tokens)"
             if step >= 1 else
             f"serve an engine built with --max-seq-len {usable * config.block_size} or less")
    raise CapacityError(
        f"the KV cache holds {usable} blocks of {config.block_size} tokens, fewer than the {need} one request of the "
        f"engine's max_seq_len {config.max_seq_len} takes, so a server would refuse requests within the context it "
        f"announces; raise kv_cache_memory to at least {least_text(least)}, or {other}")


def least_text(size: int) -> str:
    """A byte count as kv_cache_memory takes it, rounded up to a whole KiB or MiB (never below `size`)."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= 16 * scale:
            return f"{-(-size // scale)}{unit}"
    return str(size)


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_runtime_options(threads: int | None = None, spin_wait: bool = True, huge_pages: bool = True) -> None:
    """The backend options LLM and Session take, refused before the engine loads when they are not what they say."""
    if threads is not None and not is_int_at_least(threads, 1):
        raise RequestError(f"threads must be an integer >= 1, or unset for the backend's choice; got {threads!r:.60}")
    cpus = usable_cpus()
    if threads is not None and threads > cpus:
        raise RequestError(f"threads {threads} is more than the {cpus} CPUs this process may use (those past them "
                           f"would only take turns); pass at most {cpus}, or leave threads unset for the backend's "
                           "choice")
    for name, value in (("spin_wait", spin_wait), ("huge_pages", huge_pages)):
        if not isinstance(value, bool):
            raise RequestError(f"{name} is True or False, got {value!r:.60}")


def check_threads_target(threads: int | None, target: str, engine: str | Path) -> None:
    """threads sets ONNX Runtime's CPU cores: a TensorRT engine refuses it (taken, then ignored, it would read as
    set)."""
    if threads is not None and target != "onnxruntime":
        raise RequestError(f"threads sets how many CPU cores ONNX Runtime uses; {engine} is a {target} engine, which "
                           "computes on the GPU: drop threads")


def check_fits_in_flight(sequences: int, max_batch_size: int, max_queue: int | None, what: str, advice: str) -> None:
    """Refuse `sequences` that could never be in flight at once (RequestError)."""
    if max_queue is not None and sequences > max_batch_size + max_queue:
        raise RequestError(f"{what}: at most {max_batch_size + max_queue} sequences fit in flight (max_batch_size "
                           f"{max_batch_size} + max_queue {max_queue}); {advice} or raise max_queue")


def check_max_queue(max_queue: int | None) -> None:
    if max_queue is not None and not is_int_at_least(max_queue, 0):
        raise RequestError(f"max_queue must be an integer >= 0, or None for no limit; got {max_queue!r}")


def check_priority(priority: object) -> int:
    if not is_int(priority):
        raise RequestError(f"priority must be an integer (lower runs first), got {priority!r}")
    return int(priority)


def priorities(priority: int | Sequence[int] | None, count: int) -> list[int]:
    """One priority per prompt: None → all 0, one integer → all that, a sequence → one each."""
    if priority is None or is_int(priority):
        return [check_priority(priority or 0)] * count
    if isinstance(priority, np.ndarray):
        priority = priority.tolist()
    if isinstance(priority, str) or not isinstance(priority, Sequence):
        raise RequestError(f"priority must be an integer or one integer per prompt, got {priority!r}")
    if len(priority) != count:
        raise RequestError(f"got {len(priority)} priorities for {count} prompts; pass one each (or one for all)")
    return [check_priority(p) for p in priority]


def prompt_list(prompts: object) -> list:
    """generate()'s prompts as a list: one prompt (text, ids or a prompt dict) or a sequence of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts)
                                            and is_int(prompts[0])):
        return [prompts]  # one prompt
    if prompts is None or isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise RequestError(f"prompts must be a prompt (text, token ids or a prompt dict) or a list of them, got "
                           f"{prompts!r:.80}")
    return list(prompts)


def params_list(params: object, count: int, default: SamplingParams | None = None) -> list[SamplingParams]:
    """One SamplingParams per prompt from None (`default`: the model's, else SamplingParams()), one for all, or
    one each."""
    if params is None or isinstance(params, SamplingParams):
        return [params or default or SamplingParams()] * count
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise RequestError(f"sampling_params must be a SamplingParams or one per prompt, got {params!r:.80}")
    params = list(params)
    if len(params) != count:
        raise RequestError(f"got {len(params)} SamplingParams for {count} prompts; pass one or one each")
    wrong = next((i for i, p in enumerate(params) if not isinstance(p, SamplingParams)), None)
    if wrong is not None:
        raise RequestError(f"sampling_params[{wrong}] is {params[wrong]!r:.80}, not a SamplingParams")
    return params
