"""Rank functions for test_lora_moe.py: LoRA on Qwen3-MoE and Mixtral against PEFT on the transformers model.

``moe_model_checks`` (one layout): logits, loss and adapter gradients (q_proj: column split, o_proj: row split, on an
MoE layer) against ``peft.get_peft_model``; PEFT's parameter counts; megatron's DDP holds only the adapters and
``modules_to_save``, all in its dense buffers (reduced over the dense data-parallel group, none over the expert
one); the adapter folder loads in ``PeftModel.from_pretrained`` and the merged export (the full MoE checkpoint) in
transformers with the Loong model's logits; a PEFT-written adapter loads onto the Loong model with PEFT's logits.
"""

from __future__ import annotations

import torch

from ._lora_checks import _close, _gather_full, export_checks, lora_pair
from ._lora_load import write_peft_adapter

# what PEFT adapts on these models as modules (their experts and router only as target_parameters)
LORA_KW = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False,
               modules_to_save=["post_attention_layernorm", "lm_head"])


def _probe() -> torch.Tensor:
    return torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))


def _check_adapter_grads(model, ref, hf_config) -> None:
    """q_proj of layer 1 (A replicated, B split by heads) and o_proj of layer 2 (A split by columns, B replicated)."""
    from megatron.core import parallel_state as ps

    ref_params = dict(ref.named_parameters())
    heads = hf_config.num_attention_heads
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    chunk = dict(model.chunks[0].named_parameters())
    rows = slice(tp_rank * heads // tp * hd, (tp_rank + 1) * heads // tp * hd)
    prefix, qkv, proj = "base_model.model.model.layers", "self_attention.linear_qkv.lora", "self_attention.linear_proj"
    _close(chunk[f"decoder.layers.1.{qkv}.q_proj.A"].grad,
           ref_params[f"{prefix}.1.self_attn.q_proj.lora_A.default.weight"].grad, "dA q_proj")
    _close(chunk[f"decoder.layers.1.{qkv}.q_proj.B"].grad,
           ref_params[f"{prefix}.1.self_attn.q_proj.lora_B.default.weight"].grad[rows], "dB q_proj")
    _close(_gather_full(chunk[f"decoder.layers.2.{proj}.lora.o_proj.A"].grad, dim=1),
           ref_params[f"{prefix}.2.self_attn.o_proj.lora_A.default.weight"].grad, "dA o_proj")
    _close(chunk[f"decoder.layers.2.{proj}.lora.o_proj.B"].grad,
           ref_params[f"{prefix}.2.self_attn.o_proj.lora_B.default.weight"].grad, "dB o_proj")
    model.zero_grad(set_to_none=True)


def _ddp_groups(model, out_dir: str) -> dict:
    """Which of megatron's DDP buffers hold the trainable parameters, and over how many ranks each reduces."""
    import transformers
    from megatron.core import parallel_state as ps

    from loongforge_hf.trainer.engine import MegatronEngine

    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    engine = MegatronEngine(model, args=transformers.TrainingArguments(out_dir + "/unused", use_cpu=True,
                                                                       report_to=[]))
    dense = {id(p) for c in engine.chunks for b in c.buffers for p in b.params}
    expert = {id(p) for c in engine.chunks for b in c.expert_parallel_buffers for p in b.params}
    groups = {getattr(g, "intra_distributed_optimizer_instance_size", None) or g.data_parallel_group.size()
              for c in engine.chunks for g in c.bucket_groups}
    return {"ddp_holds_trainable_only": {id(p) for c in engine.chunks for p in c.params_with_grad} == trainable,
            "dense_buffers_hold_all": dense == trainable, "expert_buffers_empty": not expert,
            "dense_group_sizes": sorted(groups),
            "data_parallel_size": ps.get_data_parallel_world_size(with_context_parallel=True)}


def moe_model_checks(folder: str, out_dir: str, layout: dict, peft_adapter: str) -> dict:
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import load_adapter

    ids = _probe()
    model, hf, ref = lora_pair(folder, layout, LORA_KW)
    result = {"counts": model.get_nb_trainable_parameters(), "peft_counts": ref.get_nb_trainable_parameters()}

    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    result["logits_diff"] = float((ours.logits - theirs.logits).abs().max())
    result["loss_diff"] = float((ours.loss - theirs.loss).abs())
    if model.parallel.pipeline_parallel_size == 1:
        ours.loss.backward()
        theirs.loss.backward()
        _check_adapter_grads(model, ref, hf.config)
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
}


def one_rank_checks(folders: dict, out_dir: str, adapters: dict) -> dict:
    from ._sft_parity import run_loong, run_trl

    out = {arch: moe_model_checks(folder, f"{out_dir}/{arch}", {}, adapters[arch]) for arch, folder in folders.items()}
    names = list(SFT_SCENARIOS)
    out["sft"] = {"trl": run_trl(folders["qwen3_moe"], out_dir + "/trl", names, SFT_SCENARIOS),
                  "loong": run_loong(folders["qwen3_moe"], out_dir + "/loong", {}, names, SFT_SCENARIOS)}
    return out


TWO_RANK_LAYOUTS = {
    # TP2 with sequence parallelism and EP2 in one layout; experts not split over TP (expert_tensor_parallel_size=1)
    "tp2_sp_ep2": {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2,
                   "expert_tensor_parallel_size": 1},
    # EP2 over a dense data-parallel pair: the adapters reduce over both ranks, the experts over none
    "ep2_dp2": {"expert_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}


def two_rank_checks(folder: str, out_dir: str, adapter: str) -> dict:
    from ._sft_parity import run_loong

    out = {name: moe_model_checks(folder, f"{out_dir}/{name}", layout, adapter)
           for name, layout in TWO_RANK_LAYOUTS.items()}
    out["sft"] = run_loong(folder, out_dir + "/sft", TWO_RANK_LAYOUTS["tp2_sp_ep2"], list(SFT_SCENARIOS),
                           SFT_SCENARIOS)
    return out


def write_peft_adapters(folders: dict, out_dir: str) -> dict:
    adapters = {}
    for arch, folder in folders.items():
        adapters[arch] = f"{out_dir}/{arch}-peft-adapter"
        write_peft_adapter(folder, adapters[arch], LORA_KW)
    return adapters
