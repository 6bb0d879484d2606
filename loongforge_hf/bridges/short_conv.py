"""LFM2's short-convolution mixer (transformers' ``Lfm2ShortConv``, Liquid AI's LFM2 / LFM2-MoE ``conv`` layers) as a
megatron-style module in the self-attention slot, and the slot's class that picks it or megatron's ``SelfAttention``
by layer.

Choices:
- Forward as transformers' torch path: ``in_proj`` -> ``B``, ``C``, ``x`` (three ``hidden_size`` blocks), ``B * x``,
  the causal depthwise conv of ``conv_L_cache`` taps with its bias and no activation (``kernels.causal_conv``, in the
  weight's dtype), ``C *`` its output, ``out_proj``. Padded tokens (the diagonal of megatron's ``[b, 1, s, s]``
  mask: a token masked from itself) have their input zeroed, as transformers zeroes their hidden states: ``in_proj``
  gives them its bias (``skip_bias_add``: the masked output plus the bias, the same numbers).
- Tensor parallelism splits by channels: the conv is depthwise, so rank ``r`` holds channels ``r * h / tp ..`` of
  each of ``B``, ``C``, ``x`` (one column-parallel ``in_proj``, one all-gather of the tokens under sequence
  parallelism), of the conv's weight and bias, and ``out_proj``'s input columns (row-parallel; its bias, with
  ``conv_bias``, is added once after the reduction by megatron's bias-dropout-add).
- Packed documents (megatron's mask blocks attention between documents): the conv restarts at each document's first
  token (no tap reads another document), as running each document alone. transformers' torch path runs a packed row
  as one sequence.
- Cached generate (``kv_cache.py``: one of transformers' ``LinearAttentionLayer`` per conv layer of the rank, after
  the attentions' layers; a ``recurrent_common.CachedStep`` per step, as Mamba2's): the step's first ``given`` tokens
  (the layout's padding after them never enters the state; its outputs are zero), the padding transformers' 2-D
  mask marks handled as without the cache; the conv after the conv state (the last ``conv_L_cache`` inputs
  ``B * x``, transformers' layout, this rank's channels). No recurrent state. Beam search reorders it with the cache.
- Context parallelism (megatron's load-balanced chunks): the layer runs its own tokens, each chunk's conv after the
  previous chunk's last ``conv_L_cache - 1`` inputs (``parallel/recurrent_cp.conv_chunks``: one all-gather of the
  tails); padding and packed documents as above; the CP group is megatron's, read at each forward. Cached steps never
  run under CP (``kv_cache.patched`` refuses the split prefill): generate under CP runs without the cache.
- ``post_norm`` (LFM3's sandwich norms): our ``RMSNorm`` on ``out_proj``'s output (its bias added first), before
  megatron's residual add, as ``layer_outputs.transformed_attention``'s; under sequence parallelism on the rank's
  tokens.
- Refused at the forward: megatron's ``inference_context`` and THD ``packed_seq_params``
  (``kv_cache.refuse_megatron_state_inputs``); the layouts and configs in ``lfm2.py``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.recurrent_common import CachedStep, _token_layout, mixer_projections
from loongforge_hf.bridges.mamba2 import _documents
from loongforge_hf.kernels.causal_conv import causal_conv
from loongforge_hf.parallel import tp_sections
from loongforge_hf.parallel.context_parallel import cp_group_and_size


class ShortConvMixer(torch.nn.Module):
    """One LFM2 conv layer's token mixer, this TP rank's channels (see the module docstring)."""

    def __init__(self, config, *, layer_number: int, conv_kernel: int, bias: bool, post_norm: bool = False,
                 pg_collection=None, **_: object) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from loongforge_hf.bridges.layer_outputs import _post_norm
        from loongforge_hf.xpu import get_backend

        super().__init__()
        self.config, self.layer_number = config, layer_number
        tp_group = getattr(pg_collection, "tp", None)
        h, tp = config.hidden_size, config.tensor_model_parallel_size
        self.channels = h // tp
        self.in_proj, self.out_proj = mixer_projections(config, in_size=3 * h, out_size=h, bias=bias,
                                                        tp_group=tp_group)
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        kw = dict(dtype=config.params_dtype, device=device)
        self.conv_weight = torch.nn.Parameter(torch.zeros(self.channels, 1, conv_kernel, **kw))
        self.conv_bias = torch.nn.Parameter(torch.zeros(self.channels, **kw)) if bias else None
        for p in self._own_parameters().values():
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        tp_sections.declare_rows(self.in_proj, (self.channels,) * 3)  # NOTE: this rank's B, C and x rows
        _post_norm(self, config, post_norm)

    def _own_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self._parameters.items() if p is not None}

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                inference_context=None, packed_seq_params=None, cached: CachedStep | None = None, **_: object):
        from loongforge_hf.kv_cache import refuse_megatron_state_inputs
        from loongforge_hf.parallel.recurrent_cp import conv_chunks

        refuse_megatron_state_inputs("LFM2 short-conv", inference_context, packed_seq_params)
        mixed, bias = self.in_proj(hidden_states)                         # [s, b, 3 * channels]: all tokens
        mixed = mixed.transpose(0, 1)                                     # [b, s, 3 * channels]
        if cached is not None:
            return self._cached_forward(mixed, bias, cached)
        batch, seq, _ = mixed.shape
        group, cp, _ = cp_group_and_size()
        real, starts = _token_layout(attention_mask, batch, seq, group=group)
        c, bx = self._gates(mixed, bias, real)
        if cp > 1:  # NOTE: this rank's two load-balanced chunks, each after the previous chunk's tail
            conv = conv_chunks(bx, starts, group=group, width=self.conv_weight.shape[-1] - 1, conv=self._conv)
        else:
            conv = self._conv(bx, documents=None if starts is None else _documents(starts, batch, seq, bx.device))
        return self._output(c * conv, padded=seq)

    def _cached_forward(self, mixed: torch.Tensor, bias: torch.Tensor | None, step: CachedStep):
        """A cached generate step (see the module docstring): ``mixed`` ``[b, s, 3 * channels]``, ``in_proj``'s
        output (without its bias) of the step's first ``step.given`` tokens and the layout's padding after them."""
        c, bx = self._gates(mixed[:, :step.given], bias, step.real)
        cache, index = step.cache, step.index
        history = cache.get_conv_state(index)
        conv = self._conv(bx, history=None if history is None else history[..., 1:])
        # NOTE: after the conv read it: the cache writes the state in place
        cache.update_conv_state(bx.transpose(1, 2), index, conv_kernel_size=self.conv_weight.shape[-1])
        return self._output(c * conv, padded=mixed.shape[1])

    def _gates(self, mixed: torch.Tensor, bias: torch.Tensor | None, real: torch.Tensor | None):
        """``in_proj``'s output ``[b, s, 3 * channels]`` without its bias, the tokens where ``real`` ``[b, s]`` is
        False zeroed (None: none), plus the bias -> ``C`` and the conv's input ``B * x``."""
        if real is not None:
            mixed = mixed * real[..., None].to(mixed.dtype)
        if bias is not None:
            mixed = mixed + bias
        b, c, x = torch.split(mixed, self.channels, dim=-1)
        return c, b * x

    def _conv(self, bx: torch.Tensor, *, history: torch.Tensor | None = None,
              documents: torch.Tensor | None = None) -> torch.Tensor:
        return causal_conv(bx, self.conv_weight, self.conv_bias, history=history, documents=documents).to(bx.dtype)

    def _output(self, y: torch.Tensor, *, padded: int):
        """``C * conv`` ``[b, given, channels]`` through ``out_proj`` (and the post norm, LFM3's), zeros for the
        layout's padding up to ``padded`` tokens."""
        from loongforge_hf.bridges.layer_outputs import _transform

        if padded > y.shape[1]:
            y = F.pad(y, (0, 0, 0, padded - y.shape[1]))
        out = self.out_proj(y.transpose(0, 1).contiguous())
        return out if self.post_layernorm is None else _transform(out, self.post_layernorm, 1.0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from loongforge_hf.bridges.recurrent_common import mixer_sharded_state_dict

        return mixer_sharded_state_dict(self, prefix, sharded_offsets, metadata, self._own_parameters())


@functools.cache
def hybrid_short_conv_attention(*, conv: frozenset[int], conv_kernel: int, bias: bool, attention: type | None = None,
                                post_norm: bool = False) -> type:
    """The self-attention slot's class: ``ShortConvMixer`` on the layers in ``conv`` (0-based global indices;
    megatron numbers layers from 1, offset by the pipeline stage), with a norm on its output where ``post_norm``
    (LFM3's sandwich norms); ``attention`` (None: megatron's ``SelfAttention``) elsewhere."""
    from megatron.core.transformer.attention import SelfAttention

    class HybridShortConvAttention:
        def __new__(cls, config, submodules=None, layer_number: int = 1, **kwargs):
            if layer_number - 1 in conv:
                return ShortConvMixer(config, layer_number=layer_number, conv_kernel=conv_kernel, bias=bias,
                                      post_norm=post_norm, pg_collection=kwargs.get("pg_collection"))
            return (attention or SelfAttention)(config, submodules, layer_number, **kwargs)

    return HybridShortConvAttention
