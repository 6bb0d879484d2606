"""ArceeForCausalLM (Arcee AFM-4.5B): the Llama layout with a plain (not gated) MLP, ``down(relu2(up(x)))``: megatron's
``MLP`` without ``gated_linear_unit``, ``up_proj`` as its ``linear_fc1``."""

from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("ArceeForCausalLM")
class ArceeBridge(DenseBridge):
    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "gated_linear_unit": False}

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
                ColumnParallel(f"{D}.mlp.linear_fc1.weight", f"{L}.mlp.up_proj.weight"),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{L}.mlp.down_proj.weight")]

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f = self.hf_config.hidden_size, self.hf_config.intermediate_size
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{prefix}.mlp.up_proj.weight": (f, h),
                f"{prefix}.mlp.down_proj.weight": (h, f)}
