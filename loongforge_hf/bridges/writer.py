"""Writing a plain HF checkpoint folder, one tensor at a time, all or nothing.

Choices:
- Shard boundaries, file names and the index are transformers' own (``shard_plan``); shards are
  ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` (``metadata.total_size``, plus
  ``total_parameters`` as transformers 5 writes it, and ``weight_map``), or one ``model.safetensors`` and no index.
  Every shard's safetensors metadata says ``format: pt``.
- Streaming: a caller that knows its tensors up front (the exporter does) declares them with ``plan()``: shard
  boundaries and every shard's header are fixed then (as ``save_file`` would write them: ``shard_plan``), and each
  ``add()`` writes its bytes straight to their place in the shard file (``os.pwrite``), holding nothing back. Without
  a plan (or for tensors beyond it) only the shard being filled is held in memory and goes to disk through
  safetensors' ``save_file`` when full. Either way shards are written under provisional names and renamed once the
  shard count is known.
- A planned tensor may also arrive in blocks (``add_part``: rows ``start:stop`` along one dim, e.g. one
  tensor-parallel rank's shard), each written to its place at once: the full tensor is never assembled in memory. A
  block along dim 0 is one write; along a later dim, one write per run of contiguous bytes. Blocks of one tensor must
  not overlap; the tensor counts as added once they cover it; a 0-d tensor's one block (dim 0, start 0) is all of it.
- All or nothing (``atomic_folder``): everything goes to a temporary sibling folder that replaces ``out_dir`` on a
  clean exit (keeping the old entries ``carry_over`` names); on an exception in the ``with`` block or a failed write
  (disk full -> ``CheckpointError``) it is removed and ``out_dir`` is left as it was.
- Planned writes are spread over the I/O threads of ``parallel_io`` (``os.pwrite`` releases the GIL): a tensor or
  block of more than a few MiB goes out in pieces (whole runs for a block of columns) written concurrently from the
  caller's memory, and ``add()``/``add_part()`` return once every piece is written; a failed piece raises after the
  others ended.
- Each tensor is detached, moved to CPU and made contiguous; a buffered tensor still sharing memory with the
  caller's (a CPU tensor, or a view) is cloned, so the buffer never aliases a live parameter, a reused buffer, or
  another entry. A planned tensor is written before ``add()`` returns, so it is never copied.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Callable, Iterable, Sequence

import torch
from safetensors.torch import save_file

from .atomic_folder import AtomicFolder
from .checkpoint_io import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, CheckpointError
from .parallel_io import write_runs
from .shard_plan import (SHARD_NAME, Planned, block_runs, index_text, parse_size, shard_header, shard_names,
                         split_into_shards)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class _OpenShard:
    fd: int
    left: int           # planned tensors not written yet


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
        carry_over: Callable[[str], bool] | None = None,
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
        self._folder = AtomicFolder(self.out_dir, carry_over=carry_over)
        self._names: set[str] = set()
        self._side_files: set[str] = set()
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (provisional file name, tensor names), in order
        self._planned: dict[str, Planned] = {}
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
        self._folder.create()
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
        for specs in split_into_shards(tensors, self.max_shard_size):
            index = len(self._shards)
            header, offsets = shard_header(specs, self.metadata)
            self._shards.append((f"shard-{index + 1:05d}.safetensors", [n for n, _, _ in specs]))
            self._headers[index] = header
            for name, shape, dtype in specs:
                self._planned[name] = Planned(shard=index, shape=shape, dtype=dtype, offset=offsets[name])
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
        its blocks (all along the same ``dim``, none overlapping) cover it; a 0-d tensor's one block is all of it."""
        self._check_open()
        spec = self._planned.get(name) if isinstance(name, str) else None
        if spec is None:
            raise CheckpointError(f"add_part(): tensor {name!r} was not planned; only planned ones go in blocks.")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            raise CheckpointError(f"add_part(): block of {name!r} must be a tensor with data, got {tensor!r:.60}.")
        if name in self._names:
            raise CheckpointError(f"Tensor {name!r} was added twice to the checkpoint for {self.out_dir}.")
        if spec.shape == () and tensor.dim() == 0 and (dim, start) == (0, 0):  # NOTE: a scalar's one block
            return self._write_planned(name, tensor)
        offset, runs, run_bytes, stride = block_runs(name, spec, tensor, dim=dim, start=start)
        stop = start + tensor.shape[dim]
        part_dim, blocks = self._parts.get(name, (dim, []))
        if part_dim != dim or any(start < b and a < stop for a, b in blocks):
            raise CheckpointError(f"Tensor {name!r}: block {start}:{stop} along dim {dim} overlaps a block already "
                                  f"added, or another block was along dim {part_dim}.")
        data = tensor.detach().to("cpu").contiguous()
        fd, file = self._shard_fd(spec.shard)
        if data.numel():
            view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
            self._folder.guarded(file, lambda: write_runs(fd, view, offset, runs=runs, run_bytes=run_bytes,
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
        self._folder.guarded(relpath, lambda: target.write_text(text, encoding="utf-8"))

    def copy_file(self, relpath: str, src: str | os.PathLike) -> None:
        """Copy the file ``src`` to ``relpath`` inside the checkpoint folder."""
        if not Path(src).is_file():
            raise CheckpointError(f"Cannot copy {src} into the checkpoint as {relpath!r}: not a file.")
        target = self._side_path(relpath)
        self._folder.guarded(relpath, lambda: shutil.copyfile(src, target))

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
            self._folder.guarded(file, lambda: write_runs(fd, view, spec.offset))
        self._total_size += _nbytes(data)
        self._total_parameters += data.numel()
        self._planned_done(name, spec)

    def _shard_fd(self, index: int) -> tuple[int, str]:
        """The open file of planned shard ``index`` (created, with its header, on first use), and its name."""
        file = self._shards[index][0]
        shard = self._open.get(index)
        if shard is None:
            fd = self._folder.create_file(file, self._headers.pop(index))
            shard = self._open[index] = _OpenShard(fd=fd, left=len(self._shards[index][1]))
        return shard.fd, file

    def _planned_done(self, name: str, spec: Planned) -> None:
        """``name`` is wholly on disk: close its shard when it was the shard's last tensor."""
        file, shard = self._shards[spec.shard][0], self._open[spec.shard]
        self._unwritten.discard(name)
        shard.left -= 1
        if shard.left == 0:
            del self._open[spec.shard]
            self._folder.close_file(file, shard.fd)

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError("Use CheckpointWriter in a with block; it is not open (or already finished).")

    def _side_path(self, relpath: str) -> Path:
        self._check_open()
        norm = self._folder.relative(relpath)
        if norm in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or SHARD_NAME.fullmatch(norm):
            raise CheckpointError(f"{relpath!r} is a weights file name; weights are written with add().")
        if norm in self._side_files:
            raise CheckpointError(f"{relpath!r} was written twice to the checkpoint for {self.out_dir}.")
        self._side_files.add(norm)
        return self._folder.path(norm)

    def _flush(self) -> None:
        if not self._buffer:
            return
        tmp = self._folder.tmp
        assert tmp is not None
        name = f"shard-{len(self._shards) + 1:05d}.safetensors"
        buffer, self._buffer, self._buffer_bytes = self._buffer, {}, 0
        self._folder.guarded(name, lambda: save_file(buffer, str(tmp / name), metadata=self.metadata))
        self._shards.append((name, list(buffer)))

    def _finish(self) -> None:
        self._check_open()
        if self._unwritten:
            missing = sorted(self._unwritten)
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"{len(missing)} planned tensor(s) were never added (or only in part) to the "
                                  f"checkpoint for {self.out_dir}: {', '.join(missing[:5])}{more}.")
        self._flush()
        tmp = self._folder.tmp
        assert tmp is not None
        if len(self._shards) == 1:
            single = tmp / self._shards[0][0]
            self._folder.guarded(SAFE_WEIGHTS_NAME, lambda: os.replace(single, tmp / SAFE_WEIGHTS_NAME))
        elif self._shards:
            finals = shard_names(len(self._shards))
            for (provisional, _), final in zip(self._shards, finals):
                self._folder.guarded(final, lambda: os.replace(tmp / provisional, tmp / final))
            text = index_text(self._shards, finals, total_size=self._total_size,
                              total_parameters=self._total_parameters)
            self._folder.guarded(SAFE_WEIGHTS_INDEX_NAME,
                                 lambda: (tmp / SAFE_WEIGHTS_INDEX_NAME).write_text(text, encoding="utf-8"))
        self._folder.commit()
        self._state = "done"

    def _abort(self) -> None:
        self._buffer.clear()
        self._open = {}
        self._folder.abort()
        self._state = "done"
