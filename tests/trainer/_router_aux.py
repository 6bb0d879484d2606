"""Rank functions: transformers' router load-balancing loss (output_router_logits) in the model's forward and in
training, loongforge-hf against transformers; one world per world size runs every check of that size."""

import torch

from ._train_parity import train_hf, train_loong


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 200, (2, 15), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return ids, mask, labels


def _router_weights(model, hf: bool) -> list[torch.Tensor]:
    if hf:
        return [layer.mlp.gate.weight for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    return [router.weight for router in model.router_balance.routers]


def _aux_grads(model, ids, mask, labels, hf: bool, objective=lambda out: out.loss) -> list[torch.Tensor]:
    """The router weights' gradient of ``objective(output)`` with output_router_logits minus the loss's without
    (``coef * aux``'s for the plain loss). Under
    sequence parallelism each rank's is its own tokens' part, summed over the tensor-parallel ranks (as megatron's
    finalize_model_grads sums every sequence-parallel replicated weight's); under context parallelism likewise over
    the context-parallel ranks (as the data-parallel reduction with context parallelism does)."""
    import torch.distributed as dist

    grads = []
    for on in (True, False):
        model.config.output_router_logits = on
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        (objective(out) if on else out.loss).backward()
        grads.append([w.grad.clone() for w in _router_weights(model, hf)])
        if not hf:
            from megatron.core import parallel_state as ps

            groups = [ps.get_tensor_model_parallel_group()] if model.megatron.config.sequence_parallel else []
            groups += [ps.get_context_parallel_group()] if ps.get_context_parallel_world_size() > 1 else []
            for group in groups:
                for g in grads[-1]:
                    dist.all_reduce(g, group=group)
    model.config.output_router_logits = True
    return [a - b for a, b in zip(*grads)]


def forward_checks(folder: str, model) -> dict:
    """(transformers, loongforge) pairs: loss and aux_loss with and without an attention mask with pads, the
    aux_loss under no_grad in eval mode, and the routers' gradient of the balancing term."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids, mask, labels = _batch()
    out = {}
    for name, m in (("no_mask", None), ("mask", mask)):
        want = hf(input_ids=ids, attention_mask=m, labels=labels)
        got = model(input_ids=ids, attention_mask=m, labels=labels)
        out[name] = {"loss": (float(want.loss), float(got.loss)), "aux": (float(want.aux_loss), float(got.aux_loss)),
                     "type": type(got).__name__}
    with torch.no_grad():
        out["no_grad_no_labels"] = (float(hf(input_ids=ids, attention_mask=mask).aux_loss),
                                    float(model(input_ids=ids, attention_mask=mask).aux_loss))
    want, got = _aux_grads(hf, ids, mask, labels, True), _aux_grads(model, ids, mask, labels, False)
    out["grad"] = [float((a - b).abs().max() / a.abs().max()) for a, b in zip(want, got)]
    out["grad_size"] = [float(a.abs().max()) for a in want]
    # the routers' gradient follows what is backpropagated, as transformers': a loss scaled after the forward
    # (gradient accumulation's 1 / steps), and an objective that leaves the term out (no balancing gradient then)
    coef = hf.config.router_aux_loss_coef
    for name, objective in (("scaled", lambda o: 0.25 * o.loss + 0.75 * o.loss.detach()),
                            ("without_aux", lambda o: o.loss - coef * o.aux_loss)):
        want, got = (_aux_grads(m, ids, mask, labels, m is hf, objective) for m in (hf, model))
        out[name] = max(float((a - b).abs().max()) for a, b in zip(want, got)) / max(out["grad_size"])
    # the forward keyword overrides the config, as in transformers (the config says output_router_logits=True)
    plain = [m(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False) for m in (hf, model)]
    out["keyword_off"] = ([type(o).__name__ for o in plain], [float(o.loss) for o in plain])
    return out


def forward_values(folder: str, model) -> dict:
    """(transformers, loongforge) loss and aux_loss with and without an attention mask with pads (a pipelined
    model's forward runs without a graph)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids, mask, labels = _batch()
    out = {}
    for name, m in (("no_mask", None), ("mask", mask)):
        want, got = (x(input_ids=ids, attention_mask=m, labels=labels) for x in (hf, model))
        out[name] = [(float(want.loss), float(got.loss)), (float(want.aux_loss), float(got.aux_loss))]
    return out


# activation recompute with one-row micro-batches, 4 a step: the interleaved pipeline schedule then runs several
# forwards before their backwards, each layer recomputed in its micro-batch's backward
RECOMPUTE = {"gradient_checkpointing": True, "gradient_accumulation_steps": 4, "per_device_train_batch_size": 1}


def one_process(folder: str, out_dir: str, mixtral: str) -> dict:
    """Qwen3-MoE (``folder``) and Mixtral (``mixtral``): training with transformers.Trainer and LoongTrainer, and
    the forward checks."""
    import loongforge_hf as lf

    hf = train_hf(folder, out_dir + "/hf")
    one = train_loong(folder, out_dir + "/lf", {})
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    mixtral_model = lf.AutoModelForCausalLM.from_pretrained(mixtral, dtype=torch.float32)
    out = {"hf": hf, "one": one, "forward": forward_checks(folder, model),
           "forward_mixtral": forward_checks(mixtral, mixtral_model),
           "mixtral_hf": train_hf(mixtral, out_dir + "/mixtral_hf"),
           "mixtral_one": train_loong(mixtral, out_dir + "/mixtral_lf", {}),
           "recompute": train_loong(folder, out_dir + "/recompute", {}, RECOMPUTE)}
    # activation recompute: each forward's backward before the next forward, or refused (a recomputed layer would
    # take the newer forward's tally)
    ids, mask, labels = _batch()
    model.train()
    model.activation_checkpointing_enable()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    try:
        (model(input_ids=ids, labels=labels).loss + model(input_ids=ids, attention_mask=mask, labels=labels).loss
         ).backward()
        out["recompute_two_forwards"] = None
    except RuntimeError as err:
        out["recompute_two_forwards"] = str(err)
    return out


def two_processes(folder: str, out_dir: str) -> dict:
    import loongforge_hf as lf

    layout = {"tensor_parallel_size": 2, "sequence_parallel": True}
    tp2 = train_loong(folder, out_dir + "/tp2", layout)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    out = {"tp2": tp2, "forward_tp2": forward_checks(folder, model)}
    del model
    # NOTE: EP2 is DP2: one micro-batch per rank per step holds the one-process run's two (see the test)
    out["ep2"] = train_loong(folder, out_dir + "/ep2", {"expert_parallel_size": 2}, {"gradient_accumulation_steps": 1})
    out["cp2"] = train_loong(folder, out_dir + "/cp2", {"context_parallel_size": 2})
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    out["forward_cp2"] = forward_checks(folder, model)
    del model
    pp2 = {"pipeline_parallel_size": 2}
    out["pp2"] = train_loong(folder, out_dir + "/pp2", pp2)
    from loongforge_hf.parallel import stage_link

    pp2_link = stage_link._LINK[1]
    # NOTE: 4 layers, layer 0 dense: virtual stage 0 (rank 0's first chunk) has no MoE layer
    vpp = {**pp2, "virtual_pipeline_parallel_size": 2}
    out["vpp_recompute"] = train_loong(folder, out_dir + "/vpp", vpp, RECOMPUTE)
    # the PP2 layout's side-channel groups went when megatron's groups were rebuilt for the VPP layout
    live = torch.distributed.distributed_c10d._world.pg_map
    out["pp2_link_released"] = (pp2_link is not None and stage_link._LINK[1] not in (None, pp2_link)
                                and not any(g in live for g in pp2_link.groups))
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **vpp)
    out["forward_vpp"] = forward_values(folder, model)
    # a forward of the first stage's chunk alone (none of the model's own), then the model's forward again: the
    # chunk sends no sums the next forward's stages would take for theirs
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with torch.no_grad():
            model.chunks[0](torch.randint(4, 200, (2, 16)), torch.arange(16).expand(2, 16), None)
    out["forward_vpp_again"] = forward_values(folder, model)
    return out
