"""Mamba2ForCausalLM (state-spaces' Mamba-2, Mistral's Mamba-Codestral): a pure stack of Mamba2 blocks, each an RMS
pre-norm, the Mamba2 mixer and the residual add, then ``backbone.norm_f`` and the LM head.

Choices:
- Each block is one megatron ``TransformerLayer`` with its MLP's slots empty (Nemotron-H's layer class,
  ``nemotron_h.nemotron_h_layer``, every layer a Mamba2 one) and our ``Mamba2Mixer`` in the self-attention slot
  (``mamba2_layers.py``, as Granite 4.0 H's / Bamba's / Nemotron-H's: TP by heads and groups, B / C replicated
  where TP exceeds ``n_groups``, padding, packed documents, cached generate, context parallelism). transformers'
  ``MambaRMSNormGated`` is Granite's gated norm (gate first, per group of ``d_inner / n_groups``, fp32) and its
  mixer zeroes padded tokens before ``in_proj`` (no bias: the same as after it).
- megatron's config and the loader want attention sizes the model has not: the bridge's ``hf_config`` is a copy of
  the model's with ``num_heads`` as ``num_attention_heads`` / ``num_key_value_heads`` and a ``max_position_embeddings``
  (``attention_sizes``; no attention module is built, nothing reads positions; ``kv_channels`` 1); the model's own
  config, which ``save_pretrained`` writes, is left as loaded. ``ffn_hidden_size`` is ``hidden_size`` (no MLP).
- ``residual_in_fp32``: transformers adds the residual in fp32 (from the second block on the stream stays fp32);
  ours keeps the model's dtype: the same in fp32, not bit for bit in bf16.
- Refused before any collective: ``use_bias`` (``in_proj`` / ``out_proj`` biases), ``hidden_act`` other than silu,
  ``num_heads * head_dim`` other than ``expand * hidden_size``, and what ``mamba2_layers.py`` refuses (heads or
  groups that do not split over TP, the static cache).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.mamba2_layers import MAMBA, BackboneEnds, Mamba2Layers
from loongforge_hf.bridges.mappings import Mapping
from loongforge_hf.bridges.registry import register_bridge

B = "backbone.layers.{layer}"
FIELDS = (C.Field("num_hidden_layers", "num_layers"), C.Field("hidden_size", "hidden_size"),
          C.Field("num_attention_heads", "num_attention_heads"), C.Field("layer_norm_epsilon", "layernorm_epsilon"),
          C.Field("initializer_range", "init_method_std"))


@register_bridge("Mamba2ForCausalLM")
class Mamba2Bridge(BackboneEnds, Mamba2Layers, DenseBridge):
    per_layer_types = True  # NOTE: every layer a Mamba2 one (transformers' layer_types)
    position_embedding_type = "none"
    config_fields = FIELDS
    mamba_layer, mamba_module, mamba_norm = B, "mixer", "norm"
    mamba_fields = ("num_heads", "n_groups")

    def __init__(self, hf_config) -> None:
        super().__init__(attention_sizes(hf_config, heads=hf_config.num_heads))

    @property
    def layout_heads(self) -> int:
        """The heads the loader's layout check splits over TP (the config has no ``num_attention_heads``)."""
        return self.hf_config.num_heads

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        C.refuse_set_fields(c, arch, (("use_bias", "biases of the Mamba2 in_proj / out_proj"),))
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only 'silu': "
                                           "the Mamba2 conv and gated norm use it).")
        if c.num_heads * c.head_dim != int(c.expand * c.hidden_size):
            raise C.UnsupportedConfigError(f"num_heads={c.num_heads} * head_dim={c.head_dim} is not "
                                           f"expand * hidden_size for {arch}.")
        self.check_mamba_dims()

    def rope_parameters(self) -> dict:
        return {"rope_type": "default", "rope_theta": 10000.0}  # NOTE: unused: no attention, no rotary

    def qk_module(self) -> None:
        return None

    def transformer_config_kwargs(self) -> dict:
        c = self.hf_config
        kw = C.hf_to_megatron(c, self.config_fields)
        return {**kw, "num_query_groups": c.num_attention_heads, "kv_channels": 1, "ffn_hidden_size": c.hidden_size,
                "normalization": "RMSNorm", "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0}

    def mamba_dims(self) -> dict:
        c = self.hf_config
        return dict(heads=c.num_heads, head_dim=c.head_dim, groups=c.n_groups, d_state=c.state_size,
                    conv_kernel=c.conv_kernel, conv_bias=bool(c.use_conv_bias), chunk_size=c.chunk_size,
                    time_step_limit=tuple(c.time_step_limit), eps=c.layer_norm_epsilon)

    def layer_module(self) -> type:
        from loongforge_hf.bridges.nemotron_h import nemotron_h_layer

        return nemotron_h_layer((MAMBA[0],) * self.hf_config.num_hidden_layers)

    # ---- tensors --------------------------------------------------------------------------------------------
    def layer_mappings(self) -> list[Mapping]:
        return self.mamba_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        return self.mamba_mappings()

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        return self.mamba_shapes(B.format(layer=layer))

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h = c.hidden_size
        shapes = {"backbone.embeddings.weight": (c.vocab_size, h), "backbone.norm_f.weight": (h,)}
        if not self.tied:
            shapes["lm_head.weight"] = (c.vocab_size, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes


def attention_sizes(hf_config, *, heads: int):
    """A copy of an attention-free ``hf_config`` with the sizes megatron's config, the loader and the "auto" layout
    read: ``num_attention_heads`` / ``num_key_value_heads`` = ``heads`` (the mixers'), ``max_position_embeddings``,
    ``intermediate_size`` (Mamba2's config has none; Mamba's keeps its ``d_inner``)."""
    import copy

    view = copy.deepcopy(hf_config)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", heads),
                        ("max_position_embeddings", 2048), ("intermediate_size", hf_config.hidden_size)):
        if getattr(view, name, None) is None:
            setattr(view, name, value)
    return view
