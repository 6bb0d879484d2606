"""HF config <-> megatron-core ``TransformerConfig``: one two-way table, plus the checks for what we cannot express.

Choices:
- Each row names the HF field, the megatron field, and the two conversions; ``hf_to_megatron`` and
  ``megatron_to_hf`` both read the same table, so a field cannot be mapped one way only.
- The exported ``config.json`` is the source's HF config written back as it was (plus ``dtype`` when asked), so
  fields megatron has no use for (token ids, generation defaults) survive untouched.
- A value the bridge cannot express exactly (an unknown rope type, an active sliding window that the attention in use
  does not implement, bias in the MLP ...) raises ``UnsupportedConfigError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

# NOTE: transformers' gelu_pytorch_tanh and relu2, defined beside the experts' GeGLU and Relu2, which recognise them
# by identity
from loongforge_hf.kernels.geglu import gelu_tanh
from loongforge_hf.kernels.relu2 import relu2


class UnsupportedConfigError(ValueError):
    """An HF config value the bridge cannot express exactly."""


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Field:
    hf: str
    megatron: str
    to_megatron: Callable[[Any], Any] = _identity
    to_hf: Callable[[Any], Any] = _identity


def gelu_new(x):
    """transformers' ``gelu_new`` (GPT-2's and Phi-2's tanh GELU), written as transformers computes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x):
    """transformers' ``gelu_fast`` (GPT-NeoX-20B's MLP), written as transformers computes it."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": gelu_tanh, "relu2": relu2,
                "gelu_new": gelu_new, "gelu_fast": gelu_fast}


def _act_to_megatron(name: str):
    if name not in _ACTIVATIONS:
        raise UnsupportedConfigError(f"hidden_act={name!r} is not supported; supported: {sorted(_ACTIVATIONS)}.")
    return _ACTIVATIONS[name]


def _act_to_hf(fn) -> str:
    return {F.silu: "silu", F.gelu: "gelu", gelu_tanh: "gelu_pytorch_tanh", relu2: "relu2", gelu_new: "gelu_new",
            gelu_fast: "gelu_fast"}[fn]


# HF name, megatron TransformerConfig name, conversions. Order is documentation only.
DENSE_FIELDS: tuple[Field, ...] = (
    Field("num_hidden_layers", "num_layers"),
    Field("hidden_size", "hidden_size"),
    Field("intermediate_size", "ffn_hidden_size"),
    Field("num_attention_heads", "num_attention_heads"),
    Field("num_key_value_heads", "num_query_groups"),
    Field("head_dim", "kv_channels"),
    Field("rms_norm_eps", "layernorm_epsilon"),
    Field("hidden_act", "activation_func", _act_to_megatron, _act_to_hf),
    Field("attention_dropout", "attention_dropout"),
    Field("initializer_range", "init_method_std"),
)


def fields_with_eps(eps_name: str) -> tuple[Field, ...]:
    """``DENSE_FIELDS`` with the norms' epsilon read from ``eps_name`` (LayerNorm models: ``layer_norm_eps``;
    StarCoder2's ``norm_epsilon``)."""
    return tuple(Field(eps_name, "layernorm_epsilon") if f.hf == "rms_norm_eps" else f for f in DENSE_FIELDS)


def dropout_of(hf_config, name: str) -> float:
    """The dropout probability in the HF config's ``name`` (0 where the field is absent or None)."""
    return float(getattr(hf_config, name, 0.0) or 0.0)


def head_dim_of(hf_config) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def kv_heads_of(hf_config) -> int:
    """The key / value heads (megatron's query groups): ``num_key_value_heads`` (None: one per query head). Falcon's
    config has ``num_kv_heads``, which its older layout reads only without ``multi_query`` (one KV head with it);
    GPTBigCode's ``multi_query`` is one KV head, else one per query head."""
    if getattr(hf_config, "model_type", None) == "falcon":
        if hf_config.new_decoder_architecture or not hf_config.multi_query:
            return hf_config.num_kv_heads
        return 1
    if getattr(hf_config, "model_type", None) == "gpt_bigcode":  # NOTE: what its attention reads, as Falcon's
        return 1 if hf_config.multi_query else hf_config.num_attention_heads
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def hf_to_megatron(hf_config, fields: tuple[Field, ...] = DENSE_FIELDS) -> dict:
    """The megatron TransformerConfig kwargs the table derives from ``hf_config``."""
    out = {}
    for f in fields:
        if f.hf == "head_dim":
            value = head_dim_of(hf_config)
        elif f.hf == "num_key_value_heads":
            value = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        elif f.hf == "attention_dropout":  # NOTE: a config without the field (ERNIE 4.5) drops nothing
            value = dropout_of(hf_config, "attention_dropout")
        else:
            value = getattr(hf_config, f.hf)
        out[f.megatron] = f.to_megatron(value)
    return out


def megatron_to_hf(transformer_config, fields: tuple[Field, ...] = DENSE_FIELDS) -> dict:
    """The HF config fields the table derives back from a megatron ``TransformerConfig``."""
    return {f.hf: f.to_hf(getattr(transformer_config, f.megatron)) for f in fields}


# ---- rope -------------------------------------------------------------------------------------------------------

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_parameters(hf_config, *, partial_rotary: bool = False, extra_types: tuple[str, ...] = ()) -> dict:
    """``rope_parameters`` as transformers 5 stores them (theta, type and scaling fields in one dict);
    ``partial_rotary``: the architecture rotates only ``partial_rotary_factor`` of each head (Phi-3), else a factor
    other than 1 is refused (Llama's attention ignores it); ``extra_types``: rope types beyond ``default`` / ``llama3``
    the bridge takes (``yarn`` on dense decoders, ``longrope`` on Phi-3: an attention factor on q and k)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
        scaling = getattr(hf_config, "rope_scaling", None)
        if scaling:
            params.update(scaling)
    params.setdefault("rope_type", params.get("type", "default"))
    rope_type = params["rope_type"]
    supported = [*SUPPORTED_ROPE_TYPES, *extra_types]
    if rope_type not in supported:
        raise UnsupportedConfigError(
            f"rope_parameters.rope_type={rope_type!r} is not implemented; supported: {supported}.")
    needed = {"longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings")}.get(rope_type, ())
    missing = [k for k in needed if params.get(k) is None]
    if missing:
        raise UnsupportedConfigError(f"rope_parameters of type {rope_type!r} lack {missing}.")
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1.0 and not partial_rotary:
        raise UnsupportedConfigError(
            f"rope_parameters.partial_rotary_factor={params['partial_rotary_factor']} is not supported (only 1.0).")
    if partial_rotary and not 0.0 < factor <= 1.0:
        raise UnsupportedConfigError(f"rope_parameters.partial_rotary_factor={factor}: expected a value in (0, 1].")
    return params


# ---- checks for dense decoders -----------------------------------------------------------------------------------

def refuse_set_fields(hf_config, arch: str, fields: tuple[tuple[str, str], ...]) -> None:
    """Raise ``UnsupportedConfigError`` naming the first of ``fields`` ((name, what it would build)) that is set
    (true, non-zero, non-empty) in ``hf_config``."""
    for field, why in fields:
        if getattr(hf_config, field, None):
            raise UnsupportedConfigError(f"{field}={getattr(hf_config, field)!r} is not supported for {arch} ({why}).")


def check_dense_config(hf_config, *, qkv_bias: bool, check_rope: bool = True, layer_types: bool = False,
                       activation: bool = True, mlp_bias: bool = False) -> None:
    """Raise ``UnsupportedConfigError`` for values a dense bridge cannot reproduce exactly (``layer_types``: the
    bridge implements sliding-window layers, ``bridges.layer_types``; ``activation=False``: the bridge builds the
    MLP's activation itself, Apertus's xIELU; ``mlp_bias``: the bridge maps the MLP's biases, Jais 2)."""
    if check_rope:
        rope_parameters(hf_config)
    if getattr(hf_config, "mlp_bias", False) and not mlp_bias:
        raise UnsupportedConfigError("mlp_bias=True is not supported.")
    if getattr(hf_config, "attention_bias", False) and not qkv_bias:
        raise UnsupportedConfigError("attention_bias=True is not supported for this architecture.")
    if getattr(hf_config, "pretraining_tp", 1) not in (1, None):
        raise UnsupportedConfigError(f"pretraining_tp={hf_config.pretraining_tp} is not supported (only 1).")
    if getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedConfigError(
            "use_sliding_window=True is not supported (per-layer sliding windows, max_window_layers).")
    kinds = getattr(hf_config, "layer_types", None)
    if kinds and not layer_types and any(t != "full_attention" for t in kinds):
        raise UnsupportedConfigError(f"layer_types={sorted(set(kinds))} is not supported (only full_attention).")
    if activation:
        _act_to_megatron(hf_config.hidden_act)


def sliding_window_of(hf_config) -> int | None:
    """The effective sliding window (None when it can never bind: it covers every position, or the config's
    ``layer_types`` give no layer a sliding window, as Qwen2-MoE's ``sliding_window=0`` without one)."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    if window is None or window >= getattr(hf_config, "max_position_embeddings", 0):
        return None
    return int(window)


# ---- mixture of experts ------------------------------------------------------------------------------------------

def router_aux_loss_coef_of(hf_config) -> float:
    """The coefficient of transformers' router load-balancing loss for an HF MoE config: ``router_aux_loss_coef``
    when ``output_router_logits`` is on (transformers then adds ``coef * aux`` to the loss), else 0.

    Read at each forward, not at load: trl.SFTTrainer rewrites both fields of the model config. The loss is computed
    as transformers computes it, over the router logits of all MoE layers of one forward (``router_balance.py``);
    megatron-core's own balancing losses (``moe_router_load_balancing_type``: per layer, divided by top-k, summed
    over layers) are never turned on by the bridges.
    """
    if not getattr(hf_config, "output_router_logits", False):
        return 0.0
    return router_aux_loss_coef_field(hf_config)


def router_aux_loss_coef_field(hf_config) -> float:
    """The config's balancing-loss coefficient, on or off: ``router_aux_loss_coef``, or DBRX's
    ``ffn_config.moe_loss_weight``, or JetMoE's ``aux_loss_coef`` (the one its transformers model reads)."""
    ffn = getattr(hf_config, "ffn_config", None)
    if hasattr(ffn, "moe_loss_weight"):
        return float(ffn.moe_loss_weight or 0.0)
    if not hasattr(hf_config, "router_aux_loss_coef") and hasattr(hf_config, "aux_loss_coef"):
        return float(hf_config.aux_loss_coef or 0.0)
    return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)


# ---- multi-latent attention --------------------------------------------------------------------------------------

MLA_FIELDS: tuple[Field, ...] = (
    Field("q_lora_rank", "q_lora_rank"),
    Field("kv_lora_rank", "kv_lora_rank"),
    Field("qk_nope_head_dim", "qk_head_dim"),
    Field("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    Field("v_head_dim", "v_head_dim"),
)

MLA_ROPE_TYPES = ("default", "yarn")
# NOTE: transformers builds MLA's q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
MLA_LATENT_NORM_EPS = 1e-6


def mla_rope_kwargs(hf_config) -> dict:
    """megatron ``MLATransformerConfig`` rope fields for a DeepSeek config (plain rope or YaRN)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
        params.update(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in MLA_ROPE_TYPES:
        raise UnsupportedConfigError(f"rope_parameters.rope_type={rope_type!r} is not implemented for multi-latent "
                                     f"attention; supported: {list(MLA_ROPE_TYPES)}.")
    _check_mla_rotary_dim(hf_config, params.get("partial_rotary_factor", 1.0))
    theta = params.get("rope_theta", 10000.0)
    if rope_type == "default":
        # NOTE: megatron's MLA softmax scale multiplies by yarn_get_mscale(rotary_scaling_factor, mscale_all_dim)^2;
        # factor 1 keeps it at 1 like transformers' plain rope.
        return {"rope_type": "rope", "rotary_base": theta, "rotary_scaling_factor": 1.0, "mscale": 1.0,
                "mscale_all_dim": 0.0}
    if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise UnsupportedConfigError(
            "rope_parameters.attention_factor / truncate=False are not supported for YaRN multi-latent attention "
            "(megatron derives the attention factor from factor, mscale and mscale_all_dim, and truncates).")
    orig = int(params.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
    factor = float(params.get("factor") or hf_config.max_position_embeddings / orig)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        # NOTE: transformers then uses get_mscale(factor) for cos/sin and no softmax correction; megatron computes
        # get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) and get_mscale(factor, mscale_all_dim)^2,
        # which (1, 0) reproduces.
        mscale, mscale_all_dim = 1.0, 0.0
    return {"rope_type": "yarn", "rotary_base": theta, "rotary_scaling_factor": factor,
            "original_max_position_embeddings": orig, "beta_fast": float(params.get("beta_fast") or 32.0),
            "beta_slow": float(params.get("beta_slow") or 1.0), "mscale": float(mscale),
            "mscale_all_dim": float(mscale_all_dim)}


def _check_mla_rotary_dim(hf_config, factor: float) -> None:
    """transformers' rotary tables rotate ``int(head_dim * partial_rotary_factor)`` dims, which MLA's rotary part
    ``qk_rope_head_dim`` must be (DeepSeek: ``head_dim`` is it, factor 1; Mistral 4: ``head_dim`` is the whole
    query head, the factor its rotary share)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.qk_rope_head_dim
    if int(head_dim * factor) != hf_config.qk_rope_head_dim:
        raise UnsupportedConfigError(
            f"rope_parameters.partial_rotary_factor={factor} with head_dim={head_dim} rotates "
            f"{int(head_dim * factor)} dims, not qk_rope_head_dim={hf_config.qk_rope_head_dim}.")


def check_mla_config(hf_config) -> None:
    # NOTE: the latent norms keep MLA_LATENT_NORM_EPS whatever rms_norm_eps is (specs.py: LatentRMSNorm)
    mla_rope_kwargs(hf_config)
