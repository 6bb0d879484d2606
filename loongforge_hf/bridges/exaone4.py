"""Exaone4ForCausalLM (LG's EXAONE 4.0: 1.2B, 32B): OLMo 2's layout with per-head q / k norms and, where the config
has a window, sliding-window layers that rotate and full-attention layers without rotary embedding.

Choices:
- No input / pre-MLP norms; the attention's and the MLP's outputs are normalised before the residual adds
  (``post_attention_layernorm``, ``post_feedforward_layernorm``: ``layer_outputs.transformed_attention`` /
  ``transformed_mlp``); q / k norms per head, megatron's ``qk_layernorm`` (Qwen3's).
- ``sliding_window`` set (EXAONE-4.0-32B: three sliding layers to one full, ``layer_types``): the window on the
  sliding layers (megatron's ``window_attn_skip_freq``) and no rotary embedding on the full ones, as transformers
  rotates only the sliding layers then (SmolLM3's ``no_rope_attention`` on the post-norm attention); without a window
  (EXAONE-4.0-1.2B) every layer is global and rotates.
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.layer_outputs import transformed_attention, transformed_mlp
from loongforge_hf.bridges.layer_types import check_layer_kinds, layer_windows
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention


@register_bridge("Exaone4ForCausalLM")
class Exaone4Bridge(DenseBridge):
    qk_norm = True
    pre_norms = False
    supports_sliding_window = True
    per_layer_types = True

    def check_config(self) -> None:
        super().check_config()
        c = self.hf_config
        check_layer_kinds(c, self.architectures[0])
        if "sliding_attention" in (c.layer_types or []) and not c.sliding_window:
            raise C.UnsupportedConfigError(f"sliding_window={c.sliding_window} with sliding_attention layers.")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), **layer_windows(self.hf_config)}

    def attention_module(self) -> type | None:
        c = self.hf_config
        post_norm = transformed_attention(post_norm=True)
        if not c.sliding_window:
            return post_norm
        full = frozenset(i for i, kind in enumerate(c.layer_types or []) if kind == "full_attention")
        return no_rope_attention(full, base=post_norm) if full else post_norm

    def mlp_module(self) -> type | None:
        return transformed_mlp(post_norm=True)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [
            QKV(f"{D}.self_attention.linear_qkv.weight", q=f"{L}.self_attn.q_proj.weight",
                k=f"{L}.self_attn.k_proj.weight", v=f"{L}.self_attn.v_proj.weight"),
            RowParallel(f"{D}.self_attention.linear_proj.weight", f"{L}.self_attn.o_proj.weight"),
            Replicated(f"{D}.self_attention.q_layernorm.weight", f"{L}.self_attn.q_norm.weight"),
            Replicated(f"{D}.self_attention.k_layernorm.weight", f"{L}.self_attn.k_norm.weight"),
            Replicated(f"{D}.self_attention.post_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
        ]

    def dense_mlp_mappings(self) -> list[Mapping]:
        _, fc1, fc2 = super().dense_mlp_mappings()
        return [fc1, fc2, Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_feedforward_layernorm.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().attention_shapes(prefix)
        shapes.pop(f"{prefix}.input_layernorm.weight")
        return {**shapes, f"{prefix}.post_attention_layernorm.weight": (self.hf_config.hidden_size,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().dense_mlp_shapes(prefix)
        h = shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return {**shapes, f"{prefix}.post_feedforward_layernorm.weight": h}
