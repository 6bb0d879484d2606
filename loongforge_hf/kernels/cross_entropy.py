"""Fused linear cross-entropy: ``loss = CE(hidden @ weight.T, labels)`` without the full ``[N, V]`` logits.

Choices:
- Tokens are processed in chunks: each chunk's logits (``[chunk, V_local]``, fp32) live only inside the loop, so peak
  memory is one chunk of logits plus the grads of ``hidden`` and ``weight``.
- Logits are computed in the input dtype and upcast to fp32, as HF (``logits.float()``) and megatron do.
- Vocab parallel: ``weight`` holds rows ``[vocab_start, vocab_start + V_local)`` of the global vocabulary on each rank
  of ``tp_group``. The row max, the sum of exponentials and the target logit are all-reduced (two collectives per
  chunk), so every rank gets the same loss. ``hidden`` is the full input on every rank; its grad is all-reduced here,
  so do not also route it through megatron's ``copy_to_tensor_model_parallel_region``.
- Rows at or beyond ``vocab_size`` (the true vocabulary; megatron pads it to a multiple of the TP size) are masked to
  -inf, so padding never takes probability mass.
- ``reduction="sum"`` (training) computes the grads during the forward, Liger-style, and the backward only scales them:
  one logits matmul per chunk instead of two. ``reduction="none"`` returns per-token losses; its backward recomputes
  each chunk's logits, since per-token output grads are only known then.
- ``z_loss`` adds ``z_loss * logsumexp^2`` per token (PaLM's auxiliary loss). Ignored tokens contribute 0; the caller
  divides by its token count.
- ``label_smoothing`` (eps) gives transformers' ``LabelSmoother`` per token: ``(1 - eps) * -log p(label) + eps *
  mean_v(-log p_v)`` over the true vocabulary (padding rows excluded), i.e. ``lse - (1 - eps) * x_label - eps *
  mean_v(x_v)``; its logits grad is ``softmax - (1 - eps) * onehot - eps / V``. The row sum of the logits joins the
  all-reduce of the sum of exponentials under TP.
- On CUDA with Triton and without tensor parallelism, each chunk's loss and logits grad come from one Triton kernel
  (``_cross_entropy_triton.py``) that works on the logits in their own dtype, in place: the grad is rounded to that
  dtype as the torch path rounds it before the grad matmuls. The torch path is the CPU/TP path and the reference.
- The weight grad accumulates over the chunks in fp32 (one GEMM per chunk with an fp32 accumulator) and is rounded to
  the weight's dtype once; ``weight_grad_dtype=torch.bfloat16`` accumulates in bf16 instead (each chunk's GEMM still
  sums in fp32 and rounds once into the accumulator), as Liger-Kernel and transformers' bf16 grads do: half the
  accumulator memory (``[V, H]``, alive from the loss forward to the backward, at the activation peak) and half its
  traffic per chunk. ``MegatronEngine`` asks for it with ``optimizer_precision="model"``, whose grads are bf16 anyway.
- Labels outside ``[0, vocab_size)`` other than ``ignore_index`` raise (one host sync per call) instead of silently
  reading a wrong logit.
- ``softcap``: the logits soft-capped first, ``cap * tanh(logits / cap)`` (Gemma 2's ``final_logit_softcapping``),
  in fp32 on the torch path; the loss, token statistics and grads are the capped logits' (the logits grad times
  ``1 - tanh^2``).
- ``logit_scale``: the logits multiplied by it first, in their own dtype (Cohere's ``logits * logit_scale``: the
  same rounding), before any soft-capping; the logits grad times it (with the rows' scale, in fp32).
- ``bias``: the LM head's bias (Phi's ``lm_head.bias``, this rank's vocabulary rows) added to each chunk's logits in
  the GEMM (``addmm``, as ``nn.Linear``), before any scaling; its gradient is the logits grad summed over the tokens
  (fp32 over the chunks, rounded to the bias's dtype once).
- ``low_rank``: a LoRA adapter on the LM head, ``(z [N, r], B [V_local, r])`` with ``z = scaling * dropout(hidden)
  @ A^T`` made by the caller: each chunk's logits gain ``z @ B^T`` (in the GEMM's dtype, before the bias is
  scaled or capped: PEFT adds the adapter's term to the linear's output), without ever forming ``W + scaling B A``:
  the frozen ``[V, H]`` weight takes no gradient, ``z``'s is all-reduced over TP as ``hidden``'s, ``B``'s accumulates
  in fp32 over the chunks (``[V_local, r]``).
- ``token_stats`` (an fp32 ``[2]`` tensor) receives, summed over the non-ignored tokens, the entropy of each token's
  predicted distribution and whether its label is the top-1 prediction (the first maximum, as ``argmax`` picks it):
  what trl.SFTTrainer logs as ``entropy`` and ``mean_token_accuracy``. They come from the chunk's logits in the same
  pass as the loss (the entropy term shares its all-reduce; the first maximum's global index takes one more under TP).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from loongforge_hf.kernels._triton import use_triton
from loongforge_hf.xpu.common import accumulate_matmul


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _Plan:
    """What every chunk needs: which rows are real vocabulary, where each label lives, which tokens count."""

    def __init__(self, labels: torch.Tensor, *, v_local: int, vocab_start: int, vocab_size: int, ignore_index: int,
                 z_loss: float, group, weight_grad_dtype: torch.dtype = torch.float32,
                 token_stats: torch.Tensor | None = None, label_smoothing: float = 0.0,
                 softcap: float | None = None, logit_scale: float | None = None,
                 bias: torch.Tensor | None = None, low_rank: tuple | None = None) -> None:
        self.bias = bias
        self.low_rank = low_rank
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.weight_grad_dtype = weight_grad_dtype
        self.smoothing = label_smoothing
        self.vocab_size = vocab_size
        self.token_stats = token_stats
        self.labels = labels
        self.vocab_start = vocab_start
        self.valid = labels != ignore_index
        local = labels - vocab_start
        self.in_shard = self.valid & (local >= 0) & (local < v_local)
        self.local_label = torch.where(self.in_shard, local, torch.zeros_like(local))
        self.real_rows = max(0, min(v_local, vocab_size - vocab_start))
        self.v_local = v_local
        self.z_loss = z_loss
        self.group = group

    def chunk(self, hidden: torch.Tensor, weight: torch.Tensor, rows: slice, *, with_grad: bool,
              row_scale: torch.Tensor | None = None, stats: bool = False):
        """Loss ``[c]`` of the tokens in ``rows`` and, when asked, d(loss)/d(logits) ``[c, V_local]`` (fp32, or the
        input dtype from the Triton kernel), times ``row_scale [c]`` when given; ``stats`` adds the rows' entropy and
        top-1 sums to ``token_stats``."""
        stats = stats and self.token_stats is not None
        if self.logit_scale is not None and with_grad:  # NOTE: d(scaled logits) / d(logits)
            row_scale = row_scale * self.logit_scale if row_scale is not None else torch.full(
                (rows.stop - rows.start,), self.logit_scale, dtype=torch.float32, device=hidden.device)
        if self.softcap is not None:
            capped = torch.tanh(self._logits(hidden, weight, rows).to(torch.float32) / self.softcap)
            loss, grad = self.scores(capped * self.softcap, rows, with_grad=with_grad, row_scale=row_scale,
                                     stats=stats)
            return loss, (grad.mul_(1 - capped.square_()) if grad is not None else None)
        if self.group is None and use_triton(hidden):
            from loongforge_hf.kernels import _cross_entropy_triton

            logits = self._logits(hidden, weight, rows)
            loss, *extra = _cross_entropy_triton.chunk_loss(
                logits, self.local_label[rows], self.in_shard[rows], self.valid[rows], real_cols=self.real_rows,
                z_loss=self.z_loss, smoothing=self.smoothing, vocab_size=self.vocab_size, with_grad=with_grad,
                row_scale=row_scale.to(torch.float32).contiguous() if row_scale is not None else None, stats=stats)
            if stats:
                entropy, first_max = extra
                self._add_stats(rows, entropy, first_max.to(torch.int64) + self.vocab_start)
            return loss, (logits if with_grad else None)
        return self.scores(self._logits(hidden, weight, rows).to(torch.float32), rows, with_grad=with_grad,
                           row_scale=row_scale, stats=stats)

    def _logits(self, hidden: torch.Tensor, weight: torch.Tensor, rows: slice) -> torch.Tensor:
        """The logits ``[c, V_local]`` of the tokens in ``rows``, in the input dtype, times ``logit_scale``."""
        logits = hidden[rows] @ weight.t() if self.bias is None else torch.addmm(self.bias, hidden[rows], weight.t())
        if self.low_rank is not None:
            z, b = self.low_rank
            logits.addmm_(z[rows], b.t())
        return logits.mul_(self.logit_scale) if self.logit_scale is not None else logits

    def scores(self, logits: torch.Tensor, rows: slice, *, with_grad: bool, row_scale: torch.Tensor | None = None,
               stats: bool = False):
        """``chunk`` from this rank's fp32 logits ``[c, V_local]`` of the tokens in ``rows`` (changed in place)."""
        if self.real_rows < self.v_local:
            logits[:, self.real_rows:] = float("-inf")
        local_label = self.local_label[rows]
        in_shard = self.in_shard[rows]
        target = logits.gather(1, local_label[:, None]).squeeze(1)
        target = torch.where(in_shard, target, torch.zeros_like(target))
        # NOTE: before the in-place exponentials below; the padding columns (-inf) left out
        row_sum = logits[:, :self.real_rows].sum(dim=-1) if self.smoothing else None
        local_max = logits.max(dim=-1).values
        row_max = _all_reduce(local_max.clone() if stats else local_max, dist.ReduceOp.MAX, self.group)
        if stats:
            first_max = self._first_max(logits, local_max, row_max)
        # NOTE: a rank whose shard is all padding sees exp(-inf - max) = 0: it adds nothing.
        probs = torch.exp_(logits.sub_(row_max[:, None]))
        sums = [probs.sum(dim=-1), target]
        if row_sum is not None:
            sums.append(row_sum)
        if stats:
            # NOTE: sum of exp(x - max) * (x - max); xlogy gives 0, not nan, at the -inf (padding) columns.
            sums.append(torch.xlogy(probs, probs).sum(dim=-1))
        sum_exp, target, *rest = _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, self.group)
        row_sum = rest.pop(0) if row_sum is not None else None
        if stats:
            # NOTE: entropy = lse - sum(p * x) = log(sum_exp) - sum(exp(x - max) * (x - max)) / sum_exp
            self._add_stats(rows, torch.log(sum_exp) - rest[0] / sum_exp, first_max)
        lse = row_max + torch.log(sum_exp)
        valid = self.valid[rows]
        loss = lse - target
        if row_sum is not None:
            loss = loss + self.smoothing * (target - row_sum / self.vocab_size)
        if self.z_loss:
            loss = loss + self.z_loss * lse.square()
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        if not with_grad:
            return loss, None
        # d/dlogits of (lse - target + z * lse^2) = softmax * (1 + 2 z lse) - onehot(target)
        probs.div_(sum_exp[:, None])
        if self.z_loss:
            probs.mul_((1 + 2 * self.z_loss * lse)[:, None])
        probs.scatter_add_(1, local_label[:, None], -(1 - self.smoothing) * in_shard.to(probs.dtype)[:, None])
        if self.smoothing:
            probs[:, :self.real_rows] -= self.smoothing / self.vocab_size
        probs.mul_(valid.to(probs.dtype)[:, None])
        if row_scale is not None:
            probs.mul_(row_scale.to(torch.float32)[:, None])
        return loss, probs

    def _first_max(self, logits: torch.Tensor, local_max: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        """Global vocabulary index of each row's first maximum (``argmax``'s pick) over the tensor-parallel shards."""
        index = torch.argmax(logits, dim=-1) + self.vocab_start
        if self.group is None:
            return index
        index = torch.where(local_max == row_max, index, torch.full_like(index, torch.iinfo(index.dtype).max))
        return _all_reduce(index, dist.ReduceOp.MIN, self.group)

    def _add_stats(self, rows: slice, entropy: torch.Tensor, first_max: torch.Tensor) -> None:
        valid = self.valid[rows]
        top1 = valid & (first_max == self.labels[rows])
        self.token_stats += torch.stack((torch.where(valid, entropy, torch.zeros_like(entropy)).sum(),
                                         top1.sum().to(torch.float32)))


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, plan: _Plan, chunk_size: int, reduction: str, bias=None, z=None,
                b=None):
        needs = [ctx.needs_input_grad[i] for i in (0, 1, 6, 7, 8)]
        precompute = reduction == "sum" and any(needs)
        n = hidden.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grads = _grad_buffers(hidden, weight, bias, z, b, plan.weight_grad_dtype, needs) if precompute else None
        for rows in _chunks(n, chunk_size):
            loss[rows], grad_logits = plan.chunk(hidden, weight, rows, with_grad=precompute, stats=True)
            if precompute:
                _accumulate(grad_logits.to(hidden.dtype), hidden, weight, rows, grads, plan.low_rank)
        ctx.plan, ctx.chunk_size, ctx.reduction = plan, chunk_size, reduction
        ctx.dtypes = [t.dtype if t is not None else None for t in (hidden, weight, bias, z, b)]
        if precompute:
            _reduce_input_grads(grads, plan.group)
            ctx.save_for_backward(*grads)
        else:
            ctx.save_for_backward(hidden, weight)
        return loss.sum() if reduction == "sum" else loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.reduction == "sum":
            grads = list(ctx.saved_tensors)
            for i, (g, dtype) in enumerate(zip(grads, ctx.dtypes)):
                if g is None:
                    continue
                if i == 0 or i == 3:  # NOTE: hidden's and z's, in their own dtype already
                    grads[i] = g * grad_loss.to(g.dtype)
                else:  # NOTE: scaled and rounded to the tensor's dtype in one pass (out= of the lower dtype)
                    grads[i] = torch.mul(g, grad_loss, out=torch.empty(g.shape, dtype=dtype, device=g.device))
        else:
            hidden, weight = ctx.saved_tensors
            plan = ctx.plan
            z, b = plan.low_rank if plan.low_rank is not None else (None, None)
            needs = [ctx.needs_input_grad[i] for i in (0, 1, 6, 7, 8)]
            grads = _grad_buffers(hidden, weight, plan.bias, z, b, plan.weight_grad_dtype, needs)
            for rows in _chunks(hidden.shape[0], ctx.chunk_size):
                _, grad_logits = plan.chunk(hidden, weight, rows, with_grad=True, row_scale=grad_loss[rows])
                _accumulate(grad_logits.to(hidden.dtype), hidden, weight, rows, grads, plan.low_rank)
            _reduce_input_grads(grads, plan.group)
            grads = [g.to(dtype) if g is not None else None for g, dtype in zip(grads, ctx.dtypes)]
        grad_hidden, grad_weight, grad_bias, grad_z, grad_b = grads
        return grad_hidden, grad_weight, None, None, None, None, grad_bias, grad_z, grad_b


def _grad_buffers(hidden, weight, bias, z, b, weight_grad_dtype, needs) -> list:
    """The gradient buffers of (hidden, weight, bias, z, B) where ``needs`` says so, else None: the inputs' own
    (written chunk by chunk), the weight's in ``weight_grad_dtype``, the bias's and B's fp32 accumulators."""
    return [torch.empty_like(hidden) if needs[0] else None,
            torch.zeros(weight.shape, dtype=weight_grad_dtype, device=weight.device) if needs[1] else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs[2] else None,
            torch.empty_like(z) if needs[3] else None,
            torch.zeros(b.shape, dtype=torch.float32, device=b.device) if needs[4] else None]


def _reduce_input_grads(grads: list, group) -> None:
    """hidden's and z's gradients summed over the vocabulary shards (each rank's logits' part)."""
    for i in (0, 3):
        if grads[i] is not None:
            _all_reduce(grads[i], dist.ReduceOp.SUM, group)


def _accumulate(grad_logits, hidden, weight, rows, grads, low_rank) -> None:
    grad_hidden, grad_weight, grad_bias, grad_z, grad_b = grads
    if grad_bias is not None:  # NOTE: the bias's gradient is the logits' summed over the tokens
        grad_bias.add_(grad_logits.sum(dim=0, dtype=torch.float32))
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        # NOTE: one GEMM with an fp32 accumulator and output per chunk; a bf16 product, its fp32 copy and an add_
        # were three passes over [V, H] per chunk (15-20% of a training step on an H200, issue 7's profiles).
        accumulate_matmul(grad_weight, grad_logits.t(), hidden[rows])
    if grad_z is not None:
        torch.mm(grad_logits, low_rank[1].to(grad_logits.dtype), out=grad_z[rows])
    if grad_b is not None:
        accumulate_matmul(grad_b, grad_logits.t(), low_rank[0][rows].to(grad_logits.dtype))


def _default_chunk_size(n: int, hidden_size: int, v_local: int, logits_bytes: int = 4) -> int:
    # NOTE: one chunk of logits about as large as the hidden states themselves (Liger's rule of thumb), but at least
    # 512 MiB of them (``logits_bytes`` per element: 2 on the Triton path, which keeps bf16 logits, 4 on the fp32
    # torch path): each chunk's weight-gradient GEMM reads and writes the whole fp32 [V, H] accumulator, so fewer,
    # longer chunks also keep that GEMM efficient (about ten chunks for 16k tokens of a 152k vocabulary).
    liger = math.ceil(n / max(1, math.ceil(v_local / hidden_size)))
    return max(1, min(n, max(liger, math.ceil(_MIN_CHUNK_BYTES / (logits_bytes * v_local)))))


_MIN_CHUNK_BYTES = 512 * 2 ** 20


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         ignore_index: int = -100, tp_group: dist.ProcessGroup | None = None,
                         vocab_start: int | None = None, vocab_size: int | None = None,
                         chunk_size: int | None = None, z_loss: float = 0.0,
                         reduction: str = "sum", weight_grad_dtype: torch.dtype = torch.float32,
                         token_stats: torch.Tensor | None = None, label_smoothing: float = 0.0,
                         softcap: float | None = None, logit_scale: float | None = None,
                         bias: torch.Tensor | None = None, low_rank: tuple | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden [N, H] @ weight[V_local, H].T (+ bias[V_local]) (+ z @ B.T)`` against ``labels
    [N]``, chunked over tokens.

    ``vocab_start`` defaults to ``tp_rank * V_local`` (megatron's even split); ``vocab_size`` to ``V_local * tp_size``.
    Returns the fp32 sum over non-ignored tokens (``reduction="sum"``) or the fp32 per-token losses (``"none"``, 0 at
    ignored tokens). ``weight_grad_dtype``: the dtype the weight grad accumulates in over the chunks (fp32, or the
    weight's own dtype). ``token_stats``: an fp32 ``[2]`` tensor on the device the entropy sum and the top-1 count of
    the non-ignored tokens are added to (see the module docstring). ``label_smoothing``: transformers' label
    smoothing factor, in ``[0, 1]``. ``softcap``: the logits soft-capped at it first; ``logit_scale``: the logits
    multiplied by it first (see the module docstring). ``bias``: the LM head's bias (this rank's ``[V_local]`` rows,
    added before any scaling; its gradient is the logits' summed over the tokens, accumulated in fp32). ``low_rank``:
    ``(z [N, r], B [V_local, r])``, a LoRA adapter's term on the LM head (see the module docstring).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden must be [N, H] and weight [V_local, H]; got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}.")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"linear_cross_entropy: labels must be [{hidden.shape[0]}], got {tuple(labels.shape)}.")
    if reduction not in ("sum", "none"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'sum' or 'none', got {reduction!r}.")
    v_local = weight.shape[0]
    if bias is not None and bias.shape != (v_local,):
        raise ValueError(f"linear_cross_entropy: bias must be [{v_local}] (the weight's rows), got "
                         f"{tuple(bias.shape)}.")
    if low_rank is not None:
        z, b = low_rank
        if z.dim() != 2 or b.dim() != 2 or z.shape[0] != hidden.shape[0] or b.shape != (v_local, z.shape[1]):
            raise ValueError(f"linear_cross_entropy: low_rank must be (z [{hidden.shape[0]}, r], B [{v_local}, r]); "
                             f"got {tuple(z.shape)} and {tuple(b.shape)}.")
    tp_group, vocab_start, vocab_size = _vocab_layout("linear_cross_entropy", labels, v_local, tp_group=tp_group,
                                                      vocab_start=vocab_start, vocab_size=vocab_size,
                                                      ignore_index=ignore_index)
    if weight_grad_dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"linear_cross_entropy: weight_grad_dtype must be torch.float32 or the weight's dtype "
                         f"({weight.dtype}), got {weight_grad_dtype}.")
    if chunk_size is None:
        triton = tp_group is None and use_triton(hidden) and softcap is None
        # NOTE: soft-capping keeps the chunk's tanh beside its fp32 logits
        chunk_size = _default_chunk_size(hidden.shape[0], hidden.shape[1], v_local,
                                         8 if softcap is not None else hidden.element_size() if triton else 4)
    if token_stats is not None and (token_stats.shape != (2,) or token_stats.dtype != torch.float32
                                    or token_stats.device != hidden.device):
        raise ValueError(f"linear_cross_entropy: token_stats must be an fp32 tensor of shape [2] on {hidden.device}, "
                         f"got {token_stats.dtype} {tuple(token_stats.shape)} on {token_stats.device}.")
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be positive, got {chunk_size}.")
    check_label_smoothing(label_smoothing)
    plan = _Plan(labels, v_local=v_local, vocab_start=vocab_start, vocab_size=vocab_size,
                 ignore_index=ignore_index, z_loss=float(z_loss), group=tp_group,
                 weight_grad_dtype=weight_grad_dtype, token_stats=token_stats,
                 label_smoothing=float(label_smoothing), softcap=None if softcap is None else float(softcap),
                 logit_scale=None if logit_scale is None else float(logit_scale), bias=bias, low_rank=low_rank)
    z, b = low_rank if low_rank is not None else (None, None)
    return _LinearCrossEntropy.apply(hidden, weight, labels, plan, chunk_size, reduction, bias, z, b)


def smoothing_term(local_logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                   tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x_label - mean_v(x_v)`` per token over the true vocabulary, from this rank's logits ``[..., V_local]``
    (megatron's even vocabulary split over ``tp_group``) and in-range ``labels [...]``: a label-smoothed loss is
    ``CE + eps * smoothing_term`` (module docstring), for losses computed from materialised logits. Both parts are
    summed over the shards with megatron's reduce, whose backward hands each shard its own gradient."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    v_local = local_logits.shape[-1]
    start = dist.get_rank(tp_group) * v_local if tp_group is not None else 0
    logits = local_logits.float()[..., :max(0, min(v_local, vocab_size - start))]
    local = labels - start
    here = (local >= 0) & (local < logits.shape[-1])
    target = torch.zeros(labels.shape, dtype=logits.dtype, device=logits.device)
    if logits.shape[-1]:
        picked = logits.gather(-1, torch.where(here, local, torch.zeros_like(local))[..., None]).squeeze(-1)
        target = torch.where(here, picked, target)
    parts = torch.stack((target, logits.sum(dim=-1)))
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        parts = reduce_from_tensor_model_parallel_region(parts, group=tp_group)
    return parts[0] - parts[1] / vocab_size


def check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}.")


def _vocab_layout(name: str, labels: torch.Tensor, v_local: int, *, tp_group, vocab_start, vocab_size, ignore_index):
    """(group or None at TP 1, this rank's first vocabulary row, the true vocabulary size), labels checked."""
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    if vocab_start is None:
        vocab_start = tp_rank * v_local
    if vocab_size is None:
        vocab_size = v_local * tp_size
    if vocab_size > v_local * tp_size:
        raise ValueError(f"{name}: vocab_size={vocab_size} exceeds the {v_local} x {tp_size} rows held by the "
                         "tensor-parallel ranks.")
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"{name}: labels must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}; found "
                         f"{labels[bad][:5].tolist()}.")
    return tp_group, vocab_start, vocab_size


@torch.no_grad()
def logits_token_stats(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                       tp_group: dist.ProcessGroup | None = None, vocab_start: int | None = None,
                       vocab_size: int | None = None) -> torch.Tensor:
    """fp32 ``[entropy sum, top-1 count]`` over the non-ignored tokens of materialised logits ``[..., V_local]``
    (this rank's vocabulary shard under ``tp_group``) against ``labels [...]``: ``linear_cross_entropy``'s
    ``token_stats`` where the logits exist anyway (evaluation, unfused losses). The logits are not changed."""
    v_local = logits.shape[-1]
    labels = labels.reshape(-1)
    if logits.numel() // max(v_local, 1) != labels.numel():
        raise ValueError(f"logits_token_stats: {tuple(logits.shape)} logits for {labels.numel()} labels.")
    tp_group, vocab_start, vocab_size = _vocab_layout("logits_token_stats", labels, v_local, tp_group=tp_group,
                                                      vocab_start=vocab_start, vocab_size=vocab_size,
                                                      ignore_index=ignore_index)
    stats = torch.zeros(2, dtype=torch.float32, device=logits.device)
    plan = _Plan(labels, v_local=v_local, vocab_start=vocab_start, vocab_size=vocab_size, ignore_index=ignore_index,
                 z_loss=0.0, group=tp_group, token_stats=stats)
    plan.scores(logits.reshape(-1, v_local).to(torch.float32, copy=True), slice(None), with_grad=False, stats=True)
    return stats
