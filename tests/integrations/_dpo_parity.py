"""Rank functions: the same DPO runs with trl.DPOTrainer on the transformers model and with LoongDPOTrainer.

A scenario is (DPOConfig overrides, LoraConfig kwargs or None, whether a reference model is passed); a world runs
several so that the process start-up is paid once. A MoE model's logs carry TRL's ``aux_loss`` after ``METRICS``.
"""

from __future__ import annotations

import torch

WORDS = [f"tok{i}" for i in range(4, 203)]
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "entropy", "mean_token_accuracy", "num_tokens", "grad_norm")

# name -> (DPOConfig overrides, LoraConfig kwargs or None, ref_model passed)
SCENARIOS = {
    "full_ref_model": ({"learning_rate": 2e-3}, None, True),
    "lora_disabled_adapters": ({"learning_rate": 3e-2, "eval_strategy": "steps", "eval_steps": 2,
                                "per_device_eval_batch_size": 2},
                               dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]), False),
    "full_precomputed": ({"learning_rate": 2e-3, "precompute_ref_log_probs": True}, None, False),
}

# TRL 1.16's other loss types, each in a 2-step full fine-tuning run against a passed reference, with label smoothing
# where they read it, each f-divergence with one loss type that takes it, and RPO ("sigmoid" plus "sft", weighted);
# the ones that count tokens also evaluate after each step: name -> DPOConfig overrides
_EVAL_EACH_STEP = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 2}
_LOSS_OVERRIDES = {
    "hinge": {"loss_type": "hinge"}, "ipo": {"loss_type": "ipo", **_EVAL_EACH_STEP},
    "exo_pair": {"loss_type": "exo_pair", "label_smoothing": 1e-3}, "nca_pair": {"loss_type": "nca_pair"},
    "robust_js": {"loss_type": "robust", "label_smoothing": 0.1, "f_divergence_type": "js_divergence"},
    "bco_pair": {"loss_type": "bco_pair"}, "sppo_hard": {"loss_type": "sppo_hard"},
    "aot": {"loss_type": "aot", "label_smoothing": 0.1}, "aot_unpaired": {"loss_type": "aot_unpaired"},
    "apo_zero": {"loss_type": "apo_zero"}, "apo_down": {"loss_type": "apo_down"},
    "discopop_alpha": {"loss_type": "discopop", "discopop_tau": 0.2, "f_divergence_type": "alpha_divergence",
                       "f_alpha_divergence_coef": 0.3},
    "sigmoid_norm_fkl": {"loss_type": "sigmoid_norm", "f_divergence_type": "forward_kl"},
    # an older TRL's rpo_alpha=0.5
    "rpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], **_EVAL_EACH_STEP},
    # WPO: per-pair weights from the policy's per-token log-probs and log sum_v p_v^2
    "wpo": {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.5], "use_weighting": True, **_EVAL_EACH_STEP},
    # LD-DPO: the tokens past the pair's shorter completion times ld_alpha ("sft" reads the plain log-probs)
    "ld_dpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "ld_alpha": 0.3, **_EVAL_EACH_STEP},
}
LOSS_SCENARIOS = {name: ({"learning_rate": 2e-3, "max_steps": 2, **overrides}, None, True)
                  for name, overrides in _LOSS_OVERRIDES.items()}
# padding_free: each micro-batch's chosen and rejected rows packed into one row (TRL 1.16 warns and pads instead, so
# its run with the same config is the padded one); LoRA with the disabled adapters as reference, evaluating, WPO's
# weights and LD-DPO's token weights over the packed rows. use_liger_kernel: the full_ref_model run with TRL's flag
# (liger_kernel is not installed here: TRL's reference is its run without it, see test_dpo)
PACKED_SCENARIOS = {
    "padding_free": ({**SCENARIOS["lora_disabled_adapters"][0], "padding_free": True, "loss_type": ["sigmoid", "ipo"],
                      "loss_weights": [1.0, 0.5], "use_weighting": True, "ld_alpha": 0.3},
                     SCENARIOS["lora_disabled_adapters"][1], False),
    "liger": ({**SCENARIOS["full_ref_model"][0], "use_liger_kernel": True}, None, True),
}
# a Qwen3-MoE loaded without output_router_logits: TRL's own coefficient turns the router balancing loss on
MOE_SCENARIOS = {"moe_router_aux": ({"learning_rate": 2e-3, "router_aux_loss_coef": 0.1, "eval_strategy": "steps",
                                     "eval_steps": 2, "per_device_eval_batch_size": 2}, None, True)}
# the same with padding_free (the balancing loss over the packed row's tokens)
MOE_SCENARIOS["moe_padding_free"] = ({**MOE_SCENARIOS["moe_router_aux"][0], "padding_free": True}, None, True)


def _sentence(g: torch.Generator, low: int, high: int) -> str:
    n = int(torch.randint(low, high, (1,), generator=g))
    return " ".join(WORDS[int(i)] for i in torch.randint(2, len(WORDS), (n,), generator=g))


def make_dataset(n: int = 16, seed: int = 0):
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = [(_sentence(g, 3, 9), " " + _sentence(g, 2, 8), " " + _sentence(g, 2, 8)) for _ in range(n)]
    return datasets.Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows],
                                       "rejected": [r[2] for r in rows]})


def dpo_config(out_dir: str, **overrides):
    import trl

    kw = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
              lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.1, max_grad_norm=1.0, beta=0.1,
              logging_steps=1, seed=0, report_to=[], save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True,
              dataloader_drop_last=True, max_length=24, gradient_checkpointing=False)
    kw.update(overrides)
    return trl.DPOConfig(**kw)


def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


EVAL_METRICS = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies",
                "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected")


def _logs(trainer) -> list[list[float]]:
    return [[h[k] for k in METRICS] + [h[k] for k in ("aux_loss",) if k in h]
            for h in trainer.state.log_history if "loss" in h]


def _eval_logs(trainer) -> list[list[float]]:
    return [[h[k] for k in EVAL_METRICS] + [h[k] for k in ("eval_aux_loss",) if k in h]
            for h in trainer.state.log_history if "eval_loss" in h]


def _eval_dataset(overrides: dict):
    return make_dataset(4, seed=3) if overrides.get("eval_strategy") else None


def run_trl(folder: str, out_dir: str, names: list[str], scenarios: dict = SCENARIOS) -> dict:
    """trl.DPOTrainer (+ PEFT): {scenario: {"logs", "weights" (the trained tensors, HF / PEFT names; rank 0)}}."""
    import peft
    import transformers
    import trl

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    out = {}
    for name in names:
        overrides, lora, with_ref = scenarios[name]
        trainer = trl.DPOTrainer(model=load(), ref_model=load() if with_ref else None,
                                 args=dpo_config(f"{out_dir}/{name}", **overrides), train_dataset=make_dataset(),
                                 eval_dataset=_eval_dataset(overrides), processing_class=_tokenizer(folder),
                                 peft_config=peft.LoraConfig(**lora) if lora else None)
        trainer.train()
        model = trainer.model
        if lora:
            weights = {k: v.detach().cpu().clone() for k, v in peft.get_peft_model_state_dict(model).items()}
        else:  # NOTE: the checkpoint's names (transformers fuses a MoE's experts in memory, one tensor per layer)
            model.save_pretrained(f"{out_dir}/{name}/final")
            weights = saved_tensors(f"{out_dir}/{name}/final")
        out[name] = {"logs": _logs(trainer), "eval_logs": _eval_logs(trainer), "weights": weights}
    return out


def saved_tensors(folder: str) -> dict:
    """Every tensor of a folder's safetensors files."""
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(f"{folder}/*.safetensors"):
        out.update(load_file(f))
    return out


def run_loong(folder: str, out_dir: str, layout: dict, names: list[str], scenarios: dict = SCENARIOS) -> dict:
    """LoongDPOTrainer: {scenario: {"logs", "weights" (the saved model's or adapter's tensors, rank 0)}}."""
    import peft
    import torch.distributed as dist

    import loongforge_hf as lf

    def load():
        return lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)

    out = {}
    for name in names:
        overrides, lora, with_ref = scenarios[name]
        trainer = lf.LoongDPOTrainer(model=load(), ref_model=load() if with_ref else None,
                                     args=dpo_config(f"{out_dir}/{name}", **overrides), train_dataset=make_dataset(),
                                     eval_dataset=_eval_dataset(overrides), processing_class=_tokenizer(folder),
                                     peft_config=peft.LoraConfig(**lora) if lora else None)
        trainer.train()
        trainer.save_model(f"{out_dir}/{name}/final")
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
        result = {"logs": _logs(trainer), "eval_logs": _eval_logs(trainer), "batch_rows": batch["input_ids"].shape[0]}
        if dist.get_rank() == 0:
            result["weights"] = saved_tensors(f"{out_dir}/{name}/final")
        out[name] = result
    return out


def refusals(folder: str, out_dir: str) -> list[str]:
    """The messages LoongDPOTrainer raises for what it does not support."""
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = []
    liger_lm_head = {"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": True}}
    for overrides in ({"loss_type": ["sigmoid", "kto"]}, liger_lm_head,
                      {"use_weighting": True, "loss_type": ["sigmoid", "sft"]}, {}):
        args = dpo_config(out_dir, **overrides)
        if not overrides:
            args.rpo_alpha = 0.5  # NOTE: a field of older TRLs' DPOConfig (TRL 1.16 has none)
        try:
            lf.LoongDPOTrainer(model=model, args=args, train_dataset=make_dataset(4),
                               processing_class=_tokenizer(folder))
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def packed_refusal(folder: str, out_dir: str, layout: dict) -> str:
    """The message LoongDPOTrainer raises for ``padding_free=True`` at ``layout``."""
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    try:
        lf.LoongDPOTrainer(model=model, args=dpo_config(out_dir, padding_free=True), train_dataset=make_dataset(4),
                           processing_class=_tokenizer(folder))
    except ValueError as e:
        return str(e)
    return "no error"


def world(folder: str, out_dir: str, layout: dict, names: list[str], with_trl: bool) -> dict:
    out = {"loong": run_loong(folder, out_dir + "/loong", layout, names)}
    if with_trl:
        out["trl"] = run_trl(folder, out_dir + "/trl", names)
    return out
