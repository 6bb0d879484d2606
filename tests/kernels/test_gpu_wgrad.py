"""The CUDA path of ``xpu.common.TorchWgradAccumulation`` (torch's fp32-output ``addmm`` on bf16 inputs)."""

import pytest
import torch

from loongforge_hf.xpu.common import TorchWgradAccumulation, wgrad_accumulation_supported

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("tokens,out,inp", [(4096, 1024, 3072), (1000, 384, 200)])
def test_cuda_wgrad_accumulates_in_fp32(tokens, out, inp):
    device = torch.device("cuda")
    assert wgrad_accumulation_supported(device), "torch lacks addmm(out_dtype=float32) for bf16 on this GPU"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, inp, device=device, generator=g).bfloat16()
    dy = torch.randn(tokens, out, device=device, generator=g).bfloat16()
    main_grad = torch.randn(out, inp, device=device, generator=g)
    expected = main_grad.double() + dy.double().t() @ x.double()
    before = main_grad.data_ptr()
    TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy, main_grad)
    TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy.t().contiguous().t(), main_grad)  # a column-major grad
    expected = expected + dy.double().t() @ x.double()
    assert main_grad.data_ptr() == before and main_grad.dtype == torch.float32
    # NOTE: fp32 accumulation over `tokens` products of size ~1 (random walk ~ sqrt(tokens)): a few fp32 ulps of
    # sqrt(tokens) * 2 per GEMM; the bf16 rounding of a separate weight grad (what the fusion removes) would be ~1e-2.
    torch.testing.assert_close(main_grad.double(), expected, atol=2e-3, rtol=1e-4)
