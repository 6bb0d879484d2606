"""``LoongTrainer``: transformers.Trainer on the outside, megatron-core schedules and optimizer on the inside.

Choices:
- Trainer's own machinery stays: TrainerState, callbacks, progress bar, logging/report_to, evaluation, save_steps and
  checkpoint rotation, ``train()``'s return value. Replaced: the per-step work (megatron's forward/backward schedule
  over ``gradient_accumulation_steps`` micro-batches, then megatron's distributed optimizer), data sharding (over
  data-parallel ranks only), checkpoint contents (megatron distributed checkpoint + HF export), and ``save_model``
  (HF format through the bridge).
- Logged per step like Trainer: ``loss`` (mean over all label tokens of the global batch), ``grad_norm``,
  ``learning_rate``; plus ``tokens_per_second`` and, when the device's peak is known, ``mfu``.
- ``label_smoothing_factor``: the engine's loss is transformers' ``LabelSmoother`` (normalised over the global
  batch's label tokens, as Trainer passes it ``num_items_in_batch``); evaluation smooths with Trainer's own smoother
  on the model's logits, shifted as Trainer shifts a causal LM's. Trainer does not shift for an image-text model
  (its class is not a causal LM), so that combination is refused here (LoongSFTTrainer: TRL always shifts).
- Bad batches fail on every rank before the step's first collective (``_check_batches_everywhere``: each rank checks
  its own, then the ranks agree): missing columns, sequences past ``max_position_embeddings`` or the bridge's
  ``check_sequence_length``, and, for an image-text model, image / video placeholder tokens that do not match the
  images (``multimodal.image_tokens``: e.g. cut by TRL's ``max_length``, which truncates ``input_ids``, not the
  images); an image-text model's evaluation batches get the image check too, before their forward.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from accelerate.utils.memory import clear_device_cache
from transformers import Trainer
from transformers.trainer_utils import seed_worker

from loongforge_hf.bridges import router_balance
from loongforge_hf.trainer.balanced_data import balanced_train_dataloader
from loongforge_hf.trainer.data import (DataError, FailedBatch, ReportingCollator, check_batch, dp_rank_and_size,
                                        fetch_micro_batches, shard_over_data_parallel)
from loongforge_hf.trainer.engine import (MegatronEngine, check_interleaved_micro_batches, fused_adam_for,
                                          micro_batch_group)

MEGATRON_DIR = "megatron"

logger = logging.getLogger(__name__)


def label_token_count(inputs: dict) -> torch.Tensor | None:
    """The label tokens of a batch as Trainer counts them for ``num_items_in_batch`` (a causal LM's labels shifted
    by one, or the collator's ``shift_labels``); None without labels."""
    labels = inputs.get("shift_labels", inputs.get("labels"))
    if labels is None:
        return None
    return ((labels if "shift_labels" in inputs else labels[..., 1:]) != -100).sum()


def _holds_other_runs(folder: str) -> bool:
    """True when ``folder`` has entries an HF export would not write (checkpoint-N folders, logs, runs/)."""
    if not os.path.isdir(folder):
        return False
    return any(os.path.isdir(os.path.join(folder, name)) for name in os.listdir(folder))


class LoongTrainer(Trainer):
    """A drop-in ``transformers.Trainer`` for ``LoongModelForCausalLM`` models."""

    def __init__(self, model=None, args=None, *pos, **kwargs) -> None:
        from loongforge_hf.modeling import LoongModelForCausalLM

        if not isinstance(model, LoongModelForCausalLM):
            raise TypeError("LoongTrainer trains a loongforge_hf model: load it with "
                            "loongforge_hf.AutoModelForCausalLM.from_pretrained(...) "
                            f"(got {type(model).__name__}).")
        # NOTE: Trainer must neither move nor wrap the model: megatron owns placement and gradient reduction.
        model.is_parallelizable = True
        model.model_parallel = True
        # NOTE: evaluation would otherwise have accelerate move the model to its device ("cpu:0" != "cpu" copies
        # every parameter), cutting the parameters off megatron's DDP buffers: later optimizer steps never reach them.
        model._is_accelerate_prepared = True
        # NOTE: under `accelerate launch` with a MEGATRON_LM config, the layout was already read from the
        # environment by from_pretrained; Trainer's Accelerator must not start accelerate's own Megatron-LM plugin
        # (it needs the Megatron-LM training package and would drive training itself).
        saved = os.environ.pop("ACCELERATE_USE_MEGATRON_LM", None)
        self._step_row_tokens: int | None = None  # NOTE: a balanced step's token count (_run_epoch)
        try:
            super().__init__(model, args, *pos, **kwargs)
        finally:
            if saved is not None:
                os.environ["ACCELERATE_USE_MEGATRON_LM"] = saved
        # The loss the model returns is already the mean over label tokens of its batch; Trainer must not rescale it
        # by the number of processes (it would, since forward takes **kwargs).
        self.model_accepts_loss_kwargs = False
        self.engine: MegatronEngine | None = None
        # NOTE: Trainer would hook NEFTune onto get_input_embeddings(); train() hooks megatron's embedding instead
        self._neftune_alpha, self.neftune_noise_alpha = self.neftune_noise_alpha, None
        self._check_batch_sizes()
        self._refuse_unsupported()
        self._apply_ddp_timeout()

    def _refuse_unsupported(self) -> None:
        """Settings that change training under transformers.Trainer but that the megatron step cannot honour: refused
        in the user's terms instead of being silently ignored."""
        args = self.args
        problems = []
        optim = str(getattr(args.optim, "value", args.optim))
        if optim not in ("adamw_torch", "adamw_torch_fused"):
            problems.append(f"optim={optim!r} (the step is always torch AdamW inside megatron's optimizer)")
        if self.optimizer is not None or self.lr_scheduler is not None:
            problems.append("optimizers=(...) (the optimizer and LR scheduler are megatron's AdamW driven by "
                            "transformers' schedulers from TrainingArguments)")
        if getattr(self, "optimizer_cls_and_kwargs", None) is not None:
            problems.append("optimizer_cls_and_kwargs (the step is always megatron's AdamW)")
        # a user's subclass (between this class and LoongTrainer in the MRO) that overrides the per-step loss
        mine = type(self).__mro__[:type(self).__mro__.index(LoongTrainer)]
        overridden = sorted({name for cls in mine if not cls.__module__.startswith("loongforge_hf.")
                             for name in ("compute_loss", "training_step") if name in vars(cls)})
        if getattr(self, "compute_loss_func", None) is not None or overridden:
            problems.append(f"compute_loss_func / an overridden {' / '.join(overridden) or 'compute_loss'} "
                            "(training runs megatron's schedule and loss, which never call them)")
        if str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) in ("reduce_lr_on_plateau", "greedy"):
            problems.append(f"lr_scheduler_type={args.lr_scheduler_type!r} (metric-driven schedulers)")
        if str(getattr(args, "train_sampling_strategy", "random")) == "batch_rebalance":
            problems.append("train_sampling_strategy='batch_rebalance' (Trainer's rank-aware batch sampler shards over "
                            "every process, not the data-parallel group; use dp_load_balance with a packing collator)")
        if args.use_liger_kernel:
            problems.append("use_liger_kernel=True (Liger patches transformers' modules, which a loongforge model does "
                            "not run; its own fused loss, norm, rope and SwiGLU kernels are used)")
        if args.load_best_model_at_end and args.save_only_model:
            problems.append("load_best_model_at_end with save_only_model=True (the best weights are reloaded "
                            "from the checkpoint's megatron/ folder)")
        if args.label_smoothing_factor and not self._smoothing_shifts():
            problems.append(f"label_smoothing_factor with a {self.model.config.model_type} model (transformers."
                            "Trainer smooths an image-text model's logits against unshifted labels; the megatron "
                            "loss predicts the next token: use LoongSFTTrainer, which shifts as TRL does)")
        full_eval = torch.bfloat16 if args.bf16_full_eval else torch.float16 if args.fp16_full_eval else None
        if full_eval is not None and getattr(self.model, "dtype", full_eval) != full_eval:
            problems.append(f"{'bf16' if args.bf16_full_eval else 'fp16'}_full_eval with a model in "
                            f"{self.model.dtype} (Trainer's evaluate() would cast the trained weights in place; load "
                            "the model in that dtype or evaluate in the model's)")
        if problems:
            raise ValueError("LoongTrainer does not support: " + "; ".join(problems) + ".")
        # NOTE: transformers' router balancing loss (output_router_logits) trains as transformers.Trainer adds it
        # (engine.py); where it cannot (a bridge without it), refused here on every rank alike
        router_balance.active(self.model)
        dtype = getattr(self.model, "dtype", None)
        if (args.bf16 or args.fp16) and dtype == torch.float32:
            logger.warning("%s=True with a float32 model: LoongTrainer trains in the model's dtype, without autocast "
                           "(transformers.Trainer would autocast); load the model with dtype=torch.bfloat16 to train "
                           "in bf16.", "bf16" if args.bf16 else "fp16")
        if args.torch_compile:
            logger.warning("torch_compile=True has no effect under LoongTrainer: megatron-core's modules and this "
                           "library's kernels run uncompiled.")
        if not args.average_tokens_across_devices:
            logger.warning("average_tokens_across_devices=False: LoongTrainer still averages the training loss "
                           "over all label tokens of the global batch (transformers.Trainer would average each "
                           "rank's own mean, and average the router balancing loss of output_router_logits over the "
                           "ranks where LoongTrainer sums it, as Trainer does with average_tokens_across_devices).")

    def _smoothing_shifts(self) -> bool:
        """Whether Trainer's label smoother shifts the labels by one for this model, as for a causal LM (its class
        in transformers' causal-LM mapping)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return self.model.config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Evaluation's loss (training steps run in the megatron engine): Trainer's, but a label smoother shifts
        the labels as for the transformers class (Trainer reads the class name, here a loongforge one), and the
        loss is normalised over the data-parallel ranks as Trainer normalises it (``data_parallel_token_mean``)."""
        count = label_token_count(inputs) if self._data_parallel_token_mean_applies() else None
        if self.label_smoother is None or "labels" not in inputs:
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        else:
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = self.label_smoother(outputs, labels, shift_labels=self._smoothing_shifts())
        loss = self.data_parallel_token_mean(loss, count)
        return (loss, outputs) if return_outputs else loss

    def _data_parallel_token_mean_applies(self) -> bool:
        return dp_rank_and_size()[1] > 1 and bool(self.args.average_tokens_across_devices)

    def data_parallel_token_mean(self, loss: torch.Tensor | None, count: torch.Tensor | None):
        """An evaluation batch's loss (this rank's mean over its ``count`` label tokens) as Trainer computes it for
        the transformers model under DDP: with ``average_tokens_across_devices`` its model divides by the label
        tokens of every rank's batch (``num_items_in_batch``) and the loss is scaled by the ranks, so ``eval_loss``
        is the mean over all ranks' tokens, not the mean of each rank's mean."""
        if loss is None or count is None or not self._data_parallel_token_mean_applies():
            return loss
        _, size = dp_rank_and_size()
        from megatron.core import parallel_state as ps

        count = count.to(loss.device, torch.float64)
        total = count.clone()
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=False))
        scaled = loss.double() * count / total.clamp(min=1) * size
        # NOTE: a rank without label tokens adds 0 (transformers' sum over none), not its mean's 0/0
        return torch.where(count > 0, scaled, torch.zeros_like(scaled)).to(loss.dtype)

    def _apply_ddp_timeout(self) -> None:
        """``TrainingArguments.ddp_timeout`` on the process groups training uses: transformers applies it when
        accelerate starts the default group, which from_pretrained has already started; set here on it (when
        loongforge-hf started it) and on megatron-core's groups (``parallel.set_collective_timeout``)."""
        from loongforge_hf.parallel import set_collective_timeout

        if self.args.ddp_timeout is None or self.args.ddp_timeout <= 0:
            raise ValueError(f"ddp_timeout must be a number of seconds > 0, got {self.args.ddp_timeout!r}.")
        set_collective_timeout(self.args.ddp_timeout)

    # ---- sizes ---------------------------------------------------------------------------------------------------
    def _check_batch_sizes(self) -> None:
        if self.args.per_device_train_batch_size < 1 or self.args.gradient_accumulation_steps < 1:
            raise DataError("per_device_train_batch_size and gradient_accumulation_steps must be >= 1.")
        check_interleaved_micro_batches(getattr(self.model, "parallel", None), self.args.gradient_accumulation_steps)

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * dp_rank_and_size()[1]

    # ---- data ----------------------------------------------------------------------------------------------------
    def _dataset_tokenized_by_collator(self) -> bool:
        """Whether the training set is tokenized by the data collator, batch by batch (LoongSFTTrainer: TRL's image
        datasets), rather than holding ``input_ids`` itself."""
        return False

    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False,
                        dataloader_key=None):
        import datasets
        from functools import partial

        collator = self.data_collator
        if is_training and isinstance(dataset, datasets.Dataset) and "input_ids" not in dataset.column_names \
                and not self._dataset_tokenized_by_collator():
            raise DataError(f"train_dataset has no 'input_ids' column (columns: {dataset.column_names}). "
                            "Tokenize it first, e.g. dataset.map(lambda b: tokenizer(b['text']), batched=True).")
        if is_training and not isinstance(dataset, torch.utils.data.IterableDataset) and len(dataset) == 0:
            # NOTE: every rank holds the same dataset: all raise, before any collective
            raise DataError("train_dataset is empty (0 examples): there is nothing to train on.")
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        if not is_training and self._checks_evaluation_batches():
            collator = ReportingCollator(collator)  # NOTE: its error raised on every rank by _check_evaluation_batch
        args = self.args
        # NOTE: the DataLoader arguments of transformers.Trainer._get_dataloader (5.24), all of them
        params = {"batch_size": batch_size, "collate_fn": collator, "num_workers": args.dataloader_num_workers,
                  "pin_memory": args.dataloader_pin_memory, "persistent_workers": args.dataloader_persistent_workers,
                  "multiprocessing_context": args.dataloader_multiprocessing_context,
                  "prefetch_factor": args.dataloader_prefetch_factor, "in_order": args.dataloader_in_order}
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            sampler = sampler_fn(dataset) if sampler_fn is not None else None
            if sampler is not None:
                params["sampler"] = sampler
            params["drop_last"] = args.dataloader_drop_last
            if is_training:
                params["worker_init_fn"] = partial(seed_worker, num_workers=args.dataloader_num_workers,
                                                   rank=args.process_index)
        loader = shard_over_data_parallel(DataLoader(dataset, **params), args=args, is_training=is_training,
                                          accelerator=self.accelerator)
        if is_training:
            loader = balanced_train_dataloader(loader, args=args, model=self.model,
                                               data_collator=self.data_collator, collator=collator)
        if dataloader_key is not None and args.dataloader_persistent_workers:
            # NOTE: as Trainer: get_eval_dataloader hands this one out again instead of starting new workers
            self._eval_dataloaders = {**getattr(self, "_eval_dataloaders", {}), dataloader_key: loader}
        return loader

    # ---- evaluation ------------------------------------------------------------------------------------------------
    def evaluation_loop(self, *args, **kwargs):
        # NOTE: Trainer gathers losses, logits, labels and inputs with accelerate's gather_for_metrics, over every
        # process; the evaluation batches are sharded over the data-parallel ranks only (the ranks of one TP / PP /
        # CP group hold the same samples), so that gather would repeat each sample once per model-parallel rank.
        # Gather over the data-parallel group instead (Trainer's loop resets gather_function when it ends).
        self.gather_function = self._gather_over_data_parallel
        output = super().evaluation_loop(*args, **kwargs)
        # NOTE: Trainer's evaluate / predict then count the loop's steps as samples / (eval batch x processes); one
        # step takes eval_batch_size samples per data-parallel rank: _fix_eval_steps_per_second recounts them
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        ranks = 1 if self.accelerator.split_batches else dp_rank_and_size()[1]  # NOTE: split: a step is one batch
        self._eval_steps = (prefix, math.ceil(output.num_samples / (self.args.eval_batch_size * ranks)))
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Trainer's, after an image-text model's batch is checked on every rank (``_check_evaluation_batch``)."""
        self._check_evaluation_batch(inputs)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _checks_evaluation_batches(self) -> bool:
        """Whether evaluation batches are checked and agreed on every rank before their forward: an image-text model's
        (a text model's go straight to its forward: no collective added)."""
        return getattr(getattr(self.model, "bridge", None), "image_token_id", None) is not None

    def _check_evaluation_batch(self, inputs: dict) -> None:
        """An image-text model's evaluation batch of tensors, or what its collator raised (``ReportingCollator``):
        its image tokens checked and agreed across ranks before its forward (GRPO / RLOO's batches of prompt rows,
        whose model inputs the processor builds whole after generation, are not checked)."""
        if self._checks_evaluation_batches() and (isinstance(inputs, FailedBatch) or (
                isinstance(inputs, Mapping) and torch.is_tensor(inputs.get("input_ids")))):
            self._check_batches_everywhere([inputs], None)

    def _fix_eval_steps_per_second(self, metrics: dict) -> None:
        """``<prefix>_steps_per_second`` of the last evaluation loop over its data-parallel steps, in place."""
        prefix, steps = getattr(self, "_eval_steps", (None, 0))
        runtime = metrics.get(f"{prefix}_runtime")
        if f"{prefix}_steps_per_second" in metrics and runtime:
            metrics[f"{prefix}_steps_per_second"] = round(steps / runtime, 3)
            self._eval_steps = (None, 0)

    def predict(self, *args, **kwargs):
        output = super().predict(*args, **kwargs)
        self._fix_eval_steps_per_second(output.metrics)
        return output

    def _gather_over_data_parallel(self, data, use_gather_object: bool = False):
        """``accelerator.gather_for_metrics`` over the data-parallel group: tensors concatenated in data-parallel
        rank order (the order of the sharded DataLoader), the samples that padded the last batch dropped."""
        from accelerate.utils import recursively_apply

        size = dp_rank_and_size()[1]
        try:
            recursively_apply(lambda t: t, data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if dist.is_initialized() and size > 1:
            from megatron.core import parallel_state as ps

            group = ps.get_data_parallel_group(with_context_parallel=False)
            # NOTE: even_batches=False: the ranks' last batches differ in rows (shorter ones are padded for the
            # gather, then cut back); with even_batches they are equal
            uneven = not self.accelerator.even_batches

            def gather(t: torch.Tensor) -> torch.Tensor:
                t = t.detach().contiguous()
                t = t[None] if t.dim() == 0 else t
                rows = [len(t)] * size
                if uneven:
                    counts = [torch.zeros(1, dtype=torch.int64, device=t.device) for _ in range(size)]
                    dist.all_gather(counts, torch.tensor([len(t)], dtype=torch.int64, device=t.device), group=group)
                    rows = [int(c) for c in counts]
                    t = torch.cat([t, t.new_zeros(max(rows) - len(t), *t.shape[1:])])
                parts = [torch.empty_like(t) for _ in range(size)]
                dist.all_gather(parts, t, group=group)
                return torch.cat([part[:n] for part, n in zip(parts, rows)], dim=0)

            if use_gather_object:
                parts = [None] * size
                dist.all_gather_object(parts, data, group=group)
                data = [item for part in parts for item in part]
            else:
                data = recursively_apply(gather, data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = data[:state.remainder] if use_gather_object else \
                recursively_apply(lambda t: t[:state.remainder], data)
        return data

    # ---- optimizer and schedule ----------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        previous = None
        if self.engine is not None and self.engine.released:
            # NOTE: another trainer (engine) has wrapped the model since: this one wraps it again, over the current
            # weights, and keeps its AdamW state as transformers.Trainer keeps its optimizer's
            previous, self.engine = self.engine, None
        if self.engine is None:
            self.engine = MegatronEngine(self.model, args=self.args,
                                         optimizer_precision=getattr(self.args, "optimizer_precision", "fp32"),
                                         fused_adam=fused_adam_for(getattr(self.args, "adamw_kernel", "triton"),
                                                                   self.model.device))
        if previous is not None and not self.engine.adopt_optimizer_state(previous):
            logger.warning("Another LoongTrainer has trained this model since this trainer last did, and the rebuilt "
                           "optimizer's layout differs from this trainer's earlier one: AdamW state starts afresh.")
        # NOTE: evaluation smooths with Trainer's own label_smoother (compute_loss, on the model's logits)
        self.engine.label_smoothing = float(self.args.label_smoothing_factor or 0.0)
        self.optimizer = self.engine.optimizer
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        from transformers.optimization import get_scheduler

        from loongforge_hf.trainer.scheduler import LinkedSchedulers

        if self.lr_scheduler is None:
            self.lr_scheduler = LinkedSchedulers([
                get_scheduler(self.args.lr_scheduler_type, optimizer=opt,
                              num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
                              num_training_steps=num_training_steps,
                              scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
                for opt in self.engine.inner_optimizers()])
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.model
        if self._neftune_alpha is not None and self.engine.neftune is None:
            from loongforge_hf.trainer.neftune import NoisyEmbeddings

            self.engine.neftune = NoisyEmbeddings(self.model.chunks, alpha=self._neftune_alpha)
        self._seed_model_parallel_rng()
        if resume_from_checkpoint is not None:
            from loongforge_hf.trainer.checkpoint import load_training_checkpoint

            load_training_checkpoint(self, resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.engine is not None and self.engine.neftune is not None:
                self.engine.neftune.remove()  # NOTE: as transformers deactivates NEFTune after training
                self.engine.neftune = None

    def _seed_model_parallel_rng(self) -> None:
        """megatron's model-parallel RNG streams (attention dropout, LoRA dropout, expert-parallel dropout) from
        ``TrainingArguments.seed``, as Trainer's ``set_seed`` seeds every generator the HF model's dropout uses;
        they were seeded by ``from_pretrained(seed=1234)`` and ``args.seed`` never reached them. A resume then
        restores the saved streams over these."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        graphable = getattr(get_cuda_rng_tracker(), "use_cudagraphable_rng", False)
        model_parallel_cuda_manual_seed(self.args.seed, use_cudagraphable_rng=graphable, force_reset_rng=True)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # NOTE: weights come back with the optimizer from the megatron checkpoint in _prepare_for_training; here (before
        # Trainer reads trainer_state.json and before any collective of the resume) the folder is checked, alike on
        # every rank, so an incomplete or corrupt checkpoint fails with a message naming the file.
        from loongforge_hf.trainer.checkpoint import check_training_checkpoint

        check_training_checkpoint(resume_from_checkpoint)

    def _get_learning_rate(self) -> float:
        return self.lr_scheduler.get_last_lr()[0]

    # ---- the loop ------------------------------------------------------------------------------------------------
    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                   ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                   steps_trained_in_current_epoch):
        args = self.args
        ga = args.gradient_accumulation_steps
        # NOTE: Trainer's random state (python, numpy, torch: what collators and NEFTune draw from) comes back as
        # Trainer brings it back: before the epoch's data order at an epoch boundary, after the skipped batches
        # otherwise (their fetching draws too), not at all when ignore_data_skip trains on from the epoch's start
        resumed = epoch == epochs_trained and resume_from_checkpoint is not None
        if resumed and steps_trained_in_current_epoch == 0:
            self._load_rng_state(resume_from_checkpoint)
        if hasattr(train_dataloader, "set_epoch"):
            train_dataloader.set_epoch(epoch)
        iterator = iter(train_dataloader)
        first_update = 0
        rng_after_skip = resumed and steps_trained_in_current_epoch > 0 and not args.ignore_data_skip
        if rng_after_skip:
            for _ in range(steps_trained_in_current_epoch):
                next(iterator)
            first_update = steps_trained_in_current_epoch // ga
        grad_norm = learning_rate = None
        ran = False
        consumed = first_update * ga  # NOTE: micro-batches: the epoch fraction is logged as Trainer logs it
        max_pos = getattr(self.model.config, "max_position_embeddings", None)  # NOTE: none in Mamba2's
        for update_step in range(first_update, num_update_steps_per_epoch):
            micro, failed = fetch_micro_batches(iterator, ga)
            if rng_after_skip:
                self._load_rng_state(resume_from_checkpoint)
                rng_after_skip = False
            micro = micro if failed else self._whole_interleaved_groups(micro)
            if not micro and not failed:
                break
            self._check_batches_everywhere(micro, max_pos, failed=failed)
            ran = True
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            t0 = time.perf_counter()
            self._micro_batches_in_step = len(micro)
            result = self.engine.train_step(micro, before_optimizer_step=self._pre_optimizer_step)
            elapsed = time.perf_counter() - t0
            if args.torch_empty_cache_steps is not None and self.state.global_step % args.torch_empty_cache_steps == 0:
                clear_device_cache()  # NOTE: as Trainer, after the step's forwards and backwards (not in its timing)
            # NOTE: a balanced step's token count as Trainer / TRL count it where its samples were drawn (not after
            # some micro-batches were left out: _whole_interleaved_groups)
            self._step_row_tokens = getattr(train_dataloader, "step_row_tokens", None) \
                if len(micro) == getattr(train_dataloader, "step_micros", None) else None
            self._record_step(result, micro)
            self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
            learning_rate = self._get_learning_rate()
            if not result.skipped:
                self.lr_scheduler.step()
            grad_norm = result.grad_norm
            loss = torch.tensor(result.loss, device=self._tr_loss.device, dtype=self._tr_loss.dtype)
            if args.logging_nan_inf_filter and not torch.isfinite(loss):
                # NOTE: as Trainer: a nan / inf step loss counts as the mean of the steps since the last log
                loss = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            self._tr_loss += loss
            self._step_speed = self._speed_metrics(micro, elapsed)
            self._step_speed.update(getattr(train_dataloader, "step_logs", {}))
            self._count_tokens_seen(micro, self._step_speed.pop("_flops"))
            self.state.global_step += 1
            consumed += len(micro)
            self.state.epoch = epoch + consumed / steps_in_epoch
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._maybe_log_save_evaluate(self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                          start_time, learning_rate=learning_rate)
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        if not ran:
            # NOTE: as Trainer: an epoch without a single batch (e.g. an exhausted IterableDataset) ends training
            logger.warning("The training data gave no batch in epoch %d: training stops at step %d (expected with an "
                           "IterableDataset holding fewer samples than max_steps=%d needs).", epoch,
                           self.state.global_step, self.state.max_steps)
            self.control.should_training_stop = True
        self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
        self._maybe_log_save_evaluate(self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                      start_time, learning_rate=learning_rate)

    def _record_step(self, result, micro: list[dict]) -> None:
        """What a subclass keeps of each engine step (its ``StepResult`` and micro-batches) for its own logs."""

    def _whole_interleaved_groups(self, micro: list[dict]) -> list[dict]:
        """The epoch's last, partial accumulation window under virtual pipeline stages: megatron's interleaved
        schedule runs micro-batches only in groups of pipeline_parallel_size, so the trailing ones that do not fill a
        group are left out of the epoch (logged), as megatron's own samplers drop an incomplete global batch;
        elsewhere Trainer's behaviour (a shorter last step) is kept."""
        group = micro_batch_group(getattr(self.model, "parallel", None))
        keep = len(micro) - len(micro) % group
        if keep < len(micro):
            logger.warning("virtual pipeline stages: the epoch's last %d micro-batch(es) do not fill a group of "
                           "pipeline_parallel_size=%d and are left out (megatron's interleaved schedule needs whole "
                           "groups).", len(micro) - keep, group)
        return micro[:keep]

    def _check_batches_everywhere(self, micro: list[dict], max_positions: int | None,
                                  failed: str | None = None) -> None:
        """Validate this rank's batches (``max_positions`` None: evaluation's, their image tokens only; ``failed``:
        what fetching them raised here), then agree across ranks so a bad batch on one rank stops all of them."""
        from loongforge_hf.bridges.absolute_positions import with_mask_positions
        from loongforge_hf.bridges.distribution import agree_on_error
        from loongforge_hf.multimodal.image_tokens import image_token_problem

        error = failed
        try:
            bridge = getattr(self.model, "bridge", None)
            check_length = getattr(bridge, "check_sequence_length", None) if max_positions is not None else None
            for b in micro if failed is None else ():
                if isinstance(b, FailedBatch):
                    raise DataError(b["error"])
                with_mask_positions(bridge, b)  # NOTE: OPT's default positions, from the attention mask
                if max_positions is not None:
                    check_batch(b, max_positions=max_positions)
                getattr(bridge, "check_position_ids", lambda _: None)(b.get("position_ids"))  # NOTE: packing it refuses
                if check_length is not None:  # NOTE: positions the bridge is not exact from (Mistral 4's query scale)
                    positions = b.get("position_ids")
                    check_length(int(positions.max()) + 1 if torch.is_tensor(positions) and positions.numel()
                                 else b["input_ids"].shape[-1])
                # NOTE: image tokens cut by max_length would fail in one rank's forward, the others waiting
                problem = image_token_problem(bridge, b, max_length=getattr(self.args, "max_length", None))
                if problem is not None:
                    raise DataError(problem)
        except (DataError, ValueError) as e:
            error = str(e)
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.model.device)
        if dist.is_initialized():
            dist.all_reduce(flag)
        if int(flag.item()):
            raise DataError(agree_on_error(error))

    def _speed_metrics(self, micro: list[dict], elapsed: float) -> dict:
        from loongforge_hf.trainer.flops import model_flops_per_token
        from loongforge_hf.xpu import get_backend

        local_tokens = sum(int(b["input_ids"].numel()) for b in micro)
        tokens = local_tokens * dp_rank_and_size()[1]
        # NOTE: the language model's FLOPs (a vision tower's are not counted)
        flops = model_flops_per_token(self.model.config.get_text_config(), seq_len=micro[0]["input_ids"].shape[1]) \
            * tokens
        out = {"_flops": flops, "tokens_per_second": tokens / max(elapsed, 1e-9)}
        peak = get_backend().peak_flops(self.model.dtype)
        if peak:
            world = dist.get_world_size() if dist.is_initialized() else 1
            out["mfu"] = flops / elapsed / (peak * world)
        return out

    def _count_tokens_seen(self, micro: list[dict], flops: float) -> None:
        """``state.num_input_tokens_seen`` and ``total_flos`` as Trainer keeps them: input tokens of the global
        batch (``include_num_input_tokens_seen``: "all" / True counts padding, "non_padding" only attention-mask
        ones, "no" / False nothing), and the step's model FLOPs (this process's share, summed over processes when
        stored)."""
        mode = self.args.include_num_input_tokens_seen
        if mode != "no":
            masked = mode == "non_padding" and any(b.get("attention_mask") is not None for b in micro)
            self.state.num_input_tokens_seen += self.count_step_tokens(
                micro, lambda b: int(b["attention_mask"].sum()) if masked and b.get("attention_mask") is not None
                else int(b["input_ids"].numel()), with_padding=not masked)
        self.current_flos += flops / (dist.get_world_size() if dist.is_initialized() else 1)

    def count_step_tokens(self, micro: list[dict], count: Callable[[dict], int], *, with_padding: bool) -> int:
        """The step's tokens over the data-parallel ranks, ``count`` of each micro-batch: summed over the ranks, not
        this rank's count times their number (their batches differ in length: packed rows, padding to each rank's
        longest); a balanced step counted ``with_padding`` takes its rows as collated where the samples were drawn
        (``balanced_data.padded_row_tokens``), as Trainer / TRL count them without balancing."""
        if with_padding and self._step_row_tokens is not None:
            return self._step_row_tokens
        seen = torch.tensor([sum(count(b) for b in micro)], dtype=torch.int64, device=self.model.device)
        if dist.is_initialized():
            from megatron.core import parallel_state as ps

            dist.all_reduce(seen, group=ps.get_data_parallel_group())  # NOTE: CP ranks share a batch
        return int(seen.item())

    def log(self, logs: dict, start_time: float | None = None) -> None:
        self._fix_eval_steps_per_second(logs)  # NOTE: evaluate() logs its metrics dict, then returns that same dict
        if "loss" in logs and getattr(self, "_step_speed", None):
            logs = {**logs, **self._step_speed}
        super().log(logs, start_time)

    # ---- saving ----------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model in HF format through the bridge (collective; rank 0 writes, atomically)."""
        import shutil
        import tempfile

        from loongforge_hf.trainer.checkpoint import run_everywhere

        from transformers.trainer import TRAINING_ARGS_NAME

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        side: list[str] = []  # rank 0: the folder the processing class and training arguments are saved into

        def save_side_files() -> None:
            side.append(tempfile.mkdtemp(prefix="loongforge-save-"))
            if self.processing_class is not None:
                self.processing_class.save_pretrained(side[0])
            torch.save(self.args, os.path.join(side[0], TRAINING_ARGS_NAME))  # NOTE: as Trainer._save

        try:
            # NOTE: the tokenizer / processor and training_args.bin go into the export's folder with the weights, in
            # its one atomic swap; saved first (rank 0; every rank learns the outcome), so a failure writes nothing.
            run_everywhere(f"save_model({output_dir!r}): could not save the processing class and training arguments",
                           save_side_files, on=self.args.should_save)
            folder = side[0] if side else None
            if _holds_other_runs(output_dir):
                self._save_beside_runs(output_dir, folder)
            else:
                self.model.save_pretrained(output_dir, side_files_dir=folder)
        finally:
            for folder in side:
                shutil.rmtree(folder, ignore_errors=True)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)  # NOTE: as Trainer

    def _save_beside_runs(self, output_dir: str, side_files_dir: str | None) -> None:
        """Export into a folder that also holds checkpoints or logs (Trainer's default ``output_dir``): write the
        complete export next to it, then move its files in one by one, so the checkpoints survive and no weight
        shard of an older export is left behind."""
        import shutil

        from loongforge_hf.trainer.checkpoint import run_everywhere

        staging = os.path.join(output_dir, ".loongforge-export.incomplete")
        self.model.save_pretrained(staging, side_files_dir=side_files_dir)

        def move_in() -> None:
            try:
                new = set(os.listdir(staging))
                for name in os.listdir(output_dir):
                    if name not in new and (name.endswith(".safetensors") or name == "model.safetensors.index.json"):
                        os.remove(os.path.join(output_dir, name))
                for name in sorted(new):
                    os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
            finally:
                shutil.rmtree(staging, ignore_errors=True)

        run_everywhere(f"save_model({output_dir!r}): could not move the export into place", move_in,
                       on=not dist.is_initialized() or dist.get_rank() == 0)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, built in a temporary folder and renamed when complete (atomic)."""
        from pathlib import Path

        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        from transformers.trainer_callback import ExportableState
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_utils import rotate_checkpoints

        import shutil

        from loongforge_hf.trainer.checkpoint import publish_checkpoint, run_everywhere, save_training_checkpoint

        self.store_flos()
        run_dir = Path(self._get_output_dir(trial=trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final, tmp = run_dir / name, run_dir / f".{name}.incomplete"
        if self.args.should_save and tmp.exists():
            shutil.rmtree(tmp)

        def write_trainer_state() -> None:
            for cb in [cb for cb in self.callback_handler.callbacks + [self.control]
                       if isinstance(cb, ExportableState)]:
                cb_name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks.get(cb_name), list):
                    self.state.stateful_callbacks[cb_name].append(cb.state())
                else:
                    self.state.stateful_callbacks[cb_name] = cb.state()
            self.state.save_to_json(str(tmp / TRAINER_STATE_NAME))

        # NOTE: every step below either is collective and raises alike on every rank, or runs through
        # run_everywhere (the ranks agree on its outcome): a failed write never leaves a rank in a collective, and
        # the temporary folder goes, so output_dir holds only complete checkpoints.
        try:
            self.save_model(str(tmp), _internal_call=True)
            if not self.args.save_only_model:
                save_training_checkpoint(self, tmp)
                run_everywhere(f"could not write the RNG state into {tmp}", lambda: self._save_rng_state(str(tmp)))
            run_everywhere(f"could not write {tmp / TRAINER_STATE_NAME}", write_trainer_state,
                           on=self.args.should_save)
            publish_checkpoint(tmp, final)
        except BaseException:
            if self.args.should_save:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.args.push_to_hub:
            # NOTE: Trainer's upload (rank 0, in the background: the HF files into output_dir, then the folder and,
            # per hub_strategy, the checkpoint); every rank learns whether starting it failed
            run_everywhere(f"push_to_hub: could not start uploading {final}",
                           lambda: Trainer._push_from_checkpoint(self, str(final)), on=self.is_world_process_zero())
        # as Trainer._save_checkpoint: remember the best checkpoint so that rotation keeps it and
        # load_best_model_at_end reloads it
        if self.args.save_strategy in ("steps", "epoch", "best") and self.state.best_global_step:
            best = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"
            if best.exists():
                self.state.best_model_checkpoint = str(best)
                if self.args.should_save:
                    self.state.save_to_json(str(final / TRAINER_STATE_NAME))
        if self.args.should_save:
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
        if dist.is_initialized():
            dist.barrier()

    def _load_best_model(self) -> None:
        """Trainer's version loads HF-named tensors into the megatron model (nothing matches): reload the best
        checkpoint's megatron state (weights, with optimizer and schedulers, all layouts) instead."""
        from loongforge_hf.trainer.checkpoint import check_training_checkpoint, load_training_checkpoint

        logger.info("Loading best model from %s (score: %s).", self.state.best_model_checkpoint,
                    self.state.best_metric)
        check_training_checkpoint(self.state.best_model_checkpoint)
        load_training_checkpoint(self, self.state.best_model_checkpoint)

    def _pre_optimizer_step(self) -> None:
        """Trainer's events between the step's backwards and its update: ``on_substep_end`` once per micro-batch but
        the last (they ran inside megatron's schedule, which has no hook between them, so they fire here, in
        Trainer's order), then ``on_pre_optimizer_step``."""
        for _ in range(getattr(self, "_micro_batches_in_step", 1) - 1):
            self.control = self.callback_handler.on_substep_end(self.args, self.state, self.control)
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)

    def _save_scaler(self, output_dir: str) -> None:
        """No GradScaler: megatron's optimizer owns loss scaling and saves it with its state."""

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        """Loaded with the model in ``_prepare_for_training``."""

    def _load_scaler(self, checkpoint) -> None:
        """Part of megatron's optimizer state."""

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Trainer's (rank 0 creates the repository, for push_to_hub=True), with every rank learning the outcome
        and the repository's id, so a failure never leaves the other ranks waiting in a collective."""
        from loongforge_hf.trainer.checkpoint import run_everywhere

        run_everywhere("push_to_hub=True: could not create the Hub repository",
                       lambda: Trainer.init_hf_repo(self, token=token, private=private),
                       on=self.is_world_process_zero())
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [self.hub_model_id]
            dist.broadcast_object_list(box, src=0)
            self.hub_model_id = box[0]

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, token=None,
                    revision=None, **kwargs) -> str:
        """Upload ``save_model``'s HF folder to ``args.hub_model_id`` (collective)."""
        repo_id = getattr(self, "hub_model_id", None) or self.args.hub_model_id
        if repo_id is None and self.args.push_to_hub:
            repo_id = os.path.basename(os.path.abspath(self.args.output_dir))
        if repo_id is None:
            raise ValueError("Set TrainingArguments(hub_model_id=...) (or push_to_hub=True, which names the repo "
                             "after output_dir) before calling trainer.push_to_hub().")
        if self.is_world_process_zero():
            self._finish_current_push()  # NOTE: as Trainer: the checkpoints' uploads land first
        return self.model.push_to_hub(repo_id, token=token or self.args.hub_token,
                                      private=self.args.hub_private_repo, revision=revision,
                                      commit_message=commit_message or "End of training")
