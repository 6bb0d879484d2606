"""The initial A and B of every adapter, drawn exactly as PEFT draws them, at HF shapes.

Choices:
- PEFT creates, per target module in ``named_modules`` order, ``lora_A = nn.Linear(in, r, bias=False)`` then
  ``lora_B = nn.Linear(r, out, bias=False)`` (each constructor draws its default kaiming-uniform init from the CPU
  generator), then re-initialises A (kaiming-uniform with ``a=sqrt(5)``, or normal with std 1/r for ``"gaussian"``)
  and zeroes B; with ``init_lora_weights=False`` both constructor draws are kept. The same calls, in the same order,
  on the CPU generator, give the same numbers: after ``transformers.set_seed(seed)`` (which TRL's SFTTrainer calls
  right before ``get_peft_model``) the first loss equals PEFT's. tests/integrations/test_lora.py checks the tensors
  against ``peft.get_peft_model`` on the HF model.
- ``"orthogonal"`` (PEFT's ``orthogonal_init``): after both constructor draws, a random ``r x r`` matrix's Q factor;
  A from its odd rows, B from its even rows (so ``B @ A = 0``), each times a fresh Gaussian, over 10. As PEFT, an odd
  rank is refused; on expert stacks and the router (PEFT's ``ParamWrapper``) it is refused here.
- Every rank draws every adapter of the model (all layers, full HF shapes), so the generator stays in step across
  ranks and each rank slices its own part afterwards; adapters are small next to the model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loongforge_hf.lora.plan import LoraConfigError


def draw_initial_weights(targets, init_lora_weights) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A [r, in], B [out, r]) in float32 for each target, in order, from the default CPU generator (an expert stack's
    A [r * E, in], B [out, r * E], as PEFT's ``ParamWrapper``; the gaussian std stays 1 / r)."""
    out = []
    if init_lora_weights == "orthogonal":
        odd = sorted({t.hf_module for t in targets if t.r % 2})
        params = sorted({t.hf_module for t in targets if t.kind in ("experts", "router", "shared_gate")})
        if odd or params:
            raise LoraConfigError(f"init_lora_weights='orthogonal' needs an even rank (PEFT refuses an odd one) on "
                                  f"linear targets; {odd[:3] or params[:3]} "
                                  f"{'have an odd r' if odd else 'are expert / router parameters'}.")
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
            elif init_lora_weights == "orthogonal":
                q, _ = torch.linalg.qr(torch.randn(t.r, t.r))
                lora_a.weight = nn.Parameter(torch.randn(in_features, t.r // 2).mm(q[0::2, :]).T / 10.0)
                lora_b.weight = nn.Parameter(torch.randn(t.r // 2, out_features).T.mm(q[1::2, :]) / 10.0)
        out.append((lora_a.weight.detach().contiguous(), lora_b.weight.detach().contiguous()))
    return out
