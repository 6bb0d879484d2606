"""test_checkpoint_bad_input.py's cases on 2 GPUs over NCCL (PP=2): a checkpoint write that fails on one rank and a
bad checkpoint given to ``resume_from_checkpoint`` raise the same ``CheckpointError`` on both ranks (the outcome is
shared with NCCL object collectives, which need each rank on its own GPU), nothing is left behind, and a clean save
afterwards works; a hang runs into the timeout."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .._device_env import pickleable_month_day_nano
from .test_checkpoint_bad_input import (RESUME_CASES, SAVE_CASES, check_bad_resume, check_clean_save,
                                        check_failed_save, save_and_resume_cases)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]


def _cases_on_gpus(folder: str, out_dir: str) -> dict:
    pickleable_month_day_nano()
    return save_and_resume_cases(folder, out_dir, {"use_cpu": False})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_bad_gpu")
    folder = make_tiny_checkpoint(tmp / "src", "llama")
    return run_distributed(_cases_on_gpus, 2, str(folder), str(tmp / "out"), timeout=500,
                           env={"LOONGFORGE_DEVICE": "cuda"})


def test_ranks_ran_on_their_own_gpus(results):
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("case", list(SAVE_CASES))
def test_failed_checkpoint_write_raises_alike_on_gpus(results, case):
    check_failed_save(results, case)


def test_clean_save_after_failures_on_gpus(results):
    check_clean_save(results)


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_bad_checkpoint_to_resume_raises_alike_on_gpus(results, case):
    check_bad_resume(results, case)
