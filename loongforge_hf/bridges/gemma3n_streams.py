"""Gemma 3n's residual streams around megatron's decoder (``gemma3n_layer.py`` is the layer between them).

Choices:
- The residual is ``altup_num_inputs`` streams, carried between megatron's layers as one ``[s, b, n * H]`` tensor:
  ``AltUpStreams`` (a forward pre-hook on the first stage's decoder) makes them from the embedding (transformers'
  ``altup_projections``, each rescaled to the embedding's RMS), and the last stage's decoder's final norm is
  ``AltUpHead`` (``altup_unembed_projections`` rescaled to stream 0's RMS, the mean of the streams, then
  ``model.norm``). The per-layer inputs ``[s, b, layers, P]`` (``PerLayerIds``) are made beside them on the first
  stage and handed to the layers through a holder (``per_layer_stream``), each layer reading its own slice by its
  global number. Under pipeline parallelism (``add_streams``) a stage before the last appends the per-layer inputs to
  its decoder's output, ``[s, b, n * H + layers * P]`` (``boundary_width``), and a later stage splits what it
  receives back into the streams (the decoder's input) and the holder's per-layer inputs; the gradient of both goes
  back through the same tensor.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges.gemma4_per_layer import PerLayerInputs, _linear, carry_per_layer_inputs


def _rms_like(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``x`` rescaled to ``target``'s RMS (``target`` the RMS itself), as transformers' stream projections."""
    return x * target / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))


def _linears(count: int, size: int, config) -> torch.nn.ModuleList:
    return torch.nn.ModuleList(_linear(size, size, config) for _ in range(count))


class AltUpStreams(torch.nn.Module):
    """The streams from the embedding (``[s, b, H]`` -> ``[s, b, n * H]``): transformers' ``altup_projections``."""

    def __init__(self, config, hf_config) -> None:
        super().__init__()
        self.projections = _linears(hf_config.altup_num_inputs - 1, hf_config.hidden_size, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5
        streams = [x, *(_rms_like(p(x).to(x.dtype), target) for p in self.projections)]
        return torch.stack(streams, dim=-2).flatten(-2)


class AltUpHead(torch.nn.Module):
    """The decoder's final norm: the streams back to one (``altup_unembed_projections``, their mean), then
    ``model.norm`` (``[s, b, n * H]`` -> ``[s, b, H]``)."""

    def __init__(self, config, hf_config) -> None:
        from loongforge_hf.kernels.rmsnorm import RMSNorm

        super().__init__()
        self.n = hf_config.altup_num_inputs
        self.unembed_projections = _linears(self.n - 1, hf_config.hidden_size, config)
        self.norm = RMSNorm(config, hf_config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        streams = x.unflatten(-1, (self.n, -1))
        first = streams[..., 0, :]
        target = torch.mean(first ** 2, dim=-1, keepdim=True) ** 0.5
        rest = (_rms_like(p(streams[..., i + 1, :]).to(x.dtype), target) for i, p in
                enumerate(self.unembed_projections))
        return self.norm(torch.mean(torch.stack([first, *rest]), dim=0))


class PerLayerIds(PerLayerInputs):
    """``PerLayerInputs`` with transformers' Gemma 3n lookup: ids outside the table (``table_rows``) are looked up
    as 0."""

    table_rows = 0

    def forward(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        inside = (input_ids >= 0) & (input_ids < self.table_rows)
        return super().forward(torch.where(inside, input_ids, 0), embeddings)


def boundary_width(hf_config) -> int:
    """What crosses a pipeline stage boundary per token: the AltUp streams, then every layer's per-layer input."""
    c = hf_config
    return c.altup_num_inputs * c.hidden_size + c.num_hidden_layers * c.hidden_size_per_layer_input


def add_streams(chunk, hf_config) -> None:
    """Wire ``chunk`` (one pipeline stage's ``GPTModel``; the whole model without a pipeline) as the module
    docstring says: the first stage makes the streams and the per-layer inputs before its decoder, a later stage
    splits what it receives into the two, a stage before the last appends the per-layer inputs to its decoder's
    output (``gemma4_per_layer.carry_per_layer_inputs``), the last has ``AltUpHead`` as its decoder's final norm.
    Call after any other pre-hook on the decoder."""
    from megatron.core import parallel_state as ps

    config, c = chunk.config, hf_config
    layers, size = c.num_hidden_layers, c.hidden_size_per_layer_input
    if chunk.pre_process:
        chunk.per_layer_inputs = PerLayerIds(config, num_layers=layers, size=size, vocab=c.vocab_size_per_layer_input,
                                             pad_token_id=c.pad_token_id,
                                             tp_group=ps.get_tensor_model_parallel_group())
        chunk.per_layer_inputs.table_rows = c.vocab_size_per_layer_input
        chunk.altup_streams = AltUpStreams(config, c)
    if chunk.post_process:
        chunk.decoder.final_layernorm = AltUpHead(config, c)
    carry_per_layer_inputs(chunk, width=c.altup_num_inputs * c.hidden_size, layers=layers, size=size,
                           widen=chunk.altup_streams if chunk.pre_process else None)
