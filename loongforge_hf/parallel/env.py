"""What the launcher told this process: torchrun / accelerate / Slurm-through-torchrun environments.

With no launcher a one-process world on 127.0.0.1 is assumed. accelerate's ``megatron_lm`` plugin keys
(``ACCELERATE_USE_MEGATRON_LM``, ``MEGATRON_LM_TP_DEGREE``, ``MEGATRON_LM_PP_DEGREE``,
``MEGATRON_LM_SEQUENCE_PARALLELISM``) give layout defaults; sizes passed to ``from_pretrained`` win over them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "none" | "torchrun" | "accelerate"


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "accelerate" if "ACCELERATE_MIXED_PRECISION" in env or "ACCELERATE_USE_MEGATRON_LM" in env \
            or "ACCELERATE_DYNAMO_BACKEND" in env else "torchrun"
        world = int(env["WORLD_SIZE"])
        return LaunchEnv(rank=int(env["RANK"]), world_size=world, local_rank=int(env.get("LOCAL_RANK", 0)),
                         local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
                         master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                         master_port=int(env.get("MASTER_PORT", 29500)), launcher=launcher)
    return LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                     master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 0)),
                     launcher="none")


def accelerate_megatron_layout(environ: Mapping[str, str] | None = None) -> dict:
    """Layout sizes from accelerate's megatron_lm plugin environment (empty when not used)."""
    env = os.environ if environ is None else environ
    if not _truthy(env.get("ACCELERATE_USE_MEGATRON_LM")):
        return {}
    out: dict = {}
    if env.get("MEGATRON_LM_TP_DEGREE"):
        out["tensor_parallel_size"] = int(env["MEGATRON_LM_TP_DEGREE"])
    if env.get("MEGATRON_LM_PP_DEGREE"):
        out["pipeline_parallel_size"] = int(env["MEGATRON_LM_PP_DEGREE"])
    if env.get("MEGATRON_LM_SEQUENCE_PARALLELISM") is not None:
        out["sequence_parallel"] = _truthy(env["MEGATRON_LM_SEQUENCE_PARALLELISM"])
    return out
