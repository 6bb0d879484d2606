"""Predicted data-parallel load imbalance: round-robin vs equal-token packing vs the cost balancer.

Pure computation (no accelerator): for long-tailed sample-length distributions and several DP sizes, report
max rank cost / mean rank cost under each assignment, the lower bound no assignment can beat, and the balancer's
wall time. Costs come from the Qwen3-8B-like FLOP model (`CostModel.from_model_dims`).

    python scripts/bench_dp_balance.py [--out outputs/bench_dp_balance.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Callable

import numpy as np

from loongforge_hf.trainer.balance import CostModel, balance, equal_tokens, lower_bound, round_robin

QWEN3_8B_DIMS = dict(
    hidden_size=4096, num_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=12288, vocab_size=151936,
)
MIN_TOKENS, MAX_TOKENS = 128, 32768
SEED = 1234
DP_SIZES = (8, 64, 512)
SAMPLES_PER_RANK = (16, 64)
SCALE_SAMPLES, SCALE_RANKS = 100_000, 512


def lognormal(rng: np.random.Generator, n: int) -> np.ndarray:
    """SFT-like: median 1024 tokens, sigma 1.0 in log space (mean ~1.7k), clipped to 128..32768."""
    return np.clip(rng.lognormal(np.log(1024), 1.0, size=n), MIN_TOKENS, MAX_TOKENS).astype(np.int64)


def pareto(rng: np.random.Generator, n: int) -> np.ndarray:
    """Heavy tail: Pareto with x_min 256 and shape 1.2 (infinite variance), clipped to 128..32768."""
    return np.clip(256 * (1 + rng.pareto(1.2, size=n)), MIN_TOKENS, MAX_TOKENS).astype(np.int64)


DISTRIBUTIONS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "lognormal(1024, 1.0)": lognormal, "pareto(256, 1.2)": pareto,
}


def best_of(fn: Callable[[], object], repeats: int) -> tuple[object, float]:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def run_case(name: str, lengths: np.ndarray, *, num_ranks: int, cost: CostModel, cap: int | None = None,
             repeats: int = 3) -> dict:
    balanced, seconds = best_of(
        lambda: balance(lengths, num_ranks=num_ranks, cost=cost, max_tokens_per_rank=cap), repeats)
    return {
        "distribution": name,
        "dp": num_ranks,
        "samples": int(lengths.size),
        "samples_per_rank": lengths.size / num_ranks,
        "max_tokens_per_rank": cap,
        "longest_sample": int(lengths.max()),
        "mean_tokens_per_rank": float(lengths.sum()) / num_ranks,
        "round_robin": round_robin(lengths, num_ranks=num_ranks, cost=cost).imbalance(),
        "equal_tokens": equal_tokens(lengths, num_ranks=num_ranks, cost=cost).imbalance(),
        "balanced": balanced.imbalance(),
        "lower_bound": lower_bound(lengths, num_ranks=num_ranks, cost=cost),
        "skipped": balanced.skipped,
        "balance_ms": seconds * 1e3,
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_dp_balance.json", help="where to write the JSON results")
    args = parser.parse_args()

    cost = CostModel.from_model_dims(**QWEN3_8B_DIMS)
    rows = []
    for per_rank in SAMPLES_PER_RANK:
        for name, draw in DISTRIBUTIONS.items():
            for dp in DP_SIZES:
                lengths = draw(np.random.default_rng([SEED, per_rank, dp]), per_rank * dp)
                rows.append(run_case(name, lengths, num_ranks=dp, cost=cost))
    for name, draw in DISTRIBUTIONS.items():
        lengths = draw(np.random.default_rng([SEED, SCALE_SAMPLES]), SCALE_SAMPLES)
        rows.append(run_case(name, lengths, num_ranks=SCALE_RANKS, cost=cost, repeats=2))
        cap = int(np.ceil(lengths.sum() / SCALE_RANKS * 1.02))  # a tight cap: 2% above the mean token share
        rows.append(run_case(name, lengths, num_ranks=SCALE_RANKS, cost=cost, cap=cap, repeats=2))

    header = (f"{'distribution':<21} {'DP':>4} {'samples':>7} {'cap':>7} {'round-robin':>11} {'equal-tok':>9} "
              f"{'balanced':>8} {'bound':>7} {'balance ms':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        cap = "-" if r["max_tokens_per_rank"] is None else str(r["max_tokens_per_rank"])
        print(f"{r['distribution']:<21} {r['dp']:>4} {r['samples']:>7} {cap:>7} {r['round_robin']:>11.4f} "
              f"{r['equal_tokens']:>9.4f} {r['balanced']:>8.4f} {r['lower_bound']:>7.4f} {r['balance_ms']:>10.1f}")

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__},
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "cost_model": {"dims": QWEN3_8B_DIMS, "a": cost.a, "b": cost.b, "c": cost.c},
        "metric": "max rank cost / mean rank cost (1.0 is perfect); lower_bound = max(largest sample, mean) / mean",
        "seed": SEED,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
