"""Writing a plain HF checkpoint folder, one tensor at a time, all or nothing.

Choices:
- File names, shard boundaries and the index are transformers' own: tensors go to the current shard until the next one
  would push it past ``max_shard_size`` (a tensor larger than that gets a shard to itself); shards are
  ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` (``metadata.total_size``, plus
  ``total_parameters`` as transformers 5 writes it, and ``weight_map``), or one ``model.safetensors`` and no index.
  Every shard's safetensors metadata says ``format: pt``.
- Streaming: only the shard being filled is held in memory. Shards go to disk under provisional names and are renamed
  once the shard count is known.
- All or nothing: everything is written to a temporary sibling folder (``.<out_dir>.tmp-XXXX``, same filesystem) that
  replaces ``out_dir`` as a whole on a clean exit: ``os.replace`` when ``out_dir`` doesn't exist, otherwise the old
  folder is moved aside, the new one moved in, then the old one deleted. On an exception in the ``with`` block or a
  failed write (disk full -> ``CheckpointError``) the temporary folder is removed and ``out_dir`` is left as it was.
  Replacing the working directory, one of its parents or the home folder is refused.
- Each tensor is detached, moved to CPU and made contiguous; a tensor still sharing memory with the caller's (a CPU
  tensor, or a view) is cloned, so the buffer never aliases a live parameter, a reused buffer, or another entry.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
from pathlib import Path, PurePosixPath
from types import TracebackType

import torch
from safetensors.torch import save_file

from .checkpoint_io import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, CheckpointError

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
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` under ``name``; a full shard is written out first."""
        self._check_open()
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"Tensor names must be non-empty strings, got {name!r}.")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"Tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}.")
        if tensor.device.type == "meta":
            raise CheckpointError(f"Tensor {name!r} is on the meta device: it has no data to write.")
        if name in self._names:
            raise CheckpointError(f"Tensor {name!r} was added twice to the checkpoint for {self.out_dir}.")
        self._names.add(name)
        size = _nbytes(tensor)
        if self._buffer and self._buffer_bytes + size > self.max_shard_size:
            self._flush()
        self._buffer[name] = _owned_cpu_copy(tensor)
        self._buffer_bytes += size
        self._total_size += size
        self._total_parameters += tensor.numel()

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

    def _guarded(self, file: str, write) -> None:
        """Run ``write``; an OSError becomes a CheckpointError naming ``file`` and the output folder."""
        try:
            write()
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
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._state = "done"
