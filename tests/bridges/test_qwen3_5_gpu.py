"""Qwen3.5's context parallelism on two GPUs of one host over NCCL (``parallel/delta_rule_cp.py``: the Gated
DeltaNets' conv halo and state passing through NCCL all-gathers, the CUDA kernels of the delta rule): the CP2 checks
of test_qwen3_5.py (a row packing four documents across the chunks and a left-padded row; logits, loss and every
parameter's gradient, an uncached greedy generate, the refused cached one) against transformers on the same GPU,
fp32 with TF32 off on both sides, within 1e-4 as on CPU."""

import os

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .._device_env import pickleable_month_day_nano
from .test_qwen3_5 import TOL, _cp2_checks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _cuda_cp_world(folder: str) -> dict:
    import transformers

    pickleable_month_day_nano()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    return _cp2_checks(folder, ref)


def test_context_parallel_on_two_gpus(tmp_path):
    folder = str(make_tiny_checkpoint(tmp_path / "qwen3_5", "qwen3_5"))
    results = run_distributed(_cuda_cp_world, 2, folder, timeout=400, env={"LOONGFORGE_DEVICE": "cuda"})
    for rank, cp in enumerate(results):
        assert cp["logits"] < TOL and cp["loss"] < TOL, (rank, cp)
        same, scores = cp["generate"]
        assert same and scores < TOL, (rank, cp["generate"])
        assert "use_cache=False" in cp["cached_refusal"], (rank, cp["cached_refusal"])
    grads = results[0]["grads"]
    assert any(".linear_attn." in n for n in grads) and len(grads) == 56, sorted(grads)
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(grads.items(), key=lambda kv: -kv[1])[:5])
