"""ArceeForCausalLM (Arcee AFM-4.5B): the Llama layout with a plain (not gated) MLP, ``down(relu2(up(x)))``: megatron's
``MLP`` without ``gated_linear_unit``, ``up_proj`` as its ``linear_fc1``."""

from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.registry import register_bridge


class PlainMLP:
    """A dense bridge's MLP ``fc2(act(fc1(x)))`` without a gate: megatron's ``MLP`` without ``gated_linear_unit``,
    the HF names ``mlp_names`` (fc1, fc2) as its ``linear_fc1`` / ``linear_fc2`` (Arcee's; StarCoder2's ``c_fc`` /
    ``c_proj``)."""

    mlp_names = ("up_proj", "down_proj")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "gated_linear_unit": False}

    def dense_mlp_mappings(self) -> list[Mapping]:
        fc1, fc2 = self.mlp_names
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
                ColumnParallel(f"{D}.mlp.linear_fc1.weight", f"{L}.mlp.{fc1}.weight"),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{L}.mlp.{fc2}.weight")]

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        (fc1, fc2), h, f = self.mlp_names, self.hf_config.hidden_size, self.hf_config.intermediate_size
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{prefix}.mlp.{fc1}.weight": (f, h),
                f"{prefix}.mlp.{fc2}.weight": (h, f)}


@register_bridge("ArceeForCausalLM")
class ArceeBridge(PlainMLP, DenseBridge):
    """Llama's layout with ``PlainMLP``."""
