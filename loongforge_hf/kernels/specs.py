"""megatron-core layer specs built from our kernels: what a bridge hands to ``GPTModel``.

Choices:
- Linear layers are megatron's own tensor-parallel ``ColumnParallelLinear`` / ``RowParallelLinear``; norms are our
  ``RMSNorm`` (input, pre-MLP, q/k and final), or for a config with ``normalization="LayerNorm"`` our ``LayerNorm``
  (weight and bias: input, pre-MLP and final; StarCoder2; without the bias where the bridge says ``norm_bias =
  False``: Cohere; without either where it says ``norm_weight = False``: OLMo), core attention our
  ``CoreAttention``; MoE layer, router and token dispatchers are megatron's.
- The dense MLP is ``SwiGLUMLP``: megatron's ``MLP`` (same parameters, state dict and TP layout) whose gated activation
  is our ``swiglu`` (one Triton kernel each way on CUDA). megatron-core 0.16's ``MLP.forward`` applies the
  ``activation_func`` slot only with ``config.use_te_activation_func`` (a config-wide switch that also changes the
  MoE experts' path, transformer/moe/experts.py and shared_experts.py) and otherwise computes ``silu(gate) * up`` as
  three torch ops (transformer/mlp.py, ``glu``). The expert MLPs keep the ``SwiGLU`` slot.
- ``GPTModel`` given a bare layer spec adds megatron's default final norm, which is a torch norm that refuses sequence
  parallelism; ``get_block_spec`` wraps a layer spec with our final norm instead.
- ``use_te=True`` hands over to megatron's Transformer Engine spec whole (TE's fused norm-linear modules differ in
  layout from the local ones, so pieces are not mixed) and fails with an ImportError when TE is not installed. The
  bridges do not use it (they load the local layout): with a TE FP8 recipe they keep this spec and put megatron's TE
  linears in its linear slots only (``kernels/fp8_te.py``).
- ``get_block_spec`` also turns on the fused rotary embedding for the config (``rope.enable_megatron_fused_rope``).
- Parallel residual (GPT-NeoX / Pythia): ``ParallelResidualLayer``, megatron's ``TransformerLayer`` whose MLP reads
  the layer's input instead of the attention's output, ``x + attn(norm1(x)) + mlp(norm2(x))``. megatron's own
  attention and MLP paths run unchanged (bias-dropout-add after each, selective recompute, chunked prefill, the KV
  cache): only the pre-MLP norm's input differs. With ``shared_norm`` (one norm before both sublayers: Phi-2, Cohere)
  the pre-MLP slot is empty and the MLP reads the input norm's output again (the norm recomputed: one elementwise
  pass, no second weight to keep in step).
- MoE experts are megatron's ``SequentialMLP``; ``moe_grouped_gemm=True`` without TE means megatron's legacy
  ``GroupedMLP``, which needs the ``grouped_gemm`` package: checked here, before any model is built.
"""

from __future__ import annotations

import importlib.util

import torch.nn.functional as F

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from loongforge_hf.kernels.attention import CoreAttention
from loongforge_hf.kernels.layernorm import LayerNorm, LayerNormWithoutBias, LayerNormWithoutParameters
from loongforge_hf.kernels.rmsnorm import RMSNorm, RMSNormWithoutWeight
from loongforge_hf.kernels.rope import enable_megatron_fused_rope
from loongforge_hf.kernels.swiglu import SwiGLU, swiglu


_NORMS = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}


def norm_class(normalization: str, *, bias: bool = True, weight: bool = True) -> type:
    """Our module for megatron's ``normalization`` setting (``RMSNorm`` or ``LayerNorm``); ``bias=False``: a LayerNorm
    without bias (Cohere's; RMSNorm has none either way); ``weight=False``: a LayerNorm without weight or bias
    (OLMo's), an RMSNorm without weight (NanoChat's)."""
    if normalization not in _NORMS:
        raise ValueError(f"normalization={normalization!r} is not supported; supported: {sorted(_NORMS)}.")
    if not weight:
        return LayerNormWithoutParameters if normalization == "LayerNorm" else RMSNormWithoutWeight
    return LayerNormWithoutBias if normalization == "LayerNorm" and not bias else _NORMS[normalization]


def _require(package: str, why: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{why} needs the `{package}` package, which is not installed.")


class SwiGLUMLP(MLP):
    """megatron's ``MLP`` for a gated-silu config, with ``swiglu`` between ``linear_fc1`` and ``linear_fc2``.

    Other configs (another activation, clamping, a linear offset, megatron's own fusion switches) and MoE's
    ``per_token_scale`` take megatron's ``MLP.forward`` unchanged."""

    def __init__(self, config, submodules: MLPSubmodules, *args, **kwargs) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        self.fused_swiglu = (config.gated_linear_unit and config.activation_func is F.silu
                             and getattr(config, "activation_func_clamp_value", None) is None
                             and not getattr(config, "glu_linear_offset", 0.0)
                             and not config.use_te_activation_func and not config.bias_activation_fusion)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self.fused_swiglu or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        fc1, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            fc1 = fc1 + bias
        return self.linear_fc2(swiglu(fc1))


class ParallelResidualLayer(TransformerLayer):
    """``TransformerLayer`` with the MLP beside the attention: ``out = x + attn(norm1(x)) + mlp(norm2(x))`` (see the
    module docstring); ``shared_norm``: ``norm2`` is ``norm1`` (the spec leaves ``pre_mlp_layernorm`` empty)."""

    shared_norm = False

    def forward(self, *args, **kwargs):
        kwargs.pop("dynamic_inference_decode_only", None)
        self._layer_input = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        try:
            after_attention, context = self._forward_attention(*args, **kwargs)
            # NOTE: megatron's MLP path adds its output to ``after_attention`` (x + attn); the norm reads the input
            output = self._forward_mlp(after_attention, kwargs.get("inference_context"),
                                       padding_mask=kwargs.get("padding_mask"))
        finally:
            self._layer_input = None
        return output, context

    def _forward_pre_mlp_layernorm(self, hidden_states):
        if self.shared_norm:
            return self.input_layernorm(self._layer_input)
        return super()._forward_pre_mlp_layernorm(self._layer_input)


class SharedNormParallelLayer(ParallelResidualLayer):
    """``ParallelResidualLayer`` with one norm before both sublayers."""

    shared_norm = True


_PARALLEL_LAYERS = {None: TransformerLayer, "separate": ParallelResidualLayer, "shared": SharedNormParallelLayer}


def _mlp_submodules() -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear, activation_func=SwiGLU)


def _moe_spec(num_experts: int, moe_grouped_gemm: bool) -> ModuleSpec:
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    if num_experts < 1:
        raise ValueError(f"get_layer_spec: num_experts must be positive, got {num_experts}.")
    if moe_grouped_gemm:
        _require("grouped_gemm", "moe_grouped_gemm=True without Transformer Engine (megatron's GroupedMLP)")
        experts = ModuleSpec(module=GroupedMLP)
    else:
        experts = ModuleSpec(module=SequentialMLP, submodules=_mlp_submodules())
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(experts=experts,
                                 shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=_mlp_submodules())),
        metainfo={"fuse_pre_mlp_layernorm": False},
    )


def get_layer_spec(*, qk_norm: bool, num_experts: int | None = None, moe_grouped_gemm: bool = False,
                   use_te: bool = False, qk_module: type | tuple[type, type] | None = None,
                   attention_module: type | None = None, mlp_module: type | None = None,
                   pre_norms: bool = True, normalization: str = "RMSNorm", norm_bias: bool = True,
                   norm_weight: bool = True, parallel_residual: str | None = None) -> ModuleSpec:
    """A megatron ``TransformerLayer`` spec: pre-norm causal self-attention (megatron's ``SelfAttention`` or
    ``attention_module``; optional q/k RMSNorm, or ``qk_module`` in the q/k norm slots: one class for both or a
    (q, k) pair), then a gated MLP (``SwiGLUMLP`` or ``mlp_module``, with the same submodules) or, with
    ``num_experts``, an MoE layer (shared experts appear when the config sets their size). ``pre_norms=False``: no
    input / pre-MLP norms (OLMo 2 normalises the attention and MLP outputs instead, in its modules);
    ``normalization`` / ``norm_bias`` / ``norm_weight``: the kind of the input / pre-MLP norms (``norm_class``);
    ``parallel_residual``: ``"separate"`` (the MLP beside the attention, each with its norm) or ``"shared"`` (one norm
    before both), see ``ParallelResidualLayer``."""
    if use_te:
        _require("transformer_engine", "get_layer_spec(use_te=True)")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                                          qk_layernorm=qk_norm)
    q, k = qk_module if isinstance(qk_module, tuple) else (qk_module or (RMSNorm if qk_norm else IdentityOp),) * 2
    if parallel_residual not in _PARALLEL_LAYERS:
        raise ValueError(f"parallel_residual={parallel_residual!r}; expected one of {list(_PARALLEL_LAYERS)}.")
    pre_norm = norm_class(normalization, bias=norm_bias, weight=norm_weight) if pre_norms else IdentityOp
    mlp = ModuleSpec(module=mlp_module or SwiGLUMLP, submodules=_mlp_submodules()) if num_experts is None \
        else _moe_spec(num_experts, moe_grouped_gemm)
    return ModuleSpec(
        module=_PARALLEL_LAYERS[parallel_residual],
        submodules=TransformerLayerSubmodules(
            input_layernorm=pre_norm,
            self_attention=ModuleSpec(
                module=attention_module or SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=CoreAttention,
                                                   linear_proj=RowParallelLinear, q_layernorm=q, k_layernorm=k),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if parallel_residual == "shared" else pre_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def final_norm_spec(*, use_te: bool = False, normalization: str = "RMSNorm", norm_bias: bool = True,
                    norm_weight: bool = True) -> type:
    """The module for the norm after the last layer (``norm_bias`` / ``norm_weight``: see ``norm_class``)."""
    if use_te:
        _require("transformer_engine", "final_norm_spec(use_te=True)")
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return norm_class(normalization, bias=norm_bias, weight=norm_weight)


def get_block_spec(config, layer_spec: ModuleSpec, *, use_te: bool = False, vp_stage: int | None = None,
                   pp_rank: int | None = None, norm_bias: bool = True,
                   norm_weight: bool = True) -> TransformerBlockSubmodules:
    """The spec to pass as ``GPTModel(transformer_layer_spec=...)``: this stage's layers plus our final norm
    (``norm_bias`` / ``norm_weight``: see ``norm_class``)."""
    if not use_te:
        enable_megatron_fused_rope(config)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage, pp_rank),
                                      layer_norm=final_norm_spec(use_te=use_te, normalization=config.normalization,
                                                                 norm_bias=norm_bias, norm_weight=norm_weight))
