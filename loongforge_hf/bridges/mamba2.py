"""The Mamba2 mixer (IBM Granite 4.0 H's ``mamba`` layers) as a megatron-style module in the self-attention slot, and
the slot's class that picks it or megatron's ``SelfAttention`` by layer.

Choices:
- Our own module, not megatron-core's ``ssm/mamba_mixer.py``: that one needs the mamba_ssm and causal_conv1d
  packages (CUDA only), has no padding mask, and belongs to megatron's ``MambaModel``, not ``GPTModel``'s layers.
- Tensor parallelism splits by heads and groups, as megatron's ``MambaMixer``: rank ``r`` holds heads
  ``r * H / tp ..`` and the ``n_groups / tp`` groups they read. One column-parallel ``in_proj`` holds this rank's
  rows of transformers' ``in_proj`` in each of its blocks, in order: ``z`` (the gate), ``x``, ``B``, ``C``, ``dt``
  (one all-gather of the tokens under sequence parallelism); the depthwise conv's channels (x, B, C) and its bias,
  ``A_log``, ``D``, ``dt_bias`` and the gated norm's weight are split with them (the norm runs over groups of
  ``d_inner / n_groups`` channels); ``out_proj`` is row-parallel.
- More TP ranks than groups (megatron's ``MambaMixer`` refuses them; the hub's Granite 4.0 H have one group): each
  group's B / C rows of ``in_proj`` and conv channels are replicated on the ``tp / n_groups`` ranks that hold its
  heads (x, z, dt still split), as KV heads are (``parallel/kv_replicas.py``: the rows marked by ``mark_rows``, their
  gradients summed over the replicas once per step and counted once in the gradient norm); the gated norm's mean
  square over a group's channels, now spread over those ranks, is their mean (``sum_over_replicas``: one small
  all-reduce a layer, forward and backward).
- Forward as transformers' ``GraniteMoeHybridMambaLayer`` without a cache (its torch path): padded tokens (the
  diagonal of megatron's ``[b, 1, s, s]`` mask: a token masked from itself) are zeroed before the conv (after
  ``in_proj``, which has no bias: the same) and after it; the causal depthwise conv with its bias
  (``kernels.causal_conv``, in the weight's dtype) and ``silu``; ``dt = clamp(softplus(dt + dt_bias),
  *time_step_limit)``, ``A = -exp(A_log)``; the chunked SSD scan (``kernels.ssd``, fp32, op for op transformers'
  ``mamba2_chunk_scan``); the gated RMSNorm (``y * silu(z)`` normalised per group in fp32, times the weight) and
  ``out_proj``.
- Falcon-H1's options (``falcon_h1.py``): ``in_proj_multipliers``, one factor per block of ``in_proj``'s output (z, x,
  B, C, dt: transformers' ``mup_vector``), multiplied in after ``in_proj`` (after LoRA's terms, before the padding is
  zeroed: the same, zeros stay zeros); ``rms_norm=False``: no norm, ``y * silu(z)`` (no ``norm_weight``);
  ``norm_before_gate``: ``FalconH1RMSNormGated``'s order, ``y`` normalised per group, times the weight (fp32), times
  ``silu(z)``.
- Packed documents (megatron's mask blocks attention between documents): the conv and the scan restart at each
  document's first token (the conv masks taps from another document; ``kernels.ssd`` masks the scan), as running
  each document alone. transformers' torch path runs a packed row as one sequence.
- Cached generate (``kv_cache.py``: one of transformers' ``LinearAttentionLayer`` per Mamba2 layer of the rank,
  after the attentions' layers; a ``CachedStep`` per step, as Gated DeltaNet's): the step's first ``given`` tokens
  (the layout's padding after them never enters a state; its outputs are zero), those transformers' 2-D mask marks
  as padding zeroed (before and after the conv, as without the cache: from the zero state they change neither state);
  the conv after the conv state (the last ``conv_kernel`` inputs, transformers' layout); the scan from the SSM state
  (fp32 ``[b, heads, head_dim, d_state]``, this rank's heads): a one-token step by ``kernels.ssd.ssd_step`` with
  ``dt`` not clamped by ``time_step_limit`` (as transformers' and mamba_ssm's one-token step), a longer one (the
  prefill) by the chunked scan with ``initial_state``. Beam search reorders the states with the cache.
- Context parallelism (megatron's load-balanced chunks: the inputs, the mask's rows ``[b, 1, s_local, s]``): the
  layer runs its own tokens and passes the conv's tail and the SSM state between the chunks over the CP group
  (``parallel/ssd_cp.py``: each chunk's scan as an affine map of its incoming state, a per-head decay and a state,
  all-gathered and scanned), the same outputs and gradients as one run over the whole sequence; padding and packed
  documents as above. The group is megatron's, read at each forward (``context_parallel.cp_group_and_size``).
  Cached steps never run under CP (generate's cached steps run whole on every rank; its split prefill cannot carry
  the states and is refused by ``kv_cache.patched``): generate under CP runs without the cache.
- Refused, before any collective (``mamba2_layers.py``: Granite 4.0 H, Bamba, Nemotron-H, Falcon-H1): heads that do
  not split over TP, groups that neither split over TP nor divide it, projection biases, the static cache; at the
  forward: megatron's ``inference_context`` and THD ``packed_seq_params``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.recurrent_common import (CachedStep, _token_layout, mixer_on_layers, mixer_projections,
                                                    tp_group_of)
from loongforge_hf.kernels.causal_conv import causal_conv
from loongforge_hf.parallel.context_parallel import cp_group_and_size
from loongforge_hf.parallel.ssd_cp import context_parallel_scan


class Mamba2Mixer(torch.nn.Module):
    """One Mamba2 layer's token mixer, this TP rank's heads and groups (see the module docstring)."""

    def __init__(self, config, *, layer_number: int, heads: int, head_dim: int, groups: int, d_state: int,
                 conv_kernel: int, conv_bias: bool, chunk_size: int, time_step_limit: tuple[float, float],
                 eps: float, rms_norm: bool = True, norm_before_gate: bool = False,
                 in_proj_multipliers: tuple[float, ...] | None = None, pg_collection=None, **_: object) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from loongforge_hf.parallel import tp_sections
        from loongforge_hf.parallel.kv_replicas import mark_rows, replicas_of
        from loongforge_hf.xpu import get_backend

        super().__init__()
        self.config, self.layer_number = config, layer_number
        tp_group = tp_group_of(pg_collection)
        tp = config.tensor_model_parallel_size
        self.tp_group, self.tp_rank = tp_group, (tp_group.rank() if tp > 1 else 0)
        # NOTE: one group replicated on tp / groups ranks where TP exceeds the groups (parallel/kv_replicas.py)
        self.heads, self.head_dim, self.groups, self.d_state = heads // tp, head_dim, max(1, groups // tp), d_state
        self.all_groups = groups
        self.chunk_size, self.time_step_limit, self.eps = chunk_size, time_step_limit, eps
        self.rms_norm, self.norm_before_gate = rms_norm, norm_before_gate
        self.d_inner = self.heads * head_dim
        self.conv_dim = self.d_inner + 2 * self.groups * d_state
        local = self.d_inner + self.conv_dim + self.heads
        self.in_proj, self.out_proj = mixer_projections(config, in_size=local * tp, out_size=heads * head_dim,
                                                        tp_group=tp_group)
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        kw = dict(dtype=config.params_dtype, device=device)
        self.conv_weight = torch.nn.Parameter(torch.zeros(self.conv_dim, 1, conv_kernel, **kw))
        self.conv_bias = torch.nn.Parameter(torch.zeros(self.conv_dim, **kw)) if conv_bias else None
        self.A_log = torch.nn.Parameter(torch.zeros(self.heads, **kw))
        self.D = torch.nn.Parameter(torch.ones(self.heads, **kw))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.heads, **kw))
        self.norm_weight = torch.nn.Parameter(torch.ones(self.d_inner, **kw)) if rms_norm else None
        self.register_buffer("in_proj_scale", None if in_proj_multipliers is None else self._section_scale(
            in_proj_multipliers, **kw), persistent=False)
        for p in self._split_parameters().values():
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        bc = 2 * self.groups * d_state  # NOTE: the B / C rows, replicas where TP exceeds the groups
        for p, start in ((self.in_proj.weight, 2 * self.d_inner), (self.conv_weight, self.d_inner),
                         (self.conv_bias, self.d_inner)):
            if p is not None:
                mark_rows(p, (start, start + bc), groups=groups, tp_rank=self.tp_rank, tp_size=tp)
        r, b = replicas_of(groups, tp), self.groups * d_state
        tp_sections.declare(self.in_proj.weight, (self.d_inner, self.d_inner, b, b, self.heads),
                            replicas=(1, 1, r, r, 1))
        for p in (self.conv_weight, self.conv_bias):
            if p is not None:
                tp_sections.declare(p, (self.d_inner, b, b), replicas=(1, r, r))

    def _section_scale(self, multipliers: tuple[float, ...], **kw) -> torch.Tensor:
        """``in_proj``'s local output ``[z, x, B, C, dt]``: each block's multiplier, one per row."""
        sizes = (self.d_inner, self.d_inner, self.groups * self.d_state, self.groups * self.d_state, self.heads)
        return torch.cat([torch.full((n,), float(m), **kw) for n, m in zip(sizes, multipliers, strict=True)])

    def _split_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self._parameters.items() if p is not None}

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                inference_context=None, packed_seq_params=None, cached: CachedStep | None = None, **_: object):
        from loongforge_hf.kernels.ssd import ssd_scan
        from loongforge_hf.kv_cache import refuse_megatron_state_inputs

        refuse_megatron_state_inputs("Mamba2", inference_context, packed_seq_params)
        mixed, _ = self.in_proj(hidden_states)                            # [s, b, local]: all tokens
        if self.in_proj_scale is not None:
            mixed = mixed * self.in_proj_scale
        mixed = mixed.transpose(0, 1)                                     # [b, s, local]
        if cached is not None:
            return self._cached_forward(mixed, cached)
        batch, seq, _ = mixed.shape
        group, cp, _ = cp_group_and_size()
        real, starts = _token_layout(attention_mask, batch, seq, group=group)
        z, xbc, dt = self._split(mixed, real)
        if cp > 1:  # NOTE: this rank's two load-balanced chunks, states passed over the CP group
            y = context_parallel_scan(self, xbc, dt, real=real, group=group, starts=starts)
        else:
            documents = None if starts is None else _documents(starts, batch, seq, mixed.device)
            x, B, C = self.conv_heads(xbc, real, documents=documents)
            y = ssd_scan(x, self.time_steps(dt), -torch.exp(self.A_log.float()), B, C, chunk_size=self.chunk_size,
                         D=self.D, documents=documents)
        return self._output(y.reshape(batch, seq, -1), z, padded=seq)

    def _cached_forward(self, mixed: torch.Tensor, step: CachedStep):
        """A cached generate step (see the module docstring): ``mixed`` ``[b, s, local]``, ``in_proj``'s output of
        the step's first ``step.given`` tokens and the layout's padding after them."""
        from loongforge_hf.kernels.ssd import ssd_scan, ssd_step

        z, xbc, dt = self._split(mixed[:, :step.given], step.real)
        cache, index, A = step.cache, step.index, -torch.exp(self.A_log.float())
        history, state = cache.get_conv_state(index), cache.get_recurrent_state(index)
        x, B, C = self.conv_heads(xbc, step.real, history=None if history is None else history[..., 1:])
        # NOTE: after the conv read it: the cache writes the state in place
        cache.update_conv_state(xbc.transpose(1, 2), index, conv_kernel_size=self.conv_weight.shape[-1])
        if state is not None and step.given == 1:  # NOTE: as transformers' one-token step: no time-step limit
            y, state = ssd_step(state, x[:, 0], F.softplus(dt[:, 0] + self.dt_bias.to(dt.dtype)), A, B[:, 0],
                                C[:, 0], D=self.D)
            y = y[:, None]
        else:
            y, state = ssd_scan(x, self.time_steps(dt), A, B, C, chunk_size=self.chunk_size, D=self.D,
                                initial_state=state, output_final_state=True)
        cache.update_recurrent_state(state, index)
        return self._output(y.reshape(*y.shape[:2], -1), z, padded=mixed.shape[1])

    def _split(self, mixed: torch.Tensor, real: torch.Tensor | None):
        """``in_proj``'s output ``[b, s, local]``, the tokens where ``real`` ``[b, s]`` is False zeroed (None: none)
        -> the gate ``z``, the conv's input ``xbc``, the raw time steps ``dt``."""
        if real is not None:
            mixed = mixed * real[..., None].to(mixed.dtype)
        return torch.split(mixed, [self.d_inner, self.conv_dim, self.heads], dim=-1)

    def conv_heads(self, xbc: torch.Tensor, real: torch.Tensor | None, *, documents: torch.Tensor | None = None,
                   history: torch.Tensor | None = None):
        """The conv (``_conv``) over ``xbc`` ``[b, s, conv_dim]``, padded tokens (``real`` False) zeroed again -> x
        ``[b, s, heads, head_dim]``, B, C ``[b, s, groups, d_state]``."""
        xbc = self._conv(xbc, documents, history=history)
        if real is not None:
            xbc = xbc * real[..., None].to(xbc.dtype)
        batch, seq, _ = xbc.shape
        x, B, C = torch.split(xbc, [self.d_inner, self.groups * self.d_state, self.groups * self.d_state], dim=-1)
        groups = (batch, seq, self.groups, self.d_state)
        return x.reshape(batch, seq, self.heads, self.head_dim), B.reshape(groups), C.reshape(groups)

    def time_steps(self, dt: torch.Tensor) -> torch.Tensor:
        return F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(*self.time_step_limit)

    def _output(self, y: torch.Tensor, z: torch.Tensor, *, padded: int):
        """The scan's output ``[b, given, d_inner]`` through the gated norm and ``out_proj``, zeros for the layout's
        padding up to ``padded`` tokens."""
        out = self._gated_norm(y, z).to(z.dtype)
        if padded > out.shape[1]:
            out = F.pad(out, (0, 0, 0, padded - out.shape[1]))
        return self.out_proj(out.transpose(0, 1).contiguous())

    def _conv(self, xbc: torch.Tensor, documents: torch.Tensor | None, *,
              history: torch.Tensor | None = None) -> torch.Tensor:
        """``kernels.causal_conv`` (in the weight's dtype, after ``history``, documents restarting it) and ``silu``
        over ``xbc`` ``[b, s, ch]`` -> ``[b, s, ch]`` in ``xbc``'s dtype."""
        conv = causal_conv(xbc, self.conv_weight, self.conv_bias, history=history, documents=documents)
        return F.silu(conv).to(xbc.dtype)

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """transformers' ``GraniteMoeHybridRMSNormGated``: ``y * silu(gate)`` normalised per group (fp32), times the
        weight; without ``rms_norm`` ``y * silu(gate)``; with ``norm_before_gate`` (Falcon-H1) ``y`` normalised, times
        the weight, times ``silu(gate)`` in fp32."""
        from loongforge_hf.parallel.kv_replicas import replicas_of, sum_over_replicas

        if not self.rms_norm:
            return y * F.silu(gate)
        h = y.float() if self.norm_before_gate else y.float() * F.silu(gate.float())
        h = h.reshape(*h.shape[:-1], self.groups, -1)
        square = h.pow(2).mean(-1, keepdim=True)
        tp = self.config.tensor_model_parallel_size
        replicas = replicas_of(self.all_groups, tp)
        if replicas > 1:  # NOTE: the group's channels spread over its replicas' ranks: the mean of theirs
            square = sum_over_replicas(square, groups=self.all_groups, tp_rank=self.tp_rank, tp_size=tp,
                                       tp_group=self.tp_group) / replicas
        h = (h * torch.rsqrt(square + self.eps)).reshape(*y.shape)
        if self.norm_before_gate:
            return self.norm_weight * h * F.silu(gate.float())
        return self.norm_weight * h.to(y.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from loongforge_hf.bridges.recurrent_common import mixer_sharded_state_dict

        return mixer_sharded_state_dict(self, prefix, sharded_offsets, metadata, self._split_parameters())


def _documents(starts: list[list[int]], batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Each row's document ids ``[b, s]`` (0, 1, ...) from the starts after its first token."""
    first = torch.zeros(batch, seq, dtype=torch.long)
    for row, cuts in enumerate(starts):
        first[row, cuts] = 1
    return first.cumsum(-1).to(device)


@functools.cache
def hybrid_mamba_attention(*, mamba: frozenset[int], **dims) -> type:
    """The self-attention slot's class: ``Mamba2Mixer`` (with ``dims``) on the layers in ``mamba`` (0-based global
    indices; megatron numbers layers from 1, offset by the pipeline stage), megatron's ``SelfAttention`` elsewhere."""
    from megatron.core.transformer.attention import SelfAttention

    return mixer_on_layers(mamba, Mamba2Mixer, SelfAttention, **dims)
