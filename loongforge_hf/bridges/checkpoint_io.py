"""Reading Hugging Face checkpoint folders: one tensor, or one slice of one tensor, at a time.

Choices:
- Only transformers' file names are read, in its order: ``model.safetensors``, else ``model.safetensors.index.json`` +
  shards (a ``variant``'s names if given; ``use_safetensors`` True / False: only safetensors / only pickle). Pickle
  weights (``pytorch_model.bin``, ``pytorch_model.bin.index.json``) only with ``allow_pickle=True``, through
  ``torch.load(weights_only=True, mmap=True)``: no code runs, no tensor data is read until asked for.
- Everything that can be checked without tensor data is checked in ``__init__``, so every rank fails alike before any
  collective: the index parses, every shard it names exists and stays inside the folder (no absolute paths, no ``..``,
  no symlink leading out), every safetensors header parses and its byte ranges fit the file (a truncated download fails
  here, not half way through loading), and every tensor the index places in a shard is in that shard's header.
- Shards are opened lazily, file descriptors cached: a rank needing one shard of four opens one (``opened_files``).
- Tensor data is read with positioned reads (``os.preadv``) at the offsets of the validated header, straight into a
  fresh tensor of the slice's size: a tensor-parallel rank reads its rows (one read) or its columns (one run per row,
  the gaps landing in a small scratch buffer) without materialising the whole tensor and without a second copy.
  NOTE: not through safetensors' memory map: reading through it leaves every touched page of the file mapped into
  the process until the handle closes, so a rank's resident memory grew by the file bytes it read (1.6 GB per rank for
  an 8B-wide checkpoint at TP=2, see scripts/bench_bridge_io.py), and it costs a page fault per page on top of a copy.
  Safetensors data is little-endian, as on every host torch supports here (x86-64, arm64).
- Reads are spread over a pool of threads (``os.preadv`` releases the GIL; from the page cache one thread copies
  a few GB/s, far below what the cores of a host copy together; ``parallel_io``): a read of more than 4 MiB is cut into
  pieces (whole runs for a slice of columns) read concurrently, each straight into its place in the destination,
  and ``_read`` returns once every piece has landed. Nothing is read into memory of the pool's own (each piece of a
  slice of columns has a scratch buffer of one gap), so a rank's peak memory stays what it was with one thread.
  Threads per process: ``LOONGFORGE_IO_THREADS``, else the CPUs this process may run on divided by the processes of
  its node (``LOCAL_WORLD_SIZE``), 1 to 16. A failed piece fails the read, naming the file and tensor, after the
  other pieces finished (no thread still writes into the destination when the error arrives).
- Every bad input raises ``CheckpointError`` (a ``ValueError``) whose message names the file, tensor or field.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Mapping

import torch

from .checkpoint_files import (  # noqa: F401 (re-exported: callers import these from checkpoint_io)
    _MAX_HEADER_BYTES, _SAFETENSORS_DTYPES, PICKLE_WEIGHTS_INDEX_NAME, PICKLE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME, CheckpointError, IntegerShape, _allowed_roots, _check_inside, _numel, _read_index,
    load_pickle_weights, read_safetensors_header, weight_file_names,
)
from .parallel_io import read_runs


class _TensorInfo:
    __slots__ = ("shard", "dtype_name", "shape", "offset")

    def __init__(self, shard: str, dtype_name: str, shape: tuple[int, ...], offset: int = -1) -> None:
        self.shard = shard
        self.dtype_name = dtype_name
        self.shape = shape
        self.offset = offset  # where the tensor's bytes start in the file (safetensors only)


class CheckpointReader:
    """Lazy, validated access to the tensors of one HF checkpoint folder."""

    def __init__(self, folder: str | os.PathLike, *, allow_pickle: bool = False, variant: str | None = None,
                 use_safetensors: bool | None = None) -> None:
        self.folder = Path(folder)
        self.allow_pickle = allow_pickle
        self.variant, self.use_safetensors = variant, use_safetensors
        safe, safe_index, self._pickle_name, self._pickle_index = weight_file_names(variant)
        self.opened_files: set[str] = set()
        self._fds: dict[str, int] = {}
        self._pickled: dict[str, Mapping[str, torch.Tensor]] = {}
        self._infos: dict[str, _TensorInfo] = {}
        self._paths: dict[str, Path] = {}
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a checkpoint folder (no such directory).")
        # NOTE: same precedence as transformers' from_pretrained (single file first), so both load the same weights.
        self.format = "safetensors"
        if use_safetensors is not False and (self.folder / safe).is_file():
            self._init_single(safe)
        elif use_safetensors is not False and (self.folder / safe_index).is_file():
            self._init_sharded(self.folder / safe_index)
        elif use_safetensors:
            raise CheckpointError(f"No {safe} or {safe_index} in {self.folder} (use_safetensors=True).")
        else:
            self.format = "pickle"
            self._init_pickle()

    # -- set-up -----------------------------------------------------------------------------------------------------
    def _init_sharded(self, index_path: Path) -> None:
        weight_map = _read_index(index_path)
        first_tensor: dict[str, str] = {}
        for tensor, shard in weight_map.items():
            first_tensor.setdefault(shard, tensor)
        for shard, tensor in first_tensor.items():
            self._paths[shard] = _check_inside(self.folder, shard, index=index_path, tensor=tensor)
        headers = {shard: read_safetensors_header(path) for shard, path in self._paths.items()}
        for tensor, shard in weight_map.items():
            entry = headers[shard].get(tensor)
            if entry is None:
                raise CheckpointError(f"{index_path}: places tensor {tensor!r} in {shard!r}, but that shard does not "
                                      "hold it.")
            self._infos[tensor] = _TensorInfo(shard, entry["dtype"], entry["shape"], entry["offset"])

    def _init_single(self, name: str) -> None:
        path = self.folder / name
        self._paths[name] = path
        for tensor, entry in read_safetensors_header(path).items():
            self._infos[tensor] = _TensorInfo(name, entry["dtype"], entry["shape"], entry["offset"])

    def _init_pickle(self) -> None:
        index_path, single_path = self.folder / self._pickle_index, self.folder / self._pickle_name
        if not index_path.is_file() and not single_path.is_file():
            others = sorted(p.name for p in self.folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
            found = f" (found {', '.join(others)}, but not under transformers' names)" if others else ""
            wanted = weight_file_names(self.variant)[slice(0, 2) if self.use_safetensors is None else slice(2, 4)]
            raise CheckpointError(f"No weights found in {self.folder}: expected {' or '.join(wanted)}{found}"
                                  + ("" if self.use_safetensors is None else " (use_safetensors=False)") + ".")
        if not self.allow_pickle:
            which = index_path.name if index_path.is_file() else single_path.name
            holds = "holds only" if self.use_safetensors is None else "is read from (use_safetensors=False)"
            raise CheckpointError(
                f"{self.folder} {holds} pickle weights ({which}); pickle checkpoints are refused unless "
                f"allow_pickle=True (they are then loaded with torch.load(weights_only=True)). Prefer converting "
                f"the checkpoint to safetensors."
            )
        if index_path.is_file():
            weight_map = _read_index(index_path)
            for tensor, shard in weight_map.items():
                if shard not in self._paths:
                    self._paths[shard] = _check_inside(self.folder, shard, index=index_path, tensor=tensor)
        else:
            self._paths[single_path.name] = single_path
            weight_map = {tensor: single_path.name for tensor in self._load_pickle(single_path.name)}
        for tensor, shard in weight_map.items():
            # NOTE: pickle files carry no separate header; shapes come from the (mmapped) shard when first asked for.
            self._infos[tensor] = _TensorInfo(shard, "", ())

    def _load_pickle(self, shard: str) -> Mapping[str, torch.Tensor]:
        if shard not in self._pickled:
            self._pickled[shard] = load_pickle_weights(self._paths[shard])
            self.opened_files.add(shard)
        return self._pickled[shard]

    # -- lookup -----------------------------------------------------------------------------------------------------
    def _info(self, name: str) -> _TensorInfo:
        info = self._infos.get(name)
        if info is None:
            raise CheckpointError(f"Tensor {name!r} is not in the checkpoint at {self.folder}.")
        return info

    def _pickled_tensor(self, name: str) -> torch.Tensor:
        info = self._info(name)
        state = self._load_pickle(info.shard)
        if name not in state:
            raise CheckpointError(f"{self._paths[info.shard]}: the index places tensor {name!r} in this file, but it "
                                  "does not hold it.")
        return state[name]

    def _fd(self, shard: str) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            path = self._paths[shard]
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as err:
                raise CheckpointError(f"{path}: cannot be opened ({err}).") from err
            self._fds[shard] = fd
            self.opened_files.add(shard)
        return fd

    def _read(self, name: str, *, dim: int | None = None, start: int = 0, stop: int = 0,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` along ``dim`` of safetensors tensor ``name`` (all of it when ``dim`` is None), read
        into a new contiguous tensor, or into ``out``."""
        info = self._info(name)
        if dim is None:
            out = self._destination(name, info.shape, out)
            runs, offset, run_bytes, stride = 1, info.offset, out.numel() * out.element_size(), 0
        else:
            shape = info.shape
            out = self._destination(name, shape[:dim] + (stop - start,) + shape[dim + 1:], out)
            step = _numel(shape[dim + 1:]) * out.element_size()  # bytes of one index along ``dim``
            runs = _numel(shape[:dim])                           # one contiguous run per index before ``dim``
            offset, run_bytes, stride = info.offset + start * step, (stop - start) * step, shape[dim] * step
        if out.numel() == 0:
            return out
        dest = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
        path = self._paths[info.shard]
        try:
            read_runs(self._fd(info.shard), dest, offset=offset, runs=runs, run_bytes=run_bytes, stride=stride)
        except OSError as err:
            raise CheckpointError(f"{path}: reading tensor {name!r} failed ({err}).") from err
        except EOFError as err:
            raise CheckpointError(f"{path}: truncated while reading tensor {name!r} ({err}).") from err
        return out

    def _destination(self, name: str, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        """A new tensor to read ``name``'s ``shape`` into, or ``out`` once checked to fit it exactly."""
        dtype = self.dtype(name)
        if out is None:
            return torch.empty(shape, dtype=dtype)
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device.type != "cpu" \
                or not out.is_contiguous():
            raise CheckpointError(f"Tensor {name!r}: cannot read {dtype} {list(shape)} into a "
                                  f"{'' if out.is_contiguous() else 'non-contiguous '}{out.dtype} "
                                  f"{list(out.shape)} tensor on {out.device}.")
        return out

    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def shard_of(self, name: str) -> str:
        """The file (relative to the folder) that holds tensor ``name``."""
        return self._info(name).shard

    def shape(self, name: str) -> tuple[int, ...]:
        if self.format == "pickle":
            return tuple(self._pickled_tensor(name).shape)
        return self._info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        if self.format == "pickle":
            return self._pickled_tensor(name).dtype
        info = self._info(name)
        dtype = _SAFETENSORS_DTYPES.get(info.dtype_name)
        if dtype is None:
            raise CheckpointError(
                f"{self._paths[info.shard]}: tensor {name!r} has dtype {info.dtype_name!r}, which torch "
                f"{torch.__version__} does not support."
            )
        return dtype

    # -- data -------------------------------------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        if self.format == "pickle":
            return self._pickled_tensor(name).clone()
        return self._read(name)

    def get_slice(self, name: str, *, dim: int, start: int, stop: int, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """Rows ``start:stop`` of ``name`` along ``dim``, reading only that part of the file.

        ``out``: a contiguous CPU tensor of exactly the slice's shape and dtype (e.g. a block of rows of a larger
        tensor) to read into, and return, instead of a new one."""
        shape = self.shape(name)
        if not -len(shape) <= dim < len(shape):
            raise CheckpointError(f"Tensor {name!r} has shape {shape}; dim {dim} is out of range.")
        dim %= len(shape)
        if not 0 <= start <= stop <= shape[dim]:
            raise CheckpointError(
                f"Tensor {name!r} has shape {shape}; slice {start}:{stop} along dim {dim} is out of range."
            )
        if self.format == "pickle":
            # NOTE: a view into the memory-mapped file; copy just the slice out, so the caller owns it.
            part = self._pickled_tensor(name).narrow(dim, start, stop - start)
            if out is None:
                return part.clone(memory_format=torch.contiguous_format)
            return self._destination(name, tuple(part.shape), out).copy_(part)
        return self._read(name, dim=dim, start=start, stop=stop, out=out)

    def validate_shapes(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Raise one error listing every tensor of ``expected`` that is missing, has another shape or is not floating
        point (an ``IntegerShape``'s: integers) (a corrupt or foreign file, failing otherwise on its readers only)."""
        problems = []
        for name, want in expected.items():
            if name not in self._infos:
                problems.append(f"{name!r}: missing (expected shape {tuple(want)})")
                continue
            found = self.shape(name)
            if tuple(found) != tuple(want):
                problems.append(f"{name!r}: expected shape {tuple(want)}, found {tuple(found)}")
            elif (dtype := self.dtype(name)).is_floating_point == isinstance(want, IntegerShape):
                kind = "integers" if isinstance(want, IntegerShape) else "floating point"
                problems.append(f"{name!r}: stored as {dtype} in {self.shard_of(name)}, expected {kind}")
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise CheckpointError(f"The checkpoint at {self.folder} does not match the model its config.json "
                                  f"describes ({len(problems)} tensor(s)):\n  {shown}{more}")

    # -- lifetime ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
        self._pickled.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.folder)!r}, {len(self._infos)} tensors in {len(self._paths)} file(s))"
