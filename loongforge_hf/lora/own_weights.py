"""LoRA on weights a bridge's own modules hold as parameters where transformers has an ``nn.Linear`` (Mamba-1's
``x_proj``, Doge's ``dt_proj`` and ``router_gate``, Kimi Linear's ``f_a_proj`` / ``f_b_proj`` / ``g_a_proj`` /
``g_b_proj``, JetMoE's attention router ``router.layer``), which PEFT adapts as any linear.

Choices:
- The module declares the weights and their tensor-parallel split (``lora_own_weights``) and applies each through
  ``bridges.own_weights.adapted``; the planner takes an HF linear whose weight is one of those as a target of kind
  ``"row"`` / ``"column"`` / ``"replicated"`` (``KIND``) with ``Target.own_weight`` set (``plan._adaptable``).
- Attaching re-classes the module to ``Lora<cls>`` (``cls`` first: ``unload`` re-classes to ``__mro__[1]``) with a
  child ``lora`` of ``LoraAdapter``s keyed by the HF module's last component (``x_proj``), each knowing its weight
  and split. ``lora_term`` adds PEFT's ``scaling * B (A dropout(x))`` to the module's product with the weight, the
  factors split as the weight is: A's input columns for ``"row"`` (the term joins the partial products the module
  sums over TP), B's output rows for ``"column"``, neither for ``"replicated"``. A factor whole on every rank enters
  through ``copy_to_tensor_model_parallel_region``, so its gradient sums the ranks' partial ones, as the module's split
  makes them partial (each rank's channels or heads use its output); the activations' gradients go through the
  module's own collectives, as the weight's products' do. A weight whole on every rank applied to the rank's own
  tokens (``"sequence_parallel"``: Doge's ``router_gate``) has its factors marked ``sequence_parallel`` under SP, as
  the weight is, so megatron sums their gradients over TP; one whose module gives every rank the whole gradient
  (``"whole"``: JetMoE's attention router, reading every token) takes no reduction. Dropout on an input split over
  TP (``"row"``, or the tokens
  under SP) draws from megatron's model-parallel RNG tracker, else from the default generator (in step over TP).
- Merging adds ``scaling * B @ A`` of the local factors, which is the delta of this rank's part of the weight.
- Training checkpoints: the adapters' split factors sharded along their TP axis, the others replicated, stacked over
  the layers that carry them (``layers.stack_over_adapted_layers``), beside the module's own tensors.
- DoRA and PiSSA / OLoRA on these targets are refused by name (``replicated.check_replicated_options``): not
  compared with PEFT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# NOTE: a module's split of its own weight -> the factor split over TP (its dim below), the planner's target kind
SPLIT_FACTOR = {"row": "A", "column": "B", "replicated": None, "sequence_parallel": None, "whole": None}
KIND = {"row": "row", "column": "column", "replicated": "replicated", "sequence_parallel": "replicated",
        "whole": "replicated"}
_SUMMED = ("row", "column", "replicated")  # NOTE: a factor whole on every rank takes the ranks' partial gradients
_SPLIT_DIM = {"A": 1, "B": 0}


class LoraOwnWeights:
    """What ``Lora<cls>`` adds to a bridge module with adapters on its own weights (see the module docstring)."""

    lora: nn.ModuleDict

    def lora_term(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out``, ``x`` through the module's weight ``name``, plus the adapters' terms on that weight."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        if self.__dict__.get("lora_disabled"):  # NOTE: inside disable_adapter() (unload.py)
            return out
        group = self.tp_group
        tp = group.size() if group is not None else 1
        for adapter in self.lora.values():
            if adapter.own_weight != name:
                continue
            split, tokens = SPLIT_FACTOR[adapter.own_split], adapter.own_split == "sequence_parallel"
            a, b = adapter.A, adapter.B
            if tp > 1 and adapter.own_split in _SUMMED:  # NOTE: else megatron sums (SP-marked) or each rank's is whole
                a = a if split == "A" else copy_to_tensor_model_parallel_region(a, group=group)
                b = b if split == "B" else copy_to_tensor_model_parallel_region(b, group=group)
            xd = adapter.drop(x, input_is_split=tp > 1 and (split == "A" or tokens and a.sequence_parallel))
            out = out + (F.linear(F.linear(xd.to(a.dtype), a), b) * adapter.scaling).to(out.dtype)
        return out

    def lora_deltas(self):
        """(weight, its float32 merge delta ``scaling * B @ A``) for each adapter: this rank's part of the weight."""
        for adapter in self.lora.values():
            yield getattr(self, adapter.own_weight), \
                (adapter.B.detach().float() @ adapter.A.detach().float()) * adapter.scaling

    def _lora_sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        from loongforge_hf.lora.layers import stack_over_adapted_layers

        base = type(self).__mro__[1].sharded_state_dict(self, prefix, sharded_offsets, metadata)
        out = {k: v for k, v in base.items() if not k.startswith(f"{prefix}lora.")}
        axes = {f"{n}.{f}": _SPLIT_DIM[f] for n, a in self.lora.items() if (f := SPLIT_FACTOR[a.own_split])}
        adapters = make_sharded_tensors_for_checkpoint(
            self.lora.state_dict(prefix="", keep_vars=True), f"{prefix}lora.", axes, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"])
        return {**out, **stack_over_adapted_layers(adapters, f"{prefix}lora.", self.lora, sharded_offsets)}


_ADAPTED: dict[type, type] = {}


def check_own_weights_adaptable(module: nn.Module, targets) -> None:
    """``TypeError`` unless ``module`` declares each target's weight (``lora_own_weights``) with its split, before
    anything changes."""
    declared = getattr(type(module), "lora_own_weights", {})
    wrong = [t.own_weight for t in targets if KIND.get(declared.get(t.own_weight)) != t.kind]
    if wrong or isinstance(module, LoraOwnWeights):
        raise TypeError(f"LoRA on {type(module).__name__}'s own weights {wrong or sorted(declared)}: the module does "
                        f"not apply them through bridges.own_weights.adapted as {[t.kind for t in targets]} (it "
                        f"declares {declared}), or has adapters already.")


def attach_own_weights(module: nn.Module, members, adapters: dict) -> None:
    """Turn ``module`` into its ``Lora<cls>`` in place with ``adapters`` (by target name) on the weights of the
    targets in ``members`` [(Target, factors)]."""
    check_own_weights_adaptable(module, [t for t, _ in members])
    for t, _ in members:
        adapter = adapters[t.name]
        adapter.own_weight, adapter.own_split = t.own_weight, type(module).lora_own_weights[t.own_weight]
        for p in (adapter.A, adapter.B):  # NOTE: megatron sums these over TP where SP splits the tokens
            p.sequence_parallel = adapter.own_split == "sequence_parallel" and bool(module.config.sequence_parallel)
    cls = type(module)
    if cls not in _ADAPTED:
        _ADAPTED[cls] = type(f"Lora{cls.__name__}", (cls, LoraOwnWeights),
                             {"sharded_state_dict": LoraOwnWeights._lora_sharded_state_dict})
    module.__class__ = _ADAPTED[cls]
    module.lora = nn.ModuleDict(adapters)
