"""DogeForCausalLM (SmallDoge's Doge): Llama's layer with per-head q / k RMS norms, dynamic-mask attention (a bias per
KV head and key computed from the values, top-k masking past ``keep_window_size``), learned per-channel scales on
both residuals, and, with ``is_moe``, cross-domain experts (CDMoE: a shared gated MLP plus experts retrieved by
product keys from two embedding tables).

Choices:
- The modules: ``doge_layers.py`` (core attention, CDMoE in the MLP slot, residual scales in the residual-add slots).
  On disk: ``self_attn.A`` ``[kv heads]`` and ``self_attn.dt_proj.weight`` ``[kv heads, kv heads * head_dim]`` (split
  over TP with the KV heads), ``input_residual`` / ``post_attention_residual`` ``[H]``, and for CDMoE
  ``mlp.router_gate.weight`` ``[2 * floor(sqrt(num_experts)), H]``, ``mlp.down_embed.weight`` /
  ``mlp.up_embed.weight`` ``[num_experts, H]`` (replicated) beside the shared ``mlp.gate_proj`` / ``up_proj`` /
  ``down_proj``.
- Layouts: TP (KV heads split over it) with or without sequence parallelism, pipeline (megatron's, as it is), context
  (the attention over every key and CDMoE's routing over the whole batch: ``doge_layers.py``) and data parallelism.
- ``generate`` with transformers' dynamic KV cache: each cached step recomputes the biases from the cached values
  (transformers computes them from its cache's: ``DogeCoreAttention.attend_over_cache``).
- Refused by name before any collective: expert parallelism (CDMoE's experts are replicated embedding rows),
  ``sliding_window`` (not built), ``attention_bias`` / ``mlp_bias``, ``output_router_logits`` (transformers'
  balancing loss over product keys: not built); a KV cache (``use_cache=False`` runs) under context parallelism (the
  top-k over the keys would span the CP ranks' shares of the cache: not built), for CDMoE under sequence parallelism
  (each cached step padded to a multiple of TP would change the routing) and the static cache (its fixed decode
  step has no dynamic mask); rope types other than default / llama3 / yarn / ``dynamic``. The hub's ``dynamic``
  rope is the plain rope up to ``max_position_embeddings`` (transformers rescales it only past there): taken as
  that, longer sequences refused.
- CDMoE routes each token by logits of other tokens of the batch (transformers' view of ``[b, s, 2 * keys]`` as
  ``[2, b * s, keys]``), so the layout's own right-padding of a sequence (to a multiple of TP under sequence
  parallelism, of 2 x CP under context parallelism) would change the routing: with ``is_moe`` such lengths are
  refused (``check_sequence_length``), and packed documents route as transformers does over the packed row.
"""

from __future__ import annotations

import math

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge

ARCH = "DogeForCausalLM"


@register_bridge(ARCH)
class DogeBridge(DenseBridge):
    architectures = (ARCH,)
    qk_norm = True
    # NOTE: the layout's (check_layout), read by check_sequence_length and generation_refusal
    sequence_multiple = step_multiple = context_parallel_size = 1

    @property
    def lora_own_weights(self) -> dict[str, str]:
        """Our core attention's ``dt_proj`` and the retrieval experts' ``router_gate``, which LoRA adapts
        (``lora/own_weights.py``)."""
        from loongforge_hf.bridges.doge_layers import CORE_OWN_WEIGHTS, RETRIEVAL_OWN_WEIGHTS

        return {**CORE_OWN_WEIGHTS, **RETRIEVAL_OWN_WEIGHTS}

    # ---- config ---------------------------------------------------------------------------------------------
    @property
    def keys(self) -> int:
        return math.floor(math.sqrt(self.hf_config.num_experts))

    def check_config(self) -> None:
        c = self.hf_config
        if c.sliding_window is not None:
            raise C.UnsupportedConfigError(f"sliding_window={c.sliding_window} is not supported for {ARCH} (not "
                                           "built beside the dynamic mask).")
        if not isinstance(c.keep_window_size, int) or c.keep_window_size < 1:
            raise C.UnsupportedConfigError(f"keep_window_size={c.keep_window_size!r}: expected a positive integer.")
        if c.is_moe and c.output_router_logits:
            raise C.UnsupportedConfigError(self.router_outputs_refusal)
        if c.is_moe and not 1 <= c.num_experts_per_tok <= self.keys ** 2:
            raise C.UnsupportedConfigError(
                f"num_experts_per_tok={c.num_experts_per_tok}: expected 1 to floor(sqrt(num_experts))^2="
                f"{self.keys ** 2} (num_experts={c.num_experts}).")
        super().check_config()

    @property
    def router_outputs_refusal(self) -> str | None:
        """Why a forward with ``output_router_logits`` (the config's or the keyword) is refused: CDMoE's router
        outputs (None for the dense model, where transformers ignores the switch)."""
        if not self.hf_config.is_moe:
            return None
        return (f"output_router_logits=True is not supported for {ARCH}: transformers' router_logits and balancing "
                "loss over CDMoE's product keys are not built; set it to False.")

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` for a layout not built (pure, before any collective)."""
        if layout.expert_parallel_size > 1:
            raise C.UnsupportedConfigError(f"expert_parallel_size={layout.expert_parallel_size} is not supported for "
                                           f"{ARCH} (CDMoE's retrieval experts are embedding rows, replicated); use "
                                           "tensor, pipeline, context and data parallelism.")
        kv, tp = C.kv_heads_of(self.hf_config), layout.tensor_parallel_size
        if kv % tp:
            raise C.UnsupportedConfigError(f"num_key_value_heads={kv} does not split over tensor_parallel_size={tp} "
                                           f"for {ARCH} (A and dt_proj split with the KV heads).")
        self.sequence_multiple = layout.sequence_multiple
        self.step_multiple = layout.whole_sequence_multiple
        self.context_parallel_size = layout.context_parallel_size

    def rope_parameters(self) -> dict:
        """The config's rope; ``dynamic`` (the hub's: NTK scaling from ``max_position_embeddings`` on) as the plain
        rope it is up to there (longer sequences refused: ``check_sequence_length``)."""
        params = C.rope_parameters(self.hf_config, extra_types=(*self.extra_rope_types, "dynamic"))
        if params["rope_type"] == "dynamic":
            return {"rope_type": "default", "rope_theta": params["rope_theta"]}
        return params

    def check_sequence_length(self, longest: int) -> None:
        """``ValueError`` past the plain part of a ``dynamic`` rope, or where CDMoE's routing would read the layout's
        padding (module docstring)."""
        limit = self.hf_config.max_position_embeddings
        rope = C.rope_parameters(self.hf_config, extra_types=(*self.extra_rope_types, "dynamic"))
        if rope["rope_type"] == "dynamic" and longest > limit:
            raise ValueError(f"{longest} positions: rope_parameters.rope_type='dynamic' rescales the rope past "
                             f"max_position_embeddings={limit} in transformers, which is not implemented for {ARCH}; "
                             f"use sequences of at most {limit} tokens.")
        if self.hf_config.is_moe and longest % self.sequence_multiple:
            raise ValueError(f"{ARCH} with is_moe=True: a sequence of {longest} tokens would be padded to a multiple "
                             f"of {self.sequence_multiple} (sequence / context parallelism), which "
                             "changes CDMoE's routing (it mixes the logits of the whole batch); use lengths that "
                             "divide by it (a collator's pad_to_multiple_of).")

    def generation_refusal(self, generation_config) -> str | None:
        """Why ``generate`` with a KV cache is refused here (module docstring), or None."""
        if not generation_config.use_cache:
            return None
        if generation_config.cache_implementation == "static":
            return (f"cache_implementation='static' is not supported for {ARCH} (the fixed decode step's attention "
                    "has no dynamic mask); use the default dynamic cache.")
        if self.context_parallel_size > 1:
            return (f"a KV cache is not supported for {ARCH} under context_parallel_size="
                    f"{self.context_parallel_size} (the dynamic mask's top-k over the keys would span the CP "
                    "ranks' shares of the cache); pass use_cache=False.")
        if self.hf_config.is_moe and self.step_multiple > 1:
            return (f"a KV cache is not supported for {ARCH} with is_moe=True under sequence parallelism: each cached "
                    f"step is padded to a multiple of {self.step_multiple}, which changes CDMoE's routing (it mixes "
                    "the logits of the whole step); pass use_cache=False or sequence_parallel=False.")
        return None

    def attention_module(self) -> type:
        from loongforge_hf.bridges.doge_layers import doge_attention

        return doge_attention(self.hf_config.keep_window_size)

    def mlp_module(self) -> type | None:
        from loongforge_hf.bridges.doge_layers import cdmoe

        c = self.hf_config
        if not c.is_moe:
            return None
        return cdmoe(experts=c.num_experts, top_k=c.num_experts_per_tok, norm_topk_prob=bool(c.norm_topk_prob),
                     act=c.hidden_act)

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.doge_layers import add_residual_scales

        add_residual_scales(model)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        core, a = f"{D}.self_attention.core_attention", f"{L}.self_attn"
        return super().attention_mappings() + [
            ColumnParallel(f"{core}.A", f"{a}.A"), ColumnParallel(f"{core}.dt_proj", f"{a}.dt_proj.weight"),
            Replicated(f"{D}.residual_scales.input_residual", f"{L}.input_residual"),
            Replicated(f"{D}.residual_scales.post_attention_residual", f"{L}.post_attention_residual")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        maps = super().dense_mlp_mappings()
        if self.hf_config.is_moe:
            maps += [Replicated(f"{D}.mlp.retrieval.{n}", f"{L}.mlp.{n}.weight")
                     for n in ("router_gate", "down_embed", "up_embed")]
        return maps

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        kv, h = C.kv_heads_of(c), c.hidden_size
        return {**super().attention_shapes(prefix), f"{prefix}.self_attn.A": (kv,),
                f"{prefix}.self_attn.dt_proj.weight": (kv, kv * C.head_dim_of(c)),
                f"{prefix}.input_residual": (h,), f"{prefix}.post_attention_residual": (h,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, shapes = self.hf_config, super().dense_mlp_shapes(prefix)
        if c.is_moe:
            shapes.update({f"{prefix}.mlp.router_gate.weight": (2 * self.keys, c.hidden_size),
                           f"{prefix}.mlp.down_embed.weight": (c.num_experts, c.hidden_size),
                           f"{prefix}.mlp.up_embed.weight": (c.num_experts, c.hidden_size)})
        return shapes
