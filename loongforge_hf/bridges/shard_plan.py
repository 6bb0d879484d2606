"""Where tensors go in safetensors shard files, worked out before any of their bytes exist; no I/O here.

Choices:
- Shard boundaries are transformers': tensors go to the current shard until the next one would push it past
  ``max_shard_size`` (a tensor larger than that gets a shard to itself; the writer's unplanned path fills its buffer
  by the same rule); sizes are read as transformers reads them. Shard file names and the index are transformers' too.
- A planned shard is what ``save_file`` would write for the same tensors, up to the order of the data: tensors are
  laid out by element size, largest first, then in plan order (each starts aligned to its element size), and the
  JSON header is padded with spaces to a multiple of 8 bytes, as safetensors pads it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .checkpoint_io import _SAFETENSORS_DTYPES, CheckpointError

SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = (("GIB", 2**30, False), ("MIB", 2**20, False), ("KIB", 2**10, False),
          ("GB", 10**9, True), ("MB", 10**6, True), ("KB", 10**3, True))
_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


def parse_size(size: int | str) -> int:
    """Bytes in ``size``, with transformers' reading: "5GB" = 5 * 10**9, "5GiB" = 5 * 2**30, "5Gb" = 5 * 10**9 / 8."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    if isinstance(size, str):
        text = size.strip()
        for unit, factor, bits_allowed in _UNITS:
            if text.upper().endswith(unit):
                number = text[: -len(unit)].strip()
                if number.isdigit():
                    value = int(number) * factor
                    # NOTE: transformers reads a lowercase final "b" as bits ("5Gb" is 5 gigabits).
                    return value // 8 if bits_allowed and text.endswith("b") else value
                break
    raise ValueError(f"Cannot read size {size!r}: use an integer number of bytes, or digits and a unit, e.g. '5GB'.")


@dataclass
class Planned:
    shard: int          # index into CheckpointWriter._shards
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int         # where its bytes start in the shard file


def split_into_shards(tensors: Iterable[tuple[str, Sequence[int], torch.dtype]], max_shard_size: int
                      ) -> list[list[TensorSpec]]:
    """``(name, shape, dtype)`` of every tensor, checked, in shards of at most ``max_shard_size`` bytes (in order)."""
    shards: list[list[TensorSpec]] = []
    seen: set[str] = set()
    size = 0
    for name, shape, dtype in tensors:
        shape = tuple(shape)
        if not isinstance(name, str) or not name or name in seen:
            raise CheckpointError(f"plan(): tensor name {name!r} is empty, not a string, or given twice.")
        seen.add(name)
        if dtype not in _DTYPE_NAMES or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"plan(): tensor {name!r} has a shape {shape} or dtype {dtype} that safetensors "
                                  "cannot hold.")
        nbytes = math.prod(shape) * dtype.itemsize
        if not shards or (shards[-1] and size + nbytes > max_shard_size):
            shards.append([])
            size = 0
        shards[-1].append((name, shape, dtype))
        size += nbytes
    return shards


def shard_header(specs: list[TensorSpec], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header (length prefix included) for ``specs``, and each tensor's byte offset in the file."""
    order = sorted(range(len(specs)), key=lambda i: -specs[i][2].itemsize)  # stable: plan order within a size
    entries: dict[str, object] = {"__metadata__": metadata}
    begin, relative = 0, {}
    for i in order:
        name, shape, dtype = specs[i]
        end = begin + math.prod(shape) * dtype.itemsize
        entries[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
        relative[name] = begin
        begin = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {name: start + off for name, off in relative.items()}


def block_runs(name: str, spec: Planned, block: torch.Tensor, *, dim: int, start: int) -> tuple[int, int, int, int]:
    """Where ``block`` (rows ``start:start + block.shape[dim]`` along ``dim`` of planned tensor ``name``) lies in its
    shard file: the offset of its first byte, its runs of contiguous bytes, the bytes of one run, and the stride
    between runs. A block that does not fit the planned tensor is refused."""
    shape = tuple(block.shape)
    ndim = len(spec.shape)
    fits = block.dtype == spec.dtype and len(shape) == ndim and isinstance(dim, int) and 0 <= dim < ndim \
        and isinstance(start, int) and 0 <= start and start + shape[dim] <= spec.shape[dim] \
        and shape[:dim] + shape[dim + 1:] == spec.shape[:dim] + spec.shape[dim + 1:]
    if not fits:
        raise CheckpointError(f"Tensor {name!r} was planned as {spec.dtype} {list(spec.shape)}; a block "
                              f"{block.dtype} {list(shape)} at {start} along dim {dim} does not fit it.")
    inner = math.prod(spec.shape[dim + 1:]) * spec.dtype.itemsize  # bytes of one index along ``dim``
    return spec.offset + start * inner, math.prod(spec.shape[:dim]), shape[dim] * inner, spec.shape[dim] * inner


def shard_names(count: int) -> list[str]:
    """The final file names of ``count`` shards (more than one), as transformers names them."""
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_text(shards: list[tuple[str, list[str]]], names: list[str], *, total_size: int, total_parameters: int
               ) -> str:
    """``model.safetensors.index.json`` for ``shards`` (provisional name, tensor names) under their final ``names``."""
    weight_map: dict[str, str] = {}
    for (_, tensors), name in zip(shards, names):
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": total_size, "total_parameters": total_parameters}, "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"
