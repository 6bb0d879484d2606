"""Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4): the Llama layout with q / k / v packed into one ``qkv_proj`` and gate / up
into one ``gate_up_proj``, an optional sliding window, partial rotary and residual dropout.

Choices:
- The packed tensors load straight into megatron's fused ``linear_qkv`` / ``linear_fc1`` (``PackedQKV``,
  ``PackedGatedMLP``: each TP rank reads its q / k / v heads, gate / up rows) and export packed again.
- ``partial_rotary_factor`` (Phi-4-mini: 0.75) is megatron's ``rotary_percent``: HF and megatron both rotate the
  first channels of each head in rotate-half pairs and pass the rest through.
- ``resid_pdrop`` is megatron's ``hidden_dropout`` (both drop the attention / MLP output before the residual add);
  ``embd_pdrop`` is not read by transformers' Phi-3 either, which drops nothing from the embedding output: neither
  does megatron's embedding here (``DenseBridge.embedding_dropout``, 0; it would drop with ``hidden_dropout``).
- ``longrope`` scaling (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): transformers rotates a forward whose positions
  stay within ``original_max_position_embeddings`` with the short factors and a longer one (all its positions) with
  the long factors, and scales cos and sin by the attention factor. Here the model's rotary embedding holds both sets
  (``kernels.rope.longrope_rotary``) and each forward picks by its length as transformers does (the largest position
  id + 1: ``modeling`` for forwards and cached ``generate`` steps; the training engine per micro-batch, from the
  collator's length or position ids; a static cache's decode table row by row). ``generate``: the step whose sequence
  first passes the switch runs the whole sequence again with the long factors, the cache emptied, as transformers'
  Phi-3 does (``generation.prepare_inputs_for_generation``). The attention factor multiplies the rotary channels of q
  and k before the rotation (``DenseBridge.qk_module``; the rotation is linear, so the product is the same).
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.packed_mappings import PackedGatedMLP, PackedQKV
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Phi3ForCausalLM")
class Phi3Bridge(DenseBridge):
    supports_sliding_window = True
    extra_rope_types = ("longrope",)  # NOTE: transformers' Phi-3 config turns 'yarn' / 'su' into 'longrope'

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def check_config(self) -> None:
        super().check_config()
        rope = self.rope_parameters()
        # NOTE: where LongRoPE switches to its long factors (modeling / the engine pick per forward); None without
        self.longrope_switch = int(rope["original_max_position_embeddings"]) if rope["rope_type"] == "longrope" \
            else None

    def finish_model(self, model) -> None:
        from loongforge_hf.kernels.rope import make_longrope, rope_inv_freq

        rope = self.rope_parameters()
        if self.longrope_switch is None or getattr(model, "rotary_pos_emb", None) is None:
            return
        inv = {long: rope_inv_freq(C.head_dim_of(self.hf_config), base=rope["rope_theta"], rope_scaling=rope,
                                   partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
                                   longrope_long=long) for long in (False, True)}
        make_longrope(model.rotary_pos_emb, short=inv[False], long=inv[True], original_max=self.longrope_switch)

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw["hidden_dropout"] = C.dropout_of(self.hf_config, "resid_pdrop")
        return kw

    def attention_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
                PackedQKV(f"{D}.self_attention.linear_qkv.weight", f"{L}.self_attn.qkv_proj.weight"),
                RowParallel(f"{D}.self_attention.linear_proj.weight", f"{L}.self_attn.o_proj.weight")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
                PackedGatedMLP(f"{D}.mlp.linear_fc1.weight", f"{L}.mlp.gate_up_proj.weight",
                               intermediate_size=self.hf_config.intermediate_size),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{L}.mlp.down_proj.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        hd, heads = C.head_dim_of(c), c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        return {f"{prefix}.input_layernorm.weight": (c.hidden_size,),
                f"{prefix}.self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, c.hidden_size),
                f"{prefix}.self_attn.o_proj.weight": (c.hidden_size, heads * hd)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f = self.hf_config.hidden_size, self.hf_config.intermediate_size
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{prefix}.mlp.gate_up_proj.weight": (2 * f, h),
                f"{prefix}.mlp.down_proj.weight": (h, f)}
