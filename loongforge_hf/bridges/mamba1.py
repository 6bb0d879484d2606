"""The Mamba-1 mixer (state-spaces' Mamba, TII's Falcon-Mamba) as a megatron-style module in the self-attention
slot.

Choices:
- Our own module (megatron-core has no Mamba-1 mixer): ``in_proj`` (x and the gate z), the causal depthwise conv and
  ``silu``, ``x_proj`` (the time-step rank's ``dt`` and the state's ``B`` / ``C`` from x), ``dt_proj`` (with its
  bias), ``A_log``, ``D``, the selective scan (``kernels.selective_scan``: transformers' sequential path op for op)
  gated by ``silu(z)``, ``out_proj``.
- Tensor parallelism splits ``d_inner`` (``intermediate_size``) as megatron's ``MambaMixer`` splits Mamba2's:
  ``in_proj`` column-parallel (this rank's rows of x and of z: one all-gather of the tokens under sequence
  parallelism), the conv's channels and bias, ``dt_proj``'s rows and bias, ``A_log``'s and ``D``'s rows with them;
  ``x_proj`` reads every channel: each rank's columns give a partial ``[dt, B, C]``, summed over TP (forward) and
  its gradient summed over TP again (backward: each rank's channels use the sum); ``out_proj`` row-parallel.
- Falcon-Mamba (``rms_eps``): weightless RMS norms over ``dt`` (the time-step rank), ``B`` and ``C`` after
  ``x_proj`` (the sum: replicated on every TP rank); Jamba's (``norm_weights``) with weights, replicated: each
  rank's channels read the norms' output, whose gradient is summed over TP before the norms' backward.
- Padding and packed documents as our Mamba2 mixer (``mamba2.py``): padded tokens zeroed before ``in_proj`` (no
  bias: after it is the same) and after the conv, as transformers' torch path; packed documents restart the conv and
  the scan.
- Cached generate (``kv_cache.py``: a ``CachedStep`` per step, one ``LinearAttentionLayer`` per layer): the conv
  after the conv state (the last ``conv_kernel`` inputs), the scan from the SSM state (fp32 ``[b, d_inner / tp,
  state_size]``: this rank's channels), the step's first ``given`` tokens only; transformers' mask's padding zeroed
  as without the cache.
- Context parallelism (megatron's load-balanced chunks: the inputs, the mask's rows ``[b, 1, s_local, s]``): the
  layer runs its own tokens, the conv after its halo (``recurrent_cp.conv_chunks``), the selective scan's states
  passed between the chunks over the CP group (``parallel/linear_scan_cp.py``: each chunk's scan as an affine map of
  its incoming state, all-gathered and folded), the same outputs and gradients as one run over the whole sequence;
  padding and packed documents as above. The group is megatron's, read at each forward
  (``context_parallel.cp_group_and_size``); cached steps never run under CP (generate under CP runs without the cache).
- LoRA on ``x_proj`` (PEFT adapts transformers' linear): its product goes through ``own_weights.adapted``, the
  adapter's A split by channel as the weight, its term among the partial products summed over TP. Not ``dt_proj``:
  transformers' mixers read ``dt_proj.weight`` themselves, so PEFT's adapter there never acts (refused by name).
- Refused (``mamba1_layers.py``, before any collective): ``intermediate_size`` that does not split over TP,
  projection biases; at the forward: megatron's ``inference_context`` and THD ``packed_seq_params``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.own_weights import adapted
from loongforge_hf.bridges.recurrent_common import (CachedStep, _token_layout, mixer_on_layers, mixer_projections,
                                                    tp_group_of)
from loongforge_hf.kernels.causal_conv import causal_conv
from loongforge_hf.parallel import tp_sections
from loongforge_hf.parallel.context_parallel import cp_group_and_size

NORMS = ("dt_norm_weight", "b_norm_weight", "c_norm_weight")  # NOTE: Jamba's, replicated over TP


class MambaMixer(torch.nn.Module):
    """One Mamba-1 layer's token mixer, this TP rank's ``d_inner / tp`` channels (see the module docstring)."""

    lora_own_weights = {"x_proj_weight": "row"}  # NOTE: transformers' x_proj linear, which LoRA adapts (own_weights.py)

    def __init__(self, config, *, layer_number: int, d_inner: int, d_state: int, dt_rank: int, conv_kernel: int,
                 conv_bias: bool, rms_eps: float | None = None, norm_weights: bool = False, pg_collection=None,
                 **_: object) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from loongforge_hf.xpu import get_backend

        super().__init__()
        self.config, self.layer_number = config, layer_number
        tp_group = tp_group_of(pg_collection)
        tp = config.tensor_model_parallel_size
        self.tp_group, self.tp = tp_group, tp
        self.d_inner, self.d_state, self.dt_rank, self.rms_eps = d_inner // tp, d_state, dt_rank, rms_eps
        self.in_proj, self.out_proj = mixer_projections(config, in_size=2 * d_inner, out_size=d_inner,
                                                        tp_group=tp_group)
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        kw = dict(dtype=config.params_dtype, device=device)
        n = self.d_inner
        self.conv_weight = torch.nn.Parameter(torch.zeros(n, 1, conv_kernel, **kw))
        self.conv_bias = torch.nn.Parameter(torch.zeros(n, **kw)) if conv_bias else None
        self.x_proj_weight = torch.nn.Parameter(torch.zeros(dt_rank + 2 * d_state, n, **kw))
        self.dt_proj_weight = torch.nn.Parameter(torch.zeros(n, dt_rank, **kw))
        self.dt_proj_bias = torch.nn.Parameter(torch.zeros(n, **kw))
        self.A_log = torch.nn.Parameter(torch.zeros(n, d_state, **kw))
        self.D = torch.nn.Parameter(torch.ones(n, **kw))
        for name, p in self._split_parameters().items():
            set_tensor_model_parallel_attributes(p, True, 1 if name == "x_proj_weight" else 0, 1)
        tp_sections.declare_rows(self.in_proj, (n, n))  # NOTE: this rank's x rows, then its gate's
        # NOTE: Jamba's dt / B / C norm weights: replicated (every rank normalises the summed x_proj output)
        for name, size in zip(NORMS, (dt_rank, d_state, d_state)):
            setattr(self, name, torch.nn.Parameter(torch.ones(size, **kw)) if norm_weights else None)

    def _split_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self._parameters.items() if p is not None and n not in NORMS}

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                inference_context=None, packed_seq_params=None, cached: CachedStep | None = None, **_: object):
        from loongforge_hf.kv_cache import refuse_megatron_state_inputs

        refuse_megatron_state_inputs("Mamba", inference_context, packed_seq_params)
        mixed, _ = self.in_proj(hidden_states)                            # [s, b, 2 * d_local]: all tokens
        mixed = mixed.transpose(0, 1)                                     # [b, s, 2 * d_local]
        if cached is not None:
            return self._cached_forward(mixed, cached)
        batch, seq, _ = mixed.shape
        real, documents, cp = scan_layout(attention_mask, batch, seq, mixed.device)
        return self._output(self._mix(mixed, real, documents=documents, cp=cp)[0], padded=seq)

    def _cached_forward(self, mixed: torch.Tensor, step: CachedStep):
        return cached_mix_step(self, mixed, step)

    def _mix(self, mixed: torch.Tensor, real: torch.Tensor | None, *, documents=None, history=None, state=None,
             cache=None, cp=None):
        """``in_proj``'s output ``[b, s, 2 * d_local]`` -> the gated scan's output ``[b, d_local, s]`` (fp32), the
        final state; ``cache`` (a cache and the layer's index): its conv state updated with this step's inputs;
        ``cp`` (the CP group, ``read_cp_layout``'s starts): this rank's two chunks, ``documents`` their local ids."""
        from loongforge_hf.kernels.linear_scan import linear_scan
        from loongforge_hf.kernels.selective_scan import selective_scan

        if real is not None:
            mixed = mixed * real[..., None].to(mixed.dtype)
        x, z = mixed.split(self.d_inner, dim=-1)
        if cp is None:
            scan, inputs = linear_scan, x
            x = F.silu(causal_conv(x, self.conv_weight, self.conv_bias, history=history, documents=documents)).to(
                x.dtype)
        else:
            x, scan = cp_conv_and_scan(x, cp, weight=self.conv_weight, bias=self.conv_bias)
        if cache is not None:  # NOTE: after the conv read it: the cache writes the state in place
            cache[0].update_conv_state(inputs.transpose(1, 2), cache[1], conv_kernel_size=self.conv_weight.shape[-1])
        if real is not None:
            x = x * real[..., None].to(x.dtype)
        dt, B, C = self._time_steps_and_states(x)
        dt = F.softplus(F.linear(dt, self.dt_proj_weight).transpose(1, 2) + self.dt_proj_bias.float()[:, None])
        A = -torch.exp(self.A_log.float())
        return selective_scan(x.transpose(1, 2), dt, A, B, C, self.D, z.transpose(1, 2), documents=documents,
                              initial_state=state, scan=scan)

    def _time_steps_and_states(self, x: torch.Tensor):
        """``x_proj`` over all channels (this rank's columns, summed over TP) -> ``dt`` ``[b, s, rank]``, ``B``, ``C``
        ``[b, s, N]``, Falcon-Mamba's / Jamba's RMS norms applied."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        out = adapted(self, "x_proj_weight", x, F.linear(x, self.x_proj_weight))
        if self.tp > 1:  # NOTE: the sum forward; the norms replicated on every rank
            out = reduce_from_tensor_model_parallel_region(out, self.tp_group)
        if self.rms_eps is not None:
            parts = out.split([self.dt_rank, self.d_state, self.d_state], dim=-1)
            weights = [getattr(self, name) for name in NORMS]
            out = torch.cat([self._norm(p, w) for p, w in zip(parts, weights)], dim=-1)
        if self.tp > 1:  # NOTE: each rank's channels use the sum: its gradient summed over TP backward
            out = copy_to_tensor_model_parallel_region(out, self.tp_group)
        return out.split([self.dt_rank, self.d_state, self.d_state], dim=-1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """transformers' RMS norm over the last dim (fp32, back to ``x``'s dtype, times ``weight`` where given)."""
        h = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.rms_eps)).to(x.dtype)
        return h if weight is None else weight * h

    def _output(self, y: torch.Tensor, *, padded: int):
        """The gated scan's output ``[b, d_local, given]`` through ``out_proj``, zeros for the layout's padding up to
        ``padded`` tokens."""
        out = y.transpose(1, 2).to(self.out_proj.weight.dtype)
        if padded > out.shape[1]:
            out = F.pad(out, (0, 0, 0, padded - out.shape[1]))
        return self.out_proj(out.transpose(0, 1).contiguous())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from loongforge_hf.bridges.recurrent_common import mixer_sharded_state_dict

        own = self._split_parameters()
        axes = {n: 1 if n == "x_proj_weight" else 0 for n in own}
        norms = {n: getattr(self, n) for n in NORMS if getattr(self, n) is not None}
        return mixer_sharded_state_dict(self, prefix, sharded_offsets, metadata, {**own, **norms}, axes)


def scan_layout(attention_mask, batch: int, seq: int, device):
    """(the real tokens, the document ids, ``cp``) of a Mamba-1 mixer's forward over megatron's mask: without
    context parallelism ``cp`` is None and the ids those of the rows' documents; with it ``cp`` is (the CP group,
    ``read_cp_layout``'s starts) and the ids this rank's two load-balanced chunks' (``linear_scan_cp``)."""
    from loongforge_hf.bridges.mamba2 import _documents

    group, cp_size, _ = cp_group_and_size()
    real, starts = _token_layout(attention_mask, batch, seq, group=group)
    if cp_size > 1:
        from loongforge_hf.parallel.linear_scan_cp import local_documents

        return real, local_documents(starts, group, device), (group, starts)
    return real, None if starts is None else _documents(starts, batch, seq, device), None


def cp_conv_and_scan(x: torch.Tensor, cp, *, weight: torch.Tensor, bias: torch.Tensor | None):
    """``silu`` of the causal conv over this CP rank's two chunks of ``x`` ``[b, 2c, ch]`` (each after its halo,
    ``recurrent_cp.conv_chunks``), in ``x``'s dtype, and the scan that passes the states between the chunks
    (``linear_scan_cp.context_parallel_linear_scan``); ``cp``: ``scan_layout``'s."""
    from loongforge_hf.parallel.linear_scan_cp import context_parallel_linear_scan
    from loongforge_hf.parallel.recurrent_cp import conv_chunks

    conv = functools.partial(causal_conv, weight=weight, bias=bias)
    x = F.silu(conv_chunks(x, cp[1], group=cp[0], width=weight.shape[-1] - 1, conv=conv)).to(x.dtype)
    return x, functools.partial(context_parallel_linear_scan, group=cp[0])


def cached_mix_step(mixer, mixed: torch.Tensor, step: CachedStep) -> torch.Tensor:
    """A Mamba-1 style mixer's cached generate step (``MambaMixer``, Zamba's ``ZambaMixer``: their ``_mix`` and
    ``_output``): ``mixed`` ``[b, s, 2 * d_local]``, ``in_proj``'s output of the step's first ``step.given`` tokens
    and the layout's padding after them; the conv inputs and SSM states read from and written to the cache."""
    cache, index = step.cache, step.index
    history, state = cache.get_conv_state(index), cache.get_recurrent_state(index)
    y, state = mixer._mix(mixed[:, :step.given], step.real, history=None if history is None else history[..., 1:],
                          state=state, cache=(cache, index))
    cache.update_recurrent_state(state, index)
    return mixer._output(y, padded=mixed.shape[1])


@functools.cache
def mamba_attention(*, layers: frozenset[int], **dims) -> type:
    """The self-attention slot's class: ``MambaMixer`` (with ``dims``) on the layers in ``layers`` (0-based global
    indices), megatron's ``SelfAttention`` elsewhere (Jamba's attention layers)."""
    from megatron.core.transformer.attention import SelfAttention

    return mixer_on_layers(layers, MambaMixer, SelfAttention, **dims)
