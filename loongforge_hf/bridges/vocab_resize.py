"""Resizing a loaded model's vocabulary in place: transformers' ``resize_token_embeddings`` on megatron's
vocabulary-parallel embedding and output layer (TRL's ``clone_chat_template``, users adding special tokens).

Choices:
- The size is transformers': ``new_num_tokens`` rounded up to ``pad_to_multiple_of``; that is the new
  ``config.vocab_size`` (what ``save_pretrained`` writes, what the loss and logits mask to). megatron's copy is padded
  again to a multiple of 128 x TP with zero rows, as at load.
- Each stage holding the embedding or an untied output layer gathers that tensor's tensor-parallel slices (the whole
  matrix, as transformers holds it on one device), builds the new matrix and keeps its own rows: the padded size
  changes the rows each TP rank holds, so rows move between ranks.
- Added rows are transformers' own numbers for the same seed: with ``mean_resizing`` drawn from a normal with the
  old rows' mean and 1e-9 x their covariance (their mean alone where that covariance is not positive definite),
  otherwise from normal(0, ``initializer_range``), from the default generator of the model's device in
  transformers' order and amounts (``_added_rows``): transformers draws on the device its model is on, so the rows
  equal those of a transformers model resized on the same kind of device after the same seed (a CPU-loaded one
  draws others: ``trl.SFTTrainer`` given a model object loads nothing to the GPU before it clones a template).
  Global rank 0 draws them and broadcasts them, so every tensor- and data-parallel rank builds the same rows; the
  other ranks make the same draws, so every generator moves on alike.
- A tied output layer's copy on the last pipeline stage gets the first stage's new matrix through megatron's
  embedding group, as megatron sets that copy up at build (zeros, then an all-reduce).
- The parameters keep their identity (``weight.data`` is replaced, as transformers does): the attributes megatron set
  on them (partitioning, shared embedding) and ``requires_grad`` stay.
- Refused before any collective, with the same message on every rank: sizes that are not positive integers, a model
  held by a training engine (its gradient buffers and optimizer state are sized at wrap), a LoRA model (its
  ``modules_to_save`` copies and adapter files are sized at wrap: resize first, as with PEFT), a model whose LM head
  has a bias (Phi's: transformers draws its added rows in its own way, not reproduced here).
"""

from __future__ import annotations

import math

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
    chunks = language_chunks(model)
    first = next((c for c in chunks if getattr(c, "pre_process", False)), None)
    last = next((c for c in chunks if getattr(c, "post_process", False)), None)
    head = last.output_layer.weight if last is not None and not model.bridge.tied else None
    embedding_rows = None if first is None else _whole(first.embedding.word_embeddings.weight, old)
    head_rows = None if head is None else _whole(head, old)
    added = _added_rows(model, embedding_rows, head_rows, old=old, new=new_size, mean_resizing=mean_resizing,
                        std=float(getattr(text, "initializer_range", 0.02)))
    if first is not None:
        embedding = first.embedding.word_embeddings
        embedding.weight.data = _local_rows(embedding_rows, added[0], new=new_size, padded=padded)
        embedding.num_embeddings, embedding.num_embeddings_per_partition = padded, per_rank
        embedding.vocab_start_index, embedding.vocab_end_index = tp_rank * per_rank, (tp_rank + 1) * per_rank
        first.embedding.vocab_size = padded
    tied_copy = None
    if last is not None:
        layer = last.output_layer
        if head is not None:
            head.data = _local_rows(head_rows, added[1], new=new_size, padded=padded)
        elif layer.weight is not None:  # NOTE: tied, the last stage's copy of the embedding
            layer.weight.data = layer.weight.data.new_zeros(per_rank, layer.weight.shape[1])
            tied_copy = layer.weight
        layer.output_size, layer.output_size_per_partition = padded, per_rank
    for chunk in chunks:
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


def _whole(weight: torch.Tensor, old: int) -> torch.Tensor:
    """The first ``old`` rows of a vocabulary-parallel ``weight``, gathered over tensor parallelism."""
    from megatron.core import parallel_state as ps

    local = weight.data.contiguous()
    if ps.get_tensor_model_parallel_world_size() == 1:
        return local[:old]
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts)[:old]


def _local_rows(whole: torch.Tensor, added: torch.Tensor | None, *, new: int, padded: int) -> torch.Tensor:
    """This TP rank's slice of the ``[padded, H]`` matrix: the kept rows, the added ones, zero rows."""
    from megatron.core import parallel_state as ps

    rows = [whole[:new]]
    if added is not None:
        rows.append(added.to(device=whole.device, dtype=whole.dtype))
    rows.append(whole.new_zeros(padded - new, whole.shape[1]))
    per_rank = padded // ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * per_rank
    return torch.cat(rows)[start:start + per_rank].clone()


def _added_rows(model, embedding: torch.Tensor | None, head: torch.Tensor | None, *, old: int, new: int,
                mean_resizing: bool, std: float) -> tuple:
    """(embedding rows, untied LM head rows) to append, ``[new - old, H]`` fp32 each ((None, None) when not growing).

    Drawn as transformers draws them, from the default generator, in its order and amounts (the new embedding's own
    initialisation, then its added rows; the new LM head's, then its rows): global rank 0 keeps its values and
    broadcasts them, every other rank makes the same draws and drops them, so that each rank's generator moves on as
    rank 0's (LoRA then draws its initial adapters alike on every rank). Under pipeline parallelism the last stage
    sends rank 0 the LM head's mean and covariance."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.xpu import get_backend

    if new <= old:
        return None, None
    rank = dist.get_rank() if dist.is_initialized() else 0
    untied = not model.bridge.tied
    hidden = model.config.get_text_config().hidden_size
    device, dtype = get_backend().device(), model.dtype
    moments: list = [None, None]
    if mean_resizing and rank == 0:
        moments[0] = _moments(embedding)
    if mean_resizing and untied:
        if head is not None and rank == 0:
            moments[1] = _moments(head)
        elif ps.get_pipeline_model_parallel_world_size() > 1:  # NOTE: the LM head is on the last stage
            if rank == 0:
                moments[1] = (torch.empty(hidden, device=device), torch.empty(hidden, hidden, device=device))
                for t in moments[1]:
                    dist.recv(t, src=ps.get_pipeline_model_parallel_last_rank())
            elif head is not None and ps.get_pipeline_model_parallel_first_rank() == 0:
                for t in _moments(head):
                    dist.send(t.contiguous(), dst=0)
    # NOTE: whether each covariance is positive definite decides whether transformers draws: rank 0's verdict
    definite = torch.tensor([_definite(m) for m in moments], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(definite, src=0)
    rows = []
    for part, init in enumerate(("embedding", "linear")[:1 + untied]):
        fresh = torch.empty(new, hidden, device=device, dtype=dtype)
        if init == "embedding":  # NOTE: nn.Embedding's and nn.Linear's own initialisation of the new module
            fresh.normal_()
        else:
            torch.nn.init.kaiming_uniform_(fresh, a=math.sqrt(5))
        if not mean_resizing:  # NOTE: transformers' _init_weights of the whole new module
            rows.append(fresh.normal_(0.0, std)[old:].float())
        elif not definite[part]:
            rows.append(moments[part][0][None, :].repeat(new - old, 1) if rank == 0 else
                        torch.empty(new - old, hidden, device=device))
        else:
            rows.append(_sample(moments[part], new - old, dtype) if rank == 0 else
                        torch.empty(new - old, hidden, device=device).normal_())
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in rows:
            dist.broadcast(t, src=0)
    return rows[0], rows[1] if untied else None


def _moments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and covariance (fp32) of a vocabulary matrix's rows, computed as transformers computes them."""
    values = rows.to(torch.float32)
    mean = torch.mean(values, dim=0)
    centered = values - mean
    return mean, centered.T @ centered / values.shape[0]


def _definite(moments) -> bool:
    """Whether 1e-9 x the covariance is positive definite (transformers draws only then)."""
    return moments is not None and int(torch.linalg.cholesky_ex(_COVARIANCE_SCALE * moments[1]).info) == 0


def _sample(moments, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` rows from a normal with the moments' mean and 1e-9 x their covariance, rounded to ``dtype``."""
    mean, covariance = moments
    normal = torch.distributions.MultivariateNormal(mean, covariance_matrix=_COVARIANCE_SCALE * covariance)
    return normal.sample(sample_shape=(count,)).to(dtype).float()


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
