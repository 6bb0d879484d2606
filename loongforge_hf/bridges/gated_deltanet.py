"""Gated DeltaNet (the linear-attention layers of Qwen3.5 / Qwen3-Next) as a megatron-style module, and the
self-attention slot that picks it or megatron's ``SelfAttention`` by layer.

Choices:
- Our own module, not megatron-core 0.16's experimental ``ssm/gated_delta_net.py``: that one needs the fla package's
  kernels (an ImportError without them), allocates on the accelerator whatever the backend, ignores the padding mask and
  splits its fused in-projection evenly over TP, which needs a per-rank reordering of the checkpoint anyway.
- Tensor parallelism splits by heads: rank ``r`` holds key heads ``r * Hk / tp ..`` and the value heads they serve
  (``Hv / Hk`` consecutive ones each). One column-parallel ``in_proj`` holds this rank's rows of transformers'
  ``in_proj_qkv`` (its q, k and v heads), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, in that order (one
  all-gather of the tokens under sequence parallelism); the depthwise conv's channels, ``A_log`` and ``dt_bias`` are
  split with the heads; ``out_proj`` is row-parallel. The gated norm's weight (one ``[v_dim]`` vector shared by all
  heads) is replicated: it enters the forward through megatron's ``copy_to_tensor_model_parallel_region``, whose
  backward sums the ranks' partial grads (each rank sees its heads only).
- Forward as transformers' ``Qwen3_5GatedDeltaNet`` without a cache: padded tokens (the diagonal of megatron's
  ``[b, 1, s, s]`` mask: a token masked from itself) are zeroed (transformers zeroes their hidden states; the
  projections have no bias, so zeroing after ``in_proj`` is the same), then the causal depthwise conv with ``silu``
  (in the weight's dtype), L2-normalised q / k, ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``
  in fp32, the gated delta rule (``kernels.gated_delta_rule``), the gated RMSNorm (``weight * norm(x)`` in the
  input's dtype times ``silu(z)`` in fp32, rounded once) and ``out_proj``.
- Packed documents (megatron's mask blocks attention between documents): the conv and the recurrence restart at each
  document's start (a token masked from the one before it while both are real), each document run on its own.
  transformers' torch fallback runs a packed row as one sequence; its fla kernels restart per document as here.
- No recurrent-state cache: a KV-cache forward (``inference_context``) and THD ``packed_seq_params`` are refused.
- ``hybrid_self_attention(linear=...)`` is the layer spec's self-attention class: ``GatedDeltaNet`` for the
  0-based global layer indices in ``linear`` (megatron numbers layers from 1, offset by the pipeline stage), megatron's
  ``SelfAttention`` for the others.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


class GatedDeltaNet(torch.nn.Module):
    """One linear-attention layer's token mixer, this TP rank's heads (see the module docstring)."""

    def __init__(self, config, *, layer_number: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                 conv_kernel: int, eps: float, pg_collection=None, **_: object) -> None:
        from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                          set_tensor_model_parallel_attributes)

        from loongforge_hf.xpu import get_backend

        super().__init__()
        self.config, self.layer_number = config, layer_number
        tp_group = getattr(pg_collection, "tp", None)
        tp = config.tensor_model_parallel_size
        self.k_heads, self.v_heads, self.key_dim, self.value_dim = key_heads // tp, value_heads // tp, key_dim, \
            value_dim
        self.eps, self.tp_group = eps, tp_group
        self.qkv_size = 2 * self.k_heads * key_dim + self.v_heads * value_dim
        local = self.qkv_size + self.v_heads * value_dim + 2 * self.v_heads
        self.in_proj = ColumnParallelLinear(config.hidden_size, local * tp, config=config,
                                            init_method=config.init_method, bias=False, gather_output=False,
                                            skip_bias_add=True, tp_group=tp_group)
        self.out_proj = RowParallelLinear(value_heads * value_dim, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        kw = dict(dtype=config.params_dtype, device=device)
        self.conv_weight = torch.nn.Parameter(torch.zeros(self.qkv_size, 1, conv_kernel, **kw))
        self.A_log = torch.nn.Parameter(torch.zeros(self.v_heads, **kw))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.v_heads, **kw))
        self.norm_weight = torch.nn.Parameter(torch.ones(value_dim, **kw))
        for p in (self.conv_weight, self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(p, True, 0, 1)

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                inference_context=None, packed_seq_params=None, **_: object):
        if inference_context is not None:
            raise ValueError("Gated DeltaNet layers keep no recurrent-state cache: generate with use_cache=False.")
        if packed_seq_params is not None:
            raise ValueError("Gated DeltaNet layers do not take THD packed_seq_params; pack documents into rows "
                             "(position ids restarting at 0).")
        mixed, _ = self.in_proj(hidden_states)                            # [s, b, local]: all tokens
        mixed = mixed.transpose(0, 1)                                     # [b, s, local]
        real, starts = _token_layout(attention_mask, mixed.shape[0], mixed.shape[1])
        if real is not None:
            mixed = mixed * real[..., None].to(mixed.dtype)
        v_size = self.v_heads * self.value_dim
        qkv, z, b, a = torch.split(mixed, [self.qkv_size, v_size, self.v_heads, self.v_heads], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if starts is None:
            core = self._mix(qkv, g, beta)
        else:  # NOTE: each document of each row on its own (see the module docstring)
            rows = []
            for row, cuts in enumerate(starts):
                bounds = [0, *cuts, qkv.shape[1]]
                rows.append(torch.cat([self._mix(qkv[row:row + 1, lo:hi], g[row:row + 1, lo:hi],
                                                 beta[row:row + 1, lo:hi]) for lo, hi in zip(bounds, bounds[1:])],
                                      dim=1))
            core = torch.cat(rows, dim=0)
        out = self._gated_norm(core, z.reshape(*z.shape[:2], self.v_heads, self.value_dim))
        return self.out_proj(out.reshape(*out.shape[:2], -1).transpose(0, 1).contiguous())

    def _mix(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The conv and the delta rule over ``qkv`` ``[b, s, qkv_size]`` from a zero state -> ``[b, s, Hv, Dv]``."""
        from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule

        batch, seq, _ = qkv.shape
        weight = self.conv_weight
        conv = F.conv1d(qkv.transpose(1, 2).to(weight.dtype), weight, padding=weight.shape[-1] - 1,
                        groups=self.qkv_size)[..., :seq]
        conv = F.silu(conv).to(qkv.dtype).transpose(1, 2)
        kd = self.k_heads * self.key_dim
        q, k, v = torch.split(conv, [kd, kd, self.v_heads * self.value_dim], dim=-1)
        return gated_delta_rule(q.reshape(batch, seq, self.k_heads, self.key_dim),
                                k.reshape(batch, seq, self.k_heads, self.key_dim),
                                v.reshape(batch, seq, self.v_heads, self.value_dim), g, beta)

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        weight = copy_to_tensor_model_parallel_region(self.norm_weight, group=self.tp_group)
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((weight * normed) * F.silu(gate.float())).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default

        out = {}
        for name, child in self.named_children():
            out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
        own = {name: p for name, p in self._parameters.items()}
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, {"conv_weight": 0, "A_log": 0, "dt_bias": 0},
                                                       sharded_offsets))
        return out


def _token_layout(mask: torch.Tensor | None, batch: int, seq: int):
    """From megatron's ``[b, 1, s, s]`` mask (True = masked; None = plain causal): the real tokens ``[b, s]`` (None
    when all are) and each row's document starts after its first token (None when no row is packed)."""
    if mask is None:
        return None, None
    rows = mask[:, 0] if mask.dim() == 4 else mask
    if tuple(rows.shape[-2:]) != (seq, seq):
        raise ValueError(f"Gated DeltaNet: attention mask of shape {tuple(mask.shape)} for {seq} tokens.")
    real = ~rows.diagonal(dim1=-2, dim2=-1).expand(batch, seq)
    before = rows.diagonal(offset=-1, dim1=-2, dim2=-1).expand(batch, seq - 1)  # token t masked from t - 1
    cut = before & real[:, 1:] & real[:, :-1]
    starts = None
    if bool(cut.any()):
        starts = [(torch.nonzero(row).flatten() + 1).tolist() for row in cut]
    return (None if bool(real.all()) else real), starts


@functools.cache
def hybrid_self_attention(*, linear: frozenset[int], key_heads: int, value_heads: int, key_dim: int,
                          value_dim: int, conv_kernel: int, eps: float) -> type:
    """The self-attention slot's class: ``GatedDeltaNet`` on the layers in ``linear`` (0-based global indices),
    megatron's ``SelfAttention`` elsewhere."""
    from megatron.core.transformer.attention import SelfAttention

    class HybridSelfAttention:
        def __new__(cls, config, submodules=None, layer_number: int = 1, **kwargs):
            if layer_number - 1 in linear:
                return GatedDeltaNet(config, layer_number=layer_number, key_heads=key_heads, value_heads=value_heads,
                                     key_dim=key_dim, value_dim=value_dim, conv_kernel=conv_kernel, eps=eps,
                                     pg_collection=kwargs.get("pg_collection"))
            return SelfAttention(config, submodules, layer_number, **kwargs)

    return HybridSelfAttention
