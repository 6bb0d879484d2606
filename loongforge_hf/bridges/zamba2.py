"""Zamba2ForCausalLM (Zyphra's Zamba2): a stack of Mamba2 layers, the hybrid ones (``layers_block_type`` "hybrid")
first running one of ``num_mem_blocks`` shared transformer blocks on ``concat(hidden, token embeddings)`` whose
output, through the layer's own linear, joins the Mamba2 mixer's input.

Choices:
- Every layer a megatron ``TransformerLayer`` with our ``Mamba2Mixer`` in the self-attention slot
  (``mamba2_layers.py``: TP by heads and groups, B / C replicated where TP exceeds ``mamba_ngroups``, padding, packed
  documents) and no MLP; the hybrid layers hold their adapters, their linear and, on a block's first use, the block
  (``zamba2_shared.py``: one parameter set a block, its gradient summed over the uses). transformers' mixer: a
  time-step floor ``time_step_min`` and no ceiling, the gated norm's epsilon 1e-5 whatever ``rms_norm_eps``, the conv
  with its bias always, ``in_proj`` with no bias (``add_bias_linear`` refused).
- Tensors: a Mamba2 layer's under ``model.layers.N.*``, a hybrid layer's under ``model.layers.N.mamba_decoder.*``
  beside its ``linear``; block ``b`` under ``model.layers.M.shared_transformer.*`` (``M``: its first use), use ``u``'s
  adapters in that block's lists at index ``u`` (``linear_q_adapter_list.u.0`` / ``.1``: ``A`` / ``B``). transformers
  ties the later uses' blocks to the first only with ``tie_word_embeddings`` (it then saves the first alone; without
  it every use keeps a block of its own): other configs are refused. One megatron name stands for other HF names
  from layer to layer (the mixer under ``mamba_decoder``, a use's adapters in its owner's lists): ``ByLayer`` picks
  the layer's own mapping.
- Cached generate (``kv_cache.py``): each use of a shared block attends through a core attention of its own
  (``zamba2_shared``), so each use keeps its own keys and values, as transformers' cache keeps one slot per hybrid
  layer; the Mamba2 mixers keep their conv / SSM states (``mamba2.py``). The static cache is refused
  (``mamba2_layers.py``).
- Zamba (``ZambaForCausalLM``, ``zamba.py``): this bridge on a multi-head Mamba-1 mixer, one block, no adapters.
- Refused before any collective: ``tie_word_embeddings`` off, ``add_bias_linear``, rope types other than the default,
  ``use_long_context``, layer kinds other than the two, heads or KV heads that do not split over TP, what
  ``mamba2_layers.py`` refuses; pipeline parallelism (the embeddings live on the first stage); activation recompute
  at the forward (``zamba2_shared.refuse_recompute``). Context parallelism runs: the Mamba2 scan passes its states
  over the CP group (``mamba2.py``), each use's core attention gathers the keys and values (not Zamba: ``zamba.py``).
- LoRA: ``mappings_for_layer`` gives a layer's own mappings (``ByLayer`` only in ``layer_mappings``, the loader's
  patterns), so the Mamba ``in_proj`` / ``out_proj`` take adapters as Granite 4.0 H's; the planner refuses by name
  (``lora.plan._REFUSED``) the shared blocks' linears (transformers keeps a tied copy of a block in each hybrid
  layer: PEFT gives each use its own adapter, where megatron runs one linear for all the uses), the per-use
  ``linear`` (a plain replicated torch linear) and adapters' linears.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.mamba2_layers import MAMBA, Mamba2Layers
from loongforge_hf.bridges.mappings import (ColumnParallel, Mapping, Replicated, RowParallel, renamed,
                                            streams_export)
from loongforge_hf.bridges.packed_mappings import PackedGatedMLP
from loongforge_hf.bridges.registry import register_bridge

L = "model.layers.{layer}"
D = "decoder.layers.{layer}"
HYBRID = "hybrid"
FIELDS = (C.Field("num_hidden_layers", "num_layers"), C.Field("hidden_size", "hidden_size"),
          C.Field("num_attention_heads", "num_attention_heads"), C.Field("rms_norm_eps", "layernorm_epsilon"),
          C.Field("initializer_range", "init_method_std"))


@dataclass(frozen=True)
class ByLayer(Mapping):
    """One megatron parameter pattern whose HF tensors differ from layer to layer (a hybrid layer's mixer under
    ``mamba_decoder``, a use's adapters in its block's lists): ``choices`` (layer, the mapping there)."""

    megatron: str
    choices: tuple[tuple[int, Mapping], ...]
    tp_split: str | None = None
    hf_dtype: torch.dtype | None = None

    def at(self, layer: int) -> Mapping:
        return dict(self.choices)[layer]

    def hf_names(self, layer):
        return self.at(layer).hf_names(layer)

    def load(self, reader, ctx, layer):
        return self.at(layer).load(reader, ctx, layer)

    def export(self, shards, ctx, layer):
        return self.at(layer).export(shards, ctx, layer)

    @staticmethod
    def of(name: str, choices: list[tuple[int, Mapping]]) -> "ByLayer":
        """``ByLayer`` over ``choices``, streaming its export where theirs does (``mappings.streams_export``)."""
        first = choices[0][1]
        cls = StreamedByLayer if streams_export(first) else ByLayer
        return cls(name, tuple(choices), tp_split=first.tp_split, hf_dtype=first.hf_dtype)


@dataclass(frozen=True)
class StreamedByLayer(ByLayer):
    def export(self, shards, ctx, layer):
        return self.at(layer).export(shards, ctx, layer)

    def export_parts(self, shard, rank, ctx, layer):
        return self.at(layer).export_parts(shard, rank, ctx, layer)


@register_bridge("Zamba2ForCausalLM")
class Zamba2Bridge(Mamba2Layers, DenseBridge):
    per_layer_types = True  # NOTE: layers_block_type checked here
    config_fields = FIELDS
    mamba_layer, mamba_module, mamba_norm = L, "mamba", "input_layernorm"
    mamba_fields = ("n_mamba_heads", "mamba_ngroups")
    block_module = "shared_transformer"  # NOTE: the hybrid layers' block module (Zamba's: shared_transf)

    @property
    def num_blocks(self) -> int:
        return self.hf_config.num_mem_blocks

    @property
    def position_embedding_type(self) -> str:
        return "rope" if self.hf_config.use_mem_rope else "none"

    @property
    def mamba_layers(self) -> frozenset[int]:
        return frozenset(range(self.hf_config.num_hidden_layers))

    @property
    def hybrid(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.hf_config.layers_block_type) if kind == HYBRID)

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        self.check_shared_blocks()
        C.refuse_set_fields(c, arch, (("add_bias_linear", "biases of the Mamba2 and shared-block linears"),
                                      ("use_long_context", "the rescaled long-context rope")))
        if c.use_mem_rope and self.rope_parameters()["rope_type"] != "default":
            raise C.UnsupportedConfigError(f"rope_parameters={c.rope_parameters} is not supported for {arch} (the "
                                           "default rope only).")
        self.check_mamba_dims()

    def check_shared_blocks(self) -> None:
        c, arch = self.hf_config, self.architectures[0]  # NOTE: Zamba's too
        unknown = sorted(set(c.layers_block_type) - {MAMBA[0], HYBRID})
        if unknown:
            raise C.UnsupportedConfigError(f"layers_block_type {unknown} is not supported for {arch}: one of "
                                           f"{[MAMBA[0], HYBRID]} per layer.")
        if not c.tie_word_embeddings:
            raise C.UnsupportedConfigError(
                f"tie_word_embeddings={c.tie_word_embeddings} is not supported for {arch}: transformers then keeps a "
                "block of its own for every use of a shared transformer block instead of sharing it.")

    def rope_parameters(self) -> dict:
        rope = getattr(self.hf_config, "rope_parameters", None) or {}
        return {"rope_type": rope.get("rope_type", "default"), "rope_theta": float(rope.get("rope_theta", 10000.0))}

    def check_layout(self, layout) -> None:
        c, arch, tp = self.hf_config, self.architectures[0], layout.tensor_parallel_size
        self.check_mixer_layout(layout)
        if layout.pipeline_parallel_size > 1:
            raise C.UnsupportedConfigError(
                f"pipeline_parallel_size={layout.pipeline_parallel_size} is not supported for {arch} (the shared "
                "blocks read the token embeddings, which live on the first stage); use tensor, context and data "
                "parallelism.")
        for field in ("num_attention_heads", "num_key_value_heads"):
            if getattr(c, field) % tp:
                raise C.UnsupportedConfigError(f"{field}={getattr(c, field)} does not split over "
                                               f"tensor_parallel_size={tp} for {arch} (the shared attention).")

    def check_mixer_layout(self, layout) -> None:
        Mamba2Layers.check_layout(self, layout)

    def qk_module(self) -> None:
        return None

    def transformer_config_kwargs(self) -> dict:
        c = self.hf_config
        kw = C.hf_to_megatron(c, self.config_fields)
        return {**kw, "num_query_groups": c.num_key_value_heads, "kv_channels": c.attention_head_dim,
                "ffn_hidden_size": c.intermediate_size, "normalization": "RMSNorm", "add_bias_linear": False,
                "hidden_dropout": 0.0, "attention_dropout": 0.0}

    def mamba_dims(self) -> dict:
        c = self.hf_config
        return dict(heads=c.n_mamba_heads, head_dim=c.mamba_headdim, groups=c.mamba_ngroups, d_state=c.mamba_d_state,
                    conv_kernel=c.mamba_d_conv, conv_bias=True, chunk_size=c.chunk_size,
                    time_step_limit=(c.time_step_min, float("inf")), eps=1e-5)

    def shared_sizes(self):
        from loongforge_hf.bridges.zamba2_shared import SharedSizes

        c = self.hf_config
        return SharedSizes(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                           head_dim=c.attention_head_dim, intermediate=c.intermediate_size, rank=c.adapter_rank,
                           qkv_adapters=bool(c.use_shared_attention_adapter), rope=bool(c.use_mem_rope),
                           activation=c.hidden_act, eps=c.rms_norm_eps)

    def layer_module(self) -> type:
        from loongforge_hf.bridges.zamba2_shared import zamba2_layer

        return zamba2_layer(hybrid=self.hybrid, num_blocks=self.num_blocks, sizes=self.shared_sizes())

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.zamba2_shared import attach_shared_blocks

        attach_shared_blocks(model)

    # ---- tensors --------------------------------------------------------------------------------------------
    def final_mappings(self) -> list[Mapping]:
        return [Replicated("decoder.final_layernorm.weight", "model.final_layernorm.weight")]

    def _owner(self, use: int) -> int:
        """The layer whose ``shared_transformer`` holds use ``use``'s block and adapters."""
        return self.hybrid[use % self.num_blocks]

    def _block_mappings(self, layer: int) -> list[Mapping]:
        m, hf = f"{D}.shared_block", f"{L}.{self.block_module}"
        return [Replicated(f"{m}.input_layernorm.weight", f"{hf}.input_layernorm.weight"),
                *(ColumnParallel(f"{m}.{x}_proj.weight", f"{hf}.self_attn.{x}_proj.weight") for x in "qkv"),
                RowParallel(f"{m}.o_proj.weight", f"{hf}.self_attn.o_proj.weight"),
                Replicated(f"{m}.pre_ff_layernorm.weight", f"{hf}.pre_ff_layernorm.weight"),
                self._gate_up_mapping(f"{m}.gate_up_proj.weight", f"{hf}.feed_forward"),
                RowParallel(f"{m}.down_proj.weight", f"{hf}.feed_forward.down_proj.weight")]

    def _gate_up_mapping(self, megatron: str, mlp: str) -> Mapping:
        return PackedGatedMLP(megatron, f"{mlp}.gate_up_proj.weight",
                              intermediate_size=self.hf_config.intermediate_size)

    def _adapter_mappings(self, use: int) -> list[Mapping]:
        c, hf = self.hf_config, f"model.layers.{self._owner(use)}.shared_transformer"
        m = f"{D}.adapters"
        maps = [Replicated(f"{m}.gate_up.down.weight", f"{hf}.feed_forward.gate_up_proj_adapter_list.{use}.0.weight"),
                PackedGatedMLP(f"{m}.gate_up.up.weight", f"{hf}.feed_forward.gate_up_proj_adapter_list.{use}.1.weight",
                               intermediate_size=c.intermediate_size)]
        if c.use_shared_attention_adapter:
            for x in "qkv":
                name = f"{hf}.self_attn.linear_{x}_adapter_list.{use}"
                maps += [Replicated(f"{m}.{x}.down.weight", f"{name}.0.weight"),
                         ColumnParallel(f"{m}.{x}.up.weight", f"{name}.1.weight")]
        return maps

    def layer_mappings(self) -> list[Mapping]:
        """Each megatron name's ``ByLayer`` (the loader's patterns; a layer's own: ``mappings_for_layer``)."""
        by_name: dict[str, list[tuple[int, Mapping]]] = {}
        for layer, maps in enumerate(self._own):
            for m in maps:
                by_name.setdefault(m.megatron, []).append((layer, m))
        return [ByLayer.of(name, choices) for name, choices in by_name.items()]

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        return self._own[layer]

    @functools.cached_property
    def _own(self) -> list[list[Mapping]]:
        """Each layer's own mappings (HF names of that layer alone; built once: the loader asks per tensor)."""
        return [self._mappings_at(layer) for layer in range(self.hf_config.num_hidden_layers)]

    def _mappings_at(self, layer: int) -> list[Mapping]:
        if layer not in self.hybrid:
            return self.mamba_mappings()
        use = self.hybrid.index(layer)
        maps = [renamed(m, f"{L}.", f"{L}.mamba_decoder.") for m in self.mamba_mappings()]
        maps += [Replicated(f"{D}.linear.weight", f"{L}.linear.weight"), *self._adapter_mappings(use)]
        if use < self.num_blocks:
            maps += self._block_mappings(layer)
        return maps

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        if layer not in self.hybrid:
            return self.mamba_shapes(L.format(layer=layer))
        h, use = self.hf_config.hidden_size, self.hybrid.index(layer)
        shapes = {**self.mamba_shapes(f"model.layers.{layer}.mamba_decoder"),
                  f"model.layers.{layer}.linear.weight": (h, h), **self._adapter_shapes(use)}
        if use < self.num_blocks:
            shapes.update(self._block_shapes(f"model.layers.{layer}.{self.block_module}"))
        return shapes

    def _adapter_shapes(self, use: int) -> dict[str, tuple[int, ...]]:
        c, h = self.hf_config, self.hf_config.hidden_size
        hf, r, i = f"model.layers.{self._owner(use)}.shared_transformer", c.adapter_rank, c.intermediate_size
        shapes = {f"{hf}.feed_forward.gate_up_proj_adapter_list.{use}.0.weight": (r, h),
                  f"{hf}.feed_forward.gate_up_proj_adapter_list.{use}.1.weight": (2 * i, r)}
        if c.use_shared_attention_adapter:
            for x in "qkv":
                shapes[f"{hf}.self_attn.linear_{x}_adapter_list.{use}.0.weight"] = (r, 2 * h)
                shapes[f"{hf}.self_attn.linear_{x}_adapter_list.{use}.1.weight"] = (2 * h, r)
        return shapes

    def _block_shapes(self, hf: str) -> dict[str, tuple[int, ...]]:
        c, h, i = self.hf_config, self.hf_config.hidden_size, self.hf_config.intermediate_size
        d = c.attention_head_dim
        return {f"{hf}.input_layernorm.weight": (2 * h,), f"{hf}.pre_ff_layernorm.weight": (h,),
                f"{hf}.self_attn.q_proj.weight": (c.num_attention_heads * d, 2 * h),
                f"{hf}.self_attn.k_proj.weight": (c.num_key_value_heads * d, 2 * h),
                f"{hf}.self_attn.v_proj.weight": (c.num_key_value_heads * d, 2 * h),
                f"{hf}.self_attn.o_proj.weight": (h, c.num_attention_heads * d),
                **self._mlp_shapes(f"{hf}.feed_forward"), f"{hf}.feed_forward.down_proj.weight": (h, i)}

    def _mlp_shapes(self, mlp: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        return {f"{mlp}.gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                  "model.final_layernorm.weight": (c.hidden_size,)}
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes
