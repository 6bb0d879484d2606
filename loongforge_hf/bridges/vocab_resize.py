"""Resizing a loaded model's vocabulary in place: transformers' ``resize_token_embeddings`` on megatron's
vocabulary-parallel embedding and output layer (TRL's ``clone_chat_template``, users adding special tokens).

Choices:
- The size is transformers': ``new_num_tokens`` rounded up to ``pad_to_multiple_of``; that is the new
  ``config.vocab_size`` (what ``save_pretrained`` writes, what the loss and logits mask to). megatron's copy is padded
  again to a multiple of 128 x TP with zero rows, as at load.
- Each stage holding the embedding or an untied output layer gathers that tensor's tensor-parallel slices (the whole
  matrix, as transformers holds it on one device), builds the new matrix and keeps its own rows: the padded size
  changes the rows each TP rank holds, so rows move between ranks.
- Added rows are drawn as transformers draws them: with ``mean_resizing`` from a normal with the old rows' mean and
  1e-9 x their covariance (their mean alone where that covariance is not positive definite), otherwise from
  normal(0, ``initializer_range``). The seed comes from global rank 0's default generator (one broadcast), so every
  tensor- and data-parallel rank builds the same rows; the output layer draws from the next seed.
- A tied output layer's copy on the last pipeline stage gets the first stage's new matrix through megatron's
  embedding group, as megatron sets that copy up at build (zeros, then an all-reduce).
- The parameters keep their identity (``weight.data`` is replaced, as transformers does): the attributes megatron set
  on them (partitioning, shared embedding) and ``requires_grad`` stay.
- Refused before any collective, with the same message on every rank: sizes that are not positive integers, a model
  held by a training engine (its gradient buffers and optimizer state are sized at wrap), a LoRA model (its
  ``modules_to_save`` copies and adapter files are sized at wrap: resize first, as with PEFT).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge_hf.bridges.transforms import padded_vocab_size

_COVARIANCE_SCALE = 1e-9  # transformers' epsilon: added rows stay at the old rows' mean up to a tiny spread


def resized_vocab_size(current: int, new_num_tokens, pad_to_multiple_of) -> int:
    """The vocabulary size transformers' ``resize_token_embeddings`` gives (ValueError on bad sizes)."""
    for name, value in (("new_num_tokens", new_num_tokens), ("pad_to_multiple_of", pad_to_multiple_of)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"resize_token_embeddings: {name} must be a positive integer or None, got {value!r}.")
    size = current if new_num_tokens is None else new_num_tokens
    if pad_to_multiple_of is not None:
        size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
    return size


def resize_vocabulary(model, new_size: int, *, mean_resizing: bool) -> None:
    """Give every chunk of ``model`` (a ``LoongModelForCausalLM``) a ``new_size``-token vocabulary. Collective: every
    rank calls it."""
    from megatron.core import parallel_state as ps

    text = model.config.get_text_config()
    old = text.vocab_size
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    padded = padded_vocab_size(new_size, tensor_parallel_size=tp)
    per_rank = padded // tp
    seed = _shared_seed()
    std = float(getattr(text, "initializer_range", 0.02))
    tied_copy = None
    for chunk in language_chunks(model):
        if getattr(chunk, "pre_process", False):
            embedding = chunk.embedding.word_embeddings
            _replace_rows(embedding.weight, old=old, new=new_size, padded=padded, seed=seed,
                          mean_resizing=mean_resizing, std=std)
            embedding.num_embeddings, embedding.num_embeddings_per_partition = padded, per_rank
            embedding.vocab_start_index, embedding.vocab_end_index = tp_rank * per_rank, (tp_rank + 1) * per_rank
            chunk.embedding.vocab_size = padded
        head = chunk.output_layer if getattr(chunk, "post_process", False) else None
        if head is not None:
            if head.weight is not None and model.bridge.tied:  # NOTE: the last stage's copy of the embedding
                head.weight.data = head.weight.data.new_zeros(per_rank, head.weight.shape[1])
                tied_copy = head.weight
            elif head.weight is not None:
                _replace_rows(head.weight, old=old, new=new_size, padded=padded, seed=seed + 1,
                              mean_resizing=mean_resizing, std=std)
            head.output_size, head.output_size_per_partition = padded, per_rank
        chunk.vocab_size = padded
    if model.bridge.tied and ps.get_pipeline_model_parallel_world_size() > 1:
        _sync_tied_copy(model, tied_copy)
    for holder in (model.megatron, getattr(model, "language_model", None)):  # NOTE: a VLM keeps two views
        if holder is not None:
            holder.padded_vocab = padded
    for config in (text, model.config):  # NOTE: loongforge's VLMs mirror vocab_size on the top-level config
        if hasattr(config, "vocab_size"):
            config.vocab_size = new_size


def language_chunks(model) -> list:
    """megatron's language-model module of each chunk (a vision-language chunk wraps one)."""
    return [getattr(chunk, "language", chunk) for chunk in model.chunks]


def _shared_seed() -> int:
    """A seed drawn from global rank 0's default generator, the same on every rank."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [seed]
        dist.broadcast_object_list(box, src=0)
        seed = box[0]
    return seed


def _replace_rows(weight: torch.Tensor, *, old: int, new: int, padded: int, seed: int, mean_resizing: bool,
                  std: float) -> None:
    """This TP rank's slice of the ``[padded, H]`` matrix: the first ``min(old, new)`` rows of the gathered old
    matrix, added rows up to ``new``, zero rows up to ``padded``."""
    from megatron.core import parallel_state as ps

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    local = weight.data.contiguous()
    parts = [local]
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local, group=group)
    whole = torch.cat(parts)[:old]
    rows = [whole[:min(old, new)]]
    if new > old:
        rows.append(added_rows(whole, new - old, seed=seed, mean_resizing=mean_resizing, std=std).to(local.dtype))
    rows.append(local.new_zeros(padded - new, local.shape[1]))
    per_rank = padded // tp
    start = ps.get_tensor_model_parallel_rank() * per_rank
    weight.data = torch.cat(rows)[start:start + per_rank].clone()


def added_rows(old_rows: torch.Tensor, count: int, *, seed: int, mean_resizing: bool, std: float) -> torch.Tensor:
    """``count`` new rows (fp32) for a vocabulary matrix whose existing rows are ``old_rows``, drawn with ``seed``."""
    generator = torch.Generator(device=old_rows.device).manual_seed(seed)
    noise = torch.randn(count, old_rows.shape[1], generator=generator, device=old_rows.device, dtype=torch.float32)
    if not mean_resizing:
        return noise * std
    rows = old_rows.float()
    mean = rows.mean(dim=0)
    centered = rows - mean
    covariance = centered.T @ centered / rows.shape[0]
    factor, info = torch.linalg.cholesky_ex(_COVARIANCE_SCALE * covariance)
    if int(info) != 0:  # NOTE: not positive definite (fewer rows than dimensions, a constant column): the mean
        return mean.expand(count, -1).clone()
    return mean + noise @ factor.T


def _sync_tied_copy(model, tied_copy) -> None:
    """Under pipeline parallelism a tied output layer is a copy of the embedding on the last stage: the first stage's
    new matrix reaches it through megatron's embedding group (the copy is zero, the sum is the embedding)."""
    from megatron.core import parallel_state as ps

    if not ps.is_rank_in_embedding_group(ignore_virtual=True):
        return
    weight = tied_copy
    if weight is None:
        weight = next(c.embedding.word_embeddings.weight for c in language_chunks(model)
                      if getattr(c, "pre_process", False))
    dist.all_reduce(weight.data, group=ps.get_embedding_group())
