"""The files of a Hugging Face checkpoint folder, one at a time: their names, safetensors headers, the index, pickle
weights, and which shard paths an index may name.

Choices:
- File names are transformers': ``model.safetensors``, ``model.safetensors.index.json``, and for pickle weights
  ``pytorch_model.bin``, ``pytorch_model.bin.index.json``; a ``variant`` goes in before the last suffix as
  transformers' ``_add_variant`` puts it (``model.fp16.safetensors``, ``model.safetensors.index.fp16.json``).
- A safetensors header is parsed and checked without reading tensor data: its length field, its JSON, every entry's
  dtype, shape and byte range, that every byte range fits the file (a truncated download fails here, not half way
  through loading) and holds exactly the bytes its dtype and shape need.
- An index must parse and hold a non-empty ``weight_map`` of tensor names to file names.
- A shard path an index names must stay inside the folder (no absolute paths, no ``..``, no symlink leading out) and
  exist. Shard symlinks may point into the folder, or, for a hub-cache snapshot, into that repo's ``blobs/`` folder.
- Pickle weights are loaded only through ``torch.load(weights_only=True, mmap=True)``: no code runs, no tensor data is
  read until asked for.
- Every bad input raises ``CheckpointError`` (a ``ValueError``) whose message names the file, tensor or field.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterable, Mapping

import torch

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

# NOTE: the safetensors format caps the JSON header at 100 MB; a larger length field means a corrupt file.
_MAX_HEADER_BYTES = 100_000_000

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
        "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
    }.items()
    if hasattr(torch, attr)
}


def weight_file_names(variant: str | None = None) -> tuple[str, str, str, str]:
    """The weight file names (safetensors, its index, pickle, its index) of ``variant`` (None: the plain ones)."""
    names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, PICKLE_WEIGHTS_NAME, PICKLE_WEIGHTS_INDEX_NAME)
    if variant is None:
        return names
    return tuple(f"{stem}.{variant}.{suffix}" for stem, suffix in (name.rsplit(".", 1) for name in names))


class CheckpointError(ValueError):
    """A checkpoint folder, file, tensor or field that this layer cannot use; the message says which."""


class IntegerShape(tuple):
    """An expected shape whose tensor is stored as integers (DeepSeek-V4's ``tid2eid`` tables), for
    ``CheckpointReader.validate_shapes``."""


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Parse and check one safetensors header without reading tensor data.

    Returns {tensor: {"dtype", "shape", "offset"}}, ``offset`` being where the tensor's bytes start in the file.
    """
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {file_size} bytes, truncated?).")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors file (header length {header_len} bytes, "
                    f"file size {file_size} bytes)."
                )
            raw = f.read(header_len)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err}).") from err
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: corrupt safetensors header ({err}).") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object).")
    data_len = file_size - 8 - header_len
    tensors: dict[str, Any] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name = entry["dtype"]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            ok = isinstance(dtype_name, str) and all(isinstance(s, int) and s >= 0 for s in shape) \
                and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name!r}: {entry!r}.")
        if end > data_len:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte {end} of the data section, "
                f"which holds only {data_len} bytes."
            )
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is not None:
            expected = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != expected:
                raise CheckpointError(
                    f"{path}: corrupt safetensors header: tensor {name!r} ({dtype_name}, shape {list(shape)}) "
                    f"needs {expected} bytes but its data range holds {end - begin}."
                )
        tensors[name] = {"dtype": dtype_name, "shape": shape, "offset": 8 + header_len + begin}
    return tensors


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _read_index(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not a valid checkpoint index ({err}).") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path}: the checkpoint index has no 'weight_map' object (or it is empty).")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{path}: weight_map entry for tensor {tensor!r} is not a file name: {shard!r}.")
    return weight_map


def _allowed_roots(folder: Path) -> list[Path]:
    """Where a shard may live: the folder, and for a hub-cache snapshot (<repo>/snapshots/<commit>) the repo's blobs.

    NOTE: huggingface_hub stores each snapshot file as a symlink to <repo>/blobs/<hash>; refusing those would refuse
    every checkpoint served from the HF cache.
    """
    root = folder.resolve()
    # NOTE: a ``subfolder`` of a snapshot (<repo>/snapshots/<commit>/<subfolder>) links into the same blobs
    return [root] + [p.parent.parent / "blobs" for p in (root, *root.parents) if p.parent.name == "snapshots"][:1]


def _check_inside(folder: Path, shard: str, *, index: Path, tensor: str) -> Path:
    """The shard's path, refused when it is absolute, climbs with '..', or is a symlink resolving outside ``folder``."""
    where = f"{index.name} places tensor {tensor!r} in {shard!r}"
    if os.path.isabs(shard) or shard.startswith("\\") or PureWindowsPath(shard).drive:
        raise CheckpointError(
            f"{folder}: {where}, an absolute path; shard paths must stay inside the checkpoint folder."
        )
    if ".." in PurePosixPath(shard.replace("\\", "/")).parts:
        raise CheckpointError(f"{folder}: {where}, which leaves the checkpoint folder ('..').")
    path = folder / shard
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in _allowed_roots(folder)):
        raise CheckpointError(
            f"{folder}: {where}, which resolves to {resolved}, outside the checkpoint folder (symlink?)."
        )
    if not path.is_file():
        raise CheckpointError(f"{folder}: shard {shard!r} is missing (the index places tensor {tensor!r} in it).")
    return path


def load_pickle_weights(path: Path) -> Mapping[str, torch.Tensor]:
    """The tensors of one pickle weights file, loaded with ``torch.load(weights_only=True)``, memory-mapped."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            # NOTE: files written before torch's zipfile format cannot be memory-mapped; read them whole.
            if "mmap" not in str(err):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{path}: cannot be loaded as a weights-only torch checkpoint ({err}).") from err
    if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"{path}: does not hold a mapping of tensor names to tensors.")
    return state
