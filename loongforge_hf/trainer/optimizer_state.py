"""The state of megatron's optimizer for distributed checkpointing (``checkpoint.py``), whatever its parts hold.

megatron's ``get_megatron_optimizer`` chains one part for the dense parameters and one for the expert parameters
(the routed experts of a mixture-of-experts model, in every layout: ``engine._mark_expert_params``), and gives
every rank the parameter groups of all ranks (megatron-core 0.16.1 optimizer/__init__.py:181). A part is one of
three things on a rank:
- a stub (``engine.is_stub``): no rank trains a parameter of its kind (the dense part of LoRA on the routed experts
  alone), so megatron built no torch optimizer for it. It holds no state and is left out; the other parts keep the
  keys megatron gives a chain's parts (``chained_{i}.``, by place in the chain). megatron's own ChainedOptimizer
  sharded_state_dict / load_state_dict (optimizer.py:1184-1231) read every part's torch optimizer and raise.
- a part with empty groups on this rank: this pipeline stage trains nothing of a kind another stage trains (the
  final norm beside routed-expert adapters on every stage). megatron takes the step it writes from the torch
  optimizer's per-parameter states: DistributedOptimizer.state_dict (distrib_optimizer.py:637-643) asserts there is
  one (on this stage only, while the others enter the save's collectives: a hang), FP32Optimizer.sharded_state_dict
  (optimizer.py:1025-1034) writes none. While megatron builds the state the part borrows the step of this rank's
  other parts, under a key that is no parameter (torch's state_dict passes it through; megatron reads its step and
  keeps no per-parameter state of it). Every part steps together, and the step that counts is rank 0's
  (dist_checkpointing writes rank 0's common state, common.pt), whose stage trains something
  (``lora.model.check_stages_train``).
- a part with parameters on this rank: its state as megatron writes it.
A chain of parts of the last kind only is read and written by megatron's ChainedOptimizer itself; any other part by
part, without ChainedOptimizer's _synchronize_steps (optimizer.py:1392-1412), which aligns the step TE's FusedAdam
keeps in its parameter groups (the engine's torch AdamW keeps it per parameter).
"""

from __future__ import annotations

import contextlib

import torch

from loongforge_hf.trainer.engine import is_stub, optimizer_parts

_BORROWED = "loongforge_hf: the step of a part without parameters on this rank"


def sharded_state_dict(optimizer, model_state: dict, *, is_loading: bool, metadata: dict) -> dict:
    """megatron's ``optimizer.sharded_state_dict(model_state, is_loading=..., metadata=...)``, for the chains above."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    parts = optimizer_parts(optimizer)
    states = {}
    with _borrowed_steps(parts) as borrowing:
        if not borrowing and not any(is_stub(part) for part in parts):
            return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
        for i, part in enumerate(parts):
            if is_stub(part):
                continue
            states[i] = part.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
            if part in borrowing and isinstance(states[i].get("state"), dict):
                states[i]["state"].pop(_BORROWED, None)  # FP32Optimizer keeps the entry, with no tensor
    if len(parts) == 1:
        return states[0]
    for i, state in states.items():
        # NOTE: as ChainedOptimizer.sharded_state_dict prefixes its parts in this format (optimizer.py:1194-1212)
        add_prefix_for_sharding(state, f"chained_{i}.")
    return states


def load_state_dict(optimizer, state: dict) -> None:
    """``sharded_state_dict``'s state, as loaded by dist_checkpointing, back into ``optimizer``."""
    parts = optimizer_parts(optimizer)
    if not any(is_stub(part) for part in parts):
        optimizer.load_state_dict(state)
        return
    for i, part in enumerate(parts):
        if not is_stub(part):
            part.load_state_dict(state[i])


@contextlib.contextmanager
def _borrowed_steps(parts):
    """Each part whose torch optimizer holds no parameter on this rank holds, for the block, the step of the others
    (zero where none has one: a rank that trains nothing, whose common state is not written)."""
    real = [part for part in parts if not is_stub(part)]
    borrowing = [part for part in real if not any(group["params"] for group in part.optimizer.param_groups)]
    step = next((s["step"] for part in real for s in part.optimizer.state.values() if "step" in s),
                torch.zeros((), dtype=torch.float32))
    for part in borrowing:
        part.optimizer.state[_BORROWED] = {"step": step}
    try:
        yield borrowing
    finally:
        for part in borrowing:
            part.optimizer.state.pop(_BORROWED, None)
