"""Run a function in N local processes that form one torch.distributed world (CPU over gloo, or local GPUs).

Used by the tests and the demo. A child's exception comes back to the parent with its traceback; a world that does
not finish within ``timeout`` is killed (no hung CI job).

Choices:
- CPU worlds (``LOONGFORGE_DEVICE=cpu``, what the test suite runs) start from a fork server that imported torch,
  transformers, peft, trl, megatron-core and loongforge-hf once (``multiprocessing``'s "forkserver" with preloaded
  modules): each rank is a fork of it, not a fresh interpreter importing them again (about 8 s of CPU a rank on the
  CI machine, most of a small test's time). The server only imports (no torch ops, no CUDA, no process group),
  with ``OMP_NUM_THREADS=1``, so a fork of it is a clean process. Modules read some environment variables when
  imported (the hub's cache and offline settings): the server starts only from the environment this module was
  imported in, and a world whose parent's environment or ``sys.path`` differs from the server's (a test that
  changed ``HF_HOME``; the ``env`` argument) starts its ranks with "spawn" instead, as do GPU worlds
  (``LOONGFORGE_SPAWN=spawn`` forces it always). A forked rank takes the parent's current working directory and
  environment, the thread count torch would have read from ``OMP_NUM_THREADS``, fresh random seeds (torch,
  numpy) as a new interpreter has (forks of one server would otherwise all draw the same numbers), and the
  parent's current stdout / stderr (handed over as file descriptors: the server's are those of its start).
- A rank's result travels as plain pickle bytes (tensors by value). Through the queue's own pickler torch would
  share a tensor's storage as a file descriptor that the parent fetches from the rank's process when it reads the
  result; a rank that has exited by then (it returns, tears down its group and ends) leaves nothing to fetch, and
  the parent failed with ``FileNotFoundError`` / ``ConnectionResetError`` (seen in the demo's test under load).
- A rank freezes the garbage collector's view of what it starts with (``gc.freeze()``: the imported modules' objects,
  never collected anyway): every ``Trainer.train()`` starts with accelerate's full ``gc.collect``, which otherwise
  walks all of them again (~0.3 s a trainer on the CI machine); cycles made later are collected as usual. They are
  unfrozen when the function returns, so a spawned rank's interpreter shutdown frees them as before.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable


class ChildProcessError_(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _free_port() -> int:
    """A free TCP port for a world's rendezvous: the kernel's pick, or, where ``LOONGFORGE_SPAWN_PORTS`` ("lo-hi")
    is set, the next free one of that range. Several processes starting worlds at once (the test suite's pytest-xdist
    workers) each keep to their own range below the ephemeral ports: a port the kernel picked and this process
    released can be taken by another world's gloo connection before this world's store listens on it."""
    span = os.environ.get("LOONGFORGE_SPAWN_PORTS")
    if not span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    lo, hi = (int(p) for p in span.split("-"))
    for _ in range(hi - lo + 1):
        port = lo + next(_PORT_TURN) % (hi - lo + 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"LOONGFORGE_SPAWN_PORTS={span}: no free port in the range.")


_PORT_TURN = itertools.count()  # NOTE: the next port of LOONGFORGE_SPAWN_PORTS to try (each world a fresh one)


_PRELOAD = ["torch", "torch.distributed", "transformers", "peft", "trl", "megatron.core", "loongforge_hf"]
_SERVER: dict = {}  # the fork server's start: {"env": ..., "path": ...}; empty until the first forked world


def _stable_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


_IMPORT_ENV = _stable_env()  # NOTE: the server starts only from this environment (not one a test patched for a while)


def _fork_context(env: dict | None):
    """The "forkserver" context when this world may fork from the preloaded server, else None (spawn)."""
    if env or os.environ.get("LOONGFORGE_DEVICE") != "cpu" or os.environ.get("LOONGFORGE_SPAWN") == "spawn" \
            or "forkserver" not in mp.get_all_start_methods():
        return None
    here = {"env": _stable_env(), "path": list(sys.path)}
    if not _SERVER:
        if here["env"] != _IMPORT_ENV:
            return None
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _SERVER.update(here)
        return ctx
    return mp.get_context("forkserver") if here == _SERVER else None


class _ParentFd:
    """The parent's file descriptor ``fd`` for a forked rank: pickled while the rank starts, as multiprocessing
    hands descriptors to a fork server's children; the rank unpickles its own copy's number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _inherited_fd, (reduction.DupFd(self.fd),)


def _inherited_fd(dup) -> int:
    return dup.detach()


def _child(rank: int, world: int, port: int, extra_env: dict, fn: Callable, args: tuple, kwargs: dict,
           results: "mp.Queue", forked: dict | None = None) -> None:
    if forked is not None:  # NOTE: a fork of the server: the parent's output, directory, environment and threads
        for stream, fd in zip((sys.stdout, sys.stderr), forked["fds"]):
            stream.flush()
            os.dup2(fd, stream.fileno())
            os.close(fd)
        os.chdir(forked["cwd"])
        os.environ.clear()
        os.environ.update(forked["env"])
        import numpy
        import torch

        torch.set_num_threads(int(extra_env["OMP_NUM_THREADS"]))
        torch.seed()
        numpy.random.seed()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    os.environ.update(extra_env)
    gc.freeze()
    try:
        out = fn(*args, **kwargs)
        results.put((rank, True, pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        gc.unfreeze()  # NOTE: a spawned rank's shutdown then frees them (else Triton's bindings report leaks at exit)


def run_distributed(fn: Callable, nprocs: int, *args: Any, timeout: float = 300.0,
                    env: dict | None = None, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks; return the per-rank results in rank order."""
    fork = _fork_context(env)
    ctx = fork or mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    # NOTE: the cores shared out among the ranks. Set in this process's environment while the children start: a
    # child imports torch (unpickling ``fn``) before ``_child`` runs, and torch reads OMP_NUM_THREADS on import.
    threads = str(max(1, len(os.sched_getaffinity(0)) // nprocs))
    extra_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads), **(env or {})}
    forked = {"cwd": os.getcwd(), "env": dict(os.environ), "fds": (_ParentFd(1), _ParentFd(2))} \
        if fork is not None else None
    procs = [ctx.Process(target=_child, args=(r, nprocs, port, extra_env, fn, args, kwargs, results, forked),
                         daemon=False) for r in range(nprocs)]
    # NOTE: a forked rank sets its threads itself; the server, if this start makes it, imports with one thread
    start_env = {"OMP_NUM_THREADS": "1"} if fork is not None else extra_env
    saved = {k: os.environ.get(k) for k in start_env}
    os.environ.update(start_env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out: dict[int, Any] = {}
    errors: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < nprocs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if errors:
                    break
                raise TimeoutError(f"{fn.__name__} did not finish on {nprocs} ranks within {timeout:.0f}s "
                                   f"(finished: {sorted(out)}, failed: {[r for r, _ in errors]}).")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and i not in out and i not in [r for r, _ in errors]]
                if dead:
                    errors.extend((i, f"rank {i} exited with code {procs[i].exitcode} without a result")
                                  for i in dead)
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append((rank, value))
                # NOTE: once one rank failed the others may wait forever in a collective: give them a short grace.
                deadline = min(deadline, time.monotonic() + 20)
    finally:
        grace = time.monotonic() + 5  # NOTE: one grace period for all ranks, then the stragglers are killed
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        errors.sort()
        rank, tb = errors[0]
        raise ChildProcessError_(f"rank {rank} of {nprocs} failed:\n{tb}")
    return [out[r] for r in range(nprocs)]
