"""Resume an expert-parallel MoE run from its distributed checkpoint: the grouped expert MLP's stacked weights and
their optimizer state are saved with an expert axis, so steps 4-6 after resuming from step 3 repeat the original run's
losses. One 2-rank world runs both trainings in turn (EP2, Qwen3-MoE).

NOTE: resuming an EP2 checkpoint without expert parallelism fails in the trainer's checkpoint (megatron splits the
optimizer into dense and expert parts, ``chained_0`` / ``chained_1``, only under expert parallelism), so it is not
tested here."""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._train_parity import train_loong_resumable


def _train_then_resume(folder: str, root: str) -> dict:
    full = dict(train_loong_resumable(folder, f"{root}/full", {"expert_parallel_size": 2}))
    ckpt = f"{root}/full/checkpoint-3"
    resumed = dict(train_loong_resumable(folder, f"{root}/ep2", {"expert_parallel_size": 2}, resume=ckpt))
    return {"full": full, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_resume")
    src = make_tiny_checkpoint(tmp / "src", "qwen3_moe")
    return run_distributed(_train_then_resume, 2, str(src), str(tmp / "run"), timeout=400)[0]


def test_ep2_moe_resume_continues_the_same_losses(runs):
    full, resumed = runs["full"], runs["resumed"]
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert {4, 5, 6} <= set(resumed)
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), (step, resumed[step], full[step])
