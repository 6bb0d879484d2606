"""LoongDPOTrainer against trl.DPOTrainer on CUDA, fp32 with TF32 off on both sides: test_dpo.py's scenarios and
checks (``_assert_matches``: every logged metric within 1e-4 relative or 2e-5 absolute, accuracies and token counts
exactly -- the first step's too: the reference forwards run the training kernels, ``kernels._saved.training_numerics``,
so its rewards are exactly 0 as TRL's -- final weights) with the engine's
CUDA path (Triton kernels, LoongAdamW, the fused vocab-parallel head's per-row log-probs) against TRL's own CUDA run on
one GPU: the three scenarios and the padding-free one (packed rows, ``_dpo_parity.PACKED_SCENARIOS``) at TP1, the
Qwen3-MoE one with TRL's router balancing loss at TP1, vision DPO (``_dpo_vision``: the tiny Qwen2-VL, TRL's image
dataset and vision collator; full fine-tuning and LoRA on the language model's and the tower's attention) at TP1; on
two GPUs over NCCL, full fine-tuning, LoRA and the
padding-free one at TP2 with sequence parallelism and the MoE one at TP2 + SP x EP2."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .._device_env import pickleable_month_day_nano
from ._dpo_parity import MOE_SCENARIOS, PACKED_SCENARIOS, SCENARIOS, run_loong, run_trl
from ._dpo_vision import VISION_SCENARIOS, run_loong_vision, run_trl_vision
from .test_dpo import MOE_NAMES, MOE_TWO_RANKS, NAMES, TWO_RANK_NAMES, VISION_NAMES, _assert_matches, _initial_weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# NOTE: the scenarios with the config's use_cpu=True turned off: TRL's accelerate runs on the rank's GPU
GPU = {name: ({**overrides, "use_cpu": False}, lora, ref)
       for name, (overrides, lora, ref) in {**SCENARIOS, **MOE_SCENARIOS, **PACKED_SCENARIOS}.items()}
VISION_GPU = {name: ({**overrides, "use_cpu": False}, lora, ref)
              for name, (overrides, lora, ref) in VISION_SCENARIOS.items()}
ONE_GPU_NAMES = [*NAMES, "padding_free"]
TWO_GPU_NAMES = [*TWO_RANK_NAMES, "padding_free"]


def _cuda() -> None:
    import os

    pickleable_month_day_nano()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _one_gpu(folder: str, moe_folder: str, vl_folder: str, out_dir: str) -> dict:
    _cuda()
    return {"trl": run_trl(folder, out_dir + "/trl", ONE_GPU_NAMES, GPU),
            "loong": run_loong(folder, out_dir + "/tp1", {}, ONE_GPU_NAMES, GPU),
            "moe_trl": run_trl(moe_folder, out_dir + "/moe-trl", MOE_NAMES, GPU),
            "moe_tp1": run_loong(moe_folder, out_dir + "/moe-tp1", {}, MOE_NAMES, GPU),
            "vision_trl": run_trl_vision(vl_folder, out_dir + "/vision-trl", VISION_NAMES, VISION_GPU),
            "vision_tp1": run_loong_vision(vl_folder, out_dir + "/vision-tp1", {}, VISION_NAMES, VISION_GPU)}


def _two_gpus(folder: str, moe_folder: str, vl_folder: str, out_dir: str) -> dict:
    _cuda()
    return {"tp2_sp": run_loong(folder, out_dir + "/tp2", {"tensor_parallel_size": 2, "sequence_parallel": True},
                                TWO_GPU_NAMES, GPU),
            "moe": run_loong(moe_folder, out_dir + "/moe", MOE_TWO_RANKS["moe_tp2_sp_ep2"], MOE_NAMES, GPU)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_vl

    root = tmp_path_factory.mktemp("dpo-gpu-src")
    return (str(make_tiny_checkpoint(root / "llama", "llama")), str(make_tiny_checkpoint(root / "moe", "qwen3_moe")),
            str(make_tiny_qwen2_vl(root / "qwen2_vl")))


@pytest.fixture(scope="module")
def one_gpu(checkpoints, tmp_path_factory):
    return run_distributed(_one_gpu, 1, *checkpoints, str(tmp_path_factory.mktemp("dpo-gpu")), timeout=600,
                           env={"LOONGFORGE_DEVICE": "cuda"})[0]


@pytest.mark.parametrize("name", ONE_GPU_NAMES)
def test_dpo_on_cuda_matches_trl(checkpoints, one_gpu, name):
    _assert_matches(name, one_gpu["trl"][name], one_gpu["loong"][name], _initial_weights(checkpoints[0]))


@pytest.mark.parametrize("name", VISION_NAMES)
def test_vision_dpo_on_cuda_matches_trl(checkpoints, one_gpu, name):
    _assert_matches(name, one_gpu["vision_trl"][name], one_gpu["vision_tp1"][name], _initial_weights(checkpoints[2]))


def test_moe_router_aux_loss_on_cuda(checkpoints, one_gpu):
    for name in MOE_NAMES:
        _assert_matches(name, one_gpu["moe_trl"][name], one_gpu["moe_tp1"][name], _initial_weights(checkpoints[1]))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_and_expert_parallel_on_two_gpus(checkpoints, one_gpu, tmp_path):
    runs = run_distributed(_two_gpus, 2, *checkpoints, str(tmp_path), timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    for name in TWO_GPU_NAMES:
        _assert_matches(name, one_gpu["trl"][name], runs[0]["tp2_sp"][name], _initial_weights(checkpoints[0]))
        assert runs[1]["tp2_sp"][name]["logs"] == runs[0]["tp2_sp"][name]["logs"]
    for name in MOE_NAMES:
        _assert_matches(name, one_gpu["moe_trl"][name], runs[0]["moe"][name], _initial_weights(checkpoints[1]))
