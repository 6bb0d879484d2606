"""Data for LoongTrainer: DataLoaders sharded over data-parallel ranks only, and checks on what the model needs.

Choices:
- The DataLoader is built as transformers.Trainer builds it (same sampler, collator, column removal and DataLoader
  arguments), then sharded by accelerate's ``prepare_data_loader`` over the *data-parallel* group instead of the whole
  world: ranks of one TP / PP / CP group see the same batches. ``TrainingArguments.accelerator_config``'s
  ``split_batches``, ``even_batches`` and ``use_seedable_sampler`` (read from Trainer's Accelerator) apply as
  accelerate applies them over all processes, the data-parallel ranks taking the processes' place: with one
  data-parallel rank the order equals Trainer's on one process, with N that of Trainer on N processes.
- ``even_batches=False`` whose last round of batches leaves some data-parallel ranks one batch short is refused
  (``check_even_shards``): a step would wait on a rank with no batch left (transformers.Trainer waits there too).
- Packing uses transformers' ``DataCollatorWithFlattening`` (position ids restart per document, -100 at document
  boundaries); the model derives the document-causal mask from the restarting position ids, so attention never crosses
  documents.
- A collator or dataset that raises on one rank's rows (a processor refusing image tokens that ``max_length`` cut,
  say) must not leave the other ranks waiting in the step's first collective: training takes the error out of the
  fetch (``fetch_micro_batches``), evaluation out of the collator (``ReportingCollator``), and the batch check that
  every rank runs before any collective (``LoongTrainer._check_batches_everywhere``) raises it on all of them.
"""

from __future__ import annotations

import torch


class DataError(ValueError):
    """A dataset or batch LoongTrainer cannot train on."""


class FailedBatch(dict):
    """What ``ReportingCollator`` hands on where its collator raised: ``{"error": <what it raised>}``."""


class ReportingCollator:
    """``collator``, its exception on this rank's rows returned as a ``FailedBatch`` for the batch check (so every
    rank fails alike) instead of raised here alone."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        try:
            return self.collator(features)
        except Exception as e:  # noqa: BLE001 - raised on every rank by the batch check
            return FailedBatch(error=f"the data collator raised {type(e).__name__}: {e}")


def fetch_micro_batches(iterator, count: int) -> tuple[list, str | None]:
    """Up to ``count`` batches from ``iterator`` (fewer where it ends), and what fetching one raised on this rank
    (None: nothing), for the batch check to raise on every rank."""
    micro = []
    for _ in range(count):
        try:
            micro.append(next(iterator))
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001 - raised on every rank by the batch check
            return micro, f"fetching a training batch raised {type(e).__name__}: {e}"
    return micro, None


def dp_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_data_parallel_rank(with_context_parallel=False),
            ps.get_data_parallel_world_size(with_context_parallel=False))


def shard_over_data_parallel(dataloader, *, args, is_training: bool, accelerator=None):
    """``dataloader`` sharded over the data-parallel ranks with the dataloader settings of ``accelerator`` (Trainer's
    Accelerator; transformers' defaults without one)."""
    import torch.distributed as dist
    from accelerate.data_loader import prepare_data_loader

    rank, size = dp_rank_and_size()
    split = bool(getattr(accelerator, "split_batches", False))
    even = bool(getattr(accelerator, "even_batches", True))
    seedable = bool(getattr(accelerator, "use_seedable_sampler", True))
    rng_types = list(getattr(accelerator, "rng_types", None) or ["generator"])
    if not seedable and is_training and size == 1 and dist.is_initialized() and dist.get_world_size() > 1:
        # NOTE: one data-parallel rank over several processes: accelerate leaves the unseeded sampler, which draws
        # each pass's order from torch's RNG (as Trainer on one process), to each process. Trainer's set_seed puts
        # the ranks' RNGs in step, but a draw made on some ranks only (CPU dropout outside megatron's RNG tracker,
        # under pipeline parallelism) would split their orders: every rank takes rank 0's state as a pass starts.
        rng_types = ["torch"]
    if split and size > 1 and dataloader.batch_size is not None and dataloader.batch_size % size:
        raise DataError(f"accelerator_config split_batches=True splits each batch of {dataloader.batch_size} over the "
                        f"{size} data-parallel ranks: the per-device batch size must be a multiple of {size}.")
    check_even_shards(dataloader, num_ranks=size, split_batches=split, even_batches=even)
    return prepare_data_loader(dataloader, device=None, num_processes=size, process_index=rank,
                               split_batches=split, put_on_device=False, rng_types=rng_types, even_batches=even,
                               use_seedable_sampler=seedable, data_seed=args.data_seed)


def check_even_shards(dataloader, *, num_ranks: int, split_batches: bool, even_batches: bool) -> None:
    """Refuse ``even_batches=False`` where it gives the data-parallel ranks different numbers of batches: accelerate
    then hands out the batches (or, with ``split_batches``, each batch's slices) in turn without filling the last
    round, and a rank left without a batch would not join the others' step. Every rank computes the same verdict
    from the dataset's length alone."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import IterableDataset

    if even_batches or num_ranks == 1 or isinstance(dataloader.dataset, IterableDataset):
        return
    batches = dataloader.batch_sampler
    try:
        total = len(batches)
        samples = len(batches.sampler)
    except (TypeError, AttributeError):
        return  # NOTE: a batch sampler without a length; its shards end where they end
    if split_batches:
        per_rank = batches.batch_size // num_ranks
        last = 0 if batches.drop_last else samples % batches.batch_size
        counts = [total - (1 if last and last <= per_rank * r else 0) for r in range(num_ranks)]
    else:
        counts = [len(BatchSamplerShard(batches, num_processes=num_ranks, process_index=r, even_batches=False))
                  for r in range(num_ranks)]
    if len(set(counts)) > 1:
        raise DataError(f"accelerator_config even_batches=False: {samples} samples in batches of "
                        f"{batches.batch_size}{' split over the ranks' if split_batches else ''} give the "
                        f"{num_ranks} data-parallel ranks {counts} batches, so a step would wait on a rank that has "
                        "none left (transformers.Trainer waits there too). Use even_batches=True (accelerate "
                        "repeats the first samples to fill the last round), dataloader_drop_last=True, or a sample "
                        "count that gives every rank as many batches.")


def check_batch(batch: dict, *, max_positions: int, micro_batch_size: int | None = None) -> None:
    """Clear errors for batches the engine cannot use."""
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise DataError(f"The training batch has no {key!r} column (got {sorted(batch)}). Tokenize the dataset "
                            "and use a collator that sets labels, e.g. DataCollatorForLanguageModeling(mlm=False).")
    ids = batch["input_ids"]
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise DataError(f"input_ids must be a 2-D tensor [batch, seq], got {type(ids).__name__} "
                        f"{getattr(ids, 'shape', '')}.")
    positions = batch.get("position_ids")
    if torch.is_tensor(positions) and positions.shape[-1] == ids.shape[1] and positions.numel():
        # packed rows (position_ids restarting per document): what must fit is each document, not the row
        longest = int(positions.max()) + 1
        if longest > max_positions:
            raise DataError(f"A document of {longest} tokens (position_ids up to {longest - 1}) is longer than the "
                            f"model's max_position_embeddings ({max_positions}); truncate the data before packing.")
    elif ids.shape[1] > max_positions:
        raise DataError(f"Sequence length {ids.shape[1]} is longer than the model's max_position_embeddings "
                        f"({max_positions}); truncate the data (e.g. tokenizer(..., truncation=True, max_length=...)).")


_TEXT_KEYS = {"input_ids", "labels", "attention_mask", "position_ids"}
# NOTE: document boundaries TRL's padding-free collator derives from position_ids for varlen kernels; megatron's
# step reads the documents from position_ids itself, so a padded batch drops them rather than carry stale ones.
_DERIVED_KEYS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}


def pad_micro_batches(micro: list[dict], *, multiple: int, same_length: bool) -> list[dict]:
    """Right-pad text micro-batches to what megatron needs: a sequence length that divides by ``multiple`` (TP under
    sequence parallelism) and, under pipeline parallelism (``same_length``), one length for every micro-batch of the
    step. Pads carry label -100; they are masked out with ``attention_mask`` (made
    when absent), or, for packed rows (``position_ids`` without a mask), form a document of their own (TRL's
    ``cu_seq_lens`` / ``max_length`` / ``seq_idx`` keys are dropped from a padded batch). Batches with other inputs
    (images, ...) are returned unchanged: their collators pad them."""
    lengths = [b["input_ids"].shape[1] for b in micro]
    targets = [-(-n // multiple) * multiple for n in lengths]
    if same_length:
        targets = [max(targets)] * len(targets)
    if targets == lengths or any(set(b) - _TEXT_KEYS - _DERIVED_KEYS for b in micro):
        return micro
    out = []
    for b, n, target in zip(micro, lengths, targets):
        extra = target - n
        if extra == 0:
            out.append(b)
            continue
        ids = b["input_ids"]
        rows = ids.shape[0]

        def pad(t, value):
            return torch.cat([t, torch.full((*t.shape[:-1], extra), value, dtype=t.dtype, device=t.device)], dim=-1)

        padded = {"input_ids": pad(ids, 0), "labels": pad(b["labels"], -100)}
        if "attention_mask" in b or "position_ids" not in b:
            mask = b.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            padded["attention_mask"] = pad(mask, 0)
        if "position_ids" in b:
            pos = b["position_ids"]
            tail = torch.arange(extra, dtype=pos.dtype, device=pos.device).expand(*pos.shape[:-1], extra)
            padded["position_ids"] = torch.cat([pos, tail], dim=-1)
        assert padded["input_ids"].shape == (rows, target)
        out.append(padded)
    return out


def pad_model_inputs(input_ids, attention_mask, position_ids, labels, *, multiple: int):
    """A forward's inputs right-padded to a length that divides by ``multiple`` (``ParallelConfig.sequence_multiple``:
    2 x CP under context parallelism, TP under sequence parallelism) as ``pad_micro_batches`` pads a training
    micro-batch: labels -100, pads masked out or, for packed rows, a document of their own. Causal attention keeps the
    pads out of the real tokens' outputs. Returned as given when the length already divides."""
    if input_ids.shape[-1] % multiple == 0:
        return input_ids, attention_mask, position_ids, labels
    batch = {"input_ids": input_ids,
             "labels": labels if labels is not None else torch.full_like(input_ids, -100)}
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    if position_ids is not None:
        batch["position_ids"] = position_ids
    (padded,) = pad_micro_batches([batch], multiple=multiple, same_length=False)
    return (padded["input_ids"], padded.get("attention_mask"), padded.get("position_ids"),
            padded["labels"] if labels is not None else None)
