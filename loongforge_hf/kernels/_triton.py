"""Whether the Triton kernels of this package may run: CUDA tensors and an importable ``triton``.

``TRITON_INTERPRET=1`` (Triton's CPU interpreter) also lets them run on CPU tensors, for development and the CPU
checks of the kernels themselves; ``LOONGFORGE_TRITON=0`` turns them off (the torch paths run everywhere).
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    if not HAVE_TRITON or os.environ.get("LOONGFORGE_TRITON", "1") == "0":
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def row_programs(rows: int, device: torch.device) -> int:
    """How many programs a row-reduction kernel starts: a few per SM on a GPU, few on the interpreter."""
    if device.type == "cuda":
        from loongforge_hf.xpu import get_backend

        return max(1, min(rows, 4 * get_backend().multiprocessor_count(device)))
    return max(1, min(rows, 4))
