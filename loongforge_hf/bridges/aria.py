"""AriaTextForCausalLM (the language model of Rhymes AI's Aria, as its own causal LM): the Llama layout with a mixture
of experts in every layer beside shared experts.

Choices:
- Attention, norms and rope are Llama's (``attention_bias`` and ``mlp_bias`` refused by the shared dense checks).
- Every layer sparse: ``moe_num_experts`` experts of ``intermediate_size``, the top ``moe_topk`` of the router's
  logits (``mlp.router``, the model's dtype) weighted by the softmax over the chosen logits: megatron's softmax
  routing with ``moe_router_pre_softmax=False``. ``moe_num_shared_experts`` always-on experts as one MLP of
  ``intermediate_size * moe_num_shared_experts`` (``mlp.shared_experts``, megatron's shared experts, ungated).
- transformers' routed experts are always SiLU-gated while its shared experts follow ``hidden_act``; megatron has one
  activation for both: ``hidden_act`` other than ``silu`` is refused.
- On disk the routed experts are stacked and transposed, as the hub's files and transformers' ``save_pretrained``
  write them: ``mlp.experts.fc1.weight`` ``[E, H, 2F]`` (``[gate | up]`` columns) and ``fc2.weight`` ``[E, F, H]``,
  read and written one expert at a time (``stacked_experts.py``).
- transformers' ``router_logits`` (every layer, the model's dtype); no balancing loss (transformers adds none).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.mappings import Mapping
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, routed_stack

_FC1, _FC2 = "mlp.experts.fc1.weight", "mlp.experts.fc2.weight"


@register_bridge("AriaTextForCausalLM")
class AriaTextBridge(MoEBridge):
    shared_experts = "shared_experts"
    router_name = "router"
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for AriaTextForCausalLM "
                                           "(only silu): its routed experts are SiLU-gated whatever it says.")
        for name in ("moe_num_experts", "moe_topk", "moe_num_shared_experts"):
            if (getattr(c, name, None) or 0) < 1:
                raise C.UnsupportedConfigError(f"{name}={getattr(c, name, None)} is not supported (at least 1).")
        if c.moe_topk > c.moe_num_experts:
            raise C.UnsupportedConfigError(f"moe_topk={c.moe_topk} exceeds moe_num_experts={c.moe_num_experts}.")
        super().check_config()

    def num_experts(self) -> int:
        return self.hf_config.moe_num_experts

    def top_k(self) -> int:
        return self.hf_config.moe_topk

    def expert_ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def shared_ffn_size(self) -> int:
        return self.hf_config.intermediate_size * self.hf_config.moe_num_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": False}

    # ---- tensors --------------------------------------------------------------------------------------------
    def moe_mappings(self) -> list[Mapping]:
        routed = f"{D}.mlp.experts."
        maps = [m for m in super().moe_mappings() if not m.megatron.startswith(routed)]
        return [*maps, routed_stack(self, StackedGateUp, "linear_fc1.weight", f"{L}.{_FC1}", transposed=True),
                routed_stack(self, StackedDown, "linear_fc2.weight", f"{L}.{_FC2}", transposed=True)]

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        shapes = {k: v for k, v in super().moe_shapes(prefix).items() if ".mlp.experts." not in k}
        return {**shapes, f"{prefix}.{_FC1}": (n, h, 2 * f), f"{prefix}.{_FC2}": (n, f, h)}
