"""``LoongAdamW``: torch's AdamW whose fused step runs large tensors through one Triton kernel each.

Choices:
- A subclass of ``torch.optim.AdamW``: ``param_groups``, ``state`` (``step``, ``exp_avg``, ``exp_avg_sq``), the state
  dict, hooks and ``isinstance`` checks are torch's own, so a checkpoint written by either loads into the other and
  megatron's optimizer wrappers (which only call ``step``, ``state``, ``param_groups``, ``state_dict`` and
  ``load_state_dict``) see torch AdamW. ``MegatronEngine(fused_adam="triton")`` switches the class of the AdamW
  megatron builds (``adopt``).
- The kernel runs for the groups with ``fused=True`` (torch's fused state: one fp32 step count per parameter on its
  device; the default here when every parameter is a CUDA tensor and Triton is importable), for dense, contiguous
  fp32 / bf16 / fp16 tensors of at least ``triton_min_numel`` elements whose grad and moments share the parameter's
  dtype (``kernels/_adamw_triton.py``: 14 bytes moved per bf16 element, no host-device sync). The remaining tensors of
  such a group go through torch's fused AdamW in one call (one launch for many small tensors); other groups, and
  every group off CUDA without ``TRITON_INTERPRET=1``, run torch's own step unchanged (``super().step()``).
- ``grad_scale`` and ``found_inf`` (attributes set on the optimizer, as torch's GradScaler and
  ``MegatronEngine._optimizer_step`` do) mean what they mean in torch's fused AdamW: every grad is divided by
  ``grad_scale`` in fp32 before use (the Triton kernel multiplies by its reciprocal: within an fp32 ulp); where
  ``found_inf`` is nonzero nothing is updated and the step counts are put back. One difference: torch's fused kernel
  also writes the unscaled grads back into ``p.grad``; the Triton kernel leaves ``p.grad`` as it was (one less write
  of every grad; nothing here reads grads after the step).
- ``amsgrad`` and ``maximize`` are refused (ValueError), on every device, so the CPU and CUDA paths accept the same
  arguments.
"""

from __future__ import annotations

import inspect

import torch

from loongforge_hf.kernels._triton import HAVE_TRITON, use_triton

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _refuse_unsupported(amsgrad: bool, maximize: bool) -> None:
    if amsgrad or maximize:
        raise ValueError(f"LoongAdamW supports amsgrad=False and maximize=False only (got amsgrad={amsgrad}, "
                         f"maximize={maximize}); use torch.optim.AdamW for these.")


def _tensors(params) -> list:
    out = []
    for item in params:
        out.extend(item["params"] if isinstance(item, dict) else [item])
    return [t for t in out if isinstance(t, torch.Tensor)]


class LoongAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (amsgrad and maximize off) with a Triton step for large tensors on CUDA."""

    #: tensors with fewer elements go through torch's fused AdamW together (one launch for all of them).
    triton_min_numel: int = 1 << 16

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None) -> None:
        _refuse_unsupported(amsgrad, maximize)
        params = list(params)
        if fused is None and foreach is None and not differentiable and HAVE_TRITON:
            tensors = _tensors(params)
            fused = True if tensors and all(t.is_cuda and t.is_floating_point() for t in tensors) else None
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused)

    @classmethod
    def adopt(cls, optimizer: torch.optim.AdamW) -> LoongAdamW:
        """Turn a ``torch.optim.AdamW`` (before its first step, fused=True groups) into a ``LoongAdamW`` in place."""
        if type(optimizer) is not torch.optim.AdamW:
            raise TypeError(f"LoongAdamW.adopt takes a torch.optim.AdamW, got {type(optimizer).__name__}.")
        for group in optimizer.param_groups:
            _refuse_unsupported(group["amsgrad"], group["maximize"])
        optimizer.__class__ = cls
        optimizer._patch_step_function()  # torch's step hooks / profiler wrapper, as for an instance built here
        return optimizer

    def _kernel_group(self, group: dict) -> bool:
        beta1, beta2 = group["betas"]
        return bool(group["fused"]) and not group["differentiable"] and not any(
            isinstance(x, torch.Tensor) for x in (group["lr"], beta1, beta2))

    def _kernel_fits(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> bool:
        return (p.numel() >= self.triton_min_numel and p.dtype in _KERNEL_DTYPES and use_triton(p)
                and all(t.dtype == p.dtype and t.is_contiguous() and t.device == p.device for t in (p, g, m, v)))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            _refuse_unsupported(group["amsgrad"], group["maximize"])
        kernel_groups = [g for g in self.param_groups if self._kernel_group(g)]
        # NOTE: torch's step, not through the step-hook wrapper torch puts on AdamW.step (this step already ran it).
        torch_step = inspect.unwrap(torch.optim.AdamW.step, stop=lambda f: not getattr(f, "hooked", False))
        if not kernel_groups:
            return torch_step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in kernel_groups:
            self._kernel_step(group)
        kernel_ids = {id(g) for g in kernel_groups}
        rest = [g for g in self.param_groups if id(g) not in kernel_ids]
        if rest:
            groups, self.param_groups = self.param_groups, rest
            try:
                torch_step(self)
            finally:
                self.param_groups = groups
        return loss

    def _kernel_step(self, group: dict) -> None:
        from torch.optim.adam import adam

        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
        if not params:
            return
        beta1, beta2 = group["betas"]
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        fits = [self._kernel_fits(*t) for t in zip(params, grads, exp_avgs, exp_avg_sqs)]
        if not all(fits):
            rest = [[t for t, f in zip(ts, fits) if not f] for ts in (params, grads, exp_avgs, exp_avg_sqs, steps)]
            adam(*rest[:4], [], rest[4], foreach=False, capturable=group["capturable"], differentiable=False,
                 fused=True, grad_scale=grad_scale, found_inf=found_inf, has_complex=has_complex,
                 decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        chosen = [i for i, f in enumerate(fits) if f]
        if not chosen:
            return
        from loongforge_hf.kernels import _adamw_triton

        on_device: dict[tuple, torch.Tensor] = {}

        def to_device(t: torch.Tensor | None, device: torch.device, name: str) -> torch.Tensor | None:
            if t is None:
                return None
            key = (name, device)
            if key not in on_device:
                on_device[key] = t.to(device=device, dtype=torch.float32, non_blocking=True)
            return on_device[key]

        kernel_steps = [steps[i] for i in chosen]
        torch._foreach_add_(kernel_steps, 1)
        for i in chosen:
            device = params[i].device
            found = to_device(found_inf, device, "found_inf")
            _adamw_triton.adamw_step(
                params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], steps[i], lr=group["lr"],
                weight_decay=group["weight_decay"], beta1=beta1, beta2=beta2, eps=group["eps"],
                grad_scale=to_device(grad_scale, device, "grad_scale"), found_inf=found)
        if found_inf is not None:
            for i in chosen:
                steps[i].sub_(to_device(found_inf, params[i].device, "found_inf"))
