"""Qwen3NextForCausalLM (Qwen3-Next-80B-A3B): Qwen3.5-MoE's layers with the linear-attention in-projections fused
per key head, and Qwen3-MoE's choice of sparse layers and top-k renormalisation.

Choices:
- As ``Qwen3_5MoeBridge`` (Gated DeltaNet and gated full-attention layers, zero-centred norms, partial rotary, softmax
  top-k experts plus a sigmoid-gated shared expert, transformers' balancing loss and ``router_logits``, the same
  refusals), with Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step`` (dense layers use ``intermediate_size``)
  and ``norm_topk_prob``.
- ``in_proj_qkvz`` holds per key head its q and k rows and the v and z rows of the value heads it serves,
  ``in_proj_ba`` per key head their b then their a rows: ``gated_mappings.KeyHeadGroups`` regroups a rank's key
  heads into the ``in_proj`` our ``GatedDeltaNet`` takes (q, k, v, z, b, a), and back on export. The conv's channels
  are q, k, v in plain order, as Qwen3.5's.
"""

from __future__ import annotations

from loongforge_hf.bridges.gated_mappings import KeyHeadGroups
from loongforge_hf.bridges.mappings import Mapping
from loongforge_hf.bridges.qwen3_5 import A, S
from loongforge_hf.bridges.qwen3_5_moe import Qwen3_5MoeBridge
from loongforge_hf.bridges.qwen3_moe import Qwen3MoeBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Qwen3NextForCausalLM")
class Qwen3NextBridge(Qwen3_5MoeBridge):
    is_moe_layer = Qwen3MoeBridge.is_moe_layer

    def renormalises_top_k(self) -> bool:
        return self.hf_config.norm_topk_prob

    def _per_key_head(self) -> tuple[int, int, int]:
        """Rows of one key head's group: of q or k, of v or z (its value heads'), of b or a."""
        c = self.hf_config
        per = c.linear_num_value_heads // c.linear_num_key_heads
        return c.linear_key_head_dim, per * c.linear_value_head_dim, per

    def linear_attention_mappings(self) -> list[Mapping]:
        kd, vd, nv = self._per_key_head()
        fused = KeyHeadGroups(f"{S}.in_proj.weight", ((f"{A}.in_proj_qkvz.weight", (kd, kd, vd, vd)),
                                                      (f"{A}.in_proj_ba.weight", (nv, nv))),
                              groups=self.hf_config.linear_num_key_heads)
        maps = super().linear_attention_mappings()
        return [fused if m.megatron == f"{S}.in_proj.weight" else m for m in maps]

    def linear_attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"{prefix}.linear_attn"
        shapes = super().linear_attention_shapes(prefix)
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            del shapes[f"{p}.{name}.weight"]
        kd, vd, nv = self._per_key_head()
        heads, h = c.linear_num_key_heads, c.hidden_size
        return {**shapes, f"{p}.in_proj_qkvz.weight": (heads * 2 * (kd + vd), h),
                f"{p}.in_proj_ba.weight": (heads * 2 * nv, h)}
