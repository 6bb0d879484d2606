"""A diagonal linear recurrence ``h_t = a_t * h_{t-1} + b_t`` over one dimension of a tensor, for every state at
once, in ``O(log s)`` tensor steps instead of one Python step per token (Mamba-1's selective scan, Griffin's RG-LRU).

Choices:
- Forward: an inclusive Hillis-Steele scan of the affine maps ``h -> a_t * h + b_t`` (composition is associative:
  ``(a1, b1) then (a2, b2) = (a1 * a2, a2 * b1 + b2)``), ``ceil(log2 s)`` steps, each one elementwise op over the
  whole tensor: on a GPU a few dozen launches for any length instead of ``s``. It does ``O(s log s)`` work: the
  trade for no custom kernel. Not bit-identical to the sequential loop (the products are grouped differently):
  within fp32 rounding of it (``tests/kernels/test_linear_scan.py`` states the bounds).
- Backward by hand (``torch.autograd.Function``), not autograd through the steps (which would keep every step's
  tensors): the gradient of the states follows the reversed recurrence ``g_t = dh_t + a_{t+1} g_{t+1}``, the same
  scan run from the end; then ``db_t = g_t``, ``da_t = g_t * h_{t-1}``, ``dh0 = a_0 * g_0``. Saved for it: ``a``
  and the states (what the sequential loop's autograd keeps too). Scans run in place on their output; each keeps
  one scratch copy of the decays beside it.
- ``a_t = 0`` restarts the recurrence at ``t`` (packed documents); ``initial`` continues one (a cache).
- Computed in fp32 (fp64 for fp64 inputs) whatever the inputs' dtype; the states come back in it.
"""

from __future__ import annotations

import torch


def _scan_(decay: torch.Tensor, h: torch.Tensor, dim: int, *, reverse: bool = False) -> torch.Tensor:
    """``h`` becomes the states of ``h_t = decay_t * h_{t-1} + h_t`` (``h_{t+1}`` with ``reverse``) from zero along
    ``dim``, in place; ``decay`` is overwritten (the caller's scratch)."""
    seq = h.shape[dim]
    offset = 1
    while offset < seq:
        tail = seq - offset
        later, earlier = (0, offset) if reverse else (offset, 0)
        decay_later = decay.narrow(dim, later, tail)
        update = decay_later * h.narrow(dim, earlier, tail)  # NOTE: read before the in-place add below writes h
        if 2 * offset < seq:
            decay_later.copy_(decay_later * decay.narrow(dim, earlier, tail))
        h.narrow(dim, later, tail).add_(update)
        del update
        offset *= 2
    return h


def _first(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.narrow(dim, 0, 1)


class _LinearScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, initial, dim):
        h = b.clone()
        if initial is not None:
            _first(h, dim).add_(_first(a, dim) * initial.unsqueeze(dim))
        _scan_(a.clone(), h, dim)
        ctx.save_for_backward(a, h, initial)
        ctx.dim = dim
        return h

    @staticmethod
    def backward(ctx, grad_h):
        a, h, initial = ctx.saved_tensors
        dim = ctx.dim
        seq = a.shape[dim]
        # NOTE: g_t = dh_t + a_{t+1} g_{t+1}: the scan run from the end with a shifted by one (a_0 lands last, unread)
        g = _scan_(a.roll(-1, dim), grad_h.to(a.dtype, copy=True), dim, reverse=True)
        grad_a = torch.empty_like(g)
        torch.mul(g.narrow(dim, 1, seq - 1), h.narrow(dim, 0, seq - 1), out=grad_a.narrow(dim, 1, seq - 1))
        if initial is None:
            _first(grad_a, dim).zero_()
            return grad_a, g, None, None
        torch.mul(_first(g, dim), initial.unsqueeze(dim), out=_first(grad_a, dim))
        return grad_a, g, (_first(a, dim) * _first(g, dim)).squeeze(dim), None


def linear_scan(a: torch.Tensor, b: torch.Tensor, *, initial: torch.Tensor | None = None,
                dim: int = -1) -> torch.Tensor:
    """Every state of ``h_t = a_t * h_{t-1} + b_t`` along ``dim`` of ``a`` and ``b`` (same shape), from
    ``h_{-1} = initial`` (``a``'s shape without ``dim``; None: zeros) -> fp32 (fp64) states of ``a``'s shape;
    differentiable in ``a``, ``b`` and ``initial``."""
    if a.shape != b.shape:
        raise ValueError(f"linear_scan: a {tuple(a.shape)} and b {tuple(b.shape)} differ in shape.")
    dim = dim % a.dim()
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return _LinearScan.apply(a.to(dtype), b.to(dtype), None if initial is None else initial.to(dtype), dim)
