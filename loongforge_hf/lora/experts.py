"""LoRA on the routed experts and the router inside megatron's MoE layer: PEFT's ``ParamWrapper`` math.

Choices:
- Experts: loongforge's ``GroupedMLP`` (``kernels/grouped_mlp.py``) is re-classed in place to ``LoraGroupedMLP`` with a
  child ``lora`` holding one ``ExpertAdapter`` per adapted stack (``gate_up_proj`` on ``linear_fc1``, ``down_proj`` on
  ``linear_fc2``), each with this expert-parallel rank's experts: A ``[local experts, r, in]``, B
  ``[local experts, out, r]``. PEFT folds ``W_e + s * B_e A_e`` into the weight (``baddbmm``) at every forward; here
  the forward adds the low-rank term per expert, ``x W_e^T + s * (x A_e^T) B_e^T``, without building merged weights
  (the same sum, rounded differently). The adapters go to ``grouped_gated_mlp`` as its ``LowRank`` terms: grouped
  GEMMs, as for the frozen experts, where ``_grouped_mm`` takes the expert stacks (CUDA, bf16, hidden size and
  expert width multiples of 8; a rank that is not is padded with zeros there), else the per-expert loop.
- Expert adapters carry the expert weights' attributes (``allreduce=False`` under expert parallelism, so megatron's
  DDP keeps them in its expert buffers and reduces them over the expert-data-parallel group).
- Experts split over expert-tensor parallelism are refused for LoRA (``expert_tensor_parallel_size=1`` is the way),
  and so are plain (not gated) experts, Nemotron-H's relu2 ones (``param_targets`` names no parameter of theirs).
  Experts with biases and gpt-oss's clamped GLU take the adapters like SwiGLU ones (the biases added after the
  low-rank terms, as PEFT's merged weight gives); gpt-oss's B rows come in megatron's ``[gate; up]`` order
  (``Target.b_to_megatron``) and go back alternating on export. Llama 4's PEFT factors work the other way round
  (``Target.factors_swapped``): ``megatron_factors`` / ``peft_factors`` transpose and swap them.
- Router: megatron's router (``TopKRouter``, or ``BalanceRouter`` with the HF balancing loss) is re-classed to a
  subclass whose ``gating`` uses ``W + s * B A``: what PEFT does for a 2-D parameter (the router is ``[E, H]``).
  A and B are replicated; under sequence parallelism they are marked ``sequence_parallel`` like the router weight,
  so megatron sums their gradients over the tensor-parallel ranks that split the tokens.
- Shared-expert gate (Qwen2-MoE's ``shared_expert_gate``, a plain ``nn.Linear(H, 1)`` that PEFT adapts as a module,
  "all-linear" included): megatron's ``SharedExpertMLP`` keeps it as a raw ``gate_weight`` [1, H], so the module is
  re-classed to a subclass whose forward adds PEFT's term to the gate logits, ``W x + s * B A dropout(x)``; A and B
  replicated and marked ``sequence_parallel`` like the router's, the dropout mask drawn as ``layers.py`` draws it.
- ``sharded_state_dict``: expert adapters sharded along the expert axis over expert parallelism, like the stacks.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from loongforge_hf.kernels.grouped_mlp import GroupedMLP, LowRank, grouped_gated_mlp, routed_inputs
from loongforge_hf.lora.plan import LoraConfigError

_STACKS = {"gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}


class ExpertAdapter(nn.Module):
    """One expert stack's adapters on this rank: A ``[local experts, r, in]``, B ``[local experts, out, r]``."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, *, scaling: float, expert_parallel: bool) -> None:
        super().__init__()
        self.A = nn.Parameter(a)
        self.B = nn.Parameter(b)
        self.scaling = scaling
        for p in (self.A, self.B):  # NOTE: as kernels.grouped_mlp._StackedWeight marks the expert stacks
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
            p.allreduce = not expert_parallel

    def low_rank(self) -> LowRank:
        """The term ``grouped_gated_mlp`` adds to this stack's products."""
        return LowRank(self.A, self.B, self.scaling)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scaling * B_e @ A_e`` per local expert, ``[local experts, out, in]`` in float32."""
        return torch.bmm(self.B.float(), self.A.float()) * self.scaling


class LoraGroupedMLP(GroupedMLP):
    """loongforge's grouped expert MLP plus per-expert LoRA on ``gate_up_proj`` (fc1) and / or ``down_proj`` (fc2)."""

    lora: nn.ModuleDict

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert, permuted_probs: torch.Tensor):
        x, probs = routed_inputs(self.config, permuted_local_hidden_states, permuted_probs)
        adapters = tuple(self.lora[name].low_rank() if name in self.lora and not self.__dict__.get("lora_disabled")
                         else None for name in _STACKS)
        return grouped_gated_mlp(x, self.linear_fc1.weight, self.linear_fc2.weight, tokens_per_expert, probs,
                                 adapters=adapters, biases=self.biases(), activation=self.activation), None

    def lora_deltas(self):
        """(base stack, its float32 delta) for each adapted stack."""
        for name, adapter in self.lora.items():
            yield getattr(self, _STACKS[name]).weight, adapter.delta_weight()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.dist_checkpointing import ShardedTensor

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        axis = len(sharded_offsets)
        ep = (axis, self.ep_group.rank(), self.ep_group.size())
        for name, adapter in self.lora.items():
            for factor in ("A", "B"):
                key = f"{prefix}lora.{name}.{factor}"
                out[key] = ShardedTensor.from_rank_offsets(key, getattr(adapter, factor), *sharded_offsets, ep,
                                                           replica_id=(0, 0, self.dp_group.rank()),
                                                           prepend_axis_num=axis)
        return out


def _router_gating(self, input):
    # NOTE: stands in for megatron-core 0.16.1 transformer/moe/router.py:79-101 (TopKRouter.gating) with the adapted
    # weight; its move of CPU weights to the GPU does not apply (the model lives on its device).
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    adapter = self.lora["router"]
    weight = self.weight if self.__dict__.get("lora_disabled") else \
        self.weight + ((adapter.B @ adapter.A) * adapter.scaling).to(self.weight.dtype)
    if hasattr(self, "gating_input"):
        input = self.gating_input(input)
    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    return router_gating_linear(input, weight, self.bias, router_dtype)


def _shared_gate_forward(self, hidden_states):
    # NOTE: stands in for megatron-core 0.16.1 transformer/moe/shared_experts.py:125-132 (SharedExpertMLP.forward)
    # with the adapter's term added to the gate logits.
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP

    output, _ = MLP.forward(self, hidden_states)
    logits = F.linear(hidden_states, self.gate_weight)
    if not self.__dict__.get("lora_disabled"):
        adapter = self.lora["shared_expert_gate"]
        x = adapter.drop(hidden_states, input_is_split=bool(self.config.sequence_parallel))
        logits = logits + F.linear(F.linear(x, adapter.A), adapter.B) * adapter.scaling
    return output * torch.sigmoid(logits)


class _WholeWeightAdapter:
    """What the re-classed router and shared-expert MLP share: one replicated adapter (``lora_key``) on a raw weight
    (``lora_weight``), and what merging adds to that weight."""

    lora_key: str
    lora_weight: str

    def lora_deltas(self):
        adapter = self.lora[self.lora_key]
        yield getattr(self, self.lora_weight), (adapter.B.detach().float() @ adapter.A.detach().float()) * \
            adapter.scaling


# kind -> what its class changes: the router's gating weight is W + scaling * B @ A; the shared-expert gate's logits
# get the adapter's term
_WHOLE_WEIGHT_KINDS = {"router": dict(gating=_router_gating, lora_key="router", lora_weight="weight"),
                       "shared_gate": dict(forward=_shared_gate_forward, lora_key="shared_expert_gate",
                                           lora_weight="gate_weight")}
_ADAPTED: dict[tuple[str, type], type] = {}


def _adapted_class(kind: str, base: type) -> type:
    """``base`` (megatron's router class or ``SharedExpertMLP``) with the ``kind`` adapter; made once per class
    (``base`` stays the first in the MRO after it: unloading re-classes to ``__mro__[1]``)."""
    if (kind, base) not in _ADAPTED:
        _ADAPTED[(kind, base)] = type(f"Lora{base.__name__}", (base, _WholeWeightAdapter), _WHOLE_WEIGHT_KINDS[kind])
    return _ADAPTED[(kind, base)]


class ReplicatedAdapters(nn.ModuleDict):
    """The shared-expert gate's adapters, whole on every rank; checkpointed as such: megatron's ``MLP`` asks each of
    its children for its ``sharded_state_dict``, which a plain ``ModuleDict`` lacks."""

    def __init__(self, adapters: dict, *, tp_group) -> None:
        super().__init__(adapters)
        self.tp_group = tp_group

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def is_param_lora(module: nn.Module) -> bool:
    return isinstance(module, (LoraGroupedMLP, _WholeWeightAdapter))


def check_param_adaptable(module: nn.Module, kind: str) -> None:
    """Refuse (every rank alike) a module ``attach_param_adapters`` cannot adapt."""
    from megatron.core.transformer.moe.router import TopKRouter

    if kind == "router":
        if not isinstance(module, TopKRouter) or isinstance(module, _WholeWeightAdapter):
            raise TypeError(f"LoRA on the router needs megatron's TopKRouter; got {type(module).__name__}.")
        # NOTE: the adapter's class replaces the gating; a router transforming the gating's input says how
        # (``gating_input``: Gemma 4's), which the adapted gating applies first
        if type(module).gating is not TopKRouter.gating and not hasattr(module, "gating_input"):
            raise TypeError(f"LoRA on the router needs megatron's gating linear; {type(module).__name__} has a "
                            "gating of its own.")
        return
    if kind == "shared_gate":
        from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

        if type(module) is not SharedExpertMLP or not module.use_shared_expert_gate:
            raise TypeError(f"LoRA on shared_expert_gate needs megatron's SharedExpertMLP with its gate; got "
                            f"{type(module).__name__}.")
        return
    if type(module) is not GroupedMLP:
        raise TypeError(f"LoRA on the routed experts needs loongforge's GroupedMLP (the default expert layer); got "
                        f"{type(module).__name__} (FP8 experts, fp8='on' / 'adaptive', are not supported).")
    if not module.gated:
        raise LoraConfigError("LoRA on the routed experts is not supported for plain (not gated) relu2 experts "
                              "(Nemotron-H): adapt the attention, Mamba2 or shared-expert projections instead.")
    if module.tp_group.size() != 1:
        raise LoraConfigError(f"LoRA on the routed experts needs them whole on each rank: pass "
                              f"expert_tensor_parallel_size=1 (got {module.tp_group.size()}; it defaults to "
                              "tensor_parallel_size), or adapt only the attention projections.")


def megatron_factors(t, a: torch.Tensor, b: torch.Tensor, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert target's PEFT-shaped (A ``[r * E, in]``, B ``[out, r * E]``; or their gradients) as every expert's
    A ``[E, r, in]`` and B ``[E, out, r]`` of the megatron stack, fc1's rows in megatron's order. Where PEFT's
    factors are the other way round (``t.factors_swapped``, Llama 4: its A on the stack's output side), A_e is PEFT's
    B_e transposed and B_e its A_e transposed: the same ``B_e A_e``, transposed as the megatron stack is."""
    num = t.num_experts
    if t.factors_swapped:  # NOTE: PEFT's in_features is the stack's output width
        a_meg = b.reshape(t.out_features, t.r, num).permute(2, 1, 0)
        b_meg = t.b_to_megatron(a.t(), ctx).reshape(t.in_features, num, t.r).permute(1, 0, 2)
        return a_meg, b_meg
    b_meg = t.b_to_megatron(b, ctx).reshape(t.out_features, t.r, num).permute(2, 0, 1)
    return a.reshape(num, t.r, t.in_features), b_meg


def peft_factors(t, a: torch.Tensor, b: torch.Tensor, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``megatron_factors``: every expert's A ``[E, r, in]`` and B ``[E, out, r]`` as PEFT's A and B."""
    num = t.num_experts
    if t.factors_swapped:
        a_peft = t.b_to_hf(b.permute(1, 0, 2).reshape(t.in_features, num * t.r), ctx).t()
        return a_peft.contiguous(), a.permute(2, 1, 0).reshape(t.out_features, t.r * num)
    return a.reshape(num * t.r, t.in_features), t.b_to_hf(b.permute(1, 2, 0).reshape(t.out_features, t.r * num), ctx)


def attach_param_adapters(module: nn.Module, members, *, dtype, device, dropout: float = 0.0, ctx=None) -> None:
    """Give ``module`` (a ``GroupedMLP``, router or ``SharedExpertMLP``) the adapters of ``members`` [(Target, (A, B)
    at HF shape)]; ``dropout``: the LoraConfig's (only the shared-expert gate's adapter, a module target, takes it);
    ``ctx``: the ``ShardContext`` B's rows are put in megatron's order with."""
    kind = members[0][0].kind
    check_param_adaptable(module, kind)
    adapters = {}
    for t, (a, b) in members:
        if kind in ("router", "shared_gate"):
            from loongforge_hf.lora.layers import LoraAdapter

            adapter = LoraAdapter(a.to(device=device, dtype=dtype).clone(), b.to(device=device, dtype=dtype).clone(),
                                  scaling=t.scaling, dropout=dropout if kind == "shared_gate" else 0.0, split=None)
            for p in (adapter.A, adapter.B):
                p.sequence_parallel = bool(module.config.sequence_parallel)
        else:
            num, ep = t.num_experts, module.ep_group
            per = num // ep.size()
            local = slice(ep.rank() * per, (ep.rank() + 1) * per)
            a_full, b_full = megatron_factors(t, a, b, ctx)
            a_local, b_local = a_full[local], b_full[local]
            adapter = ExpertAdapter(a_local.to(device=device, dtype=dtype).contiguous().clone(),
                                    b_local.to(device=device, dtype=dtype).contiguous().clone(),
                                    scaling=t.scaling, expert_parallel=ep.size() > 1)
        adapters[t.name] = adapter
    module.__class__ = _adapted_class(kind, type(module)) if kind in _WHOLE_WEIGHT_KINDS else LoraGroupedMLP
    module.lora = ReplicatedAdapters(adapters, tp_group=module.tp_group) if kind == "shared_gate" else \
        nn.ModuleDict(adapters)
