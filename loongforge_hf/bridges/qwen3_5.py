"""Qwen3_5ForCausalLM (the text model of Qwen3.5, ``Qwen3_5TextConfig``): Gated DeltaNet linear-attention layers and
gated full-attention layers interleaved (``layer_types``), a gated SwiGLU MLP in every layer.

Choices:
- ``linear_attention`` layers: ``linear_attn.*`` -> our ``GatedDeltaNet`` in megatron's self-attention slot
  (``gated_deltanet.py``: TP by heads, the padding mask, packed documents, refusals), its tensors mapped by
  ``gated_mappings.HeadSections``: ``in_proj`` = this rank's heads of ``in_proj_qkv`` (q, k, v), ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``; ``conv_weight`` = ``conv1d.weight``'s q, k, v channels; ``A_log`` / ``dt_bias`` split
  with the value heads; ``norm_weight`` (the gated RMSNorm, plain ``weight * x``) replicated; ``out_proj``
  row-parallel.
- ``full_attention`` layers: megatron's ``SelfAttention`` with ``attention_output_gate``: ``q_proj`` gives each head
  its query and a sigmoid gate on its attention output (``gated_mappings.GatedQKV``); per-head q / k RMSNorms in the
  q / k norm slots, before the rotation; GQA; partial rotary (``partial_rotary_factor``: megatron's
  ``rotary_percent``, halves rotated as transformers' ``rotate_half``). The text model's multimodal rope
  (``mrope_section``) gives every channel the text position, i.e. plain rope. megatron applies the gate in fp32 and
  rounds once, transformers in the activations' dtype: the same in fp32.
- Norms are zero-centred (``Qwen3_5RMSNorm``: ``weight`` stored, ``1 + weight`` applied in fp32): megatron's
  ``layernorm_zero_centered_gamma`` on our RMSNorm (input, post-attention, q / k and final norms), as Gemma's.
- Tied embeddings (the small Qwen3.5 checkpoints) as ``DenseBridge``.
- The hub checkpoints' multi-token-prediction tensors (``mtp.*``, which transformers skips) are not built, and
  ``save_pretrained`` copies them unchanged from the source folder (``passthrough_names``), as DeepSeek's.
- ``generate`` with the dynamic cache: the full-attention layers' keys and values and the Gated DeltaNet layers'
  conv and recurrent states (``kv_cache.py``, ``gated_deltanet.py``), as transformers' dynamic cache for Qwen3.5.
- Context parallelism: the full-attention layers as every model's; the Gated DeltaNet layers pass the conv's tail
  and the recurrent state between the load-balanced chunks (``parallel/delta_rule_cp.py``), padding and packed
  documents included. ``generate`` under CP runs without the cache only (``use_cache=False``): the split prefill
  cannot fill the layers' states (``kv_cache.patched`` refuses it, on every rank before the forward).
- Refused: linear heads that do not split over TP, ``cache_implementation="static"`` (its fixed-shape decode step
  keeps no recurrent state: ``generation_refusal``), ``attention_bias`` (megatron ties o_proj's bias to the MLP's),
  ``hidden_act`` other than silu (the conv's and the gated norm's activation), unknown ``layer_types``.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.gated_mappings import GatedQKV, HeadSections
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.registry import register_bridge

LAYER_TYPES = ("linear_attention", "full_attention")
A = f"{L}.linear_attn"
S = f"{D}.self_attention"


@register_bridge("Qwen3_5ForCausalLM")
class Qwen3_5Bridge(DenseBridge):
    qk_norm = True
    per_layer_types = True  # NOTE: layer_types checked here
    extra_rope_types = ()
    has_passthrough = True

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        check_linear_attention(self.hf_config, self.architectures[0])
        super().check_config()

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` for a parallel layout the linear-attention layers cannot run (pure: called
        before any collective, every rank raises alike)."""
        c, arch = self.hf_config, self.architectures[0]
        tp = layout.tensor_parallel_size
        for field in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(c, field) % tp:
                raise C.UnsupportedConfigError(f"{field}={getattr(c, field)} does not split over "
                                               f"tensor_parallel_size={tp} for {arch}.")

    def generation_refusal(self, generation_config) -> str | None:
        if generation_config.use_cache and generation_config.cache_implementation == "static":
            return (f"cache_implementation='static' is not supported for {self.architectures[0]}: the static cache's "
                    "fixed-shape decode step keeps no Gated DeltaNet state; use the default dynamic cache.")
        return None

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    @property
    def linear_layers(self) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(self.hf_config.layer_types) if kind == "linear_attention")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "layernorm_zero_centered_gamma": True,
                "attention_output_gate": True}

    def attention_module(self) -> type:
        from loongforge_hf.bridges.gated_deltanet import hybrid_self_attention

        c = self.hf_config
        return hybrid_self_attention(linear=self.linear_layers, key_heads=c.linear_num_key_heads,
                                     value_heads=c.linear_num_value_heads, key_dim=c.linear_key_head_dim,
                                     value_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
                                     eps=c.rms_norm_eps)

    # ---- tensors --------------------------------------------------------------------------------------------
    def passthrough_names(self, names) -> list[str]:
        return [n for n in names if n.startswith("mtp.")]

    def attention_mappings(self) -> list[Mapping]:
        return [
            Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
            GatedQKV(f"{S}.linear_qkv.weight", q=f"{L}.self_attn.q_proj.weight", k=f"{L}.self_attn.k_proj.weight",
                     v=f"{L}.self_attn.v_proj.weight"),
            RowParallel(f"{S}.linear_proj.weight", f"{L}.self_attn.o_proj.weight"),
            Replicated(f"{S}.q_layernorm.weight", f"{L}.self_attn.q_norm.weight"),
            Replicated(f"{S}.k_layernorm.weight", f"{L}.self_attn.k_norm.weight"),
        ]

    def linear_attention_mappings(self) -> list[Mapping]:
        c = self.hf_config
        kd, vd, nv = (c.linear_num_key_heads * c.linear_key_head_dim,
                      c.linear_num_value_heads * c.linear_value_head_dim, c.linear_num_value_heads)
        return [
            Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
            HeadSections(f"{S}.in_proj.weight", ((f"{A}.in_proj_qkv.weight", (kd, kd, vd)),
                                                 (f"{A}.in_proj_z.weight", (vd,)), (f"{A}.in_proj_b.weight", (nv,)),
                                                 (f"{A}.in_proj_a.weight", (nv,)))),
            HeadSections(f"{S}.conv_weight", ((f"{A}.conv1d.weight", (kd, kd, vd)),)),
            ColumnParallel(f"{S}.A_log", f"{A}.A_log"),
            ColumnParallel(f"{S}.dt_bias", f"{A}.dt_bias"),
            Replicated(f"{S}.norm_weight", f"{A}.norm.weight"),
            RowParallel(f"{S}.out_proj.weight", f"{A}.out_proj.weight"),
        ]

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.linear_attention_mappings()[1:] + self.dense_mlp_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mixer = self.linear_attention_mappings() if layer in self.linear_layers else self.attention_mappings()
        return mixer + self.dense_mlp_mappings()

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().attention_shapes(prefix)
        c = self.hf_config
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (2 * c.num_attention_heads * C.head_dim_of(c), c.hidden_size)
        return shapes

    def linear_attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"{prefix}.linear_attn"
        kd, vd, nv = (c.linear_num_key_heads * c.linear_key_head_dim,
                      c.linear_num_value_heads * c.linear_value_head_dim, c.linear_num_value_heads)
        h = c.hidden_size
        return {f"{prefix}.input_layernorm.weight": (h,), f"{p}.in_proj_qkv.weight": (2 * kd + vd, h),
                f"{p}.in_proj_z.weight": (vd, h), f"{p}.in_proj_b.weight": (nv, h), f"{p}.in_proj_a.weight": (nv, h),
                f"{p}.conv1d.weight": (2 * kd + vd, 1, c.linear_conv_kernel_dim), f"{p}.A_log": (nv,),
                f"{p}.dt_bias": (nv,), f"{p}.norm.weight": (c.linear_value_head_dim,), f"{p}.out_proj.weight": (h, vd)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        mixer = self.linear_attention_shapes(prefix) if layer in self.linear_layers else self.attention_shapes(prefix)
        return {**mixer, **self.dense_mlp_shapes(prefix)}


def check_linear_attention(c, arch: str, kinds: tuple[str, ...] = LAYER_TYPES) -> None:
    """``UnsupportedConfigError`` for a config of Gated DeltaNet and full-attention layers (``layer_types``) that
    ``gated_deltanet.py`` cannot run exactly (Qwen3.5, Qwen3-Next, OLMo Hybrid): unknown layer kinds, value heads
    that are not a multiple of the key heads, an activation other than silu, attention biases (``kinds``: the
    layer kinds the bridge builds; LaraMini's adds ``sliding_attention``)."""
    types = list(c.layer_types or [])
    unknown = sorted(set(types) - set(kinds))
    if unknown:
        raise C.UnsupportedConfigError(f"layer_types {unknown} are not supported for {arch}; supported: "
                                       f"{list(kinds)}.")
    if len(types) != c.num_hidden_layers:
        raise C.UnsupportedConfigError(f"layer_types has {len(types)} entries for {c.num_hidden_layers} layers.")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise C.UnsupportedConfigError(
            f"linear_num_value_heads={c.linear_num_value_heads} is not a multiple of linear_num_key_heads="
            f"{c.linear_num_key_heads} for {arch}.")
    if c.hidden_act != "silu":
        raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only 'silu': "
                                       "the linear-attention conv and gated norm use it).")
    if getattr(c, "attention_bias", False):
        raise C.UnsupportedConfigError(f"attention_bias=True is not supported for {arch}: megatron's attention "
                                       "output projection has a bias exactly when the MLP's linears do.")
