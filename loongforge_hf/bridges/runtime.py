"""Running a bridged megatron model like a transformers causal LM: inputs, loss, full-vocabulary logits.

Choices:
- Labels are shifted here (megatron expects next-token labels); ignored positions (-100) are masked, and padded vocab
  columns (rows added to reach a multiple of 128 x TP) are set to -inf before the softmax so they never take
  probability mass: the loss equals transformers' on the real vocabulary.
- Padding in ``attention_mask`` becomes megatron's boolean mask (True = masked) combined with causality.
- Pipeline parallel: megatron's forward-only schedule with one micro-batch; the last stage's loss and logits are
  broadcast over the pipeline group so every rank returns the same output.
- When only the loss is wanted (training; ``forward(labels=..., return_logits=False)``), the language model's output
  layer passes the final hidden states through (``hidden_states_out``) and the loss is the fused, chunked
  ``kernels.cross_entropy.linear_cross_entropy`` of those states and the output weight (tied or not, vocab-parallel
  under TP; its bias too where it has one, Phi's): the ``[b, s, V]`` logits are never built. Under sequence
  parallelism the states are gathered over TP with a backward that keeps this rank's slice, since the kernel already
  all-reduces their gradient.
- With ``logits_to_keep`` (generate's prefill) the output layer computes the kept positions only where that is
  exact, else the logits are cut after it, before the TP gather (``output_layer.head_rows``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge_hf.bridges.output_layer import KeptRows, head_rows, hidden_states_out, keep_rows, language_head
from loongforge_hf.parallel.context_parallel import (cp_group_and_size, cp_local_inputs, cp_loss,
                                                     pipeline_sequence_length)

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def is_packed(position_ids: torch.Tensor | None) -> bool:
    """True when position ids restart inside a row (several documents packed into one sequence)."""
    return position_ids is not None and position_ids.shape[-1] > 1 and bool((position_ids[..., 1:] == 0).any())


def megatron_attention_mask(attention_mask: torch.Tensor | None, seq: int,
                            position_ids: torch.Tensor | None = None, *,
                            device: torch.device | None = None) -> torch.Tensor | None:
    """[b, 1, s, s] megatron mask (True = masked) from an HF padding mask (1 = token) and/or packed position ids
    (a document starts where the position is 0; attention never crosses documents). None when plain causal.
    Whether rows are packed or padded is read from the tensors where they are (host tensors from a collator cost no
    device sync); the mask is built on ``device`` (default: theirs)."""
    packed = is_packed(position_ids)
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    if not packed and not padded:
        return None
    device = device or (attention_mask if attention_mask is not None else position_ids).device
    attention_mask = attention_mask.to(device) if attention_mask is not None else None
    position_ids = position_ids.to(device) if position_ids is not None else None
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    if padded:
        mask = mask | ~attention_mask.bool()[:, None, None, :]
    if packed:
        doc = torch.cumsum((position_ids == 0).int(), dim=-1)
        mask = mask | (doc[:, None, :, None] != doc[:, None, None, :])
    return mask


def mask_padded_vocab(logits: torch.Tensor, *, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Set logits of padded vocab columns of this TP shard to -inf (no-op when the shard has none)."""
    local = logits.shape[-1]
    start = tp_rank * local
    if start + local <= vocab_size:
        return logits
    keep = max(0, vocab_size - start)
    return torch.cat([logits[..., :keep], torch.full_like(logits[..., keep:], float("-inf"))], dim=-1)


def token_losses(local_logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token losses [b, s] from TP-local logits (labels shifted, -100 gives 0; smoothing: see cross_entropy)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(local_logits.float(), vocab_size=vocab_size,
                               tp_rank=ps.get_tensor_model_parallel_rank())
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    # megatron's vocab-parallel CE takes [s, b, v] and [s, b]
    shaped = logits.transpose(0, 1).contiguous()
    if shaped.untyped_storage().data_ptr() == local_logits.untyped_storage().data_ptr():
        # NOTE: that CE works in place on its input (subtracts the max, exponentiates, normalises); fp32 logits of
        # one row on a shard without padded vocab columns reach here uncopied: the caller's logits would become
        # probabilities.
        shaped = shaped.clone()
    losses = vocab_parallel_cross_entropy(shaped, safe.transpose(0, 1).contiguous()).transpose(0, 1)
    if label_smoothing:
        from loongforge_hf.kernels.cross_entropy import smoothing_term
        losses = losses + label_smoothing * smoothing_term(local_logits, safe, vocab_size=vocab_size,
                                                           tp_group=ps.get_tensor_model_parallel_group())
    return losses * valid


def local_logits_token_stats(local_logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """fp32 [entropy sum, top-1 count] of the label tokens, from TP-local logits [b, s, V_local] (labels shifted)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.kernels.cross_entropy import logits_token_stats

    return logits_token_stats(local_logits.detach(), labels, ignore_index=IGNORE_INDEX,
                              tp_group=ps.get_tensor_model_parallel_group(), vocab_size=vocab_size)


def output_weight(head: torch.nn.Module) -> torch.Tensor:
    """The TP-local ``[V_local, h]`` output weight of a language model: the embedding's when tied (with LoRA's
    trainable token rows where they are trained: ``lora/tokens.py``)."""
    if head.share_embeddings_and_output_weights:
        weight = head.shared_embedding_or_output_weight()
        adapter = head.embedding._modules.get("token_adapter") if getattr(head, "pre_process", False) else None
        return weight if adapter is None else adapter.head_weight(weight)
    return head.output_layer.weight


def output_bias(head: torch.nn.Module) -> torch.Tensor | None:
    """The TP-local ``[V_local]`` bias of a language model's output layer (Phi's: ``output_layer.add_output_bias``),
    or None."""
    return getattr(head.output_layer, "bias", None)


def output_low_rank(head: torch.nn.Module, hidden: torch.Tensor) -> tuple | None:
    """A LoRA adapter's term on the output layer for the fused loss (``lora/head.py``): ``(scaling * dropout(hidden)
    @ A^T, B)`` from the ``[N, h]`` hidden states the loss reads (every position on every TP rank), or None (no
    adapter there, or adapters disabled)."""
    lora = head.output_layer._modules.get("lora")
    if lora is None or head.output_layer.__dict__.get("lora_disabled"):
        return None
    from loongforge_hf.lora.head import low_rank_term

    return low_rank_term(lora, hidden)


def fused_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, *,
                   vocab_size: int, weight_grad_dtype: torch.dtype = torch.float32,
                   token_stats: torch.Tensor | None = None, label_smoothing: float = 0.0) -> torch.Tensor:
    """fp32 sum over label tokens of the cross-entropy of ``hidden [b, s, h]`` (from ``hidden_states_out``) through
    ``head``'s output layer (its bias too, where it has one) against shifted ``labels [b, s]``, without the logits
    (``weight_grad_dtype`` and ``token_stats``, ``label_smoothing``: see ``kernels.cross_entropy``)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.kernels.cross_entropy import linear_cross_entropy

    hidden = hidden.reshape(-1, hidden.shape[-1])
    return linear_cross_entropy(hidden, output_weight(head), labels.reshape(-1),
                                ignore_index=IGNORE_INDEX, tp_group=ps.get_tensor_model_parallel_group(),
                                vocab_size=vocab_size, reduction="sum", weight_grad_dtype=weight_grad_dtype,
                                token_stats=token_stats, label_smoothing=label_smoothing,
                                softcap=getattr(head, "logit_softcap", None),
                                logit_scale=getattr(head, "logit_scale", None), bias=output_bias(head),
                                low_rank=output_low_rank(head, hidden))


def _run_chunk(chunk, input_ids, position_ids, mask):
    return chunk(input_ids, position_ids, mask)


def forward_causal_lm(model, *, input_ids, attention_mask, position_ids, labels, return_logits: bool, keep: int = 0):
    """(loss or None, logits or None) with transformers' semantics, on every rank. Any sequence length: the inputs
    are padded to what megatron needs and the logits cut back to the given length; ``keep`` > 0 (``logits_to_keep``,
    no labels): only the last ``keep`` positions' logits, cut before they are gathered over TP and sent over PP."""
    from loongforge_hf.trainer.data import pad_model_inputs

    given = input_ids.shape[-1]
    rows = keep_rows(given, keep if labels is None else 0)
    input_ids, attention_mask, position_ids, labels = pad_model_inputs(
        input_ids, attention_mask, position_ids, labels, multiple=model.parallel.sequence_multiple)
    return forward_padded(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          labels=labels, return_logits=return_logits, rows=rows)


def forward_padded(model, *, input_ids, attention_mask, position_ids, labels, return_logits: bool, rows: slice):
    vocab = model.config.vocab_size
    device = model.device
    input_ids = input_ids.to(device)
    b, s = input_ids.shape
    mask = megatron_attention_mask(attention_mask, s, position_ids, device=device)
    if position_ids is None:
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    position_ids = position_ids.to(device)
    shifted = shift_labels(labels.to(device)) if labels is not None else None
    fused = shifted is not None and not return_logits
    head = language_head(model.chunks[-1]) if fused else None
    count = (shifted != IGNORE_INDEX).sum().clamp(min=1) if shifted is not None else None
    # NOTE: under context parallelism each rank runs its load-balanced share of the tokens (global positions kept
    # for the rope, mask rows cut to its queries) and scores its share of the labels (parallel/context_parallel.py).
    # (none inside context_parallel.whole_sequence_on_every_rank: generate's cached steps)
    cp_group, cp_size, _ = cp_group_and_size()
    input_ids, position_ids, mask, local_labels = cp_local_inputs(input_ids, position_ids, mask, shifted)
    # NOTE: the output layer computes the kept rows only where that is exact (output_layer.KeptRows)
    kept = KeptRows(rows, s, vocab_size=vocab, sequence_parallel=model.megatron.config.sequence_parallel,
                    cut=shifted is None, device=device) if return_logits else None

    def mean(loss_sum):
        return loss_sum / count if cp_size == 1 else cp_loss(loss_sum, count, cp_group)

    def finish(output):
        if fused:
            # NOTE: the output is the final hidden states here (hidden_states_out), not logits.
            return mean(fused_loss_sum(output, local_labels, head, vocab_size=vocab)), None
        loss = None
        if shifted is not None:
            loss = mean(token_losses(output, local_labels, vocab_size=vocab).sum())
        if not return_logits:
            return loss, None
        return loss, kept.logits(output)

    with hidden_states_out(model.chunks) if fused else head_rows(model.chunks, kept.head if kept else None):
        if model.parallel.pipeline_parallel_size == 1:
            return finish(_run_chunk(model.chunks[0], input_ids, position_ids, mask))
        return _forward_pipelined(model, input_ids, position_ids, mask, finish, return_logits, labels is not None,
                                  seq=pipeline_sequence_length(s), rows=rows.stop - rows.start)


def _forward_pipelined(model, input_ids, position_ids, mask, finish, return_logits, want_loss, seq=None, rows=None):
    """``seq``: the global sequence length (``input_ids`` may be a CP share); ``rows``: how many positions' logits."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = input_ids.shape[0], seq or input_ids.shape[1]
    store: dict = {}

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        out = chunk(input_ids, position_ids, mask)

        def loss_func(output):
            loss, logits = finish(output)
            store["loss"], store["logits"] = loss, logits
            return output.sum() * 0.0, {}
        return out, loss_func

    chunks = list(model.chunks)
    with torch.no_grad():
        if len(chunks) == 1:
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=chunks[0],
                                        num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
        else:
            _interleaved_forward_once(model, chunks, input_ids, position_ids, mask, finish, store, seq=s)
    device, dtype, group = model.device, model.dtype, ps.get_pipeline_model_parallel_group()
    last = dist.get_process_group_ranks(group)[-1]
    loss = logits = None
    if want_loss:
        loss = store.get("loss", torch.zeros((), device=device)).detach().float().reshape(()).clone()
        dist.broadcast(loss, src=last, group=group)
    if return_logits:
        logits = store.get("logits")
        if logits is None:
            logits = torch.empty(b, rows or s, model.config.vocab_size, dtype=dtype, device=device)
        logits = logits.detach().contiguous()
        dist.broadcast(logits, src=last, group=group)
    return loss, logits


def _interleaved_forward_once(model, chunks, input_ids, position_ids, mask, finish, store, seq: int) -> None:
    """One micro-batch through virtual stages in order (megatron's interleaved schedule needs >= PP micro-batches).

    Stage order is chunk 0 on pipeline ranks 0..P-1, then chunk 1 on ranks 0..P-1, and so on; activations move with
    point-to-point sends over the pipeline group. ``seq``: the global sequence length (a rank's activations hold
    ``seq / CP`` of it, ``/ TP`` more under sequence parallelism).
    """
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), len(ranks)
    b = input_ids.shape[0]
    cfg = model.megatron.config
    tp = ps.get_tensor_model_parallel_world_size()
    local = seq // ps.get_context_parallel_world_size()
    local = local // tp if cfg.sequence_parallel else local
    for v, chunk in enumerate(chunks):
        first = v == 0 and pp_rank == 0
        last = v == len(chunks) - 1 and pp_rank == pp - 1
        if not first:
            width = getattr(model.megatron, "stage_hidden_size", None) or cfg.hidden_size  # NOTE: stage_boundary.py
            buf = torch.empty(local, b, width, dtype=cfg.params_dtype, device=model.device)
            dist.recv(buf, src=ranks[(pp_rank - 1) % pp])
            chunk.set_input_tensor(buf)
        out = chunk(input_ids, position_ids, mask)
        if last:
            store["loss"], store["logits"] = finish(out)
        else:
            dist.send(out.contiguous(), dst=ranks[(pp_rank + 1) % pp])
