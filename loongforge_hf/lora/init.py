"""The initial A and B of every adapter, drawn exactly as PEFT draws them, at HF shapes.

Choices:
- PEFT creates, per target module in ``named_modules`` order, ``lora_A = nn.Linear(in, r, bias=False)`` then
  ``lora_B = nn.Linear(r, out, bias=False)`` (each constructor draws its default kaiming-uniform init from the CPU
  generator), then re-initialises A (kaiming-uniform with ``a=sqrt(5)``, or normal with std 1/r for ``"gaussian"``)
  and zeroes B; with ``init_lora_weights=False`` both constructor draws are kept. The same calls, in the same order,
  on the CPU generator, give the same numbers: after ``transformers.set_seed(seed)`` (which TRL's SFTTrainer calls
  right before ``get_peft_model``) the first loss equals PEFT's. tests/integrations/test_lora.py checks the tensors
  against ``peft.get_peft_model`` on the HF model.
- Every rank draws every adapter of the model (all layers, full HF shapes), so the generator stays in step across
  ranks and each rank slices its own part afterwards; adapters are small next to the model.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def draw_initial_weights(targets, init_lora_weights) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A [r, in], B [out, r]) in float32 for each target, in order, from the default CPU generator (an expert stack's
    A [r * E, in], B [out, r * E], as PEFT's ``ParamWrapper``; the gaussian std stays 1 / r)."""
    out = []
    for t in targets:
        (rows, in_features), (out_features, cols) = t.a_shape, t.b_shape
        lora_a = nn.Linear(in_features, rows, bias=False, device="cpu", dtype=torch.float32)
        lora_b = nn.Linear(cols, out_features, bias=False, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            if init_lora_weights is True:
                nn.init.kaiming_uniform_(lora_a.weight, a=math.sqrt(5))
                nn.init.zeros_(lora_b.weight)
            elif init_lora_weights == "gaussian":
                nn.init.normal_(lora_a.weight, std=1 / t.r)
                nn.init.zeros_(lora_b.weight)
        out.append((lora_a.weight.detach(), lora_b.weight.detach()))
    return out
