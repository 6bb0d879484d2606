"""GPTBigCodeForCausalLM (BigCode's StarCoder / StarCoderBase, SantaCoder and their fine-tunes: WizardCoder,
Octocoder): GPT-2's layer (``gpt2.py``) with ``nn.Linear`` weights and multi-query attention.

Choices:
- What GPT-2's bridge does stays as it is (``GPT2Bridge``): learned absolute positions (``wpe``,
  ``absolute_positions.py``), pre-LayerNorms with biases (``layer_norm_epsilon``), biases on every linear, the ungated
  MLP ``c_proj(act(c_fc(x)))`` of width ``n_inner`` (None: ``4 * n_embd``), ``activation_function`` through the shared
  table (StarCoder's ``gelu_pytorch_tanh``), the three dropouts (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``), the
  tied LM head (an untied one is ``lm_head.weight``), base-model checkpoints without the ``transformer.`` prefix and
  ``token_type_ids`` refused by the forward.
- The weights are ``nn.Linear``'s ``[out, in]``, megatron's own: nothing is transposed.
- ``c_attn``'s rows are megatron's ``linear_qkv`` layout as they are in both attention kinds: ``multi_query``
  (StarCoder's, SantaCoder's) is ``[q of every head, k, v]`` with one KV head (one query group); without it
  transformers views each head's rows as ``[q, k, v]`` (a group per head). It loads as ``GroupedQKV`` (each TP rank
  whole groups; ``multi_query`` at TP > 1: a replica of the one k / v head beside the rank's query heads), bias
  likewise, and exports unchanged; the KV head count is ``config_map.kv_heads_of``. ``c_proj`` is row-parallel, its
  bias whole on every rank.
- Attention scale ``1 / sqrt(head_dim)`` (``scale_attn_weights``: off is refused). ``attention_softmax_in_fp32`` /
  ``scale_attention_softmax_in_fp32`` are taken whatever their values: transformers' attention does not read them
  (its eager softmax always runs in fp32, its SDPA in the input dtype), so they change no result.
  ``add_cross_attention`` (an encoder-decoder's cross-attention layers) is refused.
- Names: ``transformer.{wte, wpe, h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, ln_f}``,
  ``lm_head``; the causal-mask buffer (``transformer.bias``) is not persistent, neither read nor written.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gpt2 import GPT2Bridge
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel, biased_mlp_mappings
from loongforge_hf.bridges.packed_mappings import GroupedQKV
from loongforge_hf.bridges.registry import register_bridge

L = "transformer.h.{layer}"
D = "decoder.layers.{layer}"


@register_bridge("GPTBigCodeForCausalLM")
class GPTBigCodeBridge(GPT2Bridge):

    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        if not getattr(c, "scale_attn_weights", True):
            raise C.UnsupportedConfigError(f"scale_attn_weights=False is not supported for {arch} (transformers then "
                                           "leaves the scores unscaled); megatron's attention scales the scores by "
                                           "1 / sqrt(head_dim).")
        if getattr(c, "add_cross_attention", False):
            raise C.UnsupportedConfigError(f"add_cross_attention=True is not supported for {arch} (cross-attention "
                                           "layers of an encoder-decoder); this bridge builds a decoder only.")
        C._act_to_megatron(c.activation_function)

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "num_query_groups": C.kv_heads_of(self.hf_config)}

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        a = f"{L}.attn"
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.ln_1.weight"),
                Replicated(f"{D}.input_layernorm.bias", f"{L}.ln_1.bias"),
                GroupedQKV(f"{D}.self_attention.linear_qkv.weight", f"{a}.c_attn.weight"),
                GroupedQKV(f"{D}.self_attention.linear_qkv.bias", f"{a}.c_attn.bias"),
                RowParallel(f"{D}.self_attention.linear_proj.weight", f"{a}.c_proj.weight"),
                Replicated(f"{D}.self_attention.linear_proj.bias", f"{a}.c_proj.bias")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.ln_2.weight"),
                Replicated(f"{D}.pre_mlp_layernorm.bias", f"{L}.ln_2.bias"),
                *biased_mlp_mappings(f"{D}.mlp", f"{L}.mlp.c_fc", f"{L}.mlp.c_proj")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h = c.hidden_size
        qkv = h + 2 * C.kv_heads_of(c) * C.head_dim_of(c)
        return {f"{prefix}.ln_1.weight": (h,), f"{prefix}.ln_1.bias": (h,),
                f"{prefix}.attn.c_attn.weight": (qkv, h), f"{prefix}.attn.c_attn.bias": (qkv,),
                f"{prefix}.attn.c_proj.weight": (h, h), f"{prefix}.attn.c_proj.bias": (h,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.ffn_hidden_size, prefix
        return {f"{p}.ln_2.weight": (h,), f"{p}.ln_2.bias": (h,),
                f"{p}.mlp.c_fc.weight": (f, h), f"{p}.mlp.c_fc.bias": (f,),
                f"{p}.mlp.c_proj.weight": (h, f), f"{p}.mlp.c_proj.bias": (h,)}
