"""Data-parallel load balancing inside LoongTrainer: the same samples per step, spread so that ranks finish together.

Choices:
- A step's global batch is exactly what the unbalanced loader gives the data-parallel ranks for that step:
  accelerate's ``BatchSamplerShard`` for every rank, over one pass of the same seeded batch sampler (the sampler is
  iterated once per epoch, its batches shared between the ranks' shards). Every rank reads the whole global batch
  from the dataset (token ids are cheap), in the DataLoader's worker processes when there are any, so no data
  crosses the network. Every rank plans every step the same deterministic way; a checksum of the plan is all-reduced
  per step, and a mismatch (e.g. a dataset whose examples change length from one read to the next) raises on every
  rank.
- ``plan_step`` redistributes the samples with ``balance`` under a cost model from the HF config
  (``CostModel.from_model_dims``), optionally refit from measured times (``balance_refit``). The gradient is unchanged
  because megatron divides the summed per-token loss by the step's global label-token count, whoever holds the
  tokens.
- Each rank keeps as many micro-batches as it had (``gradient_accumulation_steps``, fewer only in an epoch's last
  step), so a rank gets at least that many samples; they are split over the micro-batches by cost, heaviest first
  onto the lightest (LPT), and packed by the user's collator.
- No packed micro-batch becomes longer than the longest one of the unbalanced step (same peak activation memory, same
  ``max_position_embeddings`` check). A step already within ``tolerance``, or one where no assignment found under
  these constraints beats the unbalanced one's slowest rank, keeps the unbalanced assignment and micro-batches.
- Applies to collators that pack a micro-batch into one row without padding between samples
  (``packs_without_padding``: ``DataCollatorWithFlattening``, TRL's SFT collator in padding-free mode); padded batches
  train unbalanced (why: ``packs_without_padding``). A TRL-packed example (bfd: several documents, ``seq_lengths``) is
  priced by its total length, which over-counts its attention; bfd fills examples to about ``max_length``, so they
  cost about the same anyway.
- Applies to map-style datasets with a sequential or seeded random sampler (what Trainer builds); anything else (an
  IterableDataset, a custom or rank-dependent sampler) trains unbalanced, with a warning.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import zlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, SequentialSampler
from torch.utils.data._utils.pin_memory import pin_memory

from loongforge_hf.bridges.config_map import kv_heads_of
from loongforge_hf.trainer.balance import CostModel, balance, imbalance
from loongforge_hf.trainer.data import DataError, dp_rank_and_size

logger = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 0.02


# ---- the plan of one step (pure) ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepPlan:
    """Which samples each data-parallel rank packs into each of its micro-batches for one step.

    Samples are numbered by their position in the step's rank-major order (rank 0's micro-batches, then rank 1's, ...
    as the unbalanced loader had them); ``micro_batches[r][m]`` are the positions in rank r's micro-batch m, ascending.
    """

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    imbalance_before: float
    imbalance_after: float
    rebalanced: bool

    def rank_positions(self, rank: int) -> list[int]:
        return [p for micro in self.micro_batches[rank] for p in micro]

    def fingerprint(self, lengths: Sequence[int]) -> int:
        """A checksum of the sample lengths and the assignment: equal on every rank that planned the same step."""
        parts = [np.asarray(lengths, dtype=np.int64)]
        for rank in self.micro_batches:
            for micro in rank:
                parts.append(np.asarray((*micro, -1), dtype=np.int64))
            parts.append(np.asarray((-2,), dtype=np.int64))
        return zlib.crc32(np.concatenate(parts).tobytes())


def plan_step(lengths: Sequence[Sequence[Sequence[int]]], *, cost: CostModel,
              tolerance: float = DEFAULT_TOLERANCE) -> StepPlan:
    """Balance one step. ``lengths[r][m]`` are the token counts of the samples the unbalanced loader put in
    data-parallel rank r's micro-batch m (every rank has the same number of micro-batches, none empty)."""
    num_ranks = len(lengths)
    if num_ranks == 0 or any(len(rank) != len(lengths[0]) for rank in lengths):
        raise ValueError("plan_step: every rank needs the same number of micro-batches, got "
                         f"{[len(rank) for rank in lengths]}")
    if any(len(micro) == 0 for rank in lengths for micro in rank):
        raise ValueError("plan_step: a micro-batch has no samples")
    num_micro = len(lengths[0])
    flat = np.asarray([n for rank in lengths for micro in rank for n in micro], dtype=np.int64)
    costs = np.asarray(cost(flat), dtype=np.float64)
    original, position = [], 0
    for rank in lengths:
        micros = []
        for micro in rank:
            micros.append(tuple(range(position, position + len(micro))))
            position += len(micro)
        original.append(tuple(micros))
    owner = np.repeat(np.arange(num_ranks), [sum(len(m) for m in rank) for rank in lengths])
    before_costs = _rank_costs(owner, costs, num_ranks)
    before = imbalance(before_costs)
    keep = StepPlan(tuple(original), before, before, rebalanced=False)
    if before <= 1 + tolerance:
        return keep
    cap = max(sum(micro) for rank in lengths for micro in rank)
    try:
        assignment = balance(flat.tolist(), num_ranks=num_ranks, cost=cost, max_tokens_per_rank=num_micro * cap,
                             tolerance=tolerance, input_layout="contiguous")
    except ValueError:  # no assignment found under the token cap: keep the unbalanced one
        return keep
    owner = np.empty(flat.size, dtype=np.int64)
    for rank, members in enumerate(assignment.ranks):
        owner[list(members)] = rank
    _give_each_rank_at_least(owner, costs, num_ranks, num_micro)
    after_costs = _rank_costs(owner, costs, num_ranks)
    if after_costs.max() >= before_costs.max():
        return keep
    split = [_split_into_micro_batches(np.flatnonzero(owner == rank), num_micro, costs, flat, cap)
             for rank in range(num_ranks)]
    if any(s is None for s in split):
        return keep
    return StepPlan(tuple(split), before, imbalance(after_costs), rebalanced=True)


def _rank_costs(owner: np.ndarray, costs: np.ndarray, num_ranks: int) -> np.ndarray:
    # NOTE: summed in sample order for every assignment, so the before/after comparison is exact.
    return np.bincount(owner, weights=costs, minlength=num_ranks).astype(np.float64)


def _give_each_rank_at_least(owner: np.ndarray, costs: np.ndarray, num_ranks: int, minimum: int) -> None:
    """Move the cheapest samples of ranks that can spare one onto ranks with fewer than ``minimum`` (in place)."""
    counts = np.bincount(owner, minlength=num_ranks)
    while counts.min() < minimum:
        short = int(np.argmin(counts))
        spare = np.flatnonzero(counts[owner] > minimum)
        i = int(spare[np.argmin(costs[spare])])
        counts[owner[i]] -= 1
        counts[short] += 1
        owner[i] = short


def _split_into_micro_batches(positions: np.ndarray, num_micro: int, costs: np.ndarray, lengths: np.ndarray,
                              cap: int) -> tuple[tuple[int, ...], ...] | None:
    """LPT over ``num_micro`` micro-batches of at most ``cap`` tokens; None when a sample fits nowhere.

    Heap keys are (cost, count, index): an empty micro-batch comes first, and any one sample fits an empty one
    (cap is the longest unbalanced micro-batch), so every micro-batch gets a sample.
    """
    heap = [(0.0, 0, m) for m in range(num_micro)]
    tokens = [0] * num_micro
    members: list[list[int]] = [[] for _ in range(num_micro)]
    for p in sorted(positions.tolist(), key=lambda q: (-costs[q], q)):
        passed = []
        while heap and tokens[heap[0][2]] + int(lengths[p]) > cap:
            passed.append(heapq.heappop(heap))
        if not heap:
            return None
        load, count, m = heapq.heappop(heap)
        members[m].append(p)
        tokens[m] += int(lengths[p])
        heapq.heappush(heap, (load + float(costs[p]), count + 1, m))
        for entry in passed:
            heapq.heappush(heap, entry)
    return tuple(sorted((tuple(sorted(m)) for m in members), key=lambda m: m[0]))


# ---- the global batch of each step, as the unbalanced loader shards it --------------------------------------------
class _OnePass:
    """One pass over shared batches, with the attributes ``BatchSamplerShard`` reads from a batch sampler."""

    def __init__(self, batches: Iterator[list[int]], like: BatchSampler) -> None:
        self._batches = batches
        self.batch_size = like.batch_size
        self.drop_last = like.drop_last

    def __iter__(self):
        # NOTE: a copy of each batch: BatchSamplerShard completes the epoch's last batch in place (``batch += ...``),
        # which must not leak into the other ranks' shards.
        return (list(batch) for batch in self._batches)


class GlobalStepIndices(Sampler):
    """Per optimizer step, the dataset indices of every data-parallel rank's micro-batches: ``key[r][m]``.

    ``shard`` is one rank's ``BatchSamplerShard`` (from ``prepare_data_loader``); the inner batch sampler is iterated
    once per pass and its batches are given to a ``BatchSamplerShard`` per rank, so each rank's share is exactly what
    accelerate gives that rank.
    """

    def __init__(self, shard, *, num_ranks: int, micro_per_step: int) -> None:
        self._shard, self._num_ranks, self._micro = shard, num_ranks, micro_per_step

    def __len__(self) -> int:
        return -(-len(self._shard) // self._micro)

    def __iter__(self):
        from accelerate.data_loader import BatchSamplerShard

        inner = self._shard.batch_sampler
        copies = itertools.tee(iter(inner), self._num_ranks)
        shards = [iter(BatchSamplerShard(_OnePass(copy, inner), num_processes=self._num_ranks, process_index=r,
                                         split_batches=False, even_batches=self._shard.even_batches))
                  for r, copy in enumerate(copies)]
        rounds = []
        for batches in itertools.zip_longest(*shards):
            if any(b is None for b in batches):
                raise RuntimeError("GlobalStepIndices: the data-parallel shards ended after different numbers of "
                                   "batches; accelerate's even_batches (or data.check_even_shards without it) "
                                   "should prevent this.")
            rounds.append(batches)
            if len(rounds) == self._micro:
                yield _by_rank(rounds)
                rounds = []
        if rounds:
            yield _by_rank(rounds)


def _by_rank(rounds: list[tuple[list[int], ...]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(tuple(r[rank]) for r in rounds) for rank in range(len(rounds[0])))


class _GlobalBatches(Dataset):
    """``dataset[key]`` for a ``GlobalStepIndices`` key: the examples, nested like the key."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, key):
        flat = [i for rank in key for micro in rank for i in micro]
        getitems = getattr(self.dataset, "__getitems__", None)
        examples = iter(getitems(flat) if getitems is not None else [self.dataset[i] for i in flat])
        return [[[next(examples) for _ in micro] for micro in rank] for rank in key]


def _as_is(item):
    return item


def _length(example) -> int:
    try:
        return len(example["input_ids"])
    except (KeyError, TypeError, IndexError) as err:
        keys = sorted(example) if isinstance(example, dict) else type(example).__name__
        raise DataError(f"DP load balancing measures each example by its 'input_ids' (got {keys}); tokenize the "
                        "dataset, or turn balancing off with dp_load_balance=False.") from err


# ---- the loader ---------------------------------------------------------------------------------------------------
class BalancedDataLoader:
    """This data-parallel rank's packed micro-batches, ``micro_per_step`` per optimizer step, balanced over ranks.

    Stands in for the sharded DataLoader it is built from (``shard_loader``, whose length, epochs and sampler it
    follows). ``step_logs`` are the imbalance figures of the step whose micro-batches were handed out last.
    ``sync_device`` turns on the cross-rank checks and the collectives of ``refit`` (torch.distributed must be up);
    without it the loader runs in one process, e.g. once per rank in a test.
    """

    def __init__(self, shard_loader, *, rank: int, num_ranks: int, micro_per_step: int, collator, cost: CostModel,
                 tolerance: float = DEFAULT_TOLERANCE, sync_device: torch.device | None = None,
                 timer=None, refit=None) -> None:
        self._shard_loader = shard_loader
        self.rank, self.num_ranks, self.micro_per_step = rank, num_ranks, micro_per_step
        self.collator, self.cost, self.tolerance = collator, cost, tolerance
        self._sync_device = sync_device
        self._timer, self._refit = timer, refit
        self.epoch = 0
        self.step_logs: dict[str, float] = {}
        # NOTE: of the step handed out last: the tokens of its rows as they would have been collated where its
        # samples were drawn (rank by rank, before balancing; padding included; ``padded_row_tokens``), over all
        # ranks, and how many micro-batches this rank trains
        self.step_row_tokens: int | None = None
        self.step_micros = 0
        self._previous_lengths: list[list[int]] | None = None
        # NOTE: the global batches are read with the worker settings of Trainer's DataLoader.
        self._steps = DataLoader(
            _GlobalBatches(shard_loader.dataset), batch_size=None,
            sampler=GlobalStepIndices(shard_loader.batch_sampler, num_ranks=num_ranks, micro_per_step=micro_per_step),
            collate_fn=_as_is, num_workers=shard_loader.num_workers, worker_init_fn=shard_loader.worker_init_fn,
            prefetch_factor=shard_loader.prefetch_factor, persistent_workers=shard_loader.persistent_workers,
            multiprocessing_context=shard_loader.multiprocessing_context, in_order=shard_loader.in_order,
            pin_memory=False)
        # NOTE: the examples travel unpinned; the packed micro-batches are pinned (dataloader_pin_memory) as
        # Trainer's DataLoader pins its batches
        self._pin = shard_loader.pin_memory

    @property
    def dataset(self):
        return self._shard_loader.dataset

    def __len__(self) -> int:
        return len(self._shard_loader)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        # NOTE: as accelerate's DataLoaderShard.__iter__: the sampler's epoch follows set_epoch, then moves on.
        self._shard_loader.set_epoch(self.epoch)
        for nested in self._steps:
            lengths = [[[_length(example) for example in micro] for micro in rank] for rank in nested]
            self._maybe_refit()
            plan = plan_step(lengths, cost=self.cost, tolerance=self.tolerance)
            flat_lengths = [n for rank in lengths for micro in rank for n in micro]
            if self._sync_device is not None:
                self._check_same_plan_everywhere(plan.fingerprint(flat_lengths))
            self._previous_lengths = [[flat_lengths[p] for p in plan.rank_positions(r)]
                                      for r in range(self.num_ranks)]
            examples = [example for rank in nested for micro in rank for example in micro]
            for i, micro in enumerate(plan.micro_batches[self.rank]):
                if i == 0:
                    self.step_logs = {"dp_imbalance_before": plan.imbalance_before,
                                      "dp_imbalance_after": plan.imbalance_after}
                    self.step_row_tokens = padded_row_tokens(lengths, self.collator)
                    self.step_micros = len(plan.micro_batches[self.rank])
                batch = self.collator([examples[p] for p in micro])
                yield pin_memory(batch) if self._pin else batch
        self.epoch += 1

    def _maybe_refit(self) -> None:
        if self._refit is None or self._refit.done or self._previous_lengths is None:
            return
        seconds = self._timer.take()
        if seconds is None:  # no training step ran since the last plan (e.g. skipped while resuming)
            return
        refit = self._refit.observe(self._previous_lengths, seconds)
        if refit is not None:
            self.cost = refit

    def _check_same_plan_everywhere(self, fingerprint: int) -> None:
        both = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=self._sync_device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if int(both[0]) != -int(both[1]):
            raise DataError("DP load balancing: ranks disagree on this step's sample lengths or their assignment. "
                            "Every rank reads the whole step from the dataset, so an example must have the same "
                            "length on every rank (no random cropping in __getitem__ or a transform); otherwise set "
                            "dp_load_balance=False.")


def padded_row_tokens(lengths: Sequence[Sequence[Sequence[int]]], collator) -> int:
    """The tokens of the rows a padding-free ``collator`` makes of the micro-batches ``lengths[rank][micro]`` (sample
    lengths): one row per micro-batch, padded to the collator's ``pad_to_multiple_of``. What Trainer's
    ``num_input_tokens_seen`` and TRL's ``num_tokens`` count (padding included) for those batches: re-collated after
    balancing, a step's rows can hold other padding than where the samples were drawn."""
    multiple = getattr(collator, "pad_to_multiple_of", None) or 1
    return sum(-(-sum(micro) // multiple) * multiple for rank in lengths for micro in rank if micro)


# ---- wiring into LoongTrainer -------------------------------------------------------------------------------------
def cost_model_for(config) -> CostModel:
    """The FLOP cost model of a HF config (the text model's, for multimodal configs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    if getattr(text, "qk_rope_head_dim", None):  # MLA: the query/key width per head is nope + rope
        head_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
    else:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    moe = {}
    if getattr(text, "num_experts_per_tok", None):
        moe = dict(num_experts_per_tok=text.num_experts_per_tok + (getattr(text, "n_shared_experts", None) or 0),
                   moe_intermediate_size=getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
    # NOTE: GPT-J names the MLP width n_inner (None: 4 x hidden), Falcon ffn_hidden_size
    width = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) \
        or getattr(text, "ffn_hidden_size", None) or 4 * text.hidden_size
    return CostModel.from_model_dims(
        hidden_size=text.hidden_size, num_layers=text.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads_of(text), head_dim=head_dim, intermediate_size=width,
        vocab_size=text.vocab_size, **moe)


def _why_unsupported(loader) -> str | None:
    from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler

    shard = getattr(loader, "batch_sampler", None)
    if not isinstance(shard, BatchSamplerShard) or shard.split_batches:
        return "the dataset is not map-style (an IterableDataset) or the loader has a custom batch sampler"
    inner = shard.batch_sampler
    if type(inner) is not BatchSampler or not isinstance(inner.sampler, (SequentialSampler, SeedableRandomSampler)):
        return (f"the sampler ({type(getattr(inner, 'sampler', inner)).__name__}) is neither sequential nor "
                "accelerate's seeded random sampler, so ranks cannot rebuild each other's batches")
    return None


def packs_without_padding(data_collator) -> bool:
    """Whether ``data_collator`` concatenates a micro-batch's samples into one row with restarting ``position_ids``
    (each sample's tokens wherever it lands, padding at most at the row's end): transformers'
    ``DataCollatorWithFlattening``, or TRL's SFT collator (``trl.trainer.sft_trainer.DataCollatorForLanguageModeling``)
    with ``padding_free`` set, which SFTConfig(padding_free=True) and the bfd packing strategies give.

    Only such batches are balanced: ``plan_step`` prices a micro-batch as the sum of its samples' costs and caps it by
    its summed tokens, which is what a packed row costs and holds. A padded batch ([rows, longest sample]) costs and
    holds rows x its longest sample instead, so moving samples would change its padding: a micro-batch within the token
    cap could still grow to more rows of the longest length (more memory than the unbalanced step), the predicted
    costs would not be the step's, and under pipeline parallelism the micro-batches of a step would stop sharing one
    shape.
    """
    import sys

    from transformers import DataCollatorWithFlattening

    if isinstance(data_collator, DataCollatorWithFlattening):
        return True
    # NOTE: an instance of TRL's collator means its module is loaded; looking it up there keeps trl optional.
    sft = sys.modules.get("trl.trainer.sft_trainer")
    trl_collator = getattr(sft, "DataCollatorForLanguageModeling", None)
    return (isinstance(trl_collator, type) and isinstance(data_collator, trl_collator)
            and bool(getattr(data_collator, "padding_free", False)))


def balanced_train_dataloader(loader, *, args, model, data_collator, collator):
    """``loader`` (LoongTrainer's sharded training DataLoader) itself, or a ``BalancedDataLoader`` over the same
    samples when balancing applies: ``args.dp_load_balance`` (default True), a collator that packs without padding
    (``packs_without_padding``) and more than one data-parallel rank. ``collator`` is the one the loader calls (e.g.
    wrapped to drop unused columns); it packs each redistributed micro-batch."""
    from loongforge_hf.trainer.balance_refit import ComputeTimer, CostRefit

    if not getattr(args, "dp_load_balance", True) or not packs_without_padding(data_collator):
        return loader
    rank, num_ranks = dp_rank_and_size()
    if num_ranks == 1:
        return loader
    reason = _why_unsupported(loader)
    if reason is not None:
        logger.warning("DP load balancing is off: %s. Training proceeds unbalanced.", reason)
        return loader
    timer = refit = None
    if getattr(args, "dp_balance_refit", False):
        timer = ComputeTimer.install(model.megatron.config, model.device)
        refit = CostRefit(steps=getattr(args, "dp_balance_refit_steps", 8), dp_rank=rank, num_ranks=num_ranks,
                          device=model.device)
    return BalancedDataLoader(loader, rank=rank, num_ranks=num_ranks, micro_per_step=args.gradient_accumulation_steps,
                              collator=collator, cost=cost_model_for(model.config), sync_device=model.device,
                              timer=timer, refit=refit)
