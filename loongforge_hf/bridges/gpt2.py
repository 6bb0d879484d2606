"""GPT2LMHeadModel (OpenAI's GPT-2 small to XL, DistilGPT2 and their fine-tunes): learned absolute position
embeddings, pre-LayerNorm layers with biases on every linear, an ungated MLP, the LM head tied to the embedding.

Choices:
- Positions: ``wpe`` is megatron's learned absolute position table (``position_embedding_type="learned_absolute"``,
  ``n_positions`` rows: ``absolute_positions.py`` says how each layout and generate get the true positions and how a
  longer input is refused); it lives on the first pipeline stage beside ``wte`` (``first_stage_mappings``), whole on
  every TP rank. No rotary embedding.
- transformers' ``Conv1D`` stores its weight ``[in, out]``: every one (``c_attn``, ``attn.c_proj``, ``mlp.c_fc``,
  ``mlp.c_proj``) loads transposed and exports transposed back (``conv1d_mappings.Transposed``).
- ``c_attn`` is ``[q; k; v]`` along its output features, each ``n_embd`` wide with the heads in order: Phi-3's packed
  ``qkv_proj`` layout with every head its own query group (``PackedQKV``), reordered into megatron's per-head
  ``[q, k, v]`` rows of ``linear_qkv`` (each TP rank takes its heads' rows) and back on export; its bias likewise.
- Norms are LayerNorms with weight and bias (``layer_norm_epsilon``); every linear has a bias (megatron's
  ``add_bias_linear`` / ``add_qkv_bias``: ``c_fc``'s split over TP, ``c_proj``'s whole on every rank). The MLP is
  ``c_proj(act(c_fc(x)))``, megatron's ungated ``MLP``; ``activation_function`` (``gelu_new``) through the shared
  table; ``n_inner`` its width (None: ``4 * n_embd``).
- Attention scale ``1 / sqrt(head_dim)`` (``scale_attn_weights``, on in every checkpoint: off is refused);
  ``scale_attn_by_inverse_layer_idx`` (an extra ``1 / (layer + 1)``) and ``reorder_and_upcast_attn`` (transformers'
  eager fp32 ``baddbmm`` path) are refused, as are ``add_cross_attention`` (an encoder-decoder's) and the
  ``token_type_ids`` transformers adds through ``wte`` (the forward refuses them, ``modeling.py``).
- Dropouts: ``resid_pdrop`` on the attention's and the MLP's outputs before the adds (megatron's
  ``hidden_dropout``), ``embd_pdrop`` on the embedding output (``embedding_dropout``), ``attn_pdrop`` on the
  attention probabilities (``attention_dropout``).
- Names: ``transformer.{wte, wpe, h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, ln_f}``, the
  LM head tied (``tie_word_embeddings``, GPT-2's default; an untied one is ``lm_head.weight``). Checkpoints saved
  without the ``transformer.`` prefix (OpenAI's ``gpt2``) load too (``base_model_prefix.py``); older ones' buffers
  (``attn.bias``, ``attn.masked_bias``) are not read, as transformers ignores them, and not written back.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.absolute_positions import LEARNED, use_position_table
from loongforge_hf.bridges.conv1d_mappings import Transposed
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.gptj import GPTJ_FIELDS
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel, VocabParallel
from loongforge_hf.bridges.packed_mappings import PackedQKV
from loongforge_hf.bridges.registry import register_bridge

L = "transformer.h.{layer}"
D = "decoder.layers.{layer}"
# NOTE: GPT-2 names its fields as GPT-J (n_embd, n_head, n_inner, activation_function, layer_norm_epsilon, attn_pdrop)
GPT2_FIELDS = GPTJ_FIELDS


@register_bridge("GPT2LMHeadModel")
class GPT2Bridge(DenseBridge):
    config_fields = GPT2_FIELDS
    qkv_bias = True
    position_embedding_type = LEARNED
    token_type_embeddings = True  # NOTE: transformers adds wte(token_type_ids); refused in the forward

    @property
    def embedding_dropout(self) -> float:
        return C.dropout_of(self.hf_config, "embd_pdrop")

    @property
    def ffn_hidden_size(self) -> int:
        return getattr(self.hf_config, "n_inner", None) or 4 * self.hf_config.hidden_size

    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        refused = {"scale_attn_weights": (getattr(c, "scale_attn_weights", True), False,
                                          "transformers then leaves the scores unscaled"),
                   "scale_attn_by_inverse_layer_idx": (getattr(c, "scale_attn_by_inverse_layer_idx", False), True,
                                                       "an extra 1 / (layer + 1) on each layer's scores"),
                   "reorder_and_upcast_attn": (getattr(c, "reorder_and_upcast_attn", False), True,
                                               "transformers' eager fp32 baddbmm attention"),
                   "add_cross_attention": (getattr(c, "add_cross_attention", False), True,
                                           "cross-attention layers of an encoder-decoder")}
        for field, (value, bad, what) in refused.items():
            if bool(value) == bad:
                raise C.UnsupportedConfigError(f"{field}={value} is not supported for {arch} ({what}); megatron's "
                                               "attention scales the scores by 1 / sqrt(head_dim).")
        C._act_to_megatron(c.activation_function)

    def rope_parameters(self) -> dict:
        return {"rope_type": "default", "rope_theta": 10000.0}  # NOTE: unused: no rotary embedding

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm", "gated_linear_unit": False,
                "add_bias_linear": True, "add_qkv_bias": True, "ffn_hidden_size": self.ffn_hidden_size,
                "hidden_dropout": C.dropout_of(self.hf_config, "resid_pdrop")}

    def finish_model(self, model) -> None:
        use_position_table(model)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        a = f"{L}.attn"
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.ln_1.weight"),
                Replicated(f"{D}.input_layernorm.bias", f"{L}.ln_1.bias"),
                Transposed(PackedQKV(f"{D}.self_attention.linear_qkv.weight", f"{a}.c_attn.weight")),
                PackedQKV(f"{D}.self_attention.linear_qkv.bias", f"{a}.c_attn.bias"),
                Transposed(RowParallel(f"{D}.self_attention.linear_proj.weight", f"{a}.c_proj.weight")),
                Replicated(f"{D}.self_attention.linear_proj.bias", f"{a}.c_proj.bias")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        m = f"{L}.mlp"
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.ln_2.weight"),
                Replicated(f"{D}.pre_mlp_layernorm.bias", f"{L}.ln_2.bias"),
                Transposed(ColumnParallel(f"{D}.mlp.linear_fc1.weight", f"{m}.c_fc.weight")),
                ColumnParallel(f"{D}.mlp.linear_fc1.bias", f"{m}.c_fc.bias"),
                Transposed(RowParallel(f"{D}.mlp.linear_fc2.weight", f"{m}.c_proj.weight")),
                Replicated(f"{D}.mlp.linear_fc2.bias", f"{m}.c_proj.bias")]

    def embedding_mapping(self) -> Mapping:
        return VocabParallel("embedding.word_embeddings.weight", "transformer.wte.weight")

    def first_stage_mappings(self) -> list[Mapping]:
        """The first pipeline stage's tensors beside the token embedding: the position table."""
        return [Replicated("embedding.position_embeddings.weight", "transformer.wpe.weight")]

    def final_mappings(self) -> list[Mapping]:
        maps: list[Mapping] = [Replicated("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
                               Replicated("decoder.final_layernorm.bias", "transformer.ln_f.bias")]
        if not self.tied:
            maps.append(VocabParallel("output_layer.weight", "lm_head.weight"))
        return maps

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h = self.hf_config.hidden_size
        return {f"{prefix}.ln_1.weight": (h,), f"{prefix}.ln_1.bias": (h,),
                f"{prefix}.attn.c_attn.weight": (h, 3 * h), f"{prefix}.attn.c_attn.bias": (3 * h,),
                f"{prefix}.attn.c_proj.weight": (h, h), f"{prefix}.attn.c_proj.bias": (h,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.ffn_hidden_size, prefix
        return {f"{p}.ln_2.weight": (h,), f"{p}.ln_2.bias": (h,),
                f"{p}.mlp.c_fc.weight": (h, f), f"{p}.mlp.c_fc.bias": (f,),
                f"{p}.mlp.c_proj.weight": (f, h), f"{p}.mlp.c_proj.bias": (h,)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = L.format(layer=layer)
        return {**self.attention_shapes(prefix), **self.dense_mlp_shapes(prefix)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, v = c.hidden_size, c.vocab_size
        shapes = {"transformer.wte.weight": (v, h), "transformer.wpe.weight": (c.max_position_embeddings, h),
                  "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
        if not self.tied:
            shapes["lm_head.weight"] = (v, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes
