"""Kimi Delta Attention (Kimi Linear's KDA, transformers' ``KimiLinearDeltaAttention``):
``gated_deltanet.GatedDeltaNet`` with three changes, the rest (TP by heads, padding, packed documents, CP, cached
steps, refusals) as there.

Choices:
- a per-channel decay: ``g = -exp(A_log[head]) * softplus(f_b(f_a(x)) + dt_bias)`` ``[b, s, heads, head_dim]``
  (fp32; ``kernels.gated_delta_rule``'s per-channel form, or fla's ``chunk_kda`` on CUDA where
  ``kernels.fla_delta_rule`` says);
- the output gate ``g_b(g_a(x))`` through ``sigmoid`` in the gated norm, all in fp32 and rounded once
  (``KimiLinearRMSNormGated``), eps ``rms_norm_eps``;
- ``in_proj`` holds this rank's q, k, v and b rows; the low-rank down projections ``f_a`` / ``g_a`` (``[head_dim,
  hidden]``) are replicated and run on the whole sequence (one more all-gather of the tokens under sequence
  parallelism, whose backward reduce-scatters), their weights entering through
  ``copy_to_tensor_model_parallel_region`` (the ranks' partial grads summed, as ``norm_weight``'s); ``f_b`` /
  ``g_b`` and ``dt_bias`` are split with the heads. LoRA on the four (transformers' linears) through
  ``own_weights.adapted``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.gated_deltanet import GatedDeltaNet
from loongforge_hf.bridges.own_weights import adapted


class KimiDeltaAttention(GatedDeltaNet):
    """Kimi Delta Attention (Kimi Linear): ``GatedDeltaNet`` with a per-channel decay from a low-rank forget gate and a
    low-rank sigmoid output gate (see the module docstring); key and value heads are the same heads."""

    # NOTE: transformers' f_a_proj / g_a_proj (replicated) and f_b_proj / g_b_proj (split with the heads) linears,
    # which LoRA adapts (lora/own_weights.py)
    lora_own_weights = {"f_a_weight": "replicated", "g_a_weight": "replicated", "f_b_weight": "column",
                        "g_b_weight": "column"}

    def __init__(self, config, **kwargs) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__(config, **kwargs)
        rank, h, local = self.key_dim, config.hidden_size, self.k_heads * self.key_dim
        kw = dict(dtype=config.params_dtype, device=self.A_log.device)
        self.dt_bias = torch.nn.Parameter(torch.zeros(local, **kw))
        self.f_a_weight = torch.nn.Parameter(torch.zeros(rank, h, **kw))
        self.g_a_weight = torch.nn.Parameter(torch.zeros(rank, h, **kw))
        self.f_b_weight = torch.nn.Parameter(torch.zeros(local, rank, **kw))
        self.g_b_weight = torch.nn.Parameter(torch.zeros(local, rank, **kw))
        for p in (self.dt_bias, self.f_b_weight, self.g_b_weight):
            set_tensor_model_parallel_attributes(p, True, 0, 1)

    def _in_proj_sections(self) -> tuple[int, ...]:
        """This rank's rows of ``in_proj``: q, k, v, b."""
        qk = self.k_heads * self.key_dim
        return qk, qk, self.v_heads * self.value_dim, self.v_heads

    def _project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``in_proj``'s rows, then this rank's heads of the forget gate's ``f_b(f_a(x))`` and the output gate's
        ``g_b(g_a(x))``, the down projections replicated over the whole sequence."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)

        group = self.tp_group
        full = gather_from_sequence_parallel_region(hidden_states, group=group) if self.config.sequence_parallel \
            else copy_to_tensor_model_parallel_region(hidden_states, group=group)
        down = copy_to_tensor_model_parallel_region(torch.cat((self.f_a_weight, self.g_a_weight)), group=group)
        forget, gate = F.linear(full, down).chunk(2, dim=-1)
        forget, gate = adapted(self, "f_a_weight", full, forget), adapted(self, "g_a_weight", full, gate)
        return torch.cat((self.in_proj(hidden_states)[0], adapted(self, "f_b_weight", forget, F.linear(
            forget, self.f_b_weight)), adapted(self, "g_b_weight", gate, F.linear(gate, self.g_b_weight))), dim=-1)

    def _split(self, mixed: torch.Tensor, real: torch.Tensor | None):
        """As ``GatedDeltaNet._split``; ``g`` per key channel ``[b, s, heads, head_dim]``, the gate before its
        sigmoid."""
        if real is not None:
            mixed = mixed * real[..., None].to(mixed.dtype)
        local = self.k_heads * self.key_dim
        qkv, b, f, gate = torch.split(mixed, [self.qkv_size, self.v_heads, local, local], -1)
        f = (f.float() + self.dt_bias.float()).reshape(*f.shape[:2], self.k_heads, self.key_dim)
        g = -self.A_log.float().exp()[:, None] * F.softplus(f)
        return qkv, gate.reshape(*gate.shape[:2], self.v_heads, self.value_dim), b.sigmoid(), g

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        weight = copy_to_tensor_model_parallel_region(self.norm_weight, group=self.tp_group)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)
