"""Positional file I/O on a pool of threads, shared by the checkpoint reader (``checkpoint_io``) and writer.

``os.preadv`` / ``os.pwrite`` release the GIL, so one large read or write cut into pieces runs on several cores: a
stretch of the file in whole pages, or a block of columns as ranges of its runs. Every call returns once all its
pieces are done; the first error (in piece order) is raised after the others ended, so no thread still touches the
caller's buffer. Threads per process: ``LOONGFORGE_IO_THREADS``, else this process's CPUs over ``LOCAL_WORLD_SIZE``,
between 1 and 16.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

# NOTE: how many buffers one preadv call may take (POSIX guarantees 16; Linux allows 1024).
_IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16, 1024))


# NOTE: below this many bytes a piece of a read is not worth a task of its own (a task costs tens of microseconds, a
# MiB from the page cache a few hundred).
_CHUNK_BYTES = 4 << 20
_MAX_IO_THREADS = 16


def io_threads() -> int:
    """Threads for checkpoint reads and writes: ``LOONGFORGE_IO_THREADS``, else this process's CPUs over the processes
    of its node (``LOCAL_WORLD_SIZE``), between 1 and 16."""
    env = os.environ.get("LOONGFORGE_IO_THREADS", "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"LOONGFORGE_IO_THREADS must be a positive integer, got {env!r}.")
        return value
    try:
        cpus = len(os.sched_getaffinity(0))  # NOTE: what taskset/cgroups leave this process, not the host's count
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(_MAX_IO_THREADS, cpus // local))


_pool_lock = threading.Lock()
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool)


def _io_pool(threads: int) -> ThreadPoolExecutor:
    """The process's I/O pool of ``threads`` threads (a new one after a fork, or when the count changes)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] != threads:
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            _pool = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="loongforge-io"))
        return _pool[2]


def run_io(tasks: list) -> None:
    """Run the callables ``tasks`` on the I/O pool (inline when one thread or one task) and wait for all of them.

    The first exception (in task order) is raised once every task has ended, so no task still touches its buffers.
    """
    threads = io_threads() if len(tasks) > 1 else 1
    if threads == 1:
        for task in tasks:
            task()
        return
    futures = [_io_pool(threads).submit(task) for task in tasks]
    error: BaseException | None = None
    for future in futures:
        try:
            future.result()
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the others finished
            error = error or err
    if error is not None:
        raise error


def split_evenly(count: int, total_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``range(count)`` in as many pieces as the I/O threads and ``_CHUNK_BYTES``
    allow (one piece for a small ``total_bytes``)."""
    pieces = max(1, min(count, io_threads(), total_bytes // _CHUNK_BYTES))
    bounds = [count * i // pieces for i in range(pieces + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def page_pieces(total_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` byte ranges of one stretch of ``total_bytes``, in whole 4 KiB pages except the last, one per
    piece of ``split_evenly``."""
    pages = -(-total_bytes // 4096)
    return [(first * 4096, min(total_bytes, last * 4096)) for first, last in split_evenly(pages, total_bytes)]


def read_runs(fd: int, dest: memoryview, *, offset: int, runs: int, run_bytes: int, stride: int) -> None:
    """Fill ``dest`` with ``runs`` runs of ``run_bytes`` bytes that start ``stride`` bytes apart from ``offset``.

    Runs that touch (one run, or a slice spanning the whole dimension) are one stretch of the file, read in pieces
    of whole pages on the I/O threads. Otherwise each thread takes a range of runs; each of its preadv calls reads a
    stretch of consecutive runs, the bytes between them going to a scratch buffer that the piece's gaps share.
    """
    if runs == 1 or stride == run_bytes:
        run_io([lambda a=a, b=b: preadv_exact(fd, [dest[a:b]], offset + a) for a, b in page_pieces(len(dest))])
        return
    run_io([lambda first=first, last=last: _read_run_range(fd, dest, offset=offset, first=first, last=last,
                                                           run_bytes=run_bytes, stride=stride)
            for first, last in split_evenly(runs, runs * stride)])


def _read_run_range(fd: int, dest: memoryview, *, offset: int, first: int, last: int, run_bytes: int,
                    stride: int) -> None:
    """Runs ``first:last`` of ``_read_runs``, the gaps between them read into one scratch buffer."""
    gap = memoryview(bytearray(stride - run_bytes))
    per_call = _IOV_MAX // 2
    for begin in range(first, last, per_call):
        end = min(last, begin + per_call)
        buffers: list[memoryview] = []
        for r in range(begin, end):
            buffers.append(dest[r * run_bytes:(r + 1) * run_bytes])
            if r + 1 < end:
                buffers.append(gap)
        preadv_exact(fd, buffers, offset + begin * stride)


def preadv_exact(fd: int, buffers: list[memoryview], offset: int) -> None:
    """preadv until every buffer is full (the kernel may stop early, e.g. at 2 GiB per call); EOFError at the end."""
    i = 0
    while i < len(buffers):
        got = os.preadv(fd, buffers[i:i + _IOV_MAX], offset)
        if got == 0:
            raise EOFError(f"the file ends at byte {offset}")
        offset += got
        while i < len(buffers) and got >= len(buffers[i]):
            got -= len(buffers[i])
            i += 1
        if got:
            buffers[i] = buffers[i][got:]


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """pwrite until all of ``data`` is written (the kernel may take less per call, e.g. 2 GiB at most)."""
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def write_runs(fd: int, data: memoryview, offset: int, *, runs: int = 1, run_bytes: int = 0, stride: int = 0) -> None:
    """Write ``data`` as ``runs`` runs of ``run_bytes`` bytes placed ``stride`` bytes apart from ``offset`` (one
    stretch when ``runs`` is 1 or the runs touch), in pieces on the I/O threads."""
    if runs == 1 or run_bytes == stride:
        run_io([lambda a=a, b=b: pwrite_all(fd, data[a:b], offset + a) for a, b in page_pieces(len(data))])
        return

    def write(first: int, last: int) -> None:
        for r in range(first, last):
            pwrite_all(fd, data[r * run_bytes:(r + 1) * run_bytes], offset + r * stride)

    run_io([lambda first=first, last=last: write(first, last) for first, last in split_evenly(runs, len(data))])
