"""LoongRewardTrainer against trl.RewardTrainer on CUDA, fp32 with TF32 off on both sides: test_reward.py's full
fine-tuning scenarios and checks (``_assert_matches``: every logged metric within 1e-4 relative or 2e-5 absolute,
num_tokens exactly, the eval metrics, the final weights) with the engine's CUDA path (Triton kernels, LoongAdamW, the
pooled score head) against TRL's own CUDA run on one GPU at TP1; on two GPUs over NCCL, the same at TP2 with sequence
parallelism."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .._device_env import pickleable_month_day_nano
from ._reward_parity import LORA, SCENARIOS, make_classifier, run_loong, run_trl, saved_tensors
from .test_reward import LAYOUTS, _assert_matches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NAMES = [name for name in SCENARIOS if name not in LORA]  # NOTE: LoRA's PEFT check feeds CPU inputs


def _cuda() -> None:
    import os

    from . import _reward_parity

    pickleable_month_day_nano()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for overrides, _ in _reward_parity.SCENARIOS.values():  # NOTE: this process's copy: TRL's accelerate on the GPU
        overrides.update(use_cpu=False)


def _one_gpu(classifier: str, out_dir: str) -> dict:
    _cuda()
    return {"trl": run_trl(classifier, out_dir + "/trl", NAMES),
            "loong": run_loong(classifier, out_dir + "/tp1", {}, NAMES)}


def _two_gpus(classifier: str, out_dir: str) -> dict:
    _cuda()
    return run_loong(classifier, out_dir + "/tp2", LAYOUTS["tp2_sp"], NAMES)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward-gpu-src")
    return make_classifier(str(make_tiny_checkpoint(root / "llama", "llama")), str(root / "llama-cls"))


@pytest.fixture(scope="module")
def one_gpu(classifier, tmp_path_factory):
    return run_distributed(_one_gpu, 1, classifier, str(tmp_path_factory.mktemp("reward-gpu")), timeout=600,
                           env={"LOONGFORGE_DEVICE": "cuda"})[0]


@pytest.mark.parametrize("name", NAMES)
def test_reward_on_cuda_matches_trl(classifier, one_gpu, name):
    _assert_matches(name, one_gpu["trl"][name], one_gpu["loong"][name], saved_tensors(classifier))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_on_two_gpus(classifier, one_gpu, tmp_path):
    runs = run_distributed(_two_gpus, 2, classifier, str(tmp_path), timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    for name in NAMES:
        _assert_matches(name, one_gpu["trl"][name], runs[0][name], saved_tensors(classifier))
        assert runs[1][name]["logs"] == runs[0][name]["logs"]
