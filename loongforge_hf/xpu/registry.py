"""Backend registry: lookup by name, explicit selection through ``LOONGFORGE_DEVICE``, automatic fallback."""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Callable

import torch

ENV_VAR = "LOONGFORGE_DEVICE"


class Backend:
    """What core code may ask about a device. Subclasses live in ``loongforge_hf/xpu/<name>.py``."""

    name: str = ""
    dist_backend: str = ""

    def setup(self) -> None:
        """Apply the patches megatron-core needs on this device. Idempotent."""

    def device(self, local_rank: int = 0) -> torch.device:
        raise NotImplementedError

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its local device."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op where work is synchronous)."""

    def max_memory_allocated(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def memory_per_device(self) -> float:
        """Bytes of memory one rank may use (the whole device; on the CPU an equal share of RAM per local rank)."""
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Dense matmul peak of one device for ``dtype`` (FLOP/s), or None when unknown (MFU is then not logged)."""
        return None

    def device_name(self, device: torch.device | None = None) -> str:
        """The device's model name (keys per-GPU caches such as the FP8 autotune table)."""
        return self.name

    def compute_capability(self, device: torch.device | None = None) -> tuple[int, int] | None:
        """(major, minor) of a GPU, None where the notion does not apply."""
        return None

    def multiprocessor_count(self, device: torch.device | None = None) -> int:
        """Parallel compute units a kernel launch can fill (SMs on a GPU, cores on the CPU)."""
        return os.cpu_count() or 1

    supports_graphs: bool = False  # NOTE: device graphs: a recorded sequence of kernels replayed without the host

    def run_before_capture(self, run: Callable[[], object]) -> object:
        """``run()`` for real, as a graph capture of it needs first (lazy initialisations, a collective's first use,
        kernel autotuning: none of which a capture may do)."""
        return run()

    @staticmethod
    def stream_capturing() -> bool:
        """Whether work queued now on this backend's current stream is recorded into a device graph, not run."""
        return False

    def capture(self, run: Callable[[], object]) -> tuple[Callable[[], None], object]:
        """Record ``run()`` as a device graph, without running it: ``(replay, the recorded call's output)``; each
        replay reruns its kernels on the same buffers and rewrites that output."""
        raise NotImplementedError(f"the {self.name} backend has no device graphs")

    def time_ms(self, fn: Callable[[], object], reps: int) -> float:
        """Mean wall time of ``fn`` over ``reps`` calls, in ms, with queued device work included."""
        import time

        self.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        self.synchronize()
        return (time.perf_counter() - start) * 1e3 / reps

    def __repr__(self) -> str:
        return f"<loongforge backend {self.name!r}>"


@dataclass(frozen=True)
class _Entry:
    module: str
    cls: str
    is_available: Callable[[], bool]
    missing: Callable[[], str]


_REGISTRY: dict[str, _Entry] = {}
_ACTIVE: Backend | None = None


def register_backend(name: str, *, module: str, cls: str, is_available: Callable[[], bool],
                     missing: Callable[[], str]) -> None:
    """Register a backend: ``missing()`` returns a sentence naming what an unavailable backend lacks."""
    _REGISTRY[name] = _Entry(module, cls, is_available, missing)
    _backend_class.cache_clear()


@functools.lru_cache(maxsize=None)
def _backend_class(device_type: str) -> type:
    entry = _REGISTRY.get(device_type)
    return getattr(importlib.import_module(entry.module), entry.cls) if entry is not None else Backend


def stream_capturing(device: torch.device) -> bool:
    """Whether work queued on ``device``'s current stream is being recorded into a device graph: asked of the
    backend of the device's type, whichever backend the process runs (a CUDA tensor in a process whose backend is
    cpu, as in the GPU tests, is still queued on a CUDA stream)."""
    return _backend_class(device.type).stream_capturing()


def available_backends() -> list[str]:
    return [name for name, entry in _REGISTRY.items() if entry.is_available()]


def _instantiate(name: str) -> Backend:
    entry = _REGISTRY[name]
    backend = getattr(importlib.import_module(entry.module), entry.cls)()
    backend.setup()
    return backend


def get_backend(name: str | None = None) -> Backend:
    """The active backend. ``name`` or ``$LOONGFORGE_DEVICE`` choose explicitly; otherwise cuda, else cpu."""
    global _ACTIVE
    requested = name or os.environ.get(ENV_VAR) or None
    if _ACTIVE is not None and (requested is None or requested == _ACTIVE.name):
        return _ACTIVE
    if requested is not None:
        requested = requested.lower()
        if requested not in _REGISTRY:
            raise ValueError(f"Unknown device backend {requested!r} (from {ENV_VAR} or the argument); "
                             f"known backends: {', '.join(sorted(_REGISTRY))}.")
        if not _REGISTRY[requested].is_available():
            raise RuntimeError(f"Device backend {requested!r} was requested but cannot work here: "
                               f"{_REGISTRY[requested].missing()}")
        _ACTIVE = _instantiate(requested)
        return _ACTIVE
    _ACTIVE = _instantiate("cuda" if _REGISTRY["cuda"].is_available() else "cpu")
    return _ACTIVE


def _reset_for_tests() -> None:
    global _ACTIVE
    _ACTIVE = None


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _kunlun_available() -> bool:
    return importlib.util.find_spec("torch_xmlir") is not None and importlib.util.find_spec("xpu_plugin") is not None


def _kunlun_missing() -> str:
    lacking = [m for m in ("torch_xmlir", "xpu_plugin") if importlib.util.find_spec(m) is None]
    return (f"the Kunlun stack is not installed (cannot import {', '.join(lacking)}); install Kunlun's torch_xmlir "
            "and its megatron-core xpu_plugin.")


register_backend("cuda", module="loongforge_hf.xpu.cuda", cls="CudaBackend", is_available=_cuda_available,
                 missing=lambda: "torch.cuda.is_available() is False (no NVIDIA GPU visible, or a CPU build of torch "
                                 f"{torch.__version__}).")
register_backend("cpu", module="loongforge_hf.xpu.cpu", cls="CpuBackend", is_available=lambda: True,
                 missing=lambda: "")
register_backend("kunlun", module="loongforge_hf.xpu.kunlun", cls="KunlunBackend", is_available=_kunlun_available,
                 missing=_kunlun_missing)
