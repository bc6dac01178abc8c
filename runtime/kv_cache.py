"""The paged KV block pool: fixed-size blocks, block 0 reserved as the null block that padding points at."""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

from camshaft.errors import CapacityError, RequestError
from camshaft.manifest import Manifest

NULL_BLOCK = 0


def bytes_per_block(manifest: Manifest) -> int:
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "float8": 1}[manifest.kv_cache.dtype]
    return manifest.kv_cache.bytes_per_block(itemsize)


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50, "EIB": 2**60}
_MEMORY = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*([A-Za-z]*)")
MEMORY_HELP = ("bytes, optionally with a unit (1000000, 1e9, 512MiB, 2GB), or a fraction of the memory available once "
               "the engine's weights are loaded: "
               "a number between 0 and 1, or 1.0 for all of it (0.3, 5e-1, 1.0)")


def memory_spec(spec: str | int | float | None) -> int | float | None:
    """A KV cache budget as given: int bytes, or a float fraction of the memory available once the engine is loaded
    (the engine resolves it: fraction_bytes). A number
    in (0, 1) is a fraction, and so is 1 written with a decimal point ("1.0", 1.0); any other number is bytes
    ("1000000", "1e9", 1000000), also with a unit ("512MiB", "2GB"). None stays None (sized from the engine limits)."""
    if spec is None:
        return None
    if isinstance(spec, bool) or not isinstance(spec, (str, numbers.Real)):
        raise RequestError(f"kv_cache_memory must be {MEMORY_HELP}; got {spec!r}")
    if isinstance(spec, numbers.Real):
        value, decimal_point, unit = spec, not isinstance(spec, numbers.Integral), ""
    else:
        match = _MEMORY.fullmatch(spec.strip())
        unit = match.group(3).upper() if match else ""
        if not match or (unit and unit not in _UNITS):
            raise RequestError(f"cannot read the memory size {spec!r}; use {MEMORY_HELP}")
        mantissa, exponent = match.group(1), match.group(2) or ""
        number = mantissa + exponent
        if len(mantissa) > 1000:  # no size is written so (reading it exactly would take long)
            raise RequestError(f"the memory size {spec[:40]!r}... has {len(mantissa)} digits; use {MEMORY_HELP}")
        # exact (a Fraction: "2.01GB" is 2010000000 bytes) where it could be a size: else a float, inf or 0 (refused)
        exact = len(exponent[1:].lstrip("+-").lstrip("0")) <= 3
        value, decimal_point = Fraction(Decimal(number)) if exact else float(number), "." in mantissa
        if value == math.inf:
            value = 2**61  # beyond any machine's memory: refused below
    if not unit and 0 < value <= 1 and (decimal_point or value != 1):  # 0.5, 5e-1 and 1.0; "1" is one byte
        if float(value) > 0:
            return float(value)
        value = 0  # too small for any memory: refused below
    if not isinstance(value, numbers.Rational) and not math.isfinite(value) \
            or unit in ("", "B") and value != int(value):
        raise RequestError(f"the memory size {spec!r} is neither a whole number of bytes nor a fraction in (0, 1]; "
                           f"use {MEMORY_HELP}")
    scaled = value * _UNITS[unit or "B"]  # whole bytes below a larger unit
    total = int(scaled) if isinstance(scaled, numbers.Rational) or math.isfinite(scaled) else 0
    if not 1 <= total <= 2**60:
        raise RequestError(f"the memory size {spec!r} is not a number of bytes a machine holds (1 B to 1 EiB); use "
                           f"{MEMORY_HELP}")
    return total


def fraction_bytes(fraction: float, available: int) -> int:
    """A fraction of a budget (memory_spec) in bytes of the memory `available` once the engine's weights are loaded
    (the host's for onnxruntime, the GPU's for TensorRT, as TensorRT-LLM's free_gpu_memory_fraction): measured
    before, 1.0 would leave the weights no room."""
    if available <= 0:
        raise CapacityError("no memory is available for the KV cache once the engine is loaded; free some (or give "
                            "the container more), or give a budget in bytes: " + MEMORY_HELP)
    if fraction * available < 1:
        raise RequestError(f"a KV cache budget of {fraction} of the memory available ({available} bytes) is under "
                           f"one byte; raise the budget: {MEMORY_HELP}")
    return int(fraction * available)


def host_available() -> int:
    """Bytes of host memory available now: the machine's, or what its cgroup's limit leaves (a container's) when
    less."""
    import psutil

    available, left = psutil.virtual_memory().available, cgroup_available()
    return available if left is None else min(available, left)


CGROUP = Path("/sys/fs/cgroup")  # where the cgroup hierarchies are mounted (v2 at the root, v1 per controller)
SELF_CGROUP = Path("/proc/self/cgroup")
V1_NO_LIMIT = 2**62  # cgroup v1 writes "no limit" as the largest page multiple of a 64-bit long


def own_cgroups(controller: str, root: Path, self_cgroup: Path) -> list[tuple[Path, bool]]:
    """The cgroups whose `controller` ("memory", "cpu") limits bind this process, (directory, v1), innermost first:
    its own (from /proc/self/cgroup) and their ancestors under the mount; the mount's root itself where the process's
    path is not there (a container's cgroup namespace mounts its own cgroup as the root); both roots where
    /proc/self/cgroup names none."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or (parts[1] and controller not in parts[1].split(",")):
            continue
        v1 = bool(parts[1])
        base = root / controller if v1 else root
        if v1 and not base.is_dir():  # the hierarchy mounted by its joined name alone ("cpu,cpuacct")
            base = root / parts[1]
        own = base / parts[2].lstrip("/")
        found += [(d, v1) for d in ([own, *own.parents[:len(own.relative_to(base).parts)]] if own.is_dir()
                                    else [base])]
    return found or [(root, False), (root / controller, True)]


def _cgroup_memory(root: Path | None, self_cgroup: Path | None) -> list[tuple[int, int | None]]:
    """(limit, bytes it leaves or None if unreadable) of each limited cgroup binding this process."""
    found = []
    for directory, v1 in own_cgroups("memory", root or CGROUP, self_cgroup or SELF_CGROUP):
        names = (("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file") if v1
                 else ("memory.max", "memory.current", "inactive_file"))
        try:
            limit = (directory / names[0]).read_text().strip()
        except OSError:
            continue
        if not limit.isdigit() or (v1 and int(limit) >= V1_NO_LIMIT):
            continue
        try:
            used = int((directory / names[1]).read_text())
            stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines()
                        if line.count(" ") == 1)
            left = max(0, int(limit) - used + int(stat.get(names[2], "0")))  # reclaimable file cache not counted
        except (OSError, ValueError):
            left = None
        found.append((int(limit), left))
    return found


def cgroup_limit(root: Path | None = None, self_cgroup: Path | None = None) -> int | None:
    """The lowest memory limit of the cgroups (v2 or v1) this process is in; None without one."""
    return min((limit for limit, _ in _cgroup_memory(root, self_cgroup)), default=None)


def cgroup_available(root: Path | None = None, self_cgroup: Path | None = None) -> int | None:
    """Bytes the cgroups' limits leave: each limit less what its cgroup holds, its reclaimable file cache not
    counted, the least of them; None without a limit (or where what a limited one holds cannot be read)."""
    found = _cgroup_memory(root, self_cgroup)
    if not found or any(left is None for _, left in found):
        return None
    return min(left for _, left in found)


def host_memory() -> int:
    """Bytes this process may use: the machine's memory, or its cgroup's limit (a container's) when lower."""
    import psutil

    limit = cgroup_limit()
    total = psutil.virtual_memory().total
    return total if limit is None else min(total, limit)

SMALLER_POOL = ("give a smaller budget (kv_cache_memory / --kv-cache-memory, in bytes such as 1GiB, or a smaller "
                "fraction) or fewer sequences (max_batch_size / --max-batch-size), or build the engine with a smaller "
                "--max-seq-len")


def check_fits_host(manifest: Manifest, num_blocks: int) -> None:
    """A host (onnxruntime) pool larger than the memory there is would be killed as it fills: refused now."""
    size, limit = num_blocks * bytes_per_block(manifest), host_memory()
    if manifest.target == "onnxruntime" and size > limit:
        raise CapacityError(f"the KV cache pool ({num_blocks} blocks, {size / 2**30:.1f} GiB) is larger than this "
                            f"machine's {limit / 2**30:.1f} GiB of memory; {SMALLER_POOL}")


def pool_bytes(manifest: Manifest, num_blocks: int) -> int:
    """The memory a pool of `num_blocks` blocks takes, every buffer of each cache counted (cache_copies)."""
    return num_blocks * bytes_per_block(manifest) * cache_copies(manifest)


def cache_copies(manifest: Manifest) -> int:
    """Buffers a backend holds of each cache: the TensorRT backend two where the plan writes a new cache rather than
    updating its input in place (backends/tensorrt.py), so a memory budget is counted for both."""
    return 2 if manifest.target.startswith("tensorrt") else 1


def plan_blocks(manifest: Manifest) -> int | None:
    """The largest KV pool (blocks) a TensorRT plan's optimisation profile takes; None for other targets."""
    profile = manifest.target_options.get("profile", {}).get("num_blocks")
    return int(profile[2]) if manifest.target != "onnxruntime" and profile else None


def pool_blocks(manifest: Manifest, max_sequences: int, memory: str | int | float | None = None,
                copies: int = 1, fraction: float | None = None, most: int | None = None) -> int:
    """Blocks for `max_sequences` full-length sequences, or as many as fit `memory` bytes (memory_spec; a fraction is
    resolved by the caller: fraction_bytes) when the backend holds `copies` buffers of each cache, plus the null
    block. `fraction`: the budget as given, where `memory` was resolved from it (for the message); `most`: a cap on
    the blocks a budget gives (a Session's: one full-length sequence)."""
    memory_bytes = memory_spec(memory)
    if isinstance(memory_bytes, float):
        raise TypeError("pool_blocks takes bytes: resolve a fraction with fraction_bytes once the engine is loaded")
    if memory_bytes is not None:
        each = copies * bytes_per_block(manifest)
        blocks = memory_bytes // each
        caps = [c for c in (plan_blocks(manifest), most) if c is not None]  # a TensorRT plan's profile, the caller's
        blocks = min([blocks, *caps])
        if blocks < 2:
            given = f" ({fraction} of the memory available)" if fraction is not None else ""
            one = "; 1 is one byte: for all of the available memory write 1.0" if memory_bytes == 1 else ""
            raise CapacityError(
                f"kv_cache_memory {memory_bytes} bytes{given} holds no KV block ({each} bytes each, and one more "
                f"is kept empty){one}; raise the budget: {MEMORY_HELP}"
            )
        return int(blocks)
    return max_sequences * manifest.limits.max_blocks_per_seq + 1


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise CapacityError(f"a KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CapacityError(f"KV cache full: {count} blocks wanted, {len(self._free)} free")
        taken = self._free[-count:] if count else []
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
