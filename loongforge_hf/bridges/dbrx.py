"""DbrxForCausalLM (Databricks' DBRX base / instruct): LayerNorms without bias, q / k / v fused in one tensor and
clamped, softmax top-k experts in every layer, stored as three 2-D tensors per layer.

Choices:
- Names are DBRX's own (transformers reads and writes them as they are): ``transformer.wte``,
  ``transformer.blocks.N.{norm_attn_norm.{norm_1, attn.Wqkv, attn.out_proj, norm_2}, ffn.{router.layer,
  experts.mlp.{w1, v1, w2}}}``, ``transformer.norm_f``, ``lm_head`` (never tied: transformers refuses it).
- Norms: ``nn.LayerNorm`` without bias and with its default eps (1e-5): our ``LayerNormWithoutBias``.
- Attention: ``Wqkv`` holds all query heads' rows, then the KV heads' keys, then their values (Phi-3's layout:
  ``packed_mappings.PackedQKV``), fused per KV group in megatron's ``linear_qkv``; no biases. ``clip_qkv`` clamps
  q, k and v as they leave the projection, before the rotation (``olmo.clipped_attention``; the hub's is 8, and
  transformers 5.24's DBRX fails without one: ``clamp(None, None)``). Plain rope or llama3 scaling (a rope attention
  factor would scale q / k before the clamp, which transformers applies first).
- Experts (``ffn_config``): ``moe_num_experts`` gated experts of ``ffn_hidden_size`` with ``ffn_act_fn`` silu.
  ``w1`` (gate) and ``v1`` (up) are ``[experts * ffn, hidden]``, expert ``e``'s matrix its rows ``e * ffn`` on;
  ``w2`` (down) too, each expert's block transposed against ``nn.Linear``'s (``stacked_experts`` with ``rows``,
  ``StackedGatePair``): read and written expert by expert.
- Routing: softmax over all experts, the top ``moe_top_k``, divided by their ``moe_normalize_expert_weights``-norm:
  1 renormalises (``moe_router_pre_softmax=False``: softmax over the k chosen logits, the same weights), None keeps
  them (``moe_router_pre_softmax=True``); any other p is refused, and 1 with ``moe_top_k=1`` (megatron routes one
  expert only with its softmax probability). ``moe_jitter_eps`` (a random scale on the MoE layer's input in
  training, which transformers' router applies in place, so its experts see it too) is refused unless 0 / None, as
  the hub's checkpoints have it.
- transformers' ``router_logits`` and balancing loss (Mixtral's, ``router_balance.BalanceRouter``) with
  ``ffn_config.moe_loss_weight`` as the coefficient (``config_map.router_aux_loss_coef_field``).
- Refused: nonzero ``resid_pdrop`` / ``emb_pdrop`` / ``attn_config.attn_pdrop`` (the hub's are 0).
- Not covered here: LoRA on the experts' 2-D tensors (PEFT's ``target_parameters``).
"""

from __future__ import annotations

import torch.nn.functional as F

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel, VocabParallel
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.olmo import OLMO_NORM_EPS, clipped_attention
from loongforge_hf.bridges.packed_mappings import PackedQKV
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGatePair, routed_stack

L = "transformer.blocks.{layer}"
A = f"{L}.norm_attn_norm"
X = f"{L}.ffn.experts.mlp"
# NOTE: no intermediate_size (no dense layer), hidden_act (ffn_config.ffn_act_fn) nor rms_norm_eps (LayerNorms' 1e-5)
DBRX_FIELDS = tuple(f for f in C.DENSE_FIELDS if f.hf not in ("intermediate_size", "hidden_act", "rms_norm_eps"))
LAYER_NORM_EPS = OLMO_NORM_EPS  # NOTE: nn.LayerNorm's default, as OLMo's


@register_bridge("DbrxForCausalLM")
class DbrxBridge(MoEBridge):
    config_fields = DBRX_FIELDS
    extra_rope_types = ()
    own_activation = True  # NOTE: silu from ffn_config.ffn_act_fn, checked below
    norm_bias = False
    hf_balance_loss = True
    hf_router_logits = True

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        a, f = c.attn_config, c.ffn_config
        for name, value in (("resid_pdrop", c.resid_pdrop), ("emb_pdrop", c.emb_pdrop),
                            ("attn_config.attn_pdrop", a.attn_pdrop)):
            if value:
                raise C.UnsupportedConfigError(f"{name}={value} is not supported for DbrxForCausalLM (only 0).")
        if dict(f.ffn_act_fn or {}) != {"name": "silu"}:
            raise C.UnsupportedConfigError(f"ffn_config.ffn_act_fn={f.ffn_act_fn} is not supported (only "
                                           "{'name': 'silu'}).")
        if f.moe_jitter_eps:
            raise C.UnsupportedConfigError(
                f"ffn_config.moe_jitter_eps={f.moe_jitter_eps} is not supported (only 0 or None): transformers scales "
                "the experts' input by the router's random jitter in training too.")
        if f.moe_normalize_expert_weights not in (None, 1):
            raise C.UnsupportedConfigError(f"ffn_config.moe_normalize_expert_weights={f.moe_normalize_expert_weights} "
                                           "is not supported (1: renormalised top-k weights, or None).")
        if f.moe_top_k == 1 and f.moe_normalize_expert_weights is not None:
            raise C.UnsupportedConfigError(
                "ffn_config.moe_top_k=1 with moe_normalize_expert_weights=1 is not supported: transformers weights the "
                "one expert by 1, megatron's top-1 routing by its softmax probability (use None for that).")
        clip = a.clip_qkv
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise C.UnsupportedConfigError(f"attn_config.clip_qkv={clip!r}: expected None or a positive number.")
        super().check_config()

    def num_experts(self) -> int:
        return self.hf_config.ffn_config.moe_num_experts

    def top_k(self) -> int:
        return self.hf_config.ffn_config.moe_top_k

    def expert_ffn_size(self) -> int:
        return self.hf_config.ffn_config.ffn_hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "softmax",
                "moe_router_pre_softmax": self.hf_config.ffn_config.moe_normalize_expert_weights is None}

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm",
                "layernorm_epsilon": LAYER_NORM_EPS, "activation_func": F.silu}

    def attention_module(self) -> type | None:
        clip = self.hf_config.attn_config.clip_qkv
        return None if clip is None else clipped_attention(float(clip))

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.input_layernorm.weight", f"{A}.norm_1.weight"),
                PackedQKV(f"{D}.self_attention.linear_qkv.weight", f"{A}.attn.Wqkv.weight"),
                RowParallel(f"{D}.self_attention.linear_proj.weight", f"{A}.attn.out_proj.weight")]

    def moe_mappings(self) -> list[Mapping]:
        rows = self.expert_ffn_size()
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{A}.norm_2.weight"),
                Replicated(f"{D}.mlp.router.weight", f"{L}.ffn.router.layer.weight"),
                routed_stack(self, StackedGatePair, "linear_fc1.weight", f"{X}.w1", up=f"{X}.v1", rows=rows),
                routed_stack(self, StackedDown, "linear_fc2.weight", f"{X}.w2", transposed=True, rows=rows)]

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.moe_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        return self.layer_mappings()

    def embedding_mapping(self) -> Mapping:
        return VocabParallel("embedding.word_embeddings.weight", "transformer.wte.weight")

    def final_mappings(self) -> list[Mapping]:
        return [Replicated("decoder.final_layernorm.weight", "transformer.norm_f.weight"),
                VocabParallel("output_layer.weight", "lm_head.weight")]

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, hd, kv = c.hidden_size, C.head_dim_of(c), c.attn_config.kv_n_heads
        a, x = A.format(layer=layer), X.format(layer=layer)
        rows = (self.num_experts() * self.expert_ffn_size(), h)
        return {f"{a}.norm_1.weight": (h,), f"{a}.attn.Wqkv.weight": (h + 2 * kv * hd, h),
                f"{a}.attn.out_proj.weight": (h, h), f"{a}.norm_2.weight": (h,),
                f"{L.format(layer=layer)}.ffn.router.layer.weight": (self.num_experts(), h),
                f"{x}.w1": rows, f"{x}.v1": rows, f"{x}.w2": rows}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, v = c.hidden_size, c.vocab_size
        shapes = {"transformer.wte.weight": (v, h), "transformer.norm_f.weight": (h,), "lm_head.weight": (v, h)}
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes
