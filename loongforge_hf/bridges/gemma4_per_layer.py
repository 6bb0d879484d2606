"""Gemma 4's per-layer inputs (``hidden_size_per_layer_input``: Gemma 4 E2B / E4B) and its double-wide MLPs
(``use_double_wide_mlp``: twice ``intermediate_size`` in the layers that reuse another's keys and values).

Choices:
- The per-layer stream (transformers' ``get_per_layer_inputs`` / ``project_per_layer_inputs``), one
  ``[s, b, layers, P]`` tensor per forward, made by ``PerLayerInputs`` (``per_layer_inputs`` of the first stage's
  ``GPTModel``) from the decoder's input (the scaled token embeddings, images in place for the image-text model)
  and the input ids: ``(norm(proj(x) / sqrt(H)) + table[ids] * sqrt(P)) / sqrt(2)``, ids of image placeholders
  looked up as ``pad_token_id``, as transformers does. A forward pre-hook on ``GPTModel`` keeps the ids, one on the
  decoder makes the stream, every layer reads its slice (``per_layer_stream``); the decoder's forward hook drops it.
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
  gradient: activation recompute is refused with per-layer inputs, as is a pipeline (the stream is made on the
  first stage): ``gemma4.py``. LoRA on the per-layer linears is refused by name (``lora/plan.py``: replicated
  tensors carry no adapter), ``exclude_modules`` naming them.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from loongforge_hf.bridges import config_map as C
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
    ``wide_layers`` (0-based; no pipeline, so global) built with twice the MLP width (module docstring)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from transformers.activations import ACT2FN

    from loongforge_hf.kernels.rmsnorm import RMSNorm

    act = ACT2FN[activation]

    class Gemma4Layer(TransformerLayer):
        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs) -> None:
            if layer_number - 1 in wide_layers:
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
    """Give ``chunk`` (a whole model: no pipeline) its ``PerLayerInputs`` and the hooks that feed its layers."""
    from megatron.core import parallel_state as ps

    holder = SimpleNamespace(input_ids=None, stream=None)
    chunk.per_layer_inputs = PerLayerInputs(
        chunk.config, num_layers=hf_config.num_hidden_layers, size=hf_config.hidden_size_per_layer_input,
        vocab=hf_config.vocab_size_per_layer_input, pad_token_id=hf_config.pad_token_id,
        placeholder_ids=placeholder_ids, tp_group=ps.get_tensor_model_parallel_group())
    for layer in chunk.decoder.layers:
        layer.per_layer_stream = holder

    def keep_ids(module, args, kwargs):
        holder.input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]

    def make_stream(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        holder.stream = chunk.per_layer_inputs(holder.input_ids, hidden)

    def drop(*_):
        holder.input_ids = holder.stream = None

    chunk.register_forward_pre_hook(keep_ids, with_kwargs=True)
    chunk.decoder.register_forward_pre_hook(make_stream, with_kwargs=True)
    chunk.decoder.register_forward_hook(drop)


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


class SmallModelFields:
    """E2B / E4B's config fields on ``gemma4.Gemma4Bridge``."""

    def check_kv_sharing(self) -> int:
        """``num_kv_shared_layers`` (returned) and ``kv_modes`` / ``reusing_layers`` from it (Gemma 3n's too)."""
        c = self.hf_config
        shared = int(c.num_kv_shared_layers or 0)
        if shared and not 0 < shared < c.num_hidden_layers:
            raise C.UnsupportedConfigError(f"num_kv_shared_layers={shared}: at least one of the "
                                           f"{c.num_hidden_layers} layers must compute keys and values.")
        try:
            self.kv_modes = list(c.kv_sharing_modes) if shared else None
        except ValueError as err:  # NOTE: a shared layer type no earlier layer computes
            raise C.UnsupportedConfigError(f"num_kv_shared_layers={shared}: {err}.") from None
        self.reusing_layers = frozenset(i for i, m in enumerate(self.kv_modes or ()) if m == "reuse")
        return shared

    def check_small_model_fields(self) -> None:
        """E2B / E4B's fields (module docstring): ``per_layer_size``, ``kv_modes`` (None without sharing),
        ``reusing_layers`` and ``wide_layers``; ``UnsupportedConfigError`` naming a field they cannot run with."""
        c = self.hf_config
        # NOTE: Gemma 4 Unified's text config has no per-layer inputs nor MoE block (reading those fields raises)
        self.per_layer_size = int(getattr(c, "hidden_size_per_layer_input", 0) or 0)
        shared = self.check_kv_sharing()
        self.wide_layers = self.reusing_layers if c.use_double_wide_mlp else frozenset()
        if (self.per_layer_size or shared) and getattr(c, "enable_moe_block", False):
            raise C.UnsupportedConfigError("hidden_size_per_layer_input / num_kv_shared_layers with "
                                           "enable_moe_block=True are not supported for Gemma4ForCausalLM (no such "
                                           "Gemma 4 is published).")

    @property
    def small_model_features(self) -> list[str]:
        """The E2B / E4B fields this config sets (each refuses pipelines, CP and recompute)."""
        return [f"{name}={getattr(self.hf_config, name)}" for name, on in
                (("hidden_size_per_layer_input", self.per_layer_size), ("num_kv_shared_layers", self.kv_modes))
                if on]


def refuse_recompute(features: list[str], decoder, args) -> None:
    if decoder.training and decoder.config.recompute_granularity is not None:
        raise ValueError(f"activation checkpointing (recompute) is not supported for Gemma 4 with "
                         f"{' and '.join(features)}: the per-layer stream and the shared keys and values pass beside "
                         "megatron's layer arguments, which a recomputed layer would not take gradients through.")
