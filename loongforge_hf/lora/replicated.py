"""LoRA on plain torch linears that a bridge's own modules keep whole on every rank (DeepSeek-V4's attention: its
query / KV / output projections, the compressors' and the indexer's linears; Gemma 3n's AltUp / LAuReL / per-layer
linears and Gemma 4's per-layer ones).

Choices:
- A bridge opts in (``lora_replicated_linears = True``); the planner then takes a linear whose weight a ``Replicated``
  mapping holds as a target of kind ``"replicated"`` (``plan._adaptable``). Other bridges' replicated tensors stay no
  target: their modules may not call the linear's ``forward`` (DeepSeek-V4's grouped ``o_a_proj`` reads its weight
  itself, and is refused by name in ``plan._REFUSED``).
- The module (``torch.nn.Linear``) is re-classed to ``LoraReplicatedLinear``, whose ``forward`` adds PEFT's
  ``scaling * B (A dropout(x))``; A and B are whole on every rank, as the base weight, and count once in the gradient
  norm (no tensor-parallel attribute). Where the bridge's module computes the whole thing on every TP rank
  (DeepSeek-V4's attention gathers the sequence under sequence parallelism), each rank's adapters take the whole
  gradient, as the weight does: no reduction over TP; dropout draws from the default generator, which megatron keeps
  in step over TP. Where it runs on each rank's own tokens under sequence parallelism (Gemma 3n's AltUp, LAuReL and
  per-layer linears, Gemma 4's per-layer ones: the weight marked ``sequence_parallel``), the factors are marked so
  too, and megatron sums their gradients over TP; dropout then draws from the model-parallel RNG tracker.
- Unload / merge / export: ``lora_merge_delta`` as megatron's LoRA linears (``export._lora_deltas``); the class is a
  direct subclass of ``torch.nn.Linear``, which ``unload`` restores.
- A linear whose weight its bridge marks ``takes_no_gradient`` (DeepSeek-V4's indexer: no gradient reaches it, in
  transformers neither) gets frozen adapters: PEFT's take no gradient there either, so never an update, and megatron's
  gradient buffers (which expect a gradient of each trainable parameter) leave them out.
- Training checkpoints: megatron's default ``sharded_state_dict`` of a plain module, each factor whole and
  replicated over TP (one writer); a run resumed from its checkpoint at TP2 + SP x EP2 and at TP1 logs the
  uninterrupted run's losses (tests/bridges/test_deepseek_v4.py).
- DoRA and PiSSA / OLoRA on these targets are refused by name (``check_replicated_options``): not compared with PEFT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_hf.lora.plan import LoraConfigError


class LoraReplicatedLinear(nn.Linear):
    """A replicated ``torch.nn.Linear`` plus one LoRA adapter (``lora``, keyed by the target's name)."""

    lora: nn.ModuleDict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.__dict__.get("lora_disabled"):  # NOTE: inside disable_adapter() (unload.py)
            return out
        for adapter in self.lora.values():
            xd = adapter.drop(x, input_is_split=adapter.A.sequence_parallel)
            out = out + F.linear(F.linear(xd, adapter.A), adapter.B) * adapter.scaling
        return out

    @torch.no_grad()
    def lora_delta_weight(self) -> torch.Tensor:
        return sum((a.B.float() @ a.A.float()) * a.scaling for a in self.lora.values())

    def lora_merge_delta(self) -> torch.Tensor:
        """What merging adds to ``weight`` (float32): ``scaling * B @ A``."""
        return self.lora_delta_weight()


def check_replicated_adaptable(module: nn.Module) -> None:
    """``TypeError`` unless ``module`` is a plain ``torch.nn.Linear`` (before anything changes)."""
    if type(module) is not nn.Linear:
        raise TypeError(f"LoRA on a replicated linear expects a plain torch.nn.Linear; got {type(module).__name__}.")


def attach_replicated(module: nn.Module, adapters: dict) -> None:
    """Turn the ``torch.nn.Linear`` ``module`` into ``LoraReplicatedLinear`` in place, with ``adapters``."""
    check_replicated_adaptable(module)
    module.__class__ = LoraReplicatedLinear
    module.lora = nn.ModuleDict(adapters)
    for p in module.lora.parameters():  # NOTE: on each rank's tokens under SP (Gemma 3n's): summed over TP as W
        p.sequence_parallel = bool(getattr(module.weight, "sequence_parallel", False))
    if getattr(module.weight, "takes_no_gradient", False):  # NOTE: DeepSeek-V4's indexer: no gradient, as in PEFT
        module.lora.requires_grad_(False)


def check_replicated_options(config, targets) -> None:
    """Refuse DoRA and PiSSA / OLoRA on replicated targets and on a bridge module's own weights (own_weights.py; pure,
    every rank alike)."""
    from loongforge_hf.lora.init import is_decomposition

    hit = sorted({t.hf_module.rsplit(".", 1)[-1] for t in targets if t.kind == "replicated" or t.own_weight})
    asked = [f"use_dora={config.use_dora}"] if config.use_dora else []
    if is_decomposition(config.init_lora_weights):
        asked.append(f"init_lora_weights={config.init_lora_weights!r}")
    if asked and hit:
        raise LoraConfigError(f"{' and '.join(asked)} is not supported on {hit} (linears of the bridge's own "
                              "modules: not compared with PEFT there); leave them out "
                              f"(exclude_modules={hit}) or use plain LoRA.")
