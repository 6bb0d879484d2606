"""Mappings for a model whose HF layer holds two of megatron's layers (LongCat-Flash's two attention and two MLP
sublayers a layer): megatron layer ``2i + j`` is HF layer ``i``'s sublayer ``j``, named with ``.{j}`` after the module.

Choices:
- ``sublayer(m)`` takes a mapping written for a one-attention, one-MLP layer (``{layer}`` its layer, HF names
  ``self_attn.*``, ``input_layernorm``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``) and gives the same
  mapping class re-classed (``Sublayer<Class>``) so that the layer index it gets is megatron's: its HF names take
  ``{sub}`` = ``layer % 2`` (``self_attn.{sub}.*``, ``mlps.{sub}.*``) and its own methods run with ``layer // 2``.
  Same class underneath, so the loader's and exporter's checks (``Expert``, ``streams_export``) see what they know;
  an expert's inner mapping is re-classed (``bind`` keeps the class through ``dataclasses.replace``). The class
  says which it stands for (``plain_class``): the LoRA planner takes a linear's kind from it.
- ``export_parts`` (streamed export) only where the base class streams, as ``mappings.streams_export`` judges.
"""

from __future__ import annotations

import functools
from dataclasses import fields, replace

from loongforge_hf.bridges.fused_mappings import Expert
from loongforge_hf.bridges.mappings import Mapping

SUB = "{sub}"
# NOTE: HF names of megatron's slots, sublayer {sub} of HF layer {layer} (Sublayer halves megatron's index)
_RENAMES = ((".self_attn.", f".self_attn.{SUB}."), (".input_layernorm.", f".input_layernorm.{SUB}."),
            (".post_attention_layernorm.", f".post_attention_layernorm.{SUB}."),
            *((f".mlp.{p}.", f".mlps.{SUB}.{p}.") for p in ("gate_proj", "up_proj", "down_proj")))


def _hf_fields(m: Mapping, rename) -> dict:
    return {f.name: rename(getattr(m, f.name)) for f in fields(m)
            if f.name != "megatron" and isinstance(getattr(m, f.name), str)}


@functools.cache
def _sublayer_class(base: type) -> type:
    """``base`` whose layer index is megatron's: HF layer ``layer // 2``, ``{sub}`` in its HF names ``layer % 2``."""

    def at(self, layer):
        if layer is None:
            return self, None
        plain = replace(self, **_hf_fields(self, lambda v: v.replace(SUB, str(layer % 2))))
        object.__setattr__(plain, "__class__", base)
        return plain, layer // 2

    def call(name):
        def method(self, *args):
            *rest, layer = args
            m, hf_layer = at(self, layer)
            return getattr(m, name)(*rest, hf_layer)
        return method

    def export_parts(self, shard, rank, ctx, layer):
        m, hf_layer = at(self, layer)
        return m.export_parts(shard, rank, ctx, hf_layer)

    attrs = {n: call(n) for n in ("hf_names", "load", "export", "hf_block", "hf_block_rows")}
    attrs["plain_class"] = base  # NOTE: what the LoRA planner looks a linear's kind up by (lora.plan._LINEAR_KINDS)
    owner = next(c for c in base.__mro__ if "export_parts" in c.__dict__)
    if owner is not Mapping and owner is next(c for c in base.__mro__ if "export" in c.__dict__):
        attrs["export_parts"] = export_parts  # NOTE: streams where the base streams (mappings.streams_export)
    return type(f"Sublayer{base.__name__}", (base,), attrs)


def sublayer(m: Mapping) -> Mapping:
    """``m`` (names of a one-attention, one-MLP layer) as LongCat's: megatron layer ``2i + j`` is HF layer ``i``'s
    sublayer ``j``; an expert's inner mapping likewise."""
    if isinstance(m, Expert):
        return replace(m, inner=sublayer(m.inner))

    def rename(value: str) -> str:
        for old, new in _RENAMES:
            value = value.replace(old, new)
        return value

    out = replace(m, **_hf_fields(m, rename))
    object.__setattr__(out, "__class__", _sublayer_class(type(m)))
    return out
