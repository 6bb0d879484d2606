"""``ParallelConfig``: the parallel layout in the user's words, and its validation.

Validation is pure (numbers in, error out) so every rank reaches the same verdict before any collective runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping


class ParallelLayoutError(ValueError):
    """A parallel layout that cannot work for this world size or this model."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    virtual_pipeline_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sequence_parallel":
                if not isinstance(value, bool):
                    raise ParallelLayoutError(f"sequence_parallel must be True or False, got {value!r}.")
                continue
            if value is None and f.name in ("virtual_pipeline_parallel_size", "expert_tensor_parallel_size"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelLayoutError(f"{f.name} must be a positive integer, got {value!r}.")
        if self.virtual_pipeline_parallel_size is not None and self.virtual_pipeline_parallel_size > 1 \
                and self.pipeline_parallel_size == 1:
            raise ParallelLayoutError("virtual_pipeline_parallel_size > 1 needs pipeline_parallel_size > 1.")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ParallelLayoutError("sequence_parallel=True needs tensor_parallel_size > 1.")

    @property
    def interleaved_stages(self) -> int | None:
        """Virtual pipeline stages per rank in megatron's terms: None unless the schedule interleaves (> 1)."""
        vpp = self.virtual_pipeline_parallel_size
        return vpp if vpp is not None and vpp > 1 else None

    @property
    def sequence_multiple(self) -> int:
        """What megatron needs a sequence length to divide by: TP under sequence parallelism, 2 x CP under context
        parallelism (two load-balanced chunks per rank)."""
        cp = self.context_parallel_size
        return math.lcm(self.whole_sequence_multiple, 2 * cp if cp > 1 else 1)

    @property
    def whole_sequence_multiple(self) -> int:
        """What a sequence every CP rank runs whole (generate's cached steps) must divide by: TP under sequence
        parallelism."""
        return self.tensor_parallel_size if self.sequence_parallel else 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    @property
    def etp_size(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        self.check_world_size(world_size)
        return world_size // self.model_parallel_size

    def check_world_size(self, world_size: int) -> None:
        if world_size % self.model_parallel_size:
            raise ParallelLayoutError(
                f"World size {world_size} is not divisible by tensor_parallel_size ({self.tensor_parallel_size}) x "
                f"pipeline_parallel_size ({self.pipeline_parallel_size}) x context_parallel_size "
                f"({self.context_parallel_size}) = {self.model_parallel_size}.")
        expert_block = self.etp_size * self.expert_parallel_size * self.pipeline_parallel_size
        if world_size % expert_block:
            raise ParallelLayoutError(
                f"World size {world_size} is not divisible by expert_tensor_parallel_size ({self.etp_size}) x "
                f"expert_parallel_size ({self.expert_parallel_size}) x pipeline_parallel_size "
                f"({self.pipeline_parallel_size}) = {expert_block}.")

    def check_model(self, *, num_layers: int, num_attention_heads: int, num_key_value_heads: int,
                    vocab_size: int | None = None, num_experts: int | None = None,
                    allow_uneven_pipeline: bool = True) -> None:
        """Check the layout against a model's sizes; raises ``ParallelLayoutError`` naming the field."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if num_attention_heads % tp:
            raise ParallelLayoutError(f"num_attention_heads={num_attention_heads} is not divisible by "
                                      f"tensor_parallel_size={tp}.")
        if num_key_value_heads % tp and tp % num_key_value_heads:
            # NOTE: tp a multiple of the KV heads replicates each head on tp / kv ranks (parallel/kv_replicas.py)
            raise ParallelLayoutError(f"num_key_value_heads={num_key_value_heads} and tensor_parallel_size={tp}: "
                                      "one must divide the other (whole KV heads per rank, or each KV head "
                                      "replicated on the same number of ranks).")
        vpp = self.virtual_pipeline_parallel_size or 1
        stages = pp * vpp
        if num_layers < stages:
            raise ParallelLayoutError(f"num_hidden_layers={num_layers} is smaller than the number of pipeline stages, "
                                      f"pipeline_parallel_size ({pp}) x virtual_pipeline_parallel_size ({vpp}) = "
                                      f"{stages}.")
        if self.virtual_pipeline_parallel_size and num_layers % stages:
            raise ParallelLayoutError(f"num_hidden_layers={num_layers} is not divisible by pipeline_parallel_size "
                                      f"({pp}) x virtual_pipeline_parallel_size ({vpp}) = {stages}.")
        if not allow_uneven_pipeline and num_layers % pp:
            raise ParallelLayoutError(f"num_hidden_layers={num_layers} is not divisible by "
                                      f"pipeline_parallel_size={pp}.")
        if num_experts is not None and num_experts % self.expert_parallel_size:
            raise ParallelLayoutError(f"num_experts={num_experts} is not divisible by "
                                      f"expert_parallel_size={self.expert_parallel_size}.")
        if num_experts is not None and tp > 1 and not self.sequence_parallel:
            # NOTE: megatron-core's MoE layer raises on the first training forward otherwise (moe_layer.py:379).
            raise ParallelLayoutError(f"tensor_parallel_size={tp} with a mixture-of-experts model needs "
                                      "sequence_parallel=True.")
        if num_experts is None and self.expert_parallel_size > 1:
            raise ParallelLayoutError(f"expert_parallel_size={self.expert_parallel_size} was given for a model "
                                      "without experts.")

    def with_overrides(self, **overrides: Any) -> "ParallelConfig":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "ParallelConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in names and v is not None})


PARALLEL_KWARGS = tuple(f.name for f in fields(ParallelConfig))
