"""What the MoE bridges share: the router, routed experts split over expert parallelism, shared experts, and the
megatron MoE config a bridge's routing declaration turns into.

Choices:
- A layer is dense or sparse as the HF config says (``is_moe_layer``); megatron gets the same pattern as a 0/1
  ``moe_layer_freq`` list and builds each layer from its own spec (``specs.layer_spec_for``).
- Routed experts run in megatron's MoE layer: alltoall dispatcher (allgather where expert and expert-tensor parallel
  are both 1, see ``specs.py``), no token dropping, experts as our ``kernels.grouped_mlp.GroupedMLP`` (each
  projection of all local experts one stacked parameter, grouped GEMMs on GPU); ``LOONGFORGE_MOE_GROUPED_GEMM=0``
  when the bridge is made selects megatron's ``SequentialMLP`` (one MLP per local expert, in a loop), to compare.
- Expert-parallel rank ``e`` of ``E`` owns experts ``[e * N / E, (e + 1) * N / E)`` and reads only those, each split
  over the expert-tensor-parallel group (``expert_tensor_parallel_size``, by default the TP size).
- Expert mappings: ``Expert`` (one megatron parameter per expert, ``SequentialMLP``) or ``StackedExpert`` (one
  parameter ``[local experts, ...]``, ``GroupedMLP``): both read each owned expert's HF tensors with the same per-expert
  mapping and export expert by expert (``ExpertSlice`` picks one expert out of the stack before any gather).
- Routing, HF -> megatron (``routing_kwargs`` in each bridge):
  softmax, top-k renormalised  -> ``moe_router_pre_softmax=False`` (softmax over the k chosen logits: the same probs);
  softmax, not renormalised    -> ``moe_router_pre_softmax=True``;
  sigmoid (DeepSeek-V3)        -> ``score_function="sigmoid"``; ``e_score_correction_bias`` -> ``router.expert_bias``;
                                  megatron renormalises sigmoid top-k whenever k > 1, so ``norm_topk_prob`` must be on;
  ``n_group`` / ``topk_group`` -> ``moe_router_num_groups`` / ``moe_router_group_topk``: megatron scores a group by the
                                  sum of its top ``k / topk_group`` scores, which must equal the model's own rule
                                  (``group_score_top``: 2 for V3's top-2 sum, 1 for V2's max);
  ``routed_scaling_factor``    -> ``moe_router_topk_scaling_factor``;
  softmax plus a fixed bias    -> ``biased_routing.route`` (ERNIE 4.5; megatron biases sigmoid scores only).
  A setting megatron cannot reproduce raises ``UnsupportedConfigError`` naming the field.
- The router balancing loss (``output_router_logits``, ``router_aux_loss_coef``) is transformers' own over a forward's
  MoE layers for bridges that declare ``hf_balance_loss`` (router: ``router_balance.BalanceRouter``); megatron's
  per-layer ones stay off (``moe_router_load_balancing_type="none"``): never counted twice.
- transformers' ``router_logits`` output (``MoeCausalLMOutputWithPast``) for bridges that declare ``hf_router_logits``
  (their router a ``BalanceRouter`` too; ``router_logits.py``): those with the balancing loss, and DeepSeek's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.fused_mappings import Expert, GatedMLP
from loongforge_hf.bridges.mappings import FP32Replicated, Mapping, Replicated, RowParallel

EXPERT = "{expert}"
GROUPED_GEMM_ENV = "LOONGFORGE_MOE_GROUPED_GEMM"


def grouped_experts_enabled() -> bool:
    """Whether routed experts are the grouped MLP (default) rather than megatron's ``SequentialMLP``."""
    value = os.environ.get(GROUPED_GEMM_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{GROUPED_GEMM_ENV}={value!r}: use 1 (grouped expert MLP) or 0 (megatron's SequentialMLP).")
    return value in ("1", "true", "on")


def _bind_names(inner: Mapping, *, hf_index: int) -> Mapping:
    """``inner`` with ``{expert}`` in its HF names set to ``hf_index`` (its megatron name is not used)."""
    values = {f.name: getattr(inner, f.name).replace(EXPERT, str(hf_index)) for f in fields(inner)
              if f.name != "megatron" and isinstance(getattr(inner, f.name), str)}
    return replace(inner, **values)


@dataclass(frozen=True)
class ExpertSlice(Mapping):
    """Expert ``index`` of a stacked expert parameter ``megatron`` ``[local experts, ...]``; ``inner`` its HF names.

    The exporter takes ``local_part`` of this rank's stack before gathering, so only one expert's shard moves."""

    megatron: str
    inner: Mapping
    index: int

    @property
    def tp_split(self) -> str | None:  # type: ignore[override]
        return self.inner.tp_split

    @property
    def hf_dtype(self):  # type: ignore[override]
        return self.inner.hf_dtype

    def local_part(self, stack: torch.Tensor) -> torch.Tensor:
        return stack[self.index]

    def hf_names(self, layer):
        return self.inner.hf_names(layer)

    def hf_block(self, layer):
        return self.inner.hf_block(layer)

    def hf_block_rows(self, layer):
        return self.inner.hf_block_rows(layer)

    def load(self, reader, ctx, layer):
        return self.inner.load(reader, ctx, layer)

    def export(self, shards, ctx, layer):
        return self.inner.export(shards, ctx, layer)


@dataclass(frozen=True)
class StackedExpert(Expert):
    """Every routed expert an expert-parallel rank owns, stacked in one megatron parameter ``stack``
    ``[N / E, ...]``; ``inner`` is one expert's mapping with ``{expert}`` in its HF names.

    ``load`` (given the model's ``ShardContext``) reads the owned experts' slices, split over the expert-tensor-parallel
    group, and stacks them; ``bind`` gives the ``ExpertSlice`` the exporter writes one expert from."""

    stack: str
    num_experts: int

    @property
    def megatron(self) -> str:  # type: ignore[override]
        return self.stack

    def bind(self, *, global_expert: int, local_expert: int) -> Mapping:
        return ExpertSlice(self.stack, _bind_names(self.inner, hf_index=global_expert), local_expert)

    def rows_to_megatron(self, rows: torch.Tensor, ctx=None) -> torch.Tensor:
        """A tensor with one expert's HF output rows (an expert LoRA's B) in the stack's row order."""
        permute = getattr(self.inner, "rows_to_megatron", None)
        return rows if permute is None else permute(rows, ctx)

    def rows_to_hf(self, rows: torch.Tensor, ctx=None) -> torch.Tensor:
        """The inverse of ``rows_to_megatron``."""
        permute = getattr(self.inner, "rows_to_hf", None)
        return rows if permute is None else permute(rows, ctx)

    def load(self, reader, ctx, layer):
        per_rank = self.num_experts // ctx.ep_size
        expert_ctx = ctx.for_experts()
        first = ctx.ep_rank * per_rank
        return torch.stack([_bind_names(self.inner, hf_index=first + i).load(reader, expert_ctx, layer)
                            for i in range(per_rank)])


@dataclass(frozen=True)
class SharedExpertGate(Replicated):
    """The shared experts' gate ``[1, H]`` (megatron's ``shared_experts.gate_weight``, HF's ``shared_expert_gate``):
    replicated, and a plain linear in HF that LoRA adapts (``lora/experts.py``) on its megatron module."""

    @property
    def module_path(self) -> str:
        return self.megatron.rsplit(".", 1)[0]


def grouped_routing_kwargs(*, num_experts: int, top_k: int, n_group: int | None, topk_group: int | None,
                           group_score_top: int, field_prefix: str = "") -> dict:
    """megatron's group-limited routing for HF ``n_group`` / ``topk_group`` (empty when grouping cannot bind)."""
    if not n_group or n_group <= 1 or not topk_group or topk_group >= n_group:
        return {}
    if num_experts % n_group:
        raise C.UnsupportedConfigError(f"{field_prefix}n_group={n_group} does not divide the {num_experts} experts.")
    if top_k // topk_group != group_score_top:
        raise C.UnsupportedConfigError(
            f"{field_prefix}num_experts_per_tok={top_k} with topk_group={topk_group}: megatron scores an expert group "
            f"by its top {top_k // topk_group} expert(s), this model by its top {group_score_top}.")
    return {"moe_router_num_groups": n_group, "moe_router_group_topk": topk_group}


def whole_experts_layout(bridge, layout):
    """``layout`` with every expert whole on its rank (``expert_tensor_parallel_size=1``) for a bridge whose experts
    cannot be split over tensor parallelism (``splits_experts`` False: gpt-oss's expert biases, which megatron-core's
    MoE takes at expert-tensor-parallel size 1 only) when the size was left to default to TP's; an explicit larger
    size is refused (before any collective)."""
    from loongforge_hf.parallel.config import ParallelLayoutError

    if getattr(bridge, "splits_experts", True) or layout.etp_size == 1:
        return layout
    if layout.expert_tensor_parallel_size is not None:
        raise ParallelLayoutError(f"expert_tensor_parallel_size={layout.expert_tensor_parallel_size} is not supported "
                                  f"for {bridge.architectures[0]} (expert biases): use 1, the default for it.")
    return replace(layout, expert_tensor_parallel_size=1)


class MoEBridge(DenseBridge):
    """A decoder whose MLPs are (some or all) mixtures of experts; subclasses declare names and routing."""

    sparse_block: str = "mlp"                                  # HF module holding router and experts
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_experts: str | None = None                          # HF module of always-on experts (DeepSeek)
    shared_expert_gate: str | None = None                      # HF linear [1, H] whose sigmoid scales them (Qwen2-MoE)
    expert_bias: bool = False                                  # ``gate.e_score_correction_bias`` (DeepSeek-V3)
    expert_bias_name: str = "gate.e_score_correction_bias"     # ... in the sparse block (MiniMax-M2: beside gate)
    router_name: str = "gate"                                  # the router's linear in it (HY3's: router.gate)
    router_fp32: bool = False                                  # transformers keeps ``gate.weight`` in fp32
    hf_balance_loss: bool = False                              # transformers' model computes the router aux loss
    hf_router_logits: bool = False                             # ... returns MoeCausalLMOutputWithPast, router_logits
    splits_experts: bool = True                                # experts may split over TP (whole_experts_layout)

    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        self.grouped_experts = grouped_experts_enabled()  # experts as GroupedMLP (else megatron's SequentialMLP)

    # ---- declarations each model makes ----------------------------------------------------------------------
    def num_experts(self) -> int:
        raise NotImplementedError

    def top_k(self) -> int:
        return self.hf_config.num_experts_per_tok

    def expert_ffn_size(self) -> int:
        return self.hf_config.moe_intermediate_size

    def shared_ffn_size(self) -> int | None:
        return None

    def is_moe_layer(self, layer: int) -> bool:
        raise NotImplementedError

    def routing_kwargs(self) -> dict:
        """Score function, normalisation, grouping and scaling (see the module docstring)."""
        raise NotImplementedError

    def moe_module(self) -> type | None:
        """The MoE layer class where megatron's ``MoELayer`` does not serve (FlexOlmo's post norm); None for it."""

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        super().check_config()
        self.routing_kwargs()

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.update(
            num_moe_experts=self.num_experts(), moe_ffn_hidden_size=self.expert_ffn_size(),
            moe_router_topk=self.top_k(),
            moe_layer_freq=[int(self.is_moe_layer(i)) for i in range(self.hf_config.num_hidden_layers)],
            moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=None, moe_grouped_gemm=False,
            moe_shared_expert_intermediate_size=self.shared_ffn_size(),
            moe_shared_expert_gate=self.shared_expert_gate is not None,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32" if self.router_fp32 else None,
        )
        kw.update(self.routing_kwargs())
        return kw

    # ---- tensors --------------------------------------------------------------------------------------------
    def routed_mappings(self, fc1: Mapping, fc2: Mapping) -> list[Mapping]:
        """One expert's fc1 / fc2 mappings as the grouped MLP's stacks, or megatron's ``SequentialMLP`` experts."""
        return [StackedExpert(m, f"{D}.mlp.experts.{n}.weight", self.num_experts()) if self.grouped_experts else
                Expert(m) for m, n in ((fc1, "linear_fc1"), (fc2, "linear_fc2"))]

    def moe_mappings(self) -> list[Mapping]:
        s = f"{L}.{self.sparse_block}"
        gate, up, down = self.expert_projections
        router = FP32Replicated if self.router_fp32 else Replicated
        local = f"{D}.mlp.experts.local_experts.{EXPERT}"
        routed = self.routed_mappings(
            GatedMLP(f"{local}.linear_fc1.weight", gate=f"{s}.experts.{EXPERT}.{gate}.weight",
                     up=f"{s}.experts.{EXPERT}.{up}.weight"),
            RowParallel(f"{local}.linear_fc2.weight", f"{s}.experts.{EXPERT}.{down}.weight"))
        maps: list[Mapping] = [
            Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
            router(f"{D}.mlp.router.weight", f"{s}.{self.router_name}.weight"),
            *routed,
        ]
        if self.expert_bias:
            maps.append(FP32Replicated(f"{D}.mlp.router.expert_bias", f"{s}.{self.expert_bias_name}"))
        if self.shared_experts:
            shared = f"{s}.{self.shared_experts}"
            maps += [GatedMLP(f"{D}.mlp.shared_experts.linear_fc1.weight", gate=f"{shared}.gate_proj.weight",
                              up=f"{shared}.up_proj.weight"),
                     RowParallel(f"{D}.mlp.shared_experts.linear_fc2.weight", f"{shared}.down_proj.weight")]
        if self.shared_expert_gate:
            gate = f"{s}.{self.shared_expert_gate}.weight"
            maps.append(SharedExpertGate(f"{D}.mlp.shared_experts.gate_weight", gate))
        return maps

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.dense_mlp_mappings() + self.moe_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mlp = self.moe_mappings() if self.is_moe_layer(layer) else self.dense_mlp_mappings()
        return self.attention_mappings() + mlp

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        s = f"{prefix}.{self.sparse_block}"
        gate, up, down = self.expert_projections
        shapes = {f"{prefix}.post_attention_layernorm.weight": (h,), f"{s}.{self.router_name}.weight": (n, h)}
        for e in range(n):
            shapes.update({f"{s}.experts.{e}.{gate}.weight": (f, h), f"{s}.experts.{e}.{up}.weight": (f, h),
                           f"{s}.experts.{e}.{down}.weight": (h, f)})
        if self.expert_bias:
            shapes[f"{s}.{self.expert_bias_name}"] = (n,)
        if self.shared_experts:
            fs, shared = self.shared_ffn_size(), f"{s}.{self.shared_experts}"
            shapes.update({f"{shared}.gate_proj.weight": (fs, h), f"{shared}.up_proj.weight": (fs, h),
                           f"{shared}.down_proj.weight": (h, fs)})
        if self.shared_expert_gate:
            shapes[f"{s}.{self.shared_expert_gate}.weight"] = (1, h)
        return shapes

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        mlp = self.moe_shapes(prefix) if self.is_moe_layer(layer) else self.dense_mlp_shapes(prefix)
        return {**self.attention_shapes(prefix), **mlp}
