"""Gemma 4 E2B / E4B's config fields on ``gemma4.Gemma4Bridge`` (Gemma 3n's bridge inherits them): per-layer inputs,
KV sharing and double-wide MLPs read and checked, the layouts they allow.

Choices:
- ``hidden_size_per_layer_input`` and ``num_kv_shared_layers`` with the MoE block are refused by name (no such Gemma 4
  is published); ``num_kv_shared_layers`` must leave a layer of each shared type computing keys and values.
- Pipelines: a stage boundary carries every layer's per-layer input beside the hidden states
  (``pipeline_hidden_size``; ``gemma4_per_layer.carry_per_layer_inputs``), which megatron sends with
  ``variable_seq_lengths`` (``stage_boundary.py``); megatron refuses its default MoE dispatcher with that even
  without experts, so the config names ``alltoall``. The keys and values a reusing layer takes are not carried, so
  the bridge declares which splits part them (``stage_split_problem``): where megatron's default split does, the
  most even one that keeps every reusing layer on the stage of the layer storing its pair is built instead
  (``stage_boundary.pipeline_split``, through ``num_layers_in_first/last_pipeline_stage``; a user's own two fields
  in ``megatron_config`` are taken, checked alike). Refused by name (``check_stage_split``): a pipeline size no
  split of which keeps them together, and virtual stages (split evenly) that part them.
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

    def stage_split_problem(self, ranges: list[range]) -> str | None:
        """Why pipeline stages ``ranges`` do not work (``stage_boundary.pipeline_split``): layers reusing keys and
        values on another stage than the layer storing them (not carried across stages); None where they work."""
        c = self.hf_config
        if not self.reusing_layers or len(ranges) < 2:
            return None
        store = {c.layer_types[i]: i for i, mode in enumerate(self.kv_modes) if mode == "store"}
        stage_of = {i: k for k, stage in enumerate(ranges) for i in stage}
        apart = sorted(i for i in self.reusing_layers if stage_of[i] != stage_of[store[c.layer_types[i]]])
        if not apart:
            return None
        sources = sorted({store[c.layer_types[i]] for i in apart})
        return (f"layers {apart} reuse the keys and values of layers {sources} on another pipeline stage "
                f"(num_kv_shared_layers={c.num_kv_shared_layers}; the shared keys and values do not cross stages)")

    def check_stage_split(self, layout) -> None:
        """``UnsupportedConfigError`` for a pipeline layout no split of which keeps each reusing layer with the layer
        storing its keys and values (``stage_boundary.pipeline_split``, pure)."""
        from loongforge_hf.bridges.stage_boundary import pipeline_split

        if layout.pipeline_parallel_size > 1 and self.reusing_layers:
            pipeline_split(self, layout)

    @property
    def small_model_features(self) -> list[str]:
        """The E2B / E4B fields this config sets (each refuses recompute)."""
        return [f"{name}={getattr(self.hf_config, name)}" for name, on in
                (("hidden_size_per_layer_input", self.per_layer_size), ("num_kv_shared_layers", self.kv_modes))
                if on]


def refuse_recompute(features: list[str], decoder, args) -> None:
    if decoder.training and decoder.config.recompute_granularity is not None:
        raise ValueError(f"activation checkpointing (recompute) is not supported for Gemma 4 with "
                         f"{' and '.join(features)}: the per-layer stream and the shared keys and values pass beside "
                         "megatron's layer arguments, which a recomputed layer would not take gradients through.")
