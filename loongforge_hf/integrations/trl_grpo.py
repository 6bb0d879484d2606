"""``LoongGRPOTrainer``: trl's GRPOTrainer on the outside, LoongTrainer's megatron engine on the inside.

Choices:
- ``class LoongGRPOTrainer(OnlineEngineMixin, LoongTrainer, GRPOTrainer)``, as ``LoongDPOTrainer``: from GRPOTrainer
  its ``__init__`` (reward functions and weights, generation config, metrics), its repeat samplers and
  generation-batch dataloader, ``_prepare_inputs`` (generation once per ``steps_per_generation x num_iterations``
  micro-batches, buffered, shuffled, split), ``_generate_and_score_completions`` (prompt tokenisation, EOS masking,
  ``mask_truncated_completions``, rewards, group advantages with ``scale_rewards`` and
  ``multi_objective_aggregation``, the reward / completion metrics), ``prediction_step`` and ``log``; from
  LoongTrainer data sharding over data-parallel ranks, the loop, optimizer, checkpoints and ``save_model``. What it
  shares with ``LoongRLOOTrainer`` (generation, the engine micro-batches, the per-token log-probs of the fused head,
  the loss hook, data-parallel gathers, evaluation) is ``trl_online.py``'s.
- The loss of each micro-batch (``_loss_and_stats``, the engine's ``loss_hook``) is TRL's GRPO loss
  (``grpo_losses.GRPOLoss``) of the policy's per-token log-probs of the completion.
- MoE router load-balancing loss, as TRL turns it on (``GRPOConfig.router_aux_loss_coef``, by default the model
  config's, for a config with ``output_router_logits``): transformers' loss over the policy forward's prompt and
  completion tokens (``bridges/router_balance.py``), ``coef * aux_loss`` added to each micro-batch's loss
  (``router_aux_reduction="mean"`` with the engine's ``router_aux_coef``: TRL's ``/ accumulation steps``, averaged
  over the data-parallel ranks), the ``aux_loss`` metric each micro-batch's value averaged over them; in
  evaluation ``coef * aux_loss`` of the evaluation forward added to the loss and ``eval_aux_loss``. Not in the
  old / reference forwards, as TRL. A MoE model that cannot compute it is refused (``router_balance.check_layout``:
  pass ``router_aux_loss_coef=0.0``).
- Evaluation (``eval_dataset``): TRL's loop, ``num_generations_eval`` completions per prompt, the loss in eval mode
  (no accumulation: "dapo" / "cispo" / "vespo" normalised over the evaluation batch's completion tokens), its
  ``eval_*`` metrics (``trl_online.OnlineEngineMixin.compute_loss``).
- Logged as TRL: ``loss``, reward, reward_std, rewards/<func>/mean|std, frac_reward_zero_std, completions/*,
  num_tokens, kl (beta != 0), entropy, clip_ratio/{low_mean, low_min, high_mean, high_max, region_mean}
  (per micro-batch, over the data-parallel ranks: each rank's clip extremes in its own slot of the step's sums),
  cispo_clip_ratio ("cispo"), vespo/phi_seq_mean ("vespo"), aux_loss (MoE). TRL's ``step_time`` is not logged.
- Vision GRPO (an image-text model from ``AutoModelForImageTextToText``, its processor, an ``image`` / ``images``
  column of conversational prompts): TRL's own image handling (generation with the images, the image inputs in
  every log-prob forward), through the engine as ``trl_online.py`` says, at every layout the model trains at.
- Refused with a message, on every rank before any collective: ``trl_online.refusals``' list, and
  ``tools`` / ``rollout_func`` / ``environment_factory`` (multi-turn), ``entropy_coef`` / ``use_adaptive_entropy``
  (entropy bonus), ``top_entropy_quantile < 1``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from trl import GRPOConfig, GRPOTrainer

from loongforge_hf.integrations.grpo_losses import SUMS, GRPOLoss
from loongforge_hf.integrations.trl_online import OnlineEngineMixin, checked_setup, no_reference, rank_slots
from loongforge_hf.trainer.arguments import LoongArgumentsMixin
from loongforge_hf.trainer.data import dp_rank_and_size
from loongforge_hf.trainer.loong_trainer import LoongTrainer

_GRPO_FIELDS = (("entropy_coef", 0.0, " (entropy bonus)"), ("use_adaptive_entropy", False, " (entropy bonus)"),
                ("top_entropy_quantile", 1.0, " (needs each token's entropy over every rank)"))


@dataclass
class LoongGRPOConfig(LoongArgumentsMixin, GRPOConfig):
    """trl's ``GRPOConfig`` plus LoongTrainer's own knobs, defined once in ``LoongArgumentsMixin``."""


class _GRPOArgsSecond(GRPOTrainer):
    """GRPOTrainer taking ``(model, args, ...)`` positionally, as LoongTrainer passes them to the next class."""

    def __init__(self, model, args=None, *, reward_funcs=None, **kwargs) -> None:
        GRPOTrainer.__init__(self, model, reward_funcs, args, **kwargs)


class LoongGRPOTrainer(OnlineEngineMixin, LoongTrainer, _GRPOArgsSecond):
    """A drop-in ``trl.GRPOTrainer`` for ``LoongModelForCausalLM`` models (``peft_config`` gives megatron LoRA)."""

    def __init__(self, model=None, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None) -> None:
        model, args = checked_setup(model, args, peft_config, train_dataset, processing_class, name="GRPO",
                                    config_class=GRPOConfig, fields=_GRPO_FIELDS,
                                    optimizers=optimizers, quantization_config=quantization_config, tools=tools,
                                    rollout_func=rollout_func, environment_factory=environment_factory)
        with no_reference(args) as beta:  # NOTE: the reference is set in _finish_setup
            super().__init__(model, args, reward_funcs=reward_funcs, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class,
                             reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                             optimizers=optimizers)
        self.policy_loss = GRPOLoss.from_args(args)
        self.num_loss_stats = len(SUMS) + 2 * dp_rank_and_size()[1]
        self._finish_setup(beta=beta, peft_config=peft_config)

    def _loss_and_stats(self, logps: torch.Tensor, inputs: dict, *, accumulation_steps: int, evaluation: bool):
        """TRL's GRPO loss; stats: ``grpo_losses.SUMS``, then one (clip low_min, high_max) slot per data-parallel
        rank. In evaluation TRL neither accumulates nor splits the generation batch."""
        device = logps.device
        policy_loss = dataclasses.replace(self.policy_loss, steps_per_generation=1) if evaluation else self.policy_loss
        old, ref = (inputs[k].to(device) if inputs.get(k) is not None else None
                    for k in ("old_per_token_logps", "ref_per_token_logps"))
        loss, sums, extremes = policy_loss(
            logps, mask=inputs["completion_mask"].to(device), advantages=inputs["advantages"].to(device),
            old_logps=old, ref_logps=ref, num_items=inputs["num_items_in_batch"].to(device),
            num_processes=dp_rank_and_size()[1], accumulation_steps=accumulation_steps)
        return loss, torch.cat([sums.float(), rank_slots(extremes, device)])

    def _log_stats(self, mode: str, values: list[float]) -> None:
        metrics = self._metrics[mode]
        entropy, kl, low, high, region, clip_count, tokens = values[:1 + len(SUMS)]
        slots = values[1 + len(SUMS):]
        if self.beta != 0.0:
            metrics["kl"].append(kl / max(tokens, 1.0))
        metrics["entropy"].append(entropy / max(tokens, 1.0))
        if self.policy_loss.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            count = max(clip_count, 1.0)
            metrics["clip_ratio/low_mean"].append(low / count)
            metrics["clip_ratio/high_mean"].append(high / count)
            metrics["clip_ratio/region_mean"].append(region / count)
            low_min, high_max = min(slots[0::2]), max(slots[1::2])
            metrics["clip_ratio/low_min"].append(low_min if low_min != float("inf") else float("nan"))
            metrics["clip_ratio/high_max"].append(high_max if high_max != float("-inf") else float("nan"))
        elif self.policy_loss.loss_type in ("cispo", "vespo"):
            key = "cispo_clip_ratio" if self.policy_loss.loss_type == "cispo" else "vespo/phi_seq_mean"
            metrics[key].append(low / max(clip_count, 1.0))
