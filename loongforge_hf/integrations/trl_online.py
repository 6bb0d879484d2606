"""What ``LoongGRPOTrainer`` and ``LoongRLOOTrainer`` share: TRL's online trainers (generate, score, train on the
completions) around LoongTrainer's megatron engine.

Choices:
- ``OnlineEngineMixin`` comes first in the trainers' MRO (``LoongXTrainer(OnlineEngineMixin, LoongTrainer,
  trl.XTrainer)``): TRL's ``_prepare_inputs`` / ``_generate_and_score_completions`` / ``log`` run as they are; the
  mixin replaces what touches the model or the processes. A trainer adds its loss (``_loss_and_stats``: the
  micro-batch's loss and its summed statistics, from the policy's per-token log-probs) and how it logs those
  statistics (``_log_stats``).
- Generation is TRL's own transformers path calling the policy's ``generate`` (``generation.py``); every rank of a
  replica samples what its first rank's generator gives, and takes that generator afterwards
  (``_generate_single_turn``), so that TRL's shuffle of a generation batch orders the rows alike on each.
- Each optimizer step runs TRL's ``_prepare_inputs`` on each of the step's generation batches (as TRL's
  ``training_step`` would) and turns each result into an engine micro-batch (``engine_batch``: prompt then
  completion ids, the completion tokens as labels, padded to ``ParallelConfig.sequence_multiple``, under pipeline
  parallelism to the step's longest; TRL's tensors ride along under "trl"); one ``MegatronEngine.train_step`` whose
  ``loss_hook`` (``PolicyLossHook``) computes the per-token log-probs of the completion from the fused,
  vocab-parallel head (``token_logps``: logits times ``1 / temperature`` as TRL's fused head divides them; no
  full-vocabulary logits, no gather over TP), then the trainer's loss. The old and reference log-probs TRL asks for
  (``_get_per_token_logps_and_entropies``, no grad) come from the same head over megatron's forward-only schedule
  (``completion_logps``; broadcast from the last pipeline stage). A model whose transformers class counts positions
  from the attention mask (OPT) gets them so in both (``absolute_positions.with_mask_positions``; the step's in
  LoongTrainer's batch checks).
- Virtual pipeline stages: the step runs megatron's interleaved schedule (``gradient_accumulation_steps`` a multiple
  of ``pipeline_parallel_size``, refused otherwise); a no-grad forward of one batch (old, reference, evaluation
  log-probs) goes through the virtual stages in order (``runtime._interleaved_forward_once``, as the DPO trainer's).
- Context parallelism: each rank scores its load-balanced share of every row's tokens and the per-token log-probs
  are put together over the CP group (``whole_rows``; differentiable for the policy's), so every CP rank computes
  the micro-batch's whole loss and counts 1 (the engine divides by CP times more counts; the backward gives each
  share CP times its gradient). The entropy sum of the statistics is each rank's own tokens'; the trainer's
  statistics are the first CP rank's (the engine sums over CP too).
- TRL gathers over every process; the ranks of one model replica (tensor x context x pipeline) hold the same rows,
  so while ``_prepare_inputs`` runs, the trainer's accelerator gathers, reduces and counts processes over the
  data-parallel group (``_OverDataParallel``), and so does the module-level ``gather`` TRL's trainer module
  imported from accelerate (rewards, RLOO's sequence KL). ``generation_batch_size`` is ``per_device_train_batch_size
  x data-parallel ranks x steps_per_generation`` (TRL's config counts every process).
- Evaluation (``eval_dataset``): TRL's loop (its eval sampler, ``prediction_step``: generation, rewards and the loss
  in eval mode); the loss's per-token log-probs and entropy sum from ``completion_logps`` (forward only), the
  statistics summed over the data-parallel ranks into TRL's ``eval`` metrics. With the MoE router balancing loss
  that forward tallies it too (``bridges/router_balance.py``, over the prompt and completion tokens' attention
  mask): TRL adds ``coef * aux_loss`` to the evaluation loss (no accumulation) and logs ``eval_aux_loss``, the
  data-parallel ranks' mean.
- The reference (``beta != 0``): the policy's checkpoint loaded again with its layout and dtype (TRL loads it from
  the policy's name; an image-text model's with its vision tower layout, the random draws of building the tower kept
  off the seeded stream, as TRL's load draws none), or with ``peft_config`` (megatron LoRA) the policy with its
  adapters disabled.
- Image-text models (vision GRPO / RLOO: an image-text model from ``AutoModelForImageTextToText``, its processor as
  ``processing_class``, an ``image`` / ``images`` column of conversational prompts): TRL attaches each prompt's images
  to its messages (repeated with the prompt for each generation by its sampler), tokenises them with the processor
  and generates with them (the policy's ``generate``, images at the prefill); its prepared batches carry the image
  inputs (``pixel_values``, ``image_grid_thw``, ``num_images``, token types, ...), which go into the engine
  micro-batch (``engine_batch``: as they are, the token types padded with 0) and the no-grad forwards
  (``completion_logps``, TRL's rows sliced per image / patch / tile as its own: ``vision_rows``), both through the
  model's own chunk inputs (``dpo_scores._model_inputs``: ``megatron_forward_inputs``, 3-D rope positions). Every
  layout the image-text model trains at (TP with SP, PP, VPP, CP, DP). TRL 1.16 truncates no prompt (no
  ``max_prompt_length``), so the image tokens stay whole.
- Refused with a message, on every rank before any collective (``refusals``): vLLM, Liger, continuous batching,
  ``sync_ref_model``, an image dataset or a processor with a text model, an image dataset with a tokenizer
  (``vision_problems``), ``gradient_accumulation_steps`` not a multiple of
  ``pipeline_parallel_size`` under virtual pipeline stages, ``log_completions`` under model
  parallelism (TRL's completion table gathers every process), a non-LoRA ``peft_config``, custom ``optimizers``,
  ``quantization_config``; each trainer adds its own.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from loongforge_hf.integrations.dpo_scores import _model_inputs
from loongforge_hf.integrations.trl_dpo import _disable_residual_dropout
from loongforge_hf.kernels._saved import training_numerics
from loongforge_hf.trainer.data import dp_rank_and_size
from loongforge_hf.trainer.engine import micro_batch_group

# TRL fields every online trainer refuses when set: (field, its default, why)
REFUSED_FIELDS = (("use_vllm", False, " (generation runs the policy's own generate)"), ("use_liger_kernel", False, ""),
                  ("use_transformers_continuous_batching", False, ""), ("sync_ref_model", False, ""),
                  ("cast_lm_head_to_fp32", False, ""))
# TRL's image inputs of a prepared batch (its forward keywords, per image, patch or tile) and its per-token types
VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                 "image_position_ids")
TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")
# the image bookkeeping TRL keeps beside them (images and tiles per row)
IMAGE_COUNTS = ("num_images", "num_tiles")


def refusals(args, model, peft_config, train_dataset, processing_class, *, fields=(), **given) -> list[str]:
    """What an online trainer does not support, the same on every rank: ``fields`` adds (field, default, why)."""
    why = {"optimizers": " (the megatron engine owns the optimizer)"}
    problems = [k + why.get(k, "") for k, v in given.items() if v is not None and v != (None, None)]
    for field, default, reason in REFUSED_FIELDS + tuple(fields):
        if getattr(args, field, default) != default:
            problems.append(f"{field}={getattr(args, field)!r}{reason}")
    problems += vision_problems(model, train_dataset, processing_class)
    if peft_config is not None and type(peft_config).__name__ != "LoraConfig":
        problems.append(f"peft_config of type {type(peft_config).__name__} (LoRA only)")
    layout = model.parallel
    if args.gradient_accumulation_steps % micro_batch_group(layout):
        problems.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps} with virtual pipeline stages "
                        "(megatron's interleaved schedule needs a multiple of "
                        f"pipeline_parallel_size={layout.pipeline_parallel_size})")
    replica = layout.tensor_parallel_size * layout.pipeline_parallel_size * layout.context_parallel_size
    if args.log_completions and replica > 1:
        problems.append("log_completions=True with tensor / pipeline / context parallelism (TRL's table gathers "
                        "every process)")
    return problems


def vision_problems(model, train_dataset, processing_class) -> list[str]:
    """What an image dataset (an ``image`` / ``images`` column, as TRL tells it) or a processor does not train with:
    a text model, or a tokenizer for the images."""
    from transformers import ProcessorMixin

    sample = next(iter(train_dataset)) if train_dataset is not None else {}
    images, processor = "image" in sample or "images" in sample, isinstance(processing_class, ProcessorMixin)
    tower = getattr(model, "vision_layout", None)
    problems = []
    if (images or processor) and tower is None:
        problems.append(f"{'an image dataset' if images else 'a processor'} with the text model "
                        f"{type(model).__name__} (load an image-text model with "
                        "loongforge_hf.AutoModelForImageTextToText.from_pretrained)")
    if images and processing_class is not None and not processor:
        problems.append(f"an image dataset with processing_class of type {type(processing_class).__name__} (pass "
                        "the model's processor)")
    if tower is not None and getattr(model.bridge, "takes_pixel_mask", False):
        problems.append(f"{model.bridge.architectures[0]} (its processor's pixel_mask, which marks each tile's "
                        "picture, is not sliced per row by the online trainers: vision_rows)")
    return problems


def vision_rows(vision: dict, start: int, end: int) -> dict:
    """TRL's image inputs of rows ``start:end`` (its ``_get_per_token_logps_and_entropies``' slicing): per-row
    tensors by row, per-image ones by ``num_images``, Qwen's patches by ``image_grid_thw``, tiles by ``num_tiles``."""
    get, out = vision.get, {}
    pixels, grid = get("pixel_values"), get("image_grid_thw")
    images, tiles = _spans(get("num_images"), start, end), _spans(get("num_tiles"), start, end)
    if pixels is not None and grid is not None:
        patches = [int(s.sum()) for s in torch.split(grid.prod(dim=-1), list(get("num_images")))]
        out.update(pixel_values=pixels[_spans(patches, start, end)], image_grid_thw=grid[images])
    elif pixels is not None and get("image_position_ids") is not None:
        out.update(pixel_values=pixels[images], image_position_ids=get("image_position_ids")[images])
    elif pixels is not None and get("spatial_shapes") is not None:
        out.update({k: get(k)[tiles] for k in ("pixel_values", "pixel_attention_mask", "spatial_shapes")})
    elif pixels is not None and tiles is not None:
        out["pixel_values"] = pixels[tiles]
    elif pixels is not None and images is not None and pixels.shape[0] == sum(get("num_images")):
        out["pixel_values"] = pixels[images]
    elif pixels is not None:
        out["pixel_values"] = pixels[start:end]
    if get("pixel_attention_mask") is not None and get("spatial_shapes") is None:
        out["pixel_attention_mask"] = get("pixel_attention_mask")[start:end]
    if get("image_sizes") is not None:
        out["image_sizes"] = get("image_sizes")[images]
    out.update({k: get(k)[start:end] for k in TOKEN_TYPES if get(k) is not None})
    return out


def _spans(counts, start: int, end: int) -> slice | None:
    """The items of rows ``start:end`` given each row's count (None without counts)."""
    if counts is None:
        return None
    bounds = [0, *torch.tensor(list(counts)).cumsum(0).tolist()]
    return slice(bounds[start], bounds[end])


def check_policy(model, trainer: str) -> None:
    from loongforge_hf.modeling import LoongModelForCausalLM

    if not isinstance(model, LoongModelForCausalLM):
        raise TypeError(f"{trainer} trains a loongforge_hf model: load it with "
                        "loongforge_hf.AutoModelForCausalLM.from_pretrained(...) "
                        f"(got {type(model).__name__}).")


def checked_args(args, model, config_class, suffix: str):
    """``args``, or TRL's default ``config_class("{model name}-{suffix}")`` where None; a TypeError for another
    type."""
    if args is None:
        name = (getattr(model.config, "_name_or_path", "") or "model").rstrip("/").split("/")[-1]
        return config_class(f"{name}-{suffix}")
    if not isinstance(args, config_class):
        raise TypeError(f"args must be a trl.{config_class.__name__} (or loongforge_hf.Loong{config_class.__name__}), "
                        f"got {type(args).__name__}.")
    return args


def checked_setup(model, args, peft_config, train_dataset, processing_class, *, name: str, config_class, **given):
    """The start of ``Loong{name}Trainer.__init__``, on every rank before any collective: the policy's type, the
    config (``checked_args``), ``refusals`` raised together; then (the prepared policy, the config)."""
    trainer = f"Loong{name}Trainer"
    check_policy(model, trainer)
    args = checked_args(args, model, config_class, name)
    problems = refusals(args, model, peft_config, train_dataset, processing_class, **given)
    if problems:
        raise ValueError(f"{trainer} does not support: " + "; ".join(problems) + ".")
    return prepare_policy(model, args, peft_config), args


def prepare_policy(model, args, peft_config):
    """The policy as TRL's ``__init__`` is to see it: megatron LoRA adapters drawn after ``set_seed`` (as TRL draws
    PEFT's), a generation config."""
    from transformers import GenerationConfig, set_seed

    if peft_config is not None:
        from loongforge_hf.lora import get_peft_model

        set_seed(args.seed)  # NOTE: as TRL, before the adapters are drawn
        model = get_peft_model(model, peft_config)
    if model.generation_config is None:
        model.generation_config = GenerationConfig.from_model_config(model.config)
    return model


@contextlib.contextmanager
def no_reference(args):
    """``args.beta`` is 0 inside (TRL would load a transformers reference model); yields the real one."""
    beta, args.beta = args.beta, 0.0
    try:
        yield beta
    finally:
        args.beta = beta


class _AdaptersDisabled:
    """The reference while it is the LoRA policy with its adapters disabled (what TRL is handed as ``ref_model``,
    so that it asks for reference log-probs through ``_get_per_token_logps_and_entropies``)."""

    def __init__(self, policy) -> None:
        self.policy = policy


def token_logps(output: torch.Tensor, labels: torch.Tensor, head, *, vocab_size: int, temperature: float,
                stats: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[b, s]`` log-probabilities of the (shifted) label tokens at ``temperature`` (0 elsewhere) from the final
    hidden states through ``head``'s fused vocab-parallel output layer; ``stats`` gets the entropy and top-1 sums."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.runtime import IGNORE_INDEX, output_bias, output_low_rank, output_weight
    from loongforge_hf.kernels.cross_entropy import linear_cross_entropy

    if head is None:
        raise ValueError("The online trainers need the engine's fused loss (the language head's final hidden states).")
    scale = getattr(head, "logit_scale", None)
    if temperature != 1.0:
        scale = (1.0 if scale is None else scale) / temperature
    hidden = output.reshape(-1, output.shape[-1])
    losses = linear_cross_entropy(hidden, output_weight(head), labels.reshape(-1),
                                  ignore_index=IGNORE_INDEX, tp_group=ps.get_tensor_model_parallel_group(),
                                  vocab_size=vocab_size, reduction="none", token_stats=stats,
                                  softcap=getattr(head, "logit_softcap", None), logit_scale=scale,
                                  bias=output_bias(head), low_rank=output_low_rank(head, hidden))
    return -losses.view(labels.shape)


def engine_batch(inputs: dict, *, multiple: int, pad_id: int, length: int = 0) -> dict:
    """An engine micro-batch from TRL's prepared inputs: prompt (left-padded) then completion (right-padded) ids,
    the completion tokens as labels, right-padded to ``multiple`` (and to ``length`` at least), an image batch's
    inputs as they are (its token types padded with 0); TRL's tensors under "trl"."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    prompt = inputs["prompt_ids"].shape[1]
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    extra = -(-max(ids.shape[1], length) // multiple) * multiple - ids.shape[1]
    types = {k: inputs[k] for k in TOKEN_TYPES if inputs.get(k) is not None}
    if extra:
        ids, mask, labels = (torch.cat([t, t.new_full((t.shape[0], extra), v)], dim=1)
                             for t, v in ((ids, pad_id), (mask, 0), (labels, -100)))
        types = {k: torch.cat([t, t.new_zeros(t.shape[0], extra)], dim=1) for k, t in types.items()}
    images = {k: inputs[k] for k in VISION_INPUTS if inputs.get(k) is not None}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, **images, **types, "trl": inputs,
            "prompt_length": prompt}


def whole_rows(local: torch.Tensor, *, grad: bool = False) -> torch.Tensor:
    """``[b, s / CP]`` values of this context-parallel rank's tokens -> ``[b, s]`` (every rank's, summed over the CP
    group; unchanged without CP). With ``grad``, differentiable: the backward sums the group's gradients, so each
    rank's tokens get CP times their gradient (each CP rank computes the whole loss and counts 1, see the engine)."""
    from loongforge_hf.parallel.context_parallel import cp_group_and_size, cp_token_index

    group, size, rank = cp_group_and_size()
    if size == 1:
        return local
    seq = local.shape[1] * size
    index = cp_token_index(seq, size, rank, device=local.device)
    whole = local.new_zeros(local.shape[0], seq).index_copy(1, index, local)
    if grad:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(whole, group=group)
    dist.all_reduce(whole, group=group)
    return whole


@training_numerics()
@torch.no_grad()
def completion_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int,
                     batch_size: int, temperature: float, entropy: bool = False, balance=None,
                     vision: dict | None = None):
    """TRL's ``_get_per_token_logps_and_entropies`` log-probs (``[rows, logits_to_keep]``, fp32, on every rank) under
    ``model`` (a ``LoongModelForCausalLM``), ``batch_size`` rows per forward of megatron's forward-only schedule
    (broadcast from the last pipeline stage); ``vision``: TRL's image inputs of the rows (``vision_rows``). With
    ``entropy`` or ``balance`` (the model's ``RouterBalance``): ``(logps, the entropy sum over the completion tokens
    or None, transformers' router balancing loss or None)``, the loss each forward's over its rows' attention mask,
    averaged over the forwards (TRL's ``compute_aux_loss``), on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from loongforge_hf.bridges.absolute_positions import with_mask_positions
    from loongforge_hf.bridges.output_layer import hidden_states_out, language_head
    from loongforge_hf.parallel.context_parallel import cp_group_and_size

    chunks = list(model.chunks)
    prompt = input_ids.shape[1] - logits_to_keep
    found = []

    def score(output, labels, head):
        stats = torch.zeros(2, dtype=torch.float32, device=output.device)
        logps = token_logps(output, labels, head, vocab_size=model.config.vocab_size, temperature=temperature,
                            stats=stats)
        group, cp, _ = cp_group_and_size()
        if cp > 1:
            dist.all_reduce(stats, group=group)
        logps = whole_rows(logps)[:, prompt - 1:prompt - 1 + logits_to_keep]
        found.append(torch.cat([logps, stats[:1].expand(logps.shape[0], 1)], dim=1).contiguous())
        return None, None

    def forward_step(data_iterator, chunk):
        args, inputs, labels = _model_inputs(model, next(data_iterator), model.device)
        head = language_head(chunk)
        with hidden_states_out([chunk]) if head is not None else contextlib.nullcontext():
            output = chunk(*args, **inputs)

        def loss_func(output):
            score(output, labels, head)
            return output.sum() * 0.0, {}
        return output, loss_func

    was_training = model.training
    model.eval()
    out, aux = [], []
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            batch = engine_batch({"prompt_ids": ids[:, :prompt], "completion_ids": ids[:, prompt:],
                                  "prompt_mask": mask[:, :prompt], "completion_mask": mask[:, prompt:],
                                  **vision_rows(vision or {}, start, start + ids.shape[0])},
                                 multiple=model.parallel.sequence_multiple, pad_id=0)
            with_mask_positions(getattr(model, "bridge", None), batch)  # NOTE: OPT's, from the left-padded mask
            if balance is not None:  # NOTE: the layout's pads weigh 0, as transformers' mask counts the rows
                tally = balance.begin(mask, tuple(ids.shape), length=batch["input_ids"].shape[1],
                                      device=model.device)
            if len(chunks) > 1:
                _through_virtual_stages(model, chunks, batch, score)
            else:
                get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]),
                                            model=chunks[0], num_microbatches=1,
                                            seq_length=batch["input_ids"].shape[1], micro_batch_size=ids.shape[0],
                                            forward_only=True)
            if balance is not None:
                aux.append(balance.finish_everywhere(tally))
                balance.end()
            if model.parallel.pipeline_parallel_size == 1:
                out.append(found.pop())
                continue
            group = ps.get_pipeline_model_parallel_group()
            rows = found.pop() if ps.is_pipeline_last_stage(ignore_virtual=True) else \
                torch.empty(ids.shape[0], logits_to_keep + 1, dtype=torch.float32, device=model.device)
            dist.broadcast(rows, src=dist.get_process_group_ranks(group)[-1], group=group)
            out.append(rows)
    finally:
        model.train(was_training)
    # NOTE: each forward's entropy sum rides in a last column (one value per row of that forward)
    rows = torch.cat(out)
    logps = rows[:, :-1]
    if not entropy and balance is None:
        return logps
    sums = torch.stack([part[0, -1] for part in out]).sum() if entropy else None
    return logps, sums, torch.stack(aux).mean() if balance is not None else None


def _through_virtual_stages(model, chunks: list, batch: dict, score) -> None:
    """One batch through the virtual pipeline stages in order (megatron's interleaved schedule needs whole groups of
    ``pipeline_parallel_size`` micro-batches); ``score(output, labels, head)`` on the last one."""
    from loongforge_hf.bridges.output_layer import hidden_states_out, language_head
    from loongforge_hf.bridges.runtime import _interleaved_forward_once

    args, inputs, labels = _model_inputs(model, batch, model.device)
    head = language_head(chunks[-1])
    chunks = model.bound_chunks(inputs).chunks if inputs else chunks
    with hidden_states_out(chunks):
        _interleaved_forward_once(model, chunks, *args, lambda output: score(output, labels, head), {},
                                  seq=batch["input_ids"].shape[1])


class _OverDataParallel:
    """Trainer's Accelerator with its gathers, reductions and process index over the data-parallel group."""

    def __init__(self, accelerator) -> None:
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def process_index(self) -> int:
        return dp_rank_and_size()[0]

    @property
    def num_processes(self) -> int:
        return dp_rank_and_size()[1]

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return gather_over_data_parallel(tensor)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        tensor = tensor.clone()
        if dp_rank_and_size()[1] > 1:
            dist.all_reduce(tensor, group=ps.get_data_parallel_group())
        return tensor / dp_rank_and_size()[1] if reduction == "mean" else tensor


def gather_over_data_parallel(tensor: torch.Tensor) -> torch.Tensor:
    """accelerate's ``gather`` (equal shapes, concatenated in rank order) over the data-parallel group."""
    from megatron.core import parallel_state as ps

    tensor = tensor.contiguous()
    tensor = tensor[None] if tensor.dim() == 0 else tensor
    if dp_rank_and_size()[1] == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dp_rank_and_size()[1])]
    dist.all_gather(parts, tensor, group=ps.get_data_parallel_group())
    return torch.cat(parts)


class PolicyLossHook:
    """``MegatronEngine.loss_hook``: the trainer's loss of each micro-batch (see the module docstring). Its stats:
    this rank's entropy sum over the completion tokens, then the trainer's ``num_loss_stats`` (the first CP rank's)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.num_stats = 1 + trainer.num_loss_stats

    def start_step(self, micro_batches: list[dict]) -> None:
        self.steps = len(micro_batches)

    def __call__(self, output, batch: dict, *, labels: torch.Tensor, head):
        from loongforge_hf.parallel.context_parallel import cp_group_and_size

        trainer, inputs = self.trainer, batch["trl"]
        entropy = torch.zeros(2, dtype=torch.float32, device=output.device)
        prompt, length = batch["prompt_length"], inputs["completion_ids"].shape[1]
        logps = token_logps(output, labels, head, vocab_size=trainer.model.config.vocab_size,
                            temperature=trainer.temperature, stats=entropy)
        logps = whole_rows(logps, grad=True)[:, prompt - 1:prompt - 1 + length]
        loss, stats = trainer._loss_and_stats(logps, inputs, accumulation_steps=self.steps, evaluation=False)
        if cp_group_and_size()[2] != 0:  # NOTE: counted once per context-parallel group
            stats = torch.zeros_like(stats)
        return loss, torch.ones((), dtype=torch.int64, device=output.device), torch.cat([entropy[:1], stats])


def rank_slots(values: list[float], device) -> torch.Tensor:
    """``values`` in this data-parallel rank's slot of a zero vector with one such slot per rank (summed over the
    ranks, each rank's values stand side by side)."""
    rank, ranks = dp_rank_and_size()
    slots = torch.zeros(len(values) * ranks, dtype=torch.float32, device=device)
    slots[len(values) * rank:len(values) * (rank + 1)] = torch.tensor(values, dtype=torch.float32)
    return slots


class OnlineEngineMixin:
    """The online trainers' shared overrides (see the module docstring); before LoongTrainer in the MRO."""

    num_loss_stats: int  # NOTE: the length of ``_loss_and_stats``'s stats

    def _loss_and_stats(self, logps: torch.Tensor, inputs: dict, *, accumulation_steps: int, evaluation: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's loss to backpropagate or, in evaluation, TRL's evaluation loss, ``num_loss_stats``
        fp32 values the data-parallel ranks sum) from the policy's per-token log-probs of the completion."""
        raise NotImplementedError

    def _log_stats(self, mode: str, values: list[float]) -> None:
        """TRL's metrics of one micro-batch into ``self._metrics[mode]`` from its summed stats (entropy sum first)."""
        raise NotImplementedError

    def _checks_evaluation_batches(self) -> bool:
        return False  # NOTE: prompt rows: the processor builds the model inputs whole after generation

    def _finish_setup(self, *, beta: float, peft_config) -> None:
        """After TRL's ``__init__`` (run with ``beta`` 0): seeds, batch sizes, dropout and the reference."""
        from transformers import set_seed

        args = self.args
        self.beta = beta
        rank, ranks = dp_rank_and_size()
        # NOTE: TRL seeds each process apart (seed + process index); the ranks of one replica must draw alike
        # (generate samples from its first rank's generator; TRL's shuffle of a generation batch draws on each)
        set_seed(args.seed + rank)
        args.generation_batch_size = args.per_device_train_batch_size * ranks * args.steps_per_generation
        vars(self.model).pop("forward", None)  # NOTE: TRL's fused-LM-head patch (nothing here calls it)
        if args.disable_dropout:
            _disable_residual_dropout(self.model)
        if beta != 0.0:
            self.ref_model = _AdaptersDisabled(self.model) if peft_config is not None else self._load_reference()
        self._router_balance()  # NOTE: a model or layout that cannot compute the MoE balancing loss raises here

    def _load_reference(self):
        from loongforge_hf.integrations.trl_dpo import _load_reference

        ref = _load_reference(self.model)
        ref.requires_grad_(False)
        if self.args.disable_dropout:
            _disable_residual_dropout(ref)
        return ref

    # ---- data --------------------------------------------------------------------------------------------------
    def _dataset_tokenized_by_collator(self) -> bool:
        return True  # NOTE: TRL's prompts: generation tokenises them

    def _whole_interleaved_groups(self, micro: list) -> list[dict]:
        # NOTE: the step's generation batches -> TRL's prepared inputs (generating where TRL generates) -> engine
        # micro-batches; nothing is left out (TRL's sampler gives whole generation windows; a count the interleaved
        # schedule cannot take is refused by the engine, by name)
        self.model.train()
        prepared = []
        for generation_batch in micro:
            prepared.append(self._prepare_inputs(generation_batch))
            self._step += 1
        # NOTE: megatron's pipeline schedule takes one sequence length for every micro-batch of a step
        length = max(p["prompt_ids"].shape[1] + p["completion_ids"].shape[1] for p in prepared) \
            if self.model.parallel.pipeline_parallel_size > 1 else 0
        return [engine_batch(p, multiple=self.model.parallel.sequence_multiple, pad_id=self._tokenizer.pad_token_id,
                             length=length) for p in prepared]

    def _prepare_inputs(self, generation_batch):
        with self._over_data_parallel():
            return super()._prepare_inputs(generation_batch)

    @contextlib.contextmanager
    def _over_data_parallel(self):
        # NOTE: TRL's trainer module gathers rewards (and RLOO its sequence KL) with accelerate's module-level
        # gather, over every process: over the data-parallel group here, for this call only
        trl_module = next(sys.modules[c.__module__] for c in type(self).__mro__
                          if c.__module__.startswith("trl.trainer."))
        accelerator, world_gather = self.accelerator, trl_module.gather
        self.accelerator, trl_module.gather = _OverDataParallel(accelerator), gather_over_data_parallel
        try:
            yield
        finally:
            self.accelerator, trl_module.gather = accelerator, world_gather

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's generation, then the replica's ranks (tensor x context x pipeline) take its first rank's CPU
        generator (generate drew from it there only, on CPU), so that TRL's shuffle of the generation batch orders
        the rows alike on each."""
        from megatron.core import parallel_state as ps

        out = super()._generate_single_turn(*args, **kwargs)
        if not dist.is_initialized():
            return out
        for group in (ps.get_tensor_and_context_parallel_group(), ps.get_pipeline_model_parallel_group()):
            if dist.get_world_size(group) > 1:
                state = torch.get_rng_state().to(self.model.device)
                dist.broadcast(state, src=dist.get_process_group_ranks(group)[0], group=group)
                torch.set_rng_state(state.cpu())
        return out

    def _count_tokens_seen(self, micro: list[dict], flops: float) -> None:
        # NOTE: TRL counts the prompt and completion tokens in _generate
        self.current_flos += flops / (dist.get_world_size() if dist.is_initialized() else 1)

    # ---- log-probs ---------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """The old or reference per-token log-probs TRL asks for (no grad; training's come from the loss hook)."""
        if compute_entropy or compute_aux_loss:
            raise NotImplementedError(f"{type(self).__name__} computes the policy's entropies in its loss hook.")
        adapters = contextlib.nullcontext()
        if isinstance(model, _AdaptersDisabled):
            model, adapters = model.policy, model.policy.disable_adapter()
        with adapters:
            logps = completion_logps(model, input_ids, attention_mask, logits_to_keep=logits_to_keep,
                                     batch_size=batch_size or input_ids.shape[0], temperature=self.temperature,
                                     vision=multimodal)
        return logps, None, None

    # ---- training and evaluation -------------------------------------------------------------------------------
    @property
    def _router_aux_coef(self) -> float:
        """TRL's weight of the MoE router balancing loss where it turned it on (``aux_loss_enabled``), else 0."""
        return self.router_aux_loss_coef if self.aux_loss_enabled else 0.0

    def _router_balance(self):
        from loongforge_hf.bridges import router_balance

        return router_balance.requested(self.model, self._router_aux_coef)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.engine.loss_hook = PolicyLossHook(self)
        # NOTE: TRL adds coef * aux_loss / accumulation steps to each micro-batch's loss, and DDP averages over ranks
        self.engine.router_aux_reduction = "mean"
        self.engine.router_aux_coef = self._router_aux_coef
        return optimizer

    def _record_step(self, result, micro: list[dict]) -> None:
        if result.router_aux is not None:
            self._metrics["train"]["aux_loss"].extend(result.router_aux)
        for values in result.hook_stats:
            self._log_stats("train", values)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's evaluation loss of a prepared batch (``prediction_step``) and its ``eval`` metrics; training runs in
        the engine."""
        from megatron.core import parallel_state as ps

        if self.model.training or return_outputs:
            raise NotImplementedError(f"{type(self).__name__} trains in its engine; compute_loss is its evaluation "
                                      "loss.")
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        routed = self._router_balance()  # NOTE: TRL's evaluation forward returns the balancing loss too
        logps, entropy, aux = completion_logps(self.model, ids, mask, logits_to_keep=inputs["completion_ids"].shape[1],
                                               batch_size=ids.shape[0], temperature=self.temperature, entropy=True,
                                               balance=routed[0] if routed is not None else None,
                                               vision={k: inputs.get(k) for k in
                                                       VISION_INPUTS + TOKEN_TYPES + IMAGE_COUNTS})
        loss, stats = self._loss_and_stats(logps, inputs, accumulation_steps=1, evaluation=True)
        values = torch.cat([entropy[None].float(), stats])
        if dp_rank_and_size()[1] > 1:
            dist.all_reduce(values, group=ps.get_data_parallel_group())
        self._log_stats("eval", values.tolist())
        if aux is not None:  # NOTE: TRL adds coef * aux_loss (no accumulation here); its metric: the ranks' mean
            loss = loss + routed[1] * aux
            self._metrics["eval"]["aux_loss"].append(float(gather_over_data_parallel(aux.float()).mean()))
        return loss.detach()
