"""What the bridges with Mamba2 layers share (Granite 4.0 H, Bamba, Nemotron-H, Falcon-H1, Mamba2): which layers are
Mamba2, the self-attention slot's class, the parallel layouts they can run, and the tensor table of a Mamba2 layer.

Choices:
- A layer is Mamba2 where transformers' ``layer_types`` says ``linear_attention`` (``mamba`` in Granite's raw
  config); it runs our ``Mamba2Mixer`` (``mamba2.py``) in megatron's self-attention slot
  (``mamba2.hybrid_mamba_attention``), the other layers megatron's ``SelfAttention``.
- A bridge declares the mixer's sizes (``mamba_dims``: each model names them differently), where the mixer's and its
  pre-norm's tensors sit (``mamba_layer`` / ``mamba_module`` / ``mamba_norm``; ``mamba_slot``: the mixer's megatron
  module, the self-attention slot itself but for Falcon-H1's, beside the attention) and the config fields its
  refusals name (``mamba_fields``).
- Tensors: ``in_proj`` = this rank's rows of each of transformers' ``in_proj`` blocks (z, x, B, C, dt; B / C a replica
  of its group's where TP exceeds the groups, exported from the group's first rank) through
  ``gated_mappings.HeadSections``; ``conv_weight`` / ``conv_bias`` = ``conv1d``'s x, B, C channels likewise;
  ``A_log``, ``D``, ``dt_bias`` and the gated norm's weight (where the mixer has the norm: ``rms_norm`` in
  ``mamba_dims``, on unless it says off) split with the heads; ``out_proj`` row-parallel.
- ``BackboneEnds``: the embedding, final norm and LM head under ``backbone.*`` (Mamba2, Mamba, Nemotron-H).
- Refused before any collective (``check_mamba_layout``): heads that do not split over TP, groups that neither split
  over TP nor divide it; the static cache (``generation_refusal``: its fixed-shape decode step keeps no Mamba2 state).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.gated_mappings import HeadSections
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel, VocabParallel

MAMBA = ("linear_attention", "mamba")
S = f"{D}.self_attention"


class Mamba2Layers:
    """Mixin for a bridge whose ``layer_types`` holds Mamba2 layers (see the module docstring)."""

    mamba_layer: str = L                       # an HF layer's prefix
    mamba_module: str = "mamba"                # the mixer's module in it
    mamba_norm: str = "input_layernorm"        # its pre-norm
    mamba_slot: str = S                        # the mixer's megatron module
    mamba_fields: tuple[str, str] = ("mamba_n_heads", "mamba_n_groups")  # the heads' and groups' config fields

    def mamba_dims(self) -> dict:
        """``heads``, ``head_dim``, ``groups``, ``d_state``, ``conv_kernel``, ``conv_bias``, ``chunk_size``,
        ``time_step_limit``, ``eps`` of the model's Mamba2 mixers (and ``Mamba2Mixer``'s options where a model sets
        them: Falcon-H1's)."""
        raise NotImplementedError

    @property
    def mamba_layers(self) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(self.hf_config.layer_types) if kind in MAMBA)

    def check_mamba_dims(self) -> None:
        d, (heads, groups) = self.mamba_dims(), self.mamba_fields
        if d["heads"] % d["groups"]:
            raise C.UnsupportedConfigError(f"{groups}={d['groups']} does not divide {heads}={d['heads']} for "
                                           f"{self.architectures[0]}.")

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` for a parallel layout the Mamba2 layers cannot run (pure: called before any
        collective, every rank raises alike)."""
        if not self.mamba_layers:
            return
        d, (heads, groups), arch = self.mamba_dims(), self.mamba_fields, self.architectures[0]
        tp = layout.tensor_parallel_size
        if d["heads"] % tp:
            raise C.UnsupportedConfigError(f"{heads}={d['heads']} does not split over tensor_parallel_size={tp} "
                                           f"for {arch} (Mamba2 layers split by heads).")
        if d["groups"] % tp and tp % d["groups"]:
            raise C.UnsupportedConfigError(f"{groups}={d['groups']} does not split over tensor_parallel_size={tp} "
                                           f"for {arch} (Mamba2 layers split the groups, or replicate each on "
                                           "tp / groups ranks: one a divisor of the other).")

    def generation_refusal(self, generation_config) -> str | None:
        if generation_config.use_cache and generation_config.cache_implementation == "static" and self.mamba_layers:
            return (f"cache_implementation='static' is not supported for {self.architectures[0]}: the static cache's "
                    "fixed-shape decode step keeps no Mamba2 conv / SSM state; use the default dynamic cache.")
        return None

    def attention_module(self) -> type:
        from loongforge_hf.bridges.mamba2 import hybrid_mamba_attention

        return hybrid_mamba_attention(mamba=self.mamba_layers, **self.mamba_dims())

    # ---- tensors --------------------------------------------------------------------------------------------
    def _mamba_sizes(self) -> tuple[int, int, int]:
        d = self.mamba_dims()
        return d["heads"] * d["head_dim"], d["groups"] * d["d_state"], d["heads"]

    def mamba_mappings(self) -> list[Mapping]:
        """The pre-norm (megatron's input norm) and the mixer of a Mamba2 layer."""
        inner, gn, heads = self._mamba_sizes()
        gn = (gn, self.mamba_dims()["groups"])  # NOTE: B / C: replicated where TP exceeds the groups
        m, s, dims = f"{self.mamba_layer}.{self.mamba_module}", self.mamba_slot, self.mamba_dims()
        maps = [Replicated(f"{D}.input_layernorm.weight", f"{self.mamba_layer}.{self.mamba_norm}.weight"),
                HeadSections(f"{s}.in_proj.weight", ((f"{m}.in_proj.weight", (inner, inner, gn, gn, heads)),)),
                HeadSections(f"{s}.conv_weight", ((f"{m}.conv1d.weight", (inner, gn, gn)),)),
                *(ColumnParallel(f"{s}.{name}", f"{m}.{name}") for name in ("A_log", "D", "dt_bias")),
                *([ColumnParallel(f"{s}.norm_weight", f"{m}.norm.weight")] if dims.get("rms_norm", True) else []),
                RowParallel(f"{s}.out_proj.weight", f"{m}.out_proj.weight")]
        if dims["conv_bias"]:
            maps.append(HeadSections(f"{s}.conv_bias", ((f"{m}.conv1d.bias", (inner, gn, gn)),)))
        return maps

    def mamba_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """The HF shapes of a Mamba2 layer's pre-norm and mixer (``prefix``: the layer's)."""
        d, p = self.mamba_dims(), f"{prefix}.{self.mamba_module}"
        inner, gn, heads = self._mamba_sizes()
        h, conv = self.hf_config.hidden_size, inner + 2 * gn
        shapes = {f"{prefix}.{self.mamba_norm}.weight": (h,), f"{p}.in_proj.weight": (inner + conv + heads, h),
                  f"{p}.conv1d.weight": (conv, 1, d["conv_kernel"]), f"{p}.A_log": (heads,), f"{p}.D": (heads,),
                  f"{p}.dt_bias": (heads,), f"{p}.out_proj.weight": (h, inner)}
        if d.get("rms_norm", True):
            shapes[f"{p}.norm.weight"] = (inner,)
        if d["conv_bias"]:
            shapes[f"{p}.conv1d.bias"] = (conv,)
        return shapes


def mamba_dims_of(c) -> dict:
    """``Mamba2Layers.mamba_dims`` from the ``mamba_*`` fields of Granite 4.0 H's and Bamba's configs."""
    limit = tuple(c.time_step_limit) if c.time_step_limit is not None else (0.0, float("inf"))
    return dict(heads=c.mamba_n_heads, head_dim=c.mamba_d_head, groups=c.mamba_n_groups, d_state=c.mamba_d_state,
                conv_kernel=c.mamba_d_conv, conv_bias=bool(c.mamba_conv_bias), chunk_size=c.mamba_chunk_size,
                time_step_limit=limit, eps=c.rms_norm_eps)


class BackboneEnds:
    """The embedding, final norm and LM head under transformers' ``backbone.*`` names (Mamba2, Mamba, Nemotron-H)."""

    def embedding_mapping(self) -> Mapping:
        return VocabParallel("embedding.word_embeddings.weight", "backbone.embeddings.weight")

    def final_mappings(self) -> list[Mapping]:
        maps: list[Mapping] = [Replicated("decoder.final_layernorm.weight", "backbone.norm_f.weight")]
        if not self.tied:
            maps.append(VocabParallel("output_layer.weight", "lm_head.weight"))
        return maps
