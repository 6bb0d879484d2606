"""An output folder written all or nothing: built in a temporary sibling, then moved into place as a whole.

Choices:
- Everything is written to a temporary sibling folder (``.<out_dir>.tmp-XXXX``, same filesystem) that replaces
  ``out_dir`` as a whole on ``commit()``: ``os.replace`` when ``out_dir`` doesn't exist, otherwise the old folder is
  moved aside, the new one moved in, then the old one deleted. ``abort()`` (an exception, a failed write) removes the
  temporary folder and leaves ``out_dir`` as it was.
- A failed write run through ``guarded()`` (disk full and any other OSError) becomes a ``CheckpointError`` naming the
  file and ``out_dir``.
- ``carry_over`` (model and adapter exports): what ``out_dir`` already holds and the new content does not write is
  kept, as transformers' ``save_pretrained`` keeps a folder's other files (a tokenizer saved there first, a README,
  a git clone's ``.git``), except what the predicate declines (the old weight shards and index the new ones
  supersede). The kept entries are hard-linked into the temporary folder just before the swap (copied where the
  filesystem has no hard links), so the swap stays one rename and an interrupted save still leaves ``out_dir`` as
  it was.
- Replacing the working directory, one of its parents or the home folder is refused.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path, PurePosixPath
from typing import Callable, TypeVar

from .checkpoint_io import CheckpointError
from .parallel_io import pwrite_all

_T = TypeVar("_T")


class AtomicFolder:
    """``out_dir`` built in a temporary folder beside it: ``create()``, write under ``tmp``, then ``commit()`` or
    ``abort()``."""

    def __init__(self, out_dir: Path, *, carry_over: Callable[[str], bool] | None = None) -> None:
        """``carry_over(name)``: whether an entry of an existing ``out_dir`` that the new content lacks is kept (None:
        the folder is replaced as a whole)."""
        self.out_dir = out_dir
        self.carry_over = carry_over
        self.tmp: Path | None = None  # the temporary folder, while one exists
        self._open_files: set[int] = set()  # from create_file(), not closed yet

    def create(self) -> Path:
        """Refuse a dangerous ``out_dir``, create its parent folders and the temporary folder, and return the latter."""
        self._refuse_dangerous_target()
        self.guarded(str(self.out_dir.parent), lambda: self.out_dir.parent.mkdir(parents=True, exist_ok=True))
        self.tmp = self._make_temp_folder()
        return self.tmp

    def relative(self, relpath: str) -> str:
        """``relpath`` normalised ("a/./b" is "a/b"); a path that is absolute or leaves the folder is refused."""
        parts = PurePosixPath(str(relpath).replace("\\", "/")).parts
        if not parts or os.path.isabs(relpath) or parts[0] == "/" or ".." in parts:
            raise CheckpointError(f"{relpath!r} must be a relative path inside the checkpoint folder {self.out_dir}.")
        return "/".join(p for p in parts if p != ".")

    def path(self, norm: str) -> Path:
        """Where the normalised relative path ``norm`` lies in the temporary folder, its parent folders created."""
        assert self.tmp is not None
        target = self.tmp / norm
        self.guarded(norm, lambda: target.parent.mkdir(parents=True, exist_ok=True))
        return target

    def create_file(self, name: str, first: bytes) -> int:
        """Create the new file ``name`` in the temporary folder, write ``first`` at its start, and return it open for
        writing (closed by ``close_file()``, or by ``abort()``)."""
        assert self.tmp is not None
        path = self.tmp / name

        def create() -> int:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            try:
                pwrite_all(fd, memoryview(first), 0)
            except BaseException:
                os.close(fd)
                raise
            return fd

        fd = self.guarded(name, create)
        self._open_files.add(fd)
        return fd

    def close_file(self, name: str, fd: int) -> None:
        """Close ``fd``, the file ``name`` from ``create_file()``."""
        self._open_files.discard(fd)
        self.guarded(name, lambda: os.close(fd))

    def guarded(self, file: str, write: Callable[[], _T]) -> _T:
        """Run ``write`` and return what it returns; an OSError becomes a CheckpointError naming ``file`` and the
        output folder."""
        try:
            return write()
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise CheckpointError(f"disk full while writing {file} in {self.out_dir}") from err
            raise CheckpointError(f"could not write {file} in {self.out_dir}: {err}") from err

    def commit(self) -> None:
        """Put the temporary folder in place of ``out_dir``; on failure ``out_dir`` is as it was (``abort()`` next)."""
        assert self.tmp is not None
        tmp, out = self.tmp, self.out_dir
        if not os.path.lexists(out):
            self.guarded(out.name, lambda: os.replace(tmp, out))
            self.tmp = None
            return
        if not out.is_dir() or out.is_symlink():
            raise CheckpointError(f"{out} exists and is not a folder; refusing to replace it with a checkpoint.")
        if self.carry_over is not None:
            for name in sorted(os.listdir(out)):
                if not os.path.lexists(tmp / name) and self.carry_over(name):
                    self.guarded(name, lambda name=name: _link_into(out / name, tmp / name))
        aside = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
        self.guarded(out.name, lambda: os.replace(out, aside))
        try:
            os.replace(tmp, out)
        except OSError as err:
            os.replace(aside, out)
            raise CheckpointError(f"could not move the new checkpoint into {out}: {err}") from err
        shutil.rmtree(aside, ignore_errors=True)
        self.tmp = None

    def abort(self) -> None:
        """Close the files still open and remove the temporary folder, if any; ``out_dir`` is untouched."""
        files, self._open_files = self._open_files, set()
        for fd in files:
            try:
                os.close(fd)
            except OSError:
                pass
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

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


def _link_into(src: Path, dst: Path) -> None:
    """``src`` (a file, symlink or folder tree) reproduced at ``dst`` by hard links, no bytes copied; copied where
    the filesystem refuses hard links."""
    def link(a, b):
        try:
            os.link(a, b, follow_symlinks=False)
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            shutil.copy2(a, b, follow_symlinks=False)

    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    else:
        link(src, dst)
