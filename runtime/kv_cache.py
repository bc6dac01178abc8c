"""The paged KV block pool: fixed-size blocks, block 0 reserved as the null block that padding points at."""

from __future__ import annotations

from camshaft.errors import CapacityError
from camshaft.manifest import Manifest

NULL_BLOCK = 0


def bytes_per_block(manifest: Manifest) -> int:
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "float8": 1}[manifest.kv_cache.dtype]
    return manifest.kv_cache.bytes_per_block(itemsize)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_memory(spec: str | int | None) -> int | None:
    """A KV cache budget: bytes with an optional unit ("512MiB", "2GB", "1000000"), or a fraction of the memory
    available now ("0.3"). None stays None (size the pool from the engine limits)."""
    if spec is None or isinstance(spec, int):
        return spec
    text = spec.strip().upper().replace(" ", "")
    number = text.rstrip("KMGIB")
    unit = text[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise CapacityError(f"cannot read the memory size {spec!r}; use bytes with a unit (512MiB, 2GB) or a fraction "
                            "of available memory (0.3)")
    if not unit and value < 1:
        import psutil

        return int(value * psutil.virtual_memory().available)
    return int(value * _UNITS[unit])


def pool_blocks(manifest: Manifest, max_sequences: int, memory_bytes: int | None = None) -> int:
    """Blocks for `max_sequences` full-length sequences, or as many as fit `memory_bytes` (plus the null block)."""
    if memory_bytes is not None:
        blocks = memory_bytes // bytes_per_block(manifest)
        if blocks < 2:
            raise CapacityError(
                f"a KV cache budget of {memory_bytes} bytes holds no block ({bytes_per_block(manifest)} bytes each); "
                "raise the budget"
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
