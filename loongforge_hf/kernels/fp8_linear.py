"""FP8 for the linear layers of a built megatron model: ``enable_fp8(chunks, mode="on" | "adaptive")``.

Choices:
- Eligible layers are megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` whose name ends in one of
  ``ELIGIBLE`` (attention qkv / output and MLA projections, MLP and expert fc1 / fc2, shared experts), and grouped
  expert modules (``kernels.grouped_mlp.GroupedMLP``, whose ``forward`` is swapped, see ``Fp8GroupedExperts``; the
  activation is the module's, SwiGLU or DeepSeek-V4's / HY-V4's clamped SwiGLU; one with biases or another activation,
  gpt-oss's, stays in its dtype, listed in the report). The
  LM head (``output_layer``), embeddings, router and norms are other modules or other names and stay in their dtype. A
  layer whose local weight dimensions are not multiples of the recipe's GEMM granule stays too (listed in the report).
- The swap gives each eligible module an instance ``_forward_impl`` (the one method megatron's ``forward`` calls for
  the GEMM; the class's stays untouched). It keeps megatron's semantics around the GEMM: sequence-parallel all-gather
  of the input before it (again in the backward), reduce-scatter or all-reduce of the input gradient after it,
  overlapped with the weight-gradient GEMM, and the weight gradient added into ``main_grad`` under
  ``gradient_accumulation_fusion`` (written into it by the GEMM where the buffer is known to hold zeros:
  ``kernels/main_grad.py``). A LoRA-adapted layer (``lora_output``) gets its adapter term added as its own class
  would. Where every GEMM of a call is to stay in bf16, the class's own method runs.
- A vision tower's linears (``multimodal.vision.VisionLinear``: qkv / proj, the MLP, the patch merger; not the
  patch embedding), given as ``towers``, get an ``fp8_impl`` (``Fp8VisionImpl``): ``kernels.fp8.fp8_linear`` around
  the GEMM, with the tower's own tensor-parallel communication left outside it as before.
- ``mode="adaptive"`` asks ``fp8_autotune.Fp8Autotuner``, for each distinct GEMM shape a layer meets (forward, input
  gradient, weight gradient), whether FP8 beats bf16 on the GPU in use (timed once, cached in a JSON file per GPU
  model, logged with the component (vision / language) and module that met it), and runs FP8 only there: each
  layer decides on its own shapes, so the vision tower and the language model decide independently. The token
  count is rounded up to a power of two for the decision (``token_bucket``). A grouped expert module decides as a
  whole (its routed rows change every step; the timing spreads them evenly over the local experts).
- Transformer Engine's recipes (``fp8_recipe="te_..."``) do not come through here: the model is built with TE's
  linears and megatron's FP8 context instead (``kernels/fp8_te.py``).
- Recipes: ``blockwise`` (1x128 activation / gradient tiles, 128x128 weight blocks, DeepSeek-V3's; the default where
  the GPU runs it), ``blockwise_wgrad2d`` (the same, except that the weight-gradient GEMM takes the output gradient
  in 128x128 blocks: a faster cuBLAS kernel, coarser scaling; opt-in, see docs/fp8.md) and ``rowwise`` (one scale
  per row / column). Only CUDA devices of compute capability 8.9+ are accepted: on any other device ``enable_fp8``
  raises instead of silently training in bf16.
- Without sequence parallelism the forward also quantises ``x.T`` for the weight gradient and keeps that (FP8)
  instead of ``x`` (bf16) for the backward: on (b) of scripts/bench_train.py 1.1 GiB less peak memory, the same
  quantisation work moved from the backward to the forward.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from loongforge_hf.kernels import main_grad as main_grad_state
from loongforge_hf.kernels.fp8 import (GROUP, RECIPES, ROW_ALIGN, Fp8Error, GemmPrecision, blockwise_supported,
                                       check_recipe, forward_only, fp8_linear, gemm_dgrad, gemm_eligible, gemm_fwd,
                                       gemm_wgrad, is_blockwise)
from loongforge_hf.kernels.fp8_autotune import Fp8Autotuner

logger = logging.getLogger("loongforge_hf.fp8")

MODES = ("on", "adaptive")
ELIGIBLE = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
            "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
ALL_FP8, NO_FP8 = GemmPrecision(True, True, True), GemmPrecision(False, False, False)


def check_fp8_mode(fp8: str | None) -> None:
    if fp8 is not None and fp8 not in MODES:
        raise ValueError(f"fp8={fp8!r} is not supported; use None, 'on' or 'adaptive'.")


def check_fp8_request(fp8: str | None, recipe: str | None = None) -> None:
    """``from_pretrained(fp8=..., fp8_recipe=...)`` before anything is built: a known mode and recipe, and a CUDA
    backend to run them on."""
    from loongforge_hf.kernels.fp8_te import TE_RECIPES, check_te_device, check_te_request, is_te_recipe

    check_fp8_mode(fp8)
    if is_te_recipe(recipe):
        check_te_request(fp8, recipe)
    elif recipe is not None and recipe not in RECIPES:
        raise Fp8Error(f"fp8_recipe={recipe!r} is not supported; use one of {RECIPES}, or with Transformer Engine "
                       f"installed one of {tuple(TE_RECIPES)} (see docs/fp8.md).")
    from loongforge_hf.xpu import get_backend

    backend = get_backend().name
    if fp8 is not None and backend != "cuda":
        raise Fp8Error(f"fp8={fp8!r} needs a CUDA GPU with FP8 tensor cores; this process runs on the {backend!r} "
                       "backend. Load with fp8=None here.")
    if fp8 is not None and is_te_recipe(recipe):
        check_te_device(recipe)


def check_fp8_device(device: torch.device) -> None:
    """FP8 GEMMs need a CUDA GPU with FP8 tensor cores (compute capability 8.9: Ada, Hopper and later)."""
    from loongforge_hf.xpu import get_backend

    backend = get_backend()
    capability = backend.compute_capability(device) if device.type == "cuda" else None
    if capability is None:
        raise Fp8Error(f"fp8 training needs a CUDA GPU with FP8 tensor cores; the model is on {device}. Load it "
                       "with fp8=None on this device.")
    if capability < (8, 9):
        raise Fp8Error(f"fp8 training needs compute capability 8.9 or newer; {backend.device_name(device)} "
                       f"has {capability[0]}.{capability[1]}.")


def granule(recipe: str) -> int:
    """What a weight's dimensions must be multiples of for the recipe's GEMMs."""
    return GROUP if is_blockwise(recipe) else ROW_ALIGN


# ---- the swapped GEMM -----------------------------------------------------------------------------------------------
def _gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


class _Fp8ParallelLinear(torch.autograd.Function):
    """megatron's linear with sequence-parallel / tensor-parallel communication around FP8 GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, precision, sequence_parallel, allreduce_dgrad, group, accumulate):
        total = _gather_tokens(x, group) if sequence_parallel else x
        x2 = total.reshape(-1, total.shape[-1])
        # NOTE: without sequence parallelism the weight gradient's x.T is quantised here and kept instead of x (FP8:
        # half its bytes); under it the backward gathers x again, as megatron does.
        for_wgrad = precision.fwd and precision.wgrad and weight.requires_grad and not sequence_parallel
        if precision.fwd:
            y, wtq, xtq = gemm_fwd(x2, weight, recipe, for_dgrad=precision.dgrad, for_wgrad=for_wgrad)
        else:
            y, wtq, xtq = x2 @ weight.t(), None, None
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x if xtq is None else None, weight)
        ctx.wtq, ctx.xtq = wtq, xtq
        ctx.recipe, ctx.precision, ctx.has_bias = recipe, precision, bias is not None
        ctx.sequence_parallel, ctx.allreduce_dgrad = sequence_parallel, allreduce_dgrad
        ctx.group, ctx.accumulate = group, accumulate
        return y.view(*total.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        xtq, ctx.xtq = ctx.xtq, None
        dy2 = dy.reshape(-1, weight.shape[0])
        gather = None
        if ctx.sequence_parallel and weight.requires_grad:
            total = torch.empty((x.shape[0] * dist.get_world_size(ctx.group), *x.shape[1:]), dtype=x.dtype,
                                device=x.device)
            gather = dist.all_gather_into_tensor(total, x.contiguous(), group=ctx.group, async_op=True)
        else:
            total = x
        dx = gemm_dgrad(dy2, weight, ctx.recipe, ctx.wtq) if ctx.precision.dgrad else dy2 @ weight
        dx = dx.view(*dy.shape[:-1], weight.shape[1])
        ctx.wtq = None
        reduce = None
        if ctx.sequence_parallel:
            local = torch.empty_like(x)
            reduce = dist.reduce_scatter_tensor(local, dx.contiguous(), group=ctx.group, async_op=True)
            dx = local
        elif ctx.allreduce_dgrad:
            reduce = dist.all_reduce(dx, group=ctx.group, async_op=True)
        dw = db = None
        if weight.requires_grad:
            if gather is not None:
                gather.wait()
            x2 = None if total is None else total.reshape(-1, total.shape[-1])

            def wgrad(out=None):
                if ctx.precision.wgrad:
                    return gemm_wgrad(dy2, x2, ctx.recipe, out=out, xtq=xtq)
                return torch.mm(dy2.t(), x2, out=out)

            if ctx.accumulate:
                # NOTE: what megatron's gradient_accumulation_fusion does: the gradient goes straight into the fp32
                # main_grad, and the autograd grad is a placeholder its DDP hook knows to skip. A main_grad known
                # to hold zeros (main_grad.claim) of the GEMM's dtype is written by the GEMM instead of added to.
                main_grad = weight.main_grad
                if main_grad.dtype == dy2.dtype and main_grad_state.claim(weight):
                    wgrad(out=main_grad)
                else:
                    main_grad.add_(wgrad())
                dw = None
                if hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
                    dw = torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) \
                        else torch.empty_like(weight)
            else:
                dw = wgrad().to(weight.dtype)
        if ctx.has_bias:
            db = dy2.sum(0)
        if reduce is not None:
            reduce.wait()
        return dx, dw, db, None, None, None, None, None, None


@dataclass
class Fp8Settings:
    """What the swapped layers of one model share."""
    mode: str
    recipe: str
    autotuner: Fp8Autotuner | None = None


def token_bucket(tokens: int) -> int:
    """The token count ``adaptive`` decides for: ``tokens`` rounded up to a power of two."""
    return 1 << max(0, tokens - 1).bit_length()


class _LayerPrecision:
    """Which GEMMs of one swapped layer (or whether a whole expert module) run in FP8: all of them (``on``), or per
    (tokens, trained) as the autotuner decides (``adaptive``)."""

    def __init__(self, *, name: str, settings: Fp8Settings) -> None:
        self.name = name
        self.component = "vision" if "vision" in name else "language"
        self.settings = settings
        self.decisions: dict[tuple[int, bool], GemmPrecision | bool] = {}

    def decision(self, tokens: int, weight: torch.Tensor, *, on, off, decide):
        """``on`` under ``mode="on"``, ``off`` for no tokens, else ``decide(m, where)`` asked once per power-of-two
        bucket ``m`` of the token count and whether the weight trains."""
        if self.settings.mode == "on":
            return on
        if tokens == 0:
            return off
        # NOTE: decided per power-of-two bucket of the token count (timed at its top): variable sequence lengths
        # and image sizes time a handful of shapes, not one per length.
        key = (token_bucket(tokens), weight.requires_grad)
        if key not in self.decisions:
            self.decisions[key] = decide(key[0], f"{self.component}:{self.name}")
        return self.decisions[key]

    def precision(self, tokens: int, weight: torch.Tensor) -> GemmPrecision:
        def decide(m: int, where: str) -> GemmPrecision:
            n, k = weight.shape
            gemm = functools.partial(self.settings.autotuner.decide, device=weight.device, dtype=weight.dtype,
                                     where=where)
            return GemmPrecision(fwd=gemm("fwd", m, n, k), dgrad=gemm("dgrad", m, k, n),
                                 wgrad=weight.requires_grad and gemm("wgrad", n, k, m))

        return self.decision(tokens, weight, on=ALL_FP8, off=NO_FP8, decide=decide)


class Fp8ForwardImpl(_LayerPrecision):
    """The instance ``_forward_impl`` of one swapped megatron linear layer."""

    def __init__(self, module, *, name: str, settings: Fp8Settings) -> None:
        super().__init__(name=name, settings=settings)
        self.module_ref = module

    def __call__(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                 sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None):
        module = self.module_ref
        group = tp_group if tp_group is not None else getattr(module, "tp_group", None)
        tokens = input.numel() // input.shape[-1] * (dist.get_world_size(group) if sequence_parallel else 1)
        precision = self.precision(tokens, weight)
        if precision == NO_FP8 or grad_output_buffer is not None:
            main_grad_state.forget(weight)  # megatron's own path adds into main_grad
            return type(module)._forward_impl(
                module, input, weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group)
        precision = forward_only(precision)
        accumulate = bool(gradient_accumulation_fusion and hasattr(weight, "main_grad"))
        out = _Fp8ParallelLinear.apply(input, weight, bias, self.settings.recipe, precision, sequence_parallel,
                                       allreduce_dgrad, group, accumulate)
        if hasattr(module, "lora_output"):
            from megatron.core.tensor_parallel.layers import ColumnParallelLinear

            out = module.lora_output(input, out, bias=bias, sequence_parallel=sequence_parallel,
                                     allreduce_dgrad=allreduce_dgrad) \
                if isinstance(module, ColumnParallelLinear) else module.lora_output(input, out)
        return out


class Fp8VisionImpl(_LayerPrecision):
    """The ``fp8_impl`` of one vision-tower linear (``multimodal.vision.VisionLinear``): ``(x, weight, bias)`` ->
    ``x @ weight.T + bias`` through ``kernels.fp8.fp8_linear`` (bf16 ``F.linear`` where every GEMM stays bf16)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        precision = self.precision(x.numel() // x.shape[-1], weight)
        if precision == NO_FP8:
            return torch.nn.functional.linear(x, weight, bias)
        return fp8_linear(x, weight, bias, recipe=self.settings.recipe, precision=precision)


def fp8_experts(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, tokens_per_expert, probs, *,
                recipe: str, activation=None) -> torch.Tensor:
    """The gated MLP of every local expert (``grouped_mlp.grouped_gated_mlp``'s math, ``activation`` on the fc1
    output: SwiGLU where None, or the clamped SwiGLU's ``ClampedGLU``) with both projections in FP8: one grouped GEMM
    per projection where ``torch._scaled_grouped_mm`` runs (or emulated off CUDA), else (Ada, a torch without it)
    expert by expert through ``fp8_linear``."""
    from loongforge_hf.kernels.fp8_grouped import fp8_grouped_gated_mlp, grouped_fp8_supported
    from loongforge_hf.kernels.grouped_mlp import expert_loop
    from loongforge_hf.kernels.swiglu import swiglu

    activation = activation or swiglu
    if not x.is_cuda or grouped_fp8_supported(x.device):
        return fp8_grouped_gated_mlp(x, fc1, fc2, tokens_per_expert, probs, emulate=not x.is_cuda,
                                     activation=activation)
    counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
    linear = functools.partial(fp8_linear, recipe=recipe)
    return expert_loop(x, fc1, fc2, [int(c) for c in counts], probs, linear=linear, activation=activation)


def fp8_experts_refusal(module) -> str | None:
    """Why the FP8 experts (``fp8_experts``: SwiGLU or the clamped SwiGLU, no biases) cannot compute grouped expert
    module ``module``'s math, or None where they can."""
    from loongforge_hf.kernels.clamped_glu import SILU_ALPHA, ClampedGLU
    from loongforge_hf.kernels.swiglu import SwiGLU

    problems = []
    if any(getattr(stack, "bias", None) is not None for stack in (module.linear_fc1, module.linear_fc2)):
        problems.append("expert biases (add_bias_linear)")
    activation = getattr(module, "activation", None)  # None: a stand-in for the SwiGLU module
    clamped_swiglu = isinstance(activation, ClampedGLU) and activation.alpha == SILU_ALPHA
    if activation is not None and not isinstance(activation, SwiGLU) and not clamped_swiglu:
        problems.append(f"the activation {type(activation).__name__} (only SwiGLU and the clamped SwiGLU)")
    if not problems:
        return None
    return "FP8 grouped experts do not support " + " or ".join(problems)


class Fp8GroupedExperts(_LayerPrecision):
    """The instance ``forward`` of a grouped expert module (``kernels.grouped_mlp.GroupedMLP``): the same math per
    expert (``swiglu(x @ W1.T)``, times the routing probability, ``@ W2.T``) with both projections in FP8
    (``fp8_experts``).

    Where ``torch._scaled_grouped_mm`` runs (CUDA compute capability 9.0 / 10.x) or off CUDA (emulated, the tests'
    path), each projection is one grouped GEMM for all local experts, row-wise scaled under either recipe
    (``kernels.fp8_grouped``: torch has no block-scaled grouped GEMM on sm90), with no host sync. On other CUDA GPUs
    (Ada, sm 8.9) or a torch without it, the experts run one after the other through ``fp8_linear`` (the recipe's
    scaling; one host sync for the token counts). ``adaptive`` decides for the whole module per power-of-two bucket
    of its routed rows: forward and backward of all local experts timed in bf16 and in FP8 at that many rows spread
    evenly (``Fp8Autotuner.decide_experts``); the module's own bf16 forward runs where FP8 does not pay.
    """

    def __init__(self, module, *, name: str, settings: Fp8Settings) -> None:
        refusal = fp8_experts_refusal(module)
        if refusal:
            raise Fp8Error(f"{name}: {refusal}.")
        super().__init__(name=name, settings=settings)
        self.module_ref = module

    def use_fp8(self, rows: int, fc1: torch.Tensor, fc2: torch.Tensor) -> bool:
        def decide(m: int, where: str) -> bool:
            return self.settings.autotuner.decide_experts(fc1, fc2, m, train=fc1.requires_grad, where=where,
                                                          activation=getattr(self.module_ref, "activation", None))

        return self.decision(rows, fc1, on=True, off=False, decide=decide)

    def __call__(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        from loongforge_hf.kernels.grouped_mlp import routed_inputs

        module = self.module_ref
        fc1, fc2 = module.linear_fc1.weight, module.linear_fc2.weight
        if not self.use_fp8(permuted_local_hidden_states.shape[0], fc1, fc2):
            return type(module).forward(module, permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x, probs = routed_inputs(module.config, permuted_local_hidden_states, permuted_probs)
        return fp8_experts(x, fc1, fc2, tokens_per_expert, probs, recipe=self.settings.recipe,
                           activation=getattr(module, "activation", None)), None


def grouped_experts(chunks) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every grouped expert module (stacked ``linear_fc1`` / ``linear_fc2`` weights)."""
    return [(f"{i}.{name}", m) for i, chunk in enumerate(chunks) for name, m in chunk.named_modules()
            if type(m).__name__ == "GroupedMLP" and type(m).__module__ == "loongforge_hf.kernels.grouped_mlp"]


# ---- the swap -------------------------------------------------------------------------------------------------------
@dataclass
class Fp8Report:
    mode: str
    recipe: str
    swapped: list[str]
    skipped: dict[str, str]
    autotuner: Fp8Autotuner | None = None


def eligible_linears(chunks) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every layer ``enable_fp8`` would swap, over all chunks (names prefixed by chunk index)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    found = []
    for i, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and name.rsplit(".", 1)[-1] in ELIGIBLE \
                    and module.weight is not None:
                found.append((f"{i}.{name}", module))
    return found


def vision_linears(towers) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every ``VisionLinear`` of the vision ``towers`` (names ``vision.{tower}.{module}``)."""
    if not towers:
        return []
    from loongforge_hf.multimodal.vision import VisionLinear

    return [(f"vision.{i}.{name}", m) for i, tower in enumerate(towers) for name, m in tower.named_modules()
            if isinstance(m, VisionLinear)]


def swap_linears(chunks, *, mode: str, recipe: str, cache_path: str | os.PathLike | None = None,
                 towers=()) -> Fp8Report:
    """Give every eligible layer whose weight fits the recipe an FP8 ``_forward_impl`` (and every linear of the
    vision ``towers`` an ``fp8_impl``); no device check: see ``enable_fp8``; off CUDA the GEMMs are emulated, which
    only tests use."""
    check_fp8_mode(mode)
    check_recipe(recipe)
    settings = Fp8Settings(mode=mode, recipe=recipe,
                           autotuner=Fp8Autotuner(recipe, Path(cache_path) if cache_path else None)
                           if mode == "adaptive" else None)
    swapped, skipped = [], {}
    step = granule(recipe)

    def swap(name, module, attr, impl, weights):
        """Install ``impl`` as ``module.attr`` where every weight's matrix dimensions fit the recipe's GEMMs."""
        bad = [tuple(w.shape[-2:]) for w in weights if not gemm_eligible(*w.shape[-2:], recipe)]
        if bad:
            skipped[name] = f"weight {'x'.join(map(str, bad[0]))} is not a multiple of {step} ({recipe} FP8 GEMM)"
        else:
            setattr(module, attr, impl(name=name, settings=settings))
            swapped.append(name)

    for name, module in eligible_linears(chunks):
        swap(name, module, "_forward_impl", functools.partial(Fp8ForwardImpl, module), [module.weight])
    for name, module in grouped_experts(chunks):  # fc1 [E, 2F, H], fc2 [E, H, F]
        refusal = fp8_experts_refusal(module)
        if refusal:
            skipped[name] = f"{refusal}: left in the model's dtype"
            continue
        swap(name, module, "forward", functools.partial(Fp8GroupedExperts, module),
             [module.linear_fc1.weight, module.linear_fc2.weight])
    for name, module in vision_linears(towers):
        swap(name, module, "fp8_impl", Fp8VisionImpl, [module.weight])
    return Fp8Report(mode=mode, recipe=recipe, swapped=swapped, skipped=skipped, autotuner=settings.autotuner)


def enable_fp8(chunks, mode: str, *, recipe: str | None = None,
               cache_path: str | os.PathLike | None = None, towers=()) -> Fp8Report:
    """Turn on FP8 GEMMs in the eligible linear layers of ``chunks`` (megatron modules already on their GPU) and of
    the vision ``towers``, if any."""
    check_fp8_mode(mode)
    params = [p for chunk in chunks for p in chunk.parameters()]
    if not params:
        raise Fp8Error("enable_fp8: the model has no parameters.")
    device = params[0].device
    check_fp8_device(device)
    if recipe is None:
        recipe = "blockwise" if blockwise_supported(device.index or 0) else "rowwise"
        if recipe == "rowwise":
            logger.warning("fp8: this GPU / torch build does not run block-wise scaled GEMMs; using row-wise scaling.")
    elif recipe not in RECIPES:
        raise Fp8Error(f"fp8_recipe={recipe!r} is not supported; use one of {RECIPES} (Transformer Engine recipes are "
                       "not offered by this backend).")
    elif is_blockwise(recipe) and not blockwise_supported(device.index or 0, recipe):
        raise Fp8Error(f"fp8_recipe={recipe!r} needs block-wise scaled GEMMs, which this GPU / torch build does not "
                       "run; use fp8_recipe='rowwise'.")
    report = swap_linears(chunks, mode=mode, recipe=recipe, cache_path=cache_path, towers=towers)
    logger.info("fp8=%s (%s scaling): %d linear layers swapped, %d left in their dtype %s", mode, recipe,
                len(report.swapped), len(report.skipped), report.skipped or "")
    return report


def disable_fp8(chunks, towers=()) -> None:
    """Undo ``swap_linears``: every layer runs its class's ``_forward_impl`` (``forward``, ``F.linear``) again."""
    for _, module in eligible_linears(chunks):
        module.__dict__.pop("_forward_impl", None)
    for _, module in grouped_experts(chunks):
        module.__dict__.pop("forward", None)
    for _, module in vision_linears(towers):
        module.__dict__.pop("fp8_impl", None)
