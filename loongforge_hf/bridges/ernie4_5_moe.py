"""Ernie4_5_MoeForCausalLM (ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B): ERNIE 4.5's attention with softmax top-k experts
chosen on the scores plus a fixed expert bias.

Choices:
- Attention is ERNIE 4.5 dense's (``llama.Ernie45Bridge``): the Llama layout rotating interleaved channel pairs,
  megatron's ``rotary_interleaved`` on its own rotary path. ``use_bias=True`` (a bias on every linear but the routed
  experts' and the router's, the LM head's included) is refused.
- Layer ``i`` is sparse where ``(i + 1) % moe_layer_interval == 0`` and ``moe_layer_start_index <= i <=
  moe_layer_end_index``, dense (``intermediate_size``) elsewhere. ``moe_num_shared_experts`` always-on experts of
  ``moe_intermediate_size`` each are one ungated MLP added to the routed output: megatron's shared experts.
- Routing, in fp32 (the router weight kept in fp32, as transformers keeps it): the softmax over all experts, the top
  k of it plus ``e_score_correction_bias`` (``mlp.moe_statics`` on disk, ``[1, E]``, fixed as in transformers), the
  chosen softmax scores renormalised by ``clamp(sum, min=moe_norm_min)``: ``biased_routing.py``, which replaces
  megatron's routing function in these routers (megatron-core 0.16 adds an expert bias to sigmoid scores only).
- transformers' ``router_logits`` (fp32) and balancing loss (``output_router_logits``, ``router_aux_loss_coef``), whose
  slot counts are the top k of the softmax without the bias, as transformers' ``load_balancing_loss_func`` counts.
- On disk the routed experts are one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``: the
  hub's files, and what transformers' ``save_pretrained`` writes from its stacked experts), read and written so.
  The hub's multi-token-prediction tensors (``model.mtp_*``), which transformers does not build, are skipped on load
  with a warning and copied unchanged on export.
"""

from loongforge_hf.bridges import biased_routing
from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.mappings import FP32Replicated, Mapping
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge

_BIAS = "mlp.moe_statics.e_score_correction_bias"


@register_bridge("Ernie4_5_MoeForCausalLM")
class Ernie45MoeBridge(MoEBridge):
    router_fp32 = True
    # NOTE: megatron applies these in the routing function biased_routing.route replaces (builder refuses them)
    unserved_megatron_fields = ("moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_router_topk_scaling_factor",
                                "moe_router_num_groups", "moe_router_group_topk", "moe_router_fusion",
                                "moe_router_load_balancing_type")
    hf_balance_loss = True
    hf_router_logits = True
    has_passthrough = True

    def __init__(self, hf_config) -> None:
        self.shared_experts = "shared_experts" if getattr(hf_config, "moe_num_shared_experts", 0) else None
        super().__init__(hf_config)

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        if getattr(c, "use_bias", False):
            raise C.UnsupportedConfigError("use_bias=True (biases on every linear) is not supported.")
        for name in ("moe_num_experts", "moe_k", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval",
                     "moe_num_shared_experts", "moe_norm_min"):
            if getattr(c, name) is None:
                raise C.UnsupportedConfigError(f"{name}=None is not supported (transformers' model needs a number).")
        if c.moe_layer_interval < 1:
            raise C.UnsupportedConfigError(f"moe_layer_interval={c.moe_layer_interval} must be at least 1.")
        super().check_config()

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "rotary_interleaved": True}

    def num_experts(self) -> int:
        return self.hf_config.moe_num_experts

    def top_k(self) -> int:
        return self.hf_config.moe_k

    def shared_ffn_size(self) -> int | None:
        c = self.hf_config
        return c.moe_intermediate_size * c.moe_num_shared_experts if self.shared_experts else None

    def is_moe_layer(self, layer: int) -> bool:
        c = self.hf_config
        last = c.num_hidden_layers - 1 if c.moe_layer_end_index == -1 else c.moe_layer_end_index
        return (layer + 1) % c.moe_layer_interval == 0 and c.moe_layer_start_index <= layer <= last

    def routing_kwargs(self) -> dict:
        if self.num_experts() <= 0 or not any(self.is_moe_layer(i) for i in range(self.hf_config.num_hidden_layers)):
            raise C.UnsupportedConfigError("no MoE layer (moe_num_experts, moe_layer_*): use Ernie4_5ForCausalLM for "
                                           "a model without experts.")
        # NOTE: the scores biased_routing.route starts from; it routes in place of megatron's function
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": True}

    def finish_model(self, model) -> None:
        super().finish_model(model)
        biased_routing.attach(model, num_experts=self.num_experts(), norm_min=self.hf_config.moe_norm_min)

    # ---- tensors --------------------------------------------------------------------------------------------
    def moe_mappings(self) -> list[Mapping]:
        return [*super().moe_mappings(), FP32Replicated(f"{D}.mlp.router.expert_bias", f"{L}.{_BIAS}")]

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().moe_shapes(prefix), f"{prefix}.{_BIAS}": (1, self.num_experts())}

    def passthrough_names(self, names) -> list[str]:
        """The hub's multi-token-prediction tensors (``model.mtp_block.0.*``, ``model.mtp_linear_proj.0.weight``...)."""
        return [n for n in names if n.startswith("model.mtp_")]
