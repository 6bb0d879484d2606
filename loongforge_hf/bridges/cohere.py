"""CohereForCausalLM (Cohere's Command-R 35B and 08-2024, Command R+, Aya-23, Aya Expanse 8B / 32B) and
Cohere2ForCausalLM (Command R7B, Command A): the attention and the MLP side by side after one norm, LayerNorms without
bias, rotary pairs interleaved and the logits scaled.

Choices:
- Each layer is ``x + attn(norm(x)) + mlp(norm(x))`` with one ``input_layernorm``: the spec's
  ``SharedNormParallelLayer`` (``kernels/specs.py``: megatron's layer whose MLP reads the input norm's output again).
  The MLP is Llama's gated one (``gate_proj`` / ``up_proj`` / ``down_proj``, ``hidden_act``), no linear has a bias.
- ``CohereLayerNorm`` (input and final norms): the mean subtracted, no bias, computed in fp32 and rounded once
  (``layer_norm_eps``): megatron's ``normalization="LayerNorm"`` built as our ``kernels.layernorm.LayerNormWithoutBias``
  (``norm_bias = False``; sequence parallel as StarCoder2's norms).
- Rotary: transformers' Cohere rotates channel pairs ``(2i, 2i + 1)`` (``repeat_interleave``'d cos / sin and its own
  ``rotate_half``): megatron's ``rotary_interleaved``, as Helium's. transformers rotates q and k in fp32 and rounds
  after; megatron in the activations' dtype: the same in fp32, one bf16 rounding apart in bf16. Plain rope and llama3
  scaling; rope types with an attention factor (YaRN) are refused (no Cohere checkpoint uses one).
- ``logit_scale`` (Command-R: 0.0625): the logits times it, in their dtype, as transformers
  (``layer_outputs.scale_logits``: the output layer's logits, and the fused loss of the training step,
  ``kernels.cross_entropy``'s ``logit_scale``). ``logit_scale=None`` (transformers' forward would fail) is refused.
- ``use_qk_norm`` (Command R+): ``CohereLayerNorm`` over each head's channels with a weight per head (``q_norm``
  ``[heads, head_dim]``, ``k_norm`` ``[kv_heads, head_dim]``) before the rotation: ``per_head_layer_norm`` in
  megatron's q / k norm slots. Under tensor parallelism each rank holds its heads' rows (column-parallel, as its q /
  k / v rows); megatron's ``qk_layernorm`` stays off, so ``finalize_model_grads`` does not sum those slices' grads over
  TP (OLMo 2's full-width norms do the same).
- ``attention_bias=True`` is refused: it puts a bias on o_proj while the MLP has none, and megatron's output
  projection has a bias exactly when the MLP's linears do (``add_bias_linear``). No hub checkpoint sets it.
- ``tie_word_embeddings`` (on in every hub checkpoint: no ``lm_head.weight`` on disk) shares the embedding with the LM
  head; off, ``lm_head.weight`` as Llama's. Names: ``model.*`` as Llama's, ``self_attn.q_norm`` / ``k_norm``.
- Cohere2: ``layer_types`` (three sliding layers to one full in Command R7B / A): the window (``sliding_window``) on
  the sliding layers (megatron's ``window_attn_skip_freq``) and no rotary embedding on the full ones, which
  transformers rotates only when a layer has a window (``smollm3.no_rope_attention``); no q / k norms
  (``Cohere2Config`` has none), ``head_dim`` is ``hidden_size / num_attention_heads``.
- CohereCompassForCausalLM (``cohere_compass_text``: the language model of Cohere's Compass image-text models, as its
  own causal LM): Cohere2's layer with Qwen3's rotary (rotate-half pairs: megatron's default, not interleaved) and the
  rope per layer type (``rope_parameters[layer_type]``; a type whose entry is None takes no rotary embedding). Its
  three M-RoPE axes all take the text positions in a causal LM, which is plain rope. The rotated types must share
  their parameters (one table; refused by name otherwise). ``logit_scale=None`` leaves the logits unscaled, as
  transformers' class does.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.layer_outputs import scale_logits
from loongforge_hf.bridges.layer_types import check_layer_kinds, layer_windows
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention

COHERE_FIELDS = C.fields_with_eps("layer_norm_eps")


@functools.cache
def per_head_layer_norm(which: str) -> type:
    """The q (``which="q"``) or k norm slot's module: ``CohereLayerNorm`` over each head's channels with a weight per
    head, ``[local heads, head_dim]`` on each TP rank (its heads' rows of the checkpoint's ``[heads, head_dim]``)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from loongforge_hf.xpu import get_backend

    class PerHeadLayerNorm(torch.nn.Module):
        def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
            super().__init__()
            heads = config.num_attention_heads if which == "q" else config.num_query_groups
            self.head_dim, self.eps = hidden_size, eps  # NOTE: megatron passes the head size
            device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
            self.weight = torch.nn.Parameter(torch.ones(heads // config.tensor_model_parallel_size, hidden_size,
                                                        dtype=config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # NOTE: x [..., local heads, head_dim]; transformers' numerics: fp32 throughout, one rounding at the end
            normed = F.layer_norm(x.to(torch.float32), (self.head_dim,), eps=self.eps)
            return (self.weight.to(torch.float32) * normed).to(x.dtype)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                       {"weight": 0}, sharded_offsets)

    PerHeadLayerNorm.__name__ = f"PerHead{which.upper()}LayerNorm"
    return PerHeadLayerNorm


@register_bridge("CohereForCausalLM")
class CohereBridge(DenseBridge):
    config_fields = COHERE_FIELDS
    extra_rope_types = ()
    parallel_residual = "shared"
    norm_bias = False
    unset_logit_scale: float | None = None  # NOTE: the scale for logit_scale=None (None: refused)

    @property
    def use_qk_norm(self) -> bool:
        return bool(getattr(self.hf_config, "use_qk_norm", False))

    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        if getattr(c, "attention_bias", False):
            raise C.UnsupportedConfigError(
                f"attention_bias=True is not supported for {arch}: it puts a bias on o_proj while the MLP has none, "
                "and megatron's attention output projection has a bias exactly when the MLP's linears do "
                "(add_bias_linear).")
        if getattr(c, "logit_scale", None) is None and self.unset_logit_scale is None:
            raise C.UnsupportedConfigError(f"logit_scale=None is not supported for {arch} (transformers multiplies "
                                           "the logits by it); set a number (1.0 leaves them unscaled).")
        super().check_config()

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm", "rotary_interleaved": True}

    def qk_module(self) -> tuple[type, type] | None:
        return (per_head_layer_norm("q"), per_head_layer_norm("k")) if self.use_qk_norm else None

    def finish_model(self, model) -> None:
        scale = self.hf_config.logit_scale
        scale_logits(model, float(self.unset_logit_scale if scale is None else scale))

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        maps = super().attention_mappings()
        if self.use_qk_norm:
            maps += [ColumnParallel(f"{D}.self_attention.q_layernorm.weight", f"{L}.self_attn.q_norm.weight"),
                     ColumnParallel(f"{D}.self_attention.k_layernorm.weight", f"{L}.self_attn.k_norm.weight")]
        return maps

    def dense_mlp_mappings(self) -> list[Mapping]:
        return super().dense_mlp_mappings()[1:]  # NOTE: no post-attention norm: the MLP reads the input norm's output

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().attention_shapes(prefix)
        if self.use_qk_norm:
            c = self.hf_config
            hd, kv = C.head_dim_of(c), getattr(c, "num_key_value_heads", None) or c.num_attention_heads
            shapes.update({f"{prefix}.self_attn.q_norm.weight": (c.num_attention_heads, hd),
                           f"{prefix}.self_attn.k_norm.weight": (kv, hd)})
        return shapes

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().dense_mlp_shapes(prefix)
        shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return shapes


@register_bridge("Cohere2ForCausalLM")
class Cohere2Bridge(CohereBridge):
    supports_sliding_window = True
    per_layer_types = True

    @property
    def use_qk_norm(self) -> bool:
        return False  # NOTE: transformers' Cohere2 has no q / k norms, whatever the config says

    def check_config(self) -> None:
        super().check_config()
        check_layer_kinds(self.hf_config, self.architectures[0])

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), **layer_windows(self.hf_config)}

    def attention_module(self) -> type | None:
        full = frozenset(i for i, kind in enumerate(self.hf_config.layer_types or []) if kind == "full_attention")
        return no_rope_attention(full) if full else None


@register_bridge("CohereCompassForCausalLM")
class CohereCompassBridge(Cohere2Bridge):
    """Cohere2's layer with rotate-half pairs and a rope (or none) per layer type (module docstring)."""

    unset_logit_scale = 1.0  # NOTE: transformers' CohereCompassForCausalLM scales by 1.0 where the config says None

    def rope_by_type(self) -> dict:
        """Each layer type's rope parameters (None: the type takes no rotary embedding)."""
        c = self.hf_config
        per_type = dict(c.rope_parameters or {})
        kinds = list(dict.fromkeys(c.layer_types or ()))
        if not kinds or set(kinds) - set(per_type):
            raise C.UnsupportedConfigError(f"rope_parameters={per_type}: expected an entry (or None) per layer type "
                                           f"{kinds} for CohereCompassForCausalLM.")
        return {kind: per_type[kind] for kind in kinds}

    def rope_parameters(self) -> dict:
        rotated = [dict(p) for p in self.rope_by_type().values() if p is not None]
        common = [{k: v for k, v in p.items() if k not in ("mrope_section", "mrope_interleaved")} for p in rotated]
        if not common or any(p != common[0] for p in common):
            raise C.UnsupportedConfigError(f"rope_parameters={self.hf_config.rope_parameters} is not supported for "
                                           "CohereCompassForCausalLM: the rotated layer types must share one rope "
                                           "(and at least one type must rotate).")
        return C.rope_parameters(SimpleNamespace(rope_parameters=common[0]), extra_types=self.extra_rope_types)

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "rotary_interleaved": False}

    def attention_module(self) -> type | None:
        kinds, rope = self.hf_config.layer_types, self.rope_by_type()
        nope = frozenset(i for i, kind in enumerate(kinds) if rope[kind] is None)
        return no_rope_attention(nope) if nope else None
