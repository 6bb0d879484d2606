"""HYV4ForCausalLM (Tencent's Hy4): GLM-5's bridge (multi-latent attention with DeepSeek Sparse Attention, layers
reusing an earlier top-k, DeepSeek-V3's experts dense or sparse by ``mlp_layer_types``) with DeepSeek-V4's residual
streams, sinks and an output gate.

Choices:
- Layers: ``deepseek_v4_layer``'s (megatron's layer with ``hc_mult`` hyper-connected streams; the decoder's final
  norm the hyper-head then ``model.norm``), HY-V4's hyper-connections (``comb=False``: ``pre`` / ``post`` only,
  ``post = hc_magnitude * sigmoid + hc_eps``, the streams added unmixed in fp32), the spec's attention kept.
- Attention: ``glm_moe_dsa.GlmMoeDsaBridge``'s (megatron's MLA, rotary halves on disk: interleaved on load and back
  on export) with three differences: a learned sink logit per head in the sparse attention's softmax
  (``sparse_attention_spec(sinks=True)``, fp32, split with the heads); an output gate (``self_attn.linear_gate``:
  column-parallel ``linear_gate`` on megatron's attention, its sigmoid times each head's output before ``o_proj``:
  a forward pre-hook on megatron's ``linear_proj``, which stays a plain linear for LoRA); the indexer rotates the
  last ``qk_rope_head_dim`` dims of each index head in halves and its key LayerNorm takes ``rms_norm_eps``.
- Experts: transformers' clamped SwiGLU (``swiglu_limit``) is ``activation_func_clamp_value`` on the routed experts' own
  config copy: our grouped MLP's ``kernels/clamped_glu.ClampedGLU``, or megatron's ``SequentialMLP`` under
  ``LOONGFORGE_MOE_GROUPED_GEMM=0``; the shared expert and dense layers are not clamped, as in transformers. Routing is
  GLM-5's (sigmoid, fixed bias, renormalised, scaled).
- Names as transformers 5 writes them (its ``conversion_mapping`` for ``hy_v4`` reversed): ``hc_pre.hc_attn_layer`` /
  ``hc_pre.hc_mlp_layer`` ``hc_{fn, base, scale}``, ``model.hc_pre.hc_head.hc_head_*``,
  ``self_attn.learnable_sink_param``, ``self_attn.linear_gate``, the MLPs' ``linear_gate`` (its reversed rename takes
  theirs too; ``gate_proj`` read as an alias), experts stacked (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
  ``down_proj``). ``model.mtp_layers.*`` (which transformers ignores) pass through. Packed rows (``position_ids``
  restarting) run as GLM-5's: each document as transformers runs it alone.
- What transformers keeps in fp32 stays so here (hyper-connections, sinks, router, the indexer's ``weights_proj``
  and ``k_norm``, which runs in fp32 as there); but ``lm_head`` (fp32 there, its logits from fp32 hidden states) is
  the model's dtype here, and so exported.
- Pipeline parallelism (virtual stages too): a stage boundary carries the ``hc_mult`` streams
  (``pipeline_hidden_size``, ``deepseek_v4_layer``). GLM-5 refuses it with any shared indexer layer; here only a
  split where a shared layer opens a stage is refused (its top-k would come from an earlier stage): a shared layer
  after a full one on its own stage reads that one's top-k (``sparse_attention.link_shared_layers``, per chunk).
  With shared layers, activation recompute under PP is refused (``recompute_refusal``): a stage runs later
  micro-batches' forwards before an earlier one's backward, so a recomputed shared layer would read another's top-k.
- ``generate``'s KV cache: GLM-5's (``sparse_attention.SparseAttentionCacheLayer``: each layer's MLA keys and values
  after the rotary embedding, a full layer's indexer keys after its rotation of their last dims, each rotated from
  its slot; a step's index queries score every cached and new key). What HY-V4 adds is per token or in the softmax,
  so a cached step applies it as the uncached forward: the sinks join the step's softmax over cache + new keys
  (``masked_sparse_attention``), the output gate comes from the step's own tokens, the streams pass through the
  layers as without the cache. Greedy and beam search give transformers' tokens with its cache.
- LoRA (names: ``deepseek_v4_lora``, transformers' ``gate_proj`` the checkpoint's ``linear_gate``): MLA's linears, the
  output gate ``self_attn.gate_proj``, ``o_proj``, the dense MLPs and the shared experts, as any megatron linear; the
  routed experts and the router (``target_parameters``) the grouped MLP's expert adapters and the re-classed router's;
  refused by name: the indexer's ``wq_b`` / ``wk`` / ``weights_proj`` (no gradient reaches them); its ``k_norm`` stays
  frozen under ``modules_to_save`` (``takes_no_gradient``).
- Context parallelism as GLM-5's (``sparse_attention.SparseAttention._cp_forward``; the streams, sinks and gate are
  per token or per query). Refused by name before any collective: a pipeline split as above, ``swiglu_limit`` <= 0,
  ``hidden_act`` other than silu, and GLM-5's refusals (the static cache in ``generate``, ``attention_bias``,
  ``attention_dropout``).
"""

from __future__ import annotations

import copy
import functools
import types
from dataclasses import dataclass, fields, replace

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.axk2 import _reclass, gated_input
from loongforge_hf.bridges.deepseek_v32 import IndexerRows
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.fused_mappings import GatedMLP
from loongforge_hf.bridges.glm_moe_dsa import GlmMoeDsaBridge
from loongforge_hf.bridges.mappings import FP32ColumnParallel, FP32Replicated, ColumnParallel, Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, routed_stack

HC, STREAMS = ("fn", "base", "scale"), {"attn": "hc_attn_layer", "ffn": "hc_mlp_layer"}
HEAD = "model.hc_pre.hc_head.hc_head"


def _linear_gate(m: Mapping) -> Mapping:
    """An MLP's gate under the name transformers writes (``linear_gate``)."""
    return replace(m, gate=m.gate.replace(".gate_proj.", ".linear_gate.")) if isinstance(m, GatedMLP) else m


@dataclass(frozen=True)
class FP32IndexerRows(IndexerRows):
    """The indexer's ``k_norm`` tensors, which transformers keeps in fp32."""

    hf_dtype = torch.float32


@functools.cache
def _gate_computing(base: type) -> type:
    class GateComputingAttention(base):
        """megatron's attention that first computes its output gate (``linear_gate``) for ``linear_proj``."""

        def forward(self, hidden_states, *args, **kwargs):
            self.box.gate, _ = self.linear_gate(hidden_states)
            return super().forward(hidden_states, *args, **kwargs)

    return GateComputingAttention


def _gate_output(attention, config, hf) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    attention.linear_gate = ColumnParallelLinear(
        hf.hidden_size, hf.num_attention_heads * hf.v_head_dim, config=config, init_method=config.init_method,
        bias=False, gather_output=False, tp_group=attention.pg_collection.tp)
    box = types.SimpleNamespace(gate=None)
    _reclass(attention, _gate_computing(type(attention)), box=box)
    # NOTE: a pre-hook, not a re-class: linear_proj stays megatron's RowParallelLinear, which LoRA's layers take
    attention.linear_proj.register_forward_pre_hook(functools.partial(gated_input, box=box))


@register_bridge("HYV4ForCausalLM")
class HYV4Bridge(GlmMoeDsaBridge):
    indexer_rope_halves, indexer_rope_first = True, False      # HY-V4's indexer: its last dims, in halves
    sparse_attention_options = {"key_norm_eps": None, "sinks": True}
    checkpoint_aliases = ((r"(\.mlp(?:\.shared_experts)?)\.gate_proj\.weight$", r"\1.linear_gate.weight"),)

    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        self.interleaved_rope_on_disk = False                  # NOTE: transformers' HY-V4 rotates halves

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        if not c.swiglu_limit or c.swiglu_limit <= 0:
            raise C.UnsupportedConfigError(f"swiglu_limit={c.swiglu_limit} is not supported for {arch} (transformers "
                                           "clamps the experts at it whatever its sign).")
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only silu).")
        super().check_config()

    def check_layout(self, layout) -> None:
        from loongforge_hf.bridges.stage_boundary import stage_layer_ranges

        if layout.pipeline_parallel_size == 1:  # NOTE: GLM-5's pipeline refusal (not called), narrowed here
            return
        shared = self.shared_layers()
        crossing = [stage.start for stage in stage_layer_ranges(self.hf_config.num_hidden_layers, layout)
                    if stage.start in shared]
        if crossing:
            raise C.UnsupportedConfigError(
                f"pipeline_parallel_size={layout.pipeline_parallel_size} is not supported for "
                f"{self.architectures[0]} with shared indexer layers {crossing} opening a pipeline stage "
                "(indexer_types: each reuses the top-k of a full layer on an earlier stage); a split where each stage "
                "opens with a full layer runs.")

    def pipeline_hidden_size(self) -> int:
        """What a pipeline stage sends per token: the ``hc_mult`` residual streams (builder.py)."""
        return self.hf_config.hc_mult * self.hf_config.hidden_size

    def recompute_refusal(self, pipeline_parallel_size: int) -> str | None:
        """Activation recompute under pipeline parallelism with shared indexer layers: a stage runs later
        micro-batches' forwards before an earlier one's backward, and a shared layer recomputed there would read the
        latest forward's top-k."""
        if pipeline_parallel_size > 1 and self.shared_layers():
            return (f"activation recompute with pipeline_parallel_size={pipeline_parallel_size} is not supported for "
                    f"{self.architectures[0]} with shared indexer layers {list(self.shared_layers())}: a recompute in "
                    "the backward of an earlier micro-batch would read another micro-batch's top-k.")
        return None

    def layer_module(self) -> type:
        from loongforge_hf.bridges.deepseek_v4_layer import v4_layer

        return v4_layer(self.hf_config, attention=False, comb=False)

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.deepseek_v4_layer import Head
        from loongforge_hf.kernels.grouped_mlp import GroupedMLP, expert_activation

        refusal = self.recompute_refusal(model.config.pipeline_model_parallel_size)
        if model.config.recompute_granularity is not None and refusal:  # NOTE: megatron_config's recompute
            raise ValueError(refusal)
        super().finish_model(model)
        c = self.hf_config
        if model.post_process:
            model.decoder.final_layernorm = Head(c, sequence_parallel=bool(model.config.sequence_parallel))
        for layer in model.decoder.layers:
            _gate_output(layer.self_attention, model.config, c)
            for p in layer.self_attention.core_attention.parameters():
                # NOTE: the indexer's, frozen by sparse_attention (no gradient): LoRA's modules_to_save keep them so
                p.takes_no_gradient = not p.requires_grad
            experts = getattr(layer.mlp, "experts", None)
            for expert in [experts] if isinstance(experts, GroupedMLP) else getattr(experts, "local_experts", ()):
                expert.config = copy.copy(expert.config)  # NOTE: routed experts only (module docstring)
                expert.config.activation_func_clamp_value = float(c.swiglu_limit)
                if isinstance(expert, GroupedMLP):
                    expert.activation = expert_activation(expert.config)

    def checkpoint_name(self, name: str) -> str:
        """The LoRA planner's way from transformers' module names to the checkpoint's (``deepseek_v4_lora``)."""
        from loongforge_hf.bridges.deepseek_v4_lora import checkpoint_name

        return checkpoint_name(self, name)

    def passthrough_names(self, names) -> list[str]:
        """DeepSeek's multi-token-prediction layers and HY-V4's ``model.mtp_layers.*``."""
        return [*super().passthrough_names(names), *(n for n in names if n.startswith("model.mtp_layers."))]

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        s = f"{L}.self_attn"
        return super().attention_mappings() + [
            ColumnParallel(f"{D}.self_attention.linear_gate.weight", f"{s}.linear_gate.weight"),
            FP32ColumnParallel(f"{D}.self_attention.core_attention.sinks", f"{s}.learnable_sink_param"),
            *(FP32Replicated(f"{D}.{ours}_hc.{x}", f"{L}.hc_pre.{theirs}.hc_{x}")
              for ours, theirs in STREAMS.items() for x in HC)]

    def indexer_mappings(self) -> list[Mapping]:
        return [FP32IndexerRows(**{f.name: getattr(m, f.name) for f in fields(m)}) if ".k_norm." in m.megatron else m
                for m in super().indexer_mappings()]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [_linear_gate(m) for m in super().dense_mlp_mappings()]

    def moe_mappings(self) -> list[Mapping]:
        routed = [routed_stack(self, cls, name, f"{L}.mlp.experts.{hf}") for cls, name, hf in (
            (StackedGateUp, "linear_fc1.weight", "gate_up_proj"), (StackedDown, "linear_fc2.weight", "down_proj"))]
        return [_linear_gate(m) for m in super().moe_mappings() if ".mlp.experts." not in m.megatron] + routed

    def final_mappings(self) -> list[Mapping]:
        return [Replicated("decoder.final_layernorm.weight", "model.norm.weight"),
                *(FP32Replicated(f"decoder.final_layernorm.hc_{x}", f"{HEAD}_{x}") for x in HC),
                *[m for m in super().final_mappings() if m.megatron == "output_layer.weight"]]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"{prefix}.self_attn"
        n, h, k = c.hc_mult, c.hidden_size, c.num_attention_heads
        shapes = {**super().attention_shapes(prefix), f"{p}.linear_gate.weight": (k * c.v_head_dim, h),
                  f"{p}.learnable_sink_param": (k,)}
        for theirs in STREAMS.values():
            x = f"{prefix}.hc_pre.{theirs}.hc"
            shapes.update({f"{x}_fn": (2 * n, n * h), f"{x}_base": (2 * n,), f"{x}_scale": (2,)})
        return shapes

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {k.replace(".mlp.gate_proj.", ".mlp.linear_gate."): v
                for k, v in super().dense_mlp_shapes(prefix).items()}

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        shapes = {k.replace(".shared_experts.gate_proj.", ".shared_experts.linear_gate."): v
                  for k, v in super().moe_shapes(prefix).items() if ".mlp.experts." not in k}
        return {**shapes, f"{prefix}.mlp.experts.gate_up_proj": (n, 2 * f, h),
                f"{prefix}.mlp.experts.down_proj": (n, h, f)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        n, h = self.hf_config.hc_mult, self.hf_config.hidden_size
        return {**super().expected_hf_shapes(), f"{HEAD}_fn": (n, n * h), f"{HEAD}_base": (n,), f"{HEAD}_scale": (1,)}
