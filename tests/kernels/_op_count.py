"""Counting the grouped GEMMs a piece of code runs (what the grouped expert MLP tests assert)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class GroupedMmCount(TorchDispatchMode):
    """Inside, ``calls`` counts ``aten._grouped_mm`` dispatches."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten._grouped_mm.default
        return func(*args, **(kwargs or {}))
