"""PhiForCausalLM (Microsoft's phi-1, phi-1.5, phi-2 and their fine-tunes): the attention and the MLP side by side
after one LayerNorm, biases on every linear and on the LM head, part of each head rotated.

Choices:
- One LayerNorm (``input_layernorm``, weight and bias, ``layer_norm_eps``) feeds both sublayers:
  ``x + dropout(attn(ln(x))) + dropout(mlp(ln(x)))``, the spec's ``SharedNormParallelLayer`` (``kernels/specs.py``:
  megatron's layer whose MLP reads the input norm's output again; no ``pre_mlp_layernorm``). ``resid_pdrop`` is
  megatron's ``hidden_dropout``, which its bias-dropout-add applies to each sublayer's output before the adds.
- ``q_proj`` / ``k_proj`` / ``v_proj`` (with biases, GQA where ``num_key_value_heads`` says so) are fused into
  megatron's ``linear_qkv`` like Qwen2's; ``dense`` is ``linear_proj`` (its bias whole on every rank); ``fc1`` /
  ``fc2`` are the ungated MLP's ``linear_fc1`` / ``linear_fc2`` with biases; ``hidden_act`` (``gelu_new``) through the
  shared table, as transformers computes it.
- ``partial_rotary_factor`` (phi-2: 0.4 of an 80-channel head, 32 rotated; phi-1 / 1.5: 0.5) is megatron's
  ``rotary_percent``: both rotate the first ``int(head_dim * factor)`` channels in rotate-half pairs. Rope types
  other than ``default`` / ``llama3`` are refused.
- ``qk_layernorm`` (off in the hub's checkpoints): a LayerNorm over each head's channels, shared by the heads, with
  weight and bias, before the rotation: our ``LayerNorm`` in megatron's q / k norm slots (``qk_layernorm``: megatron
  sums their gradients over the TP ranks, each holding its own heads).
- The LM head has a bias (``lm_head.bias``): ``lm_head_bias`` gives megatron's output layer one
  (``output_layer.add_output_bias``: this rank's rows of the padded vocabulary), loaded and exported as the weight's
  rows (``VocabParallel``), in the fused training loss too. ``tie_word_embeddings`` shares the weight only.
  ``resize_token_embeddings`` is refused for it (transformers draws the added bias rows in its own way).
- ``embd_pdrop`` drops the embedding output (phi-2: 0.0 where ``resid_pdrop`` is 0.1): the builder sets the
  embedding's own dropout to it (``embedding_dropout``; megatron would use ``hidden_dropout``). ``attention_dropout``
  through the shared table.
- Names: ``model.embed_tokens``, ``model.layers.N.{input_layernorm, self_attn.{q,k,v}_proj, self_attn.dense,
  mlp.fc1, mlp.fc2}``, ``model.final_layernorm``, ``lm_head.{weight, bias}``, as transformers writes them.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel, VocabParallel, biased_mlp_mappings
from loongforge_hf.bridges.registry import register_bridge

# NOTE: Phi names the norms' eps ``layer_norm_eps`` (LayerNorms); the rest of the table is Llama's
PHI_FIELDS = C.fields_with_eps("layer_norm_eps")


@register_bridge("PhiForCausalLM")
class PhiBridge(DenseBridge):
    config_fields = PHI_FIELDS
    qkv_bias = True
    parallel_residual = "shared"
    lm_head_bias = True
    extra_rope_types = ()

    @property
    def qk_norm(self) -> bool:
        return bool(getattr(self.hf_config, "qk_layernorm", False))

    @property
    def embedding_dropout(self) -> float:
        return C.dropout_of(self.hf_config, "embd_pdrop")

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def qk_module(self) -> type | None:
        from loongforge_hf.kernels.layernorm import LayerNorm

        return LayerNorm if self.qk_norm else None

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm", "gated_linear_unit": False,
                "add_bias_linear": True, "add_qkv_bias": True,
                "hidden_dropout": C.dropout_of(self.hf_config, "resid_pdrop")}

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        a = f"{L}.self_attn"
        maps: list[Mapping] = [
            Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
            Replicated(f"{D}.input_layernorm.bias", f"{L}.input_layernorm.bias"),
            QKV(f"{D}.self_attention.linear_qkv.weight", q=f"{a}.q_proj.weight", k=f"{a}.k_proj.weight",
                v=f"{a}.v_proj.weight"),
            QKV(f"{D}.self_attention.linear_qkv.bias", q=f"{a}.q_proj.bias", k=f"{a}.k_proj.bias",
                v=f"{a}.v_proj.bias"),
            RowParallel(f"{D}.self_attention.linear_proj.weight", f"{a}.dense.weight"),
            Replicated(f"{D}.self_attention.linear_proj.bias", f"{a}.dense.bias"),
        ]
        if self.qk_norm:
            maps += [Replicated(f"{D}.self_attention.{q}_layernorm.{p}", f"{a}.{q}_layernorm.{p}")
                     for q in ("q", "k") for p in ("weight", "bias")]
        return maps

    def dense_mlp_mappings(self) -> list[Mapping]:
        return biased_mlp_mappings(f"{D}.mlp", f"{L}.mlp.fc1", f"{L}.mlp.fc2")

    def final_mappings(self) -> list[Mapping]:
        maps: list[Mapping] = [Replicated("decoder.final_layernorm.weight", "model.final_layernorm.weight"),
                               Replicated("decoder.final_layernorm.bias", "model.final_layernorm.bias")]
        if not self.tied:
            maps.append(VocabParallel("output_layer.weight", "lm_head.weight"))
        return [*maps, VocabParallel("output_layer.bias", "lm_head.bias")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        hd, heads, h = C.head_dim_of(c), c.num_attention_heads, c.hidden_size
        kv = getattr(c, "num_key_value_heads", None) or heads
        a = f"{prefix}.self_attn"
        shapes = {f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.input_layernorm.bias": (h,),
                  f"{a}.q_proj.weight": (heads * hd, h), f"{a}.q_proj.bias": (heads * hd,),
                  f"{a}.k_proj.weight": (kv * hd, h), f"{a}.k_proj.bias": (kv * hd,),
                  f"{a}.v_proj.weight": (kv * hd, h), f"{a}.v_proj.bias": (kv * hd,),
                  f"{a}.dense.weight": (h, heads * hd), f"{a}.dense.bias": (h,)}
        if self.qk_norm:
            shapes.update({f"{a}.{q}_layernorm.{p}": (hd,) for q in ("q", "k") for p in ("weight", "bias")})
        return shapes

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.hf_config.intermediate_size, prefix
        return {f"{p}.mlp.fc1.weight": (f, h), f"{p}.mlp.fc1.bias": (f,), f"{p}.mlp.fc2.weight": (h, f),
                f"{p}.mlp.fc2.bias": (h,)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, v = c.hidden_size, c.vocab_size
        shapes = {"model.embed_tokens.weight": (v, h), "model.final_layernorm.weight": (h,),
                  "model.final_layernorm.bias": (h,), "lm_head.bias": (v,)}
        if not self.tied:
            shapes["lm_head.weight"] = (v, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes
