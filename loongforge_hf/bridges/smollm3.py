"""SmolLM3ForCausalLM: the Llama layout with no rotary embedding in some layers (``no_rope_layers``: 0 for a NoPE
layer; by default every fourth, ``no_rope_layer_interval``).

Choices:
- The NoPE layers run megatron's ``SelfAttention`` with the rotary embedding dropped from their call
  (``no_rope_attention``: a subclass that knows the global layer numbers, with the pipeline offset, that take none);
  every other layer, the KV cache (it keeps keys as the core attention gets them) and context parallelism are
  unchanged.
- Sliding windows (``use_sliding_window``) are refused by the shared dense checks, as biases are.
"""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.registry import register_bridge


def no_rope_attention(nope_layers: frozenset[int], base: type | None = None) -> type:
    """megatron's ``SelfAttention`` (or ``base``, a subclass of it) whose layers ``nope_layers`` (0-based global
    indices) take no rotary embedding."""
    from megatron.core.transformer.attention import SelfAttention

    class NoRopeSelfAttention(base or SelfAttention):
        def forward(self, *args, **kwargs):
            if self.layer_number - 1 in nope_layers:  # NOTE: megatron numbers layers from 1, offset by the stage
                kwargs.update(rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None)
            return super().forward(*args, **kwargs)

    return NoRopeSelfAttention


@register_bridge("SmolLM3ForCausalLM")
class SmolLM3Bridge(DenseBridge):
    def attention_module(self) -> type | None:
        flags = list(getattr(self.hf_config, "no_rope_layers", None) or [])
        nope = frozenset(i for i, use_rope in enumerate(flags) if not use_rope)
        return no_rope_attention(nope) if nope else None
