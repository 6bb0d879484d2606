"""The gated delta rule through flash-linear-attention's Triton kernels (the optional ``fla`` package), on the
accelerator, with documents of any length packed into one row.

Choices:
- Optional, as transformers treats it: when ``fla`` imports and the tensors are on CUDA, Gated DeltaNet layers run
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (chunked forward and backward kernels; the WY form of the same
  chunked algebra as ``gated_delta_rule``); otherwise our torch code. ``LOONGFORGE_DELTA_RULE=torch`` forces the torch
  code (benchmarks, bisecting).
- Kimi Delta Attention's per-channel decay (``g`` ``[.., v_heads, k_dim]``) runs fla's ``fla.ops.kda.chunk_kda``
  (the same rule with a decay per key channel; same conventions below) where it imports
  (``available(per_channel=True)``); its backward does not use the kernel fla refuses below
  (``tests/kernels/test_gpu_fla_delta_rule.py`` checks its gradients on the GPU against our torch code).
- Where fla refuses its backward (its gated ``chunk_bwd_dqkwg`` on Hopper with Triton 3.4 - 3.7.0 and no tilelang: a
  Triton miscompile, fla issue #640) a forward that needs gradients takes the torch code and only gradient-free
  forwards (evaluation, generate's prefill) take fla; ``available(device, backward=True)`` reads fla's own flags.
- The same conventions as ``kernels.gated_delta_rule``: q / k L2-normalised in the kernel with fla's ``x *
  rsqrt(sum(x^2) + 1e-6)``, q scaled by ``k_dim^-1/2``, grouped value heads (key head ``i`` serves value heads ``i * r
  .. i * r + r - 1``: fla's GVA indexing), log decay ``g`` and ``beta`` in fp32, the state in fp32.
- Rows and documents: the caller flattens its ``[b, s]`` tokens into one row and passes ``cu_seqlens`` (each row's
  and each packed document's start, as flash-attention's varlen API): one launch for the whole batch, every
  document starting from a zero state (or its ``initial_state`` row).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _chunk_kernel():
    """fla's ``chunk_gated_delta_rule``, or None when the package is missing or fails to import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # NOTE: an fla that does not import on this torch / triton is the same as no fla
        return None
    return chunk_gated_delta_rule


@functools.cache
def _kda_kernel():
    """fla's ``chunk_kda`` (Kimi Delta Attention: a decay per key channel), or None as ``_chunk_kernel``."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # NOTE: as _chunk_kernel
        return None
    return chunk_kda


@functools.cache
def _backward_refused() -> bool:
    """fla's own condition for refusing the gated backward (see the module docstring)."""
    import importlib.util

    from fla import utils

    broken = utils.IS_NVIDIA_HOPPER and utils.TRITON_ABOVE_3_4_0 and not utils.TRITON_ABOVE_3_7_1
    return bool(broken) and importlib.util.find_spec("tilelang") is None


def available(device: torch.device, *, backward: bool = False, per_channel: bool = False) -> bool:
    """Whether Gated DeltaNet layers on ``device`` run fla's kernels, for a forward whose gradients are needed when
    ``backward``, with a decay per key channel (Kimi Delta Attention) when ``per_channel`` (see the module
    docstring)."""
    if os.environ.get("LOONGFORGE_DELTA_RULE", "").lower() == "torch" or torch.device(device).type != "cuda":
        return False
    if per_channel:
        return _kda_kernel() is not None
    return _chunk_kernel() is not None and not (backward and _backward_refused())


def gated_delta_rule_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, *, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None = None,
                            output_final_state: bool = False):
    """``query`` / ``key`` ``[1, T, k_heads, k_dim]``, ``value`` ``[1, T, v_heads, v_dim]``, ``g`` / ``beta`` ``[1, T,
    v_heads]`` (``g`` ``[1, T, v_heads, k_dim]``: a decay per key channel, fla's KDA kernel), ``cu_seqlens``
    ``[n + 1]`` (int, on the tensors' device, 0 first and T last) -> (``[1, T, v_heads, v_dim]`` in the query's
    dtype, the ``[n, v_heads, k_dim, v_dim]`` fp32 final states or None)."""
    kernel = _kda_kernel() if g.dim() == 4 else _chunk_kernel()
    if kernel is None:
        raise RuntimeError("gated_delta_rule_varlen needs the fla package (pip install flash-linear-attention).")
    if query.shape[0] != 1:
        raise ValueError(f"gated_delta_rule_varlen: flatten the rows into one (got batch {query.shape[0]}).")
    k_dim = key.shape[-1]
    out, state = kernel(query, key, value.to(query.dtype), g.float(), beta.to(query.dtype), scale=k_dim ** -0.5,
                        initial_state=initial_state, output_final_state=output_final_state,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long())
    return out.to(query.dtype), state


def gated_delta_rule_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, *, initial_state: torch.Tensor | None = None,
                          output_final_state: bool = False):
    """``kernels.gated_delta_rule.gated_delta_rule``'s signature and returns (``[b, s, ...]`` rows, each its own
    sequence) through fla: the rows flattened into one varlen call."""
    batch, seq = query.shape[:2]
    cu = torch.arange(0, (batch + 1) * seq, seq, device=query.device)
    flat = [x.reshape(1, batch * seq, *x.shape[2:]) for x in (query, key, value, g, beta)]
    out, state = gated_delta_rule_varlen(*flat, cu_seqlens=cu, initial_state=initial_state,
                                         output_final_state=output_final_state)
    out = out.reshape(batch, seq, *out.shape[2:])
    return (out, state.float()) if output_final_state else out
