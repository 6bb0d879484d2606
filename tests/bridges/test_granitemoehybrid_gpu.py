"""Granite 4.0 H's two-rank checks on two GPUs of one host over NCCL, against transformers on the same GPU (fp32, TF32
off on both sides, 1e-4 as on CPU): the hub's one group (``mamba_n_groups=1``, B / C replicated on both TP ranks) at
TP2 with sequence parallelism -- logits, loss, balancing loss, cached greedy and beam search over a left-padded batch
(the Mamba2 conv / SSM states in our cache on the GPU), every parameter's gradient exported through the bridge --
and at EP2; the two-group model under CP2 (test_qwen3_5's checks: packed documents and left padding across scan
chunks, logits, loss, every gradient, an uncached generate, the refused cached one). test_granitemoehybrid.py's
helpers, run here on CUDA tensors."""

import os

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from .test_granitemoehybrid import TOL, _cached_generate, _check_cached_generate, _check_padded, _gradients, _padded

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _cuda_world(folders: dict) -> dict:
    import transformers

    import loongforge_hf as lf

    from .test_qwen3_5 import _cp2_checks

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = transformers.AutoModelForCausalLM.from_pretrained(folders["g1"], dtype=torch.float32).cuda().eval()
    ours = lf.AutoModelForCausalLM.from_pretrained(folders["g1"], dtype=torch.float32, tensor_parallel_size=2,
                                                   sequence_parallel=True)
    out = {"tp2": _padded(ours, ref), "generate": _cached_generate(ours, ref),
           "grads": _gradients(ours, ref, folders["g1"], "gpu-tp2")}
    del ours
    ours = lf.AutoModelForCausalLM.from_pretrained(folders["g1"], dtype=torch.float32, expert_parallel_size=2)
    out["ep2"] = _padded(ours, ref)
    del ours, ref
    ref = transformers.AutoModelForCausalLM.from_pretrained(folders["moe"], dtype=torch.float32).cuda().eval()
    out["cp2"] = _cp2_checks(folders["moe"], ref)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("granitemoehybrid-gpu")
    folders = {"moe": str(make_tiny_checkpoint(root / "moe", "granitemoehybrid")),
               "g1": str(make_tiny_checkpoint(root / "g1", "granitemoehybrid", mamba_n_groups=1))}
    return run_distributed(_cuda_world, 2, folders, timeout=500, env={"LOONGFORGE_DEVICE": "cuda"})


def test_one_group_tp2_and_ep2(world):
    for res in world:
        _check_padded(res["tp2"])
        _check_padded(res["ep2"])
        _check_cached_generate(res["generate"], lengths=[10, 2, 2], channels=64 + 2 * 8, heads=4)
    worst = max(world[0]["grads"].items(), key=lambda kv: kv[1])
    assert any(".mamba.in_proj" in n for n in world[0]["grads"]) and worst[1] < TOL, worst


def test_context_parallel(world):
    for rank, res in enumerate(world):
        cp = res["cp2"]
        assert cp["logits"] < TOL and cp["loss"] < TOL, (rank, cp)
        same, scores = cp["generate"]
        assert same and scores < TOL, (rank, cp["generate"])
        assert "use_cache=False" in cp["cached_refusal"], (rank, cp["cached_refusal"])
    worst = max(world[0]["cp2"]["grads"].items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, worst
