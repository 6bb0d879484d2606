"""MLA's core attention on CUDA: our SDPA attention with a query/key head size (nope + rope dims) larger than the
value head size, as ``specs.MLACoreAttention`` runs it for DeepSeek-V2/V3, in bf16 on the GPU against fp32 on the CPU
from the same bf16 values (outputs and q/k/v gradients). SDPA must pick a backend that takes the unequal head sizes;
the CPU parity tests (``test_moe_parity.py``) cover the module wiring.

Tolerance: elementwise atol = rtol = 2e-2 (bf16's resolution with slack for sums over the keys), as
``tests/kernels/test_gpu_paths.py`` uses for the same op."""

import math

import pytest
import torch

from loongforge_hf.kernels.attention import dot_product_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ATOL, RTOL = 2e-2, 2e-2


@pytest.mark.parametrize("seq,heads,qk_dim,v_dim", [(37, 4, 192, 128), (512, 8, 192, 128), (64, 2, 96, 64)],
                         ids=["odd", "long", "small-dims"])
def test_mla_head_sizes_match_cpu(seq, heads, qk_dim, v_dim):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(seq, 2, heads, qk_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(seq, 2, heads, v_dim, generator=g).to(torch.bfloat16)
    proj = torch.randn(seq, 2, heads, v_dim, generator=g)
    scale = 1 / math.sqrt(qk_dim)

    def run(device, dtype):
        ts = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        out = dot_product_attention(*ts, causal=True, scale=scale)
        assert out.shape == (seq, 2, heads, v_dim)
        (out.float() * proj.to(device)).sum().backward()
        return [out.detach().float().cpu()] + [t.grad.float().cpu() for t in ts]

    for name, a, b in zip(("out", "dq", "dk", "dv"), run("cuda", torch.bfloat16), run("cpu", torch.float32)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
