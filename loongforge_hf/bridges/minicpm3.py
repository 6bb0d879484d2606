"""MiniCPM3ForCausalLM (MiniCPM3-4B): a dense decoder with DeepSeek-V2's multi-latent attention and muP's scales.

Choices:
- Attention is the MLA bridges' (``deepseek.MultiLatentAttention``): ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``
  (or ``q_proj``), ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj``; the rotary dims in halves
  on disk (transformers' ``apply_rotary_pos_emb``), interleaved on load and put back on export. The MLP is Llama's.
- muP's scales: the embedding times ``scale_emb``, each attention and MLP output times ``scale_depth /
  sqrt(num_hidden_layers)`` before its residual add (``layer_outputs.scale_sublayer_outputs``), the LM head's input
  times ``dim_model_base / hidden_size`` (transformers divides by ``hidden_size / dim_model_base``: the same up to
  rounding, fp32 ~1e-7 relative).
- Rope: plain, or LongRoPE (MiniCPM3-4B's) with its short factors in MLA's rotary table; LongRoPE's attention factor
  must be 1 (``max_position_embeddings <= original_max_position_embeddings``, as in MiniCPM3-4B) and a sequence past
  ``original_max_position_embeddings`` (transformers then switches to the long factors) is refused by name.
- Tensor parallelism needs sequence parallelism: without it megatron's MLA keeps only this rank's heads' share of
  the rotary key's gradient (``mla_latent.py``); refused by name before any collective.
"""

from __future__ import annotations

import math

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek import MultiLatentAttention
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.layer_outputs import scale_embedding, scale_final_norm, scale_sublayer_outputs
from loongforge_hf.bridges.registry import register_bridge

_PLAIN_ROPE = {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


@register_bridge("MiniCPM3ForCausalLM")
class MiniCPM3Bridge(MultiLatentAttention, DenseBridge):
    interleaved_rope_on_disk = False

    def _rope(self) -> dict:
        """The config's ``rope_parameters`` (rope_type filled in)."""
        rope = dict(self.hf_config.rope_parameters or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        return rope

    def check_config(self) -> None:
        rope = self._rope()
        if rope["rope_type"] == "longrope":
            from loongforge_hf.kernels.rope import rope_attention_factor

            C.rope_parameters(self.hf_config, extra_types=("longrope",))  # NOTE: its fields present
            factor = rope_attention_factor(rope, self.hf_config.max_position_embeddings)
            if factor != 1.0:
                raise C.UnsupportedConfigError(
                    f"rope_parameters: LongRoPE's attention factor {factor:.4f} (max_position_embeddings > "
                    "original_max_position_embeddings, or attention_factor) is not supported for "
                    "MiniCPM3ForCausalLM's multi-latent attention.")
        DenseBridge.check_config(self)
        if rope["rope_type"] != "longrope":
            C.check_mla_config(self.hf_config)

    def rope_parameters(self) -> dict:
        rope = self._rope()
        if rope["rope_type"] == "longrope":
            return rope
        return super().rope_parameters()

    def transformer_config_kwargs(self) -> dict:
        if self._rope()["rope_type"] != "longrope":
            return super().transformer_config_kwargs()
        kw = DenseBridge.transformer_config_kwargs(self)
        kw.update(C.hf_to_megatron(self.hf_config, C.MLA_FIELDS), **_PLAIN_ROPE,
                  rotary_base=self._rope().get("rope_theta", 10000.0), multi_latent_attention=True, qk_layernorm=True)
        return kw

    def check_layout(self, layout) -> None:
        if layout.tensor_parallel_size > 1 and not layout.sequence_parallel:
            raise C.UnsupportedConfigError(
                f"tensor_parallel_size={layout.tensor_parallel_size} without sequence_parallel is not supported for "
                f"{self.architectures[0]} (multi-latent attention's rotary-key gradient): pass sequence_parallel=True.")

    def check_sequence_length(self, longest: int) -> None:
        """``ValueError`` where transformers would rotate by LongRoPE's long factors (not built)."""
        rope = self._rope()
        original = rope.get("original_max_position_embeddings")
        if rope["rope_type"] == "longrope" and longest > original:
            raise ValueError(f"{longest} positions: past rope_parameters.original_max_position_embeddings={original} "
                             "transformers rotates MiniCPM3 by LongRoPE's long_factor, which is not implemented here; "
                             f"use sequences of at most {original} tokens.")

    def finish_model(self, model) -> None:
        c = self.hf_config
        scale_embedding(model, float(c.scale_emb))
        scale_sublayer_outputs(model, c.scale_depth / math.sqrt(c.num_hidden_layers))
        scale_final_norm(model, c.dim_model_base / c.hidden_size)
        if self._rope()["rope_type"] == "longrope":
            _short_factor_rotary(model, self._rope(), c.qk_rope_head_dim)


def _short_factor_rotary(chunk, rope: dict, rotary_dim: int) -> None:
    """Every MLA layer's rotary table with LongRoPE's short factors (before any forward: megatron caches angles)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from loongforge_hf.kernels.rope import rope_inv_freq

    for module in chunk.modules():
        if isinstance(module, MLASelfAttention):
            table = module.rotary_pos_emb
            table.inv_freq = rope_inv_freq(rotary_dim, base=rope.get("rope_theta", 10000.0), rope_scaling=rope).to(
                table.inv_freq.device)
