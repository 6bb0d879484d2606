"""What each CPU rank runs in the distributed kernel tests (module-level so that spawned processes can import it).

Every check builds its single-rank reference inside the same process, from the same seeds, asserts its own slice
against it, and returns the names of the cases it checked. NOTE: the checks of one kind share one 2-rank world
(``op_checks``, ``gpt_checks``): starting ranks costs far more than the tiny checks themselves.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._reference import allowed_mask, attention_reference, load_balanced_rows

ATOL = RTOL = 1e-5


def _close(actual, expected, what, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------- cross entropy, TP=2

def cross_entropy_tp_matches_single_rank():
    from loongforge_hf.kernels.cross_entropy import linear_cross_entropy
    from loongforge_hf.parallel import init_distributed

    init_distributed()
    group, rank, size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    n, hidden_size, rows = 29, 12, 48
    cases = {
        "padded_vocab_z_loss": dict(vocab_size=41, z_loss=1e-3, chunk_size=5, reduction="sum"),
        "one_shard_all_padding": dict(vocab_size=20, chunk_size=None, reduction="sum"),
        "per_token": dict(vocab_size=41, chunk_size=8, reduction="none"),
        "label_smoothing": dict(vocab_size=41, chunk_size=5, reduction="sum", label_smoothing=0.3),
        "label_smoothing_per_token_one_shard_all_padding": dict(vocab_size=20, chunk_size=8, reduction="none",
                                                                z_loss=1e-3, label_smoothing=0.2),
    }
    for seed, (name, kw) in enumerate(cases.items()):
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(n, hidden_size, generator=g)
        weight = torch.randn(rows, hidden_size, generator=g) * 0.5
        labels = torch.randint(0, kw["vocab_size"], (n,), generator=g)
        labels[1::4] = -100
        grad_out = torch.randn(n, generator=g) if kw["reduction"] == "none" else None

        def run(w, **extra):
            h, w = hidden.clone().requires_grad_(), w.clone().requires_grad_()
            loss = linear_cross_entropy(h, w, labels, **kw, **extra)
            loss.backward(grad_out)
            return loss.detach(), h.grad, w.grad

        full_loss, full_dh, full_dw = run(weight)
        loss, dh, dw = run(weight.chunk(size)[rank], tp_group=group)
        _close(loss, full_loss, f"{name} loss")
        _close(dh, full_dh, f"{name} grad hidden")
        _close(dw, full_dw.chunk(size)[rank], f"{name} grad weight")
    # token stats: rows 3 and 24 (one on each rank) tie for the maximum of the first tokens; argmax picks row 3
    g = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(n, hidden_size, generator=g), torch.randn(rows, hidden_size, generator=g) * 0.5
    weight[24] = weight[3]
    hidden[:6] = weight[3] * 4 + 0.01 * hidden[:6]
    labels = torch.randint(0, 41, (n,), generator=g)
    labels[:6] = torch.tensor([3, 24, 3, 24, -100, 3])
    labels[9::4] = -100
    stats = torch.zeros(2)
    linear_cross_entropy(hidden, weight.chunk(size)[rank], labels, vocab_size=41, chunk_size=7, tp_group=group,
                         token_stats=stats)
    logits = hidden @ weight.t()
    valid = labels != -100
    logp = torch.log_softmax(logits[:, :41], dim=-1)
    expected = torch.stack((-(logp.exp() * logp).sum(-1)[valid].sum(),
                            ((logits[:, :41].argmax(-1) == labels) & valid).sum().float()))
    _close(stats, expected, "token stats, fused")
    assert stats[1] == expected[1] and (logits[:6].argmax(-1) == 3).all()
    from loongforge_hf.kernels.cross_entropy import logits_token_stats

    local = logits.chunk(size, dim=-1)[rank]
    _close(logits_token_stats(local, labels, vocab_size=41, tp_group=group), expected, "token stats, logits")
    return list(cases) + ["token_stats_ties_across_shards"]


# -------------------------------------------------------------------------------------------- attention, CP=2

def _local_run(fn, tensors, proj):
    tensors = [t.clone().requires_grad_() for t in tensors]
    out = fn(*tensors)
    (out.reshape(proj.shape) * proj).sum().backward()
    return [out.detach().reshape(proj.shape)] + [t.grad for t in tensors]


def _compare_rows(ours, full, rows, what):
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, full):
        _close(a, b[rows], f"{what} {name}")


def attention_cp_matches_full():
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loongforge_hf.kernels.attention import CoreAttention, dot_product_attention, packed_attention
    from loongforge_hf.parallel import ParallelConfig, initialize_parallel

    cp = 2
    initialize_parallel(ParallelConfig(context_parallel_size=cp))
    group = ps.get_context_parallel_group()
    rank = dist.get_rank(group)
    s, b, heads, kv_heads, d = 16, 2, 4, 2, 8
    scale = 1 / math.sqrt(d)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, hh, d, generator=g) for hh in (heads, kv_heads, kv_heads))
    proj = torch.randn(s, b, heads * d, generator=g)
    rows = load_balanced_rows(s, cp, rank)
    local = [t[rows] for t in (q, k, v)]
    checked = []

    config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                               num_query_groups=kv_heads, kv_channels=d, context_parallel_size=cp,
                               attention_dropout=0.0)
    module = CoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    assert module.cp_group is not None
    causal_mask = allowed_mask(s, s, causal=True)
    full = _local_run(lambda q, k, v: attention_reference(q, k, v, scale=scale, allowed=causal_mask), (q, k, v), proj)
    _compare_rows(_local_run(lambda q, k, v: module(q, k, v, None), local, proj[rows]), full, rows, "causal")
    checked.append("causal_gqa_module")

    # a causal window, and a two-sided one without the causal rule (queries then see keys after their chunk)
    for window, causal in (((5, 0), True), ((3, 2), False)):
        full = _local_run(lambda q, k, v: attention_reference(
            q, k, v, scale=scale, allowed=allowed_mask(s, s, causal=causal, window=window)), (q, k, v), proj)
        ours = _local_run(lambda q, k, v: dot_product_attention(
            q, k, v, causal=causal, scale=scale, window=window, cp_group=group), local, proj[rows])
        _compare_rows(ours, full, rows, f"window {window} causal={causal}")
    checked.append("sliding_window")

    # megatron's get_batch_on_this_cp_rank slices a mask's query rows only: [b, 1, s_local, s_global]
    masked_keys = torch.zeros(b, 1, s, s, dtype=torch.bool)
    masked_keys[0, ..., :3] = True
    masked_keys[1, ..., 9:11] = True
    full = _local_run(lambda q, k, v: attention_reference(
        q, k, v, scale=scale, allowed=~masked_keys & allowed_mask(s, s, causal=True)), (q, k, v), proj)
    ours = _local_run(lambda q, k, v: dot_product_attention(
        q, k, v, causal=True, scale=scale, mask=masked_keys[:, :, rows], cp_group=group), local, proj[rows])
    _compare_rows(ours, full, rows, "padding mask")
    checked.append("padding_mask")

    # packed documents, each padded to a multiple of 2 * cp, each load-balanced on its own
    cu, cu_padded = [0, 6, 9, 19], [0, 8, 12, 24]
    t = cu_padded[-1]
    q_t, k_t, v_t = (torch.randn(t, hh, d, generator=g) for hh in (heads, kv_heads, kv_heads))
    proj_t = torch.randn(t, heads * d, generator=g)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(cu), cu_seqlens_kv=torch.tensor(cu),
                             cu_seqlens_q_padded=torch.tensor(cu_padded), cu_seqlens_kv_padded=torch.tensor(cu_padded),
                             max_seqlen_q=12, max_seqlen_kv=12)

    def per_document(q, k, v):
        outs = []
        for a, e in zip(cu_padded[:-1], cu_padded[1:]):
            outs.append(attention_reference(q[a:e, None], k[a:e, None], v[a:e, None], scale=scale,
                                            allowed=allowed_mask(e - a, e - a, causal=True))[:, 0])
        return torch.cat(outs)

    full = _local_run(per_document, (q_t, k_t, v_t), proj_t)
    rows_t = torch.cat([a + load_balanced_rows(e - a, cp, rank) for a, e in zip(cu_padded[:-1], cu_padded[1:])])
    ours = _local_run(lambda q, k, v: packed_attention(q, k, v, params, causal=True, scale=scale, cp_group=group),
                      [x[rows_t] for x in (q_t, k_t, v_t)], proj_t[rows_t])
    _compare_rows(ours, full, rows_t, "packed")
    checked.append("packed_padded")

    config.attention_dropout = 0.5
    dropout_module = CoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    dropped = dropout_module.train()(*local, None)
    kept = dropout_module.eval()(*local, None)
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, kept)
    _close(kept, module(*local, None), "eval ignores dropout")
    checked.append("dropout_runs")
    return checked


# ------------------------------------------------------------------------------------ GPTModel built from our spec

SEQ, BATCH, VOCAB = 16, 2, 64


def _gpt(parallel, position, num_experts):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loongforge_hf.kernels.specs import get_block_spec, get_layer_spec

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=48,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=parallel.tensor_parallel_size,
        context_parallel_size=parallel.context_parallel_size, sequence_parallel=parallel.sequence_parallel,
        normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, use_te_activation_func=True, add_bias_linear=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        expert_model_parallel_size=parallel.expert_parallel_size, num_moe_experts=num_experts, moe_router_topk=2,
        moe_ffn_hidden_size=24 if num_experts else None,
        moe_shared_expert_intermediate_size=16 if num_experts else None, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    spec = get_block_spec(config, get_layer_spec(qk_norm=True, num_experts=num_experts))
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type=position, share_embeddings_and_output_weights=False)


def _full_weights(model):
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=g)
        weights[name] = 1 + 0.1 * noise if "layernorm" in name else 0.1 * noise
    return weights


def _tp_shard(name, full, rank, size):
    """Megatron's TP layout of one full (HF-order, megatron-named) weight."""
    if name.endswith("linear_fc1.weight"):  # [gate; up], each split on its own
        gate, up = full.chunk(2)
        return torch.cat((gate.chunk(size)[rank], up.chunk(size)[rank]))
    if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return full.chunk(size)[rank]  # qkv rows are grouped per KV head, so whole groups land on each rank
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(size, dim=1)[rank]
    return full


def _global_name(name, ep_rank, local_experts):
    """The unparallelised model's name for a parameter: expert i of EP rank r is expert r * local_experts + i."""
    head, sep, tail = name.partition("local_experts.")
    if not sep:
        return name
    index, _, rest = tail.partition(".")
    return f"{head}{sep}{ep_rank * local_experts + int(index)}.{rest}"


def _load(model, weights, rank=0, size=1, ep_rank=0, local_experts=0):
    with torch.no_grad():
        for name, p in model.named_parameters():
            shard = _tp_shard(name, weights[_global_name(name, ep_rank, local_experts)], rank, size)
            if shard.shape != p.shape:
                raise AssertionError(f"{name}: shard {tuple(shard.shape)} vs parameter {tuple(p.shape)}")
            p.copy_(shard)


def gpt_layout_matches_single_rank(layout: dict, position: str, num_experts: int | None):
    """Loss and every grad of a GPTModel built from ``get_layer_spec(qk_norm=True, num_experts=...)`` under ``layout``
    equal the same model without model parallelism on the whole batch, both loading the same full weights."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.parallel import ParallelConfig, initialize_parallel

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    # the reference: the same world, no model parallelism, every rank on the whole batch
    initialize_parallel(ParallelConfig())
    reference = _gpt(ParallelConfig(), position, num_experts)
    weights = _full_weights(reference)
    _load(reference, weights)
    ref_loss = reference(tokens, positions, None, labels=labels)
    (ref_loss.sum() / ref_loss.numel()).backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}

    parallel = initialize_parallel(ParallelConfig(**layout))
    tp, cp, dp = parallel.tensor_parallel_size, parallel.context_parallel_size, ps.get_data_parallel_world_size()
    tp_rank, cp_rank, ep_rank = (ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(),
                                 ps.get_expert_model_parallel_rank())
    model = _gpt(parallel, position, num_experts)
    _load(model, weights, tp_rank, tp, ep_rank, (num_experts or 0) // parallel.expert_parallel_size)
    # data-parallel ranks take their share of the samples, context-parallel ranks their load-balanced chunks
    samples = torch.arange(BATCH).chunk(dp)[ps.get_data_parallel_rank()]
    rows = load_balanced_rows(SEQ, cp, cp_rank) if cp > 1 else torch.arange(SEQ)
    pick = (samples[:, None], rows[None, :])
    loss = model(tokens[pick], positions[pick], None, labels=labels[pick])
    _close(loss, ref_loss[pick], "per-token loss")
    (loss.sum() / ref_loss.numel()).backward()

    params = dict(model.named_parameters())
    with_grad = sum(1 for p in params.values() if p.grad is not None and bool(p.grad.abs().sum() > 0))
    for name, p in params.items():
        grad = p.grad.clone()
        # what megatron's finalize_model_grads and DDP would reduce: grads of replicated params whose TP ranks saw
        # different tokens (sequence parallel) or different heads (q/k norms); every grad across CP ranks; dense
        # grads across data-parallel ranks (experts already received every rank's tokens through the all-to-all)
        partial_over_tp = not getattr(p, "tensor_model_parallel", False) and (
            (parallel.sequence_parallel and getattr(p, "sequence_parallel", False))
            or "q_layernorm" in name or "k_layernorm" in name)
        if tp > 1 and partial_over_tp:
            dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
        if cp > 1:
            dist.all_reduce(grad, group=ps.get_context_parallel_group())
        if dp > 1 and getattr(p, "allreduce", True):
            dist.all_reduce(grad, group=ps.get_data_parallel_group())
        expected = ref_grads[_global_name(name, ep_rank, (num_experts or 0) // parallel.expert_parallel_size)]
        _close(grad, _tp_shard(name, expected, tp_rank, tp), f"grad of {name}")
    return {"loss": float(loss.mean()), "params": len(params), "with_grad": with_grad}


# ------------------------------------------------------------------------------------------------ the two worlds

def op_checks():
    return {"cross_entropy_tp2": cross_entropy_tp_matches_single_rank(), "attention_cp2": attention_cp_matches_full()}


GPT_LAYOUTS = {  # name: (layout, position embedding, experts)
    # rope under tensor + sequence parallelism
    "tp2_sp": (dict(tensor_parallel_size=2, sequence_parallel=True), "rope", None),
    # NOTE: learned positions: on CPU, megatron-core 0.16.1's rope slicing for CP (rope_utils.py:62-64,
    # get_pos_emb_on_this_cp_rank) pins memory and calls .cuda(), which the cpu backend does not stand in for yet.
    "cp2": (dict(context_parallel_size=2), "learned_absolute", None),
    # MoE layers (routed + shared experts) from our spec, experts split over 2 ranks, data parallel for the rest
    "ep2_moe": (dict(expert_parallel_size=2), "rope", 4),
}


def gpt_checks(layouts: dict):
    return {name: gpt_layout_matches_single_rank(*case) for name, case in layouts.items()}
