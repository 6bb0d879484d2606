"""Rank functions for test_lora_moe.py: LoRA on Qwen3-MoE and Mixtral against PEFT on the transformers model.

``moe_model_checks`` (one layout): logits, loss and adapter gradients (every attention adapter of layers 1-2, column
and row split; expert and router adapters of layer 1) against ``peft.get_peft_model``; PEFT's parameter counts;
megatron's DDP holds only the adapters and ``modules_to_save``, the expert adapters in its expert buffers and the
others in its dense ones; the adapter folder loads in ``PeftModel.from_pretrained`` and the merged export (the full
MoE checkpoint) in transformers with the Loong model's logits; a PEFT-written adapter loads onto the Loong model with
PEFT's logits.
"""

from __future__ import annotations

import torch

from ._lora_checks import _close, export_checks, lora_pair
from ._lora_grads import expert_adapter_grads, module_adapter_grads, whole_adapter_grads
from ._lora_load import write_peft_adapter

# the attention projections (modules in PEFT) with modules_to_save
LORA_KW = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False,
               modules_to_save=["post_attention_layernorm", "lm_head"])
# the routed experts (and router) that PEFT adapts as parameters: its rewrite of the names turns them into
# target_parameters (gate_up_proj with r and alpha doubled); init_lora_weights=False keeps B random, so the experts'
# adapters change the logits
EXPERT_KW = {
    # attention, experts and router
    "all_linear": dict(r=2, lora_alpha=6, target_modules="all-linear", init_lora_weights=False),
    # experts only (none of Qwen3-MoE's dense first-layer MLP: PEFT's rewrite takes these names away from modules),
    # with norms trained whole
    "experts": dict(r=3, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"],
                    init_lora_weights=False, modules_to_save=["post_attention_layernorm"]),
}
MIXTRAL_EXPERT_KW = dict(r=2, lora_alpha=5, target_modules=["q_proj", "w1", "w2", "w3", "gate"],
                         init_lora_weights=False)


def _probe() -> torch.Tensor:
    return torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))


def _grad_close(ours, theirs, what: str, scale_tol: float | None) -> None:
    """``_close`` at its 1e-5, or (``scale_tol``) within ``scale_tol`` of the reference's largest entry."""
    if scale_tol is None:
        _close(ours, theirs, what)
    else:
        _close(ours, theirs, what, atol=scale_tol * float(theirs.abs().max()), rtol=0.0)


def _check_adapter_grads(model, ref, layers: tuple[int, ...] = (1, 2), scale_tol: float | None = None) -> None:
    """Every module adapter of ``layers`` against PEFT's gradient, sliced as the rank holds it
    (``_lora_grads.module_adapter_grads``)."""
    from loongforge_hf.lora.model import PARAM_KINDS

    targets = [t for t in model.lora_plan.targets if t.kind not in PARAM_KINDS and t.layer in layers]
    checked = 0
    for name, f, ours, theirs in module_adapter_grads(model, ref, targets):
        _grad_close(ours, theirs, f"d{f} {name}", scale_tol)
        checked += 1
    assert checked >= 4, checked


def _check_expert_grads(model, ref, layer: int = 1, scale_tol: float | None = None) -> None:
    """Expert, router and shared-expert-gate adapter gradients of ``layer`` against PEFT's (this rank's experts of
    PEFT's stacks: ``_lora_grads.expert_adapter_grads``; the others ``whole_adapter_grads``)."""
    ref_params = dict(ref.named_parameters())
    checked = 0
    for t in model.lora_plan.targets:
        if t.layer != layer or t.kind not in ("experts", "router", "shared_gate"):
            continue
        # NOTE: shared_gate: Qwen2-MoE's shared_expert_gate
        pairs = expert_adapter_grads(model, ref_params, t) if t.kind == "experts" else \
            whole_adapter_grads(model, ref_params, t)
        for f, a, b in pairs:
            _grad_close(a, b, f"d{f} {t.hf_module}", scale_tol)
            checked += 1
    assert checked >= 2, checked


def _sum_dense_grads_over_cp(model) -> None:
    """Under context parallelism each rank's dense gradients hold its sequence share's part; megatron's DDP sums them
    over the CP ranks (within its data-parallel group). Experts' adapters see every rank's tokens through the
    dispatcher already."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return
    for p in model.parameters():
        if p.grad is not None and getattr(p, "allreduce", True):
            dist.all_reduce(p.grad, group=ps.get_context_parallel_group())


def _ddp_groups(model, out_dir: str) -> dict:
    """Which of megatron's DDP buffers hold the trainable parameters, and over how many ranks each reduces."""
    import transformers
    from megatron.core import parallel_state as ps

    from loongforge_hf.trainer.engine import MegatronEngine

    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    engine = MegatronEngine(model, args=transformers.TrainingArguments(out_dir + "/unused", use_cpu=True,
                                                                       report_to=[]))
    # expert adapters under expert parallelism, or with the experts whole on each TP rank (marked by the engine),
    # reduce over the expert-data-parallel group, as the experts do
    experts = {id(p) for p in model.parameters() if p.requires_grad and not getattr(p, "allreduce", True)}
    dense = {id(p) for c in engine.chunks for b in c.buffers for p in b.params}
    expert = {id(p) for c in engine.chunks for b in c.expert_parallel_buffers for p in b.params}
    groups = {getattr(g, "intra_distributed_optimizer_instance_size", None) or g.data_parallel_group.size()
              for c in engine.chunks for g in c.bucket_groups}
    return {"ddp_holds_trainable_only": {id(p) for c in engine.chunks for p in c.params_with_grad} == trainable,
            "dense_buffers_hold_all": dense == trainable - experts, "expert_buffers_hold": expert == experts,
            "expert_adapters": len(experts), "dense_group_sizes": sorted(groups),
            "data_parallel_size": ps.get_data_parallel_world_size(with_context_parallel=True)}


def moe_model_checks(folder: str, out_dir: str, layout: dict, peft_adapter: str, lora_kw: dict = LORA_KW, *,
                     grad_scale_tol: float | None = None) -> dict:
    """The checks of the module docstring; adapter gradients within 1e-5 or, with ``grad_scale_tol``, within that
    fraction of each reference gradient's largest entry."""
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import load_adapter

    ids = _probe()
    model, hf, ref = lora_pair(folder, layout, lora_kw)
    result = {"counts": model.get_nb_trainable_parameters(), "peft_counts": ref.get_nb_trainable_parameters()}

    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    result["logits_diff"] = float((ours.logits - theirs.logits).abs().max())
    result["loss_diff"] = float((ours.loss - theirs.loss).abs())
    if model.parallel.pipeline_parallel_size == 1:
        ours.loss.backward()
        theirs.loss.backward()
        _sum_dense_grads_over_cp(model)
        if any(t.kind in ("experts", "router", "shared_gate") for t in model.lora_plan.targets):
            _check_expert_grads(model, ref, scale_tol=grad_scale_tol)
        if any(t.kind not in ("experts", "router", "shared_gate") for t in model.lora_plan.targets):
            _check_adapter_grads(model, ref, scale_tol=grad_scale_tol)
        model.zero_grad(set_to_none=True)
    result.update(_ddp_groups(model, out_dir))

    result.update(export_checks(model, folder, out_dir, ids, ours.logits))

    # a PEFT-written adapter (random B): frozen as transformers loads an adapter folder, and trainable
    with torch.no_grad():
        expected = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), peft_adapter)(
            input_ids=ids, labels=ids)
        frozen = lf.AutoModelForCausalLM.from_pretrained(peft_adapter, dtype=torch.float32, **layout)
        got = frozen(input_ids=ids, labels=ids)
    result["peft_adapter"] = {"class": type(frozen).__name__,
                              "trainable": sum(p.requires_grad for p in frozen.parameters()),
                              "logits_diff": float((got.logits - expected.logits).abs().max()),
                              "loss_diff": float((got.loss - expected.loss).abs())}
    trainable = load_adapter(lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout),
                             peft_adapter, is_trainable=True)
    result["peft_adapter"]["counts"] = trainable.get_nb_trainable_parameters()
    return result


# SFT scenarios as _sft_parity.SCENARIOS: (dataset kind, SFTConfig overrides, LoraConfig kwargs)
SFT_SCENARIOS = {
    "lora_attention": ("text", {"learning_rate": 1e-1},
                       dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                            task_type="CAUSAL_LM")),
    # transformers' router load-balancing loss (the router frozen): its gradient reaches the attention adapters
    "lora_norms_balance": ("text", {"learning_rate": 1e-1, "router_aux_loss_coef": 0.1},
                           dict(r=4, lora_alpha=16, use_rslora=True, modules_to_save=["norm"], task_type="CAUSAL_LM",
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    # TRL users' usual config: attention, routed experts and router (PEFT's target_parameters), PEFT's init; the
    # router balancing loss's gradient reaches the router's adapter too
    "lora_all_linear": ("text", {"learning_rate": 1e-1, "router_aux_loss_coef": 0.1},
                        dict(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")),
}

# LoRA on the routed experts alone, as PEFT users name them (target_parameters): where the experts have their own
# gradient buffers (EP2; TP2 with expert_tensor_parallel_size=1) nothing dense trains and megatron's dense optimizer
# is a stub. Clipped (max_grad_norm below the grad norms), so the norm over the expert optimizer's group counts; a
# learning rate at which TP2's other summation order stays within 1e-7 (at 1e-1 Adam's steps amplify it to 3e-4 of
# the grad norm by the third step).
EXPERTS_ONLY = ("text", {"learning_rate": 1e-2, "max_grad_norm": 0.02},
                dict(r=4, lora_alpha=8, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                     task_type="CAUSAL_LM"))
# two-rank layout -> gradient_accumulation_steps of the one-process run with the same global batches
EXPERTS_ONLY_LAYOUTS = {
    "ep2_dp2": ({"expert_parallel_size": 2}, 4),
    "tp2_sp_etp1": ({"tensor_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1}, 2),
}

# (arch, LoraConfig kwargs) of the model checks, by name
ONE_RANK_CASES = {"qwen3_moe/attention": ("qwen3_moe", LORA_KW), "mixtral/attention": ("mixtral", LORA_KW),
                  **{f"qwen3_moe/{k}": ("qwen3_moe", kw) for k, kw in EXPERT_KW.items()},
                  "mixtral/experts": ("mixtral", MIXTRAL_EXPERT_KW)}
TWO_RANK_CASES = {"attention": LORA_KW, **EXPERT_KW}


def one_rank_checks(folders: dict, out_dir: str, adapters: dict) -> dict:
    from ._sft_parity import run_loong, run_trl

    out = {name: moe_model_checks(folders[arch], f"{out_dir}/{name}", {}, adapters[name], kw)
           for name, (arch, kw) in ONE_RANK_CASES.items()}
    names = list(SFT_SCENARIOS)
    out["sft"] = {"trl": run_trl(folders["qwen3_moe"], out_dir + "/trl", names, SFT_SCENARIOS),
                  "loong": run_loong(folders["qwen3_moe"], out_dir + "/loong", {}, names, SFT_SCENARIOS)}
    out["experts_only"] = {
        accumulate: run_loong(folders["qwen3_moe"], f"{out_dir}/experts-only-{accumulate}", {}, ["experts_only"],
                              {"experts_only": EXPERTS_ONLY}, gradient_accumulation_steps=accumulate)["experts_only"]
        for accumulate in sorted({a for _, a in EXPERTS_ONLY_LAYOUTS.values()})}
    return out


TWO_RANK_LAYOUTS = {
    # TP2 with sequence parallelism and EP2 in one layout; experts not split over TP (expert_tensor_parallel_size=1)
    "tp2_sp_ep2": {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2,
                   "expert_tensor_parallel_size": 1},
    # EP2 over a dense data-parallel pair: the adapters reduce over both ranks, the experts over none
    "ep2_dp2": {"expert_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    # each rank half of every sequence (two of its four chunks), the experts split over the same two ranks
    "cp2_ep2": {"context_parallel_size": 2, "expert_parallel_size": 2},
}


def two_rank_checks(folder: str, out_dir: str, adapters: dict) -> dict:
    from ._sft_parity import resume_matches_uninterrupted, run_loong

    out = {f"{name}/{case}": moe_model_checks(folder, f"{out_dir}/{name}-{case}", layout,
                                              adapters[f"qwen3_moe/{case}"], kw)
           for name, layout in TWO_RANK_LAYOUTS.items() for case, kw in TWO_RANK_CASES.items()}
    out["refused"] = _refusals(folder)
    # LoRA on the routed experts alone where they have their own optimizer (the dense one a stub): trained, its
    # adapter folder read by PEFT, and at EP2 a checkpoint resumed
    out["experts_only"] = {
        name: run_loong(folder, f"{out_dir}/experts-only-{name}", layout, ["experts_only"],
                        {"experts_only": EXPERTS_ONLY}, gradient_accumulation_steps=2)["experts_only"]
        for name, (layout, _) in EXPERTS_ONLY_LAYOUTS.items()}
    out["experts_only_resume"] = resume_matches_uninterrupted(
        folder, out_dir + "/experts-only-resume", EXPERTS_ONLY_LAYOUTS["ep2_dp2"][0], EXPERTS_ONLY[2],
        **EXPERTS_ONLY[1])
    # expert adapters under EP2 over two data-parallel ranks train as without expert parallelism (DP2): their
    # gradients reduce over the expert-data-parallel group and are scaled as the dense ones
    out["sft_dp2"] = {name: run_loong(folder, f"{out_dir}/sft-{name}", layout, ["lora_all_linear"], SFT_SCENARIOS)
                      for name, layout in (("dp2", {}), ("ep2_dp2", TWO_RANK_LAYOUTS["ep2_dp2"]))}
    # a LoRA checkpoint with expert and router adapters (megatron dist-checkpointing) resumes exactly
    out["resume"] = resume_matches_uninterrupted(folder, out_dir + "/resume", TWO_RANK_LAYOUTS["tp2_sp_ep2"])
    out["sft"] = run_loong(folder, out_dir + "/sft", TWO_RANK_LAYOUTS["tp2_sp_ep2"], list(SFT_SCENARIOS),
                           SFT_SCENARIOS)
    return out


def four_rank_checks(folder: str, out_dir: str) -> dict:
    """EP2 x PP2 with the routed experts and the final norm (on the last stage) trained: the first stage trains
    nothing dense, the last does, so megatron gives the first stage's dense optimizer empty groups (rank 0's among
    them, whose state a checkpoint writes). A checkpoint at step 2 resumes."""
    from ._sft_parity import resume_matches_uninterrupted

    layout = {"expert_parallel_size": 2, "pipeline_parallel_size": 2}
    lora = {**EXPERTS_ONLY[2], "modules_to_save": ["model.norm"]}
    return {"resume": resume_matches_uninterrupted(folder, out_dir + "/resume", layout, lora, **EXPERTS_ONLY[1])}


def _refusals(folder: str) -> dict:
    """Expert adapters refused on every rank, with the message: experts split over expert-tensor parallelism (TP2's
    default)."""
    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import LoraConfigError, get_peft_model

    cases = {"etp2": ({"tensor_parallel_size": 2, "sequence_parallel": True}, EXPERT_KW["experts"])}
    out = {}
    for name, (layout, kw) in cases.items():
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        try:
            get_peft_model(model, peft.LoraConfig(**kw))
            out[name] = "not refused"
        except LoraConfigError as err:
            out[name] = str(err)
    return out


def write_peft_adapters(folders: dict, out_dir: str) -> dict:
    """A PEFT-written adapter (random factors) for every model-check case, by case name."""
    adapters = {}
    for name, (arch, kw) in ONE_RANK_CASES.items():
        adapters[name] = f"{out_dir}/{name.replace('/', '-')}-peft-adapter"
        write_peft_adapter(folders[arch], adapters[name], kw)
    return adapters
