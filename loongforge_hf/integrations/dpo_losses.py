"""TRL 1.16's DPO losses (``trl.DPOTrainer._compute_loss``) as pure functions of per-sequence log-probabilities.

Choices:
- Every ``loss_type`` of TRL 1.16 reads only the completion log-prob sums (policy / reference, chosen / rejected)
  and the completions' token counts, so each is computed here from those: a batch is ``[chosen rows, rejected
  rows]`` as TRL's collator builds it, the loss of each type is the mean over the pairs, and the types are summed
  with ``loss_weights`` in the order given, with TRL's operations in TRL's order (same rounding).
- "sft" (TRL's replacement for ``rpo_alpha``: RPO is ``["sigmoid", "sft"]`` with weights ``[1, alpha]``) is the
  mean over the chosen completions' tokens of their negative log-prob: the chosen rows' log-prob sum over their
  token count. "ipo" and "sigmoid_norm" divide by each completion's token count (at least 1), as TRL.
- ``f_divergence_type`` (TRL's f-DPO) maps the log ratios to the scores that the "delta" losses compare; TRL
  checks which loss types accept it.
- The reward metrics are TRL's (``beta`` times the log ratios, whatever the f-divergence), returned as sums over
  the batch's pairs so that data-parallel ranks can add them (``STATS``).
- ``ld_alpha`` (LD-DPO) changes the log-prob sums the losses read: ``ld_token_weights`` gives each label token its
  weight (1 up to the pair's shorter completion's length, ``ld_alpha`` past it), the caller sums with it; "sft" reads
  the plain sums (``sft_logps``), as TRL's per-token mean does.
- ``use_weighting`` (WPO): ``wpo_weights`` turns each row's sum of ``log p(token) - log sum_v p_v^2`` over its label
  tokens (no grad; the caller computes it from the vocabulary-parallel head) into TRL's per-pair weight, which
  multiplies every loss type's per-pair loss before its mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# TRL 1.16's loss types (DPOTrainer._compute_loss)
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# sums over a batch's pairs: chosen / rejected rewards, reward accuracies, margins, chosen / rejected log-probs, pairs
STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
         "logps/rejected", "pairs")


@dataclass(frozen=True)
class DPOLoss:
    """The loss settings of a ``DPOConfig`` (read once); called on a batch's log-probs."""

    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5

    @classmethod
    def from_args(cls, args) -> "DPOLoss":
        types = tuple(args.loss_type)
        return cls(loss_types=types, loss_weights=tuple(args.loss_weights or [1.0] * len(types)), beta=args.beta,
                   label_smoothing=args.label_smoothing, discopop_tau=args.discopop_tau,
                   f_divergence_type=str(args.f_divergence_type),
                   f_alpha_divergence_coef=args.f_alpha_divergence_coef)

    def __call__(self, logps: torch.Tensor, ref_logps: torch.Tensor, *, lengths: torch.Tensor,
                 label_tokens: torch.Tensor, sft_logps: torch.Tensor | None = None,
                 pair_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of a batch: ``logps`` / ``ref_logps`` the rows' completion log-prob sums (LD-DPO's with
        ``ld_alpha``), ``lengths`` each row's completion tokens (TRL's ``completion_mask`` sums), ``label_tokens``
        each row's label tokens (its shifted mask's sums: what "sft" averages over), ``sft_logps`` the rows' plain
        log-prob sums ("sft"'s; ``logps`` when None), ``pair_weights`` WPO's (``wpo_weights``) or None."""
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = ref_logps.chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        chosen_scores, rejected_scores = self._scores(chosen_ratio), self._scores(rejected_ratio)
        parts = _Pair(chosen, rejected, ref_chosen, ref_rejected, chosen_ratio, rejected_ratio, chosen_scores,
                      rejected_scores, chosen_scores - rejected_scores, lengths.to(logps.dtype).chunk(2),
                      label_tokens.to(logps.dtype).chunk(2)[0],
                      (sft_logps if sft_logps is not None else logps).chunk(2)[0])
        loss = 0.0
        for loss_type, weight in zip(self.loss_types, self.loss_weights, strict=True):
            per_sequence = self._per_sequence(loss_type, parts)
            if pair_weights is not None:
                per_sequence = per_sequence * pair_weights
            loss += per_sequence.mean() * weight
        return loss

    def _scores(self, ratio: torch.Tensor) -> torch.Tensor:
        kind = self.f_divergence_type
        if kind == "reverse_kl":
            return ratio
        if kind == "forward_kl":
            return 1 - torch.exp(-ratio)
        if kind == "js_divergence":
            return math.log(2) + F.logsigmoid(ratio)
        if kind == "alpha_divergence":
            alpha = self.f_alpha_divergence_coef
            if abs(alpha - 1.0) < 1e-6:
                return ratio
            # NOTE: TRL clamps before the exp so that it stays representable in the ratio's dtype
            clamp = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}[ratio.dtype]
            t = torch.clamp(((alpha - 1.0) * ratio).float(), max=clamp)
            return (torch.exp(t) - 1.0).to(ratio.dtype) * (1.0 / (alpha - 1.0))
        raise ValueError(f"Unknown f_divergence_type: {kind}")

    def _per_sequence(self, loss_type: str, p: "_Pair") -> torch.Tensor:
        beta, eps = self.beta, self.label_smoothing
        delta = p.delta
        if loss_type == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if loss_type == "hinge":
            return torch.relu(1 - beta * delta)
        if loss_type in ("ipo", "sigmoid_norm"):
            chosen_len, rejected_len = p.lengths
            avg = p.chosen_scores / chosen_len.clamp(min=1.0) - p.rejected_scores / rejected_len.clamp(min=1.0)
            return (avg - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * avg)
        if loss_type == "exo_pair":
            epsilon = torch.tensor(eps, device=delta.device)
            return (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-epsilon))
                    + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(epsilon)))
        if loss_type == "nca_pair":
            chosen_rewards, rejected_rewards = beta * p.chosen_ratio, beta * p.rejected_ratio
            return (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                    - 0.5 * F.logsigmoid(-rejected_rewards))
        if loss_type == "robust":
            clean = -(1 - eps) * F.logsigmoid(beta * delta)
            flipped = -eps * F.logsigmoid(-beta * delta)
            return (clean - flipped) / (1 - 2 * eps)
        if loss_type == "bco_pair":
            return -F.logsigmoid(beta * p.chosen_ratio) - F.logsigmoid(-(beta * p.rejected_ratio))
        if loss_type == "sppo_hard":
            return (p.chosen_ratio - 0.5 / beta) ** 2 + (p.rejected_ratio + 0.5 / beta) ** 2
        if loss_type in ("aot", "aot_unpaired"):
            if loss_type == "aot":
                first, second = p.chosen - p.rejected, p.ref_chosen - p.ref_rejected
            else:
                first, second = p.chosen_ratio, p.rejected_ratio
            sorted_delta = torch.sort(first, dim=0)[0] - torch.sort(second, dim=0)[0]
            return -F.logsigmoid(beta * sorted_delta) * (1 - eps) - F.logsigmoid(-beta * sorted_delta) * eps
        if loss_type == "apo_zero":
            return (1 - torch.sigmoid(beta * p.chosen_ratio)) + torch.sigmoid(beta * p.rejected_ratio)
        if loss_type == "apo_down":
            margin = p.chosen_ratio - p.rejected_ratio
            return torch.sigmoid(beta * p.chosen_ratio) + (1 - torch.sigmoid(beta * margin))
        if loss_type == "discopop":
            logits = delta * beta
            modulation = torch.sigmoid(logits / self.discopop_tau)
            return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
        if loss_type == "sft":
            return (-p.sft_chosen.sum() / p.chosen_label_tokens.sum()).expand(p.chosen.shape[0])
        raise ValueError(f"Unknown loss type: {loss_type}. Should be one of {list(LOSS_TYPES)}")


@dataclass
class _Pair:
    """A batch's per-pair quantities, as TRL names them."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_ratio: torch.Tensor
    rejected_ratio: torch.Tensor
    chosen_scores: torch.Tensor
    rejected_scores: torch.Tensor
    delta: torch.Tensor
    lengths: tuple[torch.Tensor, torch.Tensor]
    chosen_label_tokens: torch.Tensor
    sft_chosen: torch.Tensor


def ld_token_weights(label_mask: torch.Tensor, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's fp32 weight of each label token of a ``[chosen rows, rejected rows]`` batch (``label_mask [b, s]``,
    True at the shifted completion tokens): 1 up to the pair's shorter completion's length, ``ld_alpha`` past it, 0
    off the completion (TRL's ``shared_mask + ld_alpha * tail_mask``)."""
    position = label_mask.cumsum(dim=1)
    shared = torch.minimum(*label_mask.sum(dim=1).chunk(2)).repeat(2)
    return torch.where(position > shared[:, None], ld_alpha, 1.0).to(torch.float32) * label_mask


@torch.no_grad()
def wpo_weights(aligned: torch.Tensor, label_tokens: torch.Tensor) -> torch.Tensor:
    """WPO's per-pair weights (TRL's ``use_weighting``, Eq. 2 of the paper) from each row's sum over its label tokens
    of ``log p(token) - log sum_v p_v^2`` and its label-token count: ``exp`` of the rows' means, chosen times
    rejected."""
    weights = torch.exp(aligned / label_tokens.clamp_min(1))
    chosen, rejected = weights.chunk(2)
    return chosen * rejected


@torch.no_grad()
def reward_stats(logps: torch.Tensor, ref_logps: torch.Tensor, *, beta: float) -> torch.Tensor:
    """TRL's reward and log-prob metrics of a ``[chosen rows, rejected rows]`` batch, as sums over its pairs
    (``STATS``, fp32)."""
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    return torch.stack([chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards > rejected_rewards).float().sum(),
                        (chosen_rewards - rejected_rewards).sum(), chosen.sum(), rejected.sum(),
                        torch.tensor(float(chosen.numel()), device=logps.device)]).float()
