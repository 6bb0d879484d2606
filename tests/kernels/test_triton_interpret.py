"""The Triton kernels (RMSNorm, SwiGLU, RoPE) on CPU through Triton's interpreter, against their torch paths.

Run in a child process: ``TRITON_INTERPRET`` is read when a kernel is defined, so it must be set before the kernel
modules are imported. Skipped where triton is not installed (the kernels then never run).
"""

from ._interpret import needs_triton, run_interpreted

pytestmark = needs_triton


def test_triton_kernels_match_torch_paths_in_the_interpreter():
    checked = run_interpreted("import torch\nfrom tests.kernels._triton_checks import check_all\n"
                              "check_all('cpu', dtypes=(torch.float32, torch.bfloat16))")
    assert any(c.startswith("rms_norm(") for c in checked) and any(c.startswith("swiglu") for c in checked)
    assert any(c.startswith("clamped_swiglu") for c in checked)
    assert any(c.startswith("rms_norm_view") for c in checked) and any(c.startswith("rope") for c in checked)
    assert sum(c.startswith("linear_cross_entropy") and "_ls0.0" not in c for c in checked) == 2 * 2  # smoothed
    assert sum(c.startswith("lora_cross_entropy") for c in checked) == 2 * 2  # the LM head adapter's term


def test_router_kernel_in_the_interpreter():
    checked = run_interpreted("from tests.kernels._router_checks import check_router\ncheck_router()")
    assert len(checked) == 32


def test_grouped_fp8_layout_kernels_in_the_interpreter():
    checked = run_interpreted("from tests.kernels._fp8_grouped_checks import check_grouped_quantisation\n"
                              "check_grouped_quantisation()")
    assert checked == ["rows x", "columns x", "rows x strided", "columns x strided", "rows padded", "weight rows w",
                       "weight rows w.T", "zero_empty"]


def test_decode_attention_kernels_in_the_interpreter():
    """The split-key partial attention of a CP-sharded KV cache's decode step against the blocked torch path."""
    checked = run_interpreted("from tests.kernels._decode_attention_checks import check_decode_attention\n"
                              "check_decode_attention()")
    assert len(checked) == 10


def test_softcap_attention_kernels_in_the_interpreter():
    """The soft-capped flash-style attention (forward, dq, dk / dv) against the eager math: fp32 within 2e-5, bf16
    within its resolution."""
    checked = run_interpreted("import torch\n"
                              "from tests.kernels._softcap_attention_checks import check_softcap_attention\n"
                              "check_softcap_attention(dtypes=(torch.float32, torch.bfloat16))")
    assert len(checked) == 14
