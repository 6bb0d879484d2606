"""``LoongRLOOTrainer``: trl's RLOOTrainer on the outside, LoongTrainer's megatron engine on the inside.

Choices:
- ``class LoongRLOOTrainer(OnlineEngineMixin, LoongTrainer, RLOOTrainer)``, as ``LoongGRPOTrainer``: from
  RLOOTrainer its ``__init__`` (reward functions and weights, generation config, metrics), its repeat samplers and
  generation-batch dataloader, ``_prepare_inputs`` (generation once per ``steps_per_generation x num_iterations``
  micro-batches, buffered, shuffled, split), ``_generate_and_score_completions`` (rewards, ``reward_clip_range``,
  the KL penalty in the reward, the leave-one-out baseline advantages, ``normalize_advantages``, the reward /
  completion / kl metrics), ``prediction_step`` and ``log``; what it shares with GRPO (generation, engine
  micro-batches, the per-token log-probs of the fused head, the loss hook, data-parallel gathers, evaluation) is
  ``trl_online.py``'s.
- The KL to the reference is TRL's: ``beta`` times the sequence's summed first-order log ratio (old policy minus
  reference log-probs) taken off the reward before the baselines, computed when TRL generates
  (``_generate_and_score_completions``, its module-level gather over the data-parallel group); the loss has no KL
  term.
- The loss of each micro-batch (``_loss_and_stats``, the engine's ``loss_hook``) is TRL's: sequence log-probs (the
  completion tokens' summed per-token log-probs), the ratio to the old policy's ``exp(logps - old_logps)``, clipped
  with ``epsilon`` / ``epsilon_high``, ``-min(ratio * A, clipped * A)`` averaged over the micro-batch's sequences;
  each micro-batch counts once over ``micro-batches x data-parallel ranks`` (Trainer's ``loss / accumulation steps``
  under DDP). Evaluation: the same loss of the evaluation batch (with the MoE router balancing loss, plus
  ``coef * aux_loss`` of its forward, as TRL).
- Logged as TRL: ``loss``, reward, reward_std, rewards/<func>/mean|std, frac_reward_zero_std, completions/*,
  num_tokens, kl (beta != 0), entropy, clip_ratio/{low_mean, low_min, high_mean, high_max, region_mean} (per
  sequence, per micro-batch over the data-parallel ranks), aux_loss (MoE, as ``LoongGRPOTrainer``). TRL's
  ``step_time`` is not logged.
- Vision RLOO (an image-text model from ``AutoModelForImageTextToText``, its processor, an ``image`` / ``images``
  column of conversational prompts): TRL's own image handling (generation with the images, the image inputs in
  every log-prob forward), through the engine as ``trl_online.py`` says, at every layout the model trains at.
- Refused with a message, on every rank before any collective: ``trl_online.refusals``' list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import RLOOConfig, RLOOTrainer

from loongforge_hf.integrations.trl_online import OnlineEngineMixin, checked_setup, no_reference, rank_slots
from loongforge_hf.trainer.arguments import LoongArgumentsMixin
from loongforge_hf.trainer.data import dp_rank_and_size
from loongforge_hf.trainer.loong_trainer import LoongTrainer

# summed over the data-parallel ranks: completion tokens (the entropy's count), clipped-low / high / region
# sequences, sequences; then one (low_min, high_max) slot per rank
SUMS = ("tokens", "low", "high", "region", "rows")


@dataclass
class LoongRLOOConfig(LoongArgumentsMixin, RLOOConfig):
    """trl's ``RLOOConfig`` plus LoongTrainer's own knobs, defined once in ``LoongArgumentsMixin``."""


class _RLOOArgsSecond(RLOOTrainer):
    """RLOOTrainer taking ``(model, args, ...)`` positionally, as LoongTrainer passes them to the next class."""

    def __init__(self, model, args=None, *, reward_funcs=None, **kwargs) -> None:
        RLOOTrainer.__init__(self, model, reward_funcs, args, **kwargs)


def rloo_loss(logps: torch.Tensor, *, mask: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
              epsilon_low: float, epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL 1.16's RLOO loss (``RLOOTrainer._compute_loss``, its operations in its order) of per-token log-probs
    ``[rows, tokens]``, and the sequences' ratios ``[rows]``."""
    log_ratio = (logps * mask).sum(1) - old_logps
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.min(coef_1 * advantages, coef_2 * advantages).mean(), coef_1


class LoongRLOOTrainer(OnlineEngineMixin, LoongTrainer, _RLOOArgsSecond):
    """A drop-in ``trl.RLOOTrainer`` for ``LoongModelForCausalLM`` models (``peft_config`` gives megatron LoRA)."""

    def __init__(self, model=None, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None) -> None:
        model, args = checked_setup(model, args, peft_config, train_dataset, processing_class, name="RLOO",
                                    config_class=RLOOConfig, optimizers=optimizers,
                                    quantization_config=quantization_config)
        with no_reference(args) as beta:  # NOTE: the reference is set in _finish_setup
            super().__init__(model, args, reward_funcs=reward_funcs, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class,
                             reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                             optimizers=optimizers)
        self.num_loss_stats = len(SUMS) + 2 * dp_rank_and_size()[1]
        self._finish_setup(beta=beta, peft_config=peft_config)

    def _loss_and_stats(self, logps: torch.Tensor, inputs: dict, *, accumulation_steps: int, evaluation: bool):
        device = logps.device
        mask, advantages = inputs["completion_mask"].to(device), inputs["advantages"].to(device)
        loss, coef_1 = rloo_loss(logps, mask=mask, old_logps=inputs["old_logps"].to(device), advantages=advantages,
                                 epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high)
        with torch.no_grad():
            low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
            high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
            region = (low.bool() | high.bool()).float()
            sums = torch.stack([mask.sum().float(), low.sum(), high.sum(), region.sum(),
                                torch.tensor(float(low.numel()), device=device)])
            extremes = [float(low.min()), float(high.max())]
        return loss, torch.cat([sums, rank_slots(extremes, device)])

    def _log_stats(self, mode: str, values: list[float]) -> None:
        metrics = self._metrics[mode]
        entropy, tokens, low, high, region, rows = values[:1 + len(SUMS)]
        slots = values[1 + len(SUMS):]
        metrics["entropy"].append(entropy / max(tokens, 1.0))
        metrics["clip_ratio/low_mean"].append(low / rows)
        metrics["clip_ratio/low_min"].append(min(slots[0::2]))
        metrics["clip_ratio/high_mean"].append(high / rows)
        metrics["clip_ratio/high_max"].append(max(slots[1::2]))
        metrics["clip_ratio/region_mean"].append(region / rows)
