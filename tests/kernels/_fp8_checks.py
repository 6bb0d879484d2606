"""FP8 quantisation kernels run through Triton's interpreter (called in a child process by test_triton_interpret)."""

import torch

from loongforge_hf.kernels import fp8


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_dual() -> list[str]:
    """``_dual_kernel`` (one read, both operands) against the single-use tile / block kernels bit for bit, and its
    scales against the torch reference's. (The interpreter's rounding to e4m3 is not torch's in ~2% of values, so
    the FP8 values are compared kernel to kernel here; on a GPU test_gpu_fp8 compares them with torch's.)"""
    checked = []
    g = torch.Generator().manual_seed(0)
    for rows, cols in ((37, 256), (128, 128), (300, 384), (16, 128)):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, cols)).to(dtype)
            x[1] = 0.0
            for kind in ("tiles", "blocks"):
                row, col = fp8._dual_triton(x, kind)
                q, s = fp8._tiles_triton(fp8._pad_rows(x), cols)
                xt = fp8._pad_rows(x, fp8.GROUP).t()
                qc, sc = fp8._tiles_triton(xt, xt.shape[1]) if kind == "tiles" else fp8._blocks_triton(xt)
                ref_row = fp8.quantize_tiles(fp8._pad_rows(x), check_finite=False)  # CPU: the torch path
                ref_col = fp8.quantize(xt, kind, check_finite=False)
                assert _same_bits(row.data, q) and _same_bits(col.data, qc), (rows, cols, dtype, kind)
                assert torch.equal(row.scale, s) and torch.equal(col.scale, sc), (rows, cols, dtype, kind)
                assert torch.equal(row.scale, ref_row.scale) and torch.equal(col.scale, ref_col.scale)
                assert row.data.shape == ref_row.data.shape and col.data.shape == ref_col.data.shape
                checked.append(f"dual({rows}x{cols}, {dtype}, {kind})")
    return checked
