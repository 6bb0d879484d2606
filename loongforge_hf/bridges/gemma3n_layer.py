"""Gemma 3n's decoder layer around megatron's attention and MLP slots: AltUp's parallel streams (predict / correct),
LAuReL's low-rank residual, the per-layer input block, and the MLP's Gaussian top-k (activation sparsity).

Choices:
- The residual is ``altup_num_inputs`` streams, carried between megatron's layers as one ``[s, b, n * H]`` tensor,
  with the per-layer inputs beside them: made, split and carried across pipeline stages by ``gemma3n_streams.py``;
  each layer reads its own per-layer input slice from the model's holder (``per_layer_stream``) by its global number.
- ``Gemma3nLayer`` is transformers' ``Gemma3nTextDecoderLayer``: AltUp's prediction, the active stream's input norm
  feeding the attention (megatron's ``self_attention``, Gemma 4's: q / k / v norms, KV sharing) and LAuReL,
  ``(active + attention + laurel) / sqrt(2)``, the MLP with its sandwich norms, AltUp's correction, then the
  per-layer input block added to every stream but the first. AltUp's router coefficients are clipped in training as
  transformers does (``prediction_coefs`` in place, ``correction_coefs`` in the forward). Layers with their own
  ``intermediate_size`` are built from a copy of the config with that ``ffn_hidden_size``.
- AltUp, LAuReL and the per-layer block's weights are replicated and act on this rank's tokens: under sequence
  parallelism their gradients are summed over TP (``sequence_parallel``), as the norms'.
- ``SparseMLP`` (``activation_sparsity_pattern[i] > 0``): ``relu(gate - (mean + std * icdf(p)))`` over the whole
  intermediate width before the activation; under TP each rank holds a slice of it, so the sums behind the mean and
  the (biased) variance are all-reduced over TP (autograd's ``all_reduce``: its backward sums the gradients).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import torch

from loongforge_hf.bridges.gemma4_per_layer import _linear

_ATTENTION_ARGS = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin", "attention_bias",
                   "inference_context", "packed_seq_params", "sequence_len_offset")


def _replicated(module: torch.nn.Module, sequence_parallel: bool) -> torch.nn.Module:
    for p in module.parameters():
        p.sequence_parallel = sequence_parallel
    return module


class AltUp(torch.nn.Module):
    """transformers' ``Gemma3nTextAltUp`` on ``[s, b, n, H]`` streams."""

    def __init__(self, config, hf_config) -> None:
        from loongforge_hf.kernels.rmsnorm import RMSNorm

        super().__init__()
        n, h, dtype = hf_config.altup_num_inputs, hf_config.hidden_size, config.params_dtype
        self.n, self.active, self.clip = n, hf_config.altup_active_idx, hf_config.altup_coef_clip
        self.correct_output_scale = torch.nn.Parameter(torch.zeros(h, dtype=dtype))
        linear = functools.partial(torch.nn.utils.skip_init, torch.nn.Linear, bias=False, dtype=dtype)
        self.correction_coefs, self.prediction_coefs, self.modality_router = linear(n, n), linear(n, n * n), \
            linear(h, n)
        self.router_norm = RMSNorm(config, h, eps=config.layernorm_epsilon)
        self.router_input_scale = h ** -1.0

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        modalities = self.modalities(streams[..., self.active, :])
        if self.training and self.clip is not None:
            self.prediction_coefs.weight.data.clamp_(-self.clip, self.clip)
        coefs = self.prediction_coefs(modalities).unflatten(-1, (self.n, self.n))  # NOTE: [k, m]: stream k from m
        return (torch.matmul(coefs, streams) + streams).type_as(streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        modalities = self.modalities(activated)
        innovation = activated - predictions[..., self.active, :]
        weight = self.correction_coefs.weight
        if self.training and self.clip is not None:
            weight = weight.clamp(-self.clip, self.clip)
        coefs = torch.nn.functional.linear(modalities, weight) + 1.0
        return (innovation.unsqueeze(-2) * coefs.unsqueeze(-1) + predictions).type_as(activated)


class Laurel(torch.nn.Module):
    """transformers' ``Gemma3nTextLaurelBlock``: ``x + norm(right(left(x)))``."""

    def __init__(self, config, hf_config) -> None:
        from loongforge_hf.kernels.rmsnorm import RMSNorm

        super().__init__()
        h, r, dtype = hf_config.hidden_size, hf_config.laurel_rank, config.params_dtype
        self.linear_left = torch.nn.utils.skip_init(torch.nn.Linear, h, r, bias=False, dtype=dtype)
        self.linear_right = torch.nn.utils.skip_init(torch.nn.Linear, r, h, bias=False, dtype=dtype)
        self.post_laurel_norm = RMSNorm(config, h, eps=config.layernorm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


def std_multiplier(sparsity: float) -> torch.Tensor:
    """The standard normal's ``sparsity`` quantile (fp32), as transformers computes it."""
    return torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(sparsity, dtype=torch.float32))


def gaussian_topk(gate: torch.Tensor, multiplier: torch.Tensor, *, width: int, tp_group=None) -> torch.Tensor:
    """transformers' ``Gemma3nTextMLP._gaussian_topk`` over ``width`` channels, of which ``gate`` holds this TP
    rank's slice (module docstring); ``multiplier`` from ``std_multiplier``."""
    total = gate.sum(dim=-1, keepdim=True)
    if tp_group is not None:
        from torch.distributed.nn.functional import all_reduce

        total = all_reduce(total, group=tp_group)
    mean = total / width
    squares = ((gate - mean) ** 2).sum(dim=-1, keepdim=True)
    if tp_group is not None:
        squares = all_reduce(squares, group=tp_group)
    cutoff = mean + torch.sqrt(squares / width) * multiplier.to(gate.dtype)
    return torch.nn.functional.relu(gate - cutoff)


@functools.cache
def sparse_mlp(activation: str) -> type:
    """The Gemma sandwich MLP (``layer_outputs.transformed_mlp`` with its post norm) whose gate passes through
    ``gaussian_topk`` where the layer sets ``activation_sparsity`` (0: the plain gated MLP)."""
    from transformers.activations import ACT2FN

    from loongforge_hf.bridges.layer_outputs import _transform, transformed_mlp

    act = ACT2FN[activation]

    class SparseMLP(transformed_mlp(post_norm=True)):
        activation_sparsity, tp_group = 0.0, None

        def set_sparsity(self, sparsity: float, tp_group) -> None:
            """The layer's ``activation_sparsity_pattern`` entry; its quantile a buffer (moved with the model: no
            host-to-device copy in a forward)."""
            self.activation_sparsity, self.tp_group = sparsity, tp_group
            if sparsity:
                self.register_buffer("std_multiplier", std_multiplier(sparsity), persistent=False)

        def forward(self, hidden_states, *args, **kwargs):
            if not self.activation_sparsity:
                return super().forward(hidden_states, *args, **kwargs)
            fc1, _ = self.linear_fc1(hidden_states)
            gate, up = fc1.chunk(2, dim=-1)
            gate = gaussian_topk(gate, self.std_multiplier, width=self.config.ffn_hidden_size, tp_group=self.tp_group)
            return _transform(self.linear_fc2(act(gate) * up), self.post_layernorm, 1.0)

    return SparseMLP


def gemma3n_layer(hf_config) -> type:
    """megatron's ``TransformerLayer`` as transformers' ``Gemma3nTextDecoderLayer`` (module docstring)."""
    from transformers.activations import ACT2FN

    base = _layer_base()
    return type("Gemma3nLayer", (base,), {"hf_config": hf_config, "act": staticmethod(ACT2FN[
        hf_config.hidden_activation])})


@functools.cache
def _layer_base() -> type:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from loongforge_hf.kernels.rmsnorm import RMSNorm

    class Gemma3nLayer(TransformerLayer):
        hf_config = act = None  # NOTE: set on the subclass gemma3n_layer makes

        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs) -> None:
            import copy

            from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

            # NOTE: megatron passes the stage's own number; TransformerLayer adds this offset to it
            hf, i = self.hf_config, layer_number - 1 + get_transformer_layer_offset(config, kwargs.get("vp_stage"))
            if hf.intermediate_size[i] != config.ffn_hidden_size:
                config = copy.copy(config)
                config.ffn_hidden_size = hf.intermediate_size[i]
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            sp, h, p = bool(config.sequence_parallel), hf.hidden_size, hf.hidden_size_per_layer_input
            tp_group = ps.get_tensor_model_parallel_group()
            self.mlp.set_sparsity(float(hf.activation_sparsity_pattern[i]),
                                  tp_group if torch.distributed.get_world_size(tp_group) > 1 else None)
            self.altup = _replicated(AltUp(config, hf), sp)
            self.laurel = _replicated(Laurel(config, hf), sp)
            self.per_layer_input_gate, self.per_layer_projection = _linear(h, p, config), _linear(p, h, config)
            self.post_per_layer_input_norm = RMSNorm(config, h, eps=config.layernorm_epsilon)
            self.per_layer_stream = SimpleNamespace(stream=None)  # NOTE: the holder (gemma3n_streams.add_streams)

        def forward(self, hidden_states, attention_mask=None, **kwargs):
            hf = self.hf_config
            streams = hidden_states.unflatten(-1, (hf.altup_num_inputs, hf.hidden_size))
            predictions = self.altup.predict(streams)
            active = predictions[..., hf.altup_active_idx, :]
            normed = self.input_layernorm(active)
            laurel = self.laurel(normed)
            attended, _ = self.self_attention(normed, attention_mask=attention_mask,
                                              **{k: v for k, v in kwargs.items() if k in _ATTENTION_ARGS})
            mixed = (active + attended + laurel) / math.sqrt(2)
            out, _ = self.mlp(self.pre_mlp_layernorm(mixed))
            corrected = self.altup.correct(predictions, mixed + out)
            first = corrected[..., hf.altup_active_idx, :]
            if hf.altup_correct_scale:
                first = (first.type_as(self.altup.correct_output_scale) * self.altup.correct_output_scale).type_as(
                    first)
            stream = self.per_layer_stream.stream[:, :, self.layer_number - 1]
            first = self.post_per_layer_input_norm(self.per_layer_projection(self.act(self.per_layer_input_gate(
                first)) * stream))
            rest = corrected[..., 1:, :] + first.unsqueeze(-2)
            return torch.cat([corrected[..., :1, :], rest], dim=-2).flatten(-2).contiguous(), None

    return Gemma3nLayer
