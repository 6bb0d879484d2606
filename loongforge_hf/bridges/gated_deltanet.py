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
  (in the weight's dtype), L2-normalised q / k, ``beta = sigmoid(b)`` (times ``beta_scale``: OLMo Hybrid's 2),
  ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32, the gated delta rule (``kernels.gated_delta_rule``; fla's
  kernels through ``kernels.fla_delta_rule`` where that module says, for more than one token), the gated RMSNorm
  (``weight * norm(x)`` in the input's dtype times ``silu(z)`` in fp32, rounded once) and ``out_proj``.
- Packed documents (megatron's mask blocks attention between documents): the conv and the recurrence restart at each
  document's start (a token masked from the one before it while both are real), all rows and documents in one call
  each: the conv over the documents laid out after ``conv_kernel - 1`` zero slots each
  (``kernels.gated_delta_rule.document_slots``), the rule through ``gated_delta_rule_packed`` or fla's varlen kernel.
  transformers' torch fallback runs a packed row as one sequence; its fla kernels restart per document as here.
- Context parallelism (megatron's load-balanced chunks: the inputs, the mask's rows ``[b, 1, s_local, s]``): the
  layer runs its own tokens and passes the conv's tail and the recurrent state between the chunks over the CP group
  (``parallel/delta_rule_cp.py``: the rule as an affine map of the incoming state, all-gathered and scanned), the
  same outputs and gradients as one run over the whole sequence; padding and packed documents as above. The group
  is megatron's, read at each forward (``context_parallel.cp_group_and_size``, as the runtime that split the
  inputs). Cached steps never run under CP (generate's cached steps run whole on every rank; its split prefill
  cannot carry the states and is refused by ``kv_cache.patched``).
- Cached generate (``kv_cache.py``: its ``LoongKVCache`` holds one of transformers' ``LinearAttentionLayer`` per
  Gated DeltaNet of the rank, after the attentions' layers, as transformers' dynamic cache for Qwen3.5 holds them):
  during a cached step the cache gives each layer a ``CachedStep`` (an instance ``forward``, as it does the core
  attentions). The layer runs the step's first ``given`` new tokens (the layout's padding after them never enters
  a state; its outputs are zero), zeroes those that transformers' 2-D mask marks as padding (a left-padded prompt:
  from the zero state they change neither state, as in transformers), convolves them after the conv state (the
  last ``conv_kernel - 1`` inputs, zero before the first) and runs the delta rule from the recurrent state (fp32,
  ``[b, v_heads, k_dim, v_dim]``: this rank's heads), keeping both new states. Beam search reorders them with the
  cache (transformers' ``reorder_cache``). megatron's ``inference_context`` and THD ``packed_seq_params`` are
  refused.
- ``hybrid_self_attention(linear=...)`` is the layer spec's self-attention class: ``GatedDeltaNet`` (or the bridge's
  ``mixer``: ``kimi_delta_attention.KimiDeltaAttention``) for the 0-based global layer indices in ``linear``
  (megatron numbers layers from 1, offset by the pipeline stage), megatron's ``SelfAttention`` (or the bridge's
  ``attention`` class: OLMo Hybrid's post-normed one, Kimi Linear's ``MLASelfAttention``) for the others.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.recurrent_common import CachedStep, _cu_seqlens, _token_layout, mixer_projections
from loongforge_hf.parallel import tp_sections
from loongforge_hf.parallel.context_parallel import cp_group_and_size
from loongforge_hf.parallel.delta_rule_cp import context_parallel_mix


class GatedDeltaNet(torch.nn.Module):
    """One linear-attention layer's token mixer, this TP rank's heads (see the module docstring)."""

    def __init__(self, config, *, layer_number: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                 conv_kernel: int, eps: float, beta_scale: float = 1.0, pg_collection=None, **_: object) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from loongforge_hf.xpu import get_backend

        super().__init__()
        self.config, self.layer_number = config, layer_number
        tp_group, tp = getattr(pg_collection, "tp", None), config.tensor_model_parallel_size
        self.k_heads, self.v_heads, self.eps, self.tp_group = key_heads // tp, value_heads // tp, eps, tp_group
        self.key_dim, self.value_dim, self.beta_scale = key_dim, value_dim, beta_scale
        self.qkv_size = 2 * self.k_heads * key_dim + self.v_heads * value_dim
        local = self._in_proj_rows()
        self.in_proj, self.out_proj = mixer_projections(config, in_size=local * tp, out_size=value_heads * value_dim,
                                                        tp_group=tp_group)
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        kw = dict(dtype=config.params_dtype, device=device)
        self.conv_weight = torch.nn.Parameter(torch.zeros(self.qkv_size, 1, conv_kernel, **kw))
        self.A_log = torch.nn.Parameter(torch.zeros(self.v_heads, **kw))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.v_heads, **kw))
        self.norm_weight = torch.nn.Parameter(torch.ones(value_dim, **kw))
        for p in (self.conv_weight, self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        qk = self.k_heads * key_dim
        tp_sections.declare(self.in_proj.weight, self._in_proj_sections())
        tp_sections.declare(self.conv_weight, (qk, qk, self.v_heads * value_dim))

    def _in_proj_sections(self) -> tuple[int, ...]:
        """This rank's rows of ``in_proj`` (``parallel/tp_sections.py``): q, k, v, z, b, a."""
        qk, v = self.k_heads * self.key_dim, self.v_heads * self.value_dim
        return qk, qk, v, v, self.v_heads, self.v_heads

    def _in_proj_rows(self) -> int:
        return sum(self._in_proj_sections())

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                inference_context=None, packed_seq_params=None, cached: CachedStep | None = None, **_: object):
        from loongforge_hf.kv_cache import refuse_megatron_state_inputs

        refuse_megatron_state_inputs("Gated DeltaNet", inference_context, packed_seq_params)
        if cached is not None:
            return self._cached_forward(hidden_states, cached)
        mixed = self._project(hidden_states)                              # [s, b, local]: all tokens
        mixed = mixed.transpose(0, 1)                                     # [b, s, local]
        group, cp, _ = cp_group_and_size()
        real, starts = _token_layout(attention_mask, mixed.shape[0], mixed.shape[1], group=group)
        qkv, z, beta, g = self._split(mixed, real)
        if cp > 1:  # NOTE: this rank's two load-balanced chunks, states passed over the CP group
            core = context_parallel_mix(self, qkv, g, beta, group=group, starts=starts)
        elif starts is None:
            core = self._mix(qkv, g, beta)
        else:
            core = self._mix_packed(qkv, g, beta, [[0, *cuts, qkv.shape[1]] for cuts in starts])
        out = self._gated_norm(core, z)
        return self.out_proj(out.reshape(*out.shape[:2], -1).transpose(0, 1).contiguous())

    def _project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` (this rank's share under sequence parallelism) -> ``[s, b, local]`` for ``_split``."""
        return self.in_proj(hidden_states)[0]

    def _split(self, mixed: torch.Tensor, real: torch.Tensor | None):
        """``in_proj``'s output ``[b, s, local]`` with the tokens where ``real`` ``[b, s]`` is False zeroed (None:
        none) -> ``qkv`` ``[b, s, qkv_size]``, the gate ``z`` ``[b, s, Hv, Dv]``, ``beta`` and ``g`` (fp32)."""
        if real is not None:
            mixed = mixed * real[..., None].to(mixed.dtype)
        qkv, z, b, a = torch.split(mixed, [self.qkv_size, self.v_heads * self.value_dim, *(self.v_heads,) * 2], -1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        beta = b.sigmoid() if self.beta_scale == 1.0 else b.sigmoid() * self.beta_scale
        return qkv, z.reshape(*z.shape[:2], self.v_heads, self.value_dim), beta, g

    def _cached_forward(self, hidden_states: torch.Tensor, step: CachedStep):
        """A cached generate step (see the module docstring): ``hidden_states`` ``[s, b, h]`` (this rank's slice
        under sequence parallelism), of which the first ``step.given`` tokens are the step's."""
        mixed = self._project(hidden_states)  # NOTE: [s, b, local]: the layout's padding after the step's tokens
        qkv, z, beta, g = self._split(mixed.transpose(0, 1)[:, :step.given], step.real)  # NOTE: [b, given, ...]
        cache, index = step.cache, step.index
        core, state = self._mix(qkv, g, beta, history=cache.get_conv_state(index),
                                state=cache.get_recurrent_state(index), cached=True)
        cache.update_conv_state(qkv.transpose(1, 2), index, conv_kernel_size=self.conv_weight.shape[-1] - 1)
        cache.update_recurrent_state(state, index)
        out = self._gated_norm(core, z)
        out = F.pad(out.reshape(*out.shape[:2], -1), (0, 0, 0, mixed.shape[0] - step.given))  # NOTE: that padding
        return self.out_proj(out.transpose(0, 1).contiguous())

    def _mix(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, history: torch.Tensor | None = None,
             state: torch.Tensor | None = None, cached: bool = False):
        """The conv and the delta rule over ``qkv`` ``[b, s, qkv_size]`` -> ``[b, s, Hv, Dv]``. Uncached (zero
        states): the output only. Cached: the conv after ``history`` (its last ``conv_kernel - 1`` inputs
        ``[b, qkv_size, conv_kernel - 1]``) and the rule from ``state``, each None for zero; (output, final state)."""
        from loongforge_hf.kernels import fla_delta_rule
        from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule

        q, k, v = self.conv_heads(qkv, history)
        rule = gated_delta_rule
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, g, beta))
        if qkv.shape[1] > 1 and fla_delta_rule.available(qkv.device, backward=needs_grad, per_channel=g.dim() == 4):
            rule = fla_delta_rule.gated_delta_rule_rows
        return rule(q, k, v, g, beta, initial_state=state, output_final_state=cached)

    def _mix_packed(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, bounds: list[list[int]]):
        """``_mix`` over rows packing documents (``bounds``: each row's ``[0, .., seq]``), each document from zero
        states, in one call each: the conv over the documents laid out after ``conv_kernel - 1`` zero slots each, the
        delta rule over all rows and documents."""
        from loongforge_hf.kernels import fla_delta_rule
        from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule_packed

        batch, seq, _ = qkv.shape
        q, k, v = self.packed_conv_heads(qkv, bounds)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, g, beta))
        if not fla_delta_rule.available(qkv.device, backward=needs_grad, per_channel=g.dim() == 4):
            return gated_delta_rule_packed(q, k, v, g, beta, bounds)
        cu = _cu_seqlens(tuple(map(tuple, bounds)), seq, qkv.device)
        flat = [x.reshape(1, batch * seq, *x.shape[2:]) for x in (q, k, v, g, beta)]
        return fla_delta_rule.gated_delta_rule_varlen(*flat, cu_seqlens=cu)[0].reshape(*v.shape)

    def packed_conv_heads(self, qkv: torch.Tensor, bounds: list[list[int]], history: torch.Tensor | None = None):
        """``conv_heads`` over rows packing documents (``bounds``: each row's ``[0, .., seq]``) in one call: each
        document laid out after ``conv_kernel - 1`` zero inputs, a row's first after its ``history`` instead (None:
        zeros)."""
        from loongforge_hf.kernels.gated_delta_rule import document_slots

        batch, seq, width = qkv.shape
        weight, gap = self.conv_weight, self.conv_weight.shape[-1] - 1
        slots, places, _ = document_slots(tuple(map(tuple, bounds)), seq, qkv.device, lead=gap)
        table = [qkv.reshape(-1, width), qkv.new_zeros(1, width)]  # NOTE: the tokens, the zero, the histories
        if history is not None:
            lead = (places[::seq, None] - gap + torch.arange(gap, device=qkv.device)).flatten()
            slots = slots.index_put((lead,), torch.arange(batch * gap, device=qkv.device) + batch * seq + 1)
            table.append(history.transpose(1, 2).reshape(-1, width).to(qkv.dtype))
        inputs = torch.cat(table)[slots].t().to(weight.dtype)[None]
        conv = F.silu(F.conv1d(inputs, weight, groups=self.qkv_size))[0].t()[places - gap]
        return self._heads(conv.to(qkv.dtype).reshape(batch, seq, width))

    def conv_heads(self, qkv: torch.Tensor, history: torch.Tensor | None = None):
        """The causal depthwise conv (``silu``, in the weight's dtype) over ``qkv`` ``[b, s, qkv_size]`` after
        ``history`` (``[b, qkv_size, conv_kernel - 1]``; None: zeros) -> q, k ``[b, s, Hk, Dk]``, v ``[b, s, Hv, Dv]``
        in ``qkv``'s dtype."""
        weight = self.conv_weight
        inputs = qkv.transpose(1, 2).to(weight.dtype)
        inputs = F.pad(inputs, (weight.shape[-1] - 1, 0)) if history is None \
            else torch.cat((history.to(weight.dtype), inputs), dim=-1)
        return self._heads(F.silu(F.conv1d(inputs, weight, groups=self.qkv_size)).to(qkv.dtype).transpose(1, 2))

    def _heads(self, conv: torch.Tensor):
        """The conv's output ``[b, s, qkv_size]`` -> q, k ``[b, s, Hk, Dk]``, v ``[b, s, Hv, Dv]``."""
        batch, seq, _ = conv.shape
        kd = self.k_heads * self.key_dim
        q, k, v = torch.split(conv, [kd, kd, self.v_heads * self.value_dim], dim=-1)
        heads = (batch, seq, self.k_heads, self.key_dim)
        return q.reshape(heads), k.reshape(heads), v.reshape(batch, seq, self.v_heads, self.value_dim)

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        weight = copy_to_tensor_model_parallel_region(self.norm_weight, group=self.tp_group)
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((weight * normed) * F.silu(gate.float())).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from loongforge_hf.bridges.recurrent_common import mixer_sharded_state_dict

        own = dict(self._parameters)
        split = {name: 0 for name, p in own.items() if getattr(p, "tensor_model_parallel", False)}
        return mixer_sharded_state_dict(self, prefix, sharded_offsets, metadata, own, split)


@functools.cache
def hybrid_self_attention(*, linear: frozenset[int], key_heads: int, value_heads: int, key_dim: int,
                          value_dim: int, conv_kernel: int, eps: float, beta_scale: float = 1.0,
                          attention: type | None = None, mixer: type | None = None) -> type:
    """The self-attention slot's class: ``mixer`` (default: ``GatedDeltaNet``) on the layers in ``linear`` (0-based
    global indices), ``attention`` (default: megatron's ``SelfAttention``) elsewhere."""
    from megatron.core.transformer.attention import SelfAttention

    class HybridSelfAttention:
        def __new__(cls, config, submodules=None, layer_number: int = 1, **kwargs):
            if layer_number - 1 in linear:
                return (mixer or GatedDeltaNet)(
                    config, layer_number=layer_number, key_heads=key_heads, value_heads=value_heads, key_dim=key_dim,
                    value_dim=value_dim, conv_kernel=conv_kernel, eps=eps, beta_scale=beta_scale,
                    pg_collection=kwargs.get("pg_collection"))
            return (attention or SelfAttention)(config, submodules, layer_number, **kwargs)

    return HybridSelfAttention
