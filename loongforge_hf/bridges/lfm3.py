"""Lfm3ForCausalLM (Liquid AI's LFM3): LFM2's short-convolution and attention layers (``lfm2.Lfm2Layers``) with
sliding-window layers, a per-head output gate, sandwich norms and a proportional rope.

Choices:
- ``layer_types``: ``conv`` (LFM2's ``ShortConvMixer``: TP by channels, the padding mask, packed documents, the
  conv state in the cached generate, context parallelism), ``full_attention`` and ``sliding_attention`` (megatron's
  ``SelfAttention``; the window on the sliding layers only, ``layer_types.layer_windows``). Attention tensors under
  Qwen3's names (``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, per-head ``q_norm`` / ``k_norm`` before the
  rotation). Cached ``generate`` (keys, values and conv states in our KV cache; the static cache refused) and
  context parallelism (``generate`` under it without the cache) as LFM2's.
- The output gate (``use_attention_gate``): transformers' ``g_proj`` (``hidden_size -> num_attention_heads``, on the
  layer's normalised input) gives each head one scalar; the head's attention output times its sigmoid, before
  ``o_proj``. On disk ``self_attn.gate_proj`` (the hub's name: transformers' loading renames it, its
  ``save_pretrained`` writes it back). Our ``linear_gate`` (column-parallel by heads, as megatron splits the query
  heads; under sequence parallelism it all-gathers the tokens itself, a second gather beside ``linear_qkv``'s) hands
  megatron's ``attention_output_gate`` path one gate per head (``_apply_output_gate``: the sigmoid in the
  activations' dtype, then the product, as transformers rounds them); ``linear_qkv`` stays ungated (the module's own
  config copy turns the gate on, the shared one keeps it off). LoRA: ``g_proj`` as any column-parallel linear
  (LoRA's layers re-class ``linear_gate`` as megatron's; ``checkpoint_name`` gives the planner the hub's
  ``gate_proj`` for transformers' ``g_proj``, PEFT's name staying the adapter's), beside the other linears.
- Sandwich norms (``use_sandwich_norm``): ``post_operator_norm`` on the conv's and the attention's output,
  ``post_ffn_norm`` on the MLP's (``layer_outputs``' post norms, the conv mixer's ``post_norm``), before megatron's
  residual adds; ``operator_norm`` / ``ffn_norm`` before, ``embedding_norm`` last, as LFM2's.
- Rope per layer type (two side-by-side tables, ``layer_types._two_table_rotary``): ``default`` or ``proportional``
  (``gemma4.gemma4_inv_freq``: the first ``partial_rotary_factor * head_dim / 2`` frequencies rotate, the rest are
  zero, over the whole head as transformers' ``rotate_half``). The MLP: ``intermediate_size`` as it is.
- Refused before any collective: LFM2's refusals, ``attention_bias``, rope types other than default / proportional,
  sliding layers without a window.
"""

from __future__ import annotations

import copy
import functools

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.lfm2 import Lfm2Layers
from loongforge_hf.bridges.layer_outputs import transformed_attention, transformed_mlp
from loongforge_hf.bridges.layer_types import _two_table_rotary, layer_windows
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.registry import register_bridge

LAYER_TYPES = ("conv", "full_attention", "sliding_attention")
ROPE_TYPES = ("default", "proportional")
S = f"{D}.self_attention"


@functools.cache
def lfm3_attention(*, sliding_layers: frozenset[int], gated: bool, post_norm: bool) -> type:
    """megatron's ``SelfAttention`` with the post norm, the sliding layers' rotary half (``sliding_layers``: 0-based
    global indices) and, where ``gated``, LFM3's per-head output gate (see the module docstring)."""
    base = transformed_attention(post_norm=post_norm, sliding_layers=sliding_layers)
    if not gated:
        return base
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class Lfm3GatedAttention(base):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            self.linear_gate = ColumnParallelLinear(
                config.hidden_size, config.num_attention_heads, config=config, init_method=config.init_method,
                bias=False, gather_output=False, skip_bias_add=True, tp_group=self.pg_collection.tp)
            self.config = copy.copy(self.config)  # NOTE: megatron's forward asks for the gate when this is set
            self.config.attention_output_gate = True

        def get_query_key_value_tensors(self, hidden_states, *args, output_gate: bool = False, **kwargs):
            qkv = super().get_query_key_value_tensors(hidden_states, *args, output_gate=False, **kwargs)
            return (*qkv, self.linear_gate(hidden_states)[0]) if output_gate else qkv  # NOTE: [s, b, heads / TP]

        def _apply_output_gate(self, x, gate):
            heads = x.view(*x.shape[:-1], self.num_attention_heads_per_partition, -1)
            return (heads * torch.sigmoid(gate)[..., None]).view(x.shape)

    return Lfm3GatedAttention


@register_bridge("Lfm3ForCausalLM")
class Lfm3Bridge(Lfm2Layers, DenseBridge):
    layer_kinds = LAYER_TYPES
    supports_sliding_window = True

    def __init__(self, hf_config) -> None:
        self.post_norms = bool(hf_config.use_sandwich_norm)
        self.gated = bool(hf_config.use_attention_gate)
        super().__init__(hf_config)

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        if c.attention_bias:
            raise C.UnsupportedConfigError(f"attention_bias={c.attention_bias} is not supported for Lfm3ForCausalLM.")
        if self.sliding_layers and not c.sliding_window:
            raise C.UnsupportedConfigError(f"sliding_window={c.sliding_window} with sliding_attention layers.")
        super().check_config()

    @property
    def sliding_layers(self) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(self.hf_config.layer_types or []) if kind == "sliding_attention")

    def rope_for(self, layer_type: str) -> dict:
        """The rope parameters of ``layer_type``'s layers (the other attention type's where it has none and no
        layer is of it)."""
        ropes, kinds = self.hf_config.rope_parameters or {}, set(self.hf_config.layer_types or [])
        if layer_type not in ropes and layer_type not in kinds:
            layer_type = next(k for k in ("full_attention", "sliding_attention") if k != layer_type)
        params = dict(ropes.get(layer_type) or {})
        rope_type = params.setdefault("rope_type", "default")
        factor = params.get("partial_rotary_factor", 1.0)
        if rope_type not in ROPE_TYPES or "rope_theta" not in params or params.get("factor", 1.0) != 1.0 \
                or not 0.0 <= factor <= 1.0 or rope_type == "default" and factor != 1.0:
            raise C.UnsupportedConfigError(
                f"rope_parameters[{layer_type!r}]={params} is not supported for Lfm3ForCausalLM: rope_type one of "
                f"{list(ROPE_TYPES)} with rope_theta (a proportional rope's partial_rotary_factor in [0, 1]).")
        return params

    def rope_parameters(self) -> dict:
        # NOTE: megatron rotates whole heads; a proportional rope's unrotated channels have zero frequencies
        params = {**self.rope_for("full_attention"), "rope_type": "default"}
        params.pop("partial_rotary_factor", None)
        self.rope_for("sliding_attention")
        return params

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.pop("window_size", None)
        return {**kw, **layer_windows(self.hf_config)}

    def self_attention_class(self) -> type:
        return lfm3_attention(sliding_layers=self.sliding_layers, gated=self.gated, post_norm=self.post_norms)

    def mlp_module(self) -> type | None:
        return transformed_mlp(post_norm=True) if self.post_norms else None

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.gemma4 import gemma4_inv_freq
        from loongforge_hf.kernels.rope import set_megatron_inv_freq

        rope = getattr(model, "rotary_pos_emb", None)
        if rope is None:
            return
        hd = C.head_dim_of(self.hf_config)
        set_megatron_inv_freq(rope, gemma4_inv_freq(hd, self.rope_for("full_attention")))
        rope.__class__ = _two_table_rotary(type(rope))
        rope.local_inv_freq = gemma4_inv_freq(hd, self.rope_for("sliding_attention"))

    # ---- tensors --------------------------------------------------------------------------------------------
    def _post_operator_norm(self) -> list[Mapping]:
        return [Replicated(f"{S}.post_layernorm.weight", f"{L}.post_operator_norm.weight")] if self.post_norms else []

    def attention_mappings(self) -> list[Mapping]:
        a = f"{L}.self_attn"
        maps = [Replicated(f"{D}.input_layernorm.weight", f"{L}.operator_norm.weight"),
                QKV(f"{S}.linear_qkv.weight", q=f"{a}.q_proj.weight", k=f"{a}.k_proj.weight", v=f"{a}.v_proj.weight"),
                RowParallel(f"{S}.linear_proj.weight", f"{a}.o_proj.weight"),
                Replicated(f"{S}.q_layernorm.weight", f"{a}.q_norm.weight"),
                Replicated(f"{S}.k_layernorm.weight", f"{a}.k_norm.weight"), *self._post_operator_norm()]
        return maps + ([ColumnParallel(f"{S}.linear_gate.weight", f"{a}.gate_proj.weight")] if self.gated else [])

    def conv_mappings(self) -> list[Mapping]:
        return super().conv_mappings() + self._post_operator_norm()

    def layer_mappings(self) -> list[Mapping]:
        names = {m.megatron for m in self.attention_mappings()}
        return self.attention_mappings() + [m for m in self.conv_mappings() if m.megatron not in names] + \
            self.every_mlp_mapping()

    def dense_mlp_mappings(self) -> list[Mapping]:
        post = [Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_ffn_norm.weight")] if self.post_norms else []
        return super().dense_mlp_mappings() + post

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"{prefix}.self_attn"
        h, hd, kv, n = c.hidden_size, C.head_dim_of(c), C.kv_heads_of(c), c.num_attention_heads
        shapes = {f"{prefix}.operator_norm.weight": (h,), f"{p}.q_proj.weight": (n * hd, h),
                  f"{p}.k_proj.weight": (kv * hd, h), f"{p}.v_proj.weight": (kv * hd, h),
                  f"{p}.o_proj.weight": (h, n * hd), f"{p}.q_norm.weight": (hd,), f"{p}.k_norm.weight": (hd,)}
        if self.gated:
            shapes[f"{p}.gate_proj.weight"] = (n, h)
        return shapes

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of tensor ``name`` of transformers' module tree (LoRA's planner)."""
        return name.replace(".self_attn.g_proj.", ".self_attn.gate_proj.")

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        shapes, prefix, h = super().layer_shapes(layer), f"model.layers.{layer}", self.hf_config.hidden_size
        if self.post_norms:
            shapes.update({f"{prefix}.post_operator_norm.weight": (h,), f"{prefix}.post_ffn_norm.weight": (h,)})
        return shapes
