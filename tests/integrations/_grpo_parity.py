"""Rank functions: the same GRPO runs with trl.GRPOTrainer on the transformers model and with LoongGRPOTrainer.

A scenario is GRPOConfig overrides; a world runs several so that the process start-up is paid once. Generation is
each trainer's own (transformers' sampling, seeded as TRL seeds it), so the completions are the same as long as the
logits are.
"""

from __future__ import annotations

import torch

WORDS = [f"tok{i}" for i in range(4, 203)]
METRICS = ("loss", "grad_norm", "reward", "reward_std", "rewards/thirds/mean", "rewards/thirds/std",
           "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "num_tokens", "entropy")
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                "clip_ratio/region_mean")
OTHER_METRICS = ("kl", "cispo_clip_ratio", "vespo/phi_seq_mean", "aux_loss")

SCENARIOS = {
    "grpo_beta0": {"loss_type": "grpo", "beta": 0.0},
    "grpo_kl_iter2": {"loss_type": "grpo", "beta": 0.1, "num_iterations": 2},
    "dapo_kl_iter2": {"loss_type": "dapo", "beta": 0.05, "num_iterations": 2, "epsilon_high": 0.28,
                      "scale_rewards": "batch"},
}
# TRL 1.16's other loss types, 2 steps (one generation, two passes over it: old log-probs, ratios away from 1) at
# DP=2 against trl.GRPOTrainer under DDP; with the sequence-level importance ratios, two-sided clipping (delta), the
# off-policy mask and the bias-corrected KL among them
_ITER2 = {"num_iterations": 2, "max_steps": 2}
LOSS_SCENARIOS = {
    "bnpo_delta_off_policy": {"loss_type": "bnpo", "delta": 1.1, "off_policy_mask_threshold": 1e-3, **_ITER2},
    "dr_grpo_bias_kl": {"loss_type": "dr_grpo", "beta": 0.1, "use_bias_correction_kl": True, **_ITER2},
    "luspo_sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon": 0.05, **_ITER2},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.1, **_ITER2},
    "sapo_kl": {"loss_type": "sapo", "beta": 0.05, **_ITER2},
    "vespo": {"loss_type": "vespo", **_ITER2},
}
# a Qwen3-MoE (loaded without output_router_logits): TRL turns the router balancing loss on with its coefficient
MOE_SCENARIOS = {"moe_router_aux": {"loss_type": "grpo", "beta": 0.1, "num_iterations": 2, "max_steps": 2,
                                    "router_aux_loss_coef": 0.1}}
ALL_SCENARIOS = {**SCENARIOS, **LOSS_SCENARIOS, **MOE_SCENARIOS}
# evaluated after training (TRL's evaluate(): generation, rewards and the loss in eval mode over 2 prompts; with the
# MoE router balancing loss in it and its eval_aux_loss)
EVAL_SCENARIOS = ("grpo_kl_iter2", "dapo_kl_iter2", "moe_router_aux")


def thirds(completion_ids, **kwargs) -> list[float]:
    """A deterministic reward: how many completion tokens have an id divisible by 3."""
    return [float(sum(1 for t in ids if t % 3 == 0)) for ids in completion_ids]


def make_dataset(n: int = 8, seed: int = 0):
    import datasets

    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        k = int(torch.randint(2, 6, (1,), generator=g))
        prompts.append(" ".join(WORDS[int(i)] for i in torch.randint(2, len(WORDS), (k,), generator=g)))
    return datasets.Dataset.from_dict({"prompt": prompts})


def grpo_config(out_dir: str, **overrides):
    import trl

    kw = dict(output_dir=out_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
              max_completion_length=6, max_steps=3, learning_rate=2e-2, lr_scheduler_type="constant",
              weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, seed=0, report_to=[], save_strategy="no",
              use_cpu=True, bf16=False, disable_tqdm=True, gradient_checkpointing=False, log_completions=False,
              generation_kwargs={"suppress_tokens": [0]}, per_device_eval_batch_size=4)
    kw.update(overrides)
    return trl.GRPOConfig(**kw)


def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _logs(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if k in METRICS + CLIP_METRICS + OTHER_METRICS}
            for h in trainer.state.log_history if "loss" in h]


def _eval_dataset(name: str):
    return make_dataset(2, seed=1) if name in EVAL_SCENARIOS else None


def _evaluated(trainer, name: str, result: dict) -> dict:
    """``result`` with TRL's evaluation metrics where the scenario evaluates (but the timings: runtime, per second,
    model preparation)."""
    if name in EVAL_SCENARIOS:
        timings = ("_runtime", "_second", "_time")
        result["eval"] = {k: v for k, v in trainer.evaluate().items() if not k.endswith(timings)}
    return result


def saved_tensors(folder: str) -> dict:
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(f"{folder}/*.safetensors"):
        out.update(load_file(f))
    return out


def run_trl(folder: str, out_dir: str, names: list[str]) -> dict:
    """trl.GRPOTrainer: {scenario (of ``ALL_SCENARIOS``): {"logs", "weights"}}."""
    import transformers
    import trl

    out = {}
    for name in names:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        args = grpo_config(f"{out_dir}/{name}", **ALL_SCENARIOS[name])
        trainer = trl.GRPOTrainer(model=model, reward_funcs=thirds, args=args, train_dataset=make_dataset(),
                                  eval_dataset=_eval_dataset(name), processing_class=_tokenizer(folder))
        trainer.train()
        trainer.model.save_pretrained(f"{out_dir}/{name}/final")
        out[name] = _evaluated(trainer, name, {"logs": _logs(trainer),
                                               "weights": saved_tensors(f"{out_dir}/{name}/final")})
    return out


def run_loong(folder: str, out_dir: str, layout: dict, names: list[str]) -> dict:
    """LoongGRPOTrainer: {scenario: {"logs", "weights" (rank 0)}}."""
    import torch.distributed as dist

    import loongforge_hf as lf

    out = {}
    for name in names:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        trainer = lf.LoongGRPOTrainer(model=model, reward_funcs=thirds,
                                      args=grpo_config(f"{out_dir}/{name}", **ALL_SCENARIOS[name]),
                                      train_dataset=make_dataset(), eval_dataset=_eval_dataset(name),
                                      processing_class=_tokenizer(folder))
        trainer.train()
        trainer.save_model(f"{out_dir}/{name}/final")
        result = {"logs": _logs(trainer)}
        if dist.get_rank() == 0:
            result["weights"] = saved_tensors(f"{out_dir}/{name}/final")
        out[name] = _evaluated(trainer, name, result)
    return out


def refused_vpp_accumulation(folder: str, out_dir: str) -> str:
    """The message LoongGRPOTrainer raises for virtual pipeline stages (PP=2 x VPP=2, two ranks) with
    gradient_accumulation_steps=1 (megatron's interleaved schedule takes groups of pipeline_parallel_size)."""
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2,
                                                    virtual_pipeline_parallel_size=2)
    try:
        lf.LoongGRPOTrainer(model=model, reward_funcs=thirds, args=grpo_config(out_dir, gradient_accumulation_steps=1),
                            train_dataset=make_dataset(4), processing_class=_tokenizer(folder))
    except ValueError as e:
        return str(e)
    return "no error"


def refusals(folder: str, out_dir: str) -> list[str]:
    """The messages LoongGRPOTrainer raises for what it does not support."""
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = []
    for overrides in ({"use_vllm": True}, {"use_liger_kernel": True}, {"entropy_coef": 0.1},
                      {"top_entropy_quantile": 0.5}):
        try:
            lf.LoongGRPOTrainer(model=model, reward_funcs=thirds, args=grpo_config(out_dir, **overrides),
                                train_dataset=make_dataset(4), processing_class=_tokenizer(folder))
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
LORA_SCENARIO = {"loss_type": "grpo", "beta": 0.1, "num_iterations": 2, "learning_rate": 2e-2}


def run_lora(folder: str, out_dir: str) -> dict:
    """LoRA with the adapters disabled as the reference: trl.GRPOTrainer + PEFT and LoongGRPOTrainer, their logs."""
    import peft
    import transformers
    import trl

    import loongforge_hf as lf

    def load(cls):
        return cls.from_pretrained(folder, dtype=torch.float32)

    out = {}
    for kind, trainer_cls, model_cls in (("trl", trl.GRPOTrainer, transformers.AutoModelForCausalLM),
                                         ("loong", lf.LoongGRPOTrainer, lf.AutoModelForCausalLM)):
        args = grpo_config(f"{out_dir}/{kind}", **LORA_SCENARIO)
        trainer = trainer_cls(model=load(model_cls), reward_funcs=thirds, args=args,
                              train_dataset=make_dataset(), processing_class=_tokenizer(folder),
                              peft_config=peft.LoraConfig(**LORA))
        trainer.train()
        out[kind] = _logs(trainer)
    return out
