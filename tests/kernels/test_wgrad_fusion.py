"""Weight-gradient accumulation into megatron's fp32 main_grad without Apex (``xpu/common.py``).

- ``TorchWgradAccumulation`` computes ``main_grad += grad_output^T @ input`` (bf16 inputs: the fp32 sum of the exact
  products, as Apex's fp32-output GEMM does; the CPU path forms it with fp32 math).
- In training (``_wgrad_fusion.py``, 2 CPU ranks, TP2 with sequence parallelism and DP2): the fused and unfused
  engines give the same main grads, step loss, grad norm and weights in fp32 within 1e-5.
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.xpu.common import TorchWgradAccumulation, wgrad_accumulation_supported

from ._wgrad_fusion import fused_wgrad_matches_unfused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wgrad_gemm_accum_fp32_adds_the_weight_grad(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 24, generator=g).to(dtype)
    dy = torch.randn(37, 40, generator=g).to(dtype)[:, ::2]          # a strided grad_output, as megatron may pass
    main_grad = torch.randn(20, 24, generator=g)
    expected = main_grad + dy.double().t() @ x.double()
    TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert main_grad.dtype == torch.float32
    # NOTE: bf16 products are exact in fp32; the only error is fp32 summation over 37 terms of size ~10.
    torch.testing.assert_close(main_grad, expected.float(), atol=1e-5, rtol=1e-5)
    assert wgrad_accumulation_supported(torch.device("cpu"))


def test_fused_wgrad_training_matches_unfused(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", tie_word_embeddings=True, tokenizer=False)
    layouts = ["tp2_sp", "dp2"]
    results = run_distributed(fused_wgrad_matches_unfused, 2, str(ckpt), str(tmp_path / "out"), layouts, timeout=400)
    assert [sorted(r) for r in results] == [sorted(layouts)] * 2
