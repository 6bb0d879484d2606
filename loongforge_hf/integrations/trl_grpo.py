"""``LoongGRPOTrainer``: trl's GRPOTrainer on the outside, LoongTrainer's megatron engine on the inside.

Choices:
- ``class LoongGRPOTrainer(LoongTrainer, GRPOTrainer)``, as ``LoongDPOTrainer``: from GRPOTrainer its ``__init__``
  (reward functions and weights, generation config, metrics), its repeat sampler and generation-batch dataloader,
  ``_prepare_inputs`` (generation once per ``steps_per_generation x num_iterations`` micro-batches, buffered,
  shuffled, split), ``_generate_and_score_completions`` (prompt tokenisation, EOS masking,
  ``mask_truncated_completions``, rewards, group advantages with ``scale_rewards`` and
  ``multi_objective_aggregation``, the reward / completion metrics) and ``log``; from LoongTrainer data sharding over
  data-parallel ranks, the loop, optimizer, checkpoints and ``save_model``.
- Generation is TRL's own transformers path calling the policy's ``generate`` (``generation.py``: transformers'
  sampling on the collective forward; every rank of a replica samples what its first rank's generator gives, so a
  seeded run samples what TRL samples on one process with the same logits).
- Each optimizer step runs TRL's ``_prepare_inputs`` on each of the step's generation batches (as TRL's
  ``training_step`` would), turns each result into an engine micro-batch (prompt then completion ids, the completion
  tokens as labels, padded to ``ParallelConfig.sequence_multiple``; TRL's tensors ride along), then one
  ``MegatronEngine.train_step`` whose ``loss_hook`` (``_PolicyLoss``) computes TRL's per-token log-probs of the
  completion from the fused, vocab-parallel head (``kernels.cross_entropy.linear_cross_entropy``, logits times
  ``1 / temperature`` as TRL's fused head divides them; no full-vocabulary logits, no gather over TP) and TRL's loss
  (``grpo_losses.GRPOLoss``). The old and reference per-token log-probs TRL asks for
  (``_get_per_token_logps_and_entropies``, no grad) come from the same head over megatron's forward-only schedule
  of the policy or the reference (``completion_logps``; broadcast from the last pipeline stage).
- Pipeline parallelism: megatron's schedule; a step's micro-batches are padded to one length. Context parallelism:
  each rank scores its load-balanced share of every row's tokens and the per-token log-probs are put together over
  the CP group (``_whole_rows``; differentiable for the policy's), so every CP rank computes TRL's whole loss of the
  micro-batch (see ``_PolicyLoss``).
- MoE router load-balancing loss, as TRL turns it on (``GRPOConfig.router_aux_loss_coef``, by default the model
  config's, for a config with ``output_router_logits``): transformers' loss over the policy forward's prompt and
  completion tokens (``bridges/router_balance.py``), ``coef * aux_loss`` added to each micro-batch's loss
  (``router_aux_reduction="mean"`` with the engine's ``router_aux_coef``: TRL's ``/ accumulation steps``, averaged
  over the data-parallel ranks), the ``aux_loss`` metric each micro-batch's value averaged over them. Not in the
  old / reference forwards, as TRL. A MoE model that cannot compute it is refused (``router_balance.check_layout``:
  pass ``router_aux_loss_coef=0.0``).
- The reference (``beta != 0``): the policy's checkpoint loaded again with its layout and dtype (TRL loads it from
  the policy's name), or with ``peft_config`` (megatron LoRA) the policy with its adapters disabled.
- TRL gathers over every process; here the ranks of one model replica (tensor x context x pipeline) hold the same
  rows, so its gathers and process index run over the data-parallel group while ``_prepare_inputs`` runs
  (``_OverDataParallel``), and the reward gather (accelerate's, over the world) keeps one rank per replica
  (``_calculate_rewards``).
  ``generation_batch_size`` is ``per_device_train_batch_size x data-parallel ranks x steps_per_generation`` (TRL's
  config counts every process).
- Logged as TRL: ``loss``, reward, reward_std, rewards/<func>/mean|std, frac_reward_zero_std, completions/*,
  num_tokens, kl (beta != 0), entropy, clip_ratio/{low_mean, low_min, high_mean, high_max, region_mean}
  (per micro-batch, over the data-parallel ranks: each rank's clip extremes in its own slot of the step's sums),
  cispo_clip_ratio ("cispo"), vespo/phi_seq_mean ("vespo"), aux_loss (MoE). TRL's ``step_time`` is not logged.
- Refused with a message, on every rank before any collective: ``use_vllm``, ``use_liger_kernel``,
  ``use_transformers_continuous_batching``, ``tools`` / ``rollout_func`` / ``environment_factory`` (multi-turn),
  ``entropy_coef`` / ``use_adaptive_entropy`` (entropy bonus), ``top_entropy_quantile < 1``, ``sync_ref_model``,
  ``cast_lm_head_to_fp32``, image datasets / processors, ``eval_dataset`` (evaluation), virtual pipeline stages,
  ``log_completions`` under model parallelism (TRL's completion table gathers every process), a non-LoRA
  ``peft_config``, custom ``optimizers``, ``quantization_config``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from trl import GRPOConfig, GRPOTrainer

from loongforge_hf.integrations.grpo_losses import SUMS, GRPOLoss
from loongforge_hf.integrations.trl_dpo import _disable_residual_dropout, _local_inputs
from loongforge_hf.trainer.arguments import LoongArgumentsMixin
from loongforge_hf.trainer.data import dp_rank_and_size
from loongforge_hf.trainer.loong_trainer import LoongTrainer


@dataclass
class LoongGRPOConfig(LoongArgumentsMixin, GRPOConfig):
    """trl's ``GRPOConfig`` plus LoongTrainer's own knobs, defined once in ``LoongArgumentsMixin``."""


def _refuse_unsupported(args: GRPOConfig, model, peft_config, train_dataset, processing_class, **given) -> None:
    """Everything checked here is the same on every rank: all raise alike, before any collective."""
    why = {"optimizers": " (the megatron engine owns the optimizer)", "eval_dataset": " (evaluation)"}
    problems = [k + why.get(k, "") for k, v in given.items() if v is not None and v != (None, None)]
    for field, default, why in (
            ("use_vllm", False, " (generation runs the policy's own generate)"), ("use_liger_kernel", False, ""),
            ("use_transformers_continuous_batching", False, ""), ("sync_ref_model", False, ""),
            ("entropy_coef", 0.0, " (entropy bonus)"), ("use_adaptive_entropy", False, " (entropy bonus)"),
            ("top_entropy_quantile", 1.0, " (needs each token's entropy over every rank)"),
            ("cast_lm_head_to_fp32", False, "")):
        if getattr(args, field, default) != default:
            problems.append(f"{field}={getattr(args, field)!r}{why}")
    sample = next(iter(train_dataset)) if train_dataset is not None else {}
    if "image" in sample or "images" in sample or hasattr(processing_class, "image_processor"):
        problems.append("image datasets / processors (vision GRPO)")
    if peft_config is not None and type(peft_config).__name__ != "LoraConfig":
        problems.append(f"peft_config of type {type(peft_config).__name__} (LoRA only)")
    layout = model.parallel
    if layout.virtual_pipeline_parallel_size:
        problems.append(f"virtual_pipeline_parallel_size={layout.virtual_pipeline_parallel_size}")
    replica = layout.tensor_parallel_size * layout.pipeline_parallel_size * layout.context_parallel_size
    if args.log_completions and replica > 1:
        problems.append("log_completions=True with tensor / pipeline / context parallelism (TRL's table gathers "
                        "every process)")
    if problems:
        raise ValueError("LoongGRPOTrainer does not support: " + "; ".join(problems) + ".")


class _AdaptersDisabled:
    """The reference while it is the LoRA policy with its adapters disabled (what TRL is handed as ``ref_model``,
    so that it asks for reference log-probs through ``_get_per_token_logps_and_entropies``)."""

    def __init__(self, policy) -> None:
        self.policy = policy


class _GRPOArgsSecond(GRPOTrainer):
    """GRPOTrainer taking ``(model, args, ...)`` positionally, as LoongTrainer passes them to the next class."""

    def __init__(self, model, args=None, *, reward_funcs=None, **kwargs) -> None:
        GRPOTrainer.__init__(self, model, reward_funcs, args, **kwargs)


def _token_logps(output: torch.Tensor, labels: torch.Tensor, head, *, vocab_size: int, temperature: float,
                 stats: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[b, s]`` log-probabilities of the (shifted) label tokens at ``temperature`` (0 elsewhere) from the final
    hidden states through ``head``'s fused vocab-parallel output layer; ``stats`` gets the entropy and top-1 sums."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.runtime import IGNORE_INDEX, output_bias, output_weight
    from loongforge_hf.kernels.cross_entropy import linear_cross_entropy

    if head is None:
        raise ValueError("LoongGRPOTrainer needs the engine's fused loss (the language head's final hidden states).")
    scale = getattr(head, "logit_scale", None)
    if temperature != 1.0:
        scale = (1.0 if scale is None else scale) / temperature
    losses = linear_cross_entropy(output.reshape(-1, output.shape[-1]), output_weight(head), labels.reshape(-1),
                                  ignore_index=IGNORE_INDEX, tp_group=ps.get_tensor_model_parallel_group(),
                                  vocab_size=vocab_size, reduction="none", token_stats=stats,
                                  softcap=getattr(head, "logit_softcap", None), logit_scale=scale,
                                  bias=output_bias(head))
    return -losses.view(labels.shape)


def _engine_batch(inputs: dict, *, multiple: int, pad_id: int, length: int = 0) -> dict:
    """An engine micro-batch from TRL's prepared inputs: prompt (left-padded) then completion (right-padded) ids,
    the completion tokens as labels, right-padded to ``multiple`` (and to ``length`` at least); TRL's tensors under
    "grpo"."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    prompt = inputs["prompt_ids"].shape[1]
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    extra = -(-max(ids.shape[1], length) // multiple) * multiple - ids.shape[1]
    if extra:
        ids, mask, labels = (torch.cat([t, t.new_full((t.shape[0], extra), v)], dim=1)
                             for t, v in ((ids, pad_id), (mask, 0), (labels, -100)))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "grpo": inputs, "prompt_length": prompt}


def _whole_rows(local: torch.Tensor, *, grad: bool = False) -> torch.Tensor:
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


@torch.no_grad()
def completion_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int,
                     batch_size: int, temperature: float) -> torch.Tensor:
    """TRL's ``_get_per_token_logps_and_entropies`` log-probs (``[rows, logits_to_keep]``, fp32, on every rank) under
    ``model`` (a ``LoongModelForCausalLM``), ``batch_size`` rows per forward of megatron's forward-only schedule
    (broadcast from the last pipeline stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from loongforge_hf.bridges.output_layer import hidden_states_out, language_head

    chunk = model.chunks[0]
    prompt = input_ids.shape[1] - logits_to_keep
    found = []

    def forward_step(data_iterator, chunk):
        args, labels = _local_inputs(next(data_iterator), model.device)
        head = language_head(chunk)
        with hidden_states_out([chunk]) if head is not None else contextlib.nullcontext():
            output = chunk(*args)

        def loss_func(output):
            logps = _token_logps(output, labels, head, vocab_size=model.config.vocab_size, temperature=temperature)
            found.append(_whole_rows(logps)[:, prompt - 1:prompt - 1 + logits_to_keep].contiguous())
            return output.sum() * 0.0, {}
        return output, loss_func

    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            batch = _engine_batch({"prompt_ids": ids[:, :prompt], "completion_ids": ids[:, prompt:],
                                   "prompt_mask": mask[:, :prompt], "completion_mask": mask[:, prompt:]},
                                  multiple=model.parallel.sequence_multiple, pad_id=0)
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=chunk,
                                        num_microbatches=1, seq_length=batch["input_ids"].shape[1],
                                        micro_batch_size=ids.shape[0], forward_only=True)
            if model.parallel.pipeline_parallel_size == 1:
                out.append(found.pop())
                continue
            group = ps.get_pipeline_model_parallel_group()
            logps = found.pop() if ps.is_pipeline_last_stage(ignore_virtual=True) else \
                torch.empty(ids.shape[0], logits_to_keep, dtype=torch.float32, device=model.device)
            dist.broadcast(logps, src=dist.get_process_group_ranks(group)[-1], group=group)
            out.append(logps)
    finally:
        model.train(was_training)
    return torch.cat(out)


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
        from megatron.core import parallel_state as ps

        tensor = tensor.contiguous()
        tensor = tensor[None] if tensor.dim() == 0 else tensor
        if dp_rank_and_size()[1] == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(dp_rank_and_size()[1])]
        dist.all_gather(parts, tensor, group=ps.get_data_parallel_group())
        return torch.cat(parts)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        tensor = tensor.clone()
        if dp_rank_and_size()[1] > 1:
            dist.all_reduce(tensor, group=ps.get_data_parallel_group())
        return tensor / dp_rank_and_size()[1] if reduction == "mean" else tensor


class _PolicyLoss:
    """``MegatronEngine.loss_hook``: TRL's GRPO loss of each micro-batch (see the module docstring). Its stats: the
    entropy sum, ``grpo_losses.SUMS``, then one (clip low_min, high_max) slot per data-parallel rank.

    Under context parallelism each rank scores its share of every row's tokens; the per-token log-probs are put
    together over the group (``_whole_rows``), so every CP rank computes the micro-batch's whole loss and counts 1
    (the engine divides by CP times more counts; the backward gives each share CP times its gradient). Its entropy
    sum is each rank's own tokens'; the SUMS and slots are the first CP rank's (the engine sums over CP too)."""

    def __init__(self, trainer: "LoongGRPOTrainer") -> None:
        self.trainer = trainer
        self.ranks = dp_rank_and_size()[1]
        self.num_stats = 1 + len(SUMS) + 2 * self.ranks

    def start_step(self, micro_batches: list[dict]) -> None:
        self.steps = len(micro_batches)

    def __call__(self, output, batch: dict, *, labels: torch.Tensor, head):
        trainer, g = self.trainer, batch["grpo"]
        device = output.device
        entropy = torch.zeros(2, dtype=torch.float32, device=device)
        prompt, length = batch["prompt_length"], g["completion_ids"].shape[1]
        logps = _token_logps(output, labels, head, vocab_size=trainer.model.config.vocab_size,
                             temperature=trainer.temperature, stats=entropy)
        logps = _whole_rows(logps, grad=True)[:, prompt - 1:prompt - 1 + length]
        mask = g["completion_mask"].to(device)
        old, ref = (g[k].to(device) if g.get(k) is not None else None
                    for k in ("old_per_token_logps", "ref_per_token_logps"))
        loss, sums, extremes = trainer.policy_loss(
            logps, mask=mask, advantages=g["advantages"].to(device), old_logps=old, ref_logps=ref,
            num_items=g["num_items_in_batch"].to(device), num_processes=self.ranks, accumulation_steps=self.steps)
        slots = torch.zeros(2 * self.ranks, dtype=torch.float32, device=device)
        rank = dp_rank_and_size()[0]
        slots[2 * rank:2 * rank + 2] = torch.tensor(extremes, dtype=torch.float32)
        from loongforge_hf.parallel.context_parallel import cp_group_and_size

        if cp_group_and_size()[2] != 0:  # NOTE: counted once per context-parallel group
            sums, slots = torch.zeros_like(sums), torch.zeros_like(slots)
        stats = torch.cat([entropy[:1], sums.float(), slots])
        return loss, torch.ones((), dtype=torch.int64, device=device), stats


class LoongGRPOTrainer(LoongTrainer, _GRPOArgsSecond):
    """A drop-in ``trl.GRPOTrainer`` for ``LoongModelForCausalLM`` models (``peft_config`` gives megatron LoRA)."""

    def __init__(self, model=None, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None) -> None:
        from transformers import GenerationConfig, set_seed

        from loongforge_hf.modeling import LoongModelForCausalLM

        if not isinstance(model, LoongModelForCausalLM):
            raise TypeError("LoongGRPOTrainer trains a loongforge_hf model: load it with "
                            "loongforge_hf.AutoModelForCausalLM.from_pretrained(...) "
                            f"(got {type(model).__name__}).")
        if args is None:
            name = (getattr(model.config, "_name_or_path", "") or "model").rstrip("/").split("/")[-1]
            args = GRPOConfig(f"{name}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a trl.GRPOConfig (or loongforge_hf.LoongGRPOConfig), got "
                            f"{type(args).__name__}.")
        _refuse_unsupported(args, model, peft_config, train_dataset, processing_class, optimizers=optimizers,
                            eval_dataset=eval_dataset,
                            quantization_config=quantization_config, tools=tools, rollout_func=rollout_func,
                            environment_factory=environment_factory)
        if peft_config is not None:
            from loongforge_hf.lora import get_peft_model

            set_seed(args.seed)  # NOTE: as TRL, before the adapters are drawn
            model = get_peft_model(model, peft_config)
        if model.generation_config is None:
            model.generation_config = GenerationConfig.from_model_config(model.config)
        # NOTE: TRL would load a transformers reference model for beta != 0: the reference is set below instead
        beta, args.beta = args.beta, 0.0
        try:
            super().__init__(model, args, reward_funcs=reward_funcs, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class,
                             reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                             optimizers=optimizers)
        finally:
            args.beta = beta
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
        self.policy_loss = GRPOLoss.from_args(args)
        self._representatives = None
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
        # micro-batches; no virtual pipeline stages here, so nothing is left out
        self.model.train()
        prepared = []
        for generation_batch in micro:
            with self._over_data_parallel():
                prepared.append(self._prepare_inputs(generation_batch))
            self._step += 1
        # NOTE: megatron's pipeline schedule takes one sequence length for every micro-batch of a step
        length = max(p["prompt_ids"].shape[1] + p["completion_ids"].shape[1] for p in prepared) \
            if self.model.parallel.pipeline_parallel_size > 1 else 0
        return [_engine_batch(p, multiple=self.model.parallel.sequence_multiple, pad_id=self._tokenizer.pad_token_id,
                              length=length) for p in prepared]

    @contextlib.contextmanager
    def _over_data_parallel(self):
        accelerator = self.accelerator
        self.accelerator = _OverDataParallel(accelerator)
        try:
            yield
        finally:
            self.accelerator = accelerator

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

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of every data-parallel rank's rows (its gather spans every process: one rank per replica
        is kept, in data-parallel order)."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return rewards
        if self._representatives is None:
            from megatron.core import parallel_state as ps

            first = (ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(),
                     ps.get_pipeline_model_parallel_rank()) == (0, 0, 0)
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, (dp_rank_and_size()[0], first))
            self._representatives = [r for _, r in sorted((dp, r) for r, (dp, keep) in enumerate(ranks) if keep)]
        return rewards.view(dist.get_world_size(), -1, rewards.shape[-1])[self._representatives].flatten(0, 1)

    def _count_tokens_seen(self, micro: list[dict], flops: float) -> None:
        # NOTE: TRL counts the prompt and completion tokens in _generate
        self.current_flos += flops / (dist.get_world_size() if dist.is_initialized() else 1)

    # ---- log-probs ---------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """The old or reference per-token log-probs TRL asks for (no grad; training's come from the loss hook)."""
        if compute_entropy or compute_aux_loss:
            raise NotImplementedError("LoongGRPOTrainer computes the policy's entropies in its loss hook.")
        adapters = contextlib.nullcontext()
        if isinstance(model, _AdaptersDisabled):
            model, adapters = model.policy, model.policy.disable_adapter()
        with adapters:
            logps = completion_logps(model, input_ids, attention_mask, logits_to_keep=logits_to_keep,
                                     batch_size=batch_size or input_ids.shape[0], temperature=self.temperature)
        return logps, None, None

    # ---- training --------------------------------------------------------------------------------------------------
    @property
    def _router_aux_coef(self) -> float:
        """TRL's weight of the MoE router balancing loss where it turned it on (``aux_loss_enabled``), else 0."""
        return self.router_aux_loss_coef if self.aux_loss_enabled else 0.0

    def _router_balance(self):
        from loongforge_hf.bridges import router_balance

        return router_balance.requested(self.model, self._router_aux_coef)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.engine.loss_hook = _PolicyLoss(self)
        # NOTE: TRL adds coef * aux_loss / accumulation steps to each micro-batch's loss, and DDP averages over ranks
        self.engine.router_aux_reduction = "mean"
        self.engine.router_aux_coef = self._router_aux_coef
        return optimizer

    def _record_step(self, result, micro: list[dict]) -> None:
        metrics = self._metrics["train"]
        if result.router_aux is not None:
            metrics["aux_loss"].extend(result.router_aux)
        for values in result.hook_stats:
            entropy, kl, low, high, region, clip_count, tokens = values[:1 + len(SUMS)]
            slots = values[1 + len(SUMS):]
            if self.beta != 0.0:
                metrics["kl"].append(kl / max(tokens, 1.0))
            metrics["entropy"].append(entropy / max(tokens, 1.0))
            if self.policy_loss.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
                count = max(clip_count, 1.0)
                metrics["clip_ratio/low_mean"].append(low / count)
                metrics["clip_ratio/high_mean"].append(high / count)
                metrics["clip_ratio/region_mean"].append(region / count)
                low_min, high_max = min(slots[0::2]), max(slots[1::2])
                metrics["clip_ratio/low_min"].append(low_min if low_min != float("inf") else float("nan"))
                metrics["clip_ratio/high_max"].append(high_max if high_max != float("-inf") else float("nan"))
            elif self.policy_loss.loss_type in ("cispo", "vespo"):
                key = "cispo_clip_ratio" if self.policy_loss.loss_type == "cispo" else "vespo/phi_seq_mean"
                metrics[key].append(low / max(clip_count, 1.0))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        raise NotImplementedError("LoongGRPOTrainer trains in its engine; evaluation is not supported yet.")
