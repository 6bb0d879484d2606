"""Tiny megatron-core GPTModel forward + backward under a parallel layout (run inside each rank)."""

import torch
import torch.nn.functional as F


def build_and_step(layout: dict, *, moe: bool = False, num_layers: int = 4, seq: int = 16, micro_batches: int = 2,
                   spec: str = "megatron-local"):
    """``spec``: "megatron-local" (megatron's own local modules) or "kernels" (our norms and attention; needed for
    sequence and context parallelism, which megatron's local torch norm and attention refuse)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loongforge_hf.parallel import ParallelConfig, initialize_parallel

    parallel = initialize_parallel(ParallelConfig(**layout))
    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=parallel.tensor_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_parallel_size,
        expert_model_parallel_size=parallel.expert_parallel_size,
        context_parallel_size=parallel.context_parallel_size, sequence_parallel=parallel.sequence_parallel,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        num_moe_experts=4 if moe else None, moe_router_topk=2 if moe else 2,
        moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=32 if moe else None,
        moe_aux_loss_coeff=0.0,
    )
    vpp = parallel.virtual_pipeline_parallel_size or 1
    chunks = []
    for i in range(vpp):
        if spec == "kernels":
            from loongforge_hf.kernels.specs import get_block_spec, get_layer_spec

            layer_spec = get_block_spec(cfg, get_layer_spec(qk_norm=True, num_experts=4 if moe else None),
                                        vp_stage=i if vpp > 1 else None)
        else:
            layer_spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, moe_grouped_gemm=False)
        chunks.append(GPTModel(config=cfg, transformer_layer_spec=layer_spec, vocab_size=64, max_sequence_length=seq,
                               pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                               post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                               position_embedding_type="rope", vp_stage=i))
    for c in chunks:
        c.config.no_sync_func = None
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2, seq), generator=g) for _ in range(micro_batches)]

    def forward_step(data_iter, model):
        from megatron.core.utils import get_batch_on_this_cp_rank

        ids = next(data_iter)
        batch = get_batch_on_this_cp_rank({"tokens": ids, "position_ids": torch.arange(seq).expand_as(ids)})
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["tokens"])

        def loss_fn(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_fn

    data = iter(batches) if vpp == 1 else [iter(batches) for _ in range(vpp)]
    fb = get_forward_backward_func()
    losses = fb(forward_step_func=forward_step, data_iterator=data, model=chunks if vpp > 1 else chunks[0],
                num_microbatches=micro_batches, seq_length=seq, micro_batch_size=2, forward_only=False)
    grads = [p.grad for c in chunks for p in c.parameters() if p.requires_grad]
    n_params = sum(1 for c in chunks for p in c.parameters())
    got = [gr for gr in grads if gr is not None and gr.abs().sum() > 0]
    loss_vals = [float(d["loss"]) for d in losses] if losses else []
    return {"losses": loss_vals, "params": n_params, "with_grad": len(got),
            "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True)}
