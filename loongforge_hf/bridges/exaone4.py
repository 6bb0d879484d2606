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

from loongforge_hf.bridges.layer_outputs import transformed_attention
from loongforge_hf.bridges.layer_types import WindowsByLayerType
from loongforge_hf.bridges.olmo2 import PostNorms
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention


@register_bridge("Exaone4ForCausalLM")
class Exaone4Bridge(WindowsByLayerType, PostNorms):
    def attention_module(self) -> type | None:
        c = self.hf_config
        post_norm = transformed_attention(post_norm=True)
        if not c.sliding_window:
            return post_norm
        full = frozenset(i for i, kind in enumerate(c.layer_types or []) if kind == "full_attention")
        return no_rope_attention(full, base=post_norm) if full else post_norm
