"""Per-row log-prob scores of preference batches under a ``LoongModelForCausalLM``: what LoongDPOTrainer's loss and
its reference / evaluation forwards read, and the inputs the online trainers (``trl_online.py``) reuse.

Choices:
- ``RowScores`` / ``sequence_scores``: each row's label-token log-prob sums (and LD-DPO's / WPO's variants) through
  megatron's forward-only schedule and the fused vocabulary-parallel head, summed over the context-parallel group,
  broadcast from the last pipeline stage; virtual pipeline stages one by one (``_interleaved_one_by_one``). These
  no-grad forwards run the kernels' training path (``kernels._saved.training_numerics``), bit-equal to the training
  forward's.
- ``_token_logps`` / ``_token_log_sum_sq_probs``: per-token log-probs and WPO's ``log sum_v p_v^2`` from the final
  hidden states (fused head, or TP-local logits), vocabulary-parallel reductions only.
- Row bookkeeping of padded or packed (``position_ids``, ``row_index``) batches: ``_local_inputs`` (this CP rank's
  share as the engine builds it), ``_shifted``, ``_rows``, ``_halves``, ``_completion_lengths``.
- An image-text model's batches (vision DPO) go in as the engine's step gives them to its chunks
  (``_model_inputs``: the model's ``megatron_forward_inputs``, the vision inputs as the chunks' keywords; under
  virtual pipeline stages one by one, its ``bound_chunks``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongforge_hf.kernels._saved import training_numerics


@dataclass(frozen=True)
class RowScores:
    """What each row of a micro-batch gives the DPO loss, from its label tokens' log-probs (fp32 ``[rows, 3]``,
    summed over the context-parallel group): the log-prob sum the losses compare (LD-DPO's with ``ld_alpha``: the
    tokens past the pair's shorter completion times it), the plain sum ("sft"'s), and with ``wpo`` the sum of
    ``log p(token) - log sum_v p_v^2`` (WPO's, no grad; else 0)."""

    ld_alpha: float | None = None
    wpo: bool = False

    def __call__(self, token_logps: torch.Tensor, batch: dict, labels: torch.Tensor, *, output: torch.Tensor, head,
                 vocab_size: int, grad: bool = False) -> torch.Tensor:
        """``token_logps`` / ``labels``: this CP rank's ``[b, s_local]`` (``_token_logps``), or a packed batch's
        ``[1, s]`` (``padding_free``), ``batch`` the whole micro-batch, ``output`` / ``head`` what ``_token_logps``
        read."""
        from loongforge_hf.integrations.dpo_losses import ld_token_weights

        sq = _token_log_sum_sq_probs(output, labels, head, vocab_size=vocab_size) if self.wpo else None
        token_logps, labels = _rows(batch, token_logps, 0.0), _rows(batch, labels, -100)
        plain = token_logps.sum(dim=1)
        scored = plain
        if self.ld_alpha is not None:
            weights = ld_token_weights(_shifted(batch, token_logps.device) != -100, self.ld_alpha)
            scored = (token_logps * _cp_local_tokens(weights)).sum(dim=1)
        aligned = torch.zeros_like(plain)
        if self.wpo:
            aligned = ((token_logps.detach() - _rows(batch, sq, 0.0)) * (labels != -100)).sum(dim=1)
        return _over_context_parallel(torch.stack([scored, plain, aligned], dim=1), grad=grad)


@training_numerics()
@torch.no_grad()
def sequence_scores(model, micro_batches: list[dict], *, everywhere: bool = True,
                    scores: RowScores = RowScores()) -> list[torch.Tensor | None]:
    """Each micro-batch's per-row ``scores`` (fp32 ``[rows, 3]``, ``RowScores``) under ``model`` (a
    ``LoongModelForCausalLM``; batches padded as megatron needs, with shifted-by-the-step ``labels``), through
    megatron's forward-only schedule and the fused vocab-parallel head (summed over the context-parallel ranks). On
    the last pipeline stage, or on every rank with ``everywhere`` (broadcast over the pipeline group); None
    elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from loongforge_hf.bridges.output_layer import hidden_states_out, language_head

    device = model.device
    vocab = model.config.vocab_size
    found: list[torch.Tensor] = []

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        args, inputs, labels = _model_inputs(model, batch, device)
        head = language_head(chunk)
        with hidden_states_out([chunk]) if head is not None else nullcontext():
            output = chunk(*args, **inputs)

        def loss_func(output):
            found.append(scores(_token_logps(output, labels, head, vocab_size=vocab), batch, labels, output=output,
                                head=head, vocab_size=vocab))
            return output.sum() * 0.0, {}
        return output, loss_func

    chunks = list(model.chunks)
    seq, rows = micro_batches[0]["input_ids"].shape[1], micro_batches[0]["input_ids"].shape[0]
    if len(chunks) > 1 and len(micro_batches) % model.parallel.pipeline_parallel_size:
        _interleaved_one_by_one(model, micro_batches, found, scores)
    else:
        data = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data,
                                    model=chunks if len(chunks) > 1 else chunks[0],
                                    num_microbatches=len(micro_batches), seq_length=seq, micro_batch_size=rows,
                                    forward_only=True)
    if model.parallel.pipeline_parallel_size == 1:
        return found
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    if not everywhere:
        return found if last else [None] * len(micro_batches)
    group = ps.get_pipeline_model_parallel_group()
    out = []
    for i, batch in enumerate(micro_batches):
        values = found[i] if last else torch.empty(batch["input_ids"].shape[0], 3, dtype=torch.float32,
                                                   device=device)
        dist.broadcast(values, src=dist.get_process_group_ranks(group)[-1], group=group)
        out.append(values)
    return out


def _interleaved_one_by_one(model, micro_batches: list[dict], found: list, scores: RowScores) -> None:
    """``sequence_scores`` under virtual pipeline stages for a count of micro-batches megatron's interleaved schedule
    does not take (not a multiple of ``pipeline_parallel_size``: an evaluation batch, a precompute batch): each
    through the virtual stages in order (``runtime._interleaved_forward_once``)."""
    from loongforge_hf.bridges.output_layer import hidden_states_out, language_head
    from loongforge_hf.bridges.runtime import _interleaved_forward_once

    head = language_head(list(model.chunks)[-1])
    for batch in micro_batches:
        args, inputs, labels = _model_inputs(model, batch, model.device)
        chunks = model.bound_chunks(inputs).chunks if inputs else list(model.chunks)

        def finish(output, batch=batch, labels=labels):
            vocab = model.config.vocab_size
            return scores(_token_logps(output, labels, head, vocab_size=vocab), batch, labels, output=output,
                          head=head, vocab_size=vocab), None

        store: dict = {}
        with hidden_states_out(chunks):
            _interleaved_forward_once(model, chunks, *args, finish, store, seq=batch["input_ids"].shape[1])
        if "loss" in store:
            found.append(store["loss"])


def _over_context_parallel(values: torch.Tensor, *, grad: bool = False) -> torch.Tensor:
    """Per-row sums over this rank's share of the tokens -> over the whole rows (summed over the context-parallel
    group; unchanged without CP). With ``grad``, differentiable: the backward sums the group's gradients too, so each
    rank's share of the tokens gets CP times its gradient (see ``_PreferenceLoss``)."""
    from loongforge_hf.parallel.context_parallel import cp_group_and_size

    group, size, _ = cp_group_and_size()
    if size == 1:
        return values
    if grad:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(values, group=group)
    values = values.clone()
    dist.all_reduce(values, group=group)
    return values


def _cp_local_tokens(values: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` per-token values of whole rows -> this context-parallel rank's share (as ``_local_inputs``)."""
    from loongforge_hf.parallel.context_parallel import cp_group_and_size, cp_token_index

    _, size, rank = cp_group_and_size()
    if size == 1:
        return values
    return values[:, cp_token_index(values.shape[1], size, rank, device=values.device)]


def _shifted(batch: dict, device) -> torch.Tensor:
    """The batch's shifted labels, per row (``[rows, s]``; a packed batch's unpacked, ``_rows``)."""
    from loongforge_hf.bridges.runtime import shift_labels

    return _rows(batch, shift_labels(batch["labels"].to(device)), -100)


def _rows(batch: dict, values: torch.Tensor, fill: float) -> torch.Tensor:
    """A packed batch's (``padding_free``) per-token ``[1, s]`` values -> ``[rows, longest row]``, right-filled with
    ``fill`` (``row_index``: each row's tokens' places in the packed row, -1 past the row); ``values`` unchanged for
    a batch of rows. Differentiable."""
    index = batch.get("row_index")
    if index is None:
        return values
    index = index.to(values.device)
    return values[0, index.clamp(min=0)].masked_fill(index < 0, fill)


def _halves(batch: dict, rows: int) -> tuple[tuple, tuple, int]:
    """Where the chosen and the rejected rows' tokens are in a micro-batch's ``[b, s]`` tensors (the first and last
    ``rows``; a packed batch's two runs of its row), and the dimension to put them back together along."""
    index = batch.get("row_index")
    if index is None:
        return (slice(0, rows),), (slice(rows, None),), 0
    split = int((index[:rows] >= 0).sum())
    return (slice(None), slice(0, split)), (slice(None), slice(split, None)), 1


def _completion_lengths(batch: dict, device) -> torch.Tensor:
    """Each row's completion tokens (TRL's ``completion_mask`` sums)."""
    return _rows(batch, batch["completion_mask"].to(device), 0).sum(dim=1)


def _local_inputs(batch: dict, device) -> tuple[tuple, torch.Tensor]:
    """((input_ids, position_ids, mask), shifted labels) of a padded or packed (``position_ids``) text batch as the
    engine builds them: this context-parallel rank's share (``parallel.context_parallel.cp_local_inputs``)."""
    from loongforge_hf.bridges.runtime import megatron_attention_mask, shift_labels
    from loongforge_hf.parallel.context_parallel import cp_local_inputs

    input_ids = batch["input_ids"].to(device)
    b, s = input_ids.shape
    positions = batch.get("position_ids")
    mask = megatron_attention_mask(batch.get("attention_mask"), s, positions, device=device)
    positions = torch.arange(s, device=device).expand(b, s) if positions is None else positions.to(device)
    *args, labels = cp_local_inputs(input_ids, positions, mask, shift_labels(batch["labels"].to(device)))
    return tuple(args), labels


def _model_inputs(model, batch: dict, device) -> tuple[tuple, dict, torch.Tensor]:
    """(chunk args, chunk keywords, shifted labels) of a micro-batch as the engine's step builds them: an image-text
    model's own (``megatron_forward_inputs``: the vision inputs as keywords, this context-parallel rank's labels from
    ``megatron_local_labels``), else a text batch's (``_local_inputs``, no keywords)."""
    from loongforge_hf.bridges.runtime import shift_labels

    vision = getattr(model, "megatron_forward_inputs", None)
    if vision is None:
        args, labels = _local_inputs(batch, device)
        return args, {}, labels
    args, inputs = vision(batch)
    return args, inputs, model.megatron_local_labels(shift_labels(batch["labels"].to(device)))


def _token_logps(output: torch.Tensor, labels: torch.Tensor, head, *, vocab_size: int,
                 stats: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[b, s]`` log-probabilities of the (shifted) label tokens, 0 elsewhere: from the final hidden states
    through ``head``'s output layer (fused, chunked, vocab-parallel; ``stats`` gets the entropy and top-1 sums), or
    from TP-local logits when ``head`` is None. Differentiable."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.runtime import IGNORE_INDEX, local_logits_token_stats, output_bias, output_weight
    from loongforge_hf.bridges.runtime import token_losses

    if head is None:
        if stats is not None:
            stats += local_logits_token_stats(output, labels, vocab_size=vocab_size)
        return -token_losses(output, labels, vocab_size=vocab_size)
    from loongforge_hf.kernels.cross_entropy import linear_cross_entropy

    hidden = output.reshape(-1, output.shape[-1])
    losses = linear_cross_entropy(hidden, output_weight(head), labels.reshape(-1),
                                  ignore_index=IGNORE_INDEX, tp_group=ps.get_tensor_model_parallel_group(),
                                  vocab_size=vocab_size, reduction="none", token_stats=stats,
                                  softcap=getattr(head, "logit_softcap", None),
                                  logit_scale=getattr(head, "logit_scale", None), bias=output_bias(head),
                                  low_rank=_head_low_rank(output, hidden, head))
    return -losses.view(labels.shape)


def _head_low_rank(output: torch.Tensor, hidden: torch.Tensor, head) -> tuple | None:
    """The LM head's LoRA term for ``output`` (``runtime.output_low_rank``), drawn once per output and kept on it:
    WPO's weights (``_token_log_sum_sq_probs``) then read the logits the loss read, the same dropout mask."""
    from loongforge_hf.bridges.runtime import output_low_rank

    if "_lora_head_term" in output.__dict__:
        return output._lora_head_term
    term = output_low_rank(head, hidden)
    if torch.is_grad_enabled():  # NOTE: the loss's (differentiable) draw is the one kept
        output._lora_head_term = term
    return term


@torch.no_grad()
def _token_log_sum_sq_probs(output: torch.Tensor, labels: torch.Tensor, head, *, vocab_size: int) -> torch.Tensor:
    """fp32 ``[b, s]``: ``log sum_v p_v^2`` of each label token's predicted distribution (TRL's ``log_sum_sq_probs``,
    ``logsumexp(2 z) - 2 logsumexp(z)``), 0 elsewhere; the logits from ``output`` as ``_token_logps`` makes them
    (through ``head``'s output layer, or TP-local logits when ``head`` is None), a chunk of label tokens at a time:
    each tensor-parallel rank's vocabulary shard gives its max and two sums of exponentials, all-reduced over TP
    (the vocabulary is never gathered)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.runtime import output_weight

    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    valid = (labels != -100).reshape(-1)
    hidden = output.reshape(-1, output.shape[-1])
    rows = hidden[valid]
    weight = output_weight(head) if head is not None else None
    term = _head_low_rank(output, hidden, head) if head is not None else None
    low_rank = None if term is None else (term[0].detach()[valid], term[1].detach())
    v_local = weight.shape[0] if head is not None else rows.shape[1]
    real = max(0, min(v_local, vocab_size - ps.get_tensor_model_parallel_rank() * v_local))
    found = []
    step = max(1, (1 << 24) // max(v_local, 1))  # NOTE: 64 MiB of fp32 logits per chunk
    for start in range(0, rows.shape[0], step):
        part = None if low_rank is None else (low_rank[0][start:start + step], low_rank[1])
        z = _head_logits(rows[start:start + step], weight, head, part)[:, :real]
        top = z.max(dim=-1).values if real else z.new_full((z.shape[0],), float("-inf"))
        if group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = torch.exp(z - top[:, None])
        sums = torch.stack([exp.sum(dim=-1), exp.square().sum(dim=-1)])
        if group is not None:
            dist.all_reduce(sums, group=group)
        found.append(torch.log(sums[1]) - 2 * torch.log(sums[0]))
    out = torch.zeros(valid.shape, dtype=torch.float32, device=output.device)
    if found:
        out[valid] = torch.cat(found)
    return out.view(labels.shape)


def _head_logits(rows: torch.Tensor, weight: torch.Tensor | None, head,
                 low_rank: tuple | None = None) -> torch.Tensor:
    """fp32 TP-local logits of ``rows`` as the fused head makes them (``kernels.cross_entropy``: the GEMM with the
    bias in the input dtype, plus a LoRA adapter's ``low_rank`` term, times ``logit_scale``, upcast, soft-capped), or
    ``rows`` upcast when ``head`` is None."""
    from loongforge_hf.bridges.runtime import output_bias

    if head is None:
        return rows.float()
    bias = output_bias(head)
    z = rows @ weight.t() if bias is None else torch.addmm(bias, rows, weight.t())
    if low_rank is not None:
        z = z.addmm_(low_rank[0], low_rank[1].t())
    scale, cap = getattr(head, "logit_scale", None), getattr(head, "logit_softcap", None)
    if scale is not None:
        z = z * scale
    z = z.float()
    return cap * torch.tanh(z / cap) if cap is not None else z
