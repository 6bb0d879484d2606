"""The FP8 quantisation kernels (``kernels/_fp8_triton.py``) against the torch reference in ``kernels/fp8.py``, bit
for bit (fp8 bytes and fp32 scales), on one device: CUDA in the ``gpu`` tests, the CPU under ``TRITON_INTERPRET=1``
in test_triton_interpret.py. ``LOONGFORGE_TRITON`` switches between the two paths.

Triton's interpreter casts fp32 to e4m3 by cutting the mantissa (a round-up that carries into the exponent is lost:
0.484 becomes 0.25), which no GPU does; ``use_torch_fp8_cast_in_interpreter`` makes it cast as torch does (round to
nearest even), so the interpreter checks the kernels' indexing, masks, scales and layouts, and the GPU tests check the
hardware cast as well. The single-layout row kernel loops over a runtime column count, which Triton 3.6's
interpreter cannot run (``range`` over a kernel argument fails there), so the interpreter skips it (``skip``).
"""

import os

import torch

# (rows, cols): rows not a multiple of 16 or 128, a single row, a partial last 128-block, a K that is no multiple of 16
SHAPES = [(1, 128), (17, 200), (130, 256), (256, 136)]


def use_torch_fp8_cast_in_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def cast(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = cast


def _both(fn, x):
    out = []
    for flag in ("1", "0"):
        os.environ["LOONGFORGE_TRITON"] = flag
        try:
            out.append(fn(x))
        finally:
            os.environ.pop("LOONGFORGE_TRITON", None)
    return out


def _same(name, got, ref):
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.kind == b.kind, (name, i, a.kind, b.kind)
        assert a.data.shape == b.data.shape and a.scale.shape == b.scale.shape, \
            (name, i, a.data.shape, b.data.shape, a.scale.shape, b.scale.shape)
        assert a.data.dtype == b.data.dtype == torch.float8_e4m3fn, (name, i, a.data.dtype)
        if a.kind == "tiles":
            assert a.scale.stride(0) == 1, (name, i, a.scale.stride())  # K-tile-major, as scaled_mm reads them
        if a.kind in ("blocks", "rows"):
            assert a.data.is_contiguous(), (name, i)
        assert torch.equal(a.scale.cpu(), b.scale.cpu()), (name, i, "scales differ")
        bad = (a.data.view(torch.uint8) != b.data.view(torch.uint8)).sum().item()
        assert bad == 0, (name, i, f"{bad} fp8 bytes differ")


def make_input(rows: int, cols: int, device: str) -> torch.Tensor:
    """bf16 values over five decades (across columns), one all-zero tile and one all-zero column, a large outlier."""
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, cols)
    x[0, :min(128, cols)] = 0
    x[:, -1] = 0
    x[rows // 2, cols // 3] = 3e4
    return x.to(torch.bfloat16).to(device)


def check_fp8_kernels(device: str, shapes=SHAPES, skip=()) -> list[str]:
    from loongforge_hf.kernels import fp8

    checked = []
    for rows, cols in shapes:
        x = make_input(rows, cols, device)
        for view, what in ((x, "x"), (x.t(), "x.T")):
            cases = {
                "tiles": lambda v: [fp8.quantize_tiles(v, pad_to=128)],
                "blocks": lambda v: [fp8.quantize_blocks(v)],
                "rows": lambda v: [fp8.quantize_rows(v, pad_to=16)],
                "tiles_dual": fp8.quantize_tiles_dual,
                "blocks_dual": fp8.quantize_blocks_dual,
                "rows_dual": fp8.quantize_rows_dual,
            }
            for name, fn in cases.items():
                if name in skip:
                    continue
                got, ref = _both(fn, view)
                assert got[0].data.device.type == torch.device(device).type
                _same(f"{name}({what} {tuple(view.shape)})", got, ref)
                checked.append(f"{name}({what} {tuple(view.shape)})")
    return checked
