"""Models whose layers are of two kinds (``layer_types``: full and sliding-window attention), each kind with its own
rope parameters (transformers keeps one dict per kind: Gemma 3, OLMo 3).

Choices:
- The window goes to megatron's ``window_attn_skip_freq`` as a per-layer list, read by our core attention per layer
  (and by the KV cache).
- ``mlp_layer_types`` (EXAONE-MoE, GLM-4.7-Flash, Cohere 2 MoE, MiMo-V2-Flash, Mellum 2, ...): ``dense`` or
  ``sparse`` for every layer, else refused naming the field (``check_mlp_layer_types``).
- Two rotary tables: the model's rotary embedding returns the full layers' and the sliding layers' angles side by
  side on the last axis (``_two_table_rotary``; every slicing of it, by context parallelism or a KV cache, is along
  positions) and each layer's attention keeps its half (``layer_outputs.transformed_attention(sliding_layers=...)``).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from loongforge_hf.bridges import config_map as C

LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_KINDS = ("dense", "sparse")


def check_mlp_layer_types(hf_config) -> None:
    """``UnsupportedConfigError`` unless ``mlp_layer_types`` says ``"dense"`` or ``"sparse"`` for every layer."""
    kinds = list(hf_config.mlp_layer_types or [])
    if len(kinds) != hf_config.num_hidden_layers or set(kinds) - set(MLP_KINDS):
        raise C.UnsupportedConfigError(f"mlp_layer_types={kinds}: expected one of {list(MLP_KINDS)} for each of the "
                                       f"{hf_config.num_hidden_layers} layers.")


@functools.cache
def _two_table_rotary(base: type) -> type:
    class TwoTableRotary(base):
        """megatron's rotary embedding whose angle table is ``[positions, 1, 1, 2 * rotary_dim]``: the full layers'
        angles (``inv_freq``), then the sliding layers' (``local_inv_freq``)."""

        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            full = super().get_emb(max_seq_len, offset)
            inv = self.local_inv_freq.to(full.device)
            positions = torch.arange(max_seq_len, device=full.device, dtype=inv.dtype) + offset
            freqs = torch.outer(positions, inv)
            return torch.cat((full, torch.cat((freqs, freqs), dim=-1)[:, None, None, :]), dim=-1)

    return TwoTableRotary


def check_layer_kinds(hf_config, architecture: str) -> None:
    """``UnsupportedConfigError`` for layer types other than full and sliding-window attention, and for sliding-window
    layers without a window."""
    kinds = getattr(hf_config, "layer_types", None) or []
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise C.UnsupportedConfigError(f"layer_types {unknown} are not supported for {architecture}; supported: "
                                       f"{list(LAYER_TYPES)}.")
    if "sliding_attention" in kinds and not hf_config.sliding_window:
        raise C.UnsupportedConfigError(f"sliding_window={hf_config.sliding_window} with sliding_attention layers.")


def layer_windows(hf_config) -> dict:
    """megatron's window settings for ``hf_config``'s ``layer_types``: the window on the sliding layers only."""
    kinds = list(getattr(hf_config, "layer_types", None) or [])
    if "sliding_attention" not in kinds:
        return {}
    # NOTE: HF lets a query see itself and the window-1 tokens before it; megatron's (left, right) bounds
    return {"window_size": (hf_config.sliding_window - 1, 0),
            "window_attn_skip_freq": [int(kind == "sliding_attention") for kind in kinds]}


class WindowsByLayerType:
    """Mixed in before a bridge whose ``layer_types`` say which layers slide (Ministral, dots.llm1, EXAONE 4): the kinds
    checked, the window on the sliding layers only (none when no layer slides)."""

    supports_sliding_window = True
    per_layer_types = True

    def check_config(self) -> None:
        super().check_config()
        check_layer_kinds(self.hf_config, self.architectures[0])

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.pop("window_size", None)
        return {**kw, **layer_windows(self.hf_config)}


class LayerTypes:
    """Mixed into a dense bridge: the checks, window and rope of a model with per-kind layers."""

    extra_rope_types: tuple[str, ...] = ("linear",)
    per_layer_types = True
    partial_rotary = False  # NOTE: both kinds rotate one partial_rotary_factor of each head (MiMo-V2-Flash)
    default_rope_only = False  # NOTE: both kinds' rope the default one (Laguna, MiMo-V2-Flash, Gemma 3n)

    def check_layer_types(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        check_layer_kinds(c, arch)
        for kind in LAYER_TYPES:
            rope_type = self.rope_for(kind)["rope_type"]
            if self.default_rope_only and rope_type != "default":
                raise C.UnsupportedConfigError(f"rope_parameters[{kind!r}].rope_type={rope_type!r} is not supported "
                                               f"for {arch} (default rope only).")

    def rope_for(self, layer_type: str) -> dict:
        """The rope parameters of ``layer_type``'s layers."""
        params = dict((self.hf_config.rope_parameters or {}).get(layer_type) or {})
        if "rope_theta" not in params:
            raise C.UnsupportedConfigError(f"rope_parameters[{layer_type!r}] has no rope_theta.")
        return C.rope_parameters(SimpleNamespace(rope_parameters=params), partial_rotary=self.partial_rotary,
                                 extra_types=self.extra_rope_types)

    def rope_parameters(self) -> dict:
        return self.rope_for("full_attention")

    @property
    def sliding_layers(self) -> frozenset[int]:
        return frozenset(i for i, t in enumerate(self.hf_config.layer_types) if t == "sliding_attention")

    def set_rotary_tables(self, chunk) -> None:
        """The full and the sliding layers' frequencies in ``chunk``'s rotary embedding (see the docstring)."""
        from loongforge_hf.kernels.rope import rope_inv_freq, set_megatron_inv_freq

        rope = getattr(chunk, "rotary_pos_emb", None)
        if rope is None:
            return
        inv = {kind: rope_inv_freq(C.head_dim_of(self.hf_config), base=self.rope_for(kind)["rope_theta"],
                                   partial_rotary_factor=self.rope_for(kind).get("partial_rotary_factor", 1.0),
                                   rope_scaling=self.rope_for(kind)) for kind in LAYER_TYPES}
        set_megatron_inv_freq(rope, inv["full_attention"])
        rope.__class__ = _two_table_rotary(type(rope))
        rope.local_inv_freq = inv["sliding_attention"]
