"""The megatron-core side of training: DDP wrapping, the distributed optimizer, and one optimizer step.

Choices:
- Model chunks are wrapped in megatron's ``DistributedDataParallel`` (contiguous grad buffers, overlapped
  reduce-scatter) and optimised by megatron's distributed optimizer (sharded fp32 main weights and Adam states).
- The loss of the last stage is the fused linear cross-entropy (``runtime.fused_loss_sum``) of the final hidden
  states and the output weight: full-vocabulary logits are never built (``fused_loss=False`` keeps megatron's output
  layer and the cross-entropy on materialised logits, for comparisons).
- Without Transformer Engine or Apex megatron builds ``torch.optim.AdamW`` with its default (foreach) implementation
  over the fp32 main weights; on CUDA the engine switches it before the first step (``fused_adam``) to
  ``kernels/adamw.LoongAdamW`` (torch's AdamW class and state, large tensors stepped by one Triton kernel each; the
  default where Triton imports) or to torch's fused implementation (``fused_adam=True``); same update up to rounding.
- Weight gradients of megatron's tensor-parallel linears go straight into DDP's ``main_grad`` buffer with one
  GEMM each (megatron's ``gradient_accumulation_fusion``, its Apex kernel replaced by torch's fp32-output ``addmm``:
  ``xpu/common.enable_wgrad_accumulation_fusion``; Transformer Engine's linears through TE's own
  ``fuse_wgrad_accumulation``), on CUDA by default (``fused_wgrad``): no separate add kernel per weight. With the
  fp32 buffer the sum is the same, without the rounding of each micro-batch's weight grad to bf16; with the
  model-dtype buffer each micro-batch's GEMM rounds once into it. Right after DDP zeroes the
  buffers each step the engine marks them so (``kernels/main_grad.py``): the FP8 weight-gradient GEMMs, which cannot
  accumulate, then write their first result into the buffer instead of adding it.
- ``optimizer_precision="fp32"`` (default): fp32 grad buffer, megatron's distributed optimizer with fp32 main weights
  and fp32 Adam moments, sharded over DP (18 bytes per parameter for a bf16 model before sharding).
  ``optimizer_precision="model"``: grad buffer in the model's dtype (all-reduced over DP, not reduce-scattered) and
  megatron's non-mixed ``FP32Optimizer`` wrapping torch AdamW directly over the model's parameters: weights, grads and
  moments in the model's dtype (8 bytes per parameter for bf16, every DP rank holding all of it), what
  ``transformers.Trainer`` with torch AdamW does on a model loaded in bf16; the fused loss then accumulates the output
  weight's grad over its token chunks in that dtype too (``weight_grad_dtype``), as Liger-Kernel does. Lower-precision
  state with fp32 main weights (``use_precision_aware_optimizer``) needs TE's FusedAdam in megatron-core 0.16 and is
  not used.
- Loss is summed per token and gradients are divided by the global label-token count of the step
  (``calculate_per_token_loss``): the gradient of the mean over all label tokens of the global batch, as Trainer does.
  megatron would divide every gradient buffer by the count in ``finalize_model_grads`` and then clip with another
  pass; the engine hands the count to its optimizer step instead, which applies ``1/count`` and the clipping factor
  as one: inside torch's fused AdamW (``grad_scale``) on CUDA, else one multiply (``_optimizer_step``).
- transformers' router load-balancing loss (an MoE config with ``output_router_logits`` and ``router_aux_loss_coef``,
  ``bridges/router_balance.py``) is one value per micro-batch of each data-parallel rank (``aux``), over that
  micro-batch's tokens (user padding and the engine's layout padding excluded). It enters the step as in the trainer
  the run stands for (``router_aux_reduction``): "sum" as transformers.Trainer (the model's loss adds ``coef * aux``
  and Trainer scales it by the number of processes before DDP averages: ``coef`` times the sum over micro-batches
  and data-parallel ranks), "mean" as trl.SFTTrainer (``coef * aux / micro-batches`` per micro-batch, averaged by
  DDP: ``coef`` times the mean over both). Gradients being divided by the step's label-token count ``N`` (1 when
  it is 0), each micro-batch's backpropagated loss adds ``coef * aux * N`` ("sum") or ``coef * aux * N / (DP *
  micro-batches)`` ("mean"), so megatron's loss scale applies to it too; the logged loss adds the term to the
  language-model loss.
- A trainer with a loss of its own (LoongDPOTrainer's preference loss) sets ``loss_hook``: each step it is given the
  step's micro-batches first (``start_step``, on every rank, after the layout padding: it may run collectives, e.g. a
  reference model's forwards), then called on the last pipeline stage with each micro-batch's output (final hidden
  states under the fused loss, else TP-local logits; under context parallelism this rank's share of the tokens), the
  micro-batch, its shifted labels (this rank's share) and the language head; it returns the micro-batch's loss to
  backpropagate, count 1, and ``num_stats`` fp32 values that the step sums over the data- and context-parallel ranks
  and shares with every pipeline stage (``StepResult.hook_stats``). Every rank of a context-parallel group counts,
  as a data-parallel rank does: the step's gradients are divided by the micro-batches times the data- and
  context-parallel ranks (the hook makes its gradient that many times its tokens' share). With the router balancing
  loss, ``coef * aux`` joins the hook's loss ("mean", times CP for that count), not its reported value.
- More TP ranks than KV heads (each KV head replicated, ``parallel/kv_replicas.py``): the finalize step sums the
  replicas' K / V gradient rows after megatron's, and the gradient norm counts each HF head once.
- One engine wraps a model's chunks at a time: a new engine on the same model (a second trainer) first releases the
  one before it (``release``: megatron DDP's gradient hooks, its buffers and the parameters' links into them and
  into the optimizer, the functions it set on the model's config), then wraps the chunks afresh and builds a new
  optimizer over their current weights, so the new run starts as a fresh one, as a new transformers.Trainer does.
- Hyper-parameters come from ``TrainingArguments``: lr, AdamW betas/eps, weight_decay (megatron's default exclusions,
  biases and 1-D params, equal Trainer's for these models but for DoRA's magnitude vectors, which Trainer decays and
  so does this: ``_weight_decay_overrides``), max_grad_norm. LR schedules are transformers' own
  schedulers stepping megatron's inner optimizer(s).
- megatron's optimizer is a chain of parts (dense, then expert parameters where the experts have their own gradient
  buffers) used as megatron builds it: a part with nothing to train anywhere (the dense one of LoRA on the routed
  experts alone) is a stub without a torch optimizer, kept in the chain for its collectives and skipped where a
  torch optimizer is read (``inner_optimizers``, the step's scaling, checkpoints: ``optimizer_state.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongforge_hf.bridges import router_balance
from loongforge_hf.bridges.runtime import (IGNORE_INDEX, fused_loss_sum, hidden_states_out, language_head,
                                           local_logits_token_stats, megatron_attention_mask, shift_labels,
                                           token_losses)
from loongforge_hf.kernels import main_grad as main_grad_state
from loongforge_hf.kernels.fp8 import weight_cache as fp8_weight_cache
from loongforge_hf.parallel.context_parallel import cp_local_inputs
from loongforge_hf.parallel.kv_replicas import replica_grad_sq, sum_replica_grads


OPTIMIZER_PRECISIONS = ("fp32", "model")
# the config fields an engine sets on the model's megatron config (restored by ``release``)
_CONFIG_FIELDS = ("finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func",
                  "gradient_accumulation_fusion")
# NOTE: the engine that wraps each model chunk now (weakly: a dropped trainer's engine may go)
_WRAPPED_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wrapping_engines(chunks) -> list["MegatronEngine"]:
    """The engines (still alive, released or not) that wrapped any of the model ``chunks`` last."""
    engines = (ref() for ref in map(_WRAPPED_BY.get, chunks) if ref is not None)
    return list({id(e): e for e in engines if e is not None}.values())


def _weight_decay_overrides() -> dict:
    """megatron's standard exclusion from weight decay (biases and 1-D parameters), but for the DoRA magnitudes
    (``lora.<target>.magnitude``), attention sinks (gpt-oss's ``sinks``, megatron's ``softmax_offset``) and Gated
    DeltaNet's ``A_log`` (Qwen3.5; its ``dt_bias`` is a "bias" to Trainer too): transformers.Trainer decides by name
    (biases and norms), so it decays them."""
    from megatron.core.optimizer import ParamGroupOverride, ParamKey
    from megatron.core.optimizer.optimizer_config import ParamWithNamePredicate

    def no_decay(param, name: str) -> bool:
        kept = name.endswith((".magnitude", ".softmax_offset", ".A_log"))
        return (len(param.shape) == 1 or name.endswith(".bias")) and not kept

    return {ParamKey(with_name_predicate=ParamWithNamePredicate(name="loong_no_wd", fn=no_decay)):
            ParamGroupOverride(wd_mult=0.0)}


@dataclass
class StepResult:
    loss: float              # mean over label tokens of the global batch
    num_tokens: int          # label tokens in the global batch
    grad_norm: float | None
    skipped: bool
    # per micro-batch (entropy sum, top-1 count, label tokens) over the data-parallel ranks, with token_stats on
    token_stats: list[tuple[float, float, int]] | None = None
    # per micro-batch, the router load-balancing loss averaged over the data-parallel ranks, with the loss on
    router_aux: list[float] | None = None
    # per micro-batch, a loss hook's stats summed over the data-parallel ranks (see the module docstring)
    hook_stats: list[list[float]] | None = None


@contextlib.contextmanager
def _megatron_builds_torch_adamw():
    """megatron-core builds torch's AdamW (then switched to ``LoongAdamW`` / torch's fused step) whether or not
    Transformer Engine or Apex is installed.

    NOTE: megatron-core 0.16.1 optimizer/__init__.py:12-34 picks TE's (else Apex's) ``FusedAdam`` at import when either
    imports, and torch's AdamW only without both (line 359: ``USING_PYTORCH_OPTIMIZER``). TE's FusedAdam keeps fp32
    moments for bf16 parameters, so ``optimizer_precision="model"`` would no longer hold its state in the model's dtype,
    and the engine's fused / Triton steps (``_use_fused_adam``) and its grad-scale folding apply to torch's AdamW only:
    measured on workload (b) of scripts/bench_train.py (H100, 2026-11-27), installing TE made the bf16 step 280 ms at
    42.4 GiB against 234 ms at 31.6 GiB without it. The flag is read while the optimizer is built, and restored.
    """
    import megatron.core.optimizer as megatron_optimizer

    saved = megatron_optimizer.USING_PYTORCH_OPTIMIZER
    megatron_optimizer.USING_PYTORCH_OPTIMIZER = True
    try:
        yield
    finally:
        megatron_optimizer.USING_PYTORCH_OPTIMIZER = saved


def _mark_expert_params(chunks) -> None:
    """Routed-expert weights (and their LoRA adapters) are expert parameters in every layout: megatron's DDP reduces
    them over the expert data-parallel group and its optimizer steps them in a part of its own.

    megatron (and kernels.grouped_mlp) mark expert weights ``allreduce=False`` only under expert parallelism.
    - With expert_parallel_size=1 and expert_tensor_parallel_size=1 < tensor_parallel_size, every tensor-parallel rank
      holds the whole experts and runs them on its own sequence-parallel tokens: DDP reduced their gradients over the
      dense data-parallel group, which does not contain the other tensor-parallel ranks, so each rank stepped its
      copy of the experts on its own tokens' gradient alone (the copies drifted apart and the run no longer matched
      one process).
    - Where the expert layout is the dense one (expert_parallel_size=1, expert_tensor_parallel_size=tensor_parallel_
      size) the expert data-parallel group is the dense one (data x context parallel), so marking them changes no
      sum; it keeps megatron's optimizer a dense + expert chain in every layout of a mixture-of-experts model, so a
      checkpoint written under expert parallelism resumes without it and the other way round (the chain's parts are
      keyed by place in megatron's distributed checkpoint; a one-part optimizer's keys differ)."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.experts." in f".{name}":
                param.allreduce = False


class MegatronEngine:
    """Owns the DDP-wrapped chunks and the optimizer of a ``LoongModelForCausalLM``."""

    def __init__(self, model, *, args, overlap_grad_reduce: bool = True, fused_loss: bool = True,
                 fused_adam: bool | str | None = None, fused_wgrad: bool | None = None,
                 optimizer_precision: str = "fp32") -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if optimizer_precision not in OPTIMIZER_PRECISIONS:
            raise ValueError(f"optimizer_precision must be one of {', '.join(map(repr, OPTIMIZER_PRECISIONS))}, "
                             f"got {optimizer_precision!r}.")
        self.model = model
        self.fused_loss = fused_loss
        # NOTE: entropy and top-1 sums of each micro-batch's label tokens (trl.SFTTrainer's entropy and
        # mean_token_accuracy), from the loss's own pass over the logits; LoongSFTTrainer turns them on.
        self.token_stats = False
        # NOTE: how each micro-batch's router balancing loss enters the step (see the module docstring);
        # LoongSFTTrainer and LoongDPOTrainer set "mean".
        self.router_aux_reduction = "sum"
        # NOTE: the loss's coefficient where a trainer asks for it itself (router_balance.requested; LoongDPOTrainer,
        # as trl.DPOTrainer passes output_router_logits=True); None: the model config decides
        self.router_aux_coef: float | None = None
        # NOTE: TrainingArguments.label_smoothing_factor: the training loss is transformers' LabelSmoother's (as
        # Trainer normalises it: over the label tokens of the global batch), set by LoongTrainer
        self.label_smoothing = 0.0
        # NOTE: a trainer's own per-micro-batch loss (see the module docstring), set by LoongDPOTrainer
        self.loss_hook = None
        # NOTE: TrainingArguments.neftune_noise_alpha's hooks (neftune.NoisyEmbeddings), set by LoongTrainer.train
        self.neftune = None
        self.optimizer_precision = optimizer_precision
        mixed = optimizer_precision == "fp32"
        config = model.megatron.config
        # NOTE: "model" keeps bf16 grads: the fused loss accumulates the output weight's grad over its token chunks
        # in that dtype too (as Liger / transformers do), half the [V, H] accumulator held at the activation peak.
        self._head_grad_dtype = torch.float32 if mixed else config.params_dtype
        config.calculate_per_token_loss = True
        # NOTE: "model": without the distributed optimizer megatron's DDP all-reduces the grad buffer (in the model's
        # dtype) instead of reduce-scattering it; with the overlap it still starts bucket by bucket during backward.
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=mixed, overlap_grad_reduce=overlap_grad_reduce,
                                                   use_distributed_optimizer=mixed, average_in_collective=False)
        _mark_expert_params(model.megatron.chunks)
        for previous in wrapping_engines(model.megatron.chunks):
            previous.release()
        self.released = False
        self._config_saved = {name: getattr(config, name, None) for name in _CONFIG_FIELDS}
        self.chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                               disable_bucketing=i > 0)
                       for i, chunk in enumerate(model.megatron.chunks)]
        for chunk in model.megatron.chunks:
            _WRAPPED_BY[chunk] = weakref.ref(self)
        if fused_wgrad is None:
            from loongforge_hf.xpu.common import wgrad_accumulation_supported

            fused_wgrad = model.device.type == "cuda" and wgrad_accumulation_supported(model.device)
        self.fused_wgrad_layers = 0
        if fused_wgrad:
            from loongforge_hf.xpu.common import enable_te_wgrad_accumulation, enable_wgrad_accumulation_fusion

            modules = [m for chunk in model.megatron.chunks for m in chunk.modules()]
            self.fused_wgrad_layers = enable_wgrad_accumulation_fusion(modules) + enable_te_wgrad_accumulation(modules)
            if self.fused_wgrad_layers and getattr(config, "cuda_graph_impl", "none") == "local":
                # NOTE: megatron's graph runner (cuda_graphs.py:725) reads this to restore the
                # grad_added_to_main_grad flags that a replayed backward does not set.
                config.gradient_accumulation_fusion = True
        # NOTE: FP8 weights quantised once per step are shared by later micro-batches (kernels.fp8.weight_cache), but
        # not under megatron's CUDA graphs: a layer graph captured at a later micro-batch would replay without the
        # quantisation, reading the cached copies' memory after the step released them.
        self.share_fp8_weights = getattr(config, "cuda_graph_impl", "none") == "none"
        self.clip_grad = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else 0.0
        # NOTE: megatron does not clip (clip_grad=0): the engine's _optimizer_step folds the clipping and the
        # 1/tokens scaling into one factor (and "model" grads are not fp32, which megatron's
        # clip_grad_by_total_norm_fp32, optimizer/clip_grads.py:167, asserts).
        opt_config = OptimizerConfig(
            optimizer="adam", lr=args.learning_rate, min_lr=0.0, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_epsilon,
            clip_grad=0.0,
            use_distributed_optimizer=mixed, bf16=config.bf16 and mixed, fp16=config.fp16 and mixed,
            params_dtype=config.params_dtype, decoupled_weight_decay=True,
        )
        # NOTE: "model": no distributed optimizer and no bf16/fp16 flag, so get_megatron_optimizer returns its
        # FP32Optimizer around torch AdamW over the model's own parameters (no main-weight copy); its prepare_grads
        # points each param.grad at DDP's main_grad (model dtype) before clipping and the step. The model's config
        # keeps bf16/fp16 for the model itself.
        with _megatron_builds_torch_adamw():
            self.optimizer = get_megatron_optimizer(opt_config, self.chunks, config_overrides=_weight_decay_overrides())
        # NOTE: megatron's own LR/WD scheduler applies the per-group multipliers (no decay on biases and 1-D params);
        # transformers' schedulers don't, so the multipliers are applied to the groups once, here.
        for opt in self.inner_optimizers():
            for group in opt.param_groups:
                group["weight_decay"] = args.weight_decay * group.get("wd_mult", 1.0)
                group["lr"] = args.learning_rate * group.get("lr_mult", 1.0)
        if fused_adam is None:
            # NOTE: LoongAdamW's Triton step, with torch's update and state, measured faster than torch's fused AdamW
            # on an H100 (docs/benchmarks.md, "Sixth re-run": 13.1 against 22.0 ms over 2.8 B bf16 parameters, shape
            # (c) 94.2 against 103.0 ms per step); torch's fused AdamW where Triton does not import.
            from loongforge_hf.kernels._triton import HAVE_TRITON

            fused_adam = ("triton" if HAVE_TRITON else True) if model.device.type == "cuda" else False
        if fused_adam not in (None, True, False, "triton"):
            raise ValueError(f"fused_adam must be None, True, False or 'triton', got {fused_adam!r}.")
        if fused_adam:
            self._use_fused_adam(triton=fused_adam == "triton")
        self._finalize_megatron = finalize_model_grads
        self._main_grad_params = main_grad_state.with_main_grad(self.chunks)  # marked zeroed each step
        self._num_tokens: torch.Tensor | None = None
        config.finalize_model_grads_func = self._finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        if overlap_grad_reduce:
            config.no_sync_func = [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
            config.grad_sync_func = [c.start_grad_sync for c in self.chunks] if len(self.chunks) > 1 \
                else self.chunks[0].start_grad_sync

    def release(self) -> None:
        """Unwrap the model's chunks (a newer engine wraps them next): megatron DDP's gradient hooks, its gradient
        and parameter buffers, the parameters' links into them and into this optimizer, the fused weight-gradient
        switches and the functions set on the model's config go. The optimizer object stays with whoever holds it (a
        trainer that trains again builds a new engine and takes its AdamW state: ``adopt_optimizer_state``). Local, no
        collective."""
        if self.released:
            return
        self.released = True
        for ddp in self.chunks:
            if ddp.use_forward_hook and ddp.remove_forward_pre_hook_handles:
                ddp.disable_forward_pre_hook(param_sync=False)
            # NOTE: megatron-core 0.16.1 distributed_data_parallel.py:320-345 registers its backward hooks on the
            # parameters' AccumulateGrad nodes and keeps the nodes (grad_accs), not the hooks' handles; a parameter
            # points at its node only weakly, so dropping grad_accs drops the nodes with their hooks and autograd
            # makes hook-free ones for the next engine. A node still held elsewhere keeps the hook, which then finds
            # its parameter in no bucket (param_to_bucket_group) and does nothing: megatron's distributed optimizer
            # steps an fp32 model's parameters through views of them (distrib_optimizer.py:421), which hold the
            # nodes for as long as an earlier trainer keeps that optimizer.
            ddp.grad_accs.clear()
            ddp.param_to_bucket_group = {}
            ddp.buffers, ddp.expert_parallel_buffers = [], []
            ddp.bucket_groups, ddp.expert_parallel_bucket_groups = [], []
            for param in ddp.module.parameters():
                param.grad = None
                for attr in ("main_grad", "main_param", "main_param_sharded", "grad_added_to_main_grad"):
                    if hasattr(param, attr):
                        delattr(param, attr)
        if self.fused_wgrad_layers:
            for chunk in self.model.megatron.chunks:
                for module in chunk.modules():
                    if getattr(module, "gradient_accumulation_fusion", False):
                        module.gradient_accumulation_fusion = False
                    if getattr(module, "fuse_wgrad_accumulation", False):
                        module.fuse_wgrad_accumulation = False
        config = self.model.megatron.config
        for name, value in self._config_saved.items():
            setattr(config, name, value)
        if self.neftune is not None:
            self.neftune.remove()
            self.neftune = None
        self._main_grad_params = []

    def _use_fused_adam(self, triton: bool = False) -> None:
        """Switch megatron's torch AdamW(s) to torch's fused implementation (before any step: the fused one keeps its
        step counts as tensors on the parameters' device); ``triton``: to ``kernels.adamw.LoongAdamW`` (same state,
        large tensors through its Triton kernel; the default on CUDA where Triton imports, ``fused_adam="triton"``).
        Off CUDA ``triton`` keeps torch's default implementation under LoongAdamW's class (its step is torch's there),
        so CPU runs step as they do without it."""
        fuse = not triton or self.model.device.type == "cuda"
        for opt in self.inner_optimizers():
            if type(opt) not in (torch.optim.AdamW, torch.optim.Adam) or any(opt.state.values()):
                continue
            if fuse:
                for group in [opt.defaults, *opt.param_groups]:
                    group["fused"], group["foreach"] = True, False
            if triton and type(opt) is torch.optim.AdamW:
                from loongforge_hf.kernels.adamw import LoongAdamW

                LoongAdamW.adopt(opt)

    def _finalize_model_grads(self, model_chunks, num_tokens=None, *args, **kwargs) -> None:
        """megatron's ``finalize_model_grads`` (grad sync, shared-weight and layernorm all-reduces) without its last
        pass, the ``1 / num_tokens`` scaling of every gradient buffer: the token count is shared here as megatron
        shares it (from the last pipeline stage, summed over data x context parallel ranks) and the optimizer step
        applies the scaling together with the clipping."""
        from megatron.core import parallel_state as ps

        self._finalize_megatron(model_chunks, None, *args, **kwargs)
        # NOTE: replicas of one KV head (more TP ranks than KV heads) take the sum of their gradients
        sum_replica_grads(model_chunks, getattr(kwargs.get("pg_collection"), "tp", None))
        self._num_tokens = None
        if num_tokens is None:
            return
        groups = kwargs.get("pg_collection")
        pp = getattr(groups, "pp", None) or ps.get_pipeline_model_parallel_group()
        dp_cp = getattr(groups, "dp_cp", None) or ps.get_data_parallel_group(with_context_parallel=True)
        dist.broadcast(num_tokens, src=dist.get_process_group_ranks(pp)[-1], group=pp)
        dist.all_reduce(num_tokens, group=dp_cp)
        self._num_tokens = num_tokens

    @torch.no_grad()
    def _optimizer_step(self) -> tuple[bool, torch.Tensor | None]:
        """megatron's optimizer step (``prepare_grads``, the global norm, ``step_with_ready_grads``) with the
        gradients' ``1 / tokens`` scaling and the clipping (``max_norm / (norm + 1e-6)`` when below 1, as megatron and
        torch clip) applied as one factor: inside torch's fused AdamW (its ``grad_scale`` divisor) when every inner
        optimizer is fused, else one multiply over the grads. The norm is megatron's (tensor-parallel duplicates and
        shared weights counted once, reduced over the model-parallel group), of the unscaled grads, times the scale.

        No host-device synchronisation: the token count, the norm and the factor stay fp64 device scalars (the
        arithmetic Python floats would do), so the optimizer's kernels queue behind the backward instead of the GPU
        idling while the host reads the norm and then launches them. The norm comes back as a device tensor, read
        by ``train_step`` after the step."""
        opt = self.optimizer
        if opt.prepare_grads():
            return False, None
        inner = [o for o in self.inner_optimizers() if any(g["params"] for g in o.param_groups)]
        device = inner[0].param_groups[0]["params"][0].device if inner else self.model.device
        one = torch.ones((), dtype=torch.float64, device=device)
        tokens = self._num_tokens
        scale = one if tokens is None else torch.where(tokens > 0, 1.0 / tokens.to(device, torch.float64), one)
        # NOTE: the norm also without clipping: transformers.Trainer logs grad_norm either way
        grad_norm = _grad_norm_on_device(opt, device, self.chunks) * scale
        factor = scale
        if self.clip_grad > 0:
            coeff = self.clip_grad / (grad_norm + 1.0e-6)
            factor = torch.where(coeff < 1.0, scale * coeff, scale)
        fused = all(all(g.get("fused") for g in o.param_groups) for o in inner)
        if fused:
            for o in inner:
                o.grad_scale = (1.0 / factor).to(o.param_groups[0]["params"][0].device, torch.float32)
        else:
            grads = [p.grad for o in inner for g in o.param_groups for p in g["params"] if p.grad is not None]
            torch._foreach_mul_(grads, factor.float())
        try:
            return opt.step_with_ready_grads(), grad_norm
        finally:
            for o in inner:
                o.__dict__.pop("grad_scale", None)

    # ---- the torch optimizers transformers' schedulers drive ---------------------------------------------------
    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers of megatron's parts (``optimizer_parts``) that have one."""
        return [part.optimizer for part in optimizer_parts(self.optimizer) if not is_stub(part)]

    def adopt_optimizer_state(self, previous: "MegatronEngine") -> bool:
        """Take AdamW's per-parameter state (moments and step count) of ``previous``, an earlier engine of this model
        released since, as transformers.Trainer keeps its optimizer's state when it trains again: the weights are the
        model's current ones. Copied one to one when the inner optimizers' parameters match in number, order, shape
        and dtype on every rank (same model, precision and data-parallel sharding; collective: the ranks agree);
        else nothing is copied and False is returned."""
        def params(opt) -> list:
            return [p for group in opt.param_groups for p in group["params"]]

        olds, news = previous.inner_optimizers(), self.inner_optimizers()
        pairs = [(old, new, params(old), params(new)) for old, new in zip(olds, news)]
        matching = len(olds) == len(news) and all(
            len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))
            for _, _, a, b in pairs)
        if dist.is_initialized():
            flag = torch.tensor([int(matching)], device=self.model.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            matching = bool(flag.item())
        if not matching:
            return False
        for old, new, a, b in pairs:
            for x, y in zip(a, b):
                if old.state.get(x):
                    new.state[y] = {k: v.clone() if torch.is_tensor(v) else v for k, v in old.state[x].items()}
        return True

    # ---- one optimizer step over the micro-batches of this DP rank ---------------------------------------------
    def train_step(self, micro_batches: list[dict], *, before_optimizer_step=None) -> StepResult:
        """One optimizer step over ``micro_batches`` (megatron's schedule, then the optimizer);
        ``before_optimizer_step()`` runs between the last backward and the optimizer step (Trainer's
        ``on_pre_optimizer_step``)."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from loongforge_hf.trainer.data import pad_micro_batches

        layout = getattr(self.model, "parallel", None)
        check_interleaved_micro_batches(layout, len(micro_batches))
        balance = self._router_balance(micro_batches)
        given = [b["input_ids"].shape[1] for b in micro_batches]
        rope_lengths = self._longrope_lengths(micro_batches)
        if layout is not None:
            # NOTE: lengths megatron needs (ParallelConfig.sequence_multiple), one length per step under PP.
            micro_batches = pad_micro_batches(micro_batches, multiple=layout.sequence_multiple,
                                              same_length=layout.pipeline_parallel_size > 1)
        if self.loss_hook is not None:
            self.loss_hook.start_step(micro_batches)
        if balance:
            # NOTE: each micro-batch's mask and shape before the layout padding, found by the batch a (virtual)
            # pipeline stage's forward takes
            balance["inputs"] = {id(b): given for b, given in zip(micro_batches, balance["inputs"])}
            balance["balance"].step_start()
        # NOTE: NEFTune scales its noise by each micro-batch's length as the collator made it (neftune.py)
        lengths = {id(b): n for b, n in zip(micro_batches, given)}
        if rope_lengths is not None:
            rope_lengths = {id(b): n for b, n in zip(micro_batches, rope_lengths)}
        self.model.train()  # NOTE: as Trainer.training_step (from_pretrained and evaluate() leave it in eval mode)
        for c in self.chunks:
            c.zero_grad_buffer()
        main_grad_state.mark_zeroed(self._main_grad_params)
        self.optimizer.zero_grad()
        seq = micro_batches[0]["input_ids"].shape[1]
        mbs = micro_batches[0]["input_ids"].shape[0]
        forward_step = self._forward_step_func(self.model.config.vocab_size, balance, lengths, rope_lengths)
        vpp = len(self.chunks)
        data = [iter(micro_batches) for _ in range(vpp)] if vpp > 1 else iter(micro_batches)
        # NOTE: FP8 layers quantise each weight once for all micro-batches of the step (weights change only in the
        # optimizer step below); nothing to share with one micro-batch.
        with fp8_weight_cache(self.share_fp8_weights and len(micro_batches) > 1):
            losses = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=self.chunks if vpp > 1 else self.chunks[0],
                num_microbatches=len(micro_batches), seq_length=seq, micro_batch_size=mbs, forward_only=False)
        if balance:
            balance["balance"].step_end()
        if before_optimizer_step is not None:
            before_optimizer_step()
        update_ok, grad_norm = self._optimizer_step()
        # loss over this DP rank's tokens (last stage), then over DP, then shared with every pipeline stage; with
        # token_stats, each micro-batch's (entropy, top-1, tokens) sums the same way
        # the router balancing loss (column 3) the same way, counted once per context-parallel group
        device = self.model.device
        hooked = self.loss_hook.num_stats if self.loss_hook is not None else 0
        rows = 1 + (len(micro_batches) if self.token_stats or balance or hooked else 0)
        sums = torch.zeros(rows, 4 + hooked, dtype=torch.float64, device=device)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            for i, item in enumerate(losses):
                loss_sum, count = item["lm loss"]
                sums[0, 0] += float(loss_sum)
                sums[0, 1] += float(count)
                if self.token_stats:
                    sums[1 + i, :2] = item["token stats"].to(sums)
                    sums[1 + i, 2] = float(count)
                if balance and ps.get_context_parallel_rank() == 0:
                    sums[1 + i, 3] = item["router aux"].to(sums)
                if hooked:
                    sums[1 + i, 4:] = item["hook stats"].to(sums)
            dist.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
        last = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]
        dist.broadcast(sums, src=last, group=ps.get_pipeline_model_parallel_group())
        loss = float(sums[0, 0] / sums[0, 1].clamp(min=1))
        stats = [(float(e), float(t), int(n)) for e, t, n, *_ in sums[1:].tolist()] if self.token_stats else None
        aux = None
        if balance:
            dp = ps.get_data_parallel_world_size(with_context_parallel=False)
            aux = [float(a) / dp for a in sums[1:, 3].tolist()]
            per_step = sum(aux) * dp if self.router_aux_reduction == "sum" else sum(aux) / len(aux)
            loss += balance["coef"] * per_step
        return StepResult(loss=loss, num_tokens=int(sums[0, 1]), grad_norm=None if grad_norm is None
                          else float(grad_norm), skipped=not update_ok, token_stats=stats, router_aux=aux,
                          hook_stats=sums[1:, 4:].tolist() if hooked else None)

    def _router_balance(self, micro_batches: list[dict]) -> dict | None:
        """What the micro-batches' forwards need for the router balancing loss (None: off): the model's
        ``RouterBalance``, the coefficient, each micro-batch's token weights before layout padding, and the scale
        of its gradient (see the module docstring)."""
        from megatron.core import parallel_state as ps

        on = router_balance.active(self.model) if self.router_aux_coef is None else \
            router_balance.requested(self.model, self.router_aux_coef)
        if on is None:
            return None
        if getattr(self.model.megatron.config, "overlap_moe_expert_parallel_comm", False):
            raise ValueError("router_aux_loss_coef with output_router_logits: not supported with megatron's "
                             "overlap_moe_expert_parallel_comm (its schedule interleaves two micro-batches' forwards).")
        device = self.model.device
        count = torch.zeros((), dtype=torch.float64, device=device)
        if self.loss_hook is not None:
            # NOTE: a hook counts 1 per micro-batch on every data- and context-parallel rank
            count += len(micro_batches) * ps.get_data_parallel_world_size(with_context_parallel=True)
        else:
            for b in micro_batches:
                count += int((shift_labels(b["labels"]) != IGNORE_INDEX).sum())
            dist.all_reduce(count, group=ps.get_data_parallel_group(with_context_parallel=False))
        # NOTE: the optimizer step divides the gradients by the count, by 1 when it is 0 (_optimizer_step)
        scale = torch.where(count > 0, count, torch.ones_like(count))
        if self.router_aux_reduction == "mean":
            scale = scale / (ps.get_data_parallel_world_size(with_context_parallel=False) * len(micro_batches))
        return {"balance": on[0], "coef": on[1], "scale": scale,
                "inputs": [(b.get("attention_mask"), tuple(b["input_ids"].shape)) for b in micro_batches]}

    def _longrope_lengths(self, micro_batches: list[dict]) -> list[int] | None:
        """Per micro-batch, the length by which LongRoPE picks its frequencies as transformers does (the largest
        position id + 1, else the collator's length: before the layout's padding); None for other models."""
        from loongforge_hf.modeling import longrope_modules, rope_length

        if not longrope_modules(self.model):
            return None
        return [rope_length(b["input_ids"], b.get("position_ids")) for b in micro_batches]

    def _forward_step_func(self, vocab_size: int, balance: dict | None = None, lengths: dict | None = None,
                           rope_lengths: dict | None = None):
        def forward_step(data_iterator, chunk, return_schedule_plan: bool = False):
            batch = next(data_iterator)
            device = self.model.device
            if self.neftune is not None:
                self.neftune.set_length(lengths[id(batch)])
            if rope_lengths is not None:  # NOTE: Phi-3's LongRoPE: short or long frequencies for this micro-batch
                from loongforge_hf.kernels.rope import select_longrope
                from loongforge_hf.modeling import longrope_modules

                select_longrope(longrope_modules(self.model), rope_lengths[id(batch)])
            tally = None
            if balance:
                # NOTE: the user's mask (all ones without one), zeros over the engine's layout pads
                mask, shape = balance["inputs"][id(batch)]
                tally = balance["balance"].begin(mask, shape, length=batch["input_ids"].shape[1], device=device)
            labels = shift_labels(batch["labels"].to(device))
            model_inputs = getattr(self.model, "megatron_forward_inputs", None)
            head = language_head(chunk) if self.fused_loss and not return_schedule_plan else None
            if model_inputs is not None:
                # NOTE: a model whose chunks take more than token inputs (a vision tower's pixel_values) says what.
                args, kwargs = model_inputs(batch)
                local_labels = getattr(self.model, "megatron_local_labels", None)
                if local_labels is not None:
                    # NOTE: a model whose chunks keep this context-parallel rank's share of the tokens says which.
                    labels = local_labels(labels)
                with hidden_states_out([chunk]) if head is not None else nullcontext():
                    output = chunk(*args, **kwargs)
            else:
                input_ids = batch["input_ids"].to(device)
                b, s = input_ids.shape
                position_ids = batch.get("position_ids")
                # NOTE: packing and padding are read from the batch as given (a collator's host tensors: no sync)
                mask = megatron_attention_mask(batch.get("attention_mask"), s, position_ids, device=device)
                position_ids = (torch.arange(s, device=device).expand(b, s) if position_ids is None
                                else position_ids.to(device))
                # NOTE: this rank's context-parallel share of the tokens and labels; the schedule's seq_length stays
                # global (megatron divides it by CP for the pipeline's tensor shapes).
                input_ids, position_ids, mask, labels = cp_local_inputs(input_ids, position_ids, mask, labels)
                with hidden_states_out([chunk]) if head is not None else nullcontext():
                    # NOTE: megatron's combined 1F1B schedule (overlap_moe_expert_parallel_comm) asks the unwrapped
                    # GPTModel for a schedule plan, run later, instead of an output (so no fused head: see above).
                    run = chunk.build_schedule_plan if return_schedule_plan else chunk
                    output = run(input_ids, position_ids, mask)

            def loss_func(output):
                if self.loss_hook is not None:
                    loss, count, stats = self.loss_hook(output, batch, labels=labels, head=head)
                    reported = {"lm loss": (loss.detach().clone(), count.detach().clone()),
                                "hook stats": stats.detach()}
                    return _with_router_aux(loss, tally, balance, reported), count, reported
                count = (labels != IGNORE_INDEX).sum()
                stats = torch.zeros(2, dtype=torch.float32, device=device) if self.token_stats else None
                if head is not None:
                    loss_sum = fused_loss_sum(output, labels, head, vocab_size=vocab_size,
                                              weight_grad_dtype=self._head_grad_dtype, token_stats=stats,
                                              label_smoothing=self.label_smoothing)
                else:
                    loss_sum = token_losses(output, labels, vocab_size=vocab_size,
                                            label_smoothing=self.label_smoothing).sum()
                    if stats is not None:
                        stats += local_logits_token_stats(output, labels, vocab_size=vocab_size)
                reported = {"lm loss": (loss_sum.detach().clone(), count.detach().clone())}
                if stats is not None:
                    reported["token stats"] = stats
                return _with_router_aux(loss_sum, tally, balance, reported), count, reported
            return output, loss_func
        return forward_step


def _with_router_aux(loss: torch.Tensor, tally, balance: dict | None, reported: dict) -> torch.Tensor:
    """``loss`` plus the micro-batch's router balancing term (``reported["router aux"]``: its value), where tallied.

    NOTE: the term joins the loss megatron backpropagates (its loss scale included), not the reported loss; the
    routers get its gradient through aux (router_balance.py)."""
    if tally is None:
        return loss
    aux = tally.finish()
    reported["router aux"] = aux.detach()
    return loss + (balance["coef"] * balance["scale"]) * aux


def micro_batch_group(layout) -> int:
    """How many micro-batches a step's count must be a multiple of: megatron's interleaved schedule (virtual pipeline
    stages) runs them in groups of ``pipeline_parallel_size`` (``microbatch_group_size_per_vp_stage``) and raises
    mid-schedule otherwise; 1 for every other layout."""
    return layout.pipeline_parallel_size if layout is not None and layout.interleaved_stages else 1


def check_interleaved_micro_batches(layout, count: int) -> None:
    """Says first, in the user's terms, what megatron's interleaved schedule would raise mid-schedule (every rank of
    a step holds the same count, so all raise alike)."""
    pp = micro_batch_group(layout)
    if count < pp or count % pp:
        raise ValueError(f"virtual pipeline stages: megatron's interleaved schedule needs a multiple of "
                         f"pipeline_parallel_size={pp} micro-batches per step, this step has {count} "
                         "(TrainingArguments.gradient_accumulation_steps).")


def optimizer_parts(optimizer) -> list:
    """The megatron optimizers a ``ChainedOptimizer`` chains (dense, then expert parameters), or ``[optimizer]``."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def is_stub(part) -> bool:
    """Whether megatron built ``part`` without a torch optimizer: no rank trains a parameter of its kind (the dense
    part when only routed-expert adapters train and the experts have their own gradient buffers).

    NOTE: megatron-core 0.16.1 optimizer/__init__.py:305 and 411-413 wrap ``None`` (a "stub", ``is_stub_optimizer``)
    where a part has no parameter groups; the groups are gathered over all ranks first (line 181), so a part is a
    stub on every rank or on none. The stub stays in the chain: it enters the collectives of its kind (found-inf and
    grad-norm reductions, the parameter all-gather after the step), every rank alike."""
    return bool(getattr(part, "is_stub_optimizer", False))


def _grad_norm_on_device(opt, device: torch.device, chunks=()) -> torch.Tensor:
    """megatron's ``get_grad_norm`` (``optimizer.py``, ``clip_grads.get_grad_norm_fp32``: which grads count, the
    squared l2 norm summed over each optimizer's grad-stats group, a chained optimizer's two cases) as an fp64 device
    scalar, without its closing ``.item()``. The engine builds megatron DDP, not its FSDP, so no grad is a DTensor.
    A KV head replicated over TP ranks (``parallel/kv_replicas.py``) counts once: the model ``chunks``' other
    replicas' rows are taken off."""
    from loongforge_hf.xpu.common import l2_norm

    subs = optimizer_parts(opt)
    if len(subs) == 1 or opt.grads_states_parallel_group_is_shared():
        parts = [([g for o in subs for g in o.get_main_grads_for_grad_norm()],
                  (subs[0] if len(subs) == 1 else opt).get_grad_stats_parallel_group(), subs)]
    else:
        parts = [(o.get_main_grads_for_grad_norm(), o.get_grad_stats_parallel_group(), [o]) for o in subs]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grads, group, owners in parts:
        squared = l2_norm(grads, device) ** 2 - replica_grad_sq(owners, chunks, device)
        dist.all_reduce(squared, group=group)
        total = total + squared.double().reshape(())
    return total.sqrt()


def fused_adam_for(adamw_kernel: str, device: torch.device) -> bool | str:
    """``MegatronEngine``'s ``fused_adam`` for an ``adamw_kernel`` setting (``LoongTrainingArguments``): LoongAdamW
    for "triton" (its Triton step on CUDA, torch's default step elsewhere), torch's fused AdamW on CUDA (its default
    step elsewhere) for "torch"."""
    return "triton" if adamw_kernel == "triton" else device.type == "cuda"
