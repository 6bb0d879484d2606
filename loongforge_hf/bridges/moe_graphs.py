"""megatron's per-layer CUDA graphs (``megatron_config={"cuda_graph_impl": "local"}``) on mixture-of-experts layers.

A graph replays a layer's forward and backward at the shapes it was captured with, and nothing in it may read the
device from the host. megatron-core 0.16's token dispatchers read the routed token counts on the host inside the
layer (``.cpu()`` in the allgather dispatcher, ``.tolist()`` for the all-to-all splits), so every MoE model was
refused. Where every expert is local this package's sync-free allgather dispatcher keeps them on the device and
the permuted row count fixed (tokens x top-k), and bf16 grouped experts run ``torch._grouped_mm``, which reads its
offsets on the device (``kernels/moe_permute.fixed_shape_moe``); such layers are captured whole.

Choices:
- ``check_layout`` (pure, before any collective: every rank raises alike) refuses what the arguments already tell:
  expert parallelism (the all-to-all dispatch), a dtype other than bf16 (the experts' per-expert loop reads the
  counts), megatron's ``SequentialMLP`` (``LOONGFORGE_MOE_GROUPED_GEMM=0``), FP8 (the FP8 experts are not verified
  under graphs), Transformer Engine installed (its permutation keeps megatron's dispatcher, which reads the counts
  on the host), and transformers' router outputs
  (``output_router_logits``): the router logits and the load-balancing loss are gathered across the layers of a
  forward outside the layers' graphs (``router_balance``, ``router_logits``); switched on after loading (TRL does
  for its trainers), they are refused where they are asked for (``router_balance._switch``).
- ``check_built`` asks every built MoE layer (after FP8 and the permutation are in place) and refuses with the
  layers that still do not qualify (the same conditions read from the modules themselves: a safety net behind
  ``check_layout``); ``from_pretrained`` calls it where a failure is agreed by every rank.
- Verified on a GPU: ``tests/kernels/test_gpu_cuda_graphs.py`` (bf16 Qwen3-MoE, Mixtral and DeepSeek-V3, whose
  expert bias moves by token counts accumulated inside the captured forwards: the same losses and bias as eager).
"""

from __future__ import annotations

import os

import torch


def asked(megatron_config) -> bool:
    """Whether ``megatron_config`` (a dict or a TransformerConfig) asks for megatron's local CUDA graphs."""
    value = megatron_config.get("cuda_graph_impl") if isinstance(megatron_config, dict) else \
        getattr(megatron_config, "cuda_graph_impl", None)
    return value == "local"


def check_layout(bridge, hf_config, megatron_config: dict | None, *, expert_parallel_size: int, dtype,
                 fp8: str | None = None) -> None:
    """``ValueError`` where ``cuda_graph_impl="local"`` is asked for MoE layers that cannot be captured (pure)."""
    if not asked(megatron_config or {}) or not bridge.num_experts():
        return
    from loongforge_hf.bridges.moe import GROUPED_GEMM_ENV
    from loongforge_hf.kernels.moe_permute import te_fills_permute

    problems = []
    if expert_parallel_size > 1:
        problems.append(f"expert_parallel_size={expert_parallel_size}: the all-to-all dispatch reads its split "
                        "sizes on the host")
    if dtype != torch.bfloat16:
        problems.append(f"dtype={dtype}: the grouped experts take torch._grouped_mm in bf16 only, elsewhere a "
                        "per-expert loop over the routed counts read on the host")
    if os.environ.get(GROUPED_GEMM_ENV) == "0":
        problems.append(f"{GROUPED_GEMM_ENV}=0: megatron's SequentialMLP reads the routed counts on the host")
    if getattr(hf_config, "output_router_logits", False):
        problems.append(ROUTER_OUTPUTS)
    if fp8 is not None:
        problems.append(f"fp8={fp8!r}: FP8 experts (this package's or Transformer Engine's) are not verified under "
                        "graphs")
    if te_fills_permute():
        problems.append("Transformer Engine is installed: its fused permutation fills megatron's slot and "
                        "megatron's own allgather dispatcher, which reads the routed counts on the host, runs")
    if problems:
        raise ValueError("cuda_graph_impl='local' with MoE layers: " + "; ".join(problems) + ".")


ROUTER_OUTPUTS = ("output_router_logits=True: the router logits and the load-balancing loss are gathered across "
                  "the layers of a forward, outside the layers' CUDA graphs")


def check_built(model) -> None:
    """``ValueError`` naming the MoE layers of ``model`` (a ``MegatronModel``) that asked for local CUDA graphs and
    cannot be captured."""
    if not asked(model.config):
        return
    from loongforge_hf.kernels.moe_permute import unfixed_moe_layers

    bad = unfixed_moe_layers(model.chunks)
    if bad:
        raise ValueError(f"cuda_graph_impl='local': the MoE layers {bad} do not run at fixed shapes without host "
                         "reads: they need expert parallel 1 with the allgather dispatch, this package's token "
                         "permutation rather than Transformer Engine's, and bf16 grouped experts on CUDA with their "
                         "own forward; the FP8 forward fp8='on' / 'adaptive' give the experts is not verified under "
                         "graphs.")
