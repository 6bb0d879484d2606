"""Running a bridged megatron model like a transformers causal LM: inputs, loss, full-vocabulary logits.

Choices:
- Labels are shifted here (megatron expects next-token labels); ignored positions (-100) are masked, and padded vocab
  columns (rows added to reach a multiple of 128 x TP) are set to -inf before the softmax so they never take
  probability mass: the loss equals transformers' on the real vocabulary.
- Padding in ``attention_mask`` becomes megatron's boolean mask (True = masked) combined with causality.
- Pipeline parallel: megatron's forward-only schedule with one micro-batch; the last stage's loss and logits are
  broadcast over the pipeline group so every rank returns the same output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def is_packed(position_ids: torch.Tensor | None) -> bool:
    """True when position ids restart inside a row (several documents packed into one sequence)."""
    return position_ids is not None and position_ids.shape[-1] > 1 and bool((position_ids[..., 1:] == 0).any())


def megatron_attention_mask(attention_mask: torch.Tensor | None, seq: int,
                            position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """[b, 1, s, s] megatron mask (True = masked) from an HF padding mask (1 = token) and/or packed position ids
    (a document starts where the position is 0; attention never crosses documents). None when plain causal."""
    packed = is_packed(position_ids)
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    if not packed and not padded:
        return None
    device = (attention_mask if attention_mask is not None else position_ids).device
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


def token_losses(local_logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Per-token losses [b, s] from TP-local logits (labels already shifted; ignored tokens give 0)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(local_logits.float(), vocab_size=vocab_size,
                               tp_rank=ps.get_tensor_model_parallel_rank())
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    # megatron's vocab-parallel CE takes [s, b, v] and [s, b]
    losses = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), safe.transpose(0, 1).contiguous())
    return losses.transpose(0, 1) * valid


def full_logits(local_logits: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(local_logits)[..., :vocab_size]


def _run_chunk(chunk, input_ids, position_ids, mask):
    return chunk(input_ids, position_ids, mask)


def forward_causal_lm(model, *, input_ids, attention_mask, position_ids, labels, return_logits: bool):
    """(loss or None, logits or None) with transformers' semantics, on every rank."""
    from megatron.core import parallel_state as ps

    vocab = model.config.vocab_size
    device = model.device
    input_ids = input_ids.to(device)
    b, s = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    position_ids = position_ids.to(device)
    mask = megatron_attention_mask(attention_mask.to(device) if attention_mask is not None else None, s,
                                   position_ids)
    shifted = shift_labels(labels.to(device)) if labels is not None else None

    def finish(local_logits):
        loss = None
        if shifted is not None:
            per_token = token_losses(local_logits, shifted, vocab_size=vocab)
            loss = per_token.sum() / (shifted != IGNORE_INDEX).sum().clamp(min=1)
        logits = full_logits(local_logits, vocab_size=vocab) if return_logits else None
        return loss, logits

    if model.parallel.pipeline_parallel_size == 1:
        return finish(_run_chunk(model.chunks[0], input_ids, position_ids, mask))
    return _forward_pipelined(model, input_ids, position_ids, mask, finish, return_logits, labels is not None)


def _forward_pipelined(model, input_ids, position_ids, mask, finish, return_logits, want_loss):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = input_ids.shape
    store: dict = {}

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        out = chunk(input_ids, position_ids, mask)

        def loss_func(output):
            loss, logits = finish(output)
            store["loss"], store["logits"] = loss, logits
            zero = output.sum() * 0.0
            return zero, {}
        return out, loss_func

    chunks = list(model.chunks)
    with torch.no_grad():
        if len(chunks) == 1:
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=chunks[0],
                                        num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
        else:
            _interleaved_forward_once(model, chunks, input_ids, position_ids, mask, finish, store)
    device, dtype = model.device, model.dtype
    last = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]
    group = ps.get_pipeline_model_parallel_group()
    loss = logits = None
    if want_loss:
        loss = store.get("loss", torch.zeros((), device=device)).detach().float().reshape(())
        loss = loss.clone()
        dist.broadcast(loss, src=last, group=group)
    if return_logits:
        logits = store.get("logits")
        if logits is None:
            logits = torch.empty(b, s, model.config.vocab_size, dtype=dtype, device=device)
        logits = logits.detach().contiguous()
        dist.broadcast(logits, src=last, group=group)
    return loss, logits


def _interleaved_forward_once(model, chunks, input_ids, position_ids, mask, finish, store) -> None:
    """One micro-batch through virtual stages in order (megatron's interleaved schedule needs >= PP micro-batches).

    Stage order is chunk 0 on pipeline ranks 0..P-1, then chunk 1 on ranks 0..P-1, and so on; activations move with
    point-to-point sends over the pipeline group.
    """
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), len(ranks)
    b, s = input_ids.shape
    cfg = model.megatron.config
    tp = ps.get_tensor_model_parallel_world_size()
    seq = s // tp if cfg.sequence_parallel else s
    for v, chunk in enumerate(chunks):
        first = v == 0 and pp_rank == 0
        last = v == len(chunks) - 1 and pp_rank == pp - 1
        if not first:
            buf = torch.empty(seq, b, cfg.hidden_size, dtype=cfg.params_dtype, device=model.device)
            dist.recv(buf, src=ranks[(pp_rank - 1) % pp])
            chunk.set_input_tensor(buf)
        out = chunk(input_ids, position_ids, mask)
        if last:
            store["loss"], store["logits"] = finish(out)
        else:
            dist.send(out.contiguous(), dst=ranks[(pp_rank + 1) % pp])
