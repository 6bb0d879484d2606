"""Whether the Triton kernels of this package may run: CUDA tensors and an importable ``triton``.

``TRITON_INTERPRET=1`` (Triton's CPU interpreter) also lets them run on CPU tensors, for development and the CPU
checks of the kernels themselves; ``LOONGFORGE_TRITON=0`` turns them off (the torch paths run everywhere).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    if not HAVE_TRITON or os.environ.get("LOONGFORGE_TRITON", "1") == "0":
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# Inputs at most this many elements (a one-token decode step's activations: batch x hidden, or batch x heads x head
# dim) leave a CUDA step bound by the host's launches: there a Triton launch (~25-40 us of host time through Triton's
# launcher with a kernel's dozen arguments) costs more than the one or two aten ops that do the same work (~7-10 us
# each); scripts/bench_launch_cost.py measures both. ``LOONGFORGE_LAUNCH_BOUND_NUMEL=0`` (read at import) keeps the
# Triton kernels for every size.
def _launch_bound_numel() -> int:
    value = os.environ.get("LOONGFORGE_LAUNCH_BOUND_NUMEL", "").strip()
    if not value:
        return 1 << 18
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOONGFORGE_LAUNCH_BOUND_NUMEL={value!r}: expected an integer element count (0 keeps "
                         "the Triton kernels for every input size).") from None


LAUNCH_BOUND_NUMEL = _launch_bound_numel()


def launch_bound(x: torch.Tensor) -> bool:
    """Whether ``x`` is a small CUDA input outside a CUDA-graph capture: inference kernels then take the aten ops
    that cost the host least (a captured graph pays no launch cost, so it keeps the fused kernels' fewer launches)."""
    from loongforge_hf.xpu import stream_capturing

    return x.is_cuda and x.numel() <= LAUNCH_BOUND_NUMEL and not stream_capturing(x.device)


def row_programs(rows: int, device: torch.device) -> int:
    """How many programs a row-reduction kernel starts: a few per SM on a GPU, few on the interpreter."""
    if device.type == "cuda":
        from loongforge_hf.xpu import get_backend

        return max(1, min(rows, 4 * get_backend().multiprocessor_count(device)))
    return max(1, min(rows, 4))


@contextlib.contextmanager
def triton_paths(enabled: bool):
    """Inside: the kernels take their Triton paths where ``use_triton`` allows (``enabled``) or their torch paths
    (``LOONGFORGE_TRITON=0``); the variable is restored afterwards."""
    saved = os.environ.get("LOONGFORGE_TRITON")
    os.environ["LOONGFORGE_TRITON"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOONGFORGE_TRITON", None)
        else:
            os.environ["LOONGFORGE_TRITON"] = saved
