"""GraniteSWAForCausalLM and GraniteMoeSWAForCausalLM (IBM's granite-swash: Granite and Granite-MoE with a shared MLP,
plus sliding-window layers, a learned sink per head and layers without rotary embedding).

Choices:
- Everything of ``GraniteBridge`` / ``GraniteMoeSharedBridge``: the four multipliers; MoE: softmax top-k
  renormalised over the k chosen, transformers' balancing loss and ``router_logits``, the shared MLP
  (``shared_intermediate_size``; 0 builds none).
- Sinks: transformers scales each head's output by ``sigmoid(logsumexp(scores) - sink)``, which is the softmax with
  one more logit ``sink`` in its denominator: megatron's learnable softmax offset (``softmax_type="learnable"``,
  ``core_attention.softmax_offset``), split over TP with the heads, as gpt-oss's; every layer has them.
- ``layer_types``: the window on the sliding layers (megatron's ``window_attn_skip_freq``: ``WindowsByLayerType``).
- ``layer_rope_theta``: a layer's rotary base, 0 for none. The 0 layers take no rotary embedding
  (``smollm3.no_rope_attention``); the others share the rotary table, built at their one base. Several different
  bases are refused by name, as rope types with an attention factor (YaRN would scale the unrotated layers' q / k).
- Granite-MoE SWA on disk: transformers 5's names (this model type has no conversion mapping back to Granite MoE's):
  ``block_sparse_moe.router.weight``, ``experts.gate_up_proj`` ``[E, 2I, H]`` (``[gate; up]`` rows),
  ``experts.down_proj`` ``[E, H, I]``.
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.granite import GraniteBridge
from loongforge_hf.bridges.granitemoeshared import GraniteMoeSharedBridge
from loongforge_hf.bridges.layer_types import WindowsByLayerType
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention


class SinksAndLayerRope(WindowsByLayerType):
    """Mixed in before a Granite bridge: sinks, windows by ``layer_types``, NoPE layers by ``layer_rope_theta``."""

    extra_rope_types: tuple[str, ...] = ()

    def _layer_thetas(self) -> list[float]:
        c = self.hf_config
        thetas = list(getattr(c, "layer_rope_theta", None) or [])
        if len(thetas) != c.num_hidden_layers:
            raise C.UnsupportedConfigError(f"layer_rope_theta has {len(thetas)} entries for {c.num_hidden_layers} "
                                           f"layers ({self.architectures[0]}).")
        return thetas

    def check_config(self) -> None:
        super().check_config()
        bases = sorted({float(t) for t in self._layer_thetas() if t})
        if len(bases) > 1:
            raise C.UnsupportedConfigError(f"layer_rope_theta with several rotary bases {bases} is not supported for "
                                           f"{self.architectures[0]} (one rotary table; 0 for no rotary embedding).")

    def rope_parameters(self) -> dict:
        params = super().rope_parameters()
        bases = [t for t in self._layer_thetas() if t]
        return {**params, "rope_theta": float(bases[0])} if bases else params

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "softmax_type": "learnable"}

    def attention_module(self) -> type | None:
        nope = frozenset(i for i, theta in enumerate(self._layer_thetas()) if not theta)
        base = super().attention_module()
        return no_rope_attention(nope, base=base) if nope else base

    def attention_mappings(self) -> list[Mapping]:
        return super().attention_mappings() + [
            ColumnParallel(f"{D}.self_attention.core_attention.softmax_offset", f"{L}.self_attn.sinks")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().attention_shapes(prefix),
                f"{prefix}.self_attn.sinks": (self.hf_config.num_attention_heads,)}


@register_bridge("GraniteSWAForCausalLM")
class GraniteSWABridge(SinksAndLayerRope, GraniteBridge):
    pass


@register_bridge("GraniteMoeSWAForCausalLM")
class GraniteMoeSWABridge(SinksAndLayerRope, GraniteMoeSharedBridge):
    moe_names = ("router.weight", "experts.gate_up_proj", "experts.down_proj")
