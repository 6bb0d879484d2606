"""Gemma 4's per-layer inputs (``hidden_size_per_layer_input``: Gemma 4 E2B / E4B) and its double-wide MLPs
(``use_double_wide_mlp``: twice ``intermediate_size`` in the layers that reuse another's keys and values).

Choices:
- The per-layer stream (transformers' ``get_per_layer_inputs`` / ``project_per_layer_inputs``), one
  ``[s, b, layers, P]`` tensor per forward, made by ``PerLayerInputs`` (``per_layer_inputs`` of the first stage's
  ``GPTModel``) from the decoder's input (the scaled token embeddings, images in place for the image-text model)
  and the input ids: ``(norm(proj(x) / sqrt(H)) + table[ids] * sqrt(P)) / sqrt(2)``, ids of image placeholders
  looked up as ``pad_token_id``, as transformers does. A forward pre-hook on ``GPTModel`` keeps the ids, one on the
  decoder makes the stream, every layer reads its slice (``per_layer_stream``, by its global number); the decoder's
  forward hook drops it (``carry_per_layer_inputs``, Gemma 3n's too).
- Pipeline parallelism (virtual stages too): the stream is made once, on the first stage, and carried: a stage
  before the last appends it to its decoder's output, ``[s, b, H + layers * P]`` (the bridge's
  ``pipeline_hidden_size``), a later stage splits what it receives back into the hidden states and the stream; the
  gradient of both goes back through the same tensor, so the table, the projection and the norm (first stage only)
  get theirs through megatron's schedule. Not recomputed per stage from the ids: it reads the scaled embedding, which
  only the first stage holds. The keys and values a reusing layer takes are not carried: the split keeps it on the
  stage of the layer storing them, or the layout is refused by name (``gemma4_small.SmallModelFields``).
- The table ``[vocab_size_per_layer_input, layers * P]`` is an embedding like the main one: megatron's
  ``VocabParallelEmbedding`` (rows split over TP, reduce-scattered over the sequence under sequence parallelism),
  its rows padded to a multiple of TP where the vocabulary does not split evenly (``PaddedRows``: at most TP - 1
  zero rows no id looks up, never exported); transformers' ``padding_idx`` takes no gradient
  (``pad_without_lookup_gradient``). The projection ``[layers * P, H]`` and the norm are replicated: they act on each
  rank's own tokens (under sequence parallelism their gradients are summed over TP: ``sequence_parallel``). Training
  checkpoints key each as it is split (``PerLayerInputs.sharded_state_dict``; megatron's default for a plain module
  saved one rank's rows of the table for every rank).
- Each layer (``gemma4_layer``, megatron's ``TransformerLayer``): after its MLP's residual add,
  ``x + norm(projection(act(gate(x)) * stream[i]))`` (``per_layer_input_gate`` ``[P, H]``, ``per_layer_projection``
  ``[H, P]``, ``post_per_layer_input_norm``, replicated as the projection above), then the ``layer_scalar``
  (``gemma4._scaled_layer``). The double-wide layers are built from a copy of the config with ``ffn_hidden_size``
  doubled (their MLP, split over TP as any).
- The stream passes beside megatron's layer arguments, so a layer recomputed in the backward could not take its
  gradient: activation recompute is refused with per-layer inputs (``refuse_recompute``). Under context parallelism
  each rank's stream is its own tokens' (``gemma4.py``). LoRA on each layer's per-layer linears as on other
  replicated torch linears (``lora/replicated.py``: their factors summed over TP under SP, as the weights); the
  model's ``per_layer_model_projection`` (first stage, outside the layers) is no target.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.mappings import Mapping, Replicated, _read_into

# megatron's name in a layer -> transformers'
LAYER_TENSORS = {"per_layer_input_gate": "per_layer_input_gate", "per_layer_projection": "per_layer_projection",
                 "post_per_layer_input_norm": "post_per_layer_input_norm"}


def _linear(in_features: int, out_features: int, config) -> torch.nn.Linear:
    """A replicated linear acting on each rank's own tokens (no bias, not initialised: the checkpoint fills it)."""
    linear = torch.nn.utils.skip_init(torch.nn.Linear, in_features, out_features, bias=False,
                                      dtype=config.params_dtype)
    linear.weight.sequence_parallel = bool(config.sequence_parallel)
    return linear


class PerLayerInputs(torch.nn.Module):
    """The per-layer stream (module docstring): ``forward(input_ids [b, s], embeddings [s, b, H])`` -> ``[s, b,
    layers, P]`` (``s`` this rank's tokens)."""

    def __init__(self, config, *, num_layers: int, size: int, vocab: int, pad_token_id: int | None,
                 placeholder_ids: tuple[int, ...] = (), tp_group=None) -> None:
        from megatron.core.tensor_parallel import VocabParallelEmbedding

        from loongforge_hf.bridges.embedding_padding import pad_without_lookup_gradient
        from loongforge_hf.kernels.rmsnorm import RMSNorm

        super().__init__()
        tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        self.num_layers, self.size, self.tp_group, self.sequence_parallel = num_layers, size, tp_group, tp > 1 \
            and bool(config.sequence_parallel)
        self.pad_token_id = pad_token_id
        # NOTE: a buffer (moved with the model): no host-to-device copy in a forward (a captured decode step)
        self.register_buffer("placeholders", torch.tensor(placeholder_ids, dtype=torch.long), persistent=False)
        self.embedding = VocabParallelEmbedding(-(-vocab // tp) * tp, num_layers * size,
                                                init_method=config.init_method,
                                                reduce_scatter_embeddings=self.sequence_parallel, config=config,
                                                tp_group=tp_group)
        pad_without_lookup_gradient(self.embedding, pad_token_id)
        self.projection = _linear(config.hidden_size, num_layers * size, config)
        self.norm = RMSNorm(config, size, eps=config.layernorm_epsilon)

    def forward(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        if self.placeholders.numel():  # NOTE: transformers looks image placeholders up as padding
            input_ids = torch.where(torch.isin(input_ids, self.placeholders), self.pad_token_id, input_ids)
        tokens = self.embedding(input_ids)
        if not self.sequence_parallel:  # NOTE: [b, s, .]; reduce-scattered it comes [s / tp, b, .]
            tokens = tokens.transpose(0, 1)
        tokens = tokens * torch.tensor(self.size ** 0.5).to(tokens.dtype)
        projected = self.projection(embeddings) * embeddings.shape[-1] ** -0.5
        projected = self.norm(projected.view(*projected.shape[:2], self.num_layers, self.size))
        return (projected + tokens.view(*tokens.shape[:2], self.num_layers, self.size)) * 2 ** -0.5

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Training-checkpoint keys as the children split their tensors (the embedding over the vocabulary): megatron's
        default keys a plain module's tensors as replicated over TP, one rank's rows saved for every rank."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        state = {}
        for name, child in self.named_children():
            state.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata,
                                                    tp_group=self.tp_group))
        return state


@functools.cache
def gemma4_layer(*, wide_layers: frozenset[int], per_layer_size: int, activation: str) -> type:
    """megatron's ``TransformerLayer`` with Gemma 4's per-layer input block (``per_layer_size`` > 0) and
    ``wide_layers`` (0-based global indices) built with twice the MLP width (module docstring)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
    from transformers.activations import ACT2FN

    from loongforge_hf.kernels.rmsnorm import RMSNorm

    act = ACT2FN[activation]

    class Gemma4Layer(TransformerLayer):
        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs) -> None:
            # NOTE: megatron passes the stage's own number; TransformerLayer adds this offset to it
            if layer_number - 1 + get_transformer_layer_offset(config, kwargs.get("vp_stage")) in wide_layers:
                config = copy.copy(config)
                config.ffn_hidden_size *= 2
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            self.per_layer_stream = None  # NOTE: the model's holder of the stream (add_per_layer_inputs)
            if per_layer_size:
                h = config.hidden_size
                self.per_layer_input_gate = _linear(h, per_layer_size, config)
                self.per_layer_projection = _linear(per_layer_size, h, config)
                self.post_per_layer_input_norm = RMSNorm(config, h, eps=config.layernorm_epsilon)

        def forward(self, *args, **kwargs):
            output, context = super().forward(*args, **kwargs)
            if per_layer_size:
                stream = self.per_layer_stream.stream[:, :, self.layer_number - 1]
                mixed = act(self.per_layer_input_gate(output)) * stream
                output = output + self.post_per_layer_input_norm(self.per_layer_projection(mixed))
            return output, context

    return Gemma4Layer


def add_per_layer_inputs(chunk, hf_config, *, placeholder_ids: tuple[int, ...] = ()) -> None:
    """Give ``chunk`` (one pipeline stage's ``GPTModel``; the whole model without a pipeline) the hooks that feed
    its layers their per-layer inputs, and the first stage its ``PerLayerInputs``."""
    from megatron.core import parallel_state as ps

    c = hf_config
    if chunk.pre_process:
        chunk.per_layer_inputs = PerLayerInputs(
            chunk.config, num_layers=c.num_hidden_layers, size=c.hidden_size_per_layer_input,
            vocab=c.vocab_size_per_layer_input, pad_token_id=c.pad_token_id, placeholder_ids=placeholder_ids,
            tp_group=ps.get_tensor_model_parallel_group())
    carry_per_layer_inputs(chunk, width=c.hidden_size, layers=c.num_hidden_layers, size=c.hidden_size_per_layer_input)


def carry_per_layer_inputs(chunk, *, width: int, layers: int, size: int,
                           widen: torch.nn.Module | None = None) -> None:
    """Hand ``chunk``'s layers (one pipeline stage's ``GPTModel``) the per-layer inputs ``[s, b, layers, size]``
    through a holder (``per_layer_stream``): the first stage makes them before its decoder
    (``chunk.per_layer_inputs(input_ids, decoder input)``), then ``widen`` (if given) makes the residual the decoder
    carries (``width`` per token) from its input; a later stage splits what it receives into that residual and the
    per-layer inputs; a stage before the last appends them to its decoder's output (module docstring). Call after
    any other pre-hook on the decoder."""
    holder = SimpleNamespace(input_ids=None, stream=None)
    for layer in chunk.decoder.layers:
        layer.per_layer_stream = holder

    def keep_ids(module, args, kwargs):
        holder.input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]

    def enter(decoder, args, kwargs):
        if not chunk.pre_process:  # NOTE: megatron's block reads the received tensor, not its argument
            received = decoder.input_tensor
            decoder.input_tensor = received[..., :width]
            holder.stream = received[..., width:].unflatten(-1, (layers, size))
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        holder.stream = chunk.per_layer_inputs(holder.input_ids, hidden)
        if widen is None:
            return None
        wide = widen(hidden)
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": wide}
        return (wide, *args[1:]), kwargs

    def leave(decoder, args, output):
        stream, holder.input_ids, holder.stream = holder.stream, None, None
        if not chunk.post_process:
            return torch.cat([output, stream.flatten(-2).to(output.dtype)], dim=-1)
        return None

    chunk.register_forward_pre_hook(keep_ids, with_kwargs=True)
    chunk.decoder.register_forward_pre_hook(enter, with_kwargs=True)
    chunk.decoder.register_forward_hook(leave)


@dataclass(frozen=True)
class PaddedRows(Mapping):
    """A table's ``rows`` split over TP, padded with zero rows to a multiple of TP (never exported)."""

    megatron: str
    hf: str
    rows: int
    tp_split = "column"

    def hf_names(self, layer):
        return [self.hf]

    def load(self, reader, ctx, layer):
        per_rank = -(-self.rows // ctx.tp_size)
        start = ctx.tp_rank * per_rank
        real = max(0, min(per_rank, self.rows - start))
        out = torch.zeros(per_rank, *reader.shape(self.hf)[1:], dtype=reader.dtype(self.hf))
        if real:
            _read_into(reader, self.hf, out[:real], dim=0, start=start)
        return out

    def export(self, shards, ctx, layer):
        return {self.hf: torch.cat(shards, dim=0)[:self.rows]}

    def export_parts(self, shard, rank, ctx, layer):
        start = rank * shard.shape[0]
        keep = min(shard.shape[0], self.rows - start)
        return [(self.hf, 0, start, shard[:keep])] if keep > 0 else []


def first_stage_mappings(hf_config) -> list[Mapping]:
    """The per-layer table, the projection and its norm (on the first stage: the whole model)."""
    return [PaddedRows("per_layer_inputs.embedding.weight", "model.embed_tokens_per_layer.weight",
                       hf_config.vocab_size_per_layer_input),
            Replicated("per_layer_inputs.projection.weight", "model.per_layer_model_projection.weight"),
            Replicated("per_layer_inputs.norm.weight", "model.per_layer_projection_norm.weight")]


def layer_mappings() -> list[Mapping]:
    """Each layer's gate, projection and norm."""
    return [Replicated(f"{D}.{ours}.weight", f"{L}.{theirs}.weight") for ours, theirs in LAYER_TENSORS.items()]


def shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """The HF shapes of the per-layer inputs' tensors, every layer's included."""
    c = hf_config
    h, p, n = c.hidden_size, c.hidden_size_per_layer_input, c.num_hidden_layers
    out = {"model.embed_tokens_per_layer.weight": (c.vocab_size_per_layer_input, n * p),
           "model.per_layer_model_projection.weight": (n * p, h), "model.per_layer_projection_norm.weight": (p,)}
    for i in range(n):
        out.update({f"model.layers.{i}.per_layer_input_gate.weight": (p, h),
                    f"model.layers.{i}.per_layer_projection.weight": (h, p),
                    f"model.layers.{i}.post_per_layer_input_norm.weight": (h,)})
    return out
