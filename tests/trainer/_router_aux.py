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


def _summed_over_token_ranks(model, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's router weight gradients summed over the ranks that split the tokens (see ``_aux_grads``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    groups = [ps.get_tensor_model_parallel_group()] if model.megatron.config.sequence_parallel else []
    groups += [ps.get_context_parallel_group()] if ps.get_context_parallel_world_size() > 1 else []
    for group in groups:
        for g in grads:
            dist.all_reduce(g, group=group)
    return grads


def _router_logits(want, got) -> dict:
    """transformers' ``router_logits`` (``want``) against ours: layer counts, shapes, the largest difference and
    value, and whether they carry grad."""
    pairs = list(zip(want.router_logits, got.router_logits))
    return {"layers": (len(want.router_logits), len(got.router_logits)),
            "shapes": [(tuple(a.shape), tuple(b.shape)) for a, b in pairs],
            "dtypes": [(str(a.dtype), str(b.dtype)) for a, b in pairs],
            "diff": max(float((a - b).abs().max()) for a, b in pairs),
            "size": max(float(a.abs().max()) for a, _ in pairs),
            "requires_grad": ([a.requires_grad for a, _ in pairs], [b.requires_grad for _, b in pairs])}


def _router_logits_grads(model, ids, mask, hf: bool) -> list[torch.Tensor]:
    """The router weights' gradient of an objective on the returned router logits alone (a z-loss-like sum of
    squares; through the hidden states it reaches earlier layers' routers and experts too)."""
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask)
    sum((x.float() ** 2).sum() for x in out.router_logits).backward()
    grads = [w.grad.clone() for w in _router_weights(model, hf)]
    return grads if hf else _summed_over_token_ranks(model, grads)


def _aux_grads(model, ids, mask, labels, hf: bool, objective=lambda out: out.loss) -> list[torch.Tensor]:
    """The router weights' gradient of ``objective(output)`` with output_router_logits minus the loss's without
    (``coef * aux``'s for the plain loss). Under
    sequence parallelism each rank's is its own tokens' part, summed over the tensor-parallel ranks (as megatron's
    finalize_model_grads sums every sequence-parallel replicated weight's); under context parallelism likewise over
    the context-parallel ranks (as the data-parallel reduction with context parallelism does)."""
    grads = []
    for on in (True, False):
        model.config.output_router_logits = on
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        (objective(out) if on else out.loss).backward()
        grads.append([w.grad.clone() for w in _router_weights(model, hf)])
        if not hf:
            _summed_over_token_ranks(model, grads[-1])
    model.config.output_router_logits = True
    return [a - b for a, b in zip(*grads)]


def forward_checks(folder: str, model) -> dict:
    """(transformers, loongforge) pairs: loss, aux_loss and router_logits with and without an attention mask with
    pads, with router_aux_loss_coef=0, under no_grad in eval mode, and the routers' gradient of the balancing term
    and of an objective on the router logits."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids, mask, labels = _batch()
    out = {}
    for name, m in (("no_mask", None), ("mask", mask)):
        want = hf(input_ids=ids, attention_mask=m, labels=labels)
        got = model(input_ids=ids, attention_mask=m, labels=labels)
        out[name] = {"loss": (float(want.loss), float(got.loss)), "aux": (float(want.aux_loss), float(got.aux_loss)),
                     "type": type(got).__name__, "router": _router_logits(want, got)}
    with torch.no_grad():
        want, got = (x(input_ids=ids, attention_mask=mask) for x in (hf, model))
        out["no_grad_no_labels"] = (float(want.aux_loss), float(got.aux_loss))
        out["no_grad_router"] = _router_logits(want, got)
    # router_aux_loss_coef=0: transformers still returns aux_loss and router_logits (its model keeps the coefficient
    # it was built with: set both)
    coef = hf.config.router_aux_loss_coef
    hf.router_aux_loss_coef = hf.config.router_aux_loss_coef = model.config.router_aux_loss_coef = 0.0
    want, got = (x(input_ids=ids, attention_mask=mask, labels=labels) for x in (hf, model))
    out["coef0"] = {"loss": (float(want.loss), float(got.loss)), "aux": (float(want.aux_loss), float(got.aux_loss)),
                    "router": _router_logits(want, got)}
    hf.router_aux_loss_coef = hf.config.router_aux_loss_coef = model.config.router_aux_loss_coef = coef
    want, got = _router_logits_grads(hf, ids, mask, True), _router_logits_grads(model, ids, mask, False)
    out["logits_grad"] = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(want, got))
    out["logits_grad_size"] = min(float(a.abs().max()) for a in want)
    want, got = _aux_grads(hf, ids, mask, labels, True), _aux_grads(model, ids, mask, labels, False)
    out["grad"] = [float((a - b).abs().max() / a.abs().max()) for a, b in zip(want, got)]
    out["grad_size"] = [float(a.abs().max()) for a in want]
    # the routers' gradient follows what is backpropagated, as transformers': a loss scaled after the forward
    # (gradient accumulation's 1 / steps), and an objective that leaves the term out (no balancing gradient then)
    for name, objective in (("scaled", lambda o: 0.25 * o.loss + 0.75 * o.loss.detach()),
                            ("without_aux", lambda o: o.loss - coef * o.aux_loss)):
        want, got = (_aux_grads(m, ids, mask, labels, m is hf, objective) for m in (hf, model))
        out[name] = max(float((a - b).abs().max()) for a, b in zip(want, got)) / max(out["grad_size"])
    # the forward keyword overrides the config, as in transformers (the config says output_router_logits=True)
    plain = [m(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False) for m in (hf, model)]
    out["keyword_off"] = ([type(o).__name__ for o in plain], [float(o.loss) for o in plain],
                          [o.router_logits for o in plain])
    # and turns it on over a config without it
    for m in (hf, model):
        m.config.output_router_logits = False
    with torch.no_grad():
        want, got = (x(input_ids=ids, output_router_logits=True) for x in (hf, model))
    out["keyword_on"] = _router_logits(want, got)
    for m in (hf, model):
        m.config.output_router_logits = True
    return out


def forward_values(folder: str, model) -> dict:
    """(transformers, loongforge) loss and aux_loss with and without an attention mask with pads, and the router
    logits (a pipelined model's forward runs without a graph)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids, mask, labels = _batch()
    out = {}
    for name, m in (("no_mask", None), ("mask", mask)):
        want, got = (x(input_ids=ids, attention_mask=m, labels=labels) for x in (hf, model))
        out[name] = [(float(want.loss), float(got.loss)), (float(want.aux_loss), float(got.aux_loss))]
        out[name + "_router"] = _router_logits(want, got)
    return out


# activation recompute with one-row micro-batches, 4 a step: the interleaved pipeline schedule then runs several
# forwards before their backwards, each layer recomputed in its micro-batch's backward
RECOMPUTE = {"gradient_checkpointing": True, "gradient_accumulation_steps": 4, "per_device_train_batch_size": 1}


def one_process(folder: str, out_dir: str, mixtral: str, ernie: str, olmoe: str) -> dict:
    """Qwen3-MoE (``folder``), Mixtral (``mixtral``), ERNIE 4.5 MoE (``ernie``) and OLMoE (``olmoe``): training with
    transformers.Trainer and LoongTrainer, and the forward checks."""
    import loongforge_hf as lf

    hf = train_hf(folder, out_dir + "/hf")
    one = train_loong(folder, out_dir + "/lf", {})
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = {"hf": hf, "one": one, "forward": forward_checks(folder, model),
           "recompute": train_loong(folder, out_dir + "/recompute", {}, RECOMPUTE)}
    for name, other in (("mixtral", mixtral), ("ernie", ernie), ("olmoe", olmoe)):
        other_model = lf.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
        out[f"forward_{name}"] = forward_checks(other, other_model)
        out[f"{name}_hf"] = train_hf(other, f"{out_dir}/{name}_hf")
        out[f"{name}_one"] = train_loong(other, f"{out_dir}/{name}_lf", {})
    # activation recompute: each forward's backward before the next forward, or refused (a recomputed layer would
    # take the newer forward's tally)
    ids, mask, labels = _batch()
    import transformers

    want = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(
        input_ids=ids, attention_mask=mask, labels=labels)
    model.train()
    model.activation_checkpointing_enable()
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    got.loss.backward()
    out["recompute_router"] = _router_logits(want, got)  # NOTE: the checkpointed layers ran without grad
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
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, expert_parallel_size=2)
    out["forward_ep2"] = forward_values(folder, model)
    del model
    out["cp2"] = train_loong(folder, out_dir + "/cp2", {"context_parallel_size": 2})
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, context_parallel_size=2)
    out["forward_cp2"] = forward_checks(folder, model)
    del model
    pp2 = {"pipeline_parallel_size": 2}
    out["pp2"] = train_loong(folder, out_dir + "/pp2", pp2)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **pp2)
    out["forward_pp2"] = forward_values(folder, model)
    del model
    from loongforge_hf.parallel import stage_link

    pp2_link = stage_link._LINK[1]
    # NOTE: 4 layers, layer 0 dense: virtual stage 0 (rank 0's first chunk) has no MoE layer
    vpp = {**pp2, "virtual_pipeline_parallel_size": 2}
    out["vpp_recompute"] = train_loong(folder, out_dir + "/vpp", vpp, RECOMPUTE)
    # megatron's groups were rebuilt for the VPP layout; its pipelines are PP2's: the same side-channel groups
    out["vpp_reuses_pp2_link"] = pp2_link is not None and stage_link._LINK[1] is pp2_link
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


def four_processes(folder: str, out_dir: str) -> dict:
    """The 4-process products, one layout after another (each ``from_pretrained`` rebuilds megatron's groups):
    LoongTrainer's runs and the forwards against transformers'."""
    import loongforge_hf as lf

    def model(layout: dict):
        return lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)

    pp2 = {"pipeline_parallel_size": 2}
    pp4 = {"pipeline_parallel_size": 4}  # NOTE: 4 layers, layer 0 dense: the first stage has no MoE layer
    pp2_tp2 = {**pp2, "tensor_parallel_size": 2, "sequence_parallel": True}
    pp2_cp2 = {**pp2, "context_parallel_size": 2}
    tp2_cp2 = {"tensor_parallel_size": 2, "sequence_parallel": True, "context_parallel_size": 2}
    tp2_ep2 = {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2}
    # model parallel only: one process's batches
    out = {"pp4": train_loong(folder, out_dir + "/pp4", pp4),
           "forward_pp4": forward_values(folder, model(pp4)),
           "pp2_tp2": train_loong(folder, out_dir + "/pp2_tp2", pp2_tp2),
           "forward_pp2_tp2": forward_values(folder, model(pp2_tp2)),
           "pp2_cp2": train_loong(folder, out_dir + "/pp2_cp2", pp2_cp2, RECOMPUTE),
           "forward_pp2_cp2": forward_values(folder, model(pp2_cp2)),
           "forward_tp2_cp2": forward_checks(folder, model(tp2_cp2))}
    # NOTE: data parallel 2 (EP2 implies it); rank r takes the loader's micro-batches r, r + 2, ...: with half the
    # accumulation steps a step trains the one-process run's micro-batches (see the test)
    out["tp2_ep2"] = train_loong(folder, out_dir + "/tp2_ep2", tp2_ep2, {"gradient_accumulation_steps": 1})
    data_parallel = {**RECOMPUTE, "gradient_accumulation_steps": 2}
    for name, layout in (("pp2_dp2", pp2), ("pp2_ep2", {**pp2, "expert_parallel_size": 2}),
                         ("pp2_vpp2_dp2", {**pp2, "virtual_pipeline_parallel_size": 2})):
        out[name] = train_loong(folder, f"{out_dir}/{name}", layout, data_parallel)
    return out
