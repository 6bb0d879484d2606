"""The grouped FP8 experts' Triton kernels (``fp8.rows_into_triton``, ``_columns_into_triton``) against the
torch steps they replace (quantise, then scatter into the padded layout), on any device.

The reference is always the torch steps on the CPU (as tests/kernels/test_gpu_fp8.py compares the dense kernels:
CUDA's torch ops round a few products differently, ~0.06% of them one e4m3 step off on an H100).
``fp8_out=False`` (the interpreter's case: its float-to-e4m3 conversion is not torch's) has the kernels write their
clamped, scaled values in fp32 and rounds those with torch: every index, scale and padding value is still compared
exactly. With ``fp8_out=True`` (a GPU) the kernels' FP8 output is compared bit for bit.
"""

import torch

from loongforge_hf.kernels import fp8_grouped as G
from loongforge_hf.kernels._triton import triton_paths
from loongforge_hf.kernels.fp8 import quantize_rows

COUNTS = [0, 1, 17, 70, 0, 16, 129]


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    t = sum(COUNTS)
    x = torch.randn(t, 200, generator=g) * torch.logspace(-3, 2, 200)
    x[1:18, :8] = 0  # all-zero columns inside a segment
    x[40, 3] = 1e6  # saturates
    w = torch.randn(len(COUNTS), 48, 80, generator=g)
    return x.bfloat16().to(device), w.bfloat16().to(device)


def _bits(q: torch.Tensor) -> torch.Tensor:
    """The e4m3 bytes of ``q`` (fp32 values a kernel would have rounded are rounded by torch first). Indexing
    happens on these: CUDA has no FP8 indexing kernels."""
    return (q if q.dtype == torch.float8_e4m3fn else q.to(torch.float8_e4m3fn)).view(torch.uint8)


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    differ = got != want
    where = differ.nonzero()[:4]
    values = [t[tuple(where.t())].view(torch.float8_e4m3fn).float().tolist() for t in (got, want)]
    assert not differ.any(), f"{what}: {int(differ.sum())} of {differ.numel()} differ, e.g. {values[0]} vs {values[1]}"


def _kernels(on: bool, fn):
    """``fn()`` with the Triton kernels switched on (CUDA, or CPU under the interpreter) or off (torch steps)."""
    with triton_paths(on):
        return fn()


def _torch_steps(fn, *tensors):
    """``fn(*tensors)`` by the torch steps on the CPU, the results back on the tensors' device."""
    out = _kernels(False, lambda: fn(*(t.cpu() for t in tensors)))
    return tuple(o.to(tensors[0].device) for o in out) if isinstance(out, tuple) else out.to(tensors[0].device)


def check_grouped_quantisation(device="cpu", *, fp8_out: bool = False) -> list:
    x, w = _inputs(device)
    lay = G.Layout(torch.tensor(COUNTS, device=device), x.shape[0])
    ref = G.Layout(torch.tensor(COUNTS), x.shape[0])
    ends = int(lay.offs[-1])
    out_dtype = torch.float8_e4m3fn if fp8_out else torch.float32
    checked = []
    for name, src in (("x", x), ("x strided", x.t().contiguous().t())):
        want_q, want_s = _torch_steps(ref.quantize_rows, src)
        q = torch.full((lay.rows, x.shape[1]), float("nan"), device=device).to(out_dtype)
        s = torch.ones(lay.rows, device=device)
        G.rows_into_triton(src[None], q, s, lay.dst)
        _same_bits(_bits(q)[lay.dst], _bits(want_q)[lay.dst], f"rows {name}")
        assert torch.equal(s, want_s), f"row scales {name}"

        want_q, want_s = _torch_steps(ref.quantize_columns, src)
        q = torch.full((x.shape[1], lay.rows), float("nan"), device=device).to(out_dtype)
        s = torch.full((lay.experts * x.shape[1],), float("nan"), device=device)
        G._columns_into_triton(src, q, s, lay)
        _same_bits(_bits(q)[:, :ends], _bits(want_q)[:, :ends], f"columns {name}")  # with the zero padding
        assert torch.equal(s, want_s), f"column scales {name}"
        checked += [f"rows {name}", f"columns {name}"]
    # the dense row-wise path's use: zero columns appended up to a multiple (pad_to)
    want = _torch_steps(lambda t: tuple(quantize_rows(t, pad_to=64, check_finite=False)[:2]), x)
    q = torch.full((x.shape[0], 256), float("nan"), device=device).to(out_dtype)
    s = torch.empty(x.shape[0], 1, device=device)
    G.rows_into_triton(x[None], q, s)
    _same_bits(_bits(q), _bits(want[0]), "rows padded")
    assert torch.equal(s, want[1]), "rows padded scales"
    checked.append("rows padded")
    for name, src in (("w", w), ("w.T", w.transpose(-2, -1))):
        want_q, want_s = _torch_steps(G._quantize_weight_rows, src)
        q = torch.empty(src.shape, device=device).to(out_dtype)
        s = torch.empty(src.shape[:2], device=device)
        G.rows_into_triton(src, q, s, None)
        _same_bits(_bits(q), _bits(want_q), f"weight rows {name}")
        assert torch.equal(s, want_s), f"weight scales {name}"
        checked.append(f"weight rows {name}")
    dw = torch.randn(lay.experts, 3, 5, device=device)
    want = _torch_steps(ref.zero_empty, dw.clone())
    assert torch.equal(_kernels(True, lambda: lay.zero_empty(dw.clone())), want)
    assert torch.equal(want[torch.tensor(COUNTS, device=device) > 0], dw[torch.tensor(COUNTS, device=device) > 0])
    assert not want[torch.tensor(COUNTS, device=device) == 0].any()
    checked.append("zero_empty")
    if fp8_out:  # the Layout methods themselves pick the kernels here
        for name in ("quantize_rows", "quantize_columns"):
            (q, s), (want_q, want_s) = getattr(lay, name)(x), _torch_steps(getattr(ref, name), x)
            keep = lay.dst if name == "quantize_rows" else slice(None)
            part = (lambda t: t[keep]) if name == "quantize_rows" else (lambda t: t[:, :ends])
            _same_bits(part(_bits(q)), part(_bits(want_q)), name)
            assert torch.equal(s, want_s), name
            checked.append(name)
    return checked
