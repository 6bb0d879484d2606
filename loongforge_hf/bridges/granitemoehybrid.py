"""GraniteMoeHybridForCausalLM (IBM Granite 4.0: the hybrid "H" models granite-4.0-h-micro / tiny / small, and the
attention-only granite-4.0-micro): Mamba2 and attention layers (``layer_types``), Granite MoE's experts beside a
shared MLP in every layer, Granite's four multipliers.

Choices:
- ``mamba`` layers (``linear_attention`` once transformers has read the config): ``mamba.*`` -> our ``Mamba2Mixer``
  in megatron's self-attention slot (``mamba2.py``: TP by heads and groups, B / C replicated where TP exceeds the
  groups, the padding mask, packed documents, the cached generate's states, context parallelism through
  ``parallel/ssd_cp.py``), its tensors, layouts and refusals as ``mamba2_layers.py`` declares them for every
  bridge with Mamba2 layers (Bamba, Nemotron-H too).
- ``attention`` layers: megatron's ``SelfAttention`` (GQA) with Granite's ``attention_multiplier`` as the softmax
  scale, rotated only with ``position_embedding_type="rope"`` (the H models have none: megatron's ``"none"``).
- MLP: Granite MoE's (``granite.py``: softmax top-k renormalised over the k chosen, the experts stacked on disk,
  transformers' balancing loss and ``router_logits``) plus the always-on ``shared_mlp`` as megatron's shared experts
  (``input_linear`` ``[gate; up]``, ``output_linear``; no gate: ``granitemoeshared``'s mappings); with
  ``num_local_experts=0`` the shared MLP alone, as a dense layer's MLP.
- Multipliers as Granite MoE's: the embedding's, the residual one on the mixer's and the MLP's outputs (Mamba2 or
  attention alike), ``1 / logits_scaling`` on the final norm's output.
- Cached ``generate``: the attention layers' keys and values and the Mamba2 layers' conv and SSM states in our
  KV cache (``kv_cache.py``); greedy, sampling, beam search.
- Context parallelism: the attention layers as megatron runs them, the Mamba2 layers passing their conv and SSM
  states between the ranks' chunks (``parallel/ssd_cp.py``); ``generate`` under it without the cache.
- Refused before any collective: ``mamba_n_heads`` that do not split over TP, ``mamba_n_groups`` that neither split
  over TP nor divide it (the hub's ``n_groups=1`` runs at any TP dividing the heads), ``mamba_proj_bias``,
  ``attention_bias``, ``hidden_act`` other than silu, unknown ``layer_types``, ``cache_implementation="static"``
  (its fixed-shape decode step keeps no Mamba2 state; the default dynamic cache runs).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.granite import GraniteMoeBridge
from loongforge_hf.bridges.granitemoeshared import shared_mlp_mappings, shared_mlp_shapes
from loongforge_hf.bridges.mamba2_layers import MAMBA, Mamba2Layers, mamba_dims_of
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge

ATTENTION = ("full_attention", "attention")


@register_bridge("GraniteMoeHybridForCausalLM")
class GraniteMoeHybridBridge(Mamba2Layers, GraniteMoeBridge):
    per_layer_types = True  # NOTE: layer_types checked here

    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        if not self.hf_config.num_local_experts:  # NOTE: granite-4.0-micro: the shared MLP alone
            self.hf_balance_loss = self.hf_router_logits = False
        if self.hf_config.position_embedding_type != "rope":
            self.position_embedding_type = "none"

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        kinds = list(c.layer_types or [])
        unknown = sorted(set(kinds) - set(MAMBA + ATTENTION))
        if unknown or len(kinds) != c.num_hidden_layers:
            raise C.UnsupportedConfigError(f"layer_types {kinds} is not supported for {arch}: one of "
                                           f"{list(MAMBA + ATTENTION)} per layer ({c.num_hidden_layers}).")
        if c.position_embedding_type not in (None, "nope", "rope"):
            raise C.UnsupportedConfigError(f"position_embedding_type={c.position_embedding_type!r} is not supported "
                                           f"for {arch} (None, 'nope' or 'rope').")
        C.refuse_set_fields(c, arch, (("mamba_proj_bias", "biases of in_proj / out_proj"),
                                      ("attention_bias", "megatron's attention output bias follows the MLP's")))
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only 'silu': "
                                           "the Mamba2 conv and gated norm use it).")
        self.check_mamba_dims()
        if c.mamba_n_heads * c.mamba_d_head != c.mamba_expand * c.hidden_size:
            raise C.UnsupportedConfigError(f"mamba_n_heads={c.mamba_n_heads}, mamba_d_head={c.mamba_d_head}, "
                                           f"mamba_n_groups={c.mamba_n_groups} do not fit mamba_expand * hidden_size "
                                           f"for {arch}.")
        if c.num_local_experts:
            super().check_config()
        else:
            DenseBridge.check_config(self)

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, extra_types=self.extra_rope_types)

    def num_experts(self) -> int | None:
        return self.hf_config.num_local_experts or None

    def shared_ffn_size(self) -> int:
        return self.hf_config.shared_intermediate_size

    def transformer_config_kwargs(self) -> dict:
        if self.hf_config.num_local_experts:
            return super().transformer_config_kwargs()
        return {**DenseBridge.transformer_config_kwargs(self), "ffn_hidden_size": self.shared_ffn_size(),
                "softmax_scale": self._multiplier("attention_multiplier")}

    def mamba_dims(self) -> dict:
        return mamba_dims_of(self.hf_config)

    # ---- tensors --------------------------------------------------------------------------------------------
    def mlp_mappings(self) -> list[Mapping]:
        size = self.shared_ffn_size()
        if not self.hf_config.num_local_experts:
            return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
                    *shared_mlp_mappings(size, megatron=f"{D}.mlp")]
        return self.moe_mappings() + shared_mlp_mappings(size)

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.mamba_mappings()[1:] + self.mlp_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mixer = self.mamba_mappings() if layer in self.mamba_layers else self.attention_mappings()
        return mixer + self.mlp_mappings()

    def mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h = self.hf_config.hidden_size
        shapes = shared_mlp_shapes(prefix, hidden=h, size=self.shared_ffn_size())
        if self.hf_config.num_local_experts:
            return {**self.moe_shapes(prefix), **shapes}
        return {f"{prefix}.post_attention_layernorm.weight": (h,), **shapes}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        mixer = self.mamba_shapes(prefix) if layer in self.mamba_layers else self.attention_shapes(prefix)
        return {**mixer, **self.mlp_shapes(prefix)}
