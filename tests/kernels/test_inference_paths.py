"""Inference calls of the RMSNorm, SwiGLU and rope kernels and of a MoE layer's router, permute and grouped experts
(no grad needed: generate's decode steps, evaluation) skip their autograd Function and give the same output as the
training path; a call that needs grad still records it.
The rope kernel's Function exists on the Triton path only (a GPU): here its output is compared; its inference path ran
on the GPU in tests/test_generation_gpu.py."""

import pytest
import torch

from loongforge_hf.kernels import rmsnorm, rope, swiglu


def _refusing(monkeypatch, function_class) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"{function_class.__name__}.apply ran for a call that needs no grad")

    monkeypatch.setattr(function_class, "apply", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_without_grad_skips_the_function(monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 2, 3 * 32, generator=g).to(dtype)
    x = qkv[..., 32:64]  # NOTE: a view into a larger buffer, as megatron's k is
    weight = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype).requires_grad_()
    expected = rmsnorm.rms_norm(x, weight, 1e-6)
    assert expected.grad_fn is not None
    _refusing(monkeypatch, rmsnorm._RMSNormFunction)
    with torch.no_grad():
        got = rmsnorm.rms_norm(x, weight, 1e-6)
    assert torch.equal(got, expected.detach())
    got = rmsnorm.rms_norm(x, weight.detach(), 1e-6)  # grad mode on, nothing requires grad
    assert torch.equal(got, expected.detach())
    with pytest.raises(AssertionError, match="needs no grad"):
        rmsnorm.rms_norm(x, weight, 1e-6)  # needs grad: the Function runs


def test_swiglu_without_grad_skips_the_function(monkeypatch):
    x = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    expected = swiglu.swiglu(x)
    _refusing(monkeypatch, swiglu._SwiGLUFunction)
    with torch.no_grad():
        assert torch.equal(swiglu.swiglu(x), expected.detach())


def test_rotary_without_grad_gives_the_same_rotation():
    g = torch.Generator().manual_seed(2)
    t = torch.randn(6, 2, 4, 16, generator=g, requires_grad=True)
    freqs = torch.randn(6, 1, 1, 16, generator=g)
    expected = rope.rotary_sbhd(t, freqs)
    with torch.no_grad():
        assert torch.equal(rope.rotary_sbhd(t, freqs), expected.detach())


def test_one_query_causal_attention_sees_every_key():
    """A one-token decode step: the query is the last position, so causal attention is over every key (no mask
    object is built for it)."""
    from loongforge_hf.kernels.attention import sdpa

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g) for n in (1, 9, 9))
    got = sdpa(q, k, v, causal=True, scale=0.3)
    explicit = sdpa(q, k, v, causal=True, scale=0.3, mask=torch.zeros(1, 1, 1, 9, dtype=torch.bool))  # masked path
    reference = torch.softmax(q @ k.transpose(-1, -2) * 0.3, dim=-1) @ v
    torch.testing.assert_close(got, reference, atol=1e-6, rtol=0)
    torch.testing.assert_close(explicit, reference, atol=1e-6, rtol=0)


def test_cpu_tensors_are_never_launch_bound():
    """``_triton.launch_bound`` (small CUDA inputs outside a graph capture take aten ops instead of Triton
    launches) never holds for CPU tensors: they keep their torch paths. Its CUDA side is
    ``tests/kernels/test_gpu_paths.py::test_small_inference_inputs_take_the_aten_paths``."""
    from loongforge_hf.kernels._triton import launch_bound

    assert launch_bound(torch.zeros(8, 1, 1024)) is False


def check_moe_kernels_without_grad(monkeypatch, device: str = "cpu") -> None:
    """A MoE layer's kernels in inference (generate's decode steps): the router's top-k softmax, the token permute
    and un-permute and the grouped experts' dense-gradient identity run without their autograd Functions and give
    what the training path gives (equal; on CUDA, where the experts' small SwiGLU takes aten ops without grad and
    the Triton kernel with it, the experts' outputs within fp32 rounding); a call that needs grad still records
    them. (On CUDA: ``tests/kernels/test_gpu_paths.py``.)"""
    from loongforge_hf.kernels import grouped_mlp, moe_permute, router

    g = torch.Generator().manual_seed(4)
    tokens, experts, hidden, ffn, topk = 6, 4, 16, 8, 2

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device).requires_grad_()

    logits, x = leaf(tokens, experts), leaf(tokens, hidden)
    fc1, fc2 = leaf(experts, 2 * ffn, hidden), leaf(experts, hidden, ffn)

    def layer():
        probs, routing = router.topk_softmax(logits, topk)
        permuted, permuted_probs, row_map = moe_permute.permute(x, routing, probs)
        counts = routing.sum(0)
        out = grouped_mlp.grouped_gated_mlp(permuted, fc1, fc2, counts, permuted_probs,
                                            use_grouped_mm=None if device == "cuda" else hasattr(torch, "_grouped_mm"))
        return probs, routing, permuted, out, moe_permute.unpermute(out, row_map, x.shape)

    expected = layer()
    assert expected[-1].grad_fn is not None
    for function in (router._TopKSoftmax, moe_permute._Permute, moe_permute._Unpermute, grouped_mlp.DenseGrad):
        _refusing(monkeypatch, function)
    with torch.no_grad():
        got = layer()
    for name, a, b in zip(("probs", "routing", "permuted", "experts", "unpermuted"), got, expected):
        if device == "cpu" or name in ("probs", "routing", "permuted"):
            assert torch.equal(a, b.detach()), name
        else:
            # NOTE: on CUDA the experts' SwiGLU of a small input without grad is aten's silu(gate) * up, with grad
            # the Triton kernel (``_triton.launch_bound``): fp32 results one rounding apart
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    with pytest.raises(AssertionError, match="needs no grad"):
        layer()


def test_moe_kernels_without_grad_skip_their_functions(monkeypatch):
    check_moe_kernels_without_grad(monkeypatch)


def test_launch_bound_size_from_the_environment(monkeypatch):
    """``LOONGFORGE_LAUNCH_BOUND_NUMEL`` (read at import): unset or empty the default 2^18 elements, an integer as
    given, anything else a ValueError naming the variable."""
    from loongforge_hf.kernels import _triton

    monkeypatch.delenv("LOONGFORGE_LAUNCH_BOUND_NUMEL", raising=False)
    assert _triton._launch_bound_numel() == 1 << 18
    monkeypatch.setenv("LOONGFORGE_LAUNCH_BOUND_NUMEL", "0")
    assert _triton._launch_bound_numel() == 0
    monkeypatch.setenv("LOONGFORGE_LAUNCH_BOUND_NUMEL", "lots")
    with pytest.raises(ValueError, match="LOONGFORGE_LAUNCH_BOUND_NUMEL='lots'"):
        _triton._launch_bound_numel()
