"""Rank functions: the same RLOO runs with trl.RLOOTrainer on the transformers model and with LoongRLOOTrainer.

A scenario is RLOOConfig overrides; a world runs several so that the process start-up is paid once. Each run keeps
every metric TRL logs (but its ``step_time``), the completions each rank generated (as the reward function saw them),
on rank 0 the final weights and, for ``EVAL_SCENARIOS``, TRL's ``evaluate()`` metrics (but its timings). The prompts,
reward and tokenizer are the GRPO test's.
"""

from __future__ import annotations

import torch

from ._grpo_parity import _tokenizer, make_dataset, saved_tensors, thirds

SCENARIOS = {
    # no reference; one pass over each generation (the ratios stay 1)
    "rloo_beta0": {"beta": 0.0, "max_steps": 2},
    # the KL penalty in the reward, two passes over each generation (old log-probs, clipping), epsilon_high
    "rloo_kl_iter2": {"beta": 0.1, "num_iterations": 2, "epsilon_high": 0.28},
    # normalised advantages, clipped rewards, the KL penalty
    "rloo_norm_clip": {"beta": 0.05, "normalize_advantages": True, "reward_clip_range": (0.0, 2.0),
                       "num_iterations": 2, "max_steps": 2},
}
# a Qwen3-MoE (loaded without output_router_logits): TRL turns the router balancing loss on with its coefficient.
# NOTE: a smaller learning rate: AdamW's first step moves an expert that saw almost no gradient by the full rate
# whatever its sign's rounding, and the second pass's sequence-level ratios (exp of 6 tokens' summed log-ratio)
# make that visible in the loss at 2e-2 (2e-4 relative apart, entropy and aux_loss 1e-6)
MOE_SCENARIOS = {"rloo_moe_router_aux": {"beta": 0.1, "num_iterations": 2, "max_steps": 2,
                                         "router_aux_loss_coef": 0.1, "learning_rate": 5e-3}}
# LoRA on q / v, the policy with its adapters disabled as the reference (TRL: PEFT's)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
LORA_SCENARIOS = {"rloo_lora": {"beta": 0.1, "num_iterations": 2, "max_steps": 2}}
ALL_SCENARIOS = {**SCENARIOS, **MOE_SCENARIOS, **LORA_SCENARIOS}
# evaluated after training (TRL's evaluate(): generation, rewards and the loss in eval mode over 2 prompts; with the
# MoE router balancing loss in it and its eval_aux_loss)
EVAL_SCENARIOS = ("rloo_kl_iter2", "rloo_moe_router_aux")
NOT_COMPARED = ("step_time", "tokens_per_second", "mfu", "learning_rate", "epoch")


def rloo_config(out_dir: str, **overrides):
    import trl

    kw = dict(output_dir=out_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
              max_completion_length=6, max_steps=3, learning_rate=2e-2, lr_scheduler_type="constant",
              weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, seed=0, report_to=[], save_strategy="no",
              use_cpu=True, bf16=False, disable_tqdm=True, gradient_checkpointing=False, log_completions=False,
              generation_kwargs={"suppress_tokens": [0]}, per_device_eval_batch_size=4)
    kw.update(overrides)
    return trl.RLOOConfig(**kw)


def _recording(seen: list):
    """``thirds``, keeping the completion ids it scores."""
    def reward(completion_ids, **kwargs):
        seen.append([list(ids) for ids in completion_ids])
        return thirds(completion_ids)

    reward.__name__ = "thirds"
    return reward


def _logs(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in NOT_COMPARED} for h in trainer.state.log_history if "loss" in h]


def _run(trainer_cls, model, folder: str, out_dir: str, name: str) -> dict:
    import peft
    import torch.distributed as dist

    seen = []
    trainer = trainer_cls(model=model, reward_funcs=_recording(seen),
                          args=rloo_config(out_dir, **ALL_SCENARIOS[name]), train_dataset=make_dataset(),
                          processing_class=_tokenizer(folder),
                          eval_dataset=make_dataset(2, seed=1) if name in EVAL_SCENARIOS else None,
                          peft_config=peft.LoraConfig(**LORA) if name in LORA_SCENARIOS else None)
    trainer.train()
    result = {"logs": _logs(trainer), "completions": seen}
    if name in LORA_SCENARIOS:  # NOTE: logs only, as the GRPO test's LoRA run
        return result
    trainer.save_model(f"{out_dir}/final")
    if name in EVAL_SCENARIOS:
        timings = ("_runtime", "_second", "_time")
        result["eval"] = {k: v for k, v in trainer.evaluate().items() if not k.endswith(timings)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        result["weights"] = saved_tensors(f"{out_dir}/final")
    return result


def run_trl(folder: str, out_dir: str, names: list[str]) -> dict:
    """trl.RLOOTrainer: {scenario: {"logs", "completions", "weights" (rank 0)}}."""
    import transformers
    import trl

    return {name: _run(trl.RLOOTrainer, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                       folder, f"{out_dir}/{name}", name) for name in names}


def run_loong(folder: str, out_dir: str, layout: dict, names: list[str]) -> dict:
    """LoongRLOOTrainer: {scenario: {"logs", "completions", "weights" (rank 0)}}."""
    import loongforge_hf as lf

    def load():
        return lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)

    return {name: _run(lf.LoongRLOOTrainer, load(), folder, f"{out_dir}/{name}", name) for name in names}


def refusals(folder: str, out_dir: str) -> list[str]:
    """The messages LoongRLOOTrainer raises for what it does not support."""
    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = []
    for overrides in ({"use_vllm": True}, {"sync_ref_model": True}):
        try:
            lf.LoongRLOOTrainer(model=model, reward_funcs=thirds, args=rloo_config(out_dir, **overrides),
                                train_dataset=make_dataset(4), processing_class=_tokenizer(folder))
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages
