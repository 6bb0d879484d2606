"""TRL 1.16's GRPO policy loss (``trl.GRPOTrainer._compute_loss``) as a pure function of per-token log-probabilities.

Choices:
- Inputs are what TRL's ``_compute_loss`` reads, all ``[rows, completion tokens]`` but the advantages: the policy's
  per-token log-probs (differentiable), the completion mask, the old and reference per-token log-probs (None where
  TRL has none), the advantages ``[rows]``. The operations are TRL's, in TRL's order (same rounding).
- Every ``loss_type`` of TRL 1.16: "grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo", with
  ``importance_sampling_level`` ("token" / "sequence"), ``epsilon`` / ``epsilon_high``, ``delta`` (two-sided
  clipping), ``beta`` (the k3 KL to the reference, ``use_bias_correction_kl``) and ``off_policy_mask_threshold``.
- The returned loss is the one to backpropagate with each micro-batch counted once over ``micro-batches x
  data-parallel ranks`` (``MegatronEngine.loss_hook``): TRL's loss times its accumulation steps. TRL divides "grpo",
  "bnpo", "dr_grpo", "luspo" and "sapo" by those steps (so their value here is TRL's before that division), and
  "dapo" / "cispo" / "vespo" by the generation batch's completion tokens rescaled to one accumulation window.
- Metrics are returned as sums (and counts) that data-parallel ranks add: TRL's ``global_masked_mean`` of the KL and
  the clip indicators (for "cispo" its ``cispo_clip_ratio``, for "vespo" its ``vespo/phi_seq_mean``, in the
  "low" / "clip_count" slots); its ``clip_ratio/low_min`` / ``high_max`` (a min / max over every rank's rows) are
  this rank's, for the caller to place in its own slot.
- Not here (refused by ``LoongGRPOTrainer``): the entropy bonus and the high-entropy token mask (TRL's
  ``entropy_coef`` / ``top_entropy_quantile``), vLLM's importance-sampling correction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
_PER_WINDOW = ("grpo", "bnpo", "dr_grpo", "luspo", "sapo")  # divided by the accumulation steps in TRL
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# summed over the data-parallel ranks: KL sum, clipped-low / high / region sums, their count (mask tokens, or rows
# with sequence-level ratios), mask tokens
SUMS = ("kl", "low", "high", "region", "clip_count", "tokens")


@dataclass(frozen=True)
class GRPOLoss:
    """The loss settings of a ``GRPOConfig`` (read once); called on a micro-batch."""

    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    importance_sampling_level: str = "token"
    delta: float | None = None
    use_bias_correction_kl: bool = False
    off_policy_mask_threshold: float | None = None
    max_completion_length: int = 256
    steps_per_generation: int = 1
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)

    @classmethod
    def from_args(cls, args) -> "GRPOLoss":
        return cls(loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
                   epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
                   importance_sampling_level=args.importance_sampling_level, delta=args.delta,
                   use_bias_correction_kl=args.use_bias_correction_kl,
                   off_policy_mask_threshold=args.off_policy_mask_threshold,
                   max_completion_length=args.max_completion_length, steps_per_generation=args.steps_per_generation,
                   sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
                   vespo=(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg))

    def __call__(self, logps: torch.Tensor, *, mask: torch.Tensor, advantages: torch.Tensor,
                 old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None, num_items: torch.Tensor,
                 num_processes: int, accumulation_steps: int) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """(loss to backpropagate, ``SUMS`` fp32, [low_min, high_max] of this rank's rows) of a micro-batch."""
        from trl import GRPOTrainer

        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old_logps = logps.detach() if old_logps is None else old_logps
        if self.off_policy_mask_threshold is not None:
            keep = GRPOTrainer.get_off_policy_mask(advantages=advantages, per_token_logps=logps,
                                                   sampling_per_token_logps=old_logps, mask=mask,
                                                   off_policy_threshold=self.off_policy_mask_threshold)
        log_ratio = logps - old_logps
        if self.importance_sampling_level == "token":
            log_weights = log_ratio
        elif self.importance_sampling_level == "sequence":
            log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        else:
            raise ValueError(f"Unknown importance sampling level: {self.importance_sampling_level}.")
        coef_1 = torch.exp(log_weights)
        if self.beta != 0.0:
            per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
            if self.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1
        per_token_loss, logged, coef_1 = self._per_token(coef_1, logps, log_ratio, advantages, mask)
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * keep
        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl
        loss = self._normalised(per_token_loss, mask, num_items, num_processes, accumulation_steps)
        sums, extremes = self._stats(per_token_kl if self.beta != 0.0 else None, coef_1, advantages, mask, logged)
        return loss, sums, extremes

    def _per_token(self, coef_1, logps, log_ratio, advantages, mask
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(TRL's per-token loss, what TRL logs the masked mean of for "cispo" / "vespo" (else None), the ratios its
        clip metrics read: with ``delta``, clamped, as TRL clamps its ``coef_1`` in place)."""
        kind = self.loss_type
        if kind == "cispo":
            clipped = ((coef_1 > self.epsilon_high) & (advantages > 0)).float()
            return -torch.clamp(coef_1, max=self.epsilon_high).detach() * advantages * logps, clipped, coef_1
        if kind in _CLIPPED:
            coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
            if self.delta is not None:
                coef_1 = torch.clamp(coef_1, max=self.delta)
            return -torch.min(coef_1 * advantages, coef_2 * advantages), None, coef_1
        if kind == "sapo":
            temperatures = torch.where(advantages > 0, self.sapo_temperature_pos, self.sapo_temperature_neg)
            return -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages, None, coef_1
        if kind == "vespo":
            from trl import GRPOTrainer

            k_pos, lambda_pos, k_neg, lambda_neg = self.vespo
            phi = GRPOTrainer.get_gamma_weights(advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
                                                importance_sampling_ratio=None, k_pos=k_pos, lambda_pos=lambda_pos,
                                                k_neg=k_neg, lambda_neg=lambda_neg)
            return -phi * advantages * logps, phi, coef_1
        raise ValueError(f"Unknown loss type: {kind}. Should be one of {list(LOSS_TYPES)}")

    def _normalised(self, per_token_loss, mask, num_items, num_processes: int, steps: int) -> torch.Tensor:
        kind = self.loss_type
        if kind in ("grpo", "sapo"):
            return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        if kind == "bnpo":
            return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        if kind == "dr_grpo":
            return (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)
        if kind == "luspo":
            return (per_token_loss * mask).sum(-1).mean()
        # "dapo", "cispo", "vespo": TRL's normaliser spans one accumulation window of the generation batch
        normalizer = num_items.clamp(min=1.0) / num_processes * steps / self.steps_per_generation
        return (per_token_loss * mask).sum() / normalizer * steps

    @torch.no_grad()
    def _stats(self, per_token_kl, coef_1, advantages, mask, logged) -> tuple[torch.Tensor, list[float]]:
        device = mask.device
        tokens = mask.sum().float()
        kl = (per_token_kl * mask).sum() if per_token_kl is not None else torch.zeros((), device=device)
        if self.loss_type not in _CLIPPED:
            zero = torch.zeros((), device=device)
            total, count = zero, zero
            if logged is not None:  # NOTE: TRL's global_masked_mean: one value per row when it has one column
                total, count = ((logged.sum(), torch.tensor(float(logged.shape[0]), device=device))
                                if logged.shape[1] == 1 else ((logged * mask).sum(), tokens))
            return (torch.stack([kl.float(), total.float(), zero, zero, count.float(), tokens]),
                    [float("nan"), float("nan")])
        low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
        high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
        region = (low.bool() | high.bool()).float()
        if coef_1.shape[1] == 1:  # NOTE: sequence-level ratios: one value per row, counted per row
            sums = [x.sum() for x in (low, high, region)] + [torch.tensor(float(coef_1.shape[0]), device=device)]
            low_rows, high_rows = low.squeeze(1), high.squeeze(1)
        else:
            sums = [(x * mask).sum() for x in (low, high, region)] + [tokens]
            low_rows, high_rows = (low * mask).sum(-1) / mask.sum(-1), (high * mask).sum(-1) / mask.sum(-1)
        extremes = [float(torch.nan_to_num(low_rows, nan=float("inf")).min()),
                    float(torch.nan_to_num(high_rows, nan=float("-inf")).max())]
        return torch.stack([kl.float(), *[s.float() for s in sums], tokens]), extremes
