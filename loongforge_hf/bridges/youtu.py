"""YoutuForCausalLM (Tencent's Youtu-LLM 2B): a dense decoder with DeepSeek-V3's multi-latent attention.

Choices:
- Attention is the MLA bridges' (``deepseek.MultiLatentAttention``): ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``
  (or ``q_proj``), ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj``; the rotary dims in pairs
  on disk with ``rope_interleave=True`` (its default, megatron's own layout), in halves otherwise (interleaved on load
  and put back on export), as DeepSeek-V3's. Plain rope and YaRN (``config_map.mla_rope_kwargs``).
- The MLP is Llama's (Qwen3's ``gate_proj`` / ``up_proj`` / ``down_proj``), in every layer; pre-norms; tied
  embeddings by default. Nothing is scaled (MiniCPM3's muP scales are absent).
- Tensor parallelism needs sequence parallelism, as MiniCPM3's (``mla_latent.py``); refused by name before any
  collective.
"""

from loongforge_hf.bridges.deepseek import MultiLatentAttention
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.minicpm3 import MiniCPM3Bridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("YoutuForCausalLM")
class YoutuBridge(MultiLatentAttention, DenseBridge):
    check_layout = MiniCPM3Bridge.check_layout

    def __init__(self, hf_config) -> None:
        self.interleaved_rope_on_disk = bool(getattr(hf_config, "rope_interleave", True))
        super().__init__(hf_config)
