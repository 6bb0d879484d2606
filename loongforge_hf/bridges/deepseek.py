"""DeepseekV3ForCausalLM and DeepseekV2ForCausalLM: multi-latent attention, shared experts, dense first layers.

Choices:
- MLA maps one to one onto megatron's ``MLASelfAttention`` (local spec): ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm``
  / ``q_b_proj`` (with ``q_lora_rank``), ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj``.
  megatron's local spec splits the down projections over TP too (column-parallel, gathered before the norms); under
  TP + SP the KV latent reaches megatron at full width (``mla_latent.py``: megatron's own gather of it lost the other
  ranks' share of the rotary key's gradient).
- Rotary dims: megatron's MLA reads them as interleaved pairs, like V2 (complex rotation of pairs) and V3 with
  ``rope_interleave=True``; V3 with ``rope_interleave=False`` keeps halves, so its rotary rows are interleaved on load
  and put back on export (``RopeColumnParallel``). Plain rope and YaRN (``config_map.mla_rope_kwargs``).
- V3 routes with sigmoid scores plus ``e_score_correction_bias`` (kept fixed: ``moe_router_bias_update_rate=0``, as
  transformers never updates it), top-2-sum group scores; V2 with softmax scores, never renormalised, max group scores.
- transformers' ``MoeCausalLMOutputWithPast`` with ``router_logits`` (``output_router_logits``): the gating logits
  of the MoE layers (none for the first ``first_k_dense_replace``), before sigmoid / softmax, fp32; no ``aux_loss``.
- Multi-token-prediction layers in a checkpoint (``model.layers.{num_hidden_layers + i}.*``) are not built: they are
  skipped on load with a warning and copied unchanged from the source folder on export.
"""

from __future__ import annotations

import re

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.fused_mappings import RopeColumnParallel
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.moe import MoEBridge, grouped_routing_kwargs
from loongforge_hf.bridges.registry import register_bridge

A, S = f"{D}.self_attention", f"{L}.self_attn"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_sigmoid_renormalisation(c) -> None:
    """``UnsupportedConfigError`` unless ``norm_topk_prob`` renormalises the chosen sigmoid scores as megatron does:
    exactly when more than one expert is chosen (one chosen score stays as it is there, transformers makes it 1)."""
    if bool(c.norm_topk_prob) != (c.num_experts_per_tok > 1):
        raise C.UnsupportedConfigError(
            f"norm_topk_prob={c.norm_topk_prob} with num_experts_per_tok={c.num_experts_per_tok} is not supported "
            "with sigmoid routing (megatron renormalises the chosen sigmoid scores exactly when it chooses more than "
            "one).")


def sigmoid_routing_kwargs(c, num_experts: int | None = None) -> dict:
    """DeepSeek-V3's routing (GLM-4.5's and Kimi Linear's too): sigmoid scores plus a fixed ``e_score_correction_bias``,
    top-2-sum group scores, ``routed_scaling_factor``; top-k renormalised (``check_sigmoid_renormalisation``).
    ``num_experts`` where the config does not name it ``n_routed_experts``."""
    check_sigmoid_renormalisation(c)
    return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_bias_update_rate": 0.0, "moe_router_topk_scaling_factor": c.routed_scaling_factor,
            **grouped_routing_kwargs(num_experts=num_experts or c.n_routed_experts, top_k=c.num_experts_per_tok,
                                     n_group=c.n_group, topk_group=c.topk_group, group_score_top=2)}


class DeepseekStyleMoE(MoEBridge):
    """The mixture of experts DeepSeek-V2/V3 and GLM-4.5 share: ``n_routed_experts`` routed experts plus
    ``n_shared_experts`` always-on ones (``moe_intermediate_size`` each), the first ``first_k_dense_replace`` layers
    dense, the router in fp32 returning transformers' ``router_logits``, multi-token-prediction layers passed
    through. Routing and attention are each model's."""

    shared_experts = "shared_experts"
    router_fp32 = True
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss
    has_passthrough = True

    def check_config(self) -> None:
        super().check_config()
        if not self.hf_config.n_shared_experts:
            raise C.UnsupportedConfigError("n_shared_experts=0 is not supported.")

    def num_experts(self) -> int:
        return self.hf_config.n_routed_experts

    def shared_ffn_size(self) -> int:
        return self.hf_config.moe_intermediate_size * self.hf_config.n_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= (self.hf_config.first_k_dense_replace or 0)

    def passthrough_names(self, names) -> list[str]:
        """The checkpoint's multi-token-prediction tensors (``model.layers.{num_hidden_layers + i}.*``), not built."""
        layers = self.hf_config.num_hidden_layers
        return [n for n in names if (m := _LAYER.match(n)) and int(m.group(1)) >= layers]


class MultiLatentAttention:
    """MLA's attention declarations, for a bridge whose decoder base (``DeepseekStyleMoE``, ``DenseBridge``) follows
    it in the MRO: megatron's ``MLASelfAttention`` with the checkpoint's ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm``
    / ``q_b_proj``, ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj``."""

    interleaved_rope_on_disk = True
    multi_latent_attention = True                              # attention is megatron's MLASelfAttention

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        super().check_config()
        C.check_mla_config(self.hf_config)

    def rope_parameters(self) -> dict:
        rope = C.mla_rope_kwargs(self.hf_config)
        return {"rope_type": rope["rope_type"], "rope_theta": rope["rotary_base"]}

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.update(C.hf_to_megatron(self.hf_config, C.MLA_FIELDS))
        kw.update(C.mla_rope_kwargs(self.hf_config), multi_latent_attention=True, qk_layernorm=True)
        return kw

    # ---- tensors --------------------------------------------------------------------------------------------
    def _rope_rows(self, megatron: str, hf: str, block: int) -> Mapping:
        if self.interleaved_rope_on_disk:
            return ColumnParallel(megatron, hf)
        return RopeColumnParallel(megatron, hf, block=block, rope_dim=self.hf_config.qk_rope_head_dim)

    def attention_mappings(self) -> list[Mapping]:
        c = self.hf_config
        q_head = c.qk_nope_head_dim + c.qk_rope_head_dim
        maps: list[Mapping] = [Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight")]
        if c.q_lora_rank is None:
            maps.append(self._rope_rows(f"{A}.linear_q_proj.weight", f"{S}.q_proj.weight", q_head))
        else:
            maps += [ColumnParallel(f"{A}.linear_q_down_proj.weight", f"{S}.q_a_proj.weight"),
                     Replicated(f"{A}.q_layernorm.weight", f"{S}.q_a_layernorm.weight"),
                     self._rope_rows(f"{A}.linear_q_up_proj.weight", f"{S}.q_b_proj.weight", q_head)]
        return maps + [
            self._rope_rows(f"{A}.linear_kv_down_proj.weight", f"{S}.kv_a_proj_with_mqa.weight",
                            c.kv_lora_rank + c.qk_rope_head_dim),
            Replicated(f"{A}.kv_layernorm.weight", f"{S}.kv_a_layernorm.weight"),
            ColumnParallel(f"{A}.linear_kv_up_proj.weight", f"{S}.kv_b_proj.weight"),
            RowParallel(f"{A}.linear_proj.weight", f"{S}.o_proj.weight"),
        ]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, n, p = c.hidden_size, c.num_attention_heads, f"{prefix}.self_attn"
        q_rows = n * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        shapes = {f"{prefix}.input_layernorm.weight": (h,),
                  f"{p}.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
                  f"{p}.kv_a_layernorm.weight": (c.kv_lora_rank,),
                  f"{p}.kv_b_proj.weight": (n * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                  f"{p}.o_proj.weight": (h, n * c.v_head_dim)}
        if c.q_lora_rank is None:
            shapes[f"{p}.q_proj.weight"] = (q_rows, h)
        else:
            shapes.update({f"{p}.q_a_proj.weight": (c.q_lora_rank, h), f"{p}.q_a_layernorm.weight": (c.q_lora_rank,),
                           f"{p}.q_b_proj.weight": (q_rows, c.q_lora_rank)})
        return shapes


class DeepseekBridge(MultiLatentAttention, DeepseekStyleMoE):
    """DeepSeek-V2 / V3: multi-latent attention with DeepSeek's mixture of experts; routing is each version's."""


@register_bridge("DeepseekV3ForCausalLM")
class DeepseekV3Bridge(DeepseekBridge):
    expert_bias = True

    def __init__(self, hf_config) -> None:
        self.interleaved_rope_on_disk = bool(getattr(hf_config, "rope_interleave", True))
        super().__init__(hf_config)

    def routing_kwargs(self) -> dict:
        return sigmoid_routing_kwargs(self.hf_config)


@register_bridge("DeepseekV2ForCausalLM")
class DeepseekV2Bridge(DeepseekBridge):
    def routing_kwargs(self) -> dict:
        c = self.hf_config
        kw = {"moe_router_score_function": "softmax", "moe_router_pre_softmax": True,
              "moe_router_topk_scaling_factor": c.routed_scaling_factor}
        if c.topk_method == "group_limited_greedy":
            kw.update(grouped_routing_kwargs(num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok,
                                             n_group=c.n_group, topk_group=c.topk_group, group_score_top=1))
        elif c.topk_method != "greedy":
            raise C.UnsupportedConfigError(f"topk_method={c.topk_method!r} is not supported; supported: 'greedy', "
                                           "'group_limited_greedy'.")
        return kw
