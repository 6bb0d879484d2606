"""RecurrentGemmaForCausalLM (Google's RecurrentGemma 2B / 9B: Griffin's recurrent blocks and local attention):
``block_types`` cycled over the layers, each a temporal block (RG-LRU recurrence or local MQA attention) and a gated
GELU MLP, Gemma's norms, scaled embedding and soft-capped logits.

Choices:
- Recurrent layers (``layer_types``: ``linear_attention``): ``temporal_block.*`` -> our ``RecurrentBlock`` in
  megatron's self-attention slot (``recurrent_gemma_block.py``: TP by the RG-LRU's heads, padding, packed
  documents); ``in_proj`` = this rank's channels of ``linear_x`` then ``linear_y`` (``gated_mappings.HeadSections``,
  weights and biases), the conv, ``recurrent_param`` and the gates' heads column-parallel, ``linear_out``
  row-parallel, its bias whole.
- Attention layers (``sliding_attention``): megatron's ``SelfAttention`` with transformers' window
  (``attention_window_size``: ``layer_types.layer_windows``), rotary over the first half of each head
  (``partial_rotary_factor``: megatron's ``rotary_percent``), MQA's single KV head replicated over TP by the builder;
  ``o_proj``'s bias (always on) as megatron's ``linear_proj.bias`` (``add_bias_linear``, which the MLP's linears
  need too).
- MLP: ``mlp_block.{gate,up,down}_proj`` with biases, ``intermediate_size // 2`` wide (transformers' width),
  ``hidden_activation`` (tanh GELU). Norms: Gemma's zero-centred RMS norms (``temporal_pre_norm`` before the
  temporal block, ``channel_pre_norm`` before the MLP, ``final_norm``).
- The embedding's output times ``sqrt(hidden_size)`` rounded to bf16 whatever the dtype (transformers' ``normalizer``
  buffer is bf16); logits soft-capped at ``logits_soft_cap`` (``layer_outputs.softcap_logits``, the fused loss too).
- Refused before any collective: ``num_attention_heads`` (the RG-LRU's heads) that does not split over TP,
  ``block_types`` other than recurrent / attention,
  ``hidden_activation`` other than ``gelu_pytorch_tanh`` (the recurrent block's ``linear_y`` uses it),
  ``lru_width`` that does not split into the heads; the static cache (its fixed-shape decode step keeps no conv /
  RG-LRU state).
- Cached ``generate``: the attention layers' keys and values and the recurrent layers' conv and RG-LRU states in our
  KV cache (``kv_cache.py``); greedy, sampling, beam search.
- Context parallelism: the recurrent blocks pass the conv's halo and the RG-LRU's states between megatron's CP
  chunks (``recurrent_gemma_block.py``), the local attention takes its window over the all-gathered keys
  (``kernels.attention``).
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.fused_mappings import QKV, GatedMLP
from loongforge_hf.bridges.gated_mappings import HeadSections
from loongforge_hf.bridges.layer_outputs import scale_embedding, softcap_logits
from loongforge_hf.bridges.layer_types import layer_windows
from loongforge_hf.bridges.mamba2_lm import attention_sizes
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.registry import register_bridge

ARCH = "RecurrentGemmaForCausalLM"
S = f"{D}.self_attention"
T = f"{L}.temporal_block"
GATES = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias")
# NOTE: no hidden_act (hidden_activation), intermediate_size (halved) nor initializer_range in the table
FIELDS = tuple(f for f in C.DENSE_FIELDS if f.hf not in ("hidden_act", "intermediate_size", "initializer_range"))


@register_bridge(ARCH)
class RecurrentGemmaBridge(DenseBridge):
    supports_sliding_window = True
    per_layer_types = True
    own_activation = True
    config_fields = FIELDS

    def __init__(self, hf_config) -> None:
        self.qkv_bias = bool(getattr(hf_config, "attention_bias", False))
        super().__init__(attention_sizes(hf_config, heads=hf_config.num_attention_heads))

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        unknown = sorted(set(c.block_types) - {"recurrent", "attention"})
        if unknown:
            raise C.UnsupportedConfigError(f"block_types {list(c.block_types)} is not supported for {ARCH}: "
                                           "'recurrent' or 'attention' each.")
        if c.hidden_activation != "gelu_pytorch_tanh":
            raise C.UnsupportedConfigError(f"hidden_activation={c.hidden_activation!r} is not supported for {ARCH} "
                                           "(only 'gelu_pytorch_tanh': the recurrent blocks' linear_y uses it).")
        if c.lru_width % c.num_attention_heads:
            raise C.UnsupportedConfigError(f"lru_width={c.lru_width} does not split into num_attention_heads="
                                           f"{c.num_attention_heads} RG-LRU heads for {ARCH}.")
        super().check_config()

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` for a parallel layout the recurrent layers cannot run (pure, before any
        collective)."""
        if not self.recurrent_layers:
            return
        heads, tp = self.hf_config.num_attention_heads, layout.tensor_parallel_size
        if heads % tp:
            raise C.UnsupportedConfigError(f"num_attention_heads={heads} (the RG-LRU's heads) does not split over "
                                           f"tensor_parallel_size={tp} for {ARCH} (the recurrent layers split their "
                                           "heads).")

    def generation_refusal(self, generation_config) -> str | None:
        if generation_config.use_cache and generation_config.cache_implementation == "static" and \
                self.recurrent_layers:
            return (f"cache_implementation='static' is not supported for {ARCH}: the static cache's fixed-shape "
                    "decode step keeps no conv / RG-LRU state; use the default dynamic cache.")
        return None

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=())

    @property
    def recurrent_layers(self) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(self.hf_config.layer_types) if kind == "linear_attention")

    def transformer_config_kwargs(self) -> dict:
        c = self.hf_config
        kw = C.hf_to_megatron(c, FIELDS)
        kw.update(activation_func=C._act_to_megatron(c.hidden_activation), ffn_hidden_size=c.intermediate_size // 2,
                  normalization="RMSNorm", layernorm_zero_centered_gamma=True, gated_linear_unit=True,
                  add_bias_linear=True, add_qkv_bias=self.qkv_bias, qk_layernorm=False, hidden_dropout=0.0,
                  **layer_windows(c))
        return kw

    def attention_module(self) -> type:
        from loongforge_hf.bridges.recurrent_gemma_block import recurrent_gemma_attention

        c = self.hf_config
        return recurrent_gemma_attention(layers=self.recurrent_layers, qkv_bias=self.qkv_bias, width=c.lru_width,
                                         heads=c.num_attention_heads, conv_kernel=c.conv1d_width)

    def finish_model(self, model) -> None:
        # NOTE: transformers' normalizer is a bf16 buffer: sqrt(hidden_size) rounded to bf16 in every dtype
        scale_embedding(model, float(torch.tensor(self.hf_config.hidden_size ** 0.5, dtype=torch.bfloat16)))
        if self.hf_config.logits_soft_cap is not None:
            softcap_logits(model, self.hf_config.logits_soft_cap)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        maps = [Replicated(f"{D}.input_layernorm.weight", f"{L}.temporal_pre_norm.weight"),
                QKV(f"{S}.linear_qkv.weight", q=f"{T}.q_proj.weight", k=f"{T}.k_proj.weight", v=f"{T}.v_proj.weight"),
                RowParallel(f"{S}.linear_proj.weight", f"{T}.o_proj.weight"),
                Replicated(f"{S}.linear_proj.bias", f"{T}.o_proj.bias")]
        if self.qkv_bias:
            maps.append(QKV(f"{S}.linear_qkv.bias", q=f"{T}.q_proj.bias", k=f"{T}.k_proj.bias", v=f"{T}.v_proj.bias"))
        return maps

    def recurrent_mappings(self) -> list[Mapping]:
        w = self.hf_config.lru_width
        g = f"{T}.rg_lru"
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.temporal_pre_norm.weight"),
                *(HeadSections(f"{S}.in_proj.{k}", ((f"{T}.linear_x.{k}", (w,)), (f"{T}.linear_y.{k}", (w,))))
                  for k in ("weight", "bias")),
                ColumnParallel(f"{S}.conv_weight", f"{T}.conv_1d.weight"),
                ColumnParallel(f"{S}.conv_bias", f"{T}.conv_1d.bias"),
                ColumnParallel(f"{S}.recurrent_param", f"{g}.recurrent_param"),
                *(ColumnParallel(f"{S}.{name}", f"{g}.{name}") for name in GATES),
                RowParallel(f"{S}.out_proj.weight", f"{T}.linear_out.weight"),
                Replicated(f"{S}.out_proj.bias", f"{T}.linear_out.bias")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        m = f"{L}.mlp_block"
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.channel_pre_norm.weight"),
                *(GatedMLP(f"{D}.mlp.linear_fc1.{k}", gate=f"{m}.gate_proj.{k}", up=f"{m}.up_proj.{k}")
                  for k in ("weight", "bias")),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{m}.down_proj.weight"),
                Replicated(f"{D}.mlp.linear_fc2.bias", f"{m}.down_proj.bias")]

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.recurrent_mappings()[1:] + self.dense_mlp_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mixer = self.recurrent_mappings() if layer in self.recurrent_layers else self.attention_mappings()
        return mixer + self.dense_mlp_mappings()

    def final_mappings(self) -> list[Mapping]:
        return [Replicated("decoder.final_layernorm.weight", "model.final_norm.weight"), *super().final_mappings()[1:]]

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"model.layers.{layer}"
        h, w, f, t = c.hidden_size, c.lru_width, c.intermediate_size // 2, f"{p}.temporal_block"
        shapes = {f"{p}.temporal_pre_norm.weight": (h,), f"{p}.channel_pre_norm.weight": (h,)}
        for name in ("gate_proj", "up_proj"):
            shapes.update({f"{p}.mlp_block.{name}.weight": (f, h), f"{p}.mlp_block.{name}.bias": (f,)})
        shapes.update({f"{p}.mlp_block.down_proj.weight": (h, f), f"{p}.mlp_block.down_proj.bias": (h,)})
        if layer not in self.recurrent_layers:
            attention = super().attention_shapes(p)
            shapes.update({k.replace(".self_attn.", ".temporal_block."): v for k, v in attention.items()
                           if ".self_attn." in k})
            shapes[f"{t}.o_proj.bias"] = (h,)
            return shapes
        heads = c.num_attention_heads
        block = w // heads
        shapes.update({f"{t}.linear_x.weight": (w, h), f"{t}.linear_x.bias": (w,), f"{t}.linear_y.weight": (w, h),
                       f"{t}.linear_y.bias": (w,), f"{t}.linear_out.weight": (h, w), f"{t}.linear_out.bias": (h,),
                       f"{t}.conv_1d.weight": (w, 1, c.conv1d_width), f"{t}.conv_1d.bias": (w,),
                       f"{t}.rg_lru.recurrent_param": (w,)})
        shapes.update({f"{t}.rg_lru.{n}": (heads, block, block) if n.endswith("weight") else (heads, block)
                       for n in GATES})
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_hf_shapes()
        shapes["model.final_norm.weight"] = shapes.pop("model.norm.weight")
        return shapes
