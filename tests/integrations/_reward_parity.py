"""Rank functions: lf.AutoModelForSequenceClassification against transformers' classifier, and the same reward-model
runs with trl.RewardTrainer on the transformers model and with LoongRewardTrainer.

A world runs all of its checks so that the process start-up is paid once; each returns plain numbers / tensors.
"""

from __future__ import annotations

import torch

from ._dpo_parity import make_dataset, saved_tensors

METRICS = ("loss", "grad_norm", "min_reward", "mean_reward", "max_reward", "accuracy", "margin", "num_tokens")
EVAL_METRICS = ("eval_loss", "eval_min_reward", "eval_mean_reward", "eval_max_reward", "eval_accuracy",
                "eval_margin")

# name -> RewardConfig overrides, dataset kind ("explicit": prompt / chosen / rejected; "implicit_margin": chosen /
# rejected holding the prompt, and a margin column)
SCENARIOS = {
    "explicit": ({"learning_rate": 5e-4}, "explicit"),
    "implicit_margin_center": ({"learning_rate": 5e-4, "center_rewards_coefficient": 0.05, "eval_strategy": "steps",
                                "eval_steps": 2, "per_device_eval_batch_size": 2}, "implicit_margin"),
    "lora": ({"learning_rate": 2e-2, "eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 2},
             "explicit"),
}
# name -> LoraConfig kwargs (PEFT's SEQ_CLS: the score head trained whole beside the adapters)
LORA = {"lora": dict(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules="all-linear")}


def make_classifier(causal: str, folder: str, *, num_labels: int = 1, seed: int = 1) -> str:
    """transformers' sequence classifier of ``causal`` (its score drawn with ``seed``), saved with the tokenizer."""
    import shutil
    from pathlib import Path

    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(causal, num_labels=num_labels,
                                                                            dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.2)  # NOTE: rewards of a size that moves the loss
    model.save_pretrained(folder)
    for f in Path(causal).glob("tokenizer*"):
        shutil.copy(f, folder)
    return folder


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Four rows of 11 tokens: full, right-padded, left-padded, both (pad id 0, as the tiny configs)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 200, (4, 11), generator=g)
    ids[1, 7:] = 0
    ids[2, :4] = 0
    ids[3, :2] = 0
    ids[3, 9:] = 0
    return ids, (ids != 0).long()


def classifier_checks(causal: dict[str, str], out_dir: str, layout: dict) -> dict:
    """Per architecture: pooled logits of lf's classifier and transformers' (score copied from ours), losses of
    regression (num_labels=1) and 3-label single- / multi-label classification, the export's tensors and transformers'
    logits on it, loading info, and a sequence classifier's checkpoint loaded with its own score."""
    import os

    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf

    ids, mask = _inputs()
    out = {}
    for arch, folder in causal.items():
        res = {}
        for labels in (1, 3):
            # NOTE: seeded as transformers is; rank 1 elsewhere: the head is rank 0's draw on every rank
            torch.manual_seed(10 + labels + int(os.environ["RANK"]))
            model, info = lf.AutoModelForSequenceClassification.from_pretrained(
                folder, num_labels=labels, dtype=torch.float32, output_loading_info=True, **layout)
            ours_rng = torch.random.get_rng_state()
            torch.manual_seed(10 + labels)
            ref = transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=labels,
                                                                                  dtype=torch.float32)
            res[f"rng_after{labels}"] = torch.equal(ours_rng, torch.random.get_rng_state())
            score = next(c.output_layer.weight for c in model.chunks if c.post_process) \
                if any(c.post_process for c in model.chunks) else torch.empty(labels, model.config.hidden_size)
            if model.parallel.pipeline_parallel_size > 1:  # NOTE: the last stage's score, for the reference
                from megatron.core import parallel_state as ps

                group = ps.get_pipeline_model_parallel_group()
                score = score.detach().clone()
                dist.broadcast(score, src=dist.get_process_group_ranks(group)[-1], group=group)
            res[f"score_as_transformers{labels}"] = torch.equal(score, ref.score.weight)
            with torch.no_grad():
                ref.score.weight.copy_(score)
            targets = {1: [torch.randn(4, generator=torch.Generator().manual_seed(2))],
                       3: [torch.tensor([0, 2, 1, 2]), torch.tensor([[1., 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]])]}
            # NOTE: a MoE's forward asked for its router outputs too: transformers' classifier returns none, nor
            # adds the balancing loss, whatever output_router_logits / router_aux_loss_coef say
            moe = {"output_router_logits": True} if hasattr(ref.config, "output_router_logits") else {}
            with torch.no_grad():
                ours, theirs = model(input_ids=ids, attention_mask=mask, **moe), ref(input_ids=ids,
                                                                                     attention_mask=mask, **moe)
                # NOTE: less transformers' KV cache (use_cache by default), which ours never makes
                res[f"outputs{labels}"] = (sorted(ours.keys()), sorted(k for k in theirs.keys() if k != "cache"))
                res[f"logits{labels}"] = ((ours.logits - theirs.logits).abs().max().item(),
                                          theirs.logits.abs().max().item())
                for i, target in enumerate(targets[labels]):
                    model.config.problem_type = ref.config.problem_type = None  # NOTE: the loss infers it
                    a = model(input_ids=ids, attention_mask=mask, labels=target, **moe).loss.item()
                    b = ref(input_ids=ids, attention_mask=mask, labels=target, **moe).loss.item()
                    res[f"loss{labels}_{i}"] = (a, b, model.config.problem_type)
            res[f"info{labels}"] = (sorted(info["missing_keys"]), sorted(info["unexpected_keys"]))
            std = score.std().item()
            res[f"score_std{labels}"] = std
        # NOTE: round trip: the export (num_labels=3) in transformers, and our reload of it
        export = f"{out_dir}/{arch}-export"
        model.save_pretrained(export)
        reloaded = lf.AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32, **layout)
        with torch.no_grad():
            res["reloaded"] = (reloaded(input_ids=ids, attention_mask=mask).logits
                               - model(input_ids=ids, attention_mask=mask).logits).abs().max().item()
        if dist.get_rank() == 0:
            hf = transformers.AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32)
            source, ours = saved_tensors(folder), saved_tensors(export)
            res["export_names"] = sorted(ours)
            res["backbone_exact"] = all(torch.equal(ours[k], v) for k, v in source.items() if k != "lm_head.weight")
            res["score_exact"] = torch.equal(ours["score.weight"], score)
            with torch.no_grad():
                res["export_logits"] = (hf(input_ids=ids, attention_mask=mask).logits
                                        - model(input_ids=ids, attention_mask=mask).logits).abs().max().item()
            res["architectures"] = hf.config.architectures
        else:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
        out[arch] = res
    return out


def refusals(folder: str, layout: dict) -> list[str]:
    """The messages lf.AutoModelForSequenceClassification / LoongRewardTrainer raise for what they do not support."""
    import loongforge_hf as lf

    messages = []
    try:
        model = lf.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, num_labels=3)
        lf.LoongRewardTrainer(model=model, args=reward_config("/tmp/unused"), train_dataset=make_dataset(4))
        messages.append("no error")
    except (ValueError, TypeError) as e:
        messages.append(f"{type(e).__name__}: {e}")
    import peft
    import transformers

    vpp = lf.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, num_labels=1,
                                                                pipeline_parallel_size=2,
                                                                virtual_pipeline_parallel_size=2)
    model = lf.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, num_labels=1)
    causal = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.ones(2, 4, dtype=torch.long) * 5

    def no_pad_token():
        model.config.pad_token_id = None
        try:
            model(input_ids=ids)
        finally:
            model.config.pad_token_id = 0

    for call in (lambda: model(input_ids=ids, inputs_embeds=torch.ones(1)),
                 lambda: model.generate(ids[:1]), no_pad_token,
                 lambda: lf.LoongTrainer(model=model, args=transformers.TrainingArguments("/tmp/unused", use_cpu=True)),
                 lambda: lf.LoongRewardTrainer(model=causal, train_dataset=make_dataset(4)),
                 lambda: lf.LoongRewardTrainer(model=model, args=reward_config("/tmp/unused"),
                                               train_dataset=make_dataset(4),
                                               peft_config=peft.IA3Config(task_type="SEQ_CLS")),
                 lambda: lf.LoongRewardTrainer(model=model, args=reward_config("/tmp/unused"),
                                               train_dataset=make_dataset(4),
                                               peft_config=peft.LoraConfig(target_modules=["q_proj"])),
                 lambda: lf.LoongRewardTrainer(model=vpp, args=reward_config("/tmp/unused",
                                                                             gradient_accumulation_steps=1),
                                               train_dataset=make_dataset(4))):
        try:
            call()
            messages.append("no error")
        except (TypeError, ValueError) as e:
            messages.append(str(e))
    return messages


def reward_config(out_dir: str, **overrides):
    import trl

    kw = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
              lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.1, max_grad_norm=1.0, logging_steps=1,
              seed=0, report_to=[], save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True,
              dataloader_drop_last=True, max_length=24, gradient_checkpointing=False)
    kw.update(overrides)
    return trl.RewardConfig(**kw)


def _dataset(kind: str, n: int = 16, seed: int = 0):
    data = make_dataset(n, seed=seed)
    if kind == "explicit":
        return data
    import datasets

    g = torch.Generator().manual_seed(seed + 7)
    return datasets.Dataset.from_dict({
        "chosen": [p + c for p, c in zip(data["prompt"], data["chosen"])],
        "rejected": [p + r for p, r in zip(data["prompt"], data["rejected"])],
        "margin": torch.rand(n, generator=g).tolist()})


def _logs(trainer) -> list[list[float]]:
    return [[h[k] for k in METRICS] for h in trainer.state.log_history if "loss" in h]


def _eval_logs(trainer) -> list[list[float]]:
    return [[h[k] for k in EVAL_METRICS] for h in trainer.state.log_history if "eval_loss" in h]


def _run(make_trainer, out_dir: str, names: list[str], save, extra: dict | None = None) -> dict:
    """``extra``: {scenario: more RewardConfig fields}."""
    import peft
    from transformers import AutoTokenizer

    out = {}
    for name in names:
        overrides, kind = SCENARIOS[name]
        eval_data = _dataset(kind, 4, seed=3) if overrides.get("eval_strategy") else None
        lora = LORA.get(name)
        trainer = make_trainer(args=reward_config(f"{out_dir}/{name}", **overrides, **(extra or {}).get(name, {})),
                               train_dataset=_dataset(kind), eval_dataset=eval_data, tokenizer=AutoTokenizer,
                               peft_config=peft.LoraConfig(**lora) if lora else None)
        trainer.train()
        out[name] = {"logs": _logs(trainer), "eval_logs": _eval_logs(trainer),
                     **save(trainer, f"{out_dir}/{name}/final")}
    return out


def _adapter_config(path: str) -> dict:
    import json

    config = json.loads(open(f"{path}/adapter_config.json").read())
    config["target_modules"] = sorted(config["target_modules"])  # NOTE: PEFT writes a set's order
    return config


def run_trl(folder: str, out_dir: str, names: list[str]) -> dict:
    """trl.RewardTrainer on transformers' classifier (+ PEFT): {scenario: {"logs", "eval_logs", "weights" (the saved
    model's or adapter's tensors), and for LoRA "adapter_config"}}."""
    import transformers
    import trl

    def make(*, tokenizer, **kwargs):
        model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
        return trl.RewardTrainer(model=model, processing_class=tokenizer.from_pretrained(folder), **kwargs)

    def save(trainer, path):
        trainer.save_model(path)
        lora = hasattr(trainer.model, "peft_config") and trainer.is_world_process_zero()  # NOTE: rank 0 writes
        return {"weights": saved_tensors(path), **({"adapter_config": _adapter_config(path)} if lora else {})}

    return _run(make, out_dir, names, save)


def run_loong(folder: str, out_dir: str, layout: dict, names: list[str], extra: dict | None = None) -> dict:
    """LoongRewardTrainer: {scenario: {"logs", "eval_logs", "weights" (rank 0's: the saved model's or adapter's
    tensors), and for LoRA "adapter_config" and "peft_logits" (rank 0: PEFT's classifier loaded with the saved
    adapter folder vs the trained model, max abs difference and scale)}}."""
    import torch.distributed as dist

    import loongforge_hf as lf
    from loongforge_hf.lora import LoongLoraModelForCausalLM

    def make(*, tokenizer, **kwargs):
        model = lf.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, **layout)
        return lf.LoongRewardTrainer(model=model, processing_class=tokenizer.from_pretrained(folder), **kwargs)

    def save(trainer, path):
        trainer.save_model(path)
        lora = isinstance(trainer.model, LoongLoraModelForCausalLM)
        ids, mask = _inputs()
        with torch.no_grad():
            ours = trainer.model(input_ids=ids, attention_mask=mask).logits if lora else None
        if dist.get_rank() != 0:
            return {}
        out = {"weights": saved_tensors(path)}
        if lora:
            import peft
            import transformers

            hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
            with torch.no_grad():
                theirs = peft.PeftModel.from_pretrained(hf, path)(input_ids=ids, attention_mask=mask).logits
            out.update(adapter_config=_adapter_config(path),
                       peft_logits=((ours - theirs).abs().max().item(), theirs.abs().max().item()))
        return out

    return _run(make, out_dir, names, save, extra)


def resume_loong(folder: str, checkpoint: str, out_dir: str, layout: dict) -> dict:
    """LoongRewardTrainer on the "explicit" scenario resumed from ``checkpoint``: {step: METRICS} of the steps it
    trained."""
    from transformers import AutoTokenizer

    import loongforge_hf as lf

    overrides, kind = SCENARIOS["explicit"]
    model = lf.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, **layout)
    trainer = lf.LoongRewardTrainer(model=model, args=reward_config(out_dir, **overrides), train_dataset=_dataset(kind),
                                    processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.train(resume_from_checkpoint=checkpoint)
    step = int(checkpoint.rstrip("/").rsplit("-", 1)[-1])
    return {h["step"]: [h[k] for k in METRICS] for h in trainer.state.log_history if "loss" in h and h["step"] > step}


def bf16_head(causal: str) -> bool:
    """A fresh head in bfloat16 after the same seed: transformers' bit for bit (drawn at that dtype, as it draws)."""
    import transformers

    import loongforge_hf as lf

    torch.manual_seed(3)
    model = lf.AutoModelForSequenceClassification.from_pretrained(causal, num_labels=3, dtype=torch.bfloat16)
    torch.manual_seed(3)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(causal, num_labels=3, dtype=torch.bfloat16)
    return torch.equal(model.chunks[0].output_layer.weight, ref.score.weight)
