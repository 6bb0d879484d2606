"""ZambaForCausalLM (Zyphra's Zamba-7B): Zamba2's layout (``zamba2.py``) on a multi-head Mamba-1 mixer, with one
shared transformer block and no adapters.

Choices:
- The layers, the shared block and its re-use as Zamba2's (``zamba2_shared.py``: built once in its first use's layer,
  its gradient summed over the uses; ``concat(hidden, token embeddings)``; the output through the layer's own
  ``linear`` into the mixer's input), with ``num_mem_blocks`` 1, no rope, no adapters; the block's MLP has separate
  ``gate_proj`` / ``up_proj`` (megatron's fused fc1 rows) and the block sits under ``shared_transf``.
- The mixer: ``zamba_mixer.ZambaMixer`` (``n_mamba_heads`` Mamba-1 heads, each with its own ``x_proj`` /
  ``dt_proj`` / ``A_log`` / ``D``; TP splits the heads).
- Cached generate as Zamba2's: the shared block's keys and values per use, each Mamba layer's conv inputs and its
  heads' SSM states (``zamba_mixer.py``); the static cache refused.
- Context parallelism as Zamba2's (the shared block's core attention), the mixer's states passed between the chunks
  (``zamba_mixer.py``).
- Refused before any collective: what Zamba2 refuses (``tie_word_embeddings`` off, pipeline parallelism, heads that
  do not split over TP), ``mamba_proj_bias``, ``hidden_mamba_act`` other than silu, ``n_mamba_heads`` that do not
  split over TP.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D as DL
from loongforge_hf.bridges.fused_mappings import GatedMLP
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.zamba2 import Zamba2Bridge

L = "model.layers.{layer}"
S = f"{DL}.self_attention"


@register_bridge("ZambaForCausalLM")
class ZambaBridge(Zamba2Bridge):
    block_module = "shared_transf"
    num_blocks = 1

    @property
    def position_embedding_type(self) -> str:
        return "none"

    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        self.check_shared_blocks()
        C.refuse_set_fields(c, arch, (("mamba_proj_bias", "biases of the Mamba in_proj / out_proj"),))
        if c.hidden_mamba_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_mamba_act={c.hidden_mamba_act!r} is not supported for {arch} "
                                           "(only 'silu').")

    def check_mixer_layout(self, layout) -> None:
        heads, tp = self.hf_config.n_mamba_heads, layout.tensor_parallel_size
        if heads % tp:
            raise C.UnsupportedConfigError(f"n_mamba_heads={heads} does not split over tensor_parallel_size={tp} "
                                           f"for {self.architectures[0]} (the Mamba layers split by heads).")

    def generation_refusal(self, generation_config) -> str | None:
        if generation_config.use_cache and generation_config.cache_implementation == "static":
            return (f"cache_implementation='static' is not supported for {self.architectures[0]}: the static cache's "
                    "fixed-shape decode step keeps no Mamba conv / SSM state; use the default dynamic cache.")
        return None

    def shared_sizes(self):
        from loongforge_hf.bridges.zamba2_shared import SharedSizes

        c = self.hf_config
        return SharedSizes(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                           head_dim=c.attention_head_dim, intermediate=c.intermediate_size, rank=0,
                           qkv_adapters=False, rope=False, activation=c.hidden_act, eps=c.rms_norm_eps,
                           mlp_adapters=False)

    def attention_module(self) -> type:
        from loongforge_hf.bridges.zamba_mixer import zamba_attention_slot

        c = self.hf_config
        return zamba_attention_slot(layers=self.mamba_layers, heads=c.n_mamba_heads,
                                    d_inner=c.mamba_expand * c.hidden_size, d_state=c.mamba_d_state,
                                    dt_rank=c.mamba_dt_rank, conv_kernel=c.mamba_d_conv,
                                    conv_bias=bool(c.mamba_conv_bias))

    # ---- tensors --------------------------------------------------------------------------------------------
    def _gate_up_mapping(self, megatron: str, mlp: str) -> Mapping:
        return GatedMLP(megatron, gate=f"{mlp}.gate_proj.weight", up=f"{mlp}.up_proj.weight")

    def _mlp_shapes(self, mlp: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        return {f"{mlp}.{x}_proj.weight": (c.intermediate_size, c.hidden_size) for x in ("gate", "up")}

    def _adapter_mappings(self, use: int) -> list[Mapping]:
        return []

    def _adapter_shapes(self, use: int) -> dict[str, tuple[int, ...]]:
        return {}

    def mamba_mappings(self) -> list[Mapping]:
        m = f"{L}.mamba"
        maps = [Replicated(f"{DL}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
                ColumnParallel(f"{S}.in_proj.weight", f"{m}.in_proj.weight"),
                ColumnParallel(f"{S}.conv_weight", f"{m}.conv1d.weight"),
                *(ColumnParallel(f"{S}.{n}", f"{m}.{n}") for n in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias",
                                                                   "A_log", "D")),
                RowParallel(f"{S}.out_proj.weight", f"{m}.out_proj.weight")]
        if self.hf_config.mamba_conv_bias:
            maps.append(ColumnParallel(f"{S}.conv_bias", f"{m}.conv1d.bias"))
        return maps

    def mamba_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, m = self.hf_config, f"{prefix}.mamba"
        h, heads, inner = c.hidden_size, c.n_mamba_heads, c.mamba_expand * c.hidden_size
        d, n, r = inner // heads, c.mamba_d_state, c.mamba_dt_rank
        shapes = {f"{prefix}.input_layernorm.weight": (h,), f"{m}.in_proj.weight": (2 * inner, h),
                  f"{m}.conv1d.weight": (inner, 1, c.mamba_d_conv), f"{m}.x_proj_weight": (heads, r + 2 * n, d),
                  f"{m}.dt_proj_weight": (heads, d, r), f"{m}.dt_proj_bias": (heads, d),
                  f"{m}.A_log": (heads, d, n), f"{m}.D": (heads, d), f"{m}.out_proj.weight": (h, inner)}
        if c.mamba_conv_bias:
            shapes[f"{m}.conv1d.bias"] = (inner,)
        return shapes
