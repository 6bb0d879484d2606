"""Fixes every backend needs when Transformer Engine is absent, and the tensor-parallel marks of weights built
without initialisation (checked against megatron-core 0.16.1)."""

from __future__ import annotations

import functools
import importlib.util

import torch

_DONE = False


def apply_without_te_fixes() -> None:
    global _DONE
    if _DONE:
        return
    from megatron.core.transformer.moe import moe_utils

    # transformer/moe/moe_utils.py:34 imports `te_general_gemm` only when TE imports, yet line 1192
    # (RouterGatingLinearFunction.forward) reads the name unconditionally: without TE it is a NameError.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla

    # transformer/multi_latent_attention.py:54-62 sets HAVE_TE = True whenever extensions/transformer_engine imports,
    # which it also does without TE (its TE classes are then MagicMocks); line 185 then calls
    # `isinstance(self.linear_proj, TELinear)` with a mock and MLASelfAttention cannot be built.
    if not te_ext.HAVE_TE:
        mla.HAVE_TE = False
    _patch_reshardable_load_without_fused_adam()
    _patch_grad_norm_without_apex()
    _patch_tp_attributes_without_init()
    _DONE = True


def _patch_tp_attributes_without_init() -> None:
    from megatron.core.tensor_parallel import layers

    # Weights are built without initialisation (perform_initialization=False: the loader fills them), and megatron
    # marks a weight as tensor-parallel only inside its initialisation: tensor_parallel/layers.py:244 / 265, 855 /
    # 877 and 1178 / 1201 skip both `_initialize_affine_weight_cpu` (use_cpu_initialization) and
    # `_initialize_affine_weight_gpu` (on the device). Unmarked shards look like replicas to the optimizer
    # (`param_is_not_tensor_parallel_duplicate`), which then leaves them out of the grad norm on TP ranks > 0: the
    # norm of a TP2 model was ~1/sqrt(2) of transformers' on two GPUs, and clipping followed it. This sets the marks
    # those initialisations set, on every backend.
    for cls, dim in ((layers.ColumnParallelLinear, 0), (layers.RowParallelLinear, 1),
                     (layers.VocabParallelEmbedding, 0)):
        original = cls.__init__
        if getattr(original, "_loongforge_marks", False):
            continue

        def init(self, *args, __original=original, __dim=dim, **kwargs):
            __original(self, *args, **kwargs)
            weight = getattr(self, "weight", None)
            if weight is not None and not hasattr(weight, "tensor_model_parallel"):
                stride = getattr(self, "stride", 1) if __dim == 0 else 1
                layers.set_tensor_model_parallel_attributes(weight, True, __dim, stride)

        functools.update_wrapper(init, original)
        init._loongforge_marks = True
        cls.__init__ = init


def l2_norm(tensors: list, device: torch.device) -> torch.Tensor:
    """The l2 norm over all of ``tensors`` as a ``[1]`` fp32 tensor (on ``device`` when there are none), from one
    ``torch._foreach_norm`` (fp32 accumulation) and no host sync."""
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1)


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """What megatron calls as ``amp_C.multi_tensor_l2norm``: ``l2_norm`` of ``tensor_lists[0]``."""
    return l2_norm(tensor_lists[0], noop_flag.device), None


def _patch_grad_norm_without_apex() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    # optimizer/clip_grads.py:42 falls back to utils.local_multi_tensor_l2_norm (utils.py:1200-1208) without TE / Apex:
    # a `torch.norm` per gradient, then `torch.tensor(list of device scalars)`, which reads each norm back to the host
    # (one device sync per parameter: 227 per step of a 28-layer model, the GPU idling between them).
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm


def _patch_reshardable_load_without_fused_adam() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_loongforge", False):
        return

    # optimizer/distrib_optimizer.py:936-940 copies every key of the inner optimizer's per-parameter state from the
    # checkpoint. torch's AdamW (used without TE / Apex) keeps a per-parameter `step`, which the fully_reshardable
    # format stores once in the param groups instead (distrib_optimizer.py:640-643): the copy raised KeyError('step').
    # Keys the checkpoint lacks keep the value `load_state_dict` already restored.
    def set_states(self, model_param, tensors):
        current = self._get_main_param_and_optimizer_states(model_param)
        missing = {k: current[k] for k in current if k not in tensors}
        if set(missing) - {"step"}:
            raise KeyError(f"checkpoint lacks optimizer state {sorted(set(missing) - {'step'})}")
        return original(self, model_param, {**tensors, **missing})

    set_states._loongforge = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states

    # distrib_optimizer.py:813-816 gives every parameter the *same* `step` tensor; torch's AdamW then increments it
    # in place once per parameter and step, so bias correction runs ahead after a resume. Un-share it.
    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        out = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = state["step"].clone()
        return out

    DistributedOptimizer.load_state_dict = load_state_dict


# ---- weight-gradient accumulation into megatron's fp32 main_grad, without Apex ------------------------------------
# megatron-core 0.16.1 tensor_parallel/layers.py:561-575: with `gradient_accumulation_fusion` the backward of
# ColumnParallelLinear / RowParallelLinear calls Apex's `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input,
# grad_output, weight.main_grad)` (main_grad += grad_output^T @ input, one GEMM with fp32 output and beta = 1), returns
# a dummy weight grad and sets `weight.grad_added_to_main_grad`, so DDP's hook (distributed_data_parallel.py:436-441)
# skips its separate `main_grad.add_(grad)`. Without Apex the flag stays off and every weight grad costs an extra bf16
# [out, in] buffer plus an add kernel. torch's `addmm(..., out_dtype=torch.float32)` (CUDA: bf16/fp16 inputs, fp32
# output and accumulator) is that GEMM.


def accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` as one GEMM whose accumulator and output are ``acc``'s dtype (fp32 for bf16 ``a``/``b`` on
    CUDA): no product tensor in the inputs' dtype, no cast, no separate add."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        # NOTE: no mixed-dtype GEMM on CPU: the same sum in the accumulator's precision.
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _accumulate_wgrad(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    accumulate_matmul(main_grad, grad_output.t(), input)


class TorchWgradAccumulation:
    """What megatron calls as the ``fused_weight_gradient_mlp_cuda`` module, on torch ops:
    ``main_grad += grad_output^T @ input`` for 2-D ``input [tokens, in]`` and ``grad_output [tokens, out]``."""

    @staticmethod
    def wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        _accumulate_wgrad(input, grad_output, main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        _accumulate_wgrad(input, grad_output, main_grad)


def wgrad_accumulation_supported(device: torch.device) -> bool:
    """Whether ``TorchWgradAccumulation`` runs on ``device`` for bf16 inputs (CUDA: torch has ``addmm.dtype_out``)."""
    if device.type != "cuda":
        return device.type == "cpu"
    a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    acc = torch.ones(16, 16, dtype=torch.float32, device=device)
    try:
        _accumulate_wgrad(a, a, acc)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool((acc == 17).all())


def enable_wgrad_accumulation_fusion(modules) -> int:
    """Turn on megatron's ``gradient_accumulation_fusion`` for the tensor-parallel linears among ``modules`` whose
    weight is trained and has a ``main_grad`` (set by megatron's DDP), with ``TorchWgradAccumulation`` standing in for
    Apex when Apex is absent. Returns how many layers were switched."""
    from megatron.core.tensor_parallel import layers

    if not getattr(layers, "_grad_accum_fusion_available", False):
        # NOTE: layers.py:44-48 imports Apex's module under this name; the backward reads the module global.
        layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
    switched = 0
    for module in modules:
        if not isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            continue
        weight = getattr(module, "weight", None)
        # NOTE: a tied output layer has no weight of its own (it is handed the embedding's): left as it is.
        if weight is None or not weight.requires_grad or not hasattr(weight, "main_grad"):
            continue
        module.gradient_accumulation_fusion = True
        switched += 1
    return switched


def enable_te_wgrad_accumulation(modules) -> int:
    """The same for Transformer Engine's linears (``fp8_recipe="te_..."``, megatron's ``TEColumnParallelLinear`` /
    ``TERowParallelLinear``): their weight-gradient GEMM then writes into DDP's ``main_grad`` with beta = 1, in the
    buffer's dtype, and TE sets ``grad_added_to_main_grad`` so DDP's hook skips its add (TE 2.x
    ``module/linear.py``, ``fuse_wgrad_accumulation``; megatron passes ``config.gradient_accumulation_fusion`` at
    build time, when no ``main_grad`` exists yet, so the builder leaves it off). Returns how many were switched."""
    if importlib.util.find_spec("transformer_engine") is None:
        return 0
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    switched = 0
    for module in modules:
        weight = getattr(module, "weight", None)
        if isinstance(module, (TEColumnParallelLinear, TERowParallelLinear)) and weight is not None \
                and weight.requires_grad and hasattr(weight, "main_grad"):
            module.fuse_wgrad_accumulation = True
            switched += 1
    return switched
