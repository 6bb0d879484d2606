"""``kernels.specs.SwiGLUMLP`` (the dense spec's MLP) against megatron's ``MLP`` with the same weights: the output is
bit-identical, input and weight grads agree (fp32 1e-5; bf16 2e-2, our backward rounds once from fp32), our
``swiglu`` ran; a gelu config takes megatron's path. One CPU rank (megatron's linears need a TP group)."""

from loongforge_hf.parallel.spawn import run_distributed

from ._swiglu_mlp import swiglu_mlp_matches_megatron_mlp


def test_swiglu_mlp_matches_megatron_mlp():
    (result,) = run_distributed(swiglu_mlp_matches_megatron_mlp, 1, timeout=120)
    assert sorted(result) == ["torch.bfloat16", "torch.float32"]
