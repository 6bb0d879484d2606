"""LoongAdamW's Triton step against torch's fused AdamW on one device: CUDA in test_gpu_adamw.py, the CPU under
``TRITON_INTERPRET=1`` in test_adamw.py (torch's fused AdamW runs on CPU too).

Each step starts both optimizers from the same weights and moments (the reference's, copied into LoongAdamW's state)
so that what is compared is one update, not rounding differences carried over from earlier steps.
Tolerances (measured with the interpreter, 3 steps, sizes 1 / 1000 / 4097 / 33x65): fp32 differs in the last bit or
two of fp32 (|d| <= 7e-7 at |p| ~ 4, relative <= 2e-7 on the moments): rtol 1e-6, atol 1e-7. bf16: at most one bf16
unit in the last place of each stored tensor (Triton's interpreter truncates fp32 -> bf16
instead of rounding to nearest, so there about half the elements are one ulp off; a GPU rounds to nearest, as torch
does), atol 1e-7 where the first moment cancels to almost zero (its fp32 value differs in the last fp32 bit, which is
many bf16 ulps of a result that small).
"""

from __future__ import annotations

import torch

from loongforge_hf.kernels.adamw import LoongAdamW

RTOL_FP32, ATOL = 1e-6, 1e-7
SIZES = ((1,), (1000,), (4097,), (33, 65))


def _assert_close(u: torch.Tensor, w: torch.Tensor, *, name: str) -> None:
    """fp32: ``|u - w| <= ATOL + RTOL_FP32 * |w|``; bf16: ``|u - w| <= ATOL + one ulp of w``."""
    bf16 = w.dtype == torch.bfloat16
    u, w = u.float(), w.float()
    if bf16:
        bound = ATOL + torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - 7)
    else:
        bound = ATOL + RTOL_FP32 * w.abs()
    bad = (u - w).abs() > bound
    assert not bad.any(), f"{name}: {int(bad.sum())} of {w.numel()} off, e.g. {u[bad][:3]} vs {w[bad][:3]}"


def _pair(params, **kw):
    ours = LoongAdamW([p.clone() for p in params], fused=True, **kw)
    ours.triton_min_numel = 0
    ref = torch.optim.AdamW([p.clone() for p in params], fused=True, **kw)
    return ours, ref


def check_adamw(device: str, dtypes=(torch.float32, torch.bfloat16), steps: int = 3) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    checked = []
    for dtype in dtypes:
        for wd in (0.0, 0.1):
            for scale in (None, 4.0, 3.0):  # 3: a reciprocal that is not exact in fp32
                params = [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in SIZES]
                ours, ref = _pair(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
                a, b = ours.param_groups[0]["params"], ref.param_groups[0]["params"]
                for step in range(steps):
                    for x, y in zip(a, b):
                        g = torch.randn(y.shape, generator=gen).to(device=device, dtype=dtype)
                        x.grad, y.grad = g.clone(), g.clone()
                        if step:
                            x.copy_(y)
                            ours.state[x]["exp_avg"].copy_(ref.state[y]["exp_avg"])
                            ours.state[x]["exp_avg_sq"].copy_(ref.state[y]["exp_avg_sq"])
                    if scale is not None:
                        ours.grad_scale = torch.tensor(scale, device=device)
                        ref.grad_scale = torch.tensor(scale, device=device)
                    ours.step()
                    ref.step()
                    for x, y in zip(a, b):
                        name = f"adamw({dtype}, wd={wd}, grad_scale={scale}, {tuple(y.shape)}, step {step + 1})"
                        sx, sy = ours.state[x], ref.state[y]
                        assert sx["step"].dtype == sy["step"].dtype == torch.float32, name
                        assert sx["step"].device == sy["step"].device and float(sx["step"]) == step + 1, name
                        for what, u, w in (("param", x, y), ("exp_avg", sx["exp_avg"], sy["exp_avg"]),
                                           ("exp_avg_sq", sx["exp_avg_sq"], sy["exp_avg_sq"])):
                            assert u.dtype == w.dtype == dtype, (name, what)
                            _assert_close(u, w, name=f"{name} {what}")
                        checked.append(name)
    return checked


def check_found_inf(device: str) -> str:
    """A nonzero ``found_inf`` leaves weights, moments and step counts as they were, as torch's fused AdamW does."""
    p = torch.randn(5000, device=device)
    ours, _ = _pair([p], lr=1e-2)
    x = ours.param_groups[0]["params"][0]
    x.grad = torch.randn_like(x)
    ours.step()
    before = (x.clone(), ours.state[x]["exp_avg"].clone(), ours.state[x]["exp_avg_sq"].clone())
    ours.found_inf = torch.ones((), device=device)
    ours.step()
    assert float(ours.state[x]["step"]) == 1.0
    for u, w in zip((x, ours.state[x]["exp_avg"], ours.state[x]["exp_avg_sq"]), before):
        assert torch.equal(u, w)
    return "found_inf"
