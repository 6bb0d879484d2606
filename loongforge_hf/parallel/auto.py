"""``parallel="auto"``: pick a layout from the world size, the model's size and the accelerator's memory.

Choices (printed as the reason on rank 0):
- Training memory per parameter: weights and grads in the training dtype, plus fp32 main weights and two Adam
  moments sharded over data-parallel ranks by the distributed optimizer; activations get a fixed share of memory.
- Prefer data parallelism (no communication in the forward pass); add tensor parallelism within a node (a divisor
  of the attention and KV heads, at most the local GPU count) until the model states fit; then pipeline parallelism
  over the layers. Experts, when present, are spread with expert parallelism over data-parallel ranks first.
- A TP size that is a multiple of the KV heads (each head replicated on ``tp / kv`` ranks, ``kv_replicas.py``) is
  tried only when no dividing TP fits at that pipeline size, and before a larger pipeline size: replication costs each
  rank one head's whole K / V weights (counted) and one all-reduce of their gradients per layer and step, a pipeline
  stage a bubble every step. Not where the model cannot replicate its heads (``kv_replication=False``).
- A layout the model's bridge refuses (its ``check_layout``: Gemma 4's layer types whose KV heads do not split over
  TP, its E2B / E4B under a pipeline) is skipped (``accepts``), as if it did not fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loongforge_hf.parallel.config import ParallelConfig, ParallelLayoutError

ACTIVATION_SHARE = 0.35  # fraction of device memory kept for activations and workspace


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    num_params: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int | None = None
    kv_params: int = 0  # of num_params: the K / V projections' weights (what each replica of a head repeats)


def model_size_of(hf_config) -> ModelSize:
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    hd = getattr(hf_config, "head_dim", None) or h // heads
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) \
        or getattr(hf_config, "n_routed_experts", None)
    ffn = (getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size) if experts \
        else hf_config.intermediate_size
    per_layer = h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * ffn * (experts or 1) + 2 * h
    embeddings = hf_config.vocab_size * h * (1 if getattr(hf_config, "tie_word_embeddings", False) else 2)
    return ModelSize(num_params=layers * per_layer + embeddings, num_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv, num_experts=experts, kv_params=layers * 2 * h * hd * kv)


def state_bytes_per_rank(size: ModelSize, *, tp: int, pp: int, dp: int, ep: int, dtype_bytes: int) -> float:
    """Weights, gradients and (sharded over ``dp``) optimizer state of one rank; K / V split over at most the KV
    heads (a replicating TP holds one head's whole on each rank)."""
    shards = pp * (ep if size.num_experts else 1)
    kv_shards = shards * min(tp, size.num_key_value_heads)
    params = (size.num_params - size.kv_params) / (tp * shards) + size.kv_params / kv_shards
    return params * (2 * dtype_bytes + 12 / dp)


def tp_candidates(size: ModelSize, *, world_size: int, local_world_size: int,
                  kv_replication: bool = True) -> tuple[list[int], list[int]]:
    """TP sizes within a node that divide the world and the attention heads: those that divide the KV heads, and
    (with ``kv_replication``) those that are a multiple of them, each head replicated."""
    fits = [t for t in (1, 2, 4, 8) if t <= local_world_size and world_size % t == 0
            and size.num_attention_heads % t == 0]
    kv = size.num_key_value_heads
    return ([t for t in fits if kv % t == 0],
            [t for t in fits if kv_replication and t > kv and t % kv == 0])


def choose_layout(size: ModelSize, *, world_size: int, local_world_size: int, device_memory: float,
                  dtype_bytes: int = 2, kv_replication: bool = True,
                  accepts: Callable[[ParallelConfig], bool] | None = None) -> tuple[ParallelConfig, str]:
    """The layout and a one-line reason; raises ParallelLayoutError when nothing fits. ``kv_replication``: whether
    TP sizes above the KV heads (each head replicated) may be picked, when no dividing one fits; ``accepts``: whether
    the model runs a layout (``bridge_accepts``), None: every one."""
    budget = device_memory * (1 - ACTIVATION_SHARE)
    dividing, replicating = tp_candidates(size, world_size=world_size, local_world_size=local_world_size,
                                          kv_replication=kv_replication)
    tp_options = dividing + replicating
    for pp in [p for p in range(1, size.num_layers + 1) if world_size % p == 0]:
        for tp in tp_options:
            if world_size % (tp * pp):
                continue
            dp = world_size // (tp * pp)
            ep = 1
            if size.num_experts:
                ep = max(e for e in range(1, dp + 1) if dp % e == 0 and size.num_experts % e == 0)
            need = state_bytes_per_rank(size, tp=tp, pp=pp, dp=dp, ep=ep, dtype_bytes=dtype_bytes)
            if need <= budget:
                layout = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel_size=ep,
                                        sequence_parallel=tp > 1)
                if accepts is not None and not accepts(layout):
                    continue
                reason = (f"parallel='auto': {size.num_params / 1e9:.2f}B parameters need ~{need / 2**30:.1f} GiB of "
                          f"model and optimizer state per rank with TP={tp} x PP={pp} x DP={dp}"
                          + (f" x EP={ep}" if ep > 1 else "")
                          + (f" (each of the {size.num_key_value_heads} KV heads on {tp // size.num_key_value_heads}"
                             " ranks)" if tp in replicating else "")
                          + f", within {budget / 2**30:.1f} GiB of {device_memory / 2**30:.1f} GiB "
                          "(the rest is left for activations)"
                          + ("; smaller TP/PP did not fit." if tp * pp > 1 else "; no model parallelism needed."))
                return layout, reason
    raise ParallelLayoutError(
        f"parallel='auto': a {size.num_params / 1e9:.2f}B-parameter model does not fit {world_size} devices of "
        f"{device_memory / 2**30:.1f} GiB with any TP <= {max(tp_options, default=1)} and PP layout; use more devices.")


def bridge_accepts(bridge) -> Callable[[ParallelConfig], bool]:
    """``choose_layout``'s ``accepts`` for a bridge: a layout its ``check_layout`` (if it has one) does not refuse."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError

    def accepts(layout: ParallelConfig) -> bool:
        try:
            getattr(bridge, "check_layout", lambda _: None)(layout)
        except (UnsupportedConfigError, ParallelLayoutError):
            return False
        return True

    return accepts
