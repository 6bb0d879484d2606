"""AXK1ForCausalLM (SK Telecom's A.X-K1): GLM-4.7-Flash's bridge (DeepSeek-V3's multi-latent attention and mixture of
experts, dense or sparse by ``mlp_layer_types``) with a norm on the MoE layers' output.

Choices:
- Everything but the norm is ``glm4_moe_lite.Glm4MoeLiteBridge``: MLA with ``q_lora_rank`` (required: transformers'
  A.X-K1 always builds ``q_a_proj`` / ``q_b_proj``), rotary pairs on disk unless ``rope_interleave=False``, sigmoid
  routing with a fixed ``e_score_correction_bias``, top-2-sum groups, ``routed_scaling_factor``, shared experts, the
  router in fp32, ``router_logits``, multi-token-prediction layers passed through.
- ``post_mlp_layernorm`` (RMSNorm, ``rms_norm_eps``) normalises a MoE layer's output, routed and shared experts
  together, before the residual add (``layer_outputs.transformed_moe``, as AFMoE's and FlexOlmo's). It lives on disk
  at the decoder layer (``model.layers.N.post_mlp_layernorm.weight``: transformers renames it into ``mlp.`` on load
  and back on save). The released checkpoints also hold one for the dense layers, which transformers ignores: read
  as passthrough here (not built, copied unchanged on export), and left out of the loading info as transformers
  leaves it out (its ignore pattern matches the renamed ``mlp.post_mlp_layernorm``: ``load_kwargs.loading_info``).
- The released checkpoints have no ``mlp.gate.e_score_correction_bias``: transformers starts it at zero (its class
  ignores it as missing) and writes it on save. ``optional_tensors`` reads an absent one as zeros
  (``optional_tensors.py``), so those checkpoints load, route as transformers' and export it; a checkpoint that has
  it loads it.
"""

from __future__ import annotations

import re

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.glm4_moe_lite import Glm4MoeLiteBridge
from loongforge_hf.bridges.layer_outputs import transformed_moe
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge

_POST_MLP = Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_mlp_layernorm.weight")
_DENSE_POST_MLP = re.compile(r"^model\.layers\.(\d+)\.post_mlp_layernorm\.weight$")


@register_bridge("AXK1ForCausalLM")
class AXK1Bridge(Glm4MoeLiteBridge):
    passthrough_kind = "multi-token prediction, dense layers' unused post_mlp_layernorm"
    optional_tensors = ((r"\.mlp\.gate\.e_score_correction_bias$", 0.0),)  # NOTE: not in the hub's checkpoints

    def check_config(self) -> None:
        if not self.hf_config.q_lora_rank:
            raise C.UnsupportedConfigError(f"q_lora_rank={self.hf_config.q_lora_rank} is not supported for "
                                           "AXK1ForCausalLM (transformers' A.X-K1 always has a query latent).")
        super().check_config()

    def moe_module(self) -> type:
        return transformed_moe(post_norm=True)

    def passthrough_names(self, names) -> list[str]:
        """Multi-token-prediction layers, and the dense layers' ``post_mlp_layernorm`` (unused by transformers)."""
        names, layers = list(names), self.hf_config.num_hidden_layers
        dense = [n for n in names if (m := _DENSE_POST_MLP.match(n))
                 and int(m.group(1)) < layers and not self.is_moe_layer(int(m.group(1)))]
        return super().passthrough_names(names) + dense

    # ---- tensors --------------------------------------------------------------------------------------------
    def moe_mappings(self) -> list[Mapping]:
        return [*super().moe_mappings(), _POST_MLP]

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().moe_shapes(prefix), f"{prefix}.post_mlp_layernorm.weight": (self.hf_config.hidden_size,)}
