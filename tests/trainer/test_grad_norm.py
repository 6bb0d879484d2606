"""The gradient norm megatron computes for clipping, without TE / Apex: ``xpu.common.foreach_l2_norm`` stands in for
megatron's per-tensor fallback (which synchronises the host once per parameter) and gives the same norm."""

import torch

from loongforge_hf.xpu.common import apply_without_te_fixes, foreach_l2_norm


def test_foreach_norm_equals_megatrons_fallback_and_is_installed():
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_applier, local_multi_tensor_l2_norm

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, generator=g), torch.randn(5, 7, generator=g) * 1e3,
               torch.randn(300, generator=g).to(torch.bfloat16), torch.zeros(4)]
    flag = torch.zeros(1, dtype=torch.int)
    got, _ = foreach_l2_norm(2048, flag, [tensors], False)
    want = torch.sqrt(sum((t.double() ** 2).sum() for t in tensors))
    assert got.shape == (1,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want.reshape(1), rtol=1e-6, atol=0)
    # megatron's fallback (it allocates on "cuda": only comparable where that exists)
    if torch.cuda.is_available():
        ref, _ = local_multi_tensor_l2_norm(2048, flag, [[t.cuda() for t in tensors]], False)
        torch.testing.assert_close(got, ref.cpu(), rtol=1e-3, atol=0)
    empty, _ = foreach_l2_norm(2048, flag, [[]], False)
    assert empty.tolist() == [0.0]
    apply_without_te_fixes()
    if clip_grads.multi_tensor_applier is local_multi_tensor_applier:  # megatron found neither TE nor Apex
        assert clip_grads.l2_norm_impl is foreach_l2_norm
