"""GlmMoeDsaForCausalLM (GLM-5): DeepSeek-V3.2's bridge with two differences in the sparse-attention indexer.

Choices:
- Everything else is ``deepseek_v32.DeepseekV32Bridge`` (MLA, experts by ``mlp_layer_types``, DSA core attention,
  its refusals); GLM-5's ``rms_norm_eps`` (1e-5) for the layer norms, 1e-6 for the latent norms and the indexer's
  ``k_norm`` as transformers builds them.
- The indexer rotates its first ``qk_rope_head_dim`` dims in interleaved pairs (DeepSeek-V3.2: halves): its rows are
  only moved (rotary rows last), not re-paired.
- ``indexer_types``: a ``"shared"`` layer has no indexer (no tensors on disk) and reuses the top-k of the last
  ``"full"`` layer before it (``sparse_attention.link_shared_layers``), in each cached generate step too (that
  step's top-k over every cached key; its cache layer holds no indexer keys). Refused by name: a shared first layer (as
  transformers refuses it), and pipeline parallelism with shared layers (the top-k would cross stages).
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek_v32 import DeepseekV32Bridge
from loongforge_hf.bridges.registry import register_bridge

_TYPES = ("full", "shared")


@register_bridge("GlmMoeDsaForCausalLM")
class GlmMoeDsaBridge(DeepseekV32Bridge):
    indexer_rope_halves = False                                # GLM-5's indexer: interleaved pairs

    def has_indexer(self, layer: int) -> bool:
        return self.hf_config.indexer_types[layer] == "full"

    def check_config(self) -> None:
        kinds = list(self.hf_config.indexer_types or ())
        if len(kinds) != self.hf_config.num_hidden_layers or set(kinds) - set(_TYPES) or kinds[0] != "full":
            raise C.UnsupportedConfigError(
                f"indexer_types={kinds}: expected one of {list(_TYPES)} per layer (num_hidden_layers="
                f"{self.hf_config.num_hidden_layers}), the first 'full'.")
        super().check_config()

    def check_layout(self, layout) -> None:
        if layout.pipeline_parallel_size > 1 and self.shared_layers():
            raise C.UnsupportedConfigError(
                f"pipeline_parallel_size={layout.pipeline_parallel_size} is not supported with shared indexer layers "
                f"(indexer_types: layers {list(self.shared_layers())} reuse an earlier layer's top-k).")
