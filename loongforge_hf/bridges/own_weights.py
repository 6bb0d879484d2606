"""Where a bridge's own module applies a weight it holds as a parameter (not a megatron linear) that transformers
keeps as an ``nn.Linear``, and so PEFT adapts: Mamba-1's ``x_proj``, Doge's ``dt_proj`` and ``router_gate``, Kimi
Linear's gates' ``f_a`` / ``f_b`` / ``g_a`` / ``g_b``, JetMoE's attention router.

Choices:
- The module declares those weights with how tensor parallelism holds each (``lora_own_weights``: parameter name ->
  ``"row"``: its input columns split, the products summed over TP after it; ``"column"``: its output rows split;
  ``"replicated"``: whole on every rank, its gradient summed over TP by the module; ``"sequence_parallel"``: whole on
  every rank, applied to the rank's tokens, its gradient summed by megatron under SP; ``"whole"``: whole on every
  rank with the whole gradient there), and its bridge the same for the
  LoRA planner (``lora/plan.py``). Each product with such a weight goes through ``adapted``, which returns it as it
  is unless LoRA gave the module an adapter on that weight (``lora/own_weights.py``: the module's ``lora_term``).
"""

from __future__ import annotations

import torch


def adapted(module: torch.nn.Module, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (``x`` through ``module``'s own weight ``name``) plus the LoRA adapter's term where there is one."""
    term = getattr(module, "lora_term", None)
    return out if term is None else term(name, x, out)
