"""Gemma 4 E2B / E4B's config fields on ``gemma4.Gemma4Bridge`` (Gemma 3n's bridge inherits them): per-layer inputs,
KV sharing and double-wide MLPs read and checked, the layouts they allow.

Choices:
- ``hidden_size_per_layer_input`` and ``num_kv_shared_layers`` with the MoE block are refused by name (no such Gemma 4
  is published); ``num_kv_shared_layers`` must leave a layer of each shared type computing keys and values.
- Pipelines: a stage boundary carries every layer's per-layer input beside the hidden states
  (``pipeline_hidden_size``; ``gemma4_per_layer.carry_per_layer_inputs``), which megatron sends with
  ``variable_seq_lengths`` (``stage_boundary.py``); megatron refuses its default MoE dispatcher with that even
  without experts, so the config names ``alltoall``. The keys and values a reusing layer takes are not carried: a
  split that puts a reusing layer on another (virtual) stage than the layer storing them is refused by name
  (``check_stage_split``).
- Activation recompute is refused at the forward with either field (``refuse_recompute``: the per-layer stream and
  the shared keys and values pass beside megatron's layer arguments).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C


class SmallModelFields:
    """E2B / E4B's config fields on ``gemma4.Gemma4Bridge``."""

    def check_kv_sharing(self) -> int:
        """``num_kv_shared_layers`` (returned) and ``kv_modes`` / ``reusing_layers`` from it (Gemma 3n's too)."""
        c = self.hf_config
        shared = int(c.num_kv_shared_layers or 0)
        if shared and not 0 < shared < c.num_hidden_layers:
            raise C.UnsupportedConfigError(f"num_kv_shared_layers={shared}: at least one of the "
                                           f"{c.num_hidden_layers} layers must compute keys and values.")
        try:
            self.kv_modes = list(c.kv_sharing_modes) if shared else None
        except ValueError as err:  # NOTE: a shared layer type no earlier layer computes
            raise C.UnsupportedConfigError(f"num_kv_shared_layers={shared}: {err}.") from None
        self.reusing_layers = frozenset(i for i, m in enumerate(self.kv_modes or ()) if m == "reuse")
        return shared

    def check_small_model_fields(self) -> None:
        """E2B / E4B's fields (module docstring): ``per_layer_size``, ``kv_modes`` (None without sharing),
        ``reusing_layers`` and ``wide_layers``; ``UnsupportedConfigError`` naming a field they cannot run with."""
        c = self.hf_config
        # NOTE: Gemma 4 Unified's text config has no per-layer inputs nor MoE block (reading those fields raises)
        self.per_layer_size = int(getattr(c, "hidden_size_per_layer_input", 0) or 0)
        shared = self.check_kv_sharing()
        self.wide_layers = self.reusing_layers if c.use_double_wide_mlp else frozenset()
        if (self.per_layer_size or shared) and getattr(c, "enable_moe_block", False):
            raise C.UnsupportedConfigError("hidden_size_per_layer_input / num_kv_shared_layers with "
                                           "enable_moe_block=True are not supported for Gemma4ForCausalLM (no such "
                                           "Gemma 4 is published).")

    def pipeline_hidden_size(self) -> int:
        """What a pipeline stage sends per token: the hidden states, then every layer's per-layer input."""
        c = self.hf_config
        return c.hidden_size + c.num_hidden_layers * self.per_layer_size

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        if self.per_layer_size:  # NOTE: no experts; megatron refuses its default dispatcher with variable_seq_lengths
            kw.setdefault("moe_token_dispatcher_type", "alltoall")
        return kw

    def check_stage_split(self, layout) -> None:
        """``UnsupportedConfigError`` for a pipeline split that puts a layer reusing keys and values on another
        (virtual) stage than the layer storing them: the shared pair stays within a stage (pure)."""
        from loongforge_hf.bridges.stage_boundary import stage_layer_ranges

        c = self.hf_config
        if layout.pipeline_parallel_size < 2 or not self.reusing_layers:
            return
        store = {c.layer_types[i]: i for i, mode in enumerate(self.kv_modes) if mode == "store"}
        stage_of = {i: k for k, stage in enumerate(stage_layer_ranges(c.num_hidden_layers, layout)) for i in stage}
        if len(stage_of) < c.num_hidden_layers:  # NOTE: virtual stages that do not split the layers (config.py)
            return
        apart = sorted(i for i in self.reusing_layers if stage_of[i] != stage_of[store[c.layer_types[i]]])
        if apart:
            sources = sorted({store[c.layer_types[i]] for i in apart})
            vpp = layout.interleaved_stages
            raise C.UnsupportedConfigError(
                f"pipeline_parallel_size={layout.pipeline_parallel_size}"
                f"{f' with virtual_pipeline_parallel_size={vpp}' if vpp else ''} is not supported for "
                f"{self.architectures[0]}: layers {apart} reuse the keys and values of layers {sources} on another "
                f"pipeline stage (num_kv_shared_layers={c.num_kv_shared_layers}; the shared keys and values do not "
                "cross stages); choose a split that keeps each storing layer with the layers reusing it.")

    @property
    def small_model_features(self) -> list[str]:
        """The E2B / E4B fields this config sets (each refuses CP and recompute)."""
        return [f"{name}={getattr(self.hf_config, name)}" for name, on in
                (("hidden_size_per_layer_input", self.per_layer_size), ("num_kv_shared_layers", self.kv_modes))
                if on]


def refuse_recompute(features: list[str], decoder, args) -> None:
    if decoder.training and decoder.config.recompute_granularity is not None:
        raise ValueError(f"activation checkpointing (recompute) is not supported for Gemma 4 with "
                         f"{' and '.join(features)}: the per-layer stream and the shared keys and values pass beside "
                         "megatron's layer arguments, which a recomputed layer would not take gradients through.")
