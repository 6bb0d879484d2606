"""Routed experts as one grouped MLP (gated, or plain: Nemotron-H's relu2 experts): every local expert's fc1 and fc2
in one stacked weight each, the tokens (already permuted and sorted by expert by megatron's dispatcher) run through
two grouped GEMMs.

Choices:
- Weights: ``linear_fc1.weight`` ``[local experts, 2 * F / etp, H]`` (each expert's rows ``[gate_r; up_r]``, the
  layout of megatron's gated fc1 on expert-tensor-parallel rank ``r``; without ``gated_linear_unit`` ``[local
  experts, F / etp, H]``, rows ``up_r``) and ``linear_fc2.weight`` ``[local experts, H, F / etp]``: one Parameter per
  projection, each expert's slice laid out like the HF tensor (out, in), so the bridge loads and exports an expert
  with the same transforms as a dense MLP.
- Compute: ``torch._grouped_mm(x, W.transpose(-2, -1), offs=cumsum(tokens_per_expert))`` on CUDA in bf16 when every
  stride is 16-byte aligned (H and F / etp multiples of 8); otherwise (CPU, fp32/fp16, odd widths) a loop of one
  matmul per expert with the same math (``_grouped_mm``'s own CPU fallback is not used by default: the loop is the
  reference). ``_grouped_mm``'s backward refuses a broadcast gradient; the output hands on a dense one.
- Low-rank adapters (``LowRank``: LoRA on the experts, ``lora/experts.py``): per projection, optionally, a term
  ``scaling * (t @ A[e].T) @ B[e].T`` added to expert ``e``'s product of ``t``, in both paths with the same op
  order; the grouped path runs it as two more grouped GEMMs (never the merged ``[E, out, in]`` weight), and takes
  it where A and B are bf16 too. A rank whose rows break the 16-byte alignment (PEFT's r=4 on bf16) is padded
  with zero rows of A and columns of B to the next multiple of 8 for the GEMMs (the same sum: the added products
  are zeros; autograd hands the padded factors' gradients back to the real ones), so one small rank does not send
  the whole layer to the loop. Frozen stacks get no weight gradient: ``_grouped_mm``'s backward computes only the
  gradients autograd asks for. A projection's bias is added after its adapter term. (The FP8 experts,
  ``fp8_linear.Fp8GroupedExperts``, refuse biases and any activation but SwiGLU; the LoRA layer,
  ``lora/experts.py``, refuses the plain relu2 experts.)
- Math per expert: ``act(x @ W1[e].T + b1[e])``, times the token's routing probability (cast back to the activation
  dtype, as megatron's expert MLP does), ``@ W2[e].T``, plus ``b2[e]`` times the probability (megatron's
  ``MLP.forward`` with ``per_token_scale`` and ``TEGroupedMLP._apply_bias``: ``(out + b2 * p)`` in fp32 when the
  probabilities are, cast back once). With ``moe_apply_probs_on_input`` the probabilities scale the input instead
  (megatron allows this only for top-1) and ``b2`` is added as is (megatron's probabilities are ones then).
- Activation from the config (``expert_activation``): gated, SwiGLU (``kernels.swiglu``, ``activation_func=silu``),
  gpt-oss's clamped GLU (``kernels.clamped_glu``, ``activation_func=quick_gelu`` with ``glu_linear_offset`` and
  ``activation_func_clamp_value``; DeepSeek-V4's / HY-V4's clamped SwiGLU: silu with the clamp) or Gemma 4's gated
  tanh-GELU (``kernels.geglu``, ``activation_func=gelu_tanh``), each saving only the fc1 output for the backward; not
  gated (``gated_linear_unit=False``), the squared ReLU (``kernels.relu2``, ``activation_func=relu2``: Nemotron-H /
  Nemotron 3 Nano), saving only ``relu`` of the fc1 output. Anything else is refused. The GEMMs, probabilities and
  adapters do not depend on it: only fc1's width (``2F`` gated, ``F`` not) does.
- Biases (``add_bias_linear``, gated experts only: refused without ``gated_linear_unit``, which no supported model
  needs): ``linear_fc1.bias`` ``[E, 2F / etp]`` (each expert's ``[gate_r; up_r]`` like its
  weight rows) and ``linear_fc2.bias`` ``[E, H]``, zero at initialisation (megatron's). The loop adds ``b[e]`` to
  expert ``e``'s rows; the grouped path gathers each row's bias by its expert (``bucketize`` of the row index in the
  offsets: no host sync; rows past the last offset, which the GEMMs leave alone, read the last expert's) and sums
  the bias gradient per expert in fp32 as differences of one running sum at the offsets (``_ExpertBias``: in
  order, rounded once like the loop's sum; an atomic ``index_add`` would add in any order, a grouped GEMM of bf16
  operands would round each ``p * grad`` term first), keeping only the row indices for the backward.
- Expert-tensor parallelism: each rank holds its slice of F; no communication here: megatron's dispatcher gathers
  tokens over the expert-tensor-parallel group and reduce-scatters (sums) the partial fc2 outputs. So ``b1`` is split
  like fc1's rows, and ``b2`` (fc2's output is not split) is whole on every rank and added on expert-TP rank 0 only
  (``_FirstRankOnly``: zeros elsewhere, else the sum would hold it etp times); its gradient reaches every rank alike
  (the combine's backward all-gathers the output gradient, so each rank sums the same ``p * grad``), which keeps the
  replicas equal without communication.
- Parameters carry megatron's attributes: ``allreduce=False`` under expert parallelism (gradients are reduced over
  the expert-data-parallel group), tensor-parallel attributes for gradient-norm bookkeeping: megatron's optimizer
  counts a parameter marked ``tensor_model_parallel`` on every rank and an unmarked one only on rank 0 of the
  (dense) tensor-parallel group (``param_is_not_tensor_parallel_duplicate``). The stacks and ``b1`` are marked (split,
  or distinct experts under expert parallelism); ``b2`` is marked only with ``etp == 1`` and, replicated over
  expert-TP otherwise, left unmarked, which counts it once per expert-TP group where those groups are the dense
  tensor-parallel groups: expert-TP > 1 with biases therefore needs ``expert_tensor_parallel_size ==
  tensor_model_parallel_size`` (megatron-core 0.16's ``TransformerConfig`` asserts etp == 1 for MoE biases anyway).
  ``b2`` is never marked ``sequence_parallel``: megatron would sum its gradient over the tensor-parallel ranks,
  which hold other experts or the same gradient.
- ``sharded_state_dict``: the same keys and global shapes as megatron's ``SequentialMLP`` with a gated local MLP
  (``{prefix}experts.linear_fc1.weight`` ``[N, 2F, H]`` with gate rows then up rows, ``...linear_fc2.weight``
  ``[N, H, F]``, ``...linear_fc1.bias`` ``[N, 2F]`` split gate / up like the weight, ``...linear_fc2.bias``
  ``[N, H]`` replicated over expert-TP) or a plain one (``...linear_fc1.weight`` ``[N, F, H]``, rows split over
  expert-TP as megatron's ``ColumnParallelLinear`` saves them); the expert axis is the stack's first dimension,
  sharded over expert parallelism.
- An expert with no tokens still gets a (zero) gradient; a rank with no tokens at all runs the loop on empty splits.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from megatron.core.transformer.module import MegatronModule

from loongforge_hf.kernels._saved import needs_autograd
from loongforge_hf.kernels.clamped_glu import ClampedGLU
from loongforge_hf.kernels.geglu import GeGLU, gelu_tanh
from loongforge_hf.kernels.relu2 import Relu2, relu2
from loongforge_hf.kernels.swiglu import SwiGLU, swiglu

__all__ = ["DenseGrad", "GroupedMLP", "LowRank", "expert_activation", "gated_activation", "grouped_gated_mlp",
           "grouped_mm_supported"]


class LowRank(NamedTuple):
    """A per-expert low-rank term on one projection ``[E, out, in]``: ``scaling * (t @ A[e].T) @ B[e].T`` for expert
    ``e``'s tokens ``t``; A ``[E, r, in]``, B ``[E, out, r]``."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float


NO_ADAPTERS = (None, None)
NO_BIASES = (None, None)


def grouped_mm_supported(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, *,
                         adapters: tuple[LowRank | None, LowRank | None] = NO_ADAPTERS,
                         biases: tuple[torch.Tensor | None, torch.Tensor | None] = NO_BIASES) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: CUDA, bf16 throughout, 16-byte aligned strides of the
    expert stacks (an adapter's rank is padded to alignment where needed, ``_aligned``)."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or x.shape[0] == 0:
        return False
    factors = [w for a in adapters if a is not None for w in (a.A, a.B)]
    if any(t.dtype != torch.bfloat16 for t in (x, fc1, fc2, *factors, *(b for b in biases if b is not None))):
        return False
    align = 16 // x.element_size()
    return all(d % align == 0 for w in (fc1, fc2) for d in w.shape[1:])


def _aligned(lr: LowRank) -> LowRank:
    """``lr`` with its rank padded by zeros to a multiple of 16 bytes (the GEMMs' stride rule); unchanged if it is."""
    r = lr.A.shape[1]
    pad = -r % (16 // lr.A.element_size())
    if pad == 0:
        return lr
    return LowRank(torch.nn.functional.pad(lr.A, (0, 0, 0, pad)), torch.nn.functional.pad(lr.B, (0, pad)),
                   lr.scaling)


def check_expert_shapes(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, counts: torch.Tensor,
                        where: str, adapters: tuple[LowRank | None, LowRank | None] = NO_ADAPTERS,
                        biases: tuple[torch.Tensor | None, torch.Tensor | None] = NO_BIASES, *,
                        gated: bool = True) -> None:
    """``ValueError`` unless fc1 is ``[E, 2F, H]`` (``gated``; else ``[E, F, H]``), fc2 ``[E, H, F]`` for tokens
    ``[T, H]`` and ``E`` token counts, each adapter's A is ``[E, r, in]`` and B ``[E, out, r]`` of its projection,
    and each bias ``[E, out]``."""
    width = 2 if gated else 1
    if fc1.dim() != 3 or fc2.dim() != 3 or fc1.shape[0] != fc2.shape[0] or fc1.shape[1] != width * fc2.shape[2] \
            or fc1.shape[2] != x.shape[-1] or fc2.shape[1] != x.shape[-1]:
        raise ValueError(f"{where}: fc1 {tuple(fc1.shape)} must be [E, {'2F' if gated else 'F'}, H] and fc2 "
                         f"{tuple(fc2.shape)} [E, H, F] for tokens {tuple(x.shape)}.")
    if counts.numel() != fc1.shape[0]:
        raise ValueError(f"{where}: {counts.numel()} token counts for {fc1.shape[0]} experts.")
    for name, w, a, b in zip(("fc1", "fc2"), (fc1, fc2), adapters, biases):
        e, out, inp = w.shape
        if b is not None and tuple(b.shape) != (e, out):
            raise ValueError(f"{where}: {name}'s bias {tuple(b.shape)} must be [E, out] = {(e, out)}.")
        if a is None:
            continue
        if a.A.dim() != 3 or a.B.dim() != 3 or tuple(a.A.shape[::2]) != (e, inp) \
                or tuple(a.B.shape[:2]) != (e, out) or a.A.shape[1] != a.B.shape[2]:
            raise ValueError(f"{where}: {name}'s adapter A {tuple(a.A.shape)} must be [E, r, in] and B "
                             f"{tuple(a.B.shape)} [E, out, r] for {name} {tuple(w.shape)}.")


def scale_by_probs(act: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """Each token's row of ``act`` times its routing probability (``probs`` ``[T]``; None: unchanged)."""
    if probs is None:
        return act
    return (act * probs.unsqueeze(-1)).to(act.dtype)


def add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out + bias`` (``bias`` one row ``[N]`` or one per row ``[T, N]``, already times the probabilities for
    megatron's expert fc2 bias, maybe in fp32), cast back to ``out``'s dtype once."""
    if bias is None:
        return out
    return (out + bias).to(out.dtype)


def routed_inputs(config, x: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The experts' tokens and the probabilities still to apply after them: with ``moe_apply_probs_on_input`` the
    probabilities scale the tokens first (top-1 routing only) and none are left."""
    if config.moe_apply_probs_on_input:
        if config.moe_router_topk != 1:
            raise ValueError("moe_apply_probs_on_input needs moe_router_topk=1.")
        return scale_by_probs(x, probs), None
    return x, probs


def expert_loop(x, fc1, fc2, counts: list[int], probs, linear=None, adapters=NO_ADAPTERS, biases=NO_BIASES,
                activation: Callable[[torch.Tensor], torch.Tensor] = swiglu):
    """The experts one after the other: ``linear(t, w)`` (default ``t @ w.T``) for each projection; an expert
    without tokens still runs its (empty) products, so its weights get a zero gradient. ``adapters``: for fc1 and
    fc2, None or a ``LowRank`` whose term is added to each expert's product; ``biases``: for fc1 and fc2, None or
    ``[E, out]`` (fc2's times the probabilities)."""
    linear = linear or (lambda t, w: t @ w.t())

    def project(t, weights, e, lr):
        out = linear(t, weights[e])
        return out if lr is None else out + (t @ lr.A[e].t()) @ lr.B[e].t() * lr.scaling

    def bias_of(b, e, p=None):  # NOTE: _ExpertBias's forward for one expert
        if b is None:
            return None
        return b[e] if p is None else b[e] * p.unsqueeze(-1)

    xs = torch.split(x, counts)
    ps = torch.split(probs, counts) if probs is not None else [None] * len(counts)
    outs = []
    for e, (t, p) in enumerate(zip(xs, ps)):
        act = scale_by_probs(activation(add_bias(project(t, fc1, e, adapters[0]), bias_of(biases[0], e))), p)
        outs.append(add_bias(project(act, fc2, e, adapters[1]), bias_of(biases[1], e, p)))
    return torch.cat(outs, dim=0)


class DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense (contiguous) gradient: ``_grouped_mm``'s backward checks strides and
    refuses a broadcast one (``out.sum().backward()``); megatron's router gating backward views it
    (``bridges/router_logits.py``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _ExpertBias(torch.autograd.Function):
    """Each row's expert bias, ``bias[rows]`` (``rows``: the expert index per row), times the row's probability
    where ``probs`` is given (the loop's ``b[e] * p``, in the promoted dtype). Backward: each expert's rows of
    ``grad * p`` summed in fp32 as differences of one running sum at the offsets (in order, deterministic, exactly
    zero for an expert without rows, rows past the last offset left out) and rounded once, as the loop's broadcast
    sum does; keeps only the row indices, not the ``[T, out]`` rows."""

    @staticmethod
    def forward(ctx, bias, rows, offs, probs):
        ctx.save_for_backward(bias, rows, offs, probs)
        out = bias.index_select(0, rows)
        return out if probs is None else out * probs.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad):
        bias, rows, offs, probs = ctx.saved_tensors
        grad_bias = grad_probs = None
        if ctx.needs_input_grad[0]:
            running = grad.new_zeros(grad.shape[0] + 1, grad.shape[1], dtype=torch.float32)
            if probs is None:
                running[1:].copy_(grad)
            else:
                torch.mul(grad, probs.unsqueeze(-1), out=running[1:])
            running[1:].cumsum_(0)
            ends = running.index_select(0, torch.cat((offs.new_zeros(1), offs)).long())
            grad_bias = (ends[1:] - ends[:-1]).to(bias.dtype)
        if probs is not None and ctx.needs_input_grad[3]:
            grad_probs = (grad * bias.index_select(0, rows)).sum(-1).to(probs.dtype)
        return grad_bias, None, None, grad_probs


def _grouped(x, fc1, fc2, tokens_per_expert: torch.Tensor, probs, adapters, biases, activation):
    offs = torch.cumsum(tokens_per_expert, dim=0).to(device=x.device, dtype=torch.int32, non_blocking=True)
    rows = None
    if any(b is not None for b in biases):
        rows = torch.bucketize(torch.arange(x.shape[0], device=x.device, dtype=offs.dtype), offs, right=True)
        rows = rows.clamp_(max=fc1.shape[0] - 1)

    def gemm(t, w):
        return torch._grouped_mm(t, w.transpose(-2, -1), offs=offs)

    def project(t, weights, lr):  # NOTE: expert_loop's op order, so the loop stays the reference
        out = gemm(t, weights)
        if lr is None:
            return out
        lr = _aligned(lr)
        return out + gemm(gemm(t, lr.A), lr.B) * lr.scaling

    def bias_rows(b, p=None):
        return None if b is None else _ExpertBias.apply(b, rows, offs, p)

    act = scale_by_probs(activation(add_bias(project(x, fc1, adapters[0]), bias_rows(biases[0]))), probs)
    out = add_bias(project(act, fc2, adapters[1]), bias_rows(biases[1], probs))
    return DenseGrad.apply(out) if needs_autograd(out) else out


def grouped_gated_mlp(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, tokens_per_expert,
                      probs: torch.Tensor | None = None, *,
                      adapters: tuple[LowRank | None, LowRank | None] = NO_ADAPTERS,
                      biases: tuple[torch.Tensor | None, torch.Tensor | None] = NO_BIASES,
                      activation: Callable[[torch.Tensor], torch.Tensor] = swiglu, gated: bool = True,
                      use_grouped_mm: bool | None = None) -> torch.Tensor:
    """Experts' gated (or, ``gated=False``, plain) MLPs over tokens sorted by expert.

    x ``[T, H]`` (expert 0's tokens first), fc1 ``[E, 2F, H]`` (rows ``[gate; up]``; ``[E, F, H]`` not ``gated``),
    fc2 ``[E, H, F]``, ``tokens_per_expert`` ``[E]`` (tensor or list, summing to T), ``probs`` ``[T]`` or None.
    Returns ``[T, H]``. ``adapters``: for fc1 and fc2, None or a ``LowRank`` term added to the projection.
    ``biases``: for fc1 and fc2, None or ``[E, out]`` added to each expert's rows (fc2's times the probabilities).
    ``activation``: ``[..., 2F] -> [..., F]`` on the fc1 output (``swiglu``), elementwise ``[..., F] -> [..., F]``
    not ``gated`` (``relu2``); ``expert_activation(config)`` picks it from a config. ``use_grouped_mm`` forces a
    path (None: ``_grouped_mm`` where ``grouped_mm_supported``)."""
    counts = tokens_per_expert if isinstance(tokens_per_expert, torch.Tensor) else torch.tensor(tokens_per_expert)
    check_expert_shapes(x, fc1, fc2, counts, "grouped_gated_mlp", adapters, biases, gated=gated)
    grouped = grouped_mm_supported(x, fc1, fc2, adapters=adapters, biases=biases) if use_grouped_mm is None \
        else use_grouped_mm
    if grouped:
        return _grouped(x, fc1, fc2, counts, probs, adapters, biases, activation)
    return expert_loop(x, fc1, fc2, [int(c) for c in counts.tolist()], probs, adapters=adapters, biases=biases,
                       activation=activation)


def gated_activation(config) -> torch.nn.Module:
    """The experts' activation on the fc1 output that ``config`` asks for: ``SwiGLU`` (``activation_func=silu``),
    ``ClampedGLU`` (``activation_func=quick_gelu``, gpt-oss; silu with a clamp, DeepSeek-V4 / HY-V4) or ``GeGLU``
    (``activation_func=gelu_tanh``, Gemma 4); each checks the rest of the config."""
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if config.activation_func is quick_gelu or getattr(config, "activation_func_clamp_value", None) is not None:
        return ClampedGLU(config)
    if config.activation_func is gelu_tanh:
        return GeGLU(config)
    if config.activation_func is not F.silu:
        raise ValueError("loongforge GroupedMLP does not match this TransformerConfig: activation_func must be "
                         "torch.nn.functional.silu (SwiGLU), megatron.core.fusions.fused_bias_geglu.quick_gelu "
                         "(gpt-oss's clamped GLU) or loongforge_hf.kernels.geglu.gelu_tanh (the gated tanh-GELU), "
                         f"got {config.activation_func!r}.")
    return SwiGLU(config)


def expert_activation(config) -> torch.nn.Module:
    """The experts' activation that ``config`` asks for: ``gated_activation(config)`` with ``gated_linear_unit``,
    else ``Relu2`` (``activation_func=relu2``, Nemotron-H), the only plain one."""
    if config.gated_linear_unit:
        return gated_activation(config)
    if config.activation_func is not relu2:
        raise ValueError("loongforge GroupedMLP does not match this TransformerConfig: with gated_linear_unit=False "
                         "activation_func must be loongforge_hf.kernels.relu2.relu2 (the squared ReLU), got "
                         f"{config.activation_func!r}; the gated activations need gated_linear_unit=True.")
    return Relu2(config)


class _FirstRankOnly(torch.autograd.Function):
    """``t`` on the first rank of a group and zeros on the others in the forward; the gradient handed to ``t`` on
    every rank in the backward (a term that the group sums afterwards, whose gradient each rank sees whole)."""

    @staticmethod
    def forward(ctx, t, first: bool):
        return t.view_as(t) if first else torch.zeros_like(t)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _StackedWeight(torch.nn.Module):
    """Holds one projection's weights of every local expert: ``weight`` ``[E, out, in]`` and, with ``bias``, a
    ``bias`` ``[E, out]`` (zero, like megatron's) marked split along ``bias_partition_dim`` (None: left unmarked, a
    replica on every expert-tensor-parallel rank)."""

    def __init__(self, shape: tuple[int, int, int], *, dtype, device, partition_dim: int, expert_parallel: bool,
                 bias: bool = False, bias_partition_dim: int | None = None):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=partition_dim, stride=1)
        self.weight.allreduce = not expert_parallel
        if not bias:
            self.register_parameter("bias", None)
            return
        self.bias = torch.nn.Parameter(torch.zeros(shape[:2], dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.bias, is_parallel=bias_partition_dim is not None,
                                             dim=-1 if bias_partition_dim is None else bias_partition_dim, stride=1)
        self.bias.allreduce = not expert_parallel


class GroupedMLP(MegatronModule):
    """megatron's experts slot (``MoESubmodules.experts``): ``forward(tokens, tokens_per_expert, probs)``."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None) -> None:
        super().__init__(config=config)
        from megatron.core.tensor_parallel.utils import divide

        problems = []
        if getattr(config, "moe_latent_size", None):
            problems.append("moe_latent_size must be None")
        # NOTE: config.fp8 is set only by a Transformer Engine recipe (kernels/fp8_te.py), whose FP8 context this
        # module's torch GEMMs ignore: the routed experts stay in the model's dtype (this backend's own FP8 for them
        # is fp8_linear.Fp8GroupedExperts).
        if getattr(config, "fp4", None):
            problems.append("fp4 is not supported")
        if config.add_bias_linear and not config.gated_linear_unit:
            problems.append("add_bias_linear must be False without gated_linear_unit (plain experts take no biases)")
        if problems:
            raise ValueError("loongforge GroupedMLP does not match this TransformerConfig: " + "; ".join(problems)
                             + ".")
        self.activation = expert_activation(config)  # the same checks as the dense MLP's activation
        self.gated = bool(config.gated_linear_unit)
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        etp = self.tp_group.size()
        if config.add_bias_linear and etp > 1 and etp != config.tensor_model_parallel_size:
            raise ValueError(f"loongforge GroupedMLP with add_bias_linear and expert_tensor_parallel_size={etp} needs "
                             f"expert_tensor_parallel_size == tensor_model_parallel_size (got "
                             f"{config.tensor_model_parallel_size}): the fc2 bias, whole on every expert-TP rank, is "
                             "counted once per tensor-parallel group in the gradient norm.")
        hidden, ffn = config.hidden_size, divide(config.moe_ffn_hidden_size, etp)
        from loongforge_hf.xpu import get_backend

        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        kw = {"dtype": config.params_dtype, "device": device, "expert_parallel": config.expert_model_parallel_size > 1,
              "bias": config.add_bias_linear}
        # NOTE: fc2's bias, whole on each expert-TP rank, is marked (on the expert axis, distinct per expert-parallel
        # rank like the stacks) only where it has no expert-TP replicas; see the module docstring
        self.linear_fc1 = _StackedWeight((num_local_experts, (2 if self.gated else 1) * ffn, hidden), partition_dim=1,
                                         bias_partition_dim=1, **kw)
        self.linear_fc2 = _StackedWeight((num_local_experts, hidden, ffn), partition_dim=2,
                                         bias_partition_dim=0 if etp == 1 else None, **kw)
        if config.perform_initialization:
            self._initialize()

    @torch.no_grad()
    def _initialize(self) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        def init():
            for e in range(self.num_local_experts):
                self.config.init_method(self.linear_fc1.weight[e])
                self.config.output_layer_init_method(self.linear_fc2.weight[e])

        if self.linear_fc1.weight.is_cuda:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init()
        else:
            init()

    def biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """fc1's and fc2's biases as this rank adds them (fc2's: on expert-TP rank 0 only, ``_FirstRankOnly``)."""
        b1, b2 = self.linear_fc1.bias, self.linear_fc2.bias
        if b2 is not None and self.tp_group.size() > 1:
            b2 = _FirstRankOnly.apply(b2, self.tp_group.rank() == 0)
        return b1, b2

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x, probs = routed_inputs(self.config, permuted_local_hidden_states, permuted_probs)
        out = grouped_gated_mlp(x, self.linear_fc1.weight, self.linear_fc2.weight, tokens_per_expert, probs,
                                biases=self.biases(), activation=self.activation, gated=self.gated)
        return out, None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass (megatron calls this for delayed wgrad only)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError("GroupedMLP.sharded_state_dict: singleton_local_shards is not supported.")
        axis = len(sharded_offsets)
        ep = (axis, self.ep_group.rank(), self.ep_group.size())
        tp_rank, tp_size = self.tp_group.rank(), self.tp_group.size()
        replica_id = (0, 0, self.dp_group.rank())
        key = f"{prefix}experts."
        fc1, fc2 = self.linear_fc1.weight, self.linear_fc2.weight

        def build_fc1(k, t, replica, flattened_range):
            # NOTE: each expert's rows are [gate_r; up_r]: gate rows are shard r of 2 * tp_size of the global
            # [gate; up] rows, up rows shard tp_size + r (the layout SequentialMLP's gated fc1 saves); the bias
            # [E, 2F / etp] alike
            gate, up = torch.chunk(t, 2, dim=1)
            return [ShardedTensor.from_rank_offsets(k, part.contiguous(), *sharded_offsets, ep,
                                                    (axis + 1, index, 2 * tp_size), replica_id=replica,
                                                    prepend_axis_num=axis)
                    for part, index in ((gate, tp_rank), (up, tp_size + tp_rank))]

        def merge_fc1(parts):
            return torch.cat(parts, dim=1)

        if not self.gated:  # NOTE: a plain fc1's rows are split over expert-TP as one block, as fc2's columns
            fc1_sharded = ShardedTensor.from_rank_offsets(f"{key}linear_fc1.weight", fc1, *sharded_offsets, ep,
                                                          (axis + 1, tp_rank, tp_size), replica_id=replica_id,
                                                          prepend_axis_num=axis)
        else:
            fc1_sharded = ShardedTensorFactory(f"{key}linear_fc1.weight", fc1, build_fc1, merge_fc1, replica_id)
        out = {
            f"{prefix}linear_fc1.weight": fc1_sharded,
            f"{prefix}linear_fc2.weight": ShardedTensor.from_rank_offsets(
                f"{key}linear_fc2.weight", fc2, *sharded_offsets, ep, (axis + 2, tp_rank, tp_size),
                replica_id=replica_id, prepend_axis_num=axis),
        }
        b1, b2 = self.linear_fc1.bias, self.linear_fc2.bias
        if b1 is not None:
            out[f"{prefix}linear_fc1.bias"] = ShardedTensorFactory(f"{key}linear_fc1.bias", b1, build_fc1, merge_fc1,
                                                                   replica_id)
        if b2 is not None:  # whole on every expert-TP rank: the ranks past the first hold replicas
            out[f"{prefix}linear_fc2.bias"] = ShardedTensor.from_rank_offsets(
                f"{key}linear_fc2.bias", b2, *sharded_offsets, ep, replica_id=(0, tp_rank, self.dp_group.rank()),
                prepend_axis_num=axis)
        return out
