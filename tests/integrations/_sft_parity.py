"""Rank functions: the same SFT runs with trl.SFTTrainer on the HF model and with LoongSFTTrainer.

Each scenario is one (dataset, SFTConfig overrides, LoraConfig or None) triple; a world runs several of them so the
process start-up (imports, gloo) is paid once.
"""

from __future__ import annotations

import pytest
import torch

WORDS = [f"tok{i}" for i in range(4, 203)]

# A chat template with generation markers (for assistant_only_loss) in the tiny word-level vocabulary.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }} </s>{% endgeneration %}"
    "{% else %}{{ 'tok4 ' + message['content'] + ' tok5 ' }}{% endif %}"
    "{% endfor %}"
)


def _sentence(g: torch.Generator, low: int, high: int) -> str:
    n = int(torch.randint(low, high, (1,), generator=g))
    return " ".join(WORDS[int(i)] for i in torch.randint(2, len(WORDS), (n,), generator=g))


def make_dataset(kind: str, n: int = 16, seed: int = 0):
    import datasets

    g = torch.Generator().manual_seed(seed)
    if kind == "text":
        return datasets.Dataset.from_dict({"text": [_sentence(g, 6, 20) for _ in range(n)]})
    if kind == "prompt_completion":
        rows = [(_sentence(g, 3, 9), " " + _sentence(g, 3, 9)) for _ in range(n)]
        return datasets.Dataset.from_dict({"prompt": [p for p, _ in rows], "completion": [c for _, c in rows]})
    if kind == "messages":
        return datasets.Dataset.from_dict({"messages": [
            [{"role": "user", "content": _sentence(g, 3, 8)}, {"role": "assistant", "content": _sentence(g, 3, 8)},
             {"role": "user", "content": _sentence(g, 2, 5)}, {"role": "assistant", "content": _sentence(g, 2, 6)}]
            for _ in range(n)]})
    raise ValueError(kind)


def sft_config(out_dir: str, **overrides):
    import trl

    kw = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
              learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.1, max_grad_norm=0.5,
              logging_steps=1, seed=0, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
              disable_tqdm=True, dataloader_drop_last=True, max_length=32, gradient_checkpointing=False)
    kw.update(overrides)
    return trl.SFTConfig(**kw)


# name -> (dataset kind, SFTConfig overrides, LoraConfig kwargs or None)
SCENARIOS = {
    "lora_text": ("text", {"learning_rate": 2e-2, "eval_strategy": "steps", "eval_steps": 1,
                           "per_device_eval_batch_size": 2},
                  dict(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")),
    "lora_qv_messages": ("messages", {"assistant_only_loss": True, "learning_rate": 2e-2},
                         dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"],
                              modules_to_save=["norm"], task_type="CAUSAL_LM")),
    # NOTE: DoRA's magnitudes are weight-decayed, as transformers.Trainer decays them (1-D, but not norms or biases);
    # a large decay, so that a difference there shows in the losses
    "dora_messages": ("messages", {"assistant_only_loss": True, "learning_rate": 2e-2, "weight_decay": 5.0},
                      dict(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear", task_type="CAUSAL_LM")),
    "full_prompt_completion": ("prompt_completion", {}, None),
    "full_packing": ("text", {"packing": True}, None),
    # NOTE: a decay large enough that what is decayed shows in the losses (gpt-oss's sinks, 1-D, left undecayed:
    # the third loss 3e-4 off)
    "full_weight_decay": ("text", {"learning_rate": 1e-2, "weight_decay": 50.0}, None),
    # NOTE: NEFTune's noise is drawn as TRL (transformers.Trainer) draws it, scaled by each padded batch's length
    "lora_neftune": ("text", {"neftune_noise_alpha": 5.0, "learning_rate": 2e-2},
                     dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")),
    # NOTE: TRL's label-smoothed loss (transformers' LabelSmoother over the batch's label tokens), in evaluation too
    "lora_label_smoothing": ("text", {"label_smoothing_factor": 0.3, "learning_rate": 2e-2, "eval_strategy": "steps",
                                      "eval_steps": 1, "per_device_eval_batch_size": 2},
                             dict(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")),
}


def assert_matches(name: str, ref: dict, got: dict, scenarios: dict = SCENARIOS) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert got["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-4)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    # evaluation during training (lora_text): the loss of the model as trained so far, step after step
    assert len(ref["eval_losses"]) == (3 if scenarios[name][1].get("eval_strategy") else 0)
    assert got["eval_losses"] == pytest.approx(ref["eval_losses"], rel=1e-4)
    for key in ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens"):
        assert key in got["keys"]
    # TRL's token metrics in every train and eval log: entropy within 1e-4 relative (as the losses), the token
    # accuracy to 1e-6 (the same argmax hits; TRL divides in fp32), num_tokens exactly
    assert len(got["metrics"]) == len(ref["metrics"]) == 3
    assert len(got["eval_metrics"]) == len(ref["eval_metrics"]) == len(ref["eval_losses"])
    for ours, trl in zip(got["metrics"] + got["eval_metrics"], ref["metrics"] + ref["eval_metrics"]):
        assert ours[0] == pytest.approx(trl[0], rel=1e-4) and ours[1] == pytest.approx(trl[1], rel=1e-6, abs=1e-9)
    assert [m[2] for m in got["metrics"]] == [m[2] for m in ref["metrics"]]
    assert [m[2] for m in got["eval_metrics"]] == [m[2] for m in ref["eval_metrics"]]
    assert any(m[1] > 0 for m in ref["metrics"])  # some predictions hit: the accuracy is compared on something
    if "adapter_logits_diff" in got:
        assert got["adapter_logits_diff"] < 1e-3


def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _losses(trainer, key: str = "loss") -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def _token_metrics(trainer, prefix: str = "") -> list[list[float]]:
    """TRL's entropy, mean_token_accuracy and num_tokens of every train (or ``eval_``) log."""
    keys = [prefix + k for k in ("entropy", "mean_token_accuracy", "num_tokens")]
    return [[h[k] for k in keys] for h in trainer.state.log_history if prefix + "loss" in h]


def _eval_dataset(kind: str, overrides: dict):
    """A held-out set for scenarios that evaluate during training."""
    return make_dataset(kind, n=4, seed=9) if overrides.get("eval_strategy") else None


def probe_ids() -> torch.Tensor:
    return torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(11))


def run_trl(folder: str, out_dir: str, names: list[str], scenarios: dict = SCENARIOS, **extra) -> dict:
    """trl.SFTTrainer (+ PEFT) on the transformers model: {scenario: {"losses", "eval_losses"}}."""
    import peft
    import transformers
    import trl

    out = {}
    for name in names:
        kind, overrides, lora = scenarios[name]
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if not hasattr(model, model.base_model_prefix):
            # NOTE: TRL 1.16's fused loss runs model.base_model as the backbone, which is the whole model where
            # base_model_prefix names no attribute (Llama4ForCausalLM's "language_model"; its backbone is .model)
            model.base_model_prefix = "model"
        if model.loss_type is None:
            # NOTE: transformers' Trainer counts num_items_in_batch over labels[..., 1:] (the shifted targets) only
            # where the model's loss_type, taken from its class name, is ForCausalLM; GPT2LMHeadModel's is None, so
            # it counts each row's first label too and scales the loss (and gradients) by targets / labels
            model.loss_type = "ForCausalLM"
        trainer = trl.SFTTrainer(model=model, args=sft_config(f"{out_dir}/{name}", **overrides, **extra),
                                 train_dataset=make_dataset(kind), eval_dataset=_eval_dataset(kind, overrides),
                                 processing_class=_tokenizer(folder),
                                 peft_config=peft.LoraConfig(**lora) if lora else None)
        trainer.train()
        out[name] = {"losses": _losses(trainer), "eval_losses": _losses(trainer, "eval_loss"),
                     "metrics": _token_metrics(trainer), "eval_metrics": _token_metrics(trainer, "eval_")}
    return out


def run_loong(folder: str, out_dir: str, layout: dict, names: list[str], scenarios: dict = SCENARIOS,
              **extra) -> dict:
    """LoongSFTTrainer: {scenario: {"losses", "eval_losses", "keys", and for LoRA "adapter_logits_diff" and
    "trainable" (rank 0)}}."""
    import peft
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf

    out = {}
    for name in names:
        kind, overrides, lora = scenarios[name]
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        trainer = lf.LoongSFTTrainer(model=model, args=sft_config(f"{out_dir}/{name}", **overrides, **extra),
                                     train_dataset=make_dataset(kind), eval_dataset=_eval_dataset(kind, overrides),
                                     processing_class=_tokenizer(folder),
                                     peft_config=peft.LoraConfig(**lora) if lora else None)
        trainer.train()
        result = {"losses": _losses(trainer), "grad_norms": _losses(trainer, "grad_norm"),
                  "eval_losses": _losses(trainer, "eval_loss"),
                  "metrics": _token_metrics(trainer), "eval_metrics": _token_metrics(trainer, "eval_"),
                  "keys": sorted(trainer.state.log_history[0]),
                  "recompute": bool(getattr(trainer.model, "is_gradient_checkpointing", False))}
        if lora:
            trainer.save_model(f"{out_dir}/{name}/final")
            ids = probe_ids()
            trained = trainer.model(input_ids=ids).logits.cpu()
            if dist.get_rank() == 0:
                hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
                loaded = peft.PeftModel.from_pretrained(hf, f"{out_dir}/{name}/final")
                with torch.no_grad():
                    result["adapter_logits_diff"] = float((loaded(input_ids=ids).logits - trained).abs().max())
                result["trainable"] = trainer.model.get_nb_trainable_parameters()
        out[name] = result
    return out


def plain_trainers_refuse(folder: str, out_dir: str) -> list[str]:
    """The messages trl.SFTTrainer and transformers.Trainer raise when given a loongforge model."""
    import transformers
    import trl

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = []
    for build in (lambda: trl.SFTTrainer(model=model, args=sft_config(out_dir + "/sft"),
                                         train_dataset=make_dataset("text"), processing_class=_tokenizer(folder)),
                  lambda: transformers.Trainer(model=model, args=transformers.TrainingArguments(
                      out_dir + "/trainer", use_cpu=True, report_to=[]))):
        try:
            build()
            messages.append("no error")
        except TypeError as e:
            messages.append(str(e))
    return messages


def resume_matches_uninterrupted(folder: str, out_dir: str, layout: dict, lora: dict | None = None,
                                 full: bool = False, other_layout: dict | None = None,
                                 other_overrides: dict | None = None, **overrides) -> dict:
    """LoRA run of 4 steps checkpointing at step 2, then a run resumed from that checkpoint: the losses of steps 3-4
    and the files of a LoRA checkpoint. ``lora``: the LoraConfig kwargs ("all-linear" with the norms by default);
    ``full``: full fine-tuning instead; ``other_layout``: another layout to resume in, with ``other_overrides`` of
    the SFTConfig (the same global batch): its losses under "other" (its error's message where it fails);
    ``overrides``: SFTConfig fields."""
    import os

    import peft

    import loongforge_hf as lf

    lora = lora or dict(r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["norm"])

    def run(resume: str | None, layout: dict = layout, more: dict | None = None) -> list[tuple[int, float]]:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        trainer = lf.LoongSFTTrainer(model=model, args=sft_config(out_dir, max_steps=4, save_strategy="steps",
                                                                  save_steps=2, **{**overrides, **(more or {})}),
                                     train_dataset=make_dataset("text"), processing_class=_tokenizer(folder),
                                     peft_config=None if full else peft.LoraConfig(**lora))
        trainer.train(resume_from_checkpoint=resume)
        return [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]

    uninterrupted = run(None)
    files = sorted(os.listdir(f"{out_dir}/checkpoint-2"))
    out = {"full": uninterrupted, "resumed": run(f"{out_dir}/checkpoint-2"), "checkpoint_files": files,
           "model_card": os.path.isfile(f"{out_dir}/README.md")}
    if other_layout is not None:
        try:
            out["other"] = run(f"{out_dir}/checkpoint-2", other_layout, other_overrides)
        except Exception as err:  # noqa: BLE001 - the test reads the message
            out["other"] = str(err)
    return out


def moe_sft(folder: str, out_dir: str, use_cpu: bool = True, layout: dict | None = None) -> dict:
    """A Qwen3-MoE model loaded without output_router_logits: SFTConfig(router_aux_loss_coef=0.1) switches TRL's
    router load-balancing loss on (activation recompute on, an evaluation at the last step), with trl.SFTTrainer and
    with LoongSFTTrainer: the train and eval losses and aux_loss metrics of each. With a ``layout``: LoongSFTTrainer
    only, the model loaded with it."""
    import functools

    import transformers
    import trl

    import loongforge_hf as lf

    out = {}
    runs = (("trl", trl.SFTTrainer, transformers.AutoModelForCausalLM.from_pretrained),
            ("loong", lf.LoongSFTTrainer, functools.partial(lf.AutoModelForCausalLM.from_pretrained, **(layout or {}))))
    for name, trainer_cls, load in runs[1:] if layout else runs:
        args = sft_config(f"{out_dir}/{name}", router_aux_loss_coef=0.1, gradient_checkpointing=True,
                          eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=2, use_cpu=use_cpu)
        trainer = trainer_cls(model=load(folder, dtype=torch.float32), args=args, train_dataset=make_dataset("text"),
                              eval_dataset=make_dataset("text", n=4, seed=9), processing_class=_tokenizer(folder))
        trainer.train()
        out[name] = {key: _losses(trainer, key) for key in ("loss", "aux_loss", "eval_loss", "eval_aux_loss")}
    return out
