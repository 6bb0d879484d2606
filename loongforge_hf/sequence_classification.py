"""Sequence classification (reward models): ``AutoModelForSequenceClassification.from_pretrained`` ->
``LoongModelForSequenceClassification``, transformers' ``*ForSequenceClassification`` on a causal LM's bridge.

Choices:
- Architectures: those whose transformers sequence-classification class (by ``model_type``) is transformers'
  ``GenericForSequenceClassification`` (Llama, Qwen2 / 3, Mistral, Gemma, Phi-3, Qwen3-MoE, Mixtral, DeepSeek-V2 /
  V3, ...): the causal LM's backbone under the same tensor names and ``score`` ``[num_labels, hidden]`` without bias
  instead of the LM head. Others are refused, naming the supported ones.
- Either checkpoint loads: a causal LM's (its LM head is not read and is listed in ``unexpected_keys``; ``score`` is
  drawn from N(0, ``initializer_range``) as transformers draws a weight the checkpoint lacks, listed in
  ``missing_keys`` and logged) or a sequence classifier's (its ``score`` loaded; its ``architectures`` names the
  causal LM's bridge through the model type). ``num_labels`` / ``id2label`` / ``problem_type`` are config overrides,
  as in transformers. ``save_pretrained`` writes ``architectures = [the sequence-classification class]``. The
  fresh ``score`` is transformers' own draw: from torch's default generator as ``from_pretrained`` found it (so after
  ``torch.manual_seed(s)`` / ``transformers.set_seed(s)`` it is bit for bit the weight transformers' classifier gets
  after the same call), which it leaves advanced as transformers does; rank 0's draw on every rank.
- The bridge is the causal LM's, wrapped (``SequenceClassificationBridge``): same layers and mappings; never tied; the
  megatron output layer of the last pipeline stage becomes ``ScoreHead`` (built with the vocabulary head, which is
  dropped before the weights load): replicated over TP (a few rows), under sequence parallelism it gathers the
  sequence first with a backward that keeps this rank's slice, since every TP rank computes the whole gradient.
- ``forward``: per-position scores, then transformers' pooling: each row's rightmost token that is not
  ``pad_token_id`` (left and right padding alike; without a pad token the last position, for a batch of one only:
  transformers' ``ValueError`` otherwise), found on the given ``input_ids`` before any layout padding. The loss is
  transformers' own ``ForSequenceClassificationLoss`` (regression / single-label / multi-label by ``problem_type``,
  which it sets on first use as there). A ``SequenceClassifierOutputWithPast`` on every rank: under pipeline
  parallelism the last stage's pooled logits are broadcast (forward-only; gradients flow at PP 1).
- MoE checkpoints (Qwen3-MoE, Mixtral, ...): transformers' generic classifier (5.24) neither returns router logits
  nor adds the router balancing loss, whatever ``output_router_logits`` / ``router_aux_loss_coef`` say (the forward
  keyword is taken and changes nothing): nor does this one (no tally is begun; megatron's own balancing losses stay
  off, ``bridges/moe.py``). Expert parallelism as the causal LM's.
- Context parallelism: each rank holds its load-balanced (zig-zag) share of every row's positions; the pooled
  position lives on one rank's share, so each rank picks the scores at the pooled positions it holds (0 elsewhere)
  and they are summed over the CP group (``pool_over_context_parallel``; differentiable: the backward sums the
  group's gradients, each CP rank computing the whole loss). Virtual pipeline stages: a forward goes through them in
  order (``runtime._interleaved_forward_once``); training runs megatron's interleaved schedule.
- LoRA: ``loongforge_hf.lora.get_peft_model(model, LoraConfig(task_type="SEQ_CLS", ...))`` or
  ``LoongRewardTrainer(peft_config=...)``, the head trained whole as PEFT's ``modules_to_save``
  (``lora/sequence_classification.py``).
- Refused by name before any collective: loading PEFT adapter folders, image-text checkpoints, ``generate``,
  ``resize_token_embeddings``, and training by any trainer but ``LoongRewardTrainer`` (``integrations/trl_reward.py``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongforge_hf.bridges.mappings import Replicated
from loongforge_hf.modeling import (_REFUSED_FORWARD, AutoModelForCausalLM, LoongModelForCausalLM,
                                    select_longrope_for)

logger = logging.getLogger(__name__)

SCORE = "score.weight"
_TRAINER = "_loong_reward_trainer"  # NOTE: set on the model by LoongRewardTrainer before Trainer.__init__


def sequence_classification_class(hf_config) -> str:
    """transformers' sequence-classification class name for ``hf_config``'s model type; ``UnsupportedArchitecture
    Error`` where it is not transformers' generic one (whose layout and pooling this module reproduces)."""
    import transformers
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as NAMES

    from loongforge_hf.bridges.registry import UnsupportedArchitectureError

    model_type = getattr(hf_config, "model_type", None)
    name = NAMES.get(model_type)
    found = getattr(transformers, name, None) if name else None
    if found is None or not issubclass(found, GenericForSequenceClassification):
        raise UnsupportedArchitectureError(
            f"AutoModelForSequenceClassification: model_type={model_type!r} is not supported ("
            + (f"transformers' {name} is not its generic sequence classifier" if found is not None
               else "transformers has no sequence-classification class for it")
            + f"); supported model types: {', '.join(supported_model_types())}.")
    return name


def supported_model_types() -> list[str]:
    """The model types of the registry's causal LMs whose transformers sequence classifier is the generic one."""
    import transformers
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as NAMES

    from loongforge_hf.bridges.registry import supported_architectures

    types = set()
    for arch in supported_architectures():
        config_class = getattr(getattr(transformers, arch, None), "config_class", None)
        model_type = getattr(config_class, "model_type", None)
        found = getattr(transformers, NAMES.get(model_type, ""), None)
        if found is not None and issubclass(found, GenericForSequenceClassification):
            types.add(model_type)
    return sorted(types)


class ScoreHead(nn.Module):
    """Stands in for megatron's output layer: ``(hidden [s, b, h] @ weight.T, None)``, the weight whole on every
    tensor-parallel rank; under sequence parallelism the input is gathered over TP first."""

    def __init__(self, *, hidden_size: int, num_labels: int, dtype: torch.dtype, sequence_parallel: bool,
                 tp_group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size, dtype=dtype))
        # NOTE: the names output_layer.hidden_states_out reads
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group

    def forward(self, input_: torch.Tensor, weight=None, runtime_gather_output=None, **unused):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # NOTE: each TP rank computes the whole input gradient: the backward keeps this rank's slice of it
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return nn.functional.linear(input_, self.weight), None


@dataclass(frozen=True)
class FreshScore(Replicated):
    """``score.weight`` where the checkpoint has none (a causal LM's): zeros on load, drawn afterwards
    (``LoongModelForSequenceClassification.draw_score``), exported as the checkpoint's would be."""

    shape: tuple[int, int] = (1, 1)

    def load(self, reader, ctx, layer):
        return torch.zeros(self.shape)


class SequenceClassificationBridge:
    """A causal LM's bridge with ``score`` for its LM head (see the module docstring); everything else is the
    causal LM's bridge's."""

    tied = False
    lm_head_bias = False

    def __init__(self, inner, class_name: str) -> None:
        self.inner, self.class_name = inner, class_name
        self.fresh_score = False  # NOTE: the checkpoint has no score (see_checkpoint); drawn after the load

    def __getattr__(self, name: str):
        inner = self.__dict__.get("inner")
        if inner is None:  # NOTE: copy / pickle look attributes up before __init__ ran
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def num_labels(self) -> int:
        return int(self.hf_config.num_labels)

    def see_checkpoint(self, reader) -> None:
        from loongforge_hf.bridges.fp8_checkpoint import dequantizing_reader

        self.fresh_score = SCORE not in set(dequantizing_reader(reader).keys())

    def _head_mappings(self) -> list:
        return [m for m in self.inner.final_mappings() if m.megatron.startswith("output_layer.")]

    def final_mappings(self) -> list:
        kept = [m for m in self.inner.final_mappings() if not m.megatron.startswith("output_layer.")]
        if self.fresh_score:
            return [*kept, FreshScore("output_layer.weight", SCORE, shape=self._score_shape)]
        return [*kept, Replicated("output_layer.weight", SCORE)]

    @property
    def _score_shape(self) -> tuple[int, int]:
        return self.num_labels, self.hf_config.get_text_config().hidden_size

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        head = {n for m in self._head_mappings() for n in m.hf_names(None)}
        shapes = {k: v for k, v in self.inner.expected_hf_shapes().items() if k not in head}
        if not self.fresh_score:
            shapes[SCORE] = self._score_shape
        return shapes

    def check_layout(self, layout) -> None:
        if hasattr(self.inner, "check_layout"):
            self.inner.check_layout(layout)

    def finish_model(self, model) -> None:
        """The causal LM's changes, then ``ScoreHead`` for the last stage's output layer (its LM-head changes,
        Gemma's soft-cap, Cohere's scale, go with it: transformers' classifiers have none)."""
        if hasattr(self.inner, "finish_model"):
            self.inner.finish_model(model)
        if model.post_process:
            old = model.output_layer
            model.output_layer = ScoreHead(hidden_size=model.config.hidden_size, num_labels=self.num_labels,
                                           dtype=model.config.params_dtype,
                                           sequence_parallel=model.config.sequence_parallel,
                                           tp_group=getattr(old, "tp_group", None))
            for name in ("logit_scale", "logit_softcap"):
                vars(model).pop(name, None)


def _init_std(config) -> float:
    """The std of transformers' generic ``_init_weights`` (5.24) for ``config``."""
    if hasattr(config, "initializer_range"):
        return config.initializer_range or 0.02
    if hasattr(config, "init_std"):
        return config.init_std
    if hasattr(config, "initializer_factor"):
        return config.initializer_factor
    return getattr(config.get_text_config(), "initializer_range", 0.02)


def last_token_index(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """transformers' pooled position of each row (``GenericForSequenceClassification.forward``, 5.24): the rightmost
    token that is not ``pad_token_id``; without a pad token the last one, for a batch of one only."""
    batch, seq = input_ids.shape
    if pad_token_id is None and batch != 1:
        raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
    if pad_token_id is None:
        return torch.full((batch,), seq - 1, dtype=torch.int64, device=input_ids.device)
    not_pad = (input_ids != pad_token_id).to(torch.int32)
    return (torch.arange(seq, device=input_ids.device, dtype=torch.int32) * not_pad).argmax(-1)


def pool(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[b, s, n]`` per-position scores -> ``[b, n]`` at each row's ``index``."""
    return scores[torch.arange(scores.shape[0], device=scores.device), index.to(scores.device)]


def pool_over_context_parallel(scores: torch.Tensor, index: torch.Tensor, *, grad: bool = False) -> torch.Tensor:
    """``[b, s / CP, n]`` per-position scores of this context-parallel rank's share -> ``[b, n]`` at each row's
    (global) ``index``: the rank whose share holds it gives it, summed over the CP group (``pool`` without CP). With
    ``grad``, differentiable: the backward sums the group's gradients."""
    from loongforge_hf.parallel.context_parallel import cp_group_and_size, cp_token_index

    group, size, rank = cp_group_and_size()
    if size == 1:
        return pool(scores, index)
    held = cp_token_index(scores.shape[1] * size, size, rank, device=scores.device)
    hit = held[None, :] == index.to(scores.device)[:, None]  # [b, s / CP]: at most one True per row
    picked = (scores * hit[..., None].to(scores.dtype)).sum(dim=1)
    if grad:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(picked, group=group)
    picked = picked.detach().clone()
    dist.all_reduce(picked, group=group)
    return picked


def pooled_scores(model, *, input_ids, attention_mask, position_ids, index: torch.Tensor) -> torch.Tensor:
    """``[b, num_labels]`` scores at ``index`` on every rank, the inputs padded as the layout needs (this
    context-parallel rank's share of them)."""
    from loongforge_hf.bridges.runtime import megatron_attention_mask
    from loongforge_hf.parallel.context_parallel import cp_local_inputs
    from loongforge_hf.trainer.data import pad_model_inputs

    input_ids, attention_mask, position_ids, _ = pad_model_inputs(
        input_ids, attention_mask, position_ids, None, multiple=model.parallel.sequence_multiple)
    device = model.device
    input_ids = input_ids.to(device)
    b, s = input_ids.shape
    mask = megatron_attention_mask(attention_mask, s, position_ids, device=device)
    position_ids = torch.arange(s, device=device).expand(b, s) if position_ids is None else position_ids.to(device)
    inputs = cp_local_inputs(input_ids, position_ids, mask)[:3]
    if model.parallel.pipeline_parallel_size == 1:
        return pool_over_context_parallel(model.chunks[0](*inputs), index, grad=torch.is_grad_enabled())
    return _pipelined(model, inputs, index, seq=s)


@torch.no_grad()
def _pipelined(model, inputs: tuple, index: torch.Tensor, *, seq: int) -> torch.Tensor:
    """megatron's forward-only schedule, one micro-batch (under virtual pipeline stages through them in order);
    the last stage's pooled scores broadcast. ``seq``: the whole sequence length (``inputs`` may be a CP share)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from loongforge_hf.bridges.runtime import _interleaved_forward_once
    from loongforge_hf.parallel.context_parallel import pipeline_sequence_length

    b = inputs[0].shape[0]
    store: dict = {}
    chunks = list(model.chunks)

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        output = chunk(*inputs)

        def loss_func(output):
            store["scores"] = pool_over_context_parallel(output, index)
            return output.sum() * 0.0, {}
        return output, loss_func

    if len(chunks) > 1:
        _interleaved_forward_once(model, chunks, *inputs, lambda output: (pool_over_context_parallel(output, index),
                                                                          None), store, seq=seq)
        store["scores"] = store.pop("loss", None)
    else:
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=chunks[0],
                                    num_microbatches=1, seq_length=pipeline_sequence_length(seq),
                                    micro_batch_size=b, forward_only=True)
    group = ps.get_pipeline_model_parallel_group()
    scores = store.get("scores")
    if scores is None:
        scores = torch.empty(b, model.config.num_labels, dtype=model.dtype, device=model.device)
    scores = scores.detach().contiguous()
    dist.broadcast(scores, src=dist.get_process_group_ranks(group)[-1], group=group)
    return scores


def _forward_options(unused: dict) -> bool:
    """``return_dict``; what would change the output is refused (as ``modeling.hf_forward_options``)."""
    bad = sorted(k for k in _REFUSED_FORWARD if unused.get(k) not in (None, False))
    bad += [k for k in ("cache", "past_key_values") if unused.get(k) is not None]
    if bad:
        raise TypeError(f"forward: {bad} not supported by LoongModelForSequenceClassification"
                        + "".join(f"; {k}: {_REFUSED_FORWARD[k]}" for k in bad if k in _REFUSED_FORWARD) + ".")
    return unused.get("return_dict", True) is not False


class LoongModelForSequenceClassification(LoongModelForCausalLM):
    """transformers' ``*ForSequenceClassification`` on megatron-core modules (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.generation_config = None  # NOTE: as transformers' classifiers (save_pretrained copies the source's)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, **unused: Any):
        from transformers.loss.loss_utils import ForSequenceClassificationLoss
        from transformers.modeling_outputs import SequenceClassifierOutputWithPast

        return_dict = _forward_options(unused)
        index = last_token_index(input_ids, self.config.get_text_config().pad_token_id)
        select_longrope_for(self, input_ids, position_ids)
        logits = pooled_scores(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               index=index)
        loss = None
        if labels is not None:
            loss = ForSequenceClassificationLoss(labels=labels, pooled_logits=logits, config=self.config)
        out = SequenceClassifierOutputWithPast(loss=loss, logits=logits)
        return out if return_dict else out.to_tuple()

    @torch.no_grad()
    def draw_score(self) -> None:
        """A fresh ``score`` as transformers initialises a missing ``nn.Linear`` weight (``PreTrainedModel.
        _init_weights``): ``normal_(0, std)`` on a CPU tensor of the model's dtype, from torch's default generator
        (advanced as transformers advances it); global rank 0's draw on every rank. Collective."""
        drawn = torch.empty(self.config.num_labels, self.config.get_text_config().hidden_size,
                            dtype=self.dtype).normal_(0.0, _init_std(self.config))
        if dist.is_initialized() and dist.get_world_size() > 1:
            # NOTE: a rank whose default generator is elsewhere (unseeded, or seeded apart) still gets rank 0's
            drawn = drawn.to(self.device)
            dist.broadcast(drawn, src=0)
        for chunk in self.chunks:
            if getattr(chunk, "post_process", False):
                chunk.output_layer.weight.copy_(drawn)

    def generate(self, *args, **kwargs):
        raise TypeError("generate: a LoongModelForSequenceClassification scores sequences; it does not generate.")

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True):
        if new_num_tokens is None or new_num_tokens == self.config.get_text_config().vocab_size:
            return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        raise NotImplementedError("resize_token_embeddings is not supported for LoongModelForSequenceClassification.")

    @property
    def hf_device_map(self) -> dict:
        if not self.__dict__.get(_TRAINER, False):
            raise TypeError("LoongModelForSequenceClassification: only loongforge_hf.LoongRewardTrainer (same "
                            "arguments as trl.RewardTrainer) trains it.")
        return super().hf_device_map


class AutoModelForSequenceClassification(AutoModelForCausalLM):
    """``from_pretrained`` like transformers' ``AutoModelForSequenceClassification``, onto megatron-core modules."""

    _model_class = LoongModelForSequenceClassification

    def __init__(self) -> None:
        raise EnvironmentError("Use AutoModelForSequenceClassification.from_pretrained(...).")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any):
        """``AutoModelForCausalLM.from_pretrained``'s keywords (``num_labels=`` and the other config overrides
        too); collective. A checkpoint without ``score.weight`` gets a fresh one (see ``draw_score``)."""
        rng = torch.random.get_rng_state()  # NOTE: transformers draws the head from the generator as it was here
        loaded = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        model, info = loaded if isinstance(loaded, tuple) else (loaded, None)
        bridge = model.bridge
        if bridge.fresh_score:
            torch.random.set_rng_state(rng)
            model.draw_score()
            if info is not None:
                info["missing_keys"].add(SCORE)
            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.warning("Some weights of %s were not initialized from the model checkpoint at %s and are newly "
                               "initialized: ['%s']\nYou should probably TRAIN this model on a down-stream task to be "
                               "able to use it for predictions and inference.", bridge.class_name,
                               pretrained_model_name_or_path, SCORE)
            bridge.fresh_score = False  # NOTE: exported from here on
        model.config.architectures = [bridge.class_name]
        return loaded

    @classmethod
    def _check_task(cls, folder: Path, hf_config=None) -> None:
        from loongforge_hf.bridges.qwen2_5_vl import image_text_architectures
        from loongforge_hf.bridges.registry import UnsupportedArchitectureError, loads_as_causal_lm
        from loongforge_hf.lora.load import is_adapter_folder

        if hf_config is None:
            if is_adapter_folder(folder):
                raise ValueError(f"AutoModelForSequenceClassification: {folder} holds a PEFT adapter; loading one is "
                                 "not supported here (load its base model, then the adapter's weights into it).")
            return
        archs = list(getattr(hf_config, "architectures", None) or [])
        if loads_as_causal_lm(hf_config) or any(a in image_text_architectures() for a in archs):
            raise UnsupportedArchitectureError(f"AutoModelForSequenceClassification: {archs[0]} is an image-text "
                                               "model; not supported.")
        sequence_classification_class(hf_config)

    @classmethod
    def _task_bridge(cls, hf_config):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        from loongforge_hf.bridges import get_bridge

        name = sequence_classification_class(hf_config)
        archs = hf_config.architectures
        causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
        if causal is not None and (not archs or name in archs):
            hf_config.architectures = [causal]  # NOTE: the bridge is found by the causal LM's name
        try:
            return SequenceClassificationBridge(get_bridge(hf_config), name)
        finally:
            hf_config.architectures = archs
