"""LoongSFTTrainer against trl.SFTTrainer on one CUDA GPU, fp32 with TF32 off on both sides: the engine's CUDA path
(Triton cross-entropy kernel with its token stats, Triton RMSNorm / SwiGLU / RoPE, LoongAdamW) against TRL's own
CUDA path (its chunked LM head). Same scenarios, tolerances and checks as test_sft.py (``assert_matches``): every
logged loss and eval loss within 1e-4, entropy 1e-4, mean_token_accuracy 1e-6, num_tokens exactly."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .._device_env import pickleable_month_day_nano
from ._sft_parity import assert_matches, run_loong, run_trl

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NAMES = ["lora_text", "full_packing"]


def _world(folder: str, out_dir: str) -> dict:
    pickleable_month_day_nano()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {"trl": run_trl(folder, out_dir + "/trl", NAMES, use_cpu=False),
            "loong": run_loong(folder, out_dir + "/loong", {}, NAMES, use_cpu=False)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    src = make_tiny_checkpoint(tmp_path_factory.mktemp("sft-gpu-src") / "llama", "llama")
    return run_distributed(_world, 1, str(src), str(tmp_path_factory.mktemp("sft-gpu")), timeout=600,
                           env={"LOONGFORGE_DEVICE": "cuda"})[0]


@pytest.mark.parametrize("name", NAMES)
def test_sft_on_cuda_matches_trl(runs, name):
    assert_matches(name, runs["trl"][name], runs["loong"][name])
