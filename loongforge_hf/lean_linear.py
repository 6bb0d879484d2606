"""megatron's linear layers without their training machinery, for forwards that take no gradients (``generate``).

megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` run every forward through an autograd ``Function`` (its
``ctx``, saved tensors, ``custom_fwd``) and through the tensor-parallel mappings' ``Function``s (identities at
tensor-parallel size 1). In a one-token decode step these are most of a linear layer's cost on the host
(``scripts/bench_generate.py --compare-lean-linears`` runs generate with and without this, side by side).
``lean_linears`` turns each such layer of a model into a subclass whose ``forward`` computes what megatron's does,
the same ops in the same order: under sequence parallelism the input's sequence gathered into megatron's global
buffer, ``matmul(x, w.t())``, ``+ bias`` (returned instead with ``skip_bias_add``; a row-parallel layer adds it
after its reduction), the output gathered where megatron gathers it, a row-parallel layer's output all-reduced or,
under sequence parallelism, reduce-scattered, through megatron's own collective helpers
(``tensor_parallel.mappings``' functions under its autograd ``Function``s). It turns them back on exit. Left alone:
subclasses (LoRA's layers), layers with their own ``_forward_impl`` (FP8) or ``forward``, experts with explicit
communication, row-parallel layers whose input is not split. ``LOONGFORGE_LEAN_LINEARS=0`` turns it off (megatron's
forward everywhere).
"""

from __future__ import annotations

import contextlib
import os

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (_gather_along_first_dim, _gather_along_last_dim, _reduce,
                                                    _reduce_scatter_along_first_dim)


def _column_forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
    if self.sequence_parallel:  # NOTE: megatron gathers the sequence into its global buffer, then multiplies
        input_ = _gather_along_first_dim(input_, self.tp_group, use_global_buffer=True)
    out = torch.matmul(input_, (self.weight if weight is None else weight).t())
    if self.bias is not None and not self.skip_bias_add:
        out = out + self.bias
    if self.gather_output if runtime_gather_output is None else runtime_gather_output:
        out = _gather_along_last_dim(out, self.tp_group)
    return out, (self.bias if self.skip_bias_add else None)


def _row_forward(self, input_: torch.Tensor):
    out = torch.matmul(input_, self.weight.t())
    out = _reduce_scatter_along_first_dim(out, self.tp_group) if self.sequence_parallel else _reduce(out, self.tp_group)
    if self.skip_bias_add:
        return out, self.bias
    return (out + self.bias if self.bias is not None else out), None


class _LeanColumn(ColumnParallelLinear):
    forward = _column_forward


class _LeanRow(RowParallelLinear):
    forward = _row_forward


_LEAN = {ColumnParallelLinear: _LeanColumn, RowParallelLinear: _LeanRow}


@contextlib.contextmanager
def lean_linears(model):
    """Inside, the eligible linear layers of ``model``'s chunks (see the module docstring) are of a subclass with the
    lean forward (the same class every call: the static cache's kept graph compares the modules' classes, and no
    attribute is added); only where no gradient is taken (the caller's promise: ``generate`` runs under
    ``torch.no_grad``)."""
    swapped = []
    if os.environ.get("LOONGFORGE_LEAN_LINEARS", "1") != "0":
        for chunk in model.chunks:
            for module in chunk.modules():
                lean = _LEAN.get(type(module))
                if lean is None or "_forward_impl" in module.__dict__ or "forward" in module.__dict__ \
                        or module.explicit_expert_comm or not getattr(module, "input_is_parallel", True):
                    continue
                swapped.append((module, type(module)))
                module.__class__ = lean
    try:
        yield
    finally:
        for module, kind in swapped:
            module.__class__ = kind
