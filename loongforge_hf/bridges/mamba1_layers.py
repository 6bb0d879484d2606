"""What the bridges with Mamba-1 layers share (Mamba, Falcon-Mamba, Jamba): the self-attention slot's class, the
parallel layouts they can run, and the tensor table of a Mamba-1 layer.

Choices:
- A layer is Mamba-1 where transformers' ``layer_types`` says ``linear_attention``; it runs our ``MambaMixer``
  (``mamba1.py``) in megatron's self-attention slot (``mamba1.mamba_attention``), the other layers megatron's
  ``SelfAttention``.
- A bridge declares the mixer's sizes (``mamba_dims``: ``d_inner``, ``d_state``, ``dt_rank``, ``conv_kernel``,
  ``conv_bias``, ``rms_eps`` / ``norm_weights`` for the dt / B / C norms), where the mixer's and its pre-norm's
  tensors sit (``mamba_layer`` / ``mamba_module`` / ``mamba_norm``) and the config field that sizes ``d_inner``
  (``mamba_inner_field``, named by the refusals).
- Tensors: ``in_proj`` = this rank's rows of x and of z (``gated_mappings.HeadSections``); ``conv1d``, ``dt_proj``
  (weight and bias), ``A_log``, ``D`` split by channel (column-parallel); ``x_proj`` by its columns (row-parallel:
  the partial products summed over TP); ``out_proj`` row-parallel; Jamba's dt / B / C norm weights replicated.
- Refused before any collective (``check_layout``): ``d_inner`` that does not split over TP; the static cache
  (``generation_refusal``). Context parallelism runs (``mamba1.py``: the states passed between the CP chunks).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gated_mappings import HeadSections
from loongforge_hf.bridges.mamba2_layers import S, Mamba2Layers
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel


class Mamba1Layers(Mamba2Layers):
    """Mixin for a bridge whose ``layer_types`` holds Mamba-1 layers (see the module docstring)."""

    mamba_inner_field: str = "intermediate_size"  # the config field that sizes d_inner

    @property
    def lora_own_weights(self) -> dict[str, str]:
        """The mixer's own weights LoRA adapts (``lora/own_weights.py``): ``x_proj``, split by its columns."""
        from loongforge_hf.bridges.mamba1 import MambaMixer

        return MambaMixer.lora_own_weights

    @property
    def arch_name(self) -> str:
        """The checkpoint's architecture (Falcon-Mamba's, not the first its bridge registers), for messages."""
        return (getattr(self.hf_config, "architectures", None) or self.architectures)[0]

    def check_mamba_dims(self) -> None:
        return None

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` for a parallel layout the Mamba layers cannot run (pure, before any
        collective)."""
        if not self.mamba_layers:
            return
        d, tp, arch = self.mamba_dims()["d_inner"], layout.tensor_parallel_size, self.arch_name
        if d % tp:
            raise C.UnsupportedConfigError(f"{self.mamba_inner_field} (d_inner={d}) does not split over "
                                           f"tensor_parallel_size={tp} for {arch} (Mamba layers split their "
                                           "channels).")

    def generation_refusal(self, generation_config) -> str | None:
        if generation_config.use_cache and generation_config.cache_implementation == "static" and self.mamba_layers:
            return (f"cache_implementation='static' is not supported for {self.arch_name}: the static cache's "
                    "fixed-shape decode step keeps no Mamba conv / SSM state; use the default dynamic cache.")
        return None

    def attention_module(self) -> type:
        from loongforge_hf.bridges.mamba1 import mamba_attention

        return mamba_attention(layers=self.mamba_layers, **self.mamba_dims())

    # ---- tensors --------------------------------------------------------------------------------------------
    def mamba_mappings(self) -> list[Mapping]:
        """The pre-norm (megatron's input norm) and the mixer of a Mamba-1 layer."""
        d, dims = self.mamba_dims()["d_inner"], self.mamba_dims()
        m, norm = f"{self.mamba_layer}.{self.mamba_module}", f"{self.mamba_layer}.{self.mamba_norm}.weight"
        maps = [Replicated("decoder.layers.{layer}.input_layernorm.weight", norm),
                HeadSections(f"{S}.in_proj.weight", ((f"{m}.in_proj.weight", (d, d)),)),
                ColumnParallel(f"{S}.conv_weight", f"{m}.conv1d.weight"),
                RowParallel(f"{S}.x_proj_weight", f"{m}.x_proj.weight"),
                ColumnParallel(f"{S}.dt_proj_weight", f"{m}.dt_proj.weight"),
                ColumnParallel(f"{S}.dt_proj_bias", f"{m}.dt_proj.bias"),
                ColumnParallel(f"{S}.A_log", f"{m}.A_log"), ColumnParallel(f"{S}.D", f"{m}.D"),
                RowParallel(f"{S}.out_proj.weight", f"{m}.out_proj.weight")]
        if dims["conv_bias"]:
            maps.append(ColumnParallel(f"{S}.conv_bias", f"{m}.conv1d.bias"))
        if dims.get("norm_weights"):
            maps += [Replicated(f"{S}.{k}_norm_weight", f"{m}.{k}_layernorm.weight") for k in ("dt", "b", "c")]
        return maps

    def mamba_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """The HF shapes of a Mamba-1 layer's pre-norm and mixer (``prefix``: the layer's)."""
        dims, p = self.mamba_dims(), f"{prefix}.{self.mamba_module}"
        h, d, n, r = self.hf_config.hidden_size, dims["d_inner"], dims["d_state"], dims["dt_rank"]
        shapes = {f"{prefix}.{self.mamba_norm}.weight": (h,), f"{p}.in_proj.weight": (2 * d, h),
                  f"{p}.conv1d.weight": (d, 1, dims["conv_kernel"]), f"{p}.x_proj.weight": (r + 2 * n, d),
                  f"{p}.dt_proj.weight": (d, r), f"{p}.dt_proj.bias": (d,), f"{p}.A_log": (d, n), f"{p}.D": (d,),
                  f"{p}.out_proj.weight": (h, d)}
        if dims["conv_bias"]:
            shapes[f"{p}.conv1d.bias"] = (d,)
        if dims.get("norm_weights"):
            shapes.update({f"{p}.dt_layernorm.weight": (r,), f"{p}.b_layernorm.weight": (n,),
                           f"{p}.c_layernorm.weight": (n,)})
        return shapes
