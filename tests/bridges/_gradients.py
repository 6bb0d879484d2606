"""Rank function for test_gradients.py: every parameter's gradient of a loongforge model, written as an HF
checkpoint through the bridge's own export and read back by transformers, against transformers' gradients of the
same loss; under pipeline parallelism the training engine's (its schedule runs the backward across the stages)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _reduce_as_megatron(model) -> None:
    """The sums megatron's DDP and ``finalize_model_grads`` make after a backward, on the raw ``.grad``: replicated
    parameters that see only this rank's sequence-parallel tokens (norms, router) or heads (q / k norms) over TP;
    every dense parameter
    over the context-parallel ranks; experts that see only their own tokens over the expert-data-parallel group
    (the engine's ``allreduce=False``); then the engine's sum over the replicas of a KV head (more TP ranks than KV
    heads, ``parallel/kv_replicas.py``)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.parallel.kv_replicas import sum_replica_grads

    tp_group = ps.get_tensor_model_parallel_group()
    expert_dp, cp = ps.get_expert_data_parallel_world_size(), ps.get_context_parallel_world_size()
    for chunk in model.chunks:
        for name, p in chunk.named_parameters():
            if p.grad is None:
                continue
            if ".mlp.experts." in f".{name}":
                if expert_dp > 1:
                    dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
                continue
            # NOTE: megatron's finalize_model_grads: by attribute, and q/k norms by name (each rank's heads)
            qk_norm = model.megatron.config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            split = getattr(p, "sequence_parallel", False) and model.megatron.config.sequence_parallel
            if (split or qk_norm) and ps.get_tensor_model_parallel_world_size() > 1:
                dist.all_reduce(p.grad, group=tp_group)
            if cp > 1:  # each context-parallel rank holds its share of the sequence
                dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
    sum_replica_grads(model.chunks)


def save_gradients(model, folder: str) -> None:
    """The gradients of the last backward, reduced as megatron's DDP reduces them (``_reduce_as_megatron``), written
    over the weights and saved through the bridge's own export: an HF folder transformers reads back as gradients.
    A frozen tensor (no gradient: the DSA indexer's) is written unchanged."""
    _reduce_as_megatron(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.copy_(p.grad)
    model.save_pretrained(folder)


def gradient_diffs(folder: str, ref) -> dict[str, float]:
    """Per parameter of ``ref`` (a transformers model after its backward): the largest difference between its
    gradient and the tensor transformers reads from ``folder`` (``save_gradients``), relative to the gradient's
    largest value."""
    import transformers

    got = dict(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())
    return {n: float((got[n].detach().to(p.grad.device) - p.grad).abs().max()) / (float(p.grad.abs().max()) or 1.0)
            for n, p in ref.named_parameters()}


def _gather_sharded_grads(chunks) -> None:
    """Every rank's whole gradient buffers, where megatron's distributed optimizer left each its shard: DDP
    reduce-scatters each bucket over its data x context-parallel group (the expert-data-parallel group for experts'),
    so outside this rank's shard a buffer holds its own unreduced share (under CP: half of the sequence's). Gathered
    in place; a no-op for a group of one rank and for all-reduced buffers (``optimizer_precision="model"``)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in chunks:
        if not chunk.ddp_config.use_distributed_optimizer:
            continue
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            pg, size = group.intra_distributed_optimizer_instance_group, group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            for bucket in group.buckets:
                mine = shard_buffer(bucket.grad_data, size)[pg.rank()].clone()
                dist.all_gather_into_tensor(bucket.grad_data, mine, group=pg)


def _save_engine_gradients(model, ids: torch.Tensor, grads_dir: str) -> None:
    """Save as the model's weights the gradients of the mean loss as the training engine makes them (megatron's
    pipeline schedule, DDP's reductions, the tied embedding's sum over the first and last stage), taken between the
    last backward and the optimizer step (the engine's buffers hold the loss sum's: divided by the token count)."""
    import tempfile

    import transformers

    from loongforge_hf.trainer.engine import MegatronEngine

    def save() -> None:
        _gather_sharded_grads(engine.chunks)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.main_grad / ids[:, 1:].numel())
        model.save_pretrained(grads_dir)

    with tempfile.TemporaryDirectory() as out:
        engine = MegatronEngine(model, args=transformers.TrainingArguments(out, use_cpu=True, report_to=[]))
        engine.train_step([{"input_ids": ids, "labels": ids}], before_optimizer_step=save)


def with_pad_tokens(ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """``ids`` with every third token the pad id (unmasked input and label; both halves of each sequence)."""
    out = ids.clone()
    out[:, ::3] = pad_token_id
    return out


def gradient_checks(cases: list[tuple[str, str, dict, bool]], *, engine: tuple[str, ...] = ()) -> dict:
    """Per case (name, checkpoint folder, layout, pad): the largest difference between our gradient and
    transformers' of every HF tensor, relative to the largest gradient of that tensor (rank 0; others return {}).
    ``pad``: the input has the config's ``pad_token_id`` as real tokens (``with_pad_tokens``). The gradients are
    the training engine's step's (``_save_engine_gradients``) for the cases named in ``engine`` and under pipeline
    parallelism, else one backward's (``save_gradients``)."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.testing.tiny_models import hf_causal_lm

    plain = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(2))
    out = {}
    for name, folder, layout, pad in cases:
        ids = with_pad_tokens(plain, transformers.AutoConfig.from_pretrained(folder).pad_token_id) if pad else plain
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        grads_dir = f"{folder}-grads-{name}"
        if name in engine or layout.get("pipeline_parallel_size", 1) > 1:
            _save_engine_gradients(model, ids, grads_dir)
        else:
            model(input_ids=ids, labels=ids).loss.backward()
            save_gradients(model, grads_dir)
        if dist.get_rank() != 0:
            continue
        # NOTE: transformers reads the folder into its own layout (e.g. transformers 5's fused expert stacks)
        ours = dict(hf_causal_lm(grads_dir, dtype=torch.float32)
                    .named_parameters())
        hf = hf_causal_lm(folder, dtype=torch.float32)
        hf(input_ids=ids, labels=ids).loss.backward()
        diffs, missing = {}, []
        for n, p in hf.named_parameters():
            if n not in ours:
                missing.append(n)
                continue
            if p.grad is None:  # NOTE: no gradient (ERNIE 4.5's e_score_correction_bias, a fixed bias): ours unchanged
                diffs[n] = 0.0 if torch.equal(ours[n].detach(), p.detach()) else float("inf")
                continue
            # NOTE: a gradient zero up to rounding (OPT's key bias: without a rotation, softmax ignores a shift common
            # to a query's scores) must be ours too, within 1e-8 absolute (1e-4 of 1e-4)
            scale = float(p.grad.abs().max()) or 1.0
            scale = 1e-4 if scale <= 1e-9 else scale
            diffs[n] = float((ours[n].detach() - p.grad).abs().max()) / scale
        out[name] = {"diffs": diffs, "missing": missing}
    return out
