"""Build this rank's megatron-core GPTModel chunk(s) for a bridge and a parallel layout.

Choices:
- Weights are not initialised (``perform_initialization=False``): the loader fills every parameter from the checkpoint
  and fails if one is left over.
- Uneven pipelines: when layers don't divide by the pipeline size, the first (and if needed the last) stage take
  the extra layers through megatron's ``num_layers_in_first/last_pipeline_stage``; a split megatron cannot
  express raises ``ParallelLayoutError`` (``stage_boundary.uneven_split``). A bridge declaring
  ``stage_split_problem`` gets a split that suits it, or the user's two fields from ``megatron_config``
  (``stage_boundary.pipeline_split``).
- Rotary frequencies follow the HF config exactly (llama3 scaling included) by overwriting megatron's ``inv_freq``.
- The pad token's embedding row takes no gradient from lookups where transformers' embedding has ``padding_idx``
  (``bridges/embedding_padding.py``).
- What a bridge declares beyond its spec: ``embedding_dropout`` (the embedding output's dropout, which megatron would
  take from ``hidden_dropout``: none in Llama-family models) and ``lm_head_bias`` (``output_layer.add_output_bias``),
  applied to each built chunk.
- ``megatron_config`` (from ``from_pretrained``) adds TransformerConfig fields the checkpoint and the layout do not
  decide (e.g. ``overlap_moe_expert_parallel_comm``, ``fine_grained_activation_offloading``); a field the bridge or the
  layout sets, or one TransformerConfig does not have, raises ``ValueError`` (``check_megatron_config``, called by
  from_pretrained before any collective). ``fp8`` / ``fp8_recipe`` are refused there: a Transformer Engine recipe
  comes through ``te_fp8_recipe`` (``from_pretrained(fp8_recipe="te_...")``), which also changes the layer spec.
- A stage boundary wider than ``hidden_size`` (a bridge's ``pipeline_hidden_size()``): ``stage_boundary.py``.
- More TP ranks than KV heads: ``num_query_groups`` is the TP size and each ``linear_qkv`` carries its replica's
  rows (``parallel/kv_replicas.py``, whose ``check_kv_replication`` refuses layouts that cannot replicate).
"""

from __future__ import annotations

import importlib.util
import types
from dataclasses import dataclass

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.embedding_padding import embedding_padding_idx, pad_without_lookup_gradient
from loongforge_hf.bridges.mla_latent import full_width_kv_latent
from loongforge_hf.bridges.output_layer import add_output_bias
from loongforge_hf.bridges.stage_boundary import (SPLIT_FIELDS, boundary_problems, boundary_settings, pipeline_split,
                                                  wider_boundary)
from loongforge_hf.bridges.transforms import padded_vocab_size
from loongforge_hf.kernels.fp8_te import TE_CONFIG_FIELDS, te_config_fields
from loongforge_hf.parallel.config import ParallelConfig
from loongforge_hf.parallel.kv_replicas import mark_replicas, query_groups
from loongforge_hf.xpu import get_backend


@dataclass
class MegatronModel:
    chunks: list            # GPTModel per virtual stage held by this rank
    config: object          # megatron TransformerConfig
    layer_offsets: list[int]
    layer_counts: list[int]
    padded_vocab: int
    stage_hidden_size: int | None = None  # NOTE: what crosses a pipeline stage boundary per token, when not hidden


# TransformerConfig fields build_megatron_model sets from the layout, the dtype and the backend.
_BUILDER_FIELDS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "params_dtype", "pipeline_dtype",
    "bf16", "fp16", "use_cpu_initialization", "perform_initialization", "bias_activation_fusion",
    "masked_softmax_fusion", "gradient_accumulation_fusion", "persist_layer_norm", "apply_rope_fusion",
    "bias_dropout_fusion", "cross_entropy_loss_fusion", "deallocate_pipeline_outputs",
)


def check_megatron_config(bridge, megatron_config: dict | None) -> None:
    """``ValueError`` for ``megatron_config`` fields that TransformerConfig lacks or that the bridge or builder set.

    Pure: from_pretrained calls it before any collective, so every rank raises the same error.
    """
    if not megatron_config:
        return
    import dataclasses

    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = bridge.transformer_config_kwargs()
    config_class = MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig
    unknown = sorted(set(megatron_config) - {f.name for f in dataclasses.fields(config_class)})
    taken = set(megatron_config) & (set(kw) | set(_BUILDER_FIELDS))
    if hasattr(bridge, "stage_split_problem"):  # NOTE: the bridge checks a user's split (stage_boundary.py)
        taken -= set(SPLIT_FIELDS)
    taken = sorted(taken)
    problems = [f"{k}: not a megatron-core {config_class.__name__} field" for k in unknown]
    problems += [f"{k}: set from the checkpoint's config or the layout, not through megatron_config" for k in taken]
    problems += [f"{k}: {bridge.architectures[0]} routes with its own function, which does not apply it"
                 for k in sorted(set(megatron_config) & set(getattr(bridge, "unserved_megatron_fields", ())))]
    problems += boundary_problems(bridge, megatron_config)
    te_fields = sorted(set(megatron_config) & set(TE_CONFIG_FIELDS))
    problems += [f"{k}: Transformer Engine FP8 is chosen with from_pretrained(fp8='on', fp8_recipe='te_...'), which "
                 "also puts TE's linears into the layer spec (docs/fp8.md)" for k in te_fields]
    graphs = megatron_config.get("cuda_graph_impl", "none")
    if graphs == "local" and not getattr(bridge, "pre_norms", True):
        problems.append(f"cuda_graph_impl='local' is not supported for {bridge.architectures[0]}: its layers have no "
                        "input norm, which keeps a copy of the graphed first layer's input (builder._keep_graph_input)")
    if graphs != "none" and get_backend().name != "cuda":
        problems.append(f"cuda_graph_impl={graphs!r}: CUDA graphs need a CUDA device, this run's backend is "
                        f"{get_backend().name!r}")
    elif graphs == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        problems.append("cuda_graph_impl='transformer_engine' needs Transformer Engine, which is not installed "
                        "(cuda_graph_impl='local' is megatron's own implementation)")
    if problems:
        raise ValueError("megatron_config: " + "; ".join(problems) + ".")


def interleaved_p2p_settings(pipeline_parallel_size: int, megatron_config: dict) -> dict:
    """The p2p settings of the interleaved (virtual pipeline) schedule that ``megatron_config`` leaves to us:
    megatron-core's defaults (``batch_p2p_comm=True``, ``overlap_p2p_comm=False``) are wrong there at PP=2, where the
    previous and the next stage are one peer: the schedule's steady state sends the activation and the gradient to it
    in one batch, same-peer p2p operations pair in the order they are posted, and the two ranks post them in opposite
    orders, so each receives the other's tensor silently (equal shapes; the loss of a PP2 x VPP2 step with 4
    micro-batches was 7.787 against 7.770 at PP1). Megatron-LM's own default for this schedule is used instead: p2p
    overlapped with compute and not batched (its steady state then exchanges forward and backward tensors apart)."""
    chosen = {k: megatron_config[k] for k in ("overlap_p2p_comm", "batch_p2p_comm") if k in megatron_config}
    settings = {"overlap_p2p_comm": True, "batch_p2p_comm": False} | chosen
    if pipeline_parallel_size == 2 and settings["batch_p2p_comm"]:
        raise ValueError("megatron_config: batch_p2p_comm=True with virtual pipeline stages at "
                         "pipeline_parallel_size=2 exchanges each step's activations and gradients with the one peer "
                         "in a single batch, which megatron-core pairs wrongly (silently wrong results); leave "
                         "batch_p2p_comm unset or False.")
    if settings["overlap_p2p_comm"] and settings["batch_p2p_comm"]:
        raise ValueError("megatron_config: overlap_p2p_comm and batch_p2p_comm cannot both be True (megatron-core's "
                         "interleaved schedule refuses it); overlap_p2p_comm is on by default with virtual pipeline "
                         "stages.")
    return {k: v for k, v in settings.items() if k not in megatron_config}


def build_megatron_model(bridge, parallel: ParallelConfig, *, dtype: torch.dtype,
                         megatron_config: dict | None = None, te_fp8_recipe: str | None = None) -> MegatronModel:
    """The bridge's megatron ``GPTModel`` chunks for this rank, on the backend's device, with empty weights.
    ``te_fp8_recipe``: a Transformer Engine FP8 recipe (``kernels.fp8_te``, checked by the caller)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from loongforge_hf.bridges.specs import layer_spec_for

    hf = bridge.hf_config
    kw = bridge.transformer_config_kwargs()
    kv_heads = kw.get("num_query_groups")
    if kv_heads:  # NOTE: one group per TP rank where TP exceeds the KV heads (parallel/kv_replicas.py)
        kw["num_query_groups"] = query_groups(kv_heads, parallel.tensor_parallel_size)
    rope = bridge.rope_parameters() if hasattr(bridge, "rope_parameters") else C.rope_parameters(hf)
    config_class = MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig
    backend = get_backend()
    vpp = parallel.interleaved_stages
    kw.update({k: v for k, v in pipeline_split(bridge, parallel, megatron_config).items()
               if k not in (megatron_config or {})})
    fixed = dict(
        tensor_model_parallel_size=parallel.tensor_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=backend.name == "cpu", perform_initialization=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False, deallocate_pipeline_outputs=False,
    )
    if te_fp8_recipe is not None:
        fixed.update(te_config_fields(te_fp8_recipe))
    check_megatron_config(bridge, megatron_config)
    if vpp:
        fixed.update(interleaved_p2p_settings(parallel.pipeline_parallel_size, megatron_config or {}))
    fixed.update(boundary_settings(bridge, parallel.pipeline_parallel_size, megatron_config or {}))
    # NOTE: set after megatron's checks: fields whose check refuses what the bridge's own modules run (DSA under CP)
    late = {k: kw.pop(k) for k in getattr(bridge, "late_config_fields", ()) if k in kw}
    config = config_class(**kw, **fixed, **(megatron_config or {}))
    for field, value in late.items():
        setattr(config, field, value)
    padded = padded_vocab_size(hf.vocab_size, tensor_parallel_size=parallel.tensor_parallel_size)
    padding_idx = embedding_padding_idx(bridge)
    chunks, offsets, counts = [], [], []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config, transformer_layer_spec=layer_spec_for(bridge, config, vp_stage=stage), vocab_size=padded,
            max_sequence_length=hf.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=bridge.tied,
            position_embedding_type=getattr(bridge, "position_embedding_type", "rope"),
            rotary_base=rope["rope_theta"], rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
            parallel_output=True, vp_stage=stage,
        )
        if hasattr(model, "rotary_pos_emb") and rope["rope_type"] in ("linear", "llama3", "yarn"):
            # NOTE: transformers' scaled frequencies (kernels/rope.py); megatron computes the plain ones only.
            # LongRoPE's two sets go in with Phi3Bridge.finish_model
            from loongforge_hf.kernels.rope import rope_inv_freq, set_megatron_inv_freq

            set_megatron_inv_freq(model.rotary_pos_emb, rope_inv_freq(
                C.head_dim_of(hf), base=rope["rope_theta"], rope_scaling=rope,
                partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0))))
        if hasattr(bridge, "finish_model"):
            bridge.finish_model(model)
        if model.pre_process:  # NOTE: transformers' padding_idx (bridges/embedding_padding.py)
            pad_without_lookup_gradient(model.embedding.word_embeddings, padding_idx)
        if getattr(bridge, "embedding_dropout", None) is not None and model.pre_process:
            # NOTE: megatron's embedding drops its output with hidden_dropout; the bridge says the model's own
            model.embedding.embedding_dropout.p = float(bridge.embedding_dropout)
        if getattr(bridge, "lm_head_bias", False):
            add_output_bias(model)
        device = backend.device()
        model.to(device)
        if config.multi_latent_attention and config.sequence_parallel:
            full_width_kv_latent(model)
        if config.cuda_graph_impl == "local":
            _keep_graph_input(model)
            _graphs_in_training_only(model)
        chunks.append(model)
        offsets.append(get_transformer_layer_offset(config, vp_stage=stage))
        counts.append(get_num_layers_to_build(config, vp_stage=stage))
    if kv_heads:
        mark_replicas(chunks, num_key_value_heads=kv_heads, head_dim=config.kv_channels,
                      tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=parallel.tensor_parallel_size)
    return MegatronModel(chunks=chunks, config=config, layer_offsets=offsets, layer_counts=counts,
                         padded_vocab=padded, stage_hidden_size=wider_boundary(bridge))


def _keep_graph_input(chunk) -> None:
    """megatron's local CUDA graphs (``cuda_graph_impl="local"``): the chunk's first decoder layer normalises a copy of
    its input.

    NOTE: measured on an H100 (tiny Qwen3, fp32, lr 0): the replayed backward of a chunk's first layer got the
    input-norm weight and input grads ~10x off, every other layer's grads exact. The static input buffer of a graph
    whose input no other graph produced (the embedding output, a pipeline receive) does not keep its data until that
    graph's backward replay in megatron-core 0.16 (``cuda_graphs.py`` hands it back to its buffer pool after capture),
    while the input norm keeps that buffer for its backward. A copy made inside the graph lives in the graph's own
    memory like every other saved activation; with it graphs and eager train alike
    (tests/kernels/test_gpu_cuda_graphs.py).
    """
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    if layers is None or not len(layers):
        return
    # NOTE: an attribute, not a forward pre-hook: megatron refuses to graph a module with user hooks.
    norm = layers[0].input_layernorm
    if not hasattr(norm, "copy_input"):
        raise ValueError(f"cuda_graph_impl='local' needs this project's RMSNorm as the first layer's input norm "
                         f"(got {type(norm).__name__}, e.g. from a Transformer Engine spec).")
    norm.copy_input = True


def _graphs_in_training_only(chunk) -> None:
    """megatron's local CUDA graphs serve the training step only: a call of a graphed module in eval mode or without
    grad (evaluation, ``generate``, a static cache's own capture) runs the module eagerly.

    NOTE: megatron-core 0.16 sends every call of a graphed layer to its graph manager once any graph exists. A call at
    another shape than the training step's then fails (``cudagraph_created is set to True but no matching cudagraph
    runners were found``), and one at the same shape replays the training forward graph, which holds none of the
    work a KV cache adds around megatron's modules. A recomputed layer's first pass runs without grad inside
    megatron's checkpointing and stays on the graphs, as megatron handles it.
    """
    for module in chunk.modules():
        if hasattr(module, "cudagraph_manager") and "_should_call_local_cudagraph" not in vars(module):
            module._should_call_local_cudagraph = types.MethodType(_graphed_call_in_training_step, module)


def _graphed_call_in_training_step(self, *args, **kwargs) -> bool:
    """megatron's ``_should_call_local_cudagraph``, and only in the training step (see ``_graphs_in_training_only``)."""
    from megatron.core.tensor_parallel import random as megatron_random

    in_step = self.training and (torch.is_grad_enabled() or megatron_random.is_checkpointing())
    return in_step and type(self)._should_call_local_cudagraph(self, *args, **kwargs)


def layer_owners(config, parallel: ParallelConfig) -> dict[int, tuple[int, int | None, int]]:
    """Global layer index -> (pipeline rank, virtual stage, local index): the same table on every rank."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vpp = parallel.interleaved_stages
    owners = {}
    for pp_rank in range(parallel.pipeline_parallel_size):
        for vp in range(vpp or 1):
            stage = vp if vpp else None
            offset = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=pp_rank)
            for j in range(get_num_layers_to_build(config, vp_stage=stage, pp_rank=pp_rank)):
                owners[offset + j] = (pp_rank, stage, j)
    return owners
