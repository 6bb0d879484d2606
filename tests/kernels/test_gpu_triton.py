"""The Triton kernels on the GPU against their torch paths on the same GPU (``_triton_checks.py``: RMSNorm incl. a
strided q/k-norm view, SwiGLU, RoPE, the linear cross-entropy chunk kernel; odd and training-sized shapes; fp32, bf16
and fp16 with the tolerances stated there), and the fused linear cross-entropy against cross-entropy on fp32
materialised logits (bf16 2e-2, fp32 1e-4: TF32 may be on for fp32 matmuls)."""

import pytest
import torch

from ._triton_checks import check_all

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_triton_kernels_match_torch_paths_on_cuda():
    import loongforge_hf.kernels._triton as switch

    assert switch.use_triton(torch.empty(1, device="cuda")), "triton is not importable on this GPU machine"
    checked = check_all("cuda", big=True)
    assert len(checked) == 3 * (5 * 3 + 4 + 3 + 3)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_linear_cross_entropy_matches_materialised_logits_on_cuda(dtype, tol):
    from loongforge_hf.kernels.cross_entropy import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    n, h, v, v_real = 1000, 256, 5120, 5003
    hidden = torch.randn(n, h, generator=g).to(dtype).cuda()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(dtype).cuda()
    labels = torch.randint(0, v_real, (n,), generator=g).cuda()
    labels[::7] = -100
    a, b = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(a, b, labels, vocab_size=v_real)
    loss.backward()
    a2, b2 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    ref = torch.nn.functional.cross_entropy((a2 @ b2.t())[:, :v_real], labels, ignore_index=-100, reduction="sum")
    ref.backward()
    torch.testing.assert_close(loss.float(), ref, atol=tol * n, rtol=tol)
    torch.testing.assert_close(a.grad.float(), a2.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(b.grad.float(), b2.grad, atol=tol, rtol=tol)
