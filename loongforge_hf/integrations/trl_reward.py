"""``LoongRewardTrainer``: trl's RewardTrainer on the outside, LoongTrainer's megatron engine on the inside.

Choices:
- ``class LoongRewardTrainer(LoongTrainer, RewardTrainer)``, as ``LoongDPOTrainer``: from RewardTrainer its
  ``__init__``'s checks (``num_labels == 1``), pad / EOS tokens (the pad token written into the model config, which
  the pooling reads), dataset preparation (implicit or explicit prompts, conversational or not, EOS, tokenisation
  into ``chosen_ids`` / ``rejected_ids``, filtering by ``max_length``), its collator (the chosen rows then the
  rejected rows, right-padded, ``margin`` where the dataset has it), its metrics and ``log``; from LoongTrainer data
  sharding over data-parallel ranks, the loop, the optimizer, checkpoints and ``save_model``.
- The model is a ``LoongModelForSequenceClassification`` with ``num_labels=1``. Each optimizer step is one
  ``MegatronEngine.train_step`` whose per-micro-batch loss is TRL's (``engine.loss_hook`` = ``_RewardLoss``): on the
  last pipeline stage the score head's per-position output (``engine.fused_loss`` off: the head is a few rows, no
  vocabulary) is pooled at transformers' position (``sequence_classification.last_token_index``) into each row's
  reward, and the loss is ``-logsigmoid(chosen - rejected - margin).mean()`` over the micro-batch's pairs plus
  ``center_rewards_coefficient * mean((chosen + rejected)^2)``. The step divides the gradients by the micro-batches
  times the data-parallel ranks (the hook counts 1 per micro-batch): Trainer's ``loss / gradient_accumulation_steps``
  averaged by DDP. No router balancing loss: transformers' classifiers return none and trl.RewardTrainer (1.16),
  unlike its DPO / GRPO trainers, asks for none, so a MoE config's ``output_router_logits`` /
  ``router_aux_loss_coef`` change nothing (``engine.router_aux_coef = 0``).
- Context parallelism: each rank holds its load-balanced share of every row's positions; the rewards are the scores
  at the pooled positions summed over the CP group (``sequence_classification.pool_over_context_parallel``,
  differentiable), so every CP rank computes the micro-batch's whole loss and counts 1 (the engine divides by CP times
  more counts; the backward gives each share CP times its gradient); the metrics are the first CP rank's.
  Virtual pipeline stages: megatron's interleaved schedule (``gradient_accumulation_steps`` a multiple of
  ``pipeline_parallel_size``); evaluation's forwards go through the virtual stages in order.
- Batches are padded after TRL's collator with the pad token (so the pooled position does not move) to what megatron
  needs (``ParallelConfig.sequence_multiple``; under pipeline parallelism to ``max_length``, one length for every
  micro-batch) and get all-ignored ``labels`` (the engine's schedule reads them; the loss does not).
- Logged as TRL: ``loss``, ``num_tokens`` (attention-mask tokens), ``min_reward`` / ``mean_reward`` /
  ``max_reward`` over every data-parallel rank's rewards of a micro-batch, ``accuracy`` and ``margin`` (each rank's
  mean, averaged over the ranks), each the mean over the micro-batches since the last log. Evaluation computes the
  same loss and metrics from the model's forward, over the data-parallel ranks.
- ``peft_config``: a ``LoraConfig(task_type="SEQ_CLS")`` gives megatron LoRA (``loongforge_hf.lora.get_peft_model``
  right after ``set_seed(args.seed)``, as TRL calls PEFT's there), the score head trained whole as PEFT's
  ``modules_to_save`` (``lora/sequence_classification.py``); ``save_model`` and checkpoints write PEFT's adapter
  folder.
- ``disable_dropout`` (TRL's default) zeroes megatron's residual dropout too.
- Refused with a message, on every rank before any collective: a ``peft_config`` other than a ``LoraConfig`` (and
  one whose ``task_type`` is not ``"SEQ_CLS"``: ``LoraConfigError``), ``activation_offloading``,
  ``use_liger_kernel``, ``chat_template_path`` (it may resize the vocabulary), custom ``optimizers``,
  ``optimizer_cls_and_kwargs``, ``quantization_config``, pipeline parallelism without ``max_length``,
  ``gradient_accumulation_steps`` not a multiple of ``pipeline_parallel_size`` under virtual pipeline stages, a
  model that is not a ``LoongModelForSequenceClassification``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from trl import RewardConfig, RewardTrainer

from loongforge_hf.trainer.arguments import LoongArgumentsMixin
from loongforge_hf.trainer.engine import micro_batch_group
from loongforge_hf.trainer.loong_trainer import LoongTrainer

_SUMS = ("reward_sum", "rewards", "accuracy", "margin", "ranks")  # summed over the data-parallel ranks


@dataclass
class LoongRewardConfig(LoongArgumentsMixin, RewardConfig):
    """trl's ``RewardConfig`` plus LoongTrainer's own knobs, defined once in ``LoongArgumentsMixin``."""


def _refuse_unsupported(args: RewardConfig, model, peft_config, **given) -> None:
    """Everything checked here is the same on every rank: all raise alike, before any collective."""
    named = [k for k, v in given.items() if v is not None and v != (None, None)]
    problems = [f"{named} (the megatron engine owns the optimizer)"] if named else []
    if peft_config is not None and type(peft_config).__name__ != "LoraConfig":
        problems.append(f"peft_config of type {type(peft_config).__name__} (LoRA only)")
    for field, why in (("use_liger_kernel", ""), ("activation_offloading", ""),
                       ("chat_template_path", " (a template clone may resize the vocabulary)")):
        if getattr(args, field, None) not in (None, False):
            problems.append(f"{field}={getattr(args, field)!r}{why}")
    if args.gradient_accumulation_steps % micro_batch_group(model.parallel):
        problems.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps} with virtual pipeline stages "
                        "(megatron's interleaved schedule needs a multiple of "
                        f"pipeline_parallel_size={model.parallel.pipeline_parallel_size})")
    if model.parallel.pipeline_parallel_size > 1 and args.max_length is None:
        problems.append("pipeline_parallel_size > 1 without RewardConfig(max_length=...) (every micro-batch of a "
                        "step is padded to it)")
    if problems:
        raise ValueError("LoongRewardTrainer does not support: " + "; ".join(problems) + ".")


def reward_loss(rewards: torch.Tensor, margin: torch.Tensor | None, center: float | None) -> torch.Tensor:
    """TRL's reward loss of ``rewards`` ``[2 * pairs]`` (the chosen rows, then the rejected rows)."""
    chosen, rejected = torch.chunk(rewards, chunks=2)
    diff = chosen - rejected if margin is None else chosen - rejected - margin.to(rewards)
    loss = -torch.nn.functional.logsigmoid(diff).mean()
    if center is not None:
        loss = loss + center * torch.mean((chosen + rejected) ** 2)
    return loss


def _rank_stats(rewards: torch.Tensor, *, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This rank's ``_SUMS`` and its min / max reward in its own slots (so a sum over the ranks keeps them all)."""
    rewards = rewards.detach().float()
    chosen, rejected = torch.chunk(rewards, chunks=2)
    extremes = torch.zeros(2, dp_size, dtype=torch.float32, device=rewards.device)
    extremes[0, dp_rank], extremes[1, dp_rank] = rewards.min(), rewards.max()
    sums = torch.stack([rewards.sum(), torch.tensor(float(rewards.numel()), device=rewards.device),
                        (chosen > rejected).float().mean(), (chosen - rejected).mean(),
                        torch.ones((), device=rewards.device)])
    return torch.cat([sums, extremes.flatten()])


def _append_metrics(metrics: dict, values: list[float]) -> None:
    """TRL's per-micro-batch metrics from ``_rank_stats`` summed over the data-parallel ranks."""
    s = dict(zip(_SUMS, values))
    ranks = int(s["ranks"])
    extremes = values[len(_SUMS):]
    metrics["min_reward"].append(min(extremes[:ranks]))
    metrics["mean_reward"].append(s["reward_sum"] / s["rewards"])
    metrics["max_reward"].append(max(extremes[ranks:]))
    metrics["accuracy"].append(s["accuracy"] / ranks)
    metrics["margin"].append(s["margin"] / ranks)


def _data_parallel() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


class _RewardBatches:
    """TRL's preference collator, then padding to ``multiple`` with the pad token (masked out) and all-ignored
    ``labels``."""

    def __init__(self, collator, *, multiple: int, pad_id: int) -> None:
        self.collator, self.multiple, self.pad_id = collator, multiple, pad_id

    def __call__(self, examples):
        batch = dict(self.collator(examples))
        seq = batch["input_ids"].shape[1]
        extra = -(-seq // self.multiple) * self.multiple - seq
        if extra:
            for key, value in (("input_ids", self.pad_id), ("attention_mask", 0)):
                t = batch[key]
                batch[key] = torch.cat([t, t.new_full((t.shape[0], extra), value)], dim=1)
        batch["labels"] = torch.full_like(batch["input_ids"], -100)
        return batch


class _RewardLoss:
    """``MegatronEngine.loss_hook``: TRL's reward loss of each micro-batch (see the module docstring)."""

    def __init__(self, trainer: "LoongRewardTrainer") -> None:
        self.trainer = trainer
        self.dp_rank, self.dp_size = _data_parallel()
        self.num_stats = len(_SUMS) + 2 * self.dp_size

    def start_step(self, micro_batches: list[dict]) -> None:
        pass

    def __call__(self, output, batch: dict, *, labels: torch.Tensor, head):
        from loongforge_hf.parallel.context_parallel import cp_group_and_size
        from loongforge_hf.sequence_classification import last_token_index, pool_over_context_parallel

        model = self.trainer.model
        index = last_token_index(batch["input_ids"], model.config.get_text_config().pad_token_id)
        rewards = pool_over_context_parallel(output, index, grad=True).squeeze(-1).float()
        loss = reward_loss(rewards, batch.get("margin"), self.trainer.args.center_rewards_coefficient)
        stats = _rank_stats(rewards, dp_rank=self.dp_rank, dp_size=self.dp_size)
        if cp_group_and_size()[2] != 0:  # NOTE: counted once per context-parallel group (the engine sums over it)
            stats = torch.zeros_like(stats)
        return loss, torch.ones((), dtype=torch.int64, device=output.device), stats


def _disable_residual_dropout(model) -> None:
    """megatron's residual dropout (a float on each layer, read at every forward; TRL zeroes ``nn.Dropout``)."""
    for module in model.chunks.modules():
        if isinstance(getattr(module, "hidden_dropout", None), float):
            module.hidden_dropout = 0.0


class LoongRewardTrainer(LoongTrainer, RewardTrainer):
    """A drop-in ``trl.RewardTrainer`` for ``LoongModelForSequenceClassification`` models."""

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None, quantization_config=None,
                 peft_config=None) -> None:
        from loongforge_hf.sequence_classification import _TRAINER, LoongModelForSequenceClassification

        if not isinstance(model, LoongModelForSequenceClassification):
            raise TypeError("LoongRewardTrainer trains a loongforge_hf sequence classifier: load it with "
                            "loongforge_hf.AutoModelForSequenceClassification.from_pretrained(..., num_labels=1) "
                            f"(got {type(model).__name__}).")
        from loongforge_hf.integrations.trl_online import checked_args

        args = checked_args(args, model, RewardConfig, "Reward")
        _refuse_unsupported(args, model, peft_config, optimizers=optimizers,
                            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                            quantization_config=quantization_config)
        if peft_config is not None:
            from transformers import set_seed

            from loongforge_hf.lora import get_peft_model

            set_seed(args.seed)  # NOTE: as TRL, before the adapters are drawn
            model = get_peft_model(model, peft_config)
        setattr(model, _TRAINER, True)  # NOTE: Trainer.__init__ reads hf_device_map (sequence_classification.py)
        super().__init__(model, args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        if args.disable_dropout:
            _disable_residual_dropout(self.model)
        layout = self.model.parallel
        multiple = layout.sequence_multiple
        if layout.pipeline_parallel_size > 1:
            multiple = math.lcm(multiple, args.max_length)
        self.data_collator = _RewardBatches(self.data_collator, multiple=multiple,
                                            pad_id=self.processing_class.pad_token_id)

    # ---- data --------------------------------------------------------------------------------------------------
    def _dataset_tokenized_by_collator(self) -> bool:
        return True  # NOTE: TRL's chosen / rejected ids: its collator builds input_ids

    # ---- training --------------------------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.engine.loss_hook = _RewardLoss(self)
        self.engine.fused_loss = False  # NOTE: the score head's per-position output, pooled by the hook
        self.engine.router_aux_coef = 0.0
        return optimizer

    def _record_step(self, result, micro: list[dict]) -> None:
        from loongforge_hf.integrations.trl_dpo import record_hook_step

        record_hook_step(self, result, micro, _append_metrics)  # NOTE: no router loss here (router_aux_coef 0)

    def _save_checkpoint(self, model, trial) -> None:
        from loongforge_hf.integrations.trl import save_checkpoint_with_model_card

        save_checkpoint_with_model_card(self, model, trial)

    # ---- evaluation ------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Evaluation's loss of a batch (training runs in the engine) with TRL's metrics over the data-parallel
        ranks."""
        outputs = self.model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"))
        rewards = outputs.logits.squeeze(-1).float()
        loss = reward_loss(rewards, inputs.get("margin"), self.args.center_rewards_coefficient)
        rank, size = _data_parallel()
        values = _rank_stats(rewards, dp_rank=rank, dp_size=size).double()
        if dist.is_initialized() and size > 1:
            from megatron.core import parallel_state as ps

            dist.all_reduce(values, group=ps.get_data_parallel_group())
        _append_metrics(self._metrics["eval"], values.tolist())
        self._metrics["eval"]["num_tokens"] = [self._total_train_tokens]
        return (loss, outputs) if return_outputs else loss
