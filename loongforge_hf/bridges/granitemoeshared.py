"""GraniteMoeSharedForCausalLM (IBM's Granite MoE with a shared MLP: granite-3.x MoE checkpoints trained with
``shared_intermediate_size``, e.g. ibm-research/moe-7b-1b-active-shared-experts): Granite MoE (``granite.py``) with an
always-on gated MLP beside the experts in every layer.

Choices:
- Everything of ``GraniteMoeBridge``: the four multipliers, softmax top-k routing renormalised over the k chosen,
  experts stacked on disk, transformers' balancing loss and ``router_logits``.
- ``shared_mlp`` (``input_linear`` ``[gate; up]`` rows, ``output_linear``; silu, no biases) as megatron's shared
  experts (no gate), added to the routed experts' output inside megatron's ``MoELayer``; the residual multiplier then
  scales the sum, as transformers' ``(moe + shared) * residual_multiplier``. ``shared_intermediate_size=0`` (the
  config's default: transformers builds no shared MLP) is Granite MoE's layer as it is.
"""

from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.granite import GraniteMoeBridge
from loongforge_hf.bridges.mappings import Mapping, RowParallel
from loongforge_hf.bridges.packed_mappings import PackedGatedMLP
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("GraniteMoeSharedForCausalLM")
class GraniteMoeSharedBridge(GraniteMoeBridge):
    def shared_ffn_size(self) -> int | None:
        return self.hf_config.shared_intermediate_size or None

    def moe_mappings(self) -> list[Mapping]:
        size, shared = self.shared_ffn_size(), f"{L}.shared_mlp"
        if size is None:
            return super().moe_mappings()
        return [*super().moe_mappings(),
                PackedGatedMLP(f"{D}.mlp.shared_experts.linear_fc1.weight", f"{shared}.input_linear.weight", size),
                RowParallel(f"{D}.mlp.shared_experts.linear_fc2.weight", f"{shared}.output_linear.weight")]

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, size = self.hf_config.hidden_size, self.shared_ffn_size()
        if size is None:
            return super().moe_shapes(prefix)
        return {**super().moe_shapes(prefix), f"{prefix}.shared_mlp.input_linear.weight": (2 * size, h),
                f"{prefix}.shared_mlp.output_linear.weight": (h, size)}
