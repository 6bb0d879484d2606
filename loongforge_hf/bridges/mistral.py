"""MistralForCausalLM: Llama layout plus an optional sliding attention window (Mistral 7B v0.1: 4096);
MinistralForCausalLM (Ministral-8B): Mistral with the window on the layers ``layer_types`` marks;
Ministral3ForCausalLM (Ministral 3 3B / 8B / 14B, the text part of their image-text checkpoints): Mistral with
YaRN and Llama 4's query scale.

Choices (Ministral 3):
- Mistral's layout and one optional window on every layer (``sliding_window``, None in the hub's checkpoints);
  YaRN with ``mscale`` / ``mscale_all_dim`` (the attention factor their ratio: 1 in the hub's) as on every dense
  bridge (``kernels.rope``).
- Llama 4's query scale ``1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings))``
  multiplies the queries after the rotation, by position id. It is 1 below ``original_max_position_embeddings``
  (16384 in the hub's checkpoints) and not built: a forward or training batch with positions from there on is
  refused, naming the field (``Llama4QueryScale``, shared with Mistral 4).
"""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.layer_types import WindowsByLayerType
from loongforge_hf.bridges.registry import register_bridge


class Llama4QueryScale:
    """Mixed in where ``rope_parameters`` carry Llama 4's query scale (``llama_4_scaling_beta``, module docstring):
    sequences that reach it are refused (``check_sequence_length``, called by the model's forward and the trainer)."""

    @property
    def exact_positions(self) -> int | None:
        """The positions below which Llama 4's query scale is 1 (None: no scale)."""
        rope = self.hf_config.rope_parameters or {}
        if not rope.get("llama_4_scaling_beta"):
            return None
        return int(rope.get("original_max_position_embeddings") or self.hf_config.max_position_embeddings)

    def check_sequence_length(self, longest: int) -> None:
        """``ValueError`` where a sequence of ``longest`` positions reaches Llama 4's query scale (not built)."""
        limit = self.exact_positions
        if limit is not None and longest > limit:
            beta = self.hf_config.rope_parameters["llama_4_scaling_beta"]
            raise ValueError(f"{longest} positions: rope_parameters.llama_4_scaling_beta={beta} scales the queries "
                             f"from position original_max_position_embeddings={limit} on, which loongforge-hf does not "
                             f"implement for {self.hf_config.model_type!r} models; use sequences of at most {limit} "
                             "tokens.")


@register_bridge("MistralForCausalLM")
class MistralBridge(DenseBridge):
    supports_sliding_window = True


@register_bridge("MinistralForCausalLM")
class MinistralBridge(WindowsByLayerType, MistralBridge):
    pass


@register_bridge("Ministral3ForCausalLM")
class Ministral3Bridge(Llama4QueryScale, MistralBridge):
    """Mistral with Llama 4's query scale (``Llama4QueryScale``)."""
