"""FalconH1ForCausalLM (TII's Falcon-H1, 0.5B to 34B): in every layer a Mamba2 mixer and an attention side
by side on the same normed input, their outputs summed into the residual, a gated silu MLP after; muP multipliers
throughout.

Choices:
- Each layer's self-attention slot is ``MambaBesideAttention``: megatron's ``SelfAttention`` (GQA, rotary over whole
  heads of ``head_dim``) holding our ``Mamba2Mixer`` (``mamba2.py``: TP by heads and groups, B / C replicated where TP
  exceeds the groups, the padding mask, packed documents, the cached generate's states, context parallelism) as its
  ``mamba`` child: ``ssm_out * mamba(ssm_in * x) + attention_out * attention(attention_in * x)``, ``x`` the output of
  ``input_layernorm``, as transformers' ``FalconH1DecoderLayer``. The mixer's tensor table, layouts and refusals are
  ``mamba2_layers.py``'s (the names Bamba's: ``mamba.*``, ``feed_forward.*``, ``pre_ff_layernorm``,
  ``model.final_layernorm``); its megatron module is ``self_attention.mamba`` (``mamba_slot``).
- The mixer's own sizes: ``mamba_d_ssm`` (``mamba_n_heads * mamba_d_head``, checked by transformers' config) may
  differ from ``mamba_expand * hidden_size``. ``ssm_multipliers`` (transformers' ``mup_vector``): one factor per block
  of ``in_proj``'s output (z, x, B, C, dt), the mixer's ``in_proj_multipliers``. ``mamba_rms_norm``: the gated
  RMSNorm over groups, ``y`` normalised then gated with ``mamba_norm_before_gate`` (transformers' default), gated then
  normalised without (Granite's order; in bf16 the weight multiplies after one rounding where transformers multiplies
  before it); without ``mamba_rms_norm`` no norm and no ``norm.weight``: ``y * silu(z)``.
- ``key_multiplier``: the keys times it before the rotation, so the scores: megatron's ``softmax_scale`` is
  ``key_multiplier / sqrt(head_dim)`` (one rounding apart: fp32 ~1e-7 relative). The KV cache keeps the keys unscaled.
- ``mlp_multipliers``: ``down(up * silu(gate * m0)) * m1`` (``layer_outputs.transformed_mlp``); ``embedding_multiplier``
  on the embedding's output (``scale_embedding``); ``lm_head_multiplier`` on the logits and the fused loss's
  (``scale_logits``).
- Cached ``generate``: every layer's keys and values (a ``DynamicLayer`` each), then every layer's conv and SSM
  states (a ``LinearAttentionLayer`` each), in our KV cache (``kv_cache.py``).
- Refused before any collective: ``attention_bias``, ``mlp_bias``, ``mamba_proj_bias``, ``projectors_bias`` (biases
  of in_proj / out_proj), ``hidden_act`` other than silu, ``mamba_use_mlp=False`` (transformers builds the MLP
  whatever it says), multiplier lists of another length, and what ``mamba2_layers.py`` refuses (heads that do not
  split over TP, the static cache).
"""

from __future__ import annotations

import functools
import math

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.bamba import BambaBridge
from loongforge_hf.bridges.dense import D, DenseBridge
from loongforge_hf.bridges.layer_outputs import scale_embedding, scale_logits, transformed_mlp
from loongforge_hf.bridges.mamba2_layers import mamba_dims_of
from loongforge_hf.bridges.mappings import Mapping
from loongforge_hf.bridges.registry import register_bridge


def _times(x, factor: float):
    return x if factor == 1.0 else x * factor


@functools.cache
def mamba_beside_attention(*, attention_in: float, attention_out: float, ssm_in: float, ssm_out: float,
                           **dims) -> type:
    """The self-attention slot's class: megatron's ``SelfAttention`` with a ``Mamba2Mixer`` (``dims``) beside it on the
    same input, each input and output times its multiplier, the two outputs summed."""
    from megatron.core.transformer.attention import SelfAttention

    from loongforge_hf.bridges.mamba2 import Mamba2Mixer

    class MambaBesideAttention(SelfAttention):
        def __init__(self, config, submodules=None, layer_number: int = 1, **kwargs) -> None:
            super().__init__(config, submodules, layer_number, **kwargs)
            self.mamba = Mamba2Mixer(config, layer_number=layer_number, pg_collection=kwargs.get("pg_collection"),
                                     **dims)

        def forward(self, hidden_states, attention_mask=None, **kwargs):
            mamba, _ = self.mamba(_times(hidden_states, ssm_in), attention_mask,
                                  inference_context=kwargs.get("inference_context"),
                                  packed_seq_params=kwargs.get("packed_seq_params"))
            attention, bias = super().forward(_times(hidden_states, attention_in), attention_mask, **kwargs)
            if bias is not None:
                attention = attention + bias
            return _times(mamba, ssm_out) + _times(attention, attention_out), None

    return MambaBesideAttention


@register_bridge("FalconH1ForCausalLM")
class FalconH1Bridge(BambaBridge):
    mamba_slot = f"{D}.self_attention.mamba"

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        C.refuse_set_fields(c, arch, (("mamba_proj_bias", "a bias of the Mamba2 in_proj"),
                                      ("projectors_bias", "a bias of the Mamba2 out_proj")))
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only 'silu': "
                                           "the Mamba2 conv and the MLP use it).")
        if getattr(c, "mamba_use_mlp", True) is False:
            raise C.UnsupportedConfigError(f"mamba_use_mlp=False is not supported for {arch} (transformers builds "
                                           "and runs every layer's MLP whatever it says).")
        for field, length in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
            value = getattr(c, field)
            if value is None or len(value) != length:
                raise C.UnsupportedConfigError(f"{field}={value!r} is not supported for {arch} ({length} numbers).")
        self.check_mamba_dims()
        DenseBridge.check_config(self)

    def rope_parameters(self) -> dict:
        return DenseBridge.rope_parameters(self)  # NOTE: whole heads (Bamba rotates half of each)

    @property
    def mamba_layers(self) -> frozenset[int]:
        return frozenset(range(self.hf_config.num_hidden_layers))  # NOTE: transformers' layer_types: "hybrid"

    def mamba_dims(self) -> dict:
        c = self.hf_config
        return {**mamba_dims_of(c), "rms_norm": bool(c.mamba_rms_norm),
                "norm_before_gate": bool(c.mamba_rms_norm and c.mamba_norm_before_gate),
                "in_proj_multipliers": tuple(float(m) for m in c.ssm_multipliers)}

    def _multiplier(self, name: str) -> float:
        return float(getattr(self.hf_config, name))

    def transformer_config_kwargs(self) -> dict:
        scale = self._multiplier("key_multiplier") / math.sqrt(C.head_dim_of(self.hf_config))
        return {**super().transformer_config_kwargs(), "softmax_scale": scale}

    def attention_module(self) -> type:
        m = self._multiplier
        return mamba_beside_attention(attention_in=m("attention_in_multiplier"),
                                      attention_out=m("attention_out_multiplier"), ssm_in=m("ssm_in_multiplier"),
                                      ssm_out=m("ssm_out_multiplier"), **self.mamba_dims())

    def mlp_module(self) -> type:
        gate, down = (float(m) for m in self.hf_config.mlp_multipliers)
        return transformed_mlp(gate_scale=gate, scale=down)

    def finish_model(self, model) -> None:
        scale_embedding(model, self._multiplier("embedding_multiplier"))
        scale_logits(model, self._multiplier("lm_head_multiplier"))

    # ---- tensors --------------------------------------------------------------------------------------------
    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        return self.layer_mappings()

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        return {**self.attention_shapes(prefix), **self.mamba_shapes(prefix), **self.dense_mlp_shapes(prefix)}
