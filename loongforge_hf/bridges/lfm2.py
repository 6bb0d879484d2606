"""Lfm2ForCausalLM (Liquid AI's LFM2: LFM2-350M / 700M / 1.2B / 2.6B): short-convolution and attention layers
(``layer_types``: ``conv`` / ``full_attention``), a SwiGLU MLP in every layer.

Choices:
- ``conv`` layers: ``conv.*`` -> our ``ShortConvMixer`` in megatron's self-attention slot (``short_conv.py``: TP by
  channels, the padding mask, packed documents, the cached generate's conv state, context parallelism through the
  conv's halo), its tensors mapped by ``gated_mappings.HeadSections``: ``in_proj`` (and its bias with
  ``conv_bias``) = this rank's channels of each of transformers' ``B``, ``C``, ``x`` blocks; ``conv_weight`` /
  ``conv_bias`` = ``conv.conv``'s channels likewise; ``out_proj`` row-parallel, its bias whole.
- ``full_attention`` layers: megatron's ``SelfAttention`` (GQA, rope) with per-head q / k RMSNorms
  (``q_layernorm`` / ``k_layernorm``, before the rotation) in megatron's q / k norm slots; ``out_proj`` is
  megatron's ``linear_proj``.
- Norms: ``operator_norm`` before the mixer (megatron's ``input_layernorm``), ``ffn_norm`` before the MLP, and
  ``embedding_norm`` after the last layer (despite its name: megatron's ``final_layernorm``), all at ``norm_eps``.
- MLP: ``feed_forward.w1`` (gate), ``w3`` (up), ``w2`` (down), silu (the config has no ``hidden_act``); its width is
  transformers' ``block_auto_adjust_ff_dim`` rule on ``intermediate_size`` (``ffn_size``).
- Cached ``generate``: the attention layers' keys and values and the conv layers' conv states in our KV cache
  (``kv_cache.py``); greedy, sampling, beam search. The static cache is refused (its fixed-shape decode step keeps no
  conv state). Under context parallelism generate runs without the cache.
- Refused before any collective: ``hidden_size`` that does not split over TP (the conv's channels), unknown
  ``layer_types``, ``conv_L_cache`` < 1.
- LFM3 (``lfm3.py``) sets three options of ``Lfm2Layers``: its ``layer_kinds``, ``post_norms`` (a norm on each
  mixer's output) and ``self_attention_class`` (the attention layers' class).
"""

from __future__ import annotations

import torch.nn.functional as F

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.fused_mappings import QKV, GatedMLP
from loongforge_hf.bridges.gated_mappings import HeadSections
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel, renamed
from loongforge_hf.bridges.registry import register_bridge

LAYER_TYPES = ("conv", "full_attention")
S = f"{D}.self_attention"
CONV = f"{L}.conv"
# NOTE: the megatron-side table has no hidden_act (silu, fixed) nor intermediate_size (``ffn_size``)
LFM2_FIELDS = tuple(f for f in C.fields_with_eps("norm_eps") if f.hf not in ("hidden_act", "intermediate_size"))


class Lfm2Layers:
    """Mixed in before a dense or MoE bridge: LFM2's conv and attention layers, norms, MLP names and checks."""

    qk_norm = True
    per_layer_types = True  # NOTE: layer_types checked here
    own_activation = True  # NOTE: no hidden_act in the config: silu, set in transformer_config_kwargs
    extra_rope_types = ()
    config_fields = LFM2_FIELDS
    layer_kinds = LAYER_TYPES
    post_norms = False  # NOTE: a norm on each mixer's output (LFM3's sandwich norms: lfm3.py)

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        kinds = list(c.layer_types or [])
        unknown = sorted(set(kinds) - set(self.layer_kinds))
        if unknown or len(kinds) != c.num_hidden_layers:
            raise C.UnsupportedConfigError(f"layer_types {kinds} is not supported for {arch}: one of "
                                           f"{list(self.layer_kinds)} per layer ({c.num_hidden_layers}).")
        if c.conv_L_cache < 1:
            raise C.UnsupportedConfigError(f"conv_L_cache={c.conv_L_cache} is not supported for {arch} (at least 1).")
        super().check_config()

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` for a parallel layout the conv layers cannot run (pure: called before any
        collective, every rank raises alike)."""
        tp, h = layout.tensor_parallel_size, self.hf_config.hidden_size
        if self.conv_layers and h % tp:
            raise C.UnsupportedConfigError(f"hidden_size={h} does not split over tensor_parallel_size={tp} for "
                                           f"{self.architectures[0]} (the conv layers split their channels).")

    def generation_refusal(self, generation_config) -> str | None:
        if generation_config.use_cache and generation_config.cache_implementation == "static" and self.conv_layers:
            return (f"cache_implementation='static' is not supported for {self.architectures[0]}: the static cache's "
                    "fixed-shape decode step keeps no conv state; use the default dynamic cache.")
        return None

    @property
    def conv_layers(self) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(self.hf_config.layer_types) if kind == "conv")

    def ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "activation_func": F.silu, "ffn_hidden_size": self.ffn_size()}

    def attention_module(self) -> type:
        from loongforge_hf.bridges.short_conv import hybrid_short_conv_attention

        c = self.hf_config
        return hybrid_short_conv_attention(conv=self.conv_layers, conv_kernel=c.conv_L_cache, bias=bool(c.conv_bias),
                                           attention=self.self_attention_class(), post_norm=self.post_norms)

    def self_attention_class(self) -> type | None:
        """The attention layers' class (None: megatron's ``SelfAttention``)."""
        return None

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        a = f"{L}.self_attn"
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.operator_norm.weight"),
                QKV(f"{S}.linear_qkv.weight", q=f"{a}.q_proj.weight", k=f"{a}.k_proj.weight", v=f"{a}.v_proj.weight"),
                RowParallel(f"{S}.linear_proj.weight", f"{a}.out_proj.weight"),
                Replicated(f"{S}.q_layernorm.weight", f"{a}.q_layernorm.weight"),
                Replicated(f"{S}.k_layernorm.weight", f"{a}.k_layernorm.weight")]

    def conv_mappings(self) -> list[Mapping]:
        h = self.hf_config.hidden_size
        maps = [Replicated(f"{D}.input_layernorm.weight", f"{L}.operator_norm.weight"),
                HeadSections(f"{S}.in_proj.weight", ((f"{CONV}.in_proj.weight", (h, h, h)),)),
                ColumnParallel(f"{S}.conv_weight", f"{CONV}.conv.weight"),
                RowParallel(f"{S}.out_proj.weight", f"{CONV}.out_proj.weight")]
        if self.hf_config.conv_bias:
            maps += [HeadSections(f"{S}.in_proj.bias", ((f"{CONV}.in_proj.bias", (h, h, h)),)),
                     ColumnParallel(f"{S}.conv_bias", f"{CONV}.conv.bias"),
                     Replicated(f"{S}.out_proj.bias", f"{CONV}.out_proj.bias")]
        return maps

    def dense_mlp_mappings(self) -> list[Mapping]:
        f = f"{L}.feed_forward"
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.ffn_norm.weight"),
                GatedMLP(f"{D}.mlp.linear_fc1.weight", gate=f"{f}.w1.weight", up=f"{f}.w3.weight"),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{f}.w2.weight")]

    def mlp_mappings(self, layer: int) -> list[Mapping]:
        """The pre-MLP norm and MLP of ``layer``."""
        return self.dense_mlp_mappings()

    def every_mlp_mapping(self) -> list[Mapping]:
        return self.dense_mlp_mappings()

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.conv_mappings()[1:] + self.every_mlp_mapping()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mixer = self.conv_mappings() if layer in self.conv_layers else self.attention_mappings()
        return mixer + self.mlp_mappings(layer)

    def final_mappings(self) -> list[Mapping]:
        return [renamed(m, "model.norm.", "model.embedding_norm.") for m in super().final_mappings()]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"{prefix}.self_attn"
        h, hd, kv = c.hidden_size, C.head_dim_of(c), C.kv_heads_of(c)
        return {f"{prefix}.operator_norm.weight": (h,), f"{p}.q_proj.weight": (c.num_attention_heads * hd, h),
                f"{p}.k_proj.weight": (kv * hd, h), f"{p}.v_proj.weight": (kv * hd, h),
                f"{p}.out_proj.weight": (h, c.num_attention_heads * hd), f"{p}.q_layernorm.weight": (hd,),
                f"{p}.k_layernorm.weight": (hd,)}

    def conv_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"{prefix}.conv"
        h = c.hidden_size
        shapes = {f"{prefix}.operator_norm.weight": (h,), f"{p}.in_proj.weight": (3 * h, h),
                  f"{p}.conv.weight": (h, 1, c.conv_L_cache), f"{p}.out_proj.weight": (h, h)}
        if c.conv_bias:
            shapes.update({f"{p}.in_proj.bias": (3 * h,), f"{p}.conv.bias": (h,), f"{p}.out_proj.bias": (h,)})
        return shapes

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.ffn_size(), f"{prefix}.feed_forward"
        return {f"{prefix}.ffn_norm.weight": (h,), f"{p}.w1.weight": (f, h), f"{p}.w3.weight": (f, h),
                f"{p}.w2.weight": (h, f)}

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        return self.dense_mlp_shapes(f"model.layers.{layer}")

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        mixer = self.conv_shapes(prefix) if layer in self.conv_layers else self.attention_shapes(prefix)
        return {**mixer, **self.mlp_shapes(layer)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_hf_shapes()
        shapes["model.embedding_norm.weight"] = shapes.pop("model.norm.weight")
        return shapes


@register_bridge("Lfm2ForCausalLM")
class Lfm2Bridge(Lfm2Layers, DenseBridge):
    def ffn_size(self) -> int:
        """transformers' ``Lfm2MLP`` width: with ``block_auto_adjust_ff_dim``, 2/3 of ``intermediate_size`` times
        ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``."""
        c = self.hf_config
        size = c.intermediate_size
        if c.block_auto_adjust_ff_dim:
            size = int(2 * size / 3)
            if c.block_ffn_dim_multiplier is not None:
                size = int(c.block_ffn_dim_multiplier * size)
                size = c.block_multiple_of * ((size + c.block_multiple_of - 1) // c.block_multiple_of)
        return size
