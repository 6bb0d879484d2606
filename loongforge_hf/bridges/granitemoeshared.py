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
- ``shared_mlp_mappings`` / ``shared_mlp_shapes`` are Granite 4.0 H's too (``granitemoehybrid.py``: beside its experts,
  or alone as a dense layer's MLP).
"""

from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.granite import GraniteMoeBridge
from loongforge_hf.bridges.mappings import Mapping, RowParallel
from loongforge_hf.bridges.packed_mappings import PackedGatedMLP
from loongforge_hf.bridges.registry import register_bridge


def shared_mlp_mappings(size: int, *, megatron: str = f"{D}.mlp.shared_experts") -> list[Mapping]:
    """``shared_mlp``'s ``input_linear`` (``[gate; up]``, ``size`` rows each) and ``output_linear`` as the
    ``linear_fc1`` / ``linear_fc2`` of the megatron module ``megatron`` (the shared experts, or a dense MLP)."""
    shared = f"{L}.shared_mlp"
    return [PackedGatedMLP(f"{megatron}.linear_fc1.weight", f"{shared}.input_linear.weight", size),
            RowParallel(f"{megatron}.linear_fc2.weight", f"{shared}.output_linear.weight")]


def shared_mlp_shapes(prefix: str, *, hidden: int, size: int) -> dict[str, tuple[int, ...]]:
    """The HF shapes of ``shared_mlp``'s tensors in layer ``prefix``."""
    return {f"{prefix}.shared_mlp.input_linear.weight": (2 * size, hidden),
            f"{prefix}.shared_mlp.output_linear.weight": (hidden, size)}


@register_bridge("GraniteMoeSharedForCausalLM")
class GraniteMoeSharedBridge(GraniteMoeBridge):
    def shared_ffn_size(self) -> int | None:
        return self.hf_config.shared_intermediate_size or None

    def moe_mappings(self) -> list[Mapping]:
        size = self.shared_ffn_size()
        return super().moe_mappings() + ([] if size is None else shared_mlp_mappings(size))

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        size = self.shared_ffn_size()
        return {**super().moe_shapes(prefix),
                **({} if size is None else shared_mlp_shapes(prefix, hidden=self.hf_config.hidden_size, size=size))}
