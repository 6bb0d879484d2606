"""BambaForCausalLM (IBM / Princeton / UIUC Bamba-9B): Mamba2 layers with attention at ``attn_layer_indices``, a
gated silu MLP after every mixer.

Choices:
- Mamba2 layers (``linear_attention``): ``mamba.*`` -> our ``Mamba2Mixer`` in megatron's self-attention slot, as
  Granite 4.0 H's (transformers' ``BambaMixer`` is its ``GraniteMoeHybridMambaLayer`` line for line:
  ``mamba2_layers.py`` holds the tensor table, the layouts and the refusals both share).
- Attention layers: megatron's ``SelfAttention`` (GQA), rotary over the first half of each head in rotate-half pairs
  (transformers hard-codes ``partial_rotary_factor=0.5``: megatron's ``rotary_percent``).
- MLP: ``feed_forward.{gate,up,down}_proj`` after ``pre_ff_layernorm``, the dense spec's gated MLP; the final norm is
  ``model.final_layernorm``.
- Refused before any collective: ``z_loss_coefficient`` > 0 (transformers adds a z-loss of the logits to the loss),
  ``mamba_proj_bias``, ``attention_bias``, ``mlp_bias``, ``hidden_act`` other than silu, and what
  ``mamba2_layers.py`` refuses (the static cache among them).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.fused_mappings import GatedMLP
from loongforge_hf.bridges.mamba2_layers import Mamba2Layers, mamba_dims_of
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.registry import register_bridge

FINAL_NORM = "model.final_layernorm.weight"


@register_bridge("BambaForCausalLM")
class BambaBridge(Mamba2Layers, DenseBridge):
    per_layer_types = True  # NOTE: Mamba2 layers (linear_attention) among the full-attention ones

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        if c.z_loss_coefficient:
            raise C.UnsupportedConfigError(f"z_loss_coefficient={c.z_loss_coefficient} is not supported for {arch} "
                                           "(transformers adds a z-loss of the logits to the loss).")
        if c.mamba_proj_bias:
            raise C.UnsupportedConfigError(f"mamba_proj_bias=True is not supported for {arch} (biases of in_proj / "
                                           "out_proj).")
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only 'silu': "
                                           "the Mamba2 conv and gated norm use it).")
        self.check_mamba_dims()
        super().check_config()

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def mamba_dims(self) -> dict:
        return mamba_dims_of(self.hf_config)

    # ---- tensors --------------------------------------------------------------------------------------------
    def dense_mlp_mappings(self) -> list[Mapping]:
        f = f"{L}.feed_forward"
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.pre_ff_layernorm.weight"),
                GatedMLP(f"{D}.mlp.linear_fc1.weight", gate=f"{f}.gate_proj.weight", up=f"{f}.up_proj.weight"),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{f}.down_proj.weight")]

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.mamba_mappings()[1:] + self.dense_mlp_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mixer = self.mamba_mappings() if layer in self.mamba_layers else self.attention_mappings()
        return mixer + self.dense_mlp_mappings()

    def final_mappings(self) -> list[Mapping]:
        return [Replicated("decoder.final_layernorm.weight", FINAL_NORM), *super().final_mappings()[1:]]

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.hf_config.intermediate_size, f"{prefix}.feed_forward"
        return {f"{prefix}.pre_ff_layernorm.weight": (h,), f"{p}.gate_proj.weight": (f, h),
                f"{p}.up_proj.weight": (f, h), f"{p}.down_proj.weight": (h, f)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        mixer = self.mamba_shapes(prefix) if layer in self.mamba_layers else self.attention_shapes(prefix)
        return {**mixer, **self.dense_mlp_shapes(prefix)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_hf_shapes()
        shapes[FINAL_NORM] = shapes.pop("model.norm.weight")
        return shapes
