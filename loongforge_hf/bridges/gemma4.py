"""Gemma4ForCausalLM (``gemma4_text``: Gemma 4's text model): Gemma 3's sandwich-norm layers with Gemma 4's
differences.

Choices:
- Norms store their weight itself (``Gemma4RMSNorm``: ``x * rstd * weight``, not Gemma 3's ``1 + weight``): our
  ``RMSNorm`` without ``layernorm_zero_centered_gamma``, in every slot (input, q / k, post-attention, pre- and
  post-MLP, final). Post norms as Gemma 3's (``layer_outputs.transformed_attention`` / ``transformed_mlp``).
- Values are normalised per head without a weight (``v_norm``) as they leave ``get_query_key_value_tensors``
  (``gemma4_attention.py``); scores are not scaled (``softmax_scale=1``: the q / k norms set the scale).
- Rope per layer type (two side-by-side tables, each on its layers' head size): ``default`` or ``proportional``
  (transformers' ``_compute_proportional_rope_parameters``: the first ``partial_rotary_factor * head_dim / 2``
  frequencies rotate, the rest are zero, i.e. those channels pass unrotated; over the whole head, as transformers'
  ``rotate_half``). The full layers' default in transformers is proportional with 0.25.
- ``layer_scalar`` (a buffer per layer, loaded from the checkpoint): the layer's output, residual included, times it
  (``_scaled_layer``). ``final_logit_softcapping``: Gemma 2's ``softcap_logits`` (the fused loss too). The embedding
  is scaled by ``sqrt(hidden_size)`` rounded to the weights' dtype, as Gemma's.
- Full-attention layers with their own head size and KV heads (``per_layer_config``: ``global_head_dim``,
  ``num_global_key_value_heads``) and values from the key projection (``attention_k_eq_v``): ``gemma4_attention.py``.
  transformers refuses a global read of a per-layer field of such a config; the bridge allows it on the config it was
  given (``allow_global_per_layer_attribute_access``: the global values are the sliding layers', from which megatron's
  shared config is built). Each layer type's KV heads must split over TP (no replicated heads: ``check_layout``).
- Gemma 4 E2B / E4B: per-layer inputs (``hidden_size_per_layer_input``) and double-wide MLPs
  (``use_double_wide_mlp``): ``gemma4_per_layer.py``; the last ``num_kv_shared_layers`` layers reusing the keys and
  values of the last earlier layer of their type: ``gemma4_attention.py``. Pipelines (virtual stages too) carry
  the per-layer stream across stage boundaries (``pipeline_hidden_size``: ``hidden_size + num_hidden_layers *
  hidden_size_per_layer_input``, as Gemma 3n's); the pair is not carried across stages, so the split keeps each
  reusing layer on the stage of the layer storing its keys and values: megatron's where it does, else the most even
  one that does (``gemma4_small.py``); a pipeline size no split of which does, or virtual stages that part them,
  are refused by name (``check_layout``). Under
  context parallelism each rank's per-layer stream is its own tokens' (looked up from its input ids), a reusing
  layer takes the storing layer's keys and values of the rank's tokens and our core attention gathers them over the
  CP group as the storing layer's did. With either field activation recompute is refused by name (at the forward:
  both pass beside megatron's layer arguments); and the MoE block.
- Refused by name, before any collective: per-layer fields other than the head size and KV heads, layers of one
  type with different ones, bidirectional attention (``use_bidirectional_attention='all'``), attention biases, rope
  types other than default / proportional, all layers sharing KV (no layer would compute it).
- The MoE block (``enable_moe_block``: 26B-A4B): a config with it makes ``gemma4_moe.Gemma4MoeBridge``, this bridge with
  a dense MLP beside routed experts in every layer.
- Gemma4UnifiedForCausalLM (``gemma4_unified_text``: the language model of Gemma 4 Unified) is this model without
  per-layer inputs or MoE block (its config has neither field), served by this declaration as it is.
- A ``gemma4`` checkpoint (``Gemma4ForConditionalGeneration``: the text model with vision / audio towers) loads as
  an image-text model (``gemma4_vl.py``), its language model this declaration's.
"""

from __future__ import annotations

import functools
import re

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges import gemma4_per_layer as per_layer
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.gemma import _SandwichNorms, scale_gemma_embedding
from loongforge_hf.bridges.gemma4_attention import PerTypeQKV, per_type_attention, share_keys_and_values
from loongforge_hf.bridges.gemma4_per_layer import add_per_layer_inputs, gemma4_layer
from loongforge_hf.bridges.gemma4_small import SmallModelFields, refuse_recompute
from loongforge_hf.bridges.layer_outputs import softcap_logits
from loongforge_hf.bridges.layer_types import LAYER_TYPES, LayerTypes, _two_table_rotary
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge, register_model_type

ROPE_TYPES = ("default", "proportional")
_UNUSED_KV = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:k_proj|v_proj|k_norm)\.weight$")


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


_PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


def layer_type_heads(hf_config) -> dict[str, tuple[int, int]]:
    """(head size, KV heads) of each layer type present, from ``per_layer_config``; ``UnsupportedConfigError`` for
    per-layer fields other than those two and for layers of one type that differ."""
    extra = sorted(set(getattr(hf_config, "per_layer_attributes", None) or ()) - set(_PER_LAYER_FIELDS))
    if extra:
        raise C.UnsupportedConfigError(f"per_layer_config fields {extra} are not supported for Gemma4ForCausalLM "
                                       f"(only {list(_PER_LAYER_FIELDS)} may differ between layers).")
    layers = hf_config.per_layer_config
    found: dict[str, set] = {}
    for i, kind in enumerate(hf_config.layer_types):
        found.setdefault(kind, set()).add(tuple(getattr(layers[i], f) for f in _PER_LAYER_FIELDS))
    for kind, heads in found.items():
        if len(heads) > 1:
            raise C.UnsupportedConfigError(f"per_layer_config: the {kind} layers' (head_dim, num_key_value_heads) "
                                           f"differ ({sorted(heads)}); Gemma4ForCausalLM takes one pair per type.")
    return {kind: heads.pop() for kind, heads in found.items()}


@register_model_type("gemma4_text")  # NOTE: a text config that names no architecture is this model's
@register_bridge("Gemma4ForCausalLM", "Gemma4UnifiedForCausalLM")
class Gemma4Bridge(SmallModelFields, LayerTypes, _SandwichNorms):
    qk_norm = True
    # NOTE: LoRA on the per-layer linears (Gemma 3n's AltUp / LAuReL ones too): torch linears on each rank's tokens
    # (lora/replicated.py)
    lora_replicated_linears = True
    zero_centred_norms = False
    # NOTE: k / v projections and k norms a checkpoint may hold for layers that reuse another's keys (passthrough_names)
    has_passthrough = True
    passthrough_kind = "keys and values of layers that reuse another layer's, unused as in transformers"
    # NOTE: the image-text model's placeholders, looked up as padding in the per-layer table (gemma4_vl.py)
    placeholder_ids: tuple[int, ...] = ()

    def __new__(cls, hf_config=None, *args, **kwargs):
        if cls is Gemma4Bridge and getattr(hf_config, "enable_moe_block", False):
            from loongforge_hf.bridges.gemma4_moe import Gemma4MoeBridge

            return super().__new__(Gemma4MoeBridge)
        return super().__new__(cls)

    def check_config(self) -> None:
        c = self.hf_config
        if c.is_heterogeneous:  # NOTE: the global values are the sliding layers' (see the module docstring)
            c.allow_global_per_layer_attribute_access = True
        if c.attention_bias:
            raise C.UnsupportedConfigError(f"attention_bias={c.attention_bias} is not supported for Gemma4ForCausalLM "
                                           "(attention biases).")
        self.check_small_model_fields()
        if c.use_bidirectional_attention == "all":
            raise C.UnsupportedConfigError("use_bidirectional_attention='all' is not supported (causal attention "
                                           "only).")
        C._act_to_megatron(c.hidden_activation)
        self.check_layer_types()
        base = (C.head_dim_of(c), C.kv_heads_of(c))
        self.heads = {kind: base for kind in LAYER_TYPES} | layer_type_heads(c)
        if self.heads["sliding_attention"] != base:
            raise C.UnsupportedConfigError(f"per_layer_config: the sliding layers' (head_dim, num_key_value_heads) "
                                           f"{self.heads['sliding_attention']} differ from the config's {base}.")
        self.full_layers = frozenset(i for i, kind in enumerate(c.layer_types) if kind == "full_attention")
        self.full_heads = None if self.heads["full_attention"] == base else self.heads["full_attention"]
        self.values_from_keys = bool(c.attention_k_eq_v)

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` (pure, before any collective) for a pipeline no split of which keeps layers
        reusing keys and values with the storing one, and a layer type's KV heads that do not split over TP: layers
        built with their own heads or values from keys hold whole KV heads per rank."""
        tp = layout.tensor_parallel_size
        self.check_stage_split(layout)
        if self.full_heads is None and not self.values_from_keys:
            return
        names = {"sliding_attention": "num_key_value_heads", "full_attention": "num_global_key_value_heads"}
        for kind in names:
            kv = self.heads[kind][1]
            if kv % tp:
                raise C.UnsupportedConfigError(
                    f"{names[kind]}={kv} (the {kind} layers' KV heads) does not split over tensor_parallel_size={tp} "
                    "for Gemma4ForCausalLM, whose full-attention layers have their own heads (replicated KV heads "
                    "are not supported there); use a tensor_parallel_size that divides it.")

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
        return per_type_attention(full_layers=self.full_layers, full_heads=self.full_heads,
                                  values_from_keys=self.values_from_keys, reusing_layers=self.reusing_layers)

    def layer_module(self) -> type | None:
        if not self.per_layer_size and not self.wide_layers:
            return None
        return gemma4_layer(wide_layers=self.wide_layers, per_layer_size=self.per_layer_size,
                            activation=self.hf_config.hidden_activation)

    def finish_model(self, model) -> None:
        scale_gemma_embedding(model, self.hf_config.hidden_size)
        self.set_rotary_tables(model)
        _add_layer_scalars(model)
        if self.small_model_features:  # NOTE: first, so it refuses before the stream is made
            refuse = functools.partial(refuse_recompute, self.small_model_features)
            model.decoder.register_forward_pre_hook(refuse)
        if self.per_layer_size:
            add_per_layer_inputs(model, self.hf_config, placeholder_ids=self.placeholder_ids)
        if self.kv_modes:
            share_keys_and_values(model, self.kv_modes, self.hf_config.layer_types)
        cap = self.hf_config.final_logit_softcapping
        if cap is not None:
            softcap_logits(model, cap)

    def set_rotary_tables(self, chunk) -> None:
        from loongforge_hf.kernels.rope import set_megatron_inv_freq

        rope = getattr(chunk, "rotary_pos_emb", None)
        if rope is None:
            return
        inv = {kind: gemma4_inv_freq(self.heads[kind][0], self.rope_for(kind)) for kind in LAYER_TYPES}
        # NOTE: megatron sized its table for the shared config's head (the sliding layers'); the full layers' first
        rope.inv_freq = torch.empty_like(inv["full_attention"], device=rope.inv_freq.device)
        set_megatron_inv_freq(rope, inv["full_attention"])
        rope.__class__ = _two_table_rotary(type(rope))
        rope.local_inv_freq = inv["sliding_attention"]

    # ---- tensors --------------------------------------------------------------------------------------------
    def first_stage_mappings(self) -> list[Mapping]:
        return per_layer.first_stage_mappings(self.hf_config) if self.per_layer_size else []

    def attention_mappings(self) -> list[Mapping]:
        own = [Replicated(f"{D}.layer_scalar", f"{L}.layer_scalar")]
        if self.per_layer_size:
            own += per_layer.layer_mappings()
        if self.full_heads is None and not self.values_from_keys and not self.reusing_layers:
            return [*own, *super().attention_mappings()]  # NOTE: one layout: LoRA adapts q / k / v there
        qkv = PerTypeQKV(f"{D}.self_attention.linear_qkv.weight", q=f"{L}.self_attn.q_proj.weight",
                         k=f"{L}.self_attn.k_proj.weight", v=f"{L}.self_attn.v_proj.weight",
                         full_layers=self.full_layers, full_heads=self.full_heads,
                         values_from_keys=self.values_from_keys, reusing_layers=self.reusing_layers)
        return [*own, *(qkv if m.megatron == qkv.megatron else m for m in super().attention_mappings())]

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        maps = self.layer_mappings()
        if layer in self.reusing_layers:  # NOTE: no k norm there (the keys are another layer's)
            return [m for m in maps if not m.megatron.endswith("k_layernorm.weight")]
        return maps

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.layer_scalar": (1,), **super().attention_shapes(prefix)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_shapes(layer)
        c, p = self.hf_config, f"model.layers.{layer}.self_attn"
        if layer in self.wide_layers:
            h, f, m = c.hidden_size, 2 * c.intermediate_size, f"model.layers.{layer}.mlp"
            shapes.update({f"{m}.gate_proj.weight": (f, h), f"{m}.up_proj.weight": (f, h),
                           f"{m}.down_proj.weight": (h, f)})
        if layer in self.reusing_layers:
            for name in ("k_proj", "v_proj", "k_norm"):
                shapes.pop(f"{p}.{name}.weight", None)
        if layer not in self.full_layers:
            return shapes
        (hd, kv), h, n = self.heads["full_attention"], c.hidden_size, c.num_attention_heads
        shapes.update({f"{p}.q_proj.weight": (n * hd, h), f"{p}.k_proj.weight": (kv * hd, h),
                       f"{p}.v_proj.weight": (kv * hd, h), f"{p}.o_proj.weight": (h, n * hd),
                       f"{p}.q_norm.weight": (hd,), f"{p}.k_norm.weight": (hd,)})
        if self.values_from_keys or layer in self.reusing_layers:
            shapes.pop(f"{p}.v_proj.weight")
        if layer in self.reusing_layers:
            shapes.pop(f"{p}.k_proj.weight")
            shapes.pop(f"{p}.k_norm.weight")
        return shapes

    def passthrough_names(self, names) -> list[str]:
        """The k / v projections and k norms a checkpoint may hold for the layers that reuse another's keys and
        values (transformers ignores them on load, as megatron has no place for them): carried unchanged."""
        found = (_UNUSED_KV.search(n) for n in names)
        return [m.string for m in found if m and int(m.group(1)) in self.reusing_layers]

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_hf_shapes()
        return {**shapes, **per_layer.shapes(self.hf_config)} if self.per_layer_size else shapes
