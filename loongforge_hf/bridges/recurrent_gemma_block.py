"""RecurrentGemma's recurrent block (Griffin's: transformers' ``RecurrentGemmaRecurrentBlock``) as a megatron-style
module in the self-attention slot.

Choices:
- ``in_proj`` (column-parallel, with its bias) = this rank's channels of ``linear_x`` then of ``linear_y``: one
  all-gather of the tokens under sequence parallelism; ``y = gelu_tanh(linear_y)``; ``x`` through the causal
  depthwise conv (``kernels.causal_conv``, its bias) and the RG-LRU (``kernels.rg_lru``); ``linear_out``
  (row-parallel: megatron's bias-dropout-add adds its bias once after the reduction) of ``x * y``.
- Tensor parallelism splits ``lru_width`` by the RG-LRU's heads (its gates are block-diagonal, one block a head):
  rank ``r`` holds heads ``r * H / tp ..`` and their channels of ``linear_x`` / ``linear_y``, the conv, the gates
  and ``recurrent_param``; no communication inside the block. ``num_attention_heads`` must split over TP (checked
  by the bridge, before any collective).
- Padding and packed documents (read from megatron's mask, ``recurrent_common._token_layout``): padded tokens' conv
  inputs and outputs are zero, the scan restarts (transformers' reset: no decay, the input not normalised) at each
  row's first real token and each document's first token, and the conv reads no other document: each row or
  document as transformers runs it alone. transformers' own block takes no mask (a left-padded row's padding enters
  its conv and scan; its reset is ``position_ids == 0``).
- Cached generate (``kv_cache.py``: a ``recurrent_common.CachedStep`` per step, one ``LinearAttentionLayer`` per
  layer, as Mamba-1's): the conv after the conv state (the last ``conv1d_width`` inputs, this rank's channels), the
  RG-LRU from its state (fp32 ``[b, width / tp]``), the step's first ``given`` tokens only; transformers' mask's
  padding handled as without the cache (zeroed, the scan restarting at a row's first real token).
- Context parallelism (megatron's load-balanced chunks: the inputs, the mask's rows ``[b, 1, s_local, s]``): the
  block runs its own tokens, the conv after its halo (``recurrent_cp.conv_chunks``), the RG-LRU's states passed
  between the chunks over the CP group and its resets read from the mask's rows (``parallel/linear_scan_cp.py``),
  the same outputs and gradients as one run over the whole sequence; padding and packed documents as above. The
  group is megatron's, read at each forward (``context_parallel.cp_group_and_size``); cached steps never run under
  CP.
- Refused at the forward: megatron's ``inference_context`` and THD ``packed_seq_params``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.recurrent_common import _token_layout, mixer_on_layers, mixer_projections, tp_group_of
from loongforge_hf.kernels.causal_conv import causal_conv
from loongforge_hf.parallel import tp_sections
from loongforge_hf.parallel.context_parallel import cp_group_and_size

GATES = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias")


class RecurrentBlock(torch.nn.Module):
    """One RecurrentGemma recurrent layer's token mixer, this TP rank's heads (see the module docstring)."""

    def __init__(self, config, *, layer_number: int, width: int, heads: int, conv_kernel: int, pg_collection=None,
                 **_: object) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from loongforge_hf.xpu import get_backend

        super().__init__()
        self.config, self.layer_number = config, layer_number
        tp = config.tensor_model_parallel_size
        self.width, self.heads = width // tp, heads // tp
        self.in_proj, self.out_proj = mixer_projections(config, in_size=2 * width, out_size=width, bias=True,
                                                        tp_group=tp_group_of(pg_collection))
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        kw = dict(dtype=config.params_dtype, device=device)
        n, block = self.width, width // heads
        self.conv_weight = torch.nn.Parameter(torch.zeros(n, 1, conv_kernel, **kw))
        self.conv_bias = torch.nn.Parameter(torch.zeros(n, **kw))
        self.recurrent_param = torch.nn.Parameter(torch.zeros(n, **kw))
        for name in GATES:
            shape = (self.heads, block, block) if name.endswith("weight") else (self.heads, block)
            setattr(self, name, torch.nn.Parameter(torch.zeros(shape, **kw)))
        for p in self._own_parameters().values():
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        tp_sections.declare_rows(self.in_proj, (n, n))  # NOTE: this rank's channels of linear_x, then of linear_y

    def _own_parameters(self) -> dict[str, torch.nn.Parameter]:
        return dict(self._parameters)

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                inference_context=None, packed_seq_params=None, cached=None, **_: object):
        from loongforge_hf.bridges.mamba2 import _documents
        from loongforge_hf.kv_cache import refuse_megatron_state_inputs

        refuse_megatron_state_inputs("RecurrentGemma recurrent", inference_context, packed_seq_params)
        mixed, bias = self.in_proj(hidden_states)                         # [s, b, 2 * width]: all tokens
        mixed = (mixed + bias).transpose(0, 1)                            # [b, s, 2 * width]
        batch, seq, _ = mixed.shape
        if cached is not None:  # NOTE: the step's first ``given`` tokens; zeros for the layout's padding after them
            x, y = mixed[:, :cached.given].split(self.width, dim=-1)
            x = self._recurrence(x, cached.real, cache=(cached.cache, cached.index))
            return self.out_proj(F.pad(x * F.gelu(y, approximate="tanh"),
                                       (0, 0, 0, seq - cached.given)).transpose(0, 1).contiguous())
        group, cp, _ = cp_group_and_size()
        real, starts = _token_layout(attention_mask, batch, seq, group=group)
        x, y = mixed.split(self.width, dim=-1)
        if cp > 1:  # NOTE: this rank's two load-balanced chunks, the conv's halo and the states passed over CP
            x = self._recurrence(x, real, cp=(group, starts, attention_mask))
        else:
            documents = None if starts is None else _documents(starts, batch, seq, mixed.device)
            x = self._recurrence(x, real, documents=documents)
        return self.out_proj((x * F.gelu(y, approximate="tanh")).transpose(0, 1).contiguous())

    def _recurrence(self, x: torch.Tensor, real: torch.Tensor | None, *, documents: torch.Tensor | None = None,
                    cache=None, cp=None):
        """``x`` ``[b, s, width]`` through the conv and the RG-LRU, restarting at each row's first real token and
        each document's first; ``cache`` (a cache and the layer's index): after its conv and RG-LRU states (none
        before the prefill), both updated with this step's; ``cp`` (the CP group, ``read_cp_layout``'s starts, the
        mask): this rank's two chunks."""
        from loongforge_hf.kernels.linear_scan import linear_scan
        from loongforge_hf.kernels.rg_lru import rg_lru

        history = state = None
        if cache is not None:
            history, state = cache[0].get_conv_state(cache[1]), cache[0].get_recurrent_state(cache[1])
            # NOTE: no conv state before the prefill (nor after ``restart``, whose zeroed RG-LRU state reads as set)
            history, state = (None, None) if history is None else (history[..., 1:], state)
        keep = None if real is None else real[..., None].to(x.dtype)
        if keep is not None:
            x = x * keep
        conv = functools.partial(causal_conv, weight=self.conv_weight, bias=self.conv_bias)
        if cp is None:
            inputs, x = x, conv(x, history=history, documents=documents).to(x.dtype)
            reset, scan = _resets(x, real, documents, first=state is None), linear_scan
        else:
            from loongforge_hf.parallel.linear_scan_cp import context_parallel_linear_scan, resets
            from loongforge_hf.parallel.recurrent_cp import conv_chunks

            x = conv_chunks(x, cp[1], group=cp[0], width=self.conv_weight.shape[-1] - 1, conv=conv).to(x.dtype)
            reset = resets(cp[2], *x.shape[:2], cp[0], x.device)
            scan = functools.partial(context_parallel_linear_scan, group=cp[0])
        if keep is not None:
            x = x * keep
        out, state = rg_lru(x, reset=reset, state=state, scan=scan,
                            **{name: getattr(self, name) for name in (*GATES, "recurrent_param")})
        if cache is not None:  # NOTE: after the conv read it: the cache writes the conv state in place
            cache[0].update_conv_state(inputs.transpose(1, 2), cache[1], conv_kernel_size=self.conv_weight.shape[-1])
            cache[0].update_recurrent_state(state, cache[1])
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from loongforge_hf.bridges.recurrent_common import mixer_sharded_state_dict

        return mixer_sharded_state_dict(self, prefix, sharded_offsets, metadata, self._own_parameters())


def _resets(x: torch.Tensor, real: torch.Tensor | None, documents: torch.Tensor | None, *,
            first: bool) -> torch.Tensor:
    """Where the RG-LRU restarts ``[b, s]``: the row's first token (``first``: no state carried in), each
    document's first, the first real token after padding."""
    reset = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
    reset[:, 0] = first
    if documents is not None:
        reset[:, 1:] |= documents[:, 1:] != documents[:, :-1]
    if real is not None:
        reset[:, 1:] |= real[:, 1:] & ~real[:, :-1]
    return reset


@functools.cache
def local_attention(*, qkv_bias: bool) -> type:
    """megatron's ``SelfAttention``; without ``qkv_bias`` its ``linear_qkv`` drops the bias megatron gives it with
    ``add_bias_linear`` (RecurrentGemma's ``o_proj`` and MLP have biases, its q / k / v none unless
    ``attention_bias``). The linear keeps its class (LoRA adapts megatron's own linears only)."""
    from megatron.core.transformer.attention import SelfAttention

    class LocalAttention(SelfAttention):
        def __init__(self, config, submodules, layer_number: int = 1, **kwargs):
            super().__init__(config, submodules, layer_number, **kwargs)
            if not qkv_bias:
                self.linear_qkv.register_parameter("bias", None)

    return LocalAttention


@functools.cache
def recurrent_gemma_attention(*, layers: frozenset[int], qkv_bias: bool, **dims) -> type:
    """The self-attention slot's class: ``RecurrentBlock`` (with ``dims``) on the layers in ``layers`` (0-based global
    indices), megatron's ``SelfAttention`` (the local attention, ``local_attention``) elsewhere."""
    return mixer_on_layers(layers, RecurrentBlock, local_attention(qkv_bias=qkv_bias), **dims)
