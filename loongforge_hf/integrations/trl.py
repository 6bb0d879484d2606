"""``LoongSFTTrainer``: trl's SFTTrainer on the outside, LoongTrainer's megatron engine on the inside.

Choices:
- ``class LoongSFTTrainer(LoongTrainer, SFTTrainer)``. The MRO is LoongSFTTrainer -> LoongTrainer -> SFTTrainer ->
  Trainer, so:
  - from SFTTrainer (not overridden by LoongTrainer): ``__init__``'s dataset preparation (text, messages,
    prompt/completion, formatting_func, assistant_only_loss / completion_only_loss labels, truncation, packing), its
    collator (padding-free batches with restarting ``position_ids``), ``_set_signature_columns_if_needed``,
    ``evaluate`` and ``log``. The same SFTConfig gives the same token batches as trl.SFTTrainer;
  - from LoongTrainer: data sharding over data-parallel ranks, the training loop (each step is
    ``MegatronEngine.train_step``: megatron's schedule, DDP, distributed optimizer; the loss is the mean over all label
    tokens of the global batch, what SFTTrainer's "nll" loss is), optimizer/scheduler, checkpoints and ``save_model``.
  Composition (a LoongTrainer holding an SFTTrainer for data) was the alternative; it would duplicate Trainer state
  (callbacks, args, accelerator) in two objects, while the MRO shares one and overrides nothing of TRL's data path.
- ``peft_config`` never reaches TRL's ``get_peft_model`` (which would look for ``nn.Linear`` q_proj modules the
  megatron model does not have): it is intercepted here and applied with ``loongforge_hf.lora.get_peft_model``,
  right after ``set_seed(args.seed)`` as TRL does, so the adapters start from PEFT's values. ``save_model`` then
  writes a PEFT adapter folder (plus the tokenizer), like SFTTrainer with PEFT.
- TRL patches ``model.forward`` with its fused LM head (HF backbone + ``lm_head`` attributes); training never calls the
  model's forward and evaluation uses the model's own loss (``compute_loss`` below), so the patch is removed.
- megatron needs the sequence length to divide by TP under sequence parallelism (2 x CP under context
  parallelism), and under pipeline parallelism one length for every micro-batch of a step: the engine pads each
  step's text micro-batches so (``trainer.data.pad_micro_batches``), after TRL's collator, so the batches TRL's
  metrics count are the ones TRL would build; batches of TRL's vision collator are padded right after it instead
  (``vl_collator.PadToMultiple``, to a multiple of that and the user's ``pad_to_multiple_of``; pipeline parallelism
  pads images' batches to ``max_length``; TRL's collator itself refuses the option on prompt-completion data). Pads
  carry no loss. TRL's image datasets stay untokenized (its vision collator applies the processor), so
  LoongTrainer's check for an ``input_ids`` column stands aside for them (``_dataset_tokenized_by_collator``).
- Data-parallel load balancing (``dp_load_balance``, on unless a ``LoongSFTConfig`` turns it off) goes through
  LoongTrainer's ``_get_dataloader`` like any LoongTrainer run: it applies when TRL's collator is padding-free
  (``padding_free=True``, or packing with ``bfd`` / ``bfd_split``) and re-collates each rank's redistributed samples
  with that collator (``balanced_data.packs_without_padding``; padded batches stay unbalanced, and why, there).
- ``gradient_checkpointing`` (True by default in SFTConfig) recomputes every decoder layer with megatron-core's full
  recompute (``LoongModelForCausalLM.activation_checkpointing_enable``; the embeddings' output is made to require
  grad so LoRA adapters behind a frozen embedding still get gradients). TRL's ``selective`` checkpointing (torch's
  selective activation checkpointing wrapper on transformers' layers) is refused.
- Refused with a message: a model given by name (load it with ``loongforge_hf.AutoModelForCausalLM``),
  ``compute_loss_func``, ``loss_type="dft"``, ``use_liger_kernel``, custom ``optimizers`` /
  ``optimizer_cls_and_kwargs``, ``quantization_config``, non-LoRA ``peft_config``.
- ``label_smoothing_factor`` (deprecated in TRL, still honoured there): the engine's loss is transformers'
  ``LabelSmoother`` over the global batch's label tokens, as TRL computes it (labels shifted for every model).
- TRL's ``entropy`` / ``mean_token_accuracy`` / ``num_tokens`` metrics, which it computes in ``compute_loss``, are
  computed where our losses are: in training by the engine (``MegatronEngine.token_stats``: sums over each
  micro-batch's label tokens from the fused loss's own pass over the logits, vocab-parallel under TP), in evaluation
  from the logits the model's forward returns (``kernels.cross_entropy.logits_token_stats``). As in TRL, each
  micro-batch's values are reduced over the data-parallel ranks and the log shows their mean since the last log;
  ``num_tokens`` counts each batch's attention-mask ones, or its length when padding-free (under ``dp_load_balance``
  the rows' lengths as the collator made them where the samples were drawn, padding to ``pad_to_multiple_of``
  included: ``balanced_data.padded_row_tokens``).
- TRL's router load-balancing loss (MoE models, ``router_aux_loss_coef``, by default the model config's): TRL writes
  ``output_router_logits`` and the coefficient into the model config, and the engine adds the term as TRL weighs it
  (``coef * aux_loss / accumulation steps`` per micro-batch, averaged over data-parallel ranks:
  ``router_aux_reduction="mean"``, see ``trainer/engine.py``); the ``aux_loss`` metric is each micro-batch's value
  averaged over the data-parallel ranks (under pipeline parallelism too: ``bridges/router_balance.py``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from trl import SFTConfig, SFTTrainer

from loongforge_hf.trainer.arguments import LoongArgumentsMixin, LoongTrainingArguments
from loongforge_hf.trainer.loong_trainer import LoongTrainer

logger = logging.getLogger(__name__)


@dataclass
class LoongSFTConfig(LoongArgumentsMixin, SFTConfig):
    """trl's ``SFTConfig`` plus LoongTrainer's own knobs (``optimizer_precision``, ``dp_load_balance``,
    ``dp_balance_refit``, ``dp_balance_refit_steps``), defined once in ``LoongArgumentsMixin``."""


def _as_sft_config(args, model) -> SFTConfig:
    """``args`` as the SFTConfig TRL would build from it (None -> defaults named after the model); a
    ``LoongTrainingArguments`` becomes a ``LoongSFTConfig`` with its Loong knobs kept."""
    from transformers import TrainingArguments

    if args is None:
        name = (getattr(model.config, "_name_or_path", "") or "model").rstrip("/").split("/")[-1]
        return SFTConfig(f"{name}-SFT")
    if isinstance(args, SFTConfig):
        return args
    if isinstance(args, TrainingArguments):
        values = args.to_dict()
        values["hub_token"] = args.hub_token  # to_dict hides it
        return (LoongSFTConfig if isinstance(args, LoongTrainingArguments) else SFTConfig)(**values)
    raise TypeError(f"args must be a trl.SFTConfig or transformers.TrainingArguments, got {type(args).__name__}.")


def _refuse_unsupported(args: SFTConfig, **given) -> None:
    named = [k for k, v in given.items() if v is not None and v != (None, None)]
    if named:
        raise ValueError(f"LoongSFTTrainer does not take {named}: the megatron engine owns the loss and the optimizer "
                         "(hyper-parameters come from SFTConfig).")
    if args.loss_type != "nll":
        raise ValueError(f"SFTConfig(loss_type={args.loss_type!r}) is not supported by LoongSFTTrainer; use 'nll'.")
    if args.use_liger_kernel:
        raise ValueError("SFTConfig(use_liger_kernel=True) is not supported: loongforge's own kernels are used.")
    if getattr(args, "activation_offloading", False):
        raise ValueError("SFTConfig(activation_offloading=True) is not supported: TRL offloads activations around "
                         "its training_step, which megatron's schedule never runs; use gradient_checkpointing=True "
                         "(megatron-core's recompute) to save activation memory.")


def _vision_pad_multiple(parallel, args: SFTConfig) -> int:
    """What batches of TRL's vision collator must be padded to a multiple of, for megatron: TP under sequence
    parallelism, 2 x CP under context parallelism, and under pipeline parallelism the full ``max_length``, since
    every micro-batch of a pipelined step must have one shape. (Text batches are padded by the engine instead, per
    step: ``trainer.data.pad_micro_batches``; batches with images reach it as their collator made them.)"""
    multiple = parallel.sequence_multiple
    if parallel.pipeline_parallel_size > 1:
        if args.max_length is None:
            raise ValueError("pipeline_parallel_size > 1 with images needs batches of one length: set "
                             "SFTConfig(max_length=...).")
        multiple = math.lcm(multiple, args.max_length)
    return multiple


# NOTE: what a model's forward takes of TRL's batch in evaluation (its masks are the collator's own); images and
# videos too, for an image-text model (Idefics3's pixel mask, Gemma 3's token types, LLaVA-OneVision's images per
# sample, Aria's tile masks)
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "labels", "pixel_values", "image_grid_thw",
                "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids", "image_sizes",
                "pixel_attention_mask", "token_type_ids", "batch_num_images", "pixel_mask")


class LoongSFTTrainer(LoongTrainer, SFTTrainer):
    """A drop-in ``trl.SFTTrainer`` for ``LoongModelForCausalLM`` models (``peft_config`` gives megatron LoRA)."""

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None, formatting_func=None) -> None:
        from loongforge_hf.modeling import LoongModelForCausalLM

        if not isinstance(model, LoongModelForCausalLM):
            raise TypeError("LoongSFTTrainer trains a loongforge_hf model: load it with "
                            "loongforge_hf.AutoModelForCausalLM.from_pretrained(...) "
                            f"(got {type(model).__name__}).")
        args = _as_sft_config(args, model)
        _refuse_unsupported(args, compute_loss_func=compute_loss_func, optimizers=optimizers,
                            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                            quantization_config=quantization_config)
        if (args.gradient_checkpointing_kwargs or {}).get("selective"):
            raise ValueError("LoongSFTTrainer: gradient_checkpointing_kwargs={'selective': True} (torch's selective "
                             "activation checkpointing on transformers' layers) is not supported; drop 'selective' to "
                             "recompute whole layers with megatron-core.")
        given = {"chat_template_path": args.chat_template_path, "eos_token": args.eos_token}
        if peft_config is not None:
            from transformers import set_seed

            from loongforge_hf.lora import get_peft_model

            # NOTE: TRL seeds before a chat template's clone (whose resize draws the added rows) and the adapters;
            # doing the same gives transformers' rows and PEFT's initial values.
            set_seed(args.seed)
            processing_class = _clone_chat_template_before_lora(model, processing_class, args, peft_config)
            model = get_peft_model(model, peft_config)
        if model.generation_config is None:
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_model_config(model.config)
        try:
            super().__init__(model, args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class,
                             compute_metrics=compute_metrics, callbacks=callbacks,
                             preprocess_logits_for_metrics=preprocess_logits_for_metrics, peft_config=None,
                             formatting_func=formatting_func)
        finally:
            for name, value in given.items():
                setattr(args, name, value)
        multiple = _vision_pad_multiple(self.model.parallel, args) if self._dataset_tokenized_by_collator() else 1
        if data_collator is None and multiple > 1:
            # NOTE: padded after TRL's vision collator (which refuses pad_to_multiple_of on prompt-completion data)
            from loongforge_hf.integrations.vl_collator import PadToMultiple

            tokenizer = getattr(processing_class, "tokenizer", processing_class)
            self.data_collator = PadToMultiple(self.data_collator, math.lcm(args.pad_to_multiple_of or 1, multiple),
                                               pad_id=getattr(tokenizer, "pad_token_id", None) or 0)
        vars(self.model).pop("forward", None)  # TRL's fused-LM-head patch (see the module docstring)
        self._check_router_aux_loss()

    def _dataset_tokenized_by_collator(self) -> bool:
        """TRL's image datasets stay messages / images: its vision collator applies the processor batch by batch."""
        return bool(getattr(self, "_is_vision_dataset", False))

    def _check_router_aux_loss(self) -> None:
        """A MoE model: trl.SFTTrainer adds ``router_aux_loss_coef * aux_loss`` (transformers' balance loss over the
        router logits of all layers; the coefficient defaults to the model config's) to each micro-batch's loss,
        divided by the accumulation steps, after writing ``output_router_logits`` and the coefficient into the model
        config. The engine reads them from there (``router_aux_reduction="mean"``, set in ``create_optimizer``); a
        layout or model that cannot compute the term is refused here, on every rank alike."""
        from loongforge_hf.bridges import router_balance
        from loongforge_hf.bridges.config_map import router_aux_loss_coef_of

        if not self.aux_loss_enabled:
            return
        if router_aux_loss_coef_of(self.model.config.get_text_config()) != self.router_aux_loss_coef:
            raise ValueError(f"LoongSFTTrainer: router_aux_loss_coef={self.router_aux_loss_coef}, but the model "
                             "config has no router_aux_loss_coef field for it; pass SFTConfig(router_aux_loss_coef="
                             "0.0).")
        router_balance.active(self.model)

    def _save_checkpoint(self, model, trial) -> None:
        save_checkpoint_with_model_card(self, model, trial)

    def _smoothing_shifts(self) -> bool:
        return True  # NOTE: trl.SFTTrainer's label smoother shifts the labels of every model, image-text ones too

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.engine.token_stats = True  # NOTE: TRL's entropy and mean_token_accuracy (see the module docstring)
        self.engine.router_aux_reduction = "mean"  # NOTE: TRL's weighting of the router balancing loss
        return optimizer

    def _record_step(self, result, micro: list[dict]) -> None:
        """TRL's train metrics of one step: entropy and token accuracy of each micro-batch, the tokens seen, and
        (``aux_loss``) each micro-batch's router balancing loss averaged over the data-parallel ranks."""
        metrics = self._metrics["train"]
        if self.aux_loss_enabled and result.router_aux is not None:
            metrics["aux_loss"].extend(result.router_aux)
        for entropy, top1, count in result.token_stats:
            metrics["entropy"].append(entropy / count if count else 0.0)
            metrics["mean_token_accuracy"].append(top1 / count if count else 0.0)
        self._total_train_tokens += self.count_step_tokens(
            micro, lambda b: int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].shape[1],
            with_padding=not any("attention_mask" in b for b in micro))
        metrics["num_tokens"] = [self._total_train_tokens]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Evaluation loss from the model's forward (training steps run in the megatron engine, not here), with
        TRL's entropy, mean_token_accuracy and num_tokens metrics."""
        from loongforge_hf.bridges.runtime import IGNORE_INDEX, shift_labels
        from loongforge_hf.kernels.cross_entropy import logits_token_stats

        outputs = model(**{k: v for k, v in inputs.items() if k in MODEL_INPUTS})
        mode = "train" if self.model.training else "eval"
        if inputs.get("labels") is not None and outputs.logits is not None:
            labels = shift_labels(inputs["labels"].to(outputs.logits.device))
            entropy, top1 = logits_token_stats(outputs.logits, labels, ignore_index=IGNORE_INDEX).tolist()
            entropy, top1, count = _data_parallel_sum([entropy, top1, int((labels != IGNORE_INDEX).sum())],
                                                      outputs.logits.device)
            self._metrics[mode]["entropy"].append(entropy / count if count else 0.0)
            self._metrics[mode]["mean_token_accuracy"].append(top1 / count if count else 0.0)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled and getattr(outputs, "aux_loss", None) is not None:
            self._metrics[mode]["aux_loss"].append(_data_parallel_mean(float(outputs.aux_loss), self.model.device))
        loss = outputs.loss
        if self.label_smoother is not None and inputs.get("labels") is not None:
            # NOTE: as trl.SFTTrainer: the smoother on the logits, labels shifted for every model
            loss = self.label_smoother(outputs, inputs["labels"], shift_labels=True)
        return (loss, outputs) if return_outputs else loss


def _clone_chat_template_before_lora(model, processing_class, args: SFTConfig, peft_config):
    """TRL clones a chat template (``chat_template_path`` naming a tokenizer or model folder: its special tokens added,
    the embeddings resized) before it applies PEFT, and then trains the added tokens' embedding rows
    (``trainable_token_indices``) and the LM head (``modules_to_save``). LoRA is applied before TRL's ``__init__``
    here, so the clone and those LoraConfig changes are made first, as TRL makes them, and ``__init__`` does not clone
    again (``args.chat_template_path`` is set back after it). TRL sets ``args.eos_token`` before it clones, and the
    clone's EOS token replaces it: ``__init__`` is given the clone's (``args.eos_token`` is set back after it too), a
    token not in the tokenizer is left for ``__init__`` to refuse as TRL refuses it, before any clone. Returns the
    processing class (loaded as TRL loads it when not given)."""
    import os

    from trl.chat_template_utils import clone_chat_template

    path = args.chat_template_path
    if path is None or os.path.isfile(path) and path.endswith((".jinja", ".j2")):
        return processing_class
    if processing_class is None:
        from transformers import AutoProcessor

        processing_class = AutoProcessor.from_pretrained(model.name_or_path, trust_remote_code=args.trust_remote_code)
    if args.eos_token is not None and args.eos_token not in processing_class.get_vocab():
        return processing_class
    _, processing_class, added_tokens = clone_chat_template(model, processing_class, path)
    args.chat_template_path = None
    if args.eos_token is not None:
        args.eos_token = processing_class.eos_token
    if added_tokens:
        indices = peft_config.trainable_token_indices
        if indices is None:
            peft_config.trainable_token_indices = {"embed_tokens": added_tokens}
        elif "embed_tokens" not in indices:
            indices["embed_tokens"] = added_tokens
        else:
            indices["embed_tokens"].extend(added_tokens)
        if "lm_head" not in (peft_config.modules_to_save or []):
            logger.warning("Cloning the chat template added tokens: 'lm_head' joins LoRA's modules_to_save, as TRL "
                           "adds it, so that the model can learn to generate them.")
            peft_config.modules_to_save = [*(peft_config.modules_to_save or []), "lm_head"]
    return processing_class


def _data_parallel_mean(value: float, device) -> float:
    """``value`` averaged over the data-parallel ranks (TRL's gather-then-mean of each rank's metric)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    from megatron.core import parallel_state as ps

    return _data_parallel_sum([value], device)[0] / ps.get_data_parallel_world_size()


def _data_parallel_sum(values: list[float], device) -> list[float]:
    """``values`` summed over the data-parallel ranks (context-parallel ranks share a batch: not summed over)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return values
    from megatron.core import parallel_state as ps

    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return [int(v) if isinstance(x, int) else v for v, x in zip(total.tolist(), values)]


def save_checkpoint_with_model_card(trainer, model, trial) -> None:
    """A TRL trainer's ``_save_checkpoint`` (SFT, DPO, reward): its model card (README.md) in ``output_dir`` at every
    checkpoint, then LoongTrainer's checkpoint (the MRO would otherwise skip TRL's). The card is written on rank 0;
    every rank learns the outcome (no rank left waiting in the checkpoint's collectives)."""
    from loongforge_hf.trainer.checkpoint import run_everywhere

    hub_id = trainer.args.hub_model_id
    name = hub_id.split("/")[-1] if hub_id else Path(trainer.args.output_dir).name
    run_everywhere(f"could not write the model card into {trainer.args.output_dir}",
                   lambda: trainer.create_model_card(model_name=name), on=trainer.is_world_process_zero())
    LoongTrainer._save_checkpoint(trainer, model, trial)
