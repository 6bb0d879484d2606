"""``LoongDPOTrainer``: trl's DPOTrainer on the outside, LoongTrainer's megatron engine on the inside.

Choices:
- ``class LoongDPOTrainer(LoongTrainer, DPOTrainer)``, as ``LoongSFTTrainer``: from DPOTrainer its ``__init__``'s
  dataset preparation (prompt extraction, EOS, tokenisation into prompt / chosen / rejected ids, dropping prompts
  that fill ``max_length``), its collator (the chosen rows then the rejected rows of each batch, right-padded, a
  completion mask), its metrics and ``log``; from LoongTrainer data sharding over data-parallel ranks, the training
  loop, optimizer, checkpoints and ``save_model``. (``_DPOArgsSecond``: LoongTrainer passes ``(model, args)`` as
  Trainer takes them; DPOTrainer's second parameter is ``ref_model``.)
- Each optimizer step is one ``MegatronEngine.train_step`` whose per-micro-batch loss is TRL's DPO loss of the
  config's ``loss_type`` (every TRL 1.16 type, weighted by ``loss_weights``, with ``label_smoothing``,
  ``discopop_tau`` and ``f_divergence_type``: ``dpo_losses.DPOLoss``, from the rows' completion log-probabilities and
  token counts; ``engine.loss_hook`` = ``_PreferenceLoss``): on the last pipeline stage, each row's completion
  log-probability is the sum over its label tokens of ``-CE`` from the fused, vocab-parallel linear cross-entropy
  with per-token output (``kernels.cross_entropy.linear_cross_entropy(reduction="none")``: no full-vocabulary
  logits, no gather over TP);
  ``RowScores`` (``dpo_scores.py``, beside the no-grad ``sequence_scores`` and the row bookkeeping) turns the
  per-token log-probs into what the loss reads per row: LD-DPO's sums (``ld_alpha``: each
  token past the pair's shorter completion times it; the policy's, the reference's, precomputed and evaluation alike),
  the plain sums ("sft"'s), and WPO's (``use_weighting``) sum of ``log p(token) - log sum_v p_v^2``: the policy's
  ``log sum_v p_v^2`` per label token from a second, no-grad pass over the head's logits, a chunk of tokens at a time,
  each TP rank's vocabulary shard's max and sums of ``exp(z - max)`` and ``exp(2 (z - max))`` all-reduced over TP
  (one more head GEMM per token, without gradient; never the whole vocabulary on a rank); TRL's per-pair weight is
  ``exp`` of each row's mean over its label tokens, chosen times rejected (``dpo_losses.wpo_weights``);
  the micro-batch's loss is TRL's over its pairs (means over the pairs; "aot" sorts within the micro-batch), and the
  step's gradients are divided by the number of micro-batches times data-parallel ranks (the hook's count, 1 per
  micro-batch): the mean of the micro-batches' losses, averaged over ranks, which is what Trainer's
  ``loss / gradient_accumulation_steps`` under DDP gives TRL.
- Context parallelism: each rank scores its load-balanced share of every row's tokens and the rows' log-prob sums
  are summed over the CP group (the policy's with a gradient, ``_PreferenceLoss``; the reference's and evaluation's
  without; LD-DPO's token weights from the whole rows, cut as the tokens are; WPO's sums and token counts too), so
  every CP rank computes the whole micro-batch's loss and counts as a data-parallel rank would.
  Virtual pipeline stages: the step runs megatron's interleaved schedule (``gradient_accumulation_steps`` a multiple
  of ``pipeline_parallel_size``), the reference's forwards too; a forward of one batch (evaluation, precompute) goes
  through the virtual stages in order. Pipeline parallelism pads every batch to ``max_length``, as without VPP.
- MoE router load-balancing loss, as TRL turns it on (``DPOConfig.router_aux_loss_coef``, by default the model
  config's, for a config with ``output_router_logits``; TRL asks the policy's forwards for it whatever that field
  says, and not the reference's): transformers' loss over the policy forward's chosen and rejected rows (their
  attention mask, ``bridges/router_balance.py``), ``coef * aux_loss`` added to each micro-batch's loss
  (``router_aux_reduction="mean"`` with the engine's ``router_aux_coef``) and to the evaluation loss, the
  ``aux_loss`` metric each micro-batch's value averaged over the data-parallel ranks. A MoE model that cannot compute
  it is refused (``router_balance.check_layout``: pass ``router_aux_loss_coef=0.0``).
- Reference log-probabilities, as TRL picks them: a ``ref_model`` (a second ``LoongModelForCausalLM`` with the
  policy's layout; without one, and without LoRA or ``precompute_ref_log_probs``, loaded from the policy's
  ``name_or_path`` with its layout and dtype, as TRL loads it), the policy with its adapters disabled (a
  ``LoraConfig`` and no ``ref_model``), or precomputed over the datasets before training
  (``precompute_ref_log_probs=True``; not cached to disk). Each step runs the reference's forwards over the step's
  micro-batches with megatron's forward-only schedule (``sequence_logps``) before the policy's schedule, no grad.
- TRL's ``add_fused_lm_head`` patch of the models' ``forward`` is removed (nothing here calls it). TRL would load a
  transformers reference model when it sees no PEFT model (megatron LoRA is not ``peft.PeftModel``): it is handed
  a stand-in for "the policy as reference" instead (``_PolicyAsReference``) and ``ref_model`` is None afterwards,
  as TRL leaves it with PEFT; the reference log-probs are precomputed here, after TRL's ``__init__``.
- Vision DPO (an image dataset: an ``image`` / ``images`` column, as TRL tells them; an image-text model from
  ``AutoModelForImageTextToText``, its processor as ``processing_class``): TRL's ``DataCollatorForVisionPreference``
  applies the chat template and the processor batch by batch (each prompt's images once for its chosen and once for
  its rejected row, the prompts left-padded, then flushed left, truncated to ``max_length``), and the batches go
  through the engine as the image-text model's training step takes them (``megatron_forward_inputs``: the vision
  inputs, 3-D rope positions), the reference's and evaluation's forwards too (``dpo_scores._model_inputs``); the
  default reference is the checkpoint loaded again with the policy's layout and vision tower layout. Every layout the
  image-text model trains at (TP with SP or a split tower, PP, VPP, CP, DP) and LoRA (the tower's linears too, the
  adapters disabled as reference). Batches are padded after the collator (its ``mm_token_type_ids`` /
  ``token_type_ids`` with the ids; the images as they are). ``padding_free=True`` pads them, as TRL 1.16 does.
- ``disable_dropout`` (TRL's default): TRL zeroes ``nn.Dropout`` modules (attention, LoRA); megatron's residual
  dropout (``hidden_dropout``, a float on each layer) is zeroed too.
- ``padding_free=True`` (TRL 1.16 accepts it, warns and pads instead: the same numbers, which the packed rows give
  here): after TRL's collator each micro-batch's rows, chosen then rejected, are packed into one row without their
  pads (``_packed``: ``position_ids`` restarting at each row, so attention never crosses rows, the label of each
  row's first token dropped, ``row_index`` where each row's tokens went). The forwards run on the packed row; the
  per-token log-probs (and WPO's ``log sum_v p_v^2``) are put back into per-row ``[rows, longest]`` form
  (``_rows``) before ``RowScores``, so the losses, LD-DPO's weights and the metrics read rows as without packing;
  a MoE's balancing loss is over the same real tokens (the packed row's mask, pads off). Image batches are padded
  instead (as TRL pads them). Refused with context parallelism (each rank's share is of the packed row, not of each
  row) and pipeline parallelism (a step's micro-batches would need one length).
- ``use_liger_kernel=True``: TRL 1.16's DPO asks transformers to swap Liger's layer kernels (RMSNorm, RoPE, SwiGLU,
  ...) into the model, ``fused_linear_cross_entropy`` off: its loss and fused LM head stay its own (Liger's fused
  DPO loss is older TRL's), so the numbers are its run's without Liger. The megatron model runs this package's own
  kernels whatever the flag (``kernels/``), so it is accepted and changes nothing (``liger_kernel`` need not be
  installed; with it, ``Trainer.train`` would try to patch a transformers model: the flag is off while LoongTrainer
  checks and trains, ``_without_liger``); ``liger_kernel_config={"fused_linear_cross_entropy": True}`` is refused,
  as TRL refuses it. Tested against TRL without Liger: ``liger_kernel`` (Triton kernels) does not run on CPU.
- Batches are padded after TRL's collator to what megatron needs (``ParallelConfig.sequence_multiple``; under pipeline
  parallelism to ``max_length``, one length for every micro-batch) and get ``labels`` (the completion tokens); pads
  are masked and carry no label.
- Logged as TRL: ``loss``, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
  logps/rejected, entropy (completion tokens), mean_token_accuracy (chosen completions), num_tokens; each
  micro-batch's values over the data-parallel ranks (TRL gathers them), the log their mean since the last one. TRL's
  ``logits/chosen`` and ``logits/rejected`` (mean logit over the vocabulary) are not logged: the fused head never
  builds the logits.
- Refused with a message, on every rank before any collective: a loss type TRL 1.16 does not know,
  ``liger_kernel_config`` with ``fused_linear_cross_entropy``, ``padding_free`` with CP or PP (text), ``use_weighting``
  with "sft" (TRL 1.16 fails on it: it scales the
  expanded scalar in place), ``sync_ref_model``, ``activation_offloading``, ``rpo_alpha`` (an older TRL's field;
  TRL 1.16 writes RPO as ``loss_type=["sigmoid", "sft"]``, ``loss_weights=[1, alpha]``, which runs here),
  a ``ref_model`` that is not a loongforge model of the same layout (and vision tower layout), non-LoRA
  ``peft_config``, custom ``optimizers``, ``quantization_config``, pipeline parallelism without ``max_length``; with
  an image dataset: a text model or a tokenizer, and what TRL 1.16 refuses for it (``precompute_ref_log_probs``,
  ``truncation_mode="keep_end"`` with ``max_length``, and ``pad_to_multiple_of``, which its vision collator raises
  on at the first batch).
  TRL's own checks (``label_smoothing`` of "exo_pair", which loss types take an ``f_divergence_type``,
  ``use_weighting`` with "aot" / "aot_unpaired") run in its
  ``__init__``, on every rank alike. An image batch whose image placeholder tokens do not match its images (TRL's
  collator truncates ``input_ids`` to ``max_length``, not the images) fails on every rank before the step (the
  reference's forwards included) or the evaluation batch's forwards, naming the fields and suggesting a larger
  ``max_length`` (``multimodal.image_tokens``, LoongTrainer's batch check; TRL gives that hint after its forward).
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from trl import DPOConfig, DPOTrainer

from loongforge_hf.integrations.dpo_losses import LOSS_TYPES, DPOLoss, reward_stats, wpo_weights
from loongforge_hf.integrations.dpo_losses import STATS as REWARD_STATS
from loongforge_hf.integrations.dpo_scores import (RowScores, _completion_lengths, _halves, _over_context_parallel,
                                                   _rows, _shifted, _token_logps, sequence_scores)
from loongforge_hf.trainer.arguments import LoongArgumentsMixin
from loongforge_hf.trainer.loong_trainer import LoongTrainer

logger = logging.getLogger(__name__)
# the columns of a preference batch padded with 0 after its input ids (Qwen-VL's mm_token_type_ids, Gemma 3's
# token_type_ids: TRL's vision collator's)
_TOKEN_COLUMNS = ("attention_mask", "completion_mask", "mm_token_type_ids", "token_type_ids")
# per micro-batch, summed over the data-parallel ranks: the reward metrics (dpo_losses.STATS); entropy sum,
# completion tokens, top-1 hits and tokens of the chosen completions
_STATS = REWARD_STATS + ("entropy", "tokens", "top1", "chosen_tokens")


@dataclass
class LoongDPOConfig(LoongArgumentsMixin, DPOConfig):
    """trl's ``DPOConfig`` plus LoongTrainer's own knobs, defined once in ``LoongArgumentsMixin``."""


def _as_dpo_config(args, model) -> DPOConfig:
    if args is None:
        name = (getattr(model.config, "_name_or_path", "") or "model").rstrip("/").split("/")[-1]
        return DPOConfig(f"{name}-DPO")
    if not isinstance(args, DPOConfig):
        raise TypeError(f"args must be a trl.DPOConfig (or loongforge_hf.LoongDPOConfig), got {type(args).__name__}.")
    return args


def _refuse_unsupported(args: DPOConfig, model, ref_model, peft_config, train_dataset, processing_class,
                        **given) -> None:
    """Everything checked here is the same on every rank: all raise alike, before any collective."""
    from loongforge_hf.modeling import LoongModelForCausalLM

    named = [k for k, v in given.items() if v is not None and v != (None, None)]
    problems = [f"{named} (the megatron engine owns the optimizer)"] if named else []
    unknown = [t for t in args.loss_type if t not in LOSS_TYPES]
    if unknown:
        problems.append(f"loss_type {unknown!r} (TRL 1.16's are {list(LOSS_TYPES)})")
    if args.use_weighting and "sft" in args.loss_type:
        problems.append("use_weighting=True with loss_type 'sft' (TRL 1.16's weighting fails on its per-sequence "
                        "loss, an expanded scalar)")
    for field, default, why in (
            ("sync_ref_model", False, ""), ("activation_offloading", False, ""),
            ("rpo_alpha", None, " (an older TRL's field: write loss_type=['sigmoid', 'sft'], "
                                "loss_weights=[1.0, rpo_alpha], as TRL 1.16 does)")):
        if getattr(args, field, default) != default:
            problems.append(f"{field}={getattr(args, field)!r}{why}")
    vision = _is_vision_dataset(train_dataset)
    if vision:
        problems += _vision_problems(args, model, processing_class)
    if ref_model is not None and not isinstance(ref_model, LoongModelForCausalLM):
        loader = "AutoModelForImageTextToText" if _vision_layout(model) is not None else "AutoModelForCausalLM"
        problems.append(f"ref_model of type {type(ref_model).__name__} (load it with "
                        f"loongforge_hf.{loader}.from_pretrained, with the policy's layout)")
    elif ref_model is not None and _layout(ref_model) != _layout(model):
        problems.append(f"ref_model with layout {_layout(ref_model)} (the policy's is {_layout(model)})")
    if peft_config is not None and type(peft_config).__name__ != "LoraConfig":
        problems.append(f"peft_config of type {type(peft_config).__name__} (LoRA only)")
    if args.use_liger_kernel and (args.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
        problems.append('liger_kernel_config={"fused_linear_cross_entropy": True} (TRL 1.16 refuses it too: it '
                        "replaces the model's forward, which the trainer's fused LM head stands in for)")
    layout = model.parallel
    if args.padding_free and not vision:  # NOTE: image batches are padded (as TRL 1.16 pads them): nothing packed
        for field in ("context_parallel_size", "pipeline_parallel_size"):
            if getattr(layout, field) > 1:
                problems.append(f"padding_free=True with {field} > 1 (packed preference rows train at tensor, "
                                "sequence, expert and data parallelism)")
    if layout.pipeline_parallel_size > 1 and args.max_length is None:
        problems.append("pipeline_parallel_size > 1 without DPOConfig(max_length=...) (every micro-batch of a step "
                        "is padded to it)")
    if problems:
        raise ValueError("LoongDPOTrainer does not support: " + "; ".join(problems) + ".")


def _is_vision_dataset(dataset) -> bool:
    """TRL's test: the first sample has an ``image`` or ``images`` column."""
    sample = next(iter(dataset)) if dataset is not None else {}
    return "image" in sample or "images" in sample


def _vision_layout(model) -> str | None:
    """An image-text model's vision tower layout ('replicated', 'tensor_parallel', 'data_parallel'); None for text."""
    return getattr(model, "vision_layout", None)


def _layout(model) -> str:
    """The model's parallel layout, and an image-text model's vision tower layout."""
    tower = _vision_layout(model)
    return str(model.parallel) if tower is None else f"{model.parallel} with a {tower} vision tower"


def _vision_problems(args: DPOConfig, model, processing_class) -> list[str]:
    """What an image dataset does not train with; TRL 1.16's own refusals among them (here on every rank, before any
    collective, and before TRL's ``__init__`` would miss ``precompute_ref_log_probs``, which is hidden from it)."""
    from transformers import ProcessorMixin

    problems = []
    if _vision_layout(model) is None:
        problems.append(f"an image dataset with the text model {type(model).__name__} (load an image-text model "
                        "with loongforge_hf.AutoModelForImageTextToText.from_pretrained)")
    if processing_class is not None and not isinstance(processing_class, ProcessorMixin):
        problems.append(f"an image dataset with processing_class of type {type(processing_class).__name__} (pass "
                        "the model's processor)")
    if args.precompute_ref_log_probs:
        problems.append("precompute_ref_log_probs=True with an image dataset (TRL 1.16 refuses it too: the images "
                        "are processed batch by batch, never for the whole dataset up front)")
    if args.max_length is not None and args.truncation_mode == "keep_end":
        problems.append("truncation_mode='keep_end' with an image dataset (TRL 1.16 refuses it too: it may cut the "
                        "image tokens of the prompt)")
    if args.pad_to_multiple_of is not None:
        problems.append(f"pad_to_multiple_of={args.pad_to_multiple_of} with an image dataset (TRL 1.16's vision "
                        "collator refuses it: NotImplementedError; batches are padded here as megatron needs)")
    return problems


class _PolicyAsReference(torch.nn.Module):
    """What TRL is handed as ``ref_model`` while the reference is the policy itself (its adapters disabled, or its
    weights before training when precomputed): TRL would otherwise load a transformers model. Holds no parameters;
    ``LoongDPOTrainer`` sets ``ref_model`` back to None after TRL's ``__init__``."""

    _is_accelerate_prepared = True  # NOTE: accelerate's prepare_model returns it as it is

    def __init__(self, policy) -> None:
        super().__init__()
        self.config = policy.config


class _DPOArgsSecond(DPOTrainer):
    """DPOTrainer taking ``(model, args, ...)`` positionally, as LoongTrainer passes them to the next class."""

    def __init__(self, model, args=None, *, ref_model=None, **kwargs) -> None:
        DPOTrainer.__init__(self, model, ref_model, args, **kwargs)


class _PreferenceBatches:
    """TRL's preference collator, then (``packed``) its rows packed into one (``_packed``), padding to ``multiple``
    (pads masked out) and ``labels``: the completion tokens (TRL's ``input_ids`` where ``completion_mask``, else
    -100)."""

    def __init__(self, collator, *, multiple: int, pad_id: int, packed: bool = False) -> None:
        self.collator, self.multiple, self.pad_id, self.packed = collator, multiple, pad_id, packed

    def __call__(self, examples):
        batch = dict(self.collator(examples))
        if self.packed:
            batch = _packed(batch)
        seq = batch["input_ids"].shape[1]
        extra = -(-seq // self.multiple) * self.multiple - seq
        if extra:
            for key, value in (("input_ids", self.pad_id), *((k, 0) for k in _TOKEN_COLUMNS)):
                if key in batch:  # NOTE: an image batch's token types too; its images are left as they are
                    t = batch[key]
                    batch[key] = torch.cat([t, t.new_full((t.shape[0], extra), value)], dim=1)
            if self.packed:  # NOTE: the pads continue the last row (masked keys), as right-padding would
                pos = batch["position_ids"]
                batch["position_ids"] = torch.cat([pos, pos[:, -1:] + torch.arange(1, extra + 1)], dim=1)
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        if self.packed:  # NOTE: a row's last token predicts nothing (the next row's first token is not its label)
            labels = labels.masked_fill(batch["position_ids"] == 0, -100)
        batch["labels"] = labels
        return batch


def _packed(batch: dict) -> dict:
    """TRL's right-padded ``[rows, s]`` preference batch as one packed row (``padding_free``): the rows' tokens one
    after the other, ``position_ids`` restarting at each row, ``row_index`` where each row's tokens went (``_rows``)."""
    keep = batch["attention_mask"].bool()
    lengths = keep.sum(dim=1)
    index = torch.full(keep.shape, -1, dtype=torch.long)
    index[keep] = torch.arange(int(lengths.sum()))
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "completion_mask")}
    out.update(input_ids=batch["input_ids"][keep][None], completion_mask=batch["completion_mask"][keep][None],
               attention_mask=torch.ones_like(batch["input_ids"][keep][None]), row_index=index,
               position_ids=torch.cat([torch.arange(int(n)) for n in lengths])[None])
    return out


class _PreferenceLoss:
    """``MegatronEngine.loss_hook``: the DPO loss of each micro-batch (see the module docstring).

    Under context parallelism each rank holds a share of every row's tokens: the rows' log-prob sums are summed over
    the group (``_over_context_parallel``), so every rank computes the micro-batch's whole loss, and counts 1 as a
    data-parallel rank would; the sum's backward sums the group's gradients, so each rank's tokens get CP times
    their gradient and the step (which divides by CP times more counts) gets the loss's. Its reward stats are then
    summed CP times, the pairs too; the token stats are each rank's own tokens'."""

    num_stats = len(_STATS)

    def __init__(self, trainer: "LoongDPOTrainer") -> None:
        self.trainer = trainer
        self.reference: dict[int, torch.Tensor] = {}

    def start_step(self, micro_batches: list[dict]) -> None:
        self.reference = {}
        if self.trainer.precompute_ref_logps:
            return
        found = self.trainer.reference_logps(micro_batches, everywhere=False)
        self.reference = {id(b): v for b, v in zip(micro_batches, found)}

    def __call__(self, output, batch: dict, *, labels: torch.Tensor, head):
        trainer = self.trainer
        device = output.device
        rows = batch.get("row_index", labels).shape[0] // 2  # NOTE: pairs (a packed batch's rows: row_index's)
        chosen_stats = torch.zeros(2, dtype=torch.float32, device=device)
        rejected_stats = torch.zeros(2, dtype=torch.float32, device=device)
        vocab = trainer.model.config.vocab_size
        # NOTE: the chosen and rejected halves apart: TRL's token accuracy counts the chosen completions only
        chosen, rejected, dim = _halves(batch, rows)
        token_logps = torch.cat([_token_logps(output[half], labels[half], head, vocab_size=vocab, stats=stats)
                                 for half, stats in ((chosen, chosen_stats), (rejected, rejected_stats))], dim=dim)
        logps, plain, aligned = trainer.row_scores(token_logps, batch, labels, output=output, head=head,
                                                   vocab_size=vocab, grad=True).unbind(dim=1)
        ref = self._reference(batch, device)
        counts = (_rows(batch, labels, -100) != -100).sum(dim=1).float()  # NOTE: this rank's share of the tokens
        label_tokens = _over_context_parallel(counts)
        loss = trainer.preference_loss(logps, ref, lengths=_completion_lengths(batch, device),
                                       label_tokens=label_tokens, sft_logps=plain,
                                       pair_weights=trainer.pair_weights(aligned, label_tokens))
        stats = reward_stats(logps, ref, beta=trainer.beta)
        tokens = torch.stack([chosen_stats[0] + rejected_stats[0], counts.sum(), chosen_stats[1], counts[:rows].sum()])
        return loss, torch.ones((), dtype=torch.int64, device=device), torch.cat([stats, tokens])

    def _reference(self, batch: dict, device) -> torch.Tensor:
        if self.trainer.precompute_ref_logps:
            return torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]]).to(device, torch.float32)
        return self.reference[id(batch)]


def record_hook_step(trainer, result, micro: list[dict], append) -> None:
    """A loss-hook trainer's train metrics of one step (DPO, reward): the router balancing loss where there is one,
    ``append(metrics, values)`` for each micro-batch's hook stats, the real tokens seen (TRL's ``num_tokens``)."""
    metrics = trainer._metrics["train"]
    if result.router_aux is not None:
        metrics["aux_loss"].extend(result.router_aux)
    for values in result.hook_stats:
        append(metrics, values)
    trainer._total_train_tokens += trainer.count_step_tokens(micro, lambda b: int(b["attention_mask"].sum()),
                                                             with_padding=False)
    metrics["num_tokens"] = [trainer._total_train_tokens]


def _append_metrics(metrics: dict, values: list[float]) -> None:
    """TRL's per-micro-batch metrics from the ``_STATS`` sums of one micro-batch over the data-parallel ranks."""
    s = dict(zip(_STATS, values))
    pairs = max(s["pairs"], 1.0)
    for key in _STATS[:6]:
        metrics[key].append(s[key] / pairs)
    metrics["entropy"].append(s["entropy"] / s["tokens"] if s["tokens"] else 0.0)
    # NOTE: TRL divides the token counts in fp32
    accuracy = torch.tensor(s["top1"]) / torch.tensor(s["chosen_tokens"]) if s["chosen_tokens"] else 0.0
    metrics["mean_token_accuracy"].append(float(accuracy))


def _data_parallel_mean(value: torch.Tensor) -> float:
    """A rank's scalar averaged over the data-parallel ranks (TRL's ``gather_for_metrics(...).mean()``)."""
    from megatron.core import parallel_state as ps

    value = value.detach().double().reshape(1).clone()
    if dist.is_initialized():
        dist.all_reduce(value, group=ps.get_data_parallel_group())
        value /= ps.get_data_parallel_world_size()
    return float(value)


def _disable_residual_dropout(model) -> None:
    """megatron's residual dropout (a float on each layer, read at every forward; TRL zeroes ``nn.Dropout``)."""
    for module in model.chunks.modules():
        if isinstance(getattr(module, "hidden_dropout", None), float):
            module.hidden_dropout = 0.0


class LoongDPOTrainer(LoongTrainer, _DPOArgsSecond):
    """A drop-in ``trl.DPOTrainer`` for ``LoongModelForCausalLM`` models (``peft_config`` gives megatron LoRA)."""

    def __init__(self, model=None, ref_model=None, args=None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None) -> None:
        from transformers import GenerationConfig

        from loongforge_hf.modeling import LoongModelForCausalLM

        if not isinstance(model, LoongModelForCausalLM):
            raise TypeError("LoongDPOTrainer trains a loongforge_hf model: load it with "
                            "loongforge_hf.AutoModelForCausalLM.from_pretrained(...) "
                            f"(got {type(model).__name__}).")
        args = _as_dpo_config(args, model)
        _refuse_unsupported(args, model, ref_model, peft_config, train_dataset, processing_class,
                            optimizers=optimizers, quantization_config=quantization_config)
        if peft_config is not None:
            from transformers import set_seed

            from loongforge_hf.lora import get_peft_model

            set_seed(args.seed)  # NOTE: as TRL, before the adapters are drawn
            model = get_peft_model(model, peft_config)
        precompute = args.precompute_ref_log_probs
        if ref_model is None and peft_config is None and not precompute:
            ref_model = _load_reference(model)
        if ref_model is not None:
            # NOTE: accelerate must neither move nor wrap it (megatron owns placement), as LoongTrainer's policy
            ref_model._is_accelerate_prepared = True
        if model.generation_config is None:
            model.generation_config = GenerationConfig.from_model_config(model.config)
        vision = _is_vision_dataset(train_dataset)
        if processing_class is not None and data_collator is None:
            data_collator = _preference_collator(model, args, processing_class, vision=vision)
        # NOTE: TRL's own precompute (over accelerate's process sharding, with a hash of the model) stays off: the
        # reference log-probs are computed below, once TRL's __init__ has prepared the datasets
        # NOTE: TRL 1.16 would warn that it falls back to padding; padding-free batches are packed below (_padded)
        padding_free, args.padding_free = args.padding_free, False
        args.precompute_ref_log_probs = False
        try:
            super().__init__(model, args, ref_model=ref_model if ref_model is not None else _PolicyAsReference(model),
                             data_collator=data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset,
                             processing_class=processing_class, compute_metrics=compute_metrics,
                             callbacks=callbacks, optimizers=optimizers, peft_config=None)
        finally:
            args.precompute_ref_log_probs, args.padding_free = precompute, padding_free
        if padding_free and vision:
            logger.warning("padding_free=True with an image dataset: batches are padded, as TRL 1.16 pads them.")
        self.precompute_ref_logps, self.padding_free = precompute, padding_free and not vision
        self.preference_loss = DPOLoss.from_args(args)
        self.row_scores = RowScores(ld_alpha=args.ld_alpha, wpo=args.use_weighting)
        if isinstance(self.ref_model, _PolicyAsReference):
            self.ref_model = None
        self._router_balance()  # NOTE: a model or layout that cannot compute the MoE balancing loss raises here
        for m in (self.model, self.ref_model):
            if m is not None:
                vars(m).pop("forward", None)  # NOTE: TRL's fused-LM-head patch (see the module docstring)
                if args.disable_dropout:
                    _disable_residual_dropout(m)
        if self.ref_model is not None:
            self.ref_model.requires_grad_(False)
        self.data_collator = self._padded(self.data_collator)
        if precompute:
            self.train_dataset = self._with_reference_logps(self.train_dataset, args.per_device_train_batch_size)
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {k: self._with_reference_logps(v, args.per_device_eval_batch_size)
                                     for k, v in self.eval_dataset.items()}
            elif self.eval_dataset is not None:
                self.eval_dataset = self._with_reference_logps(self.eval_dataset, args.per_device_eval_batch_size)

    def _refuse_unsupported(self) -> None:
        """LoongTrainer's checks, but for ``use_liger_kernel``, which TRL 1.16's DPO takes (module docstring)."""
        with _without_liger(self.args):
            super()._refuse_unsupported()

    def train(self, *args, **kwargs):
        with _without_liger(self.args):  # NOTE: Trainer.train would patch a transformers model with Liger's kernels
            return super().train(*args, **kwargs)

    # ---- data --------------------------------------------------------------------------------------------------
    def _dataset_tokenized_by_collator(self) -> bool:
        return True  # NOTE: TRL's prompt / chosen / rejected ids: its collator builds input_ids

    def _padded(self, collator):
        if isinstance(collator, _PreferenceBatches):
            return collator
        layout = self.model.parallel
        multiple = layout.sequence_multiple
        if layout.pipeline_parallel_size > 1:
            multiple = math.lcm(multiple, self.args.max_length)
        return _PreferenceBatches(collator, multiple=multiple, pad_id=self._tokenizer.pad_token_id,
                                  packed=self.padding_free)

    def _with_reference_logps(self, dataset, batch_size: int):
        """``dataset`` with TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns (every rank computes all)."""
        from torch.utils.data import DataLoader

        if not hasattr(dataset, "add_column"):
            raise ValueError("precompute_ref_log_probs=True needs a map-style datasets.Dataset.")
        batch_size = self.args.precompute_ref_batch_size or batch_size
        columns = [c for c in dataset.column_names if c in ("prompt_ids", "chosen_ids", "rejected_ids")]
        loader = DataLoader(dataset.select_columns(columns), batch_size=batch_size, collate_fn=self.data_collator,
                            shuffle=False)
        chosen, rejected = [], []
        for batch in loader:
            logps = self.reference_logps([batch], everywhere=True)[0].cpu()
            c, r = logps.chunk(2)
            chosen.append(c)
            rejected.append(r)
        dataset = dataset.add_column("ref_chosen_logps", torch.cat(chosen).tolist())
        return dataset.add_column("ref_rejected_logps", torch.cat(rejected).tolist())

    # ---- reference -------------------------------------------------------------------------------------------------
    def reference_logps(self, micro_batches: list[dict], *, everywhere: bool) -> list[torch.Tensor | None]:
        """The reference's per-row completion log-probs of ``micro_batches`` (LD-DPO's with ``ld_alpha``; see
        ``sequence_scores``)."""
        scores = RowScores(ld_alpha=self.row_scores.ld_alpha)
        model = self.ref_model if self.ref_model is not None else self.model
        adapters = getattr(self.model, "disable_adapter", None) if self.ref_model is None else None
        with adapters() if adapters is not None else nullcontext():
            found = sequence_scores(model, micro_batches, everywhere=everywhere, scores=scores)
        return [v[:, 0] if v is not None else None for v in found]

    def pair_weights(self, aligned: torch.Tensor, label_tokens: torch.Tensor) -> torch.Tensor | None:
        """WPO's per-pair weights (``use_weighting``), else None (``dpo_losses.wpo_weights``)."""
        return wpo_weights(aligned, label_tokens) if self.row_scores.wpo else None

    # ---- training --------------------------------------------------------------------------------------------------
    @property
    def _router_aux_coef(self) -> float:
        """TRL's weight of the MoE router balancing loss: its ``router_aux_loss_coef`` where it turned it on, else 0
        (whatever ``output_router_logits`` the model config holds: TRL asks the policy's forwards for it)."""
        return self.router_aux_loss_coef if self.aux_loss_enabled else 0.0

    def _router_balance(self):
        """(the policy's ``RouterBalance``, coefficient) while TRL adds the balancing loss, else None; raises where
        the model or layout cannot compute it (``router_balance.check_layout``)."""
        from loongforge_hf.bridges import router_balance

        return router_balance.requested(self.model, self._router_aux_coef)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.engine.loss_hook = _PreferenceLoss(self)
        # NOTE: TRL adds coef * aux_loss to each micro-batch's loss before Trainer divides it by the accumulation
        # steps, and DDP averages over the ranks
        self.engine.router_aux_reduction = "mean"
        self.engine.router_aux_coef = self._router_aux_coef
        return optimizer

    def _record_step(self, result, micro: list[dict]) -> None:
        record_hook_step(self, result, micro, _append_metrics)

    def _save_checkpoint(self, model, trial) -> None:
        from loongforge_hf.integrations.trl import save_checkpoint_with_model_card

        save_checkpoint_with_model_card(self, model, trial)

    # ---- evaluation ------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Evaluation's DPO loss of a batch (this rank's mean over its pairs; training runs in the engine), with TRL's
        reward metrics over the data-parallel ranks."""
        from megatron.core import parallel_state as ps

        routed = self._router_balance()
        if routed is not None:  # NOTE: TRL's policy forward adds coef * aux_loss in evaluation too
            shape = tuple(inputs["input_ids"].shape)
            tally = routed[0].begin(inputs.get("attention_mask"), shape, length=shape[1], device=self.model.device)
        logps, plain, aligned = sequence_scores(self.model, [inputs], scores=self.row_scores)[0].unbind(dim=1)
        aux = routed[0].finish_everywhere(tally) if routed is not None else None
        if self.precompute_ref_logps:
            ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).to(logps)
        else:
            ref = self.reference_logps([inputs], everywhere=True)[0]
        label_tokens = (_shifted(inputs, logps.device) != -100).sum(dim=1).float()
        loss = self.preference_loss(logps, ref, lengths=_completion_lengths(inputs, logps.device),
                                    label_tokens=label_tokens, sft_logps=plain,
                                    pair_weights=self.pair_weights(aligned, label_tokens))
        if aux is not None:
            loss = loss + routed[1] * aux
        # NOTE: no entropy / token accuracy in evaluation (the forward-only pass keeps the log-probs only)
        values = reward_stats(logps, ref, beta=self.beta).double()
        if dist.is_initialized():
            dist.all_reduce(values, group=ps.get_data_parallel_group())
        s = dict(zip(_STATS, values.tolist()))
        for key in _STATS[:6]:
            self._metrics["eval"][key].append(s[key] / max(s["pairs"], 1.0))
        if aux is not None:
            self._metrics["eval"]["aux_loss"].append(_data_parallel_mean(aux))
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss only (TRL's logits for ``compute_metrics`` would need the full-vocabulary forward), after an
        image batch's image tokens are checked on every rank (``LoongTrainer._check_evaluation_batch``)."""
        self._check_evaluation_batch(inputs)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


@contextmanager
def _without_liger(args):
    """``args.use_liger_kernel`` False inside (as given again after)."""
    given, args.use_liger_kernel = args.use_liger_kernel, False
    try:
        yield
    finally:
        args.use_liger_kernel = given


def _load_reference(model):
    """TRL's default reference: the policy's checkpoint loaded again (here with the policy's layout and dtype)."""
    from loongforge_hf.modeling import AutoModelForCausalLM
    from loongforge_hf.multimodal.modeling import AutoModelForImageTextToText

    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not path:
        raise ValueError("LoongDPOTrainer: the policy has no name_or_path to load the reference model from; pass "
                         "ref_model=loongforge_hf.AutoModelForCausalLM.from_pretrained(..., same layout).")
    tower = _vision_layout(model)
    if tower is None:
        return AutoModelForCausalLM.from_pretrained(path, parallel=model.parallel, dtype=model.dtype)
    # NOTE: the policy's vision tower layout too (vision_tensor_parallel_size / vision_data_parallel)
    return AutoModelForImageTextToText.from_pretrained(
        path, parallel=model.parallel, dtype=model.dtype, vision_data_parallel=tower == "data_parallel",
        vision_tensor_parallel_size=model.parallel.tensor_parallel_size if tower == "tensor_parallel" else 1)


def _preference_collator(model, args: DPOConfig, processing_class, *, vision: bool):
    """TRL's ``DataCollatorForPreference`` (``DataCollatorForVisionPreference`` for an image dataset: the processor
    applied batch by batch, each prompt's images given to its chosen and its rejected row) as its ``__init__`` builds
    it (pad token: ``args.pad_token``, else the tokenizer's, else its EOS, set on the tokenizer and the model's
    configs)."""
    from transformers import ProcessorMixin
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DataCollatorForVisionPreference

    tokenizer = processing_class.tokenizer if isinstance(processing_class, ProcessorMixin) else processing_class
    pad_token = args.pad_token or tokenizer.pad_token or tokenizer.eos_token
    if pad_token not in tokenizer.get_vocab():
        raise ValueError(f"The specified `pad_token` ({pad_token!r}) is not in the vocabulary of the "
                         f"processing_class ({type(tokenizer).__name__}).")
    tokenizer.pad_token = pad_token
    if vision:
        return DataCollatorForVisionPreference(processor=processing_class, max_length=args.max_length)
    return DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=args.max_length,
                                     truncation_mode=args.truncation_mode, pad_to_multiple_of=args.pad_to_multiple_of)
