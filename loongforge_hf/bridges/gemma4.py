"""Gemma4ForCausalLM (``gemma4_text``: Gemma 4's text model): Gemma 3's sandwich-norm layers with Gemma 4's
differences.

Choices:
- Norms store their weight itself (``Gemma4RMSNorm``: ``x * rstd * weight``, not Gemma 3's ``1 + weight``): our
  ``RMSNorm`` without ``layernorm_zero_centered_gamma``, in every slot (input, q / k, post-attention, pre- and
  post-MLP, final). Post norms as Gemma 3's (``layer_outputs.transformed_attention`` / ``transformed_mlp``).
- Values are normalised per head without a weight (``v_norm``) as they leave ``get_query_key_value_tensors``
  (``_v_normed``); scores are not scaled (``softmax_scale=1``: the q / k norms set the scale).
- Rope per layer type (``layer_types.LayerTypes``' two side-by-side tables): ``default`` or ``proportional``
  (transformers' ``_compute_proportional_rope_parameters``: the first ``partial_rotary_factor * head_dim / 2``
  frequencies rotate, the rest are zero, i.e. those channels pass unrotated; over the whole head, as transformers'
  ``rotate_half``). The full layers' default in transformers is proportional with 0.25.
- ``layer_scalar`` (a buffer per layer, loaded from the checkpoint): the layer's output, residual included, times it
  (``_scaled_layer``). ``final_logit_softcapping``: Gemma 2's ``softcap_logits`` (the fused loss too). The embedding
  is scaled by ``sqrt(hidden_size)`` rounded to the weights' dtype, as Gemma's.
- Refused by name, before any collective: per-layer input embeddings (``hidden_size_per_layer_input``: Gemma 4
  E2B / E4B), KV shared across layers (``num_kv_shared_layers``), ``attention_k_eq_v``, full-attention layers whose
  head size or KV heads differ from the sliding ones' (``global_head_dim`` / ``num_global_key_value_heads``: every
  layer is built from one megatron config), bidirectional attention (``use_bidirectional_attention='all'``),
  attention biases, rope types other than default / proportional; the MoE block (``enable_moe_block``).
- A ``gemma4`` checkpoint (``Gemma4ForConditionalGeneration``: the text model with vision / audio towers) is refused
  with a message saying so (``Gemma4ConditionalRefusal``).
"""

from __future__ import annotations

import functools

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.gemma import _SandwichNorms, scale_gemma_embedding
from loongforge_hf.bridges.layer_outputs import softcap_logits, transformed_attention
from loongforge_hf.bridges.layer_types import LAYER_TYPES, LayerTypes, _two_table_rotary
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge, register_model_type

ROPE_TYPES = ("default", "proportional")


def gemma4_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32) of a ``default`` or ``proportional`` rope, as transformers'."""
    from loongforge_hf.kernels.rope import rope_inv_freq

    base = params["rope_theta"]
    if params.get("rope_type", "default") == "default":
        return rope_inv_freq(head_dim, base=base)
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    inv = torch.cat((rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32)))
    return inv / params.get("factor", 1.0)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``Gemma4RMSNorm(with_scale=False)``: over the last axis, in fp32, rounded once to ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


@functools.cache
def _v_normed(base: type) -> type:
    class VNormedAttention(base):
        """``base`` with the values normalised per head (no weight) before the core attention."""

        def get_query_key_value_tensors(self, *args, **kwargs):
            query, key, value, *rest = super().get_query_key_value_tensors(*args, **kwargs)
            return (query, key, _rms(value, self.config.layernorm_epsilon), *rest)

    return VNormedAttention


@functools.cache
def _scaled_layer(base: type) -> type:
    class ScaledLayer(base):
        """megatron's ``TransformerLayer`` with its output (the residual stream) times the ``layer_scalar`` buffer."""

        def forward(self, *args, **kwargs):
            output, context = super().forward(*args, **kwargs)
            return output * self.layer_scalar, context

    return ScaledLayer


def _add_layer_scalars(chunk) -> None:
    for layer in chunk.decoder.layers:
        weight = next(layer.parameters())
        layer.register_buffer("layer_scalar", torch.ones(1, dtype=weight.dtype, device=weight.device))
        layer.__class__ = _scaled_layer(type(layer))


def _differing_layers(hf_config) -> list[str]:
    """The per-layer fields whose values differ between layers (the full layers' head size / KV heads)."""
    per_layer = getattr(hf_config, "per_layer_config", None)
    if per_layer is None:
        return []
    fields = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}
    problems = []
    for field, name in fields.items():
        values = {t: sorted({getattr(per_layer[i], field) for i, k in enumerate(hf_config.layer_types) if k == t})
                  for t in LAYER_TYPES}
        if len({v for vs in values.values() for v in vs}) > 1:
            problems.append(f"{name} ({field} {values['full_attention']} on the full-attention layers, "
                            f"{values['sliding_attention']} on the sliding ones)")
    return problems


@register_model_type("gemma4_text")  # NOTE: a text config that names no architecture is this model's
@register_bridge("Gemma4ForCausalLM")
class Gemma4Bridge(LayerTypes, _SandwichNorms):
    qk_norm = True
    zero_centred_norms = False

    def check_config(self) -> None:
        c = self.hf_config
        refusals = {
            "hidden_size_per_layer_input": (c.hidden_size_per_layer_input, "per-layer input embeddings"),
            "num_kv_shared_layers": (c.num_kv_shared_layers, "keys and values shared across layers"),
            "attention_k_eq_v": (c.attention_k_eq_v, "values taken from the key projection"),
            "attention_bias": (c.attention_bias, "attention biases"),
            "enable_moe_block": (c.enable_moe_block, "the mixture-of-experts block"),
        }
        for name, (value, what) in refusals.items():
            if value:
                raise C.UnsupportedConfigError(f"{name}={value} is not supported for Gemma4ForCausalLM ({what}).")
        if c.use_bidirectional_attention == "all":
            raise C.UnsupportedConfigError("use_bidirectional_attention='all' is not supported (causal attention "
                                           "only).")
        differing = _differing_layers(c)
        if differing:
            raise C.UnsupportedConfigError(f"{'; '.join(differing)}: not supported for Gemma4ForCausalLM, whose "
                                           "layers are built with one head size and one number of KV heads.")
        C._act_to_megatron(c.hidden_activation)
        self.check_layer_types()

    def rope_for(self, layer_type: str) -> dict:
        params = dict((self.hf_config.rope_parameters or {}).get(layer_type) or {})
        rope_type = params.setdefault("rope_type", "default")
        if rope_type not in ROPE_TYPES or "rope_theta" not in params:
            raise C.UnsupportedConfigError(f"rope_parameters[{layer_type!r}]={params} is not supported for "
                                           f"Gemma4ForCausalLM; rope_type one of {list(ROPE_TYPES)}, with rope_theta.")
        factor = params.get("partial_rotary_factor", 1.0)
        if rope_type == "default" and factor != 1.0 or not 0.0 <= factor <= 1.0:
            raise C.UnsupportedConfigError(f"rope_parameters[{layer_type!r}].partial_rotary_factor={factor} is not "
                                           "supported (a proportional rope's lies in [0, 1]; a default rope's is 1).")
        return params

    def rope_parameters(self) -> dict:
        # NOTE: megatron rotates whole heads; a proportional rope's unrotated channels have zero frequencies
        params = self.rope_for("full_attention")
        params.pop("partial_rotary_factor", None)
        return params

    def softmax_scale(self) -> float:
        return 1.0

    def qk_module(self) -> type | None:
        return None

    def attention_module(self) -> type | None:
        return _v_normed(transformed_attention(post_norm=True, sliding_layers=self.sliding_layers))

    def finish_model(self, model) -> None:
        scale_gemma_embedding(model, self.hf_config.hidden_size)
        self.set_rotary_tables(model)
        _add_layer_scalars(model)
        cap = self.hf_config.final_logit_softcapping
        if cap is not None:
            softcap_logits(model, cap)

    def set_rotary_tables(self, chunk) -> None:
        from loongforge_hf.kernels.rope import set_megatron_inv_freq

        rope = getattr(chunk, "rotary_pos_emb", None)
        if rope is None:
            return
        inv = {kind: gemma4_inv_freq(C.head_dim_of(self.hf_config), self.rope_for(kind)) for kind in LAYER_TYPES}
        set_megatron_inv_freq(rope, inv["full_attention"])
        rope.__class__ = _two_table_rotary(type(rope))
        rope.local_inv_freq = inv["sliding_attention"]

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.layer_scalar", f"{L}.layer_scalar"), *super().attention_mappings()]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.layer_scalar": (1,), **super().attention_shapes(prefix)}


@register_model_type("gemma4")
class Gemma4ConditionalRefusal:
    """A ``gemma4`` (image / audio / text) checkpoint: refused with what to do instead."""

    architectures = ("Gemma4ForConditionalGeneration",)

    def __init__(self, hf_config) -> None:
        raise C.UnsupportedConfigError(
            "Gemma4ForConditionalGeneration (model_type 'gemma4': the text model with its vision and audio towers) "
            "is not supported; loongforge-hf serves Gemma 4's text model alone (Gemma4ForCausalLM, model_type "
            "'gemma4_text'), and transformers' AutoModelForCausalLM would load this checkpoint with its towers.")
