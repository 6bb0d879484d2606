"""Data-parallel load balancing for packed variable-length samples.

Before each optimizer step the samples of the global batch are redistributed over the data-parallel ranks so that
every rank has about the same predicted compute. The set of samples in the step is unchanged, so the gradient is
unchanged too, provided the loss is normalised by the global token count rather than by a per-rank mean.

Choices made here:
- Cost of one sample of L tokens is a·L² + b·L + c (`CostModel`). The L² term is attention (score and value matmuls,
  causal so half the square); the L term is every token-wise matmul (projections, MLP, LM head); c is a fixed
  per-sequence overhead. Coefficients come from FLOP counts of the model (`CostModel.from_model_dims`) or are refit
  from measured per-rank compute times by non-negative least squares (`CostModel.fit`).
- A rank's cost is the sum of its samples' costs; the step waits for the slowest rank, so the figure of merit is
  max rank cost / mean rank cost (`imbalance`). No assignment can go below
  max(largest single-sample cost, total / num_ranks) / mean, which `lower_bound` returns.
- `balance` runs longest-processing-time-first (LPT) on cost, then a local refinement: for the most loaded rank, try
  the other ranks from least to most loaded, and apply the single move or pairwise swap that most lowers the pair's
  maximum; repeat while that strictly lowers the maximum rank. It keeps the input (naive) assignment when that is
  already within `tolerance`, or when balancing would not beat it.
- A per-rank token cap is honoured throughout. If LPT on cost cannot place a sample under the cap, a best-fit
  decreasing packing on tokens is tried before giving up with a ValueError.
- Deterministic: sorts are stable and ties go to the lower sample index, then the lower rank index.
- Indices within a rank are returned in ascending order (original order of the global batch).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

# NOTE: a training step is forward + backward; backward costs about twice the forward for every matmul (gradients with
# respect to inputs and to weights), so a step is ~3x the forward FLOPs. A uniform factor does not change the balance;
# it only makes the coefficients read as training FLOPs.
TRAIN_FLOPS_PER_FORWARD_FLOP = 3

# NOTE: every packed sequence pays some work that does not grow with its length: varlen attention rounds each
# sequence up to whole tiles, and each sequence has its own boundary bookkeeping (cu_seqlens, loss masking). It is
# charged as the token-wise work of this many tokens: +50% for a 128-token sample, under +2% from 4k tokens up.
# Refit from measurements (`CostModel.fit`) when it matters.
PER_SEQUENCE_OVERHEAD_TOKENS = 64

InputLayout = Literal["round_robin", "contiguous"]


@dataclass(frozen=True)
class CostModel:
    """Predicted cost of one sample of L tokens: a·L² + b·L + c (all coefficients >= 0)."""

    a: float
    b: float
    c: float

    def __post_init__(self) -> None:
        coefficients = (self.a, self.b, self.c)
        if not all(np.isfinite(v) and v >= 0 for v in coefficients):
            raise ValueError(f"CostModel coefficients must be finite and >= 0, got a={self.a}, b={self.b}, c={self.c}")
        if not any(v > 0 for v in coefficients):
            raise ValueError("CostModel needs at least one positive coefficient; all of a, b, c are 0")

    def __call__(self, lengths: int | float | Sequence[int] | np.ndarray) -> float | np.ndarray:
        """Cost of each length; a scalar for a scalar, a float64 array otherwise."""
        length = np.asarray(lengths, dtype=np.float64)
        out = (self.a * length + self.b) * length + self.c
        return float(out) if out.ndim == 0 else out

    @classmethod
    def from_model_dims(
        cls,
        *,
        hidden_size: int,
        num_layers: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        intermediate_size: int,
        vocab_size: int,
        num_experts_per_tok: int | None = None,
        moe_intermediate_size: int | None = None,
    ) -> "CostModel":
        """Training FLOPs of a decoder stack (gated MLP, GQA attention, untied LM head) as a function of L.

        Per layer and token (a matmul of m×k by k×n costs 2·m·k·n): q and o projections 2·2·h·(heads·head_dim),
        k and v projections 2·2·h·(kv_heads·head_dim), gated MLP 2·3·h·intermediate (with MoE: 2·3·h·moe_intermediate
        for each of the num_experts_per_tok routed experts, and intermediate_size unused). Per layer and sequence:
        scores Q·Kᵀ and the weighted sum P·V each 2·L²·heads·head_dim, halved for the causal mask. Once per token:
        LM head 2·h·vocab.
        Not counted (each well under 1%): norms, rotary, softmax, the MoE router, embeddings lookup.
        """
        dims = dict(
            hidden_size=hidden_size, num_layers=num_layers, num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads, head_dim=head_dim, intermediate_size=intermediate_size,
            vocab_size=vocab_size,
        )
        for name, value in dims.items():
            if value < 1:
                raise ValueError(f"from_model_dims: {name} must be >= 1, got {value}")
        if (num_experts_per_tok is None) != (moe_intermediate_size is None):
            raise ValueError("from_model_dims: give num_experts_per_tok and moe_intermediate_size together (MoE), "
                             f"got num_experts_per_tok={num_experts_per_tok}, "
                             f"moe_intermediate_size={moe_intermediate_size}")
        h = hidden_size
        q_width = num_attention_heads * head_dim
        kv_width = num_key_value_heads * head_dim
        projections = 2 * h * q_width * 2 + 2 * h * kv_width * 2
        if num_experts_per_tok is None:
            mlp = 2 * 3 * h * intermediate_size
        else:
            if num_experts_per_tok < 1 or moe_intermediate_size < 1:
                raise ValueError("from_model_dims: num_experts_per_tok and moe_intermediate_size must be >= 1")
            mlp = 2 * 3 * h * moe_intermediate_size * num_experts_per_tok
        linear_forward = num_layers * (projections + mlp) + 2 * h * vocab_size
        # Scores and weighted values, 2·L²·heads·head_dim each; the causal mask keeps half.
        quadratic_forward = num_layers * (2 * 2 * q_width) / 2
        a = TRAIN_FLOPS_PER_FORWARD_FLOP * quadratic_forward
        b = TRAIN_FLOPS_PER_FORWARD_FLOP * linear_forward
        return cls(a=float(a), b=float(b), c=float(PER_SEQUENCE_OVERHEAD_TOKENS * b))

    @classmethod
    def fit(
        cls,
        lengths_per_step_per_rank: Sequence[Sequence[Sequence[int]]],
        measured_times: Sequence[Sequence[float]],
    ) -> "CostModel":
        """Refit a, b, c (>= 0) to measured per-rank compute times by non-negative least squares.

        `lengths_per_step_per_rank[s][r]` is the lengths of the samples rank r processed in step s, and
        `measured_times[s][r]` that rank's forward+backward time (measured before the gradient reduction, which
        would make every rank wait for the slowest). Each (step, rank) pair is one observation:
        time ≈ a·ΣL² + b·ΣL + c·count. The result is in the units of `measured_times`.
        """
        if len(lengths_per_step_per_rank) != len(measured_times):
            raise ValueError(f"fit: {len(lengths_per_step_per_rank)} steps of lengths but "
                             f"{len(measured_times)} steps of times")
        rows: list[tuple[float, float, float]] = []
        times: list[float] = []
        for step, (step_lengths, step_times) in enumerate(zip(lengths_per_step_per_rank, measured_times)):
            if len(step_lengths) != len(step_times):
                raise ValueError(f"fit: step {step} has {len(step_lengths)} ranks of lengths but "
                                 f"{len(step_times)} times")
            for rank, (rank_lengths, seconds) in enumerate(zip(step_lengths, step_times)):
                length = _as_lengths(rank_lengths, where=f"fit: step {step} rank {rank}").astype(np.float64)
                if not (np.isfinite(seconds) and seconds >= 0):
                    raise ValueError(f"fit: step {step} rank {rank} has time {seconds}; times must be finite and >= 0")
                rows.append((float(np.sum(length * length)), float(np.sum(length)), float(length.size)))
                times.append(float(seconds))
        if not rows:
            raise ValueError("fit: no observations")
        a, b, c = _nnls(np.asarray(rows), np.asarray(times))
        if not (a > 0 or b > 0 or c > 0):
            raise ValueError("fit: the non-negative least-squares fit is all zeros; are the measured times all 0?")
        return cls(a=a, b=b, c=c)


def _nnls(features: np.ndarray, target: np.ndarray) -> tuple[float, ...]:
    """Exact non-negative least squares for a handful of columns.

    The optimum's nonzero coefficients solve the unconstrained least squares on their own columns, so trying every
    subset of columns and keeping the best non-negative solution is exact; with 3 columns that is 7 small solves.
    """
    n_cols = features.shape[1]
    # NOTE: columns differ by orders of magnitude (ΣL² vs a sample count); scale them to unit norm for conditioning.
    norms = np.linalg.norm(features, axis=0)
    norms[norms == 0] = 1.0
    scaled = features / norms
    best = np.zeros(n_cols)
    best_residual = float(np.sum(target * target))
    for size in range(1, n_cols + 1):
        for subset in itertools.combinations(range(n_cols), size):
            cols = list(subset)
            solution, *_ = np.linalg.lstsq(scaled[:, cols], target, rcond=None)
            if np.any(solution < 0):
                continue
            residual = float(np.sum((scaled[:, cols] @ solution - target) ** 2))
            if residual < best_residual * (1 - 1e-12):
                best_residual = residual
                best = np.zeros(n_cols)
                best[cols] = solution
    return tuple(float(v) for v in best / norms)


def imbalance(per_rank_costs: Sequence[float] | np.ndarray) -> float:
    """Max rank cost / mean rank cost; 1.0 is perfect, and all-zero costs count as perfect."""
    costs = np.asarray(per_rank_costs, dtype=np.float64)
    if costs.ndim != 1 or costs.size == 0:
        raise ValueError(f"imbalance: need a non-empty 1-D sequence of per-rank costs, got shape {costs.shape}")
    mean = float(costs.mean())
    return 1.0 if mean == 0 else float(costs.max()) / mean


def lower_bound(lengths: Sequence[int], *, num_ranks: int, cost: CostModel) -> float:
    """The smallest imbalance any assignment can reach: max(largest sample cost, total / num_ranks) / mean."""
    length = _as_lengths(lengths, where="lower_bound")
    _check_num_ranks(num_ranks)
    if length.size == 0:
        return 1.0
    costs = np.asarray(cost(length), dtype=np.float64)
    mean = float(costs.sum()) / num_ranks
    return max(float(costs.max()), mean) / mean


@dataclass(frozen=True)
class Assignment:
    """Which samples of the global batch each data-parallel rank processes.

    `ranks[r]` are the sample indices of rank r in ascending order; `rank_costs` and `rank_tokens` are per rank;
    `before_imbalance` is the imbalance of the naive assignment this one replaced; `skipped` is True when that naive
    assignment was kept unchanged (already within tolerance, or balancing could not beat it).
    """

    ranks: tuple[tuple[int, ...], ...]
    rank_costs: tuple[float, ...]
    rank_tokens: tuple[int, ...]
    before_imbalance: float
    skipped: bool

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def imbalance(self) -> float:
        """Max rank cost / mean rank cost."""
        return imbalance(self.rank_costs)


def round_robin(lengths: Sequence[int], *, num_ranks: int, cost: CostModel) -> Assignment:
    """Baseline: sample i goes to rank i % num_ranks (what a strided distributed sampler does)."""
    length = _as_lengths(lengths, where="round_robin")
    _check_num_ranks(num_ranks)
    owner = _naive_owner(length.size, num_ranks, "round_robin")
    costs = np.asarray(cost(length), dtype=np.float64)
    naive = _rank_costs(owner, costs, num_ranks)
    return _assignment(owner, length, costs, num_ranks, before_imbalance=imbalance(naive), skipped=False)


def equal_tokens(lengths: Sequence[int], *, num_ranks: int, cost: CostModel) -> Assignment:
    """Baseline: equal token counts per rank (LPT on lengths, ignoring the L² attention cost)."""
    length = _as_lengths(lengths, where="equal_tokens")
    _check_num_ranks(num_ranks)
    costs = np.asarray(cost(length), dtype=np.float64)
    owner = _lpt(length.astype(np.float64), length, num_ranks, max_tokens=None)
    before = imbalance(_rank_costs(_naive_owner(length.size, num_ranks, "round_robin"), costs, num_ranks))
    return _assignment(owner, length, costs, num_ranks, before_imbalance=before, skipped=False)


def balance(
    lengths: Sequence[int],
    *,
    num_ranks: int,
    cost: CostModel,
    max_tokens_per_rank: int | None = None,
    tolerance: float = 0.02,
    input_layout: InputLayout = "round_robin",
) -> Assignment:
    """Redistribute the samples of one global batch over `num_ranks` ranks to equalise predicted cost.

    `input_layout` names the naive assignment the sampler would have used ("round_robin": sample i on rank
    i % num_ranks; "contiguous": consecutive equal chunks). It is kept when its imbalance is within `tolerance`
    (and it honours the cap). Every rank gets at least one sample when there are at least `num_ranks` samples.
    """
    length = _as_lengths(lengths, where="balance")
    _check_num_ranks(num_ranks)
    if tolerance < 0:
        raise ValueError(f"balance: tolerance must be >= 0, got {tolerance}")
    costs = np.asarray(cost(length), dtype=np.float64)
    if max_tokens_per_rank is not None:
        _check_cap(length, num_ranks, max_tokens_per_rank)

    naive_owner = _naive_owner(length.size, num_ranks, input_layout)
    naive_costs = _rank_costs(naive_owner, costs, num_ranks)
    naive_imbalance = imbalance(naive_costs)
    naive_fits = max_tokens_per_rank is None or bool(
        np.all(np.bincount(naive_owner, weights=length, minlength=num_ranks) <= max_tokens_per_rank))
    if naive_fits and naive_imbalance <= 1 + tolerance:
        return _assignment(naive_owner, length, costs, num_ranks, before_imbalance=naive_imbalance, skipped=True)

    owner = _lpt(costs, length, num_ranks, max_tokens=max_tokens_per_rank)
    if owner is None:
        owner = _best_fit_decreasing(length, num_ranks, max_tokens_per_rank)
    if owner is None:
        raise ValueError(
            f"balance: could not pack {length.size} samples ({int(length.sum())} tokens, longest {int(length.max())}) "
            f"into {num_ranks} ranks of max_tokens_per_rank={max_tokens_per_rank}; raise the cap or lower the "
            "global batch size")
    stop_at = lower_bound(length, num_ranks=num_ranks, cost=cost) * float(costs.sum()) / num_ranks
    _refine(owner, costs, length, num_ranks, max_tokens=max_tokens_per_rank, stop_at=stop_at)

    if naive_fits and _rank_costs(owner, costs, num_ranks).max() >= naive_costs.max():
        return _assignment(naive_owner, length, costs, num_ranks, before_imbalance=naive_imbalance, skipped=True)
    return _assignment(owner, length, costs, num_ranks, before_imbalance=naive_imbalance, skipped=False)


# ---------------------------------------------------------------------------------------------------------------------
# Internals. An assignment is an `owner` array: owner[i] is the rank of sample i.


def _as_lengths(lengths: Sequence[int] | np.ndarray, *, where: str) -> np.ndarray:
    array = np.asarray(lengths)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{where}: lengths must be a 1-D sequence of integers, got dtype {array.dtype} "
                         f"and shape {array.shape}")
    if array.min() < 1:
        raise ValueError(f"{where}: lengths must be >= 1, sample {int(np.argmin(array))} has length {array.min()}")
    return array.astype(np.int64)


def _check_num_ranks(num_ranks: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")


def _check_cap(length: np.ndarray, num_ranks: int, cap: int) -> None:
    if cap < 1:
        raise ValueError(f"balance: max_tokens_per_rank must be >= 1, got {cap}")
    if length.size and int(length.max()) > cap:
        i = int(np.argmax(length))
        raise ValueError(f"balance: sample {i} has {int(length[i])} tokens, more than max_tokens_per_rank={cap}")
    if int(length.sum()) > num_ranks * cap:
        raise ValueError(f"balance: the global batch has {int(length.sum())} tokens, more than "
                         f"num_ranks * max_tokens_per_rank = {num_ranks} * {cap} = {num_ranks * cap}")


def _naive_owner(n: int, num_ranks: int, layout: str) -> np.ndarray:
    if layout == "round_robin":
        return np.arange(n, dtype=np.int64) % num_ranks
    if layout == "contiguous":
        sizes = [len(chunk) for chunk in np.array_split(np.arange(n), num_ranks)]
        return np.repeat(np.arange(num_ranks, dtype=np.int64), sizes)
    raise ValueError(f"input_layout must be 'round_robin' or 'contiguous', got {layout!r}")


def _rank_costs(owner: np.ndarray, costs: np.ndarray, num_ranks: int) -> np.ndarray:
    # NOTE: bincount sums in sample order, so every assignment's costs are computed the same way and compare exactly.
    return np.bincount(owner, weights=costs, minlength=num_ranks).astype(np.float64)


def _assignment(owner: np.ndarray, length: np.ndarray, costs: np.ndarray, num_ranks: int, *,
                before_imbalance: float, skipped: bool) -> Assignment:
    order = np.argsort(owner, kind="stable")  # by rank, then by sample index
    bounds = np.searchsorted(owner[order], np.arange(num_ranks + 1))
    ranks = tuple(tuple(int(i) for i in order[bounds[r]:bounds[r + 1]]) for r in range(num_ranks))
    tokens = np.bincount(owner, weights=length, minlength=num_ranks)
    return Assignment(
        ranks=ranks,
        rank_costs=tuple(float(v) for v in _rank_costs(owner, costs, num_ranks)),
        rank_tokens=tuple(int(v) for v in tokens),
        before_imbalance=float(before_imbalance),
        skipped=skipped,
    )


def _lpt(weights: np.ndarray, length: np.ndarray, num_ranks: int, *, max_tokens: int | None) -> np.ndarray | None:
    """Longest-processing-time-first on `weights`: heaviest sample first, onto the least loaded rank that fits.

    Heap keys are (load, sample count, rank): an empty rank always comes first, so the first num_ranks samples land on
    distinct ranks. Returns None when a sample fits on no rank under `max_tokens`.
    """
    n = weights.size
    owner = np.empty(n, dtype=np.int64)
    order = np.argsort(-weights, kind="stable")  # heaviest first, ties by lower index
    heap = [(0.0, 0, r) for r in range(num_ranks)]
    if max_tokens is None:
        for i, w in zip(order.tolist(), weights[order].tolist()):
            load, count, rank = heap[0]
            owner[i] = rank
            heapq.heapreplace(heap, (load + w, count + 1, rank))
        return owner
    tokens = [0] * num_ranks
    for i, w, tok in zip(order.tolist(), weights[order].tolist(), length[order].tolist()):
        passed = []
        while heap and tokens[heap[0][2]] + tok > max_tokens:
            passed.append(heapq.heappop(heap))
        if not heap:
            return None
        load, count, rank = heapq.heappop(heap)
        owner[i] = rank
        tokens[rank] += tok
        heapq.heappush(heap, (load + w, count + 1, rank))
        for entry in passed:
            heapq.heappush(heap, entry)
    return owner


def _best_fit_decreasing(length: np.ndarray, num_ranks: int, max_tokens: int) -> np.ndarray | None:
    """Pure feasibility under the token cap: longest first, onto the fullest rank that still fits it.

    Afterwards each empty rank takes the shortest sample of a rank holding several (any one sample fits an empty rank),
    so that every rank gets a sample when there are enough samples. Returns None when a sample fits nowhere.
    """
    owner = np.empty(length.size, dtype=np.int64)
    tokens = np.zeros(num_ranks, dtype=np.int64)
    for i in np.argsort(-length, kind="stable").tolist():
        room = max_tokens - tokens - int(length[i])
        fitting = np.flatnonzero(room >= 0)
        if fitting.size == 0:
            return None
        rank = int(fitting[np.argmin(room[fitting])])
        owner[i] = rank
        tokens[rank] += length[i]
    counts = np.bincount(owner, minlength=num_ranks)
    for empty in np.flatnonzero(counts == 0).tolist():
        shared = np.flatnonzero(counts[owner] > 1)
        if shared.size == 0:
            break
        i = int(shared[np.argmin(length[shared])])
        counts[owner[i]] -= 1
        counts[empty] += 1
        owner[i] = empty
    return owner


class _RankView:
    """One rank's samples sorted by (cost, length, index), as arrays for vectorised search; rebuilt when it changes."""

    __slots__ = ("idx", "cost", "length")

    def __init__(self, members: list[int], costs: np.ndarray, length: np.ndarray) -> None:
        idx = np.asarray(members, dtype=np.int64)
        order = np.lexsort((idx, length[idx], costs[idx]))
        self.idx = idx[order]
        self.cost = costs[self.idx]
        self.length = length[self.idx]


def _refine(owner: np.ndarray, costs: np.ndarray, length: np.ndarray, num_ranks: int, *,
            max_tokens: int | None, stop_at: float) -> None:
    """Lower the most loaded rank by moves and pairwise swaps with other ranks, in place on `owner`.

    Each accepted change strictly lowers the larger of the two ranks it touches below the current maximum and leaves
    the others alone, so the sorted load vector decreases lexicographically and the loop terminates.
    """
    loads = _rank_costs(owner, costs, num_ranks)
    tokens = np.bincount(owner, weights=length, minlength=num_ranks).astype(np.int64)
    members: list[list[int]] = [[] for _ in range(num_ranks)]
    for i, r in enumerate(owner.tolist()):
        members[r].append(i)
    views: dict[int, _RankView] = {}

    def view(rank: int) -> _RankView:
        if rank not in views:
            views[rank] = _RankView(members[rank], costs, length)
        return views[rank]

    cap = np.iinfo(np.int64).max if max_tokens is None else max_tokens
    # NOTE: the bound guards against a pathological number of tiny improvements; in practice the loop stops far
    # earlier, when the maximum reaches the lower bound or no move or swap lowers it.
    for _ in range(8 * num_ranks + 64):
        top = int(np.argmax(loads))
        top_load = float(loads[top])
        if top_load <= stop_at * (1 + 1e-9) or len(members[top]) <= 1:
            return
        accept_below = top_load * (1 - 1e-12)
        src = view(top)
        change = None
        for dst in np.argsort(loads, kind="stable").tolist():
            if dst == top:
                continue
            if float(loads[dst]) >= accept_below:
                break  # ranks are in ascending load: none further can take anything off the top
            change = _best_change(src, view(dst), top_load=top_load, dst_load=float(loads[dst]),
                                  src_tokens=int(tokens[top]), dst_tokens=int(tokens[dst]), cap=cap)
            if change is not None and change[0] < accept_below:
                break
            change = None
        if change is None:
            return
        _, x, y = change
        delta = costs[x] - (costs[y] if y >= 0 else 0.0)
        moved = length[x] - (length[y] if y >= 0 else 0)
        loads[top] -= delta
        loads[dst] += delta
        tokens[top] -= moved
        tokens[dst] += moved
        members[top].remove(x)
        members[dst].append(x)
        owner[x] = dst
        if y >= 0:
            members[dst].remove(y)
            members[top].append(y)
            owner[y] = top
        views.pop(top, None)
        views.pop(dst, None)


def _best_change(src: _RankView, dst: _RankView, *, top_load: float, dst_load: float, src_tokens: int,
                 dst_tokens: int, cap: int) -> tuple[float, int, int] | None:
    """The move (x from src to dst) or swap (x for y) that minimises the pair's new maximum, under the token cap.

    Returns (new pair maximum, x, y) with y = -1 for a move, or None when nothing is feasible. The ideal amount to
    shift is half the gap; candidates are the nearest costs on either side of it, clamped to what the cap allows.
    Costs grow with length, so within a rank sorted by cost the lengths are sorted too.
    """
    gap = top_load - dst_load
    best: tuple[float, int, int] | None = None

    # Move: shift x's whole cost; the cap allows x with length <= cap - dst_tokens (a prefix in sorted order).
    if src.idx.size > 1:
        last_fit = int(np.searchsorted(src.length, cap - dst_tokens, side="right")) - 1
        if last_fit >= 0:
            k = int(np.searchsorted(src.cost, gap / 2))
            for j in sorted({min(max(k - 1, 0), last_fit), min(k, last_fit)}):
                new_max = max(top_load - src.cost[j], dst_load + src.cost[j])
                if best is None or new_max < best[0]:
                    best = (float(new_max), int(src.idx[j]), -1)

    # Swap: shift c_x - c_y; the cap on dst needs y with length >= x's length - (cap - dst_tokens).
    if dst.idx.size:
        m = dst.idx.size
        k = np.searchsorted(dst.cost, src.cost - gap / 2)
        first_fit = np.searchsorted(dst.length, src.length - (cap - dst_tokens), side="left")
        cand = np.concatenate((np.maximum(k - 1, first_fit), np.maximum(k, first_fit)))
        x = np.concatenate((np.arange(src.idx.size),) * 2)
        y = np.minimum(cand, m - 1)
        delta = src.cost[x] - dst.cost[y]
        moved = src.length[x] - dst.length[y]
        new_max = np.maximum(top_load - delta, dst_load + delta)
        ok = (cand < m) & (delta > 0) & (dst_tokens + moved <= cap) & (src_tokens - moved <= cap)
        new_max[~ok] = np.inf
        j = int(np.argmin(new_max))
        if new_max[j] < np.inf and (best is None or new_max[j] < best[0]):
            best = (float(new_max[j]), int(src.idx[x[j]]), int(dst.idx[y[j]]))
    return best
