"""What every Llama-family dense decoder shares: the tensor table, expected shapes, and megatron config deltas.

A per-model bridge (llama.py, qwen2.py, ...) subclasses ``DenseBridge`` and declares only what differs
(q/k norms, qkv bias, sliding window).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.fused_mappings import QKV, GatedMLP
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel, VocabParallel

L = "model.layers.{layer}"
D = "decoder.layers.{layer}"


class DenseBridge:
    architectures: tuple[str, ...] = ()
    qk_norm: bool = False
    qkv_bias: bool = False
    supports_sliding_window: bool = False
    extra_rope_types: tuple[str, ...] = ("yarn",)  # beyond default / llama3 (config_map.rope_parameters)
    has_passthrough: bool = False  # keeps checkpoint tensors megatron does not build (see passthrough_names)
    pre_norms: bool = True  # input / pre-MLP norms (OLMo 2 has none: it normalises the attention / MLP outputs)
    parallel_residual: str | None = None  # "separate" / "shared": MLP beside the attention (kernels.specs)
    per_layer_types: bool = False  # implements sliding-window layers (``layer_types``: bridges/layer_types.py)
    # NOTE: the embedding output's dropout (the builder sets megatron's, which would be hidden_dropout): none in
    # transformers' Llama-family decoders; a bridge whose model drops it says how much (GPT-NeoX, Phi, StarCoder2)
    embedding_dropout: float | None = 0.0
    lm_head_bias: bool = False  # the LM head has a bias (Phi's): output_layer.add_output_bias, by the builder
    own_activation: bool = False  # the MLP module builds hidden_act itself (Apertus's xIELU), not the config table
    mlp_bias: bool = False  # maps the MLP's biases (``mlp_bias``: Jais 2); the shared checks refuse them otherwise
    config_fields: tuple[C.Field, ...] = C.DENSE_FIELDS  # the HF <-> megatron config table (config_map.py)

    def __init__(self, hf_config) -> None:
        self.hf_config = hf_config
        self.check_config()

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        self.rope_parameters()
        C.check_dense_config(self.hf_config, qkv_bias=self.qkv_bias, check_rope=False,
                             layer_types=self.per_layer_types, activation=not self.own_activation,
                             mlp_bias=self.mlp_bias)
        if C.sliding_window_of(self.hf_config) is not None and not self.supports_sliding_window:
            raise C.UnsupportedConfigError(
                f"sliding_window={self.hf_config.sliding_window} is not supported for {self.architectures[0]}.")

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    def transformer_config_kwargs(self) -> dict:
        kw = C.hf_to_megatron(self.hf_config, self.config_fields)
        kw.update(normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                  add_qkv_bias=self.qkv_bias, qk_layernorm=self.qk_norm, hidden_dropout=0.0)
        window = C.sliding_window_of(self.hf_config)
        if window is not None:
            # NOTE: HF lets a query see itself and the window-1 tokens before it; megatron's (left, right) bounds.
            kw["window_size"] = (window - 1, 0)
        return kw

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        """The input norm and self-attention of one layer (``{layer}`` stands for its index)."""
        maps: list[Mapping] = [
            Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
            QKV(f"{D}.self_attention.linear_qkv.weight", q=f"{L}.self_attn.q_proj.weight",
                k=f"{L}.self_attn.k_proj.weight", v=f"{L}.self_attn.v_proj.weight"),
            RowParallel(f"{D}.self_attention.linear_proj.weight", f"{L}.self_attn.o_proj.weight"),
        ]
        if self.qkv_bias:
            maps.append(QKV(f"{D}.self_attention.linear_qkv.bias", q=f"{L}.self_attn.q_proj.bias",
                            k=f"{L}.self_attn.k_proj.bias", v=f"{L}.self_attn.v_proj.bias"))
        if self.qk_norm:
            maps += [Replicated(f"{D}.self_attention.q_layernorm.weight", f"{L}.self_attn.q_norm.weight"),
                     Replicated(f"{D}.self_attention.k_layernorm.weight", f"{L}.self_attn.k_norm.weight")]
        return maps

    def dense_mlp_mappings(self) -> list[Mapping]:
        """The post-attention norm and the gated MLP of a dense layer."""
        return [
            Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
            GatedMLP(f"{D}.mlp.linear_fc1.weight", gate=f"{L}.mlp.gate_proj.weight", up=f"{L}.mlp.up_proj.weight"),
            RowParallel(f"{D}.mlp.linear_fc2.weight", f"{L}.mlp.down_proj.weight"),
        ]

    def layer_mappings(self) -> list[Mapping]:
        """Every mapping any layer uses (a model whose layers differ says which are whose in mappings_for_layer)."""
        return self.attention_mappings() + self.dense_mlp_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        return self.layer_mappings()

    def passthrough_names(self, names) -> list[str]:
        """Checkpoint tensors megatron has no place for, written back unchanged on export (none for dense models)."""
        return []

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, extra_types=self.extra_rope_types)

    def qk_module(self) -> type | None:
        """For rope types with an attention factor (YaRN, LongRoPE): the q / k norm slots' module that multiplies the
        rotary channels by it before the rotation (after the q / k norm where the model has one); None without.
        A (q, k) pair where the two slots differ (OLMo 2's norms over all heads)."""
        from loongforge_hf.kernels.rmsnorm import RMSNorm
        from loongforge_hf.kernels.rope import rope_attention_factor, rotary_scale_module

        rope = self.rope_parameters()
        factor = rope_attention_factor(rope, self.hf_config.max_position_embeddings)
        if factor == 1.0:
            return None
        rotary_dim = int(C.head_dim_of(self.hf_config) * rope.get("partial_rotary_factor", 1.0))
        return rotary_scale_module(factor, rotary_dim, norm=RMSNorm if self.qk_norm else None)

    def attention_module(self) -> type | None:
        """The self-attention class of the dense spec where megatron's does not serve (SmolLM3's NoPE layers)."""
        return None

    def mlp_module(self) -> type | None:
        """The dense MLP class where the spec's ``SwiGLUMLP`` does not serve (Gemma 3's post-MLP norm)."""
        return None

    def finish_model(self, model) -> None:
        """Changes to a built ``GPTModel`` chunk that its spec cannot express (Gemma's scaled embedding and per-layer
        rotary bases); called by the builder before the weights load. None for Llama-style models."""

    def embedding_mapping(self) -> Mapping:
        return VocabParallel("embedding.word_embeddings.weight", "model.embed_tokens.weight")

    def final_mappings(self) -> list[Mapping]:
        maps: list[Mapping] = [Replicated("decoder.final_layernorm.weight", "model.norm.weight")]
        if not self.tied:
            maps.append(VocabParallel("output_layer.weight", "lm_head.weight"))
        return maps

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        hd = C.head_dim_of(c)
        kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        h, p = c.hidden_size, prefix
        shapes = {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (c.num_attention_heads * hd, h),
            f"{p}.self_attn.k_proj.weight": (kv * hd, h), f"{p}.self_attn.v_proj.weight": (kv * hd, h),
            f"{p}.self_attn.o_proj.weight": (h, c.num_attention_heads * hd),
        }
        if self.qkv_bias:
            shapes.update({f"{p}.self_attn.q_proj.bias": (c.num_attention_heads * hd,),
                           f"{p}.self_attn.k_proj.bias": (kv * hd,), f"{p}.self_attn.v_proj.bias": (kv * hd,)})
        if self.qk_norm:
            shapes.update({f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)})
        return shapes

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.hf_config.intermediate_size, prefix
        return {f"{p}.post_attention_layernorm.weight": (h,), f"{p}.mlp.gate_proj.weight": (f, h),
                f"{p}.mlp.up_proj.weight": (f, h), f"{p}.mlp.down_proj.weight": (h, f)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        return {**self.attention_shapes(prefix), **self.dense_mlp_shapes(prefix)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, v = c.hidden_size, c.vocab_size
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not self.tied:
            shapes["lm_head.weight"] = (v, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes

    def num_experts(self) -> int | None:
        return None
