"""Zamba's multi-head Mamba-1 mixer (transformers' ``ZambaMambaMixer``) as a megatron-style module in the
self-attention slot.

Choices:
- Mamba-1 (``mamba1.py``) with ``d_inner`` cut into ``n_mamba_heads`` heads, each with its own ``x_proj`` (dt, B, C
  from its own channels), ``dt_proj`` and bias, ``A_log`` and ``D``: each head runs ``kernels.selective_scan`` alone
  (its own B / C), transformers' torch path op for op; the outputs concatenated into ``out_proj``.
- ``in_proj``'s rows alternate x and the gate per channel (transformers' ``view(b, -1, 2, s)``): TP splits the heads,
  so a rank's rows are one contiguous block (column-parallel as it is; x and z de-interleaved on the rank); the conv's
  channels and every per-head tensor split with the heads; ``out_proj`` row-parallel. No reduction over TP: a head's
  dt / B / C read its own channels only.
- Padding and packed documents as ``mamba1.py``: padded tokens zeroed before ``in_proj`` and after the conv; packed
  documents restart the conv and the scan. Context parallelism as ``mamba1.py``'s: each rank its two load-balanced
  chunks, the conv after its halo (``recurrent_cp.conv_chunks``), each head's scan states passed between the chunks
  (``linear_scan_cp.context_parallel_linear_scan``: one all-gather per head).
- Cached generate (``kv_cache.py``: a ``CachedStep`` per step, one ``LinearAttentionLayer`` per layer): the conv
  after the conv state (the last ``conv_kernel`` inputs of this rank's channels), each head's scan from its rows of
  the SSM state (fp32 ``[b, d_inner / tp, d_state]``: the heads' states stacked), the step's first ``given`` tokens.
- Refused (``zamba.py``): heads that do not split over TP, projection biases, ``hidden_mamba_act`` other than silu,
  the static cache; at the forward: megatron's ``inference_context`` and THD ``packed_seq_params``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.recurrent_common import CachedStep, mixer_on_layers, mixer_projections, tp_group_of
from loongforge_hf.parallel import tp_sections


class ZambaMixer(torch.nn.Module):
    """One Zamba Mamba layer's token mixer, this TP rank's heads (see the module docstring)."""

    def __init__(self, config, *, layer_number: int, heads: int, d_inner: int, d_state: int, dt_rank: int,
                 conv_kernel: int, conv_bias: bool, pg_collection=None, **_: object) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from loongforge_hf.xpu import get_backend

        super().__init__()
        self.config, self.layer_number = config, layer_number
        tp = config.tensor_model_parallel_size
        tp_group = tp_group_of(pg_collection)
        self.heads, self.head_dim = heads // tp, d_inner // heads
        self.d_inner, self.d_state, self.dt_rank = d_inner // tp, d_state, dt_rank
        self.in_proj, self.out_proj = mixer_projections(config, in_size=2 * d_inner, out_size=d_inner,
                                                        tp_group=tp_group)
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        kw = dict(dtype=config.params_dtype, device=device)
        h, d = self.heads, self.head_dim
        self.conv_weight = torch.nn.Parameter(torch.zeros(self.d_inner, 1, conv_kernel, **kw))
        self.conv_bias = torch.nn.Parameter(torch.zeros(self.d_inner, **kw)) if conv_bias else None
        self.x_proj_weight = torch.nn.Parameter(torch.zeros(h, dt_rank + 2 * d_state, d, **kw))
        self.dt_proj_weight = torch.nn.Parameter(torch.zeros(h, d, dt_rank, **kw))
        self.dt_proj_bias = torch.nn.Parameter(torch.zeros(h, d, **kw))
        self.A_log = torch.nn.Parameter(torch.zeros(h, d, d_state, **kw))
        self.D = torch.nn.Parameter(torch.ones(h, d, **kw))
        for p in self._split_parameters().values():
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        # NOTE: one section: a rank's rows are one block of transformers' (x and the gate alternate within it)
        tp_sections.declare_rows(self.in_proj, (2 * self.d_inner,))

    def _split_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self._parameters.items() if p is not None}

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                inference_context=None, packed_seq_params=None, cached: CachedStep | None = None, **_: object):
        from loongforge_hf.bridges.mamba1 import scan_layout
        from loongforge_hf.kv_cache import refuse_megatron_state_inputs

        refuse_megatron_state_inputs("Zamba", inference_context, packed_seq_params)
        mixed = self.in_proj(hidden_states)[0].transpose(0, 1)           # [b, s, 2 * d_local]: all tokens
        if cached is not None:
            return self._cached_forward(mixed, cached)
        batch, seq, _ = mixed.shape
        real, documents, cp = scan_layout(attention_mask, batch, seq, mixed.device)
        return self._output(self._mix(mixed, real, documents=documents, cp=cp)[0], padded=seq)

    def _cached_forward(self, mixed: torch.Tensor, step: CachedStep):
        from loongforge_hf.bridges.mamba1 import cached_mix_step

        return cached_mix_step(self, mixed, step)

    def _mix(self, mixed: torch.Tensor, real: torch.Tensor | None, *, documents=None, history=None, state=None,
             cache=None, cp=None):
        """``in_proj``'s output ``[b, s, 2 * d_local]`` -> the heads' gated scans ``[b, d_local, s]`` (fp32), their
        final states ``[b, d_local, d_state]``; ``history`` / ``state``: a cached step's conv inputs and SSM states
        before it; ``cache`` (a cache and the layer's index): its conv state updated with this step's inputs; ``cp``
        (the CP group, ``read_cp_layout``'s starts): this rank's two chunks (``mamba1.py``'s conv halo and states
        passed between the chunks), ``documents`` their local ids."""
        from loongforge_hf.kernels.linear_scan import linear_scan
        from loongforge_hf.kernels.selective_scan import selective_scan

        if real is not None:
            mixed = mixed * real[..., None].to(mixed.dtype)
        inputs, z = mixed[..., 0::2], mixed[..., 1::2]                    # NOTE: rows alternate x and the gate
        if cp is None:
            scan = linear_scan
            x = causal_conv_silu(inputs, weight=self.conv_weight, bias=self.conv_bias, documents=documents,
                                 history=history)
        else:
            from loongforge_hf.bridges.mamba1 import cp_conv_and_scan

            x, scan = cp_conv_and_scan(inputs, cp, weight=self.conv_weight, bias=self.conv_bias)
        if cache is not None:  # NOTE: after the conv read it: the cache writes the state in place
            cache[0].update_conv_state(inputs.transpose(1, 2), cache[1], conv_kernel_size=self.conv_weight.shape[-1])
        if real is not None:
            x = x * real[..., None].to(x.dtype)
        x, z = x.transpose(1, 2), z.transpose(1, 2)                       # [b, d_local, s]
        outputs, states = [], []
        for h in range(self.heads):
            part = slice(h * self.head_dim, (h + 1) * self.head_dim)
            dt, B, C = torch.split(torch.matmul(self.x_proj_weight[h], x[:, part]),
                                   [self.dt_rank, self.d_state, self.d_state], dim=1)
            dt = F.softplus(torch.matmul(self.dt_proj_weight[h], dt) + self.dt_proj_bias[h].float()[:, None])
            y, last = selective_scan(x[:, part], dt, -torch.exp(self.A_log[h].float()), B.transpose(1, 2),
                                     C.transpose(1, 2), self.D[h], z[:, part], documents=documents,
                                     initial_state=None if state is None else state[:, part], scan=scan)
            outputs.append(y)
            states.append(last)
        return torch.cat(outputs, dim=1), torch.cat(states, dim=1)

    def _output(self, y: torch.Tensor, *, padded: int):
        """The heads' output ``[b, d_local, given]`` through ``out_proj``, zeros for the layout's padding up to
        ``padded`` tokens."""
        out = y.transpose(1, 2).to(self.out_proj.weight.dtype)
        if padded > out.shape[1]:
            out = F.pad(out, (0, 0, 0, padded - out.shape[1]))
        return self.out_proj(out.transpose(0, 1).contiguous())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from loongforge_hf.bridges.recurrent_common import mixer_sharded_state_dict

        return mixer_sharded_state_dict(self, prefix, sharded_offsets, metadata, self._split_parameters())


def causal_conv_silu(x: torch.Tensor, *, weight: torch.Tensor, bias: torch.Tensor | None,
                     documents: torch.Tensor | None, history: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.causal_conv`` (after ``history`` ``[b, ch, kernel - 1]``, or zeros) and ``silu`` over ``x``
    ``[b, s, ch]``, in ``x``'s dtype."""
    from loongforge_hf.kernels.causal_conv import causal_conv

    return F.silu(causal_conv(x, weight, bias, history=history, documents=documents)).to(x.dtype)


@functools.cache
def zamba_attention_slot(*, layers: frozenset[int], **dims) -> type:
    """The self-attention slot's class: ``ZambaMixer`` (with ``dims``) on every layer of ``layers``."""
    from megatron.core.transformer.attention import SelfAttention

    return mixer_on_layers(layers, ZambaMixer, SelfAttention, **dims)
