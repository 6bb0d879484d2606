"""Cohere2MoeForCausalLM (Cohere's Command A MoE models): Cohere2's layer (the attention and the MLP side by side
after one norm, interleaved rotary pairs, sliding-window layers, scaled logits) with a mixture of experts as its MLP.

Choices:
- As ``Cohere2Bridge`` (``cohere.py``): each layer ``x + attn(norm(x)) + mlp(norm(x))`` with one
  ``input_layernorm``, built by the MoE spec as the dense one (``specs.py``: megatron's MoE layer in
  ``kernels.specs.SharedNormParallelLayer``); the window on the sliding layers, ``logit_scale``, tied embeddings;
  ``attention_bias`` refused. The norms are ``CohereLayerNorm`` (no bias, ``layer_norm_eps``) or, where the config
  sets ``rms_norm_eps``, an RMSNorm with Llama's numerics: our ``RMSNorm``.
- Rotary: the sliding layers rotate; a full layer rotates only where it is dense and
  ``prefix_dense_sliding_window_pattern`` is 1 (transformers' ``force_rope``); the others take none
  (``smollm3.no_rope_attention``).
- ``mlp_layer_types``: ``dense`` layers (the prefix: ``first_k_dense_replace``) a gated MLP of
  ``prefix_dense_intermediate_size`` (``intermediate_size`` where unset), ``sparse`` ones ``num_experts`` experts of
  ``intermediate_size`` (one tensor per expert on disk, as transformers' ``save_pretrained`` writes them).
- Routing (``expert_selection_fn``): ``softmax``, the top ``num_experts_per_tok`` logits then a softmax over them
  (megatron's ``pre_softmax=False``); ``sigmoid``, the sigmoid of the top logits, renormalised with
  ``norm_topk_prob`` (megatron renormalises exactly when k > 1, so the other pairings are refused; it divides by
  the sum plus 1e-20, transformers by the sum: the same unless every chosen score is below 1e-13).
- ``num_shared_experts`` always-on experts as one MLP of ``intermediate_size * num_shared_experts``
  (``mlp.shared_experts``); ``shared_expert_combination_strategy``: ``sum`` megatron's own, ``average`` the MoE
  layer's output halved (``layer_outputs.transformed_moe``: ``(routed + shared) / 2`` exactly).
- transformers' ``router_logits`` (model dtype, every sparse layer); no balancing loss (transformers adds none).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.cohere import Cohere2Bridge
from loongforge_hf.bridges.layer_outputs import transformed_moe
from loongforge_hf.bridges.layer_types import check_mlp_layer_types
from loongforge_hf.bridges.mappings import Mapping
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention

_COMBINATIONS = ("sum", "average")


@register_bridge("Cohere2MoeForCausalLM")
class Cohere2MoeBridge(Cohere2Bridge, MoEBridge):
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss

    def __init__(self, hf_config) -> None:
        self.rms_norm = getattr(hf_config, "rms_norm_eps", None) is not None
        self.config_fields = C.fields_with_eps("rms_norm_eps" if self.rms_norm else "layer_norm_eps")
        self.shared_experts = "shared_experts" if (getattr(hf_config, "num_shared_experts", 0) or 0) > 0 else None
        super().__init__(hf_config)

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        check_mlp_layer_types(c)
        combination = c.shared_expert_combination_strategy
        if self.shared_experts and combination not in _COMBINATIONS:
            raise C.UnsupportedConfigError(f"shared_expert_combination_strategy={combination!r} is not supported; "
                                           f"supported: {list(_COMBINATIONS)}.")
        super().check_config()

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def expert_ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def shared_ffn_size(self) -> int | None:
        return self.hf_config.intermediate_size * self.hf_config.num_shared_experts if self.shared_experts else None

    def dense_ffn_size(self) -> int:
        c = self.hf_config
        return getattr(c, "prefix_dense_intermediate_size", None) or c.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return self.hf_config.mlp_layer_types[layer] == "sparse"

    def routing_kwargs(self) -> dict:
        c = self.hf_config
        if c.expert_selection_fn == "softmax":
            return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": False}
        if c.expert_selection_fn != "sigmoid":
            raise C.UnsupportedConfigError(f"expert_selection_fn={c.expert_selection_fn!r} is not supported; "
                                           "supported: 'softmax', 'sigmoid'.")
        if bool(c.norm_topk_prob) != (c.num_experts_per_tok > 1):
            raise C.UnsupportedConfigError(
                f"norm_topk_prob={c.norm_topk_prob} with num_experts_per_tok={c.num_experts_per_tok} is not supported "
                "with expert_selection_fn='sigmoid': megatron renormalises the chosen sigmoid scores exactly when "
                "more than one expert is chosen.")
        return {"moe_router_score_function": "sigmoid"}

    def transformer_config_kwargs(self) -> dict:
        kw = {**super().transformer_config_kwargs(), "ffn_hidden_size": self.dense_ffn_size()}
        return {**kw, "normalization": "RMSNorm"} if self.rms_norm else kw

    def attention_module(self) -> type | None:
        c = self.hf_config
        forced = c.prefix_dense_sliding_window_pattern == 1  # NOTE: transformers' force_rope on the dense layers
        nope = frozenset(i for i, kind in enumerate(c.layer_types) if kind == "full_attention"
                         and not (forced and c.mlp_layer_types[i] == "dense"))
        return no_rope_attention(nope) if nope else None

    def moe_module(self) -> type | None:
        average = self.shared_experts and self.hf_config.shared_expert_combination_strategy == "average"
        return transformed_moe(scale=0.5) if average else None

    # ---- tensors --------------------------------------------------------------------------------------------
    def moe_mappings(self) -> list[Mapping]:
        # NOTE: no pre-MLP norm: the experts read the input norm's output
        return [m for m in super().moe_mappings() if not m.megatron.endswith(".pre_mlp_layernorm.weight")]

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().moe_shapes(prefix)
        shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return shapes

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f = self.hf_config.hidden_size, self.dense_ffn_size()
        return {f"{prefix}.mlp.gate_proj.weight": (f, h), f"{prefix}.mlp.up_proj.weight": (f, h),
                f"{prefix}.mlp.down_proj.weight": (h, f)}
