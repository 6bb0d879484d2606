"""Gemma3nForCausalLM (``gemma3n_text``: Gemma 3n's text decoder): Gemma 4 E2B / E4B's attention, per-layer inputs
and KV sharing, inside Gemma 3n's layer (AltUp streams, LAuReL, activation sparsity: ``gemma3n_layer.py``).

Choices:
- What Gemma 4 already has is Gemma 4's (``gemma4.Gemma4Bridge``, this bridge's base): norms that store their weight,
  q / k norms and an unweighted v norm, unscaled scores (``softmax_scale=1``), sliding / full layers each with its
  default rope (``rope_parameters`` per layer type), the scaled embedding, ``final_logit_softcapping``, the last
  ``num_kv_shared_layers`` layers reusing the keys and values of the last earlier layer of their type
  (``gemma4_attention.py``), and the per-layer input stream (``gemma4_per_layer.PerLayerInputs``: the table, the
  projection, its norm; ids outside ``[0, vocab_size_per_layer_input)`` looked up as 0, as transformers does). No
  ``layer_scalar``, no per-layer heads, no values from keys.
- The layer is ``gemma3n_layer.Gemma3nLayer`` in megatron's layer slot (its attention and MLP megatron's, built from
  the spec); the residual is ``altup_num_inputs`` streams side by side. ``intermediate_size`` may differ per layer.
- Pipeline parallelism (virtual stages too): a stage boundary carries the AltUp streams and every layer's per-layer
  input (``pipeline_hidden_size``: ``altup_num_inputs * hidden_size + num_hidden_layers *
  hidden_size_per_layer_input``, ``gemma3n_layer.add_streams``). The per-layer inputs are made once, on the first
  stage, and carried rather than recomputed on each stage from the ids: they read the scaled token embedding, which
  only the first stage holds, and their table, projection and norm then live on one stage (their gradients come
  back through megatron's schedule). The keys and values a layer reuses are not carried: the split keeps each
  reusing layer on the stage of the layer storing its pair, megatron's where it does, else the most even one that
  does (``gemma4_small.SmallModelFields.stage_split_problem``, Gemma 4's; ``stage_boundary.pipeline_split``);
  gemma-3n-E4B (35 layers, 15 reusing layers 18 / 19's) splits 18 / 17 at PP2, 6 / 6 / 6 / 17 at PP4.
- Context parallelism: each rank's per-layer stream and AltUp streams are its own tokens', a reusing layer takes the
  storing layer's keys and values of the rank's tokens, which our core attention gathers over the CP group again.
- Refused by name: activation recompute (the per-layer stream and the shared keys and values pass beside megatron's
  layer arguments).
- LoRA on the attention (q / k / v, q alone in the layers reusing keys and values; o), the MLP and each layer's
  AltUp / LAuReL / per-layer linears (torch linears replicated over TP on each rank's tokens, ``lora/replicated.py``:
  the bridge's ``lora_replicated_linears``); not AltUp's ``correction_coefs`` (transformers applies its weight itself
  in training, so PEFT's adapter acts in eval only: refused by name) nor the model's stream projections outside the
  layers (``altup_projections``, ``altup_unembed_projections``, ``per_layer_model_projection``).
- ``Gemma3nForConditionalGeneration`` (the hub's checkpoints: text, vision and audio) is refused by name.
- Refused by name, before any collective: attention biases, bidirectional attention, rope types other than default,
  ``altup_active_idx`` outside the streams, ``hidden_size_per_layer_input`` < 1, ``num_kv_shared_layers`` leaving no
  layer to compute keys and values, KV heads that do not split over TP, a pipeline size no split of which keeps
  the shared pairs together, virtual stages (split evenly) that part them, a user's ``megatron_config``
  ``num_layers_in_first/last_pipeline_stage`` that part them.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges import gemma4_per_layer as per_layer
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.gemma import _SandwichNorms, scale_gemma_embedding
from loongforge_hf.bridges.gemma3n_layer import gemma3n_layer, sparse_mlp
from loongforge_hf.bridges.gemma3n_streams import add_streams, boundary_width
from loongforge_hf.bridges.gemma4 import Gemma4Bridge
from loongforge_hf.bridges.gemma4_attention import PerTypeQKV, share_keys_and_values
from loongforge_hf.bridges.layer_outputs import softcap_logits
from loongforge_hf.bridges.layer_types import LAYER_TYPES, layer_windows
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.registry import refuse_architectures, register_bridge, register_model_type

ARCH = "Gemma3nForCausalLM"
refuse_architectures("Gemma 3n's image-text-audio model (its MobileNet-V5 vision tower, audio conformer and "
                     "multimodal embedders) has no bridge; its text decoder has one: Gemma3nForCausalLM (a text-only "
                     "checkpoint, model_type 'gemma3n_text')", "Gemma3nForConditionalGeneration")
ALTUP = ("correct_output_scale", "correction_coefs.weight", "prediction_coefs.weight", "modality_router.weight",
         "router_norm.weight")
LAUREL = ("linear_left.weight", "linear_right.weight", "post_laurel_norm.weight")


def _refuse_recompute(decoder, args) -> None:
    if decoder.training and decoder.config.recompute_granularity is not None:
        raise ValueError(f"activation checkpointing (recompute) is not supported for {ARCH}: the per-layer stream "
                         "and the shared keys and values pass beside megatron's layer arguments.")


@register_model_type("gemma3n_text")
@register_bridge(ARCH)
class Gemma3nBridge(Gemma4Bridge):
    default_rope_only = True

    def check_config(self) -> None:
        c = self.hf_config
        if c.attention_bias:
            raise C.UnsupportedConfigError(f"attention_bias={c.attention_bias} is not supported for {ARCH}.")
        if getattr(c, "use_bidirectional_attention", False):
            raise C.UnsupportedConfigError(f"use_bidirectional_attention={c.use_bidirectional_attention} is not "
                                           f"supported for {ARCH} (causal attention only).")
        C._act_to_megatron(c.hidden_activation)
        if not 0 <= c.altup_active_idx < c.altup_num_inputs:
            raise C.UnsupportedConfigError(f"altup_active_idx={c.altup_active_idx} is not one of the "
                                           f"altup_num_inputs={c.altup_num_inputs} streams.")
        self.per_layer_size = int(c.hidden_size_per_layer_input or 0)
        if self.per_layer_size < 1:
            raise C.UnsupportedConfigError(f"hidden_size_per_layer_input={c.hidden_size_per_layer_input} is not "
                                           f"supported for {ARCH} (at least 1).")
        self.check_kv_sharing()
        self.wide_layers = frozenset()
        self.check_layer_types()
        self.heads = {kind: (C.head_dim_of(c), C.kv_heads_of(c)) for kind in LAYER_TYPES}
        self.full_layers = frozenset(i for i, kind in enumerate(c.layer_types) if kind == "full_attention")
        self.full_heads, self.values_from_keys = None, False

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` for a layout Gemma 3n's layers cannot run (pure, before any collective)."""
        self.check_stage_split(layout)
        kv, tp = C.kv_heads_of(self.hf_config), layout.tensor_parallel_size
        if kv % tp:
            raise C.UnsupportedConfigError(f"num_key_value_heads={kv} does not split over tensor_parallel_size={tp} "
                                           f"for {ARCH} (replicated KV heads are not supported there).")

    def pipeline_hidden_size(self) -> int:
        """What a pipeline stage sends per token: the AltUp streams and the per-layer inputs (builder.py)."""
        return boundary_width(self.hf_config)

    @property
    def small_model_features(self) -> list[str]:
        return [f"hidden_size_per_layer_input={self.per_layer_size}"]

    def transformer_config_kwargs(self) -> dict:
        c = self.hf_config  # NOTE: _SandwichNorms' with intermediate_size per layer (the first here: Gemma3nLayer)
        kw = C.hf_to_megatron(c, tuple(f for f in C.DENSE_FIELDS if f.hf not in ("hidden_act", "intermediate_size")))
        kw.update(ffn_hidden_size=c.intermediate_size[0], activation_func=C._act_to_megatron(c.hidden_activation),
                  normalization="RMSNorm", layernorm_zero_centered_gamma=False, gated_linear_unit=True,
                  add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, hidden_dropout=0.0,
                  softmax_scale=1.0, **layer_windows(c))
        # NOTE: no experts; megatron refuses its default dispatcher with the variable_seq_lengths a pipeline needs here
        kw.update(moe_token_dispatcher_type="alltoall")
        return kw

    def mlp_module(self) -> type | None:
        return sparse_mlp(self.hf_config.hidden_activation)

    def layer_module(self) -> type | None:
        return gemma3n_layer(self.hf_config)

    def finish_model(self, model) -> None:
        c = self.hf_config
        scale_gemma_embedding(model, c.hidden_size)
        self.set_rotary_tables(model)
        model.decoder.register_forward_pre_hook(_refuse_recompute)
        add_streams(model, c)
        if self.kv_modes:
            share_keys_and_values(model, self.kv_modes, c.layer_types)
        if c.final_logit_softcapping is not None:
            softcap_logits(model, c.final_logit_softcapping)

    # ---- tensors --------------------------------------------------------------------------------------------
    def first_stage_mappings(self) -> list[Mapping]:
        return [*per_layer.first_stage_mappings(self.hf_config),
                *(Replicated(f"altup_streams.projections.{i}.weight", f"model.altup_projections.{i}.weight")
                  for i in range(self.hf_config.altup_num_inputs - 1))]

    def final_mappings(self) -> list[Mapping]:
        norm, *rest = _SandwichNorms.final_mappings(self)
        return [Replicated("decoder.final_layernorm.norm.weight", norm.hf), *rest,
                *(Replicated(f"decoder.final_layernorm.unembed_projections.{i}.weight",
                             f"model.altup_unembed_projections.{i}.weight")
                  for i in range(self.hf_config.altup_num_inputs - 1))]

    def attention_mappings(self) -> list[Mapping]:
        own = [*(Replicated(f"{D}.altup.{n}", f"{L}.altup.{n}") for n in ALTUP),
               *(Replicated(f"{D}.laurel.{n}", f"{L}.laurel.{n}") for n in LAUREL), *per_layer.layer_mappings()]
        maps = _SandwichNorms.attention_mappings(self)
        if not self.reusing_layers:
            return [*own, *maps]
        qkv = PerTypeQKV(f"{D}.self_attention.linear_qkv.weight", q=f"{L}.self_attn.q_proj.weight",
                         k=f"{L}.self_attn.k_proj.weight", v=f"{L}.self_attn.v_proj.weight",
                         reusing_layers=self.reusing_layers)
        return [*own, *(qkv if m.megatron == qkv.megatron else m for m in maps)]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return _SandwichNorms.attention_shapes(self, prefix)

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"model.layers.{layer}"
        h, f, n, r = c.hidden_size, c.intermediate_size[layer], c.altup_num_inputs, c.laurel_rank
        shapes = {**self.attention_shapes(p), f"{p}.post_attention_layernorm.weight": (h,),
                  f"{p}.pre_feedforward_layernorm.weight": (h,), f"{p}.post_feedforward_layernorm.weight": (h,),
                  f"{p}.mlp.gate_proj.weight": (f, h), f"{p}.mlp.up_proj.weight": (f, h),
                  f"{p}.mlp.down_proj.weight": (h, f), f"{p}.altup.correct_output_scale": (h,),
                  f"{p}.altup.correction_coefs.weight": (n, n), f"{p}.altup.prediction_coefs.weight": (n * n, n),
                  f"{p}.altup.modality_router.weight": (n, h), f"{p}.altup.router_norm.weight": (h,),
                  f"{p}.laurel.linear_left.weight": (r, h), f"{p}.laurel.linear_right.weight": (h, r),
                  f"{p}.laurel.post_laurel_norm.weight": (h,)}
        if layer in self.reusing_layers:
            for name in ("k_proj", "v_proj", "k_norm"):
                shapes.pop(f"{p}.self_attn.{name}.weight")
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        shapes = {**_SandwichNorms.expected_hf_shapes(self), **per_layer.shapes(c)}
        for i in range(c.altup_num_inputs - 1):
            shapes.update({f"model.altup_projections.{i}.weight": (c.hidden_size, c.hidden_size),
                           f"model.altup_unembed_projections.{i}.weight": (c.hidden_size, c.hidden_size)})
        return shapes
