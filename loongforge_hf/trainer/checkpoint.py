"""Resumable training checkpoints: megatron-core distributed checkpointing for weights and optimizer state.

Layout of ``checkpoint-N/`` (written under a temporary name and renamed when complete):
- the HF export of the model (what ``save_model`` writes) — usable on its own;
- ``megatron/``: model + distributed-optimizer state saved with ``megatron.core.dist_checkpointing`` in the
  ``fully_reshardable`` optimizer format, so a run can resume under another TP / PP / VPP / DP layout (with
  ``optimizer_precision="model"``: megatron's FP32Optimizer state, AdamW moments sharded like their parameters);
- ``scheduler.pt``: the LR schedulers' state; ``rng_state_{rank}.pth`` (Trainer's) and ``megatron_rng_{rank}.pt``
  (megatron's model-parallel RNG tracker); ``trainer_state.json`` (step, log history, data position).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MEGATRON_DIR = "megatron"
SCHEDULER_FILE = "scheduler.pt"
OPTIM_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state_dict(engine, *, is_loading: bool) -> dict:
    chunks = [c.module for c in engine.chunks]
    state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    state["optimizer"] = engine.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=OPTIM_FORMAT)
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_training_checkpoint(trainer, output_dir: str | os.PathLike) -> None:
    """Write megatron state, schedulers and RNG into ``output_dir`` (collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    output_dir = Path(output_dir)
    ckpt = output_dir / MEGATRON_DIR
    if _rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    _barrier()
    dist_checkpointing.save(_sharded_state_dict(trainer.engine, is_loading=False), str(ckpt))
    if _rank() == 0:
        torch.save(trainer.lr_scheduler.state_dict(), output_dir / SCHEDULER_FILE)
    torch.save(get_cuda_rng_tracker().get_states(), output_dir / f"megatron_rng_{_rank()}.pt")
    _barrier()


def load_training_checkpoint(trainer, checkpoint_dir: str | os.PathLike) -> None:
    """Restore weights, optimizer, schedulers and RNG from ``checkpoint_dir`` (collective; any layout)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    checkpoint_dir = Path(checkpoint_dir)
    ckpt = checkpoint_dir / MEGATRON_DIR
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{checkpoint_dir} has no {MEGATRON_DIR}/ folder: it was not written by "
                                "LoongTrainer, so it cannot be resumed.")
    engine = trainer.engine
    _materialize_adam_state(engine)
    template = _sharded_state_dict(engine, is_loading=True)
    loaded = dist_checkpointing.load(template, str(ckpt))
    for i, chunk in enumerate(engine.chunks):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    engine.optimizer.load_state_dict(loaded["optimizer"])
    trainer.lr_scheduler.load_state_dict(torch.load(checkpoint_dir / SCHEDULER_FILE, weights_only=True))
    rng_file = checkpoint_dir / f"megatron_rng_{_rank()}.pt"
    saved_world = len(list(checkpoint_dir.glob("megatron_rng_*.pt")))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rng_file.is_file() and saved_world == world:
        get_cuda_rng_tracker().set_states(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("Resuming under a different world size (%d -> %d): model-parallel RNG streams restart.",
                       saved_world, world)


def _materialize_adam_state(engine) -> None:
    """Give every parameter of the inner AdamW(s) the state torch creates at its first step (zeros, step 0).

    megatron's DistributedOptimizer.state_dict() reads the common ``step`` of the inner optimizer, which a fresh
    optimizer does not have yet; the loaded checkpoint then overwrites all of it.
    """
    for opt in engine.inner_optimizers():
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def publish_checkpoint(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a complete temporary checkpoint folder into place (rank 0), replacing an older one."""
    if _rank() == 0:
        if final_dir.exists():
            shutil.rmtree(final_dir)
        os.replace(tmp_dir, final_dir)
    _barrier()
