"""Writing a plain HF checkpoint folder, one tensor at a time, all or nothing.

Choices:
- File names, shard boundaries and the index are transformers' own: tensors go to the current shard until the next one
  would push it past ``max_shard_size`` (a tensor larger than that gets a shard to itself); shards are
  ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` (``metadata.total_size``, plus
  ``total_parameters`` as transformers 5 writes it, and ``weight_map``), or one ``model.safetensors`` and no index.
  Every shard's safetensors metadata says ``format: pt``.
- Streaming: a caller that knows its tensors up front (the exporter does) declares them with ``plan()``: shard
  boundaries and every shard's header are fixed then, and each ``add()`` writes its bytes straight to their place in
  the shard file (``os.pwrite``), holding nothing back. Without a plan (or for tensors beyond it) only the shard being
  filled is held in memory and goes to disk through safetensors' ``save_file`` when full. Either way shards are
  written under provisional names and renamed once the shard count is known.
- A planned tensor may also arrive in blocks (``add_part``: rows ``start:stop`` along one dim, e.g. one
  tensor-parallel rank's shard), each written to its place at once: the full tensor is never assembled in memory. A
  block along dim 0 is one write; along a later dim, one write per run of contiguous bytes. Blocks of one tensor must
  not overlap; the tensor counts as added once they cover it.
- A planned shard is what ``save_file`` would write for the same tensors, up to the order of the data: tensors are
  laid out by element size, largest first, then in plan order (each starts aligned to its element size), and the
  JSON header is padded with spaces to a multiple of 8 bytes, as safetensors pads it.
- All or nothing: everything is written to a temporary sibling folder (``.<out_dir>.tmp-XXXX``, same filesystem) that
  replaces ``out_dir`` as a whole on a clean exit: ``os.replace`` when ``out_dir`` doesn't exist, otherwise the old
  folder is moved aside, the new one moved in, then the old one deleted. On an exception in the ``with`` block or a
  failed write (disk full -> ``CheckpointError``) the temporary folder is removed and ``out_dir`` is left as it was.
  Replacing the working directory, one of its parents or the home folder is refused.
- Planned writes are spread over the I/O threads of ``parallel_io`` (``os.pwrite`` releases the GIL): a tensor or
  block of more than a few MiB goes out in pieces (whole runs for a block of columns) written concurrently from the
  caller's memory, and ``add()``/``add_part()`` return once every piece is written; a failed piece raises after the
  others ended.
- Each tensor is detached, moved to CPU and made contiguous; a buffered tensor still sharing memory with the
  caller's (a CPU tensor, or a view) is cloned, so the buffer never aliases a live parameter, a reused buffer, or
  another entry. A planned tensor is written before ``add()`` returns, so it is never copied.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Iterable, Sequence

import torch
from safetensors.torch import save_file

from .checkpoint_io import _SAFETENSORS_DTYPES, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, CheckpointError
from .parallel_io import pwrite_all, write_runs

_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = (("GIB", 2**30, False), ("MIB", 2**20, False), ("KIB", 2**10, False),
          ("GB", 10**9, True), ("MB", 10**6, True), ("KB", 10**3, True))


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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


@dataclass
class _Planned:
    shard: int          # index into CheckpointWriter._shards
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int         # where its bytes start in the shard file


@dataclass
class _OpenShard:
    fd: int
    left: int           # planned tensors not written yet


def _shard_header(specs: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict[str, str]
                  ) -> tuple[bytes, dict[str, int]]:
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


def _owned_cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, on CPU, contiguous, and in memory no one else holds."""
    out = tensor.detach().to("cpu").contiguous()
    shares = out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() \
        or out.untyped_storage().nbytes() != _nbytes(out)
    return out.clone() if shares else out


class CheckpointWriter:
    """Stream tensors and side files into ``out_dir``; use as a context manager."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        max_shard_size: int | str = "5GB",
        metadata: dict[str, str] | None = None,
    ) -> None:
        """``metadata``: extra string entries for every shard's safetensors header (``format: pt`` is always set)."""
        self.out_dir = Path(os.path.abspath(os.path.expanduser(out_dir)))
        self.max_shard_size = parse_size(max_shard_size)
        if self.max_shard_size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}.")
        extra = dict(metadata or {})
        bad = {k: v for k, v in extra.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise ValueError(f"safetensors metadata must map strings to strings; got {bad!r}.")
        self.metadata = {**extra, "format": "pt"}
        self._tmp: Path | None = None
        self._names: set[str] = set()
        self._side_files: set[str] = set()
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (provisional file name, tensor names), in order
        self._planned: dict[str, _Planned] = {}
        self._headers: dict[int, bytes] = {}            # planned shard -> its header, written when the shard opens
        self._open: dict[int, _OpenShard] = {}
        self._unwritten: set[str] = set()
        self._parts: dict[str, tuple[int, list[tuple[int, int]]]] = {}  # partly added: dim, [start, stop) blocks
        self._total_size = 0
        self._total_parameters = 0
        self._state = "new"

    # -- the with block ---------------------------------------------------------------------------------------------
    def __enter__(self) -> CheckpointWriter:
        if self._state != "new":
            raise RuntimeError("A CheckpointWriter writes one checkpoint; create a new one.")
        self._refuse_dangerous_target()
        self._guarded(str(self.out_dir.parent), lambda: self.out_dir.parent.mkdir(parents=True, exist_ok=True))
        self._tmp = self._make_temp_folder()
        self._state = "open"
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._abort()
            return
        try:
            self._finish()
        except BaseException:
            self._abort()
            raise

    # -- adding content ---------------------------------------------------------------------------------------------
    def plan(self, tensors: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> None:
        """Declare ``(name, shape, dtype)`` of tensors still to be added, in file order, before the first ``add()``.

        Their shards and headers are fixed now, and each ``add()`` of one of them writes it to disk at once. Tensors
        added beyond the plan are buffered as without one and go to shards after the planned ones. Every planned
        tensor must be added, with exactly the planned shape and dtype.
        """
        self._check_open()
        if self._names or self._shards:
            raise RuntimeError("CheckpointWriter.plan() must come before the first add(), once.")
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []
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
            if not shards or (shards[-1] and size + nbytes > self.max_shard_size):
                shards.append([])
                size = 0
            shards[-1].append((name, shape, dtype))
            size += nbytes
        for specs in shards:
            index = len(self._shards)
            header, offsets = _shard_header(specs, self.metadata)
            self._shards.append((f"shard-{index + 1:05d}.safetensors", [n for n, _, _ in specs]))
            self._headers[index] = header
            for name, shape, dtype in specs:
                self._planned[name] = _Planned(shard=index, shape=shape, dtype=dtype, offset=offsets[name])
        self._unwritten = set(self._planned)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` under ``name`` (a planned one at once; otherwise queued, a full shard written out first)."""
        self._check_open()
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"Tensor names must be non-empty strings, got {name!r}.")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"Tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}.")
        if tensor.device.type == "meta":
            raise CheckpointError(f"Tensor {name!r} is on the meta device: it has no data to write.")
        if name in self._names or name in self._parts:
            raise CheckpointError(f"Tensor {name!r} was added twice to the checkpoint for {self.out_dir}.")
        if name in self._planned:
            self._write_planned(name, tensor)
            return
        self._names.add(name)
        size = _nbytes(tensor)
        if self._buffer and self._buffer_bytes + size > self.max_shard_size:
            self._flush()
        self._buffer[name] = _owned_cpu_copy(tensor)
        self._buffer_bytes += size
        self._total_size += size
        self._total_parameters += tensor.numel()

    def add_part(self, name: str, tensor: torch.Tensor, *, dim: int, start: int) -> None:
        """Write ``tensor`` as rows ``start:start + tensor.shape[dim]`` along ``dim`` of planned tensor ``name``.

        Every other dim is whole; the bytes go to their place in the shard at once. ``name`` counts as added once
        its blocks (all along the same ``dim``, none overlapping) cover it.
        """
        self._check_open()
        spec = self._planned.get(name) if isinstance(name, str) else None
        if spec is None:
            raise CheckpointError(f"add_part(): tensor {name!r} was not planned; only planned tensors are written in "
                                  "blocks.")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            raise CheckpointError(f"add_part(): block of {name!r} must be a tensor with data, got {tensor!r:.60}.")
        if name in self._names:
            raise CheckpointError(f"Tensor {name!r} was added twice to the checkpoint for {self.out_dir}.")
        shape = tuple(tensor.shape)
        ndim = len(spec.shape)
        fits = tensor.dtype == spec.dtype and len(shape) == ndim and isinstance(dim, int) and 0 <= dim < ndim \
            and isinstance(start, int) and 0 <= start and start + shape[dim] <= spec.shape[dim] \
            and shape[:dim] + shape[dim + 1:] == spec.shape[:dim] + spec.shape[dim + 1:]
        if not fits:
            raise CheckpointError(f"Tensor {name!r} was planned as {spec.dtype} {list(spec.shape)}; a block "
                                  f"{tensor.dtype} {list(shape)} at {start} along dim {dim} does not fit it.")
        stop = start + shape[dim]
        part_dim, blocks = self._parts.get(name, (dim, []))
        if part_dim != dim or any(start < b and a < stop for a, b in blocks):
            raise CheckpointError(f"Tensor {name!r}: block {start}:{stop} along dim {dim} overlaps a block already "
                                  f"added, or another block was along dim {part_dim}.")
        data = tensor.detach().to("cpu").contiguous()
        fd, file = self._shard_fd(spec.shard)
        if data.numel():
            inner = math.prod(spec.shape[dim + 1:]) * spec.dtype.itemsize  # bytes of one index along ``dim``
            runs, run_bytes, stride = math.prod(spec.shape[:dim]), (stop - start) * inner, spec.shape[dim] * inner
            view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
            offset = spec.offset + start * inner
            self._guarded(file, lambda: write_runs(fd, view, offset, runs=runs, run_bytes=run_bytes,
                                                   stride=stride))
        blocks.append((start, stop))
        self._parts[name] = (dim, blocks)
        self._total_size += _nbytes(data)
        self._total_parameters += data.numel()
        if sum(b - a for a, b in blocks) == spec.shape[dim]:
            del self._parts[name]
            self._names.add(name)
            self._planned_done(name, spec)

    def write_text(self, relpath: str, text: str) -> None:
        """Write ``text`` (UTF-8) to ``relpath`` inside the checkpoint folder."""
        target = self._side_path(relpath)
        self._guarded(relpath, lambda: target.write_text(text, encoding="utf-8"))

    def copy_file(self, relpath: str, src: str | os.PathLike) -> None:
        """Copy the file ``src`` to ``relpath`` inside the checkpoint folder."""
        if not Path(src).is_file():
            raise CheckpointError(f"Cannot copy {src} into the checkpoint as {relpath!r}: not a file.")
        target = self._side_path(relpath)
        self._guarded(relpath, lambda: shutil.copyfile(src, target))

    # -- internals --------------------------------------------------------------------------------------------------
    def _write_planned(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._planned[name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise CheckpointError(f"Tensor {name!r} was planned as {spec.dtype} {list(spec.shape)} but added as "
                                  f"{tensor.dtype} {list(tensor.shape)}.")
        self._names.add(name)
        data = tensor.detach().to("cpu").contiguous()
        fd, file = self._shard_fd(spec.shard)
        if data.numel():
            view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
            self._guarded(file, lambda: write_runs(fd, view, spec.offset))
        self._total_size += _nbytes(data)
        self._total_parameters += data.numel()
        self._planned_done(name, spec)

    def _shard_fd(self, index: int) -> tuple[int, str]:
        """The open file of planned shard ``index`` (created, with its header, on first use), and its name."""
        file = self._shards[index][0]
        shard = self._open.get(index)
        if shard is None:
            assert self._tmp is not None
            path, header = self._tmp / file, self._headers.pop(index)

            def create() -> int:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
                try:
                    pwrite_all(fd, memoryview(header), 0)
                except BaseException:
                    os.close(fd)
                    raise
                return fd

            fd = self._guarded(file, create)
            shard = self._open[index] = _OpenShard(fd=fd, left=len(self._shards[index][1]))
        return shard.fd, file

    def _planned_done(self, name: str, spec: _Planned) -> None:
        """``name`` is wholly on disk: close its shard when it was the shard's last tensor."""
        file, shard = self._shards[spec.shard][0], self._open[spec.shard]
        self._unwritten.discard(name)
        shard.left -= 1
        if shard.left == 0:
            del self._open[spec.shard]
            self._guarded(file, lambda: os.close(shard.fd))

    def _close_open_shards(self) -> None:
        shards, self._open = self._open, {}
        for shard in shards.values():
            try:
                os.close(shard.fd)
            except OSError:
                pass

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError("Use CheckpointWriter in a with block; it is not open (or already finished).")

    def _make_temp_folder(self) -> Path:
        # NOTE: os.mkdir rather than tempfile.mkdtemp: mkdtemp makes a private (0700) folder, and the checkpoint
        # should get the permissions a plain mkdir under the user's umask gives.
        for _ in range(100):
            candidate = self.out_dir.parent / f".{self.out_dir.name}.tmp-{secrets.token_hex(4)}"
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                continue
            except OSError as err:
                raise CheckpointError(f"could not create a temporary folder next to {self.out_dir}: {err}") from err
        raise CheckpointError(f"could not find a free temporary folder name next to {self.out_dir}.")

    def _refuse_dangerous_target(self) -> None:
        target = self.out_dir.resolve()
        cwd = Path.cwd().resolve()
        if target == cwd or cwd.is_relative_to(target) or target == Path.home().resolve():
            raise CheckpointError(
                f"Refusing to write a checkpoint to {self.out_dir}: the folder is replaced as a whole, and it is the "
                f"working directory, one of its parents, or the home folder. Pick a dedicated folder."
            )

    def _side_path(self, relpath: str) -> Path:
        self._check_open()
        parts = PurePosixPath(str(relpath).replace("\\", "/")).parts
        if not parts or os.path.isabs(relpath) or parts[0] == "/" or ".." in parts:
            raise CheckpointError(f"{relpath!r} must be a relative path inside the checkpoint folder {self.out_dir}.")
        norm = "/".join(p for p in parts if p != ".")
        if norm in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or _SHARD_NAME.fullmatch(norm):
            raise CheckpointError(f"{relpath!r} is a weights file name; weights are written with add().")
        if norm in self._side_files:
            raise CheckpointError(f"{relpath!r} was written twice to the checkpoint for {self.out_dir}.")
        self._side_files.add(norm)
        assert self._tmp is not None
        target = self._tmp / norm
        self._guarded(norm, lambda: target.parent.mkdir(parents=True, exist_ok=True))
        return target

    def _guarded(self, file: str, write):
        """Run ``write`` and return what it returns; an OSError becomes a CheckpointError naming ``file`` and the
        output folder."""
        try:
            return write()
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise CheckpointError(f"disk full while writing {file} in {self.out_dir}") from err
            raise CheckpointError(f"could not write {file} in {self.out_dir}: {err}") from err

    def _flush(self) -> None:
        if not self._buffer:
            return
        assert self._tmp is not None
        name = f"shard-{len(self._shards) + 1:05d}.safetensors"
        buffer, self._buffer, self._buffer_bytes = self._buffer, {}, 0
        self._guarded(name, lambda: save_file(buffer, str(self._tmp / name), metadata=self.metadata))
        self._shards.append((name, list(buffer)))

    def _finish(self) -> None:
        self._check_open()
        if self._unwritten:
            missing = sorted(self._unwritten)
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"{len(missing)} planned tensor(s) were never added (or only in part) to the "
                                  f"checkpoint for {self.out_dir}: {', '.join(missing[:5])}{more}.")
        self._flush()
        assert self._tmp is not None
        tmp = self._tmp
        if len(self._shards) == 1:
            self._guarded(SAFE_WEIGHTS_NAME, lambda: os.replace(tmp / self._shards[0][0], tmp / SAFE_WEIGHTS_NAME))
        elif self._shards:
            count = len(self._shards)
            weight_map: dict[str, str] = {}
            for i, (provisional, tensors) in enumerate(self._shards, start=1):
                final = f"model-{i:05d}-of-{count:05d}.safetensors"
                self._guarded(final, lambda: os.replace(tmp / provisional, tmp / final))
                weight_map.update(dict.fromkeys(tensors, final))
            index = {
                "metadata": {"total_size": self._total_size, "total_parameters": self._total_parameters},
                "weight_map": weight_map,
            }
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            self._guarded(SAFE_WEIGHTS_INDEX_NAME,
                          lambda: (tmp / SAFE_WEIGHTS_INDEX_NAME).write_text(text, encoding="utf-8"))
        self._replace_out_dir()
        self._tmp = None
        self._state = "done"

    def _replace_out_dir(self) -> None:
        assert self._tmp is not None
        tmp, out = self._tmp, self.out_dir
        if not os.path.lexists(out):
            self._guarded(out.name, lambda: os.replace(tmp, out))
            return
        if not out.is_dir() or out.is_symlink():
            raise CheckpointError(f"{out} exists and is not a folder; refusing to replace it with a checkpoint.")
        aside = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
        self._guarded(out.name, lambda: os.replace(out, aside))
        try:
            os.replace(tmp, out)
        except OSError as err:
            os.replace(aside, out)
            raise CheckpointError(f"could not move the new checkpoint into {out}: {err}") from err
        shutil.rmtree(aside, ignore_errors=True)

    def _abort(self) -> None:
        self._buffer.clear()
        self._close_open_shards()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._state = "done"
