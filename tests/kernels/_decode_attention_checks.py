"""The Triton split-key partial attention (``_decode_attention_triton``) against the blocked torch path of
``attention.partial_attention``, run on CPU under ``TRITON_INTERPRET=1`` by test_triton_interpret.py (and on a GPU by
test_gpu_paths.py)."""

import torch

from loongforge_hf.kernels import _decode_attention_triton
from loongforge_hf.kernels._triton import triton_paths
from loongforge_hf.kernels.attention import _blocked_partial_attention, partial_attention

# (batch, heads, key heads, query rows, keys, head dim, value head dim, allowed over the batch, key buffer):
# several splits (one batch and key head: four programs on the interpreter), grouped-query heads, head sizes that are
# not powers of two (MLA's wider keys), a key buffer longer than the keys (a cache's slice) or every other slot of
# one, an empty share.
CASES = [
    (1, 4, 1, 1, 200, 64, 64, False, "whole"),
    (1, 4, 2, 3, 130, 80, 80, True, "longer"),
    (2, 2, 2, 2, 77, 96, 64, True, "every other"),
    (2, 8, 2, 1, 64, 32, 32, False, "whole"),
    (1, 2, 1, 1, 0, 64, 64, True, "whole"),
]


def _keys(t: torch.Tensor, layout: str) -> torch.Tensor:
    n = t.shape[2]
    if layout == "longer":
        buffer = torch.zeros(*t.shape[:2], n + 37, t.shape[-1], dtype=t.dtype)
        buffer[:, :, :n] = t
        return buffer[:, :, :n]
    if layout == "every other":
        buffer = torch.zeros(*t.shape[:2], 2 * n, t.shape[-1], dtype=t.dtype)
        buffer[:, :, 1::2] = t
        return buffer[:, :, 1::2]
    return t


def check_decode_attention(device: str = "cpu", dtypes=(torch.float32, torch.bfloat16)) -> list:
    """Outputs within 1e-5 (fp32) / bf16's resolution (2e-2) of the fp32 blocked path from the same values;
    log-sum-exps within 1e-5 / 1e-2; rows with no allowed key zeros and -inf alike. Returns what it checked."""
    checked = []
    g = torch.Generator().manual_seed(11)
    for b, h, h_kv, sq, n, d, d_v, per_sample, layout in CASES:
        q = torch.randn(b, h, sq, d, generator=g)
        k, v = torch.randn(b, h_kv, n, d, generator=g), torch.randn(b, h_kv, n, d_v, generator=g)
        allowed = torch.rand(b if per_sample else 1, 1, sq, n, generator=g) > 0.25
        if n:
            allowed[-1, 0, 0] = False  # NOTE: a row with no allowed key
        for dtype in dtypes:
            qd, kd, vd = (t.to(dtype) for t in (q, k, v))
            ref_out, ref_lse = _blocked_partial_attention(qd.float(), kd.float(), vd.float(), allowed=allowed,
                                                          scale=0.3)
            args = (qd.to(device), _keys(kd, layout).to(device), _keys(vd, layout).to(device))
            assert _decode_attention_triton.usable(*args)
            with triton_paths(True):
                out, lse = partial_attention(*args, allowed=allowed.to(device), scale=0.3)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.cpu(), ref_out, atol=tol, rtol=tol)
            finite = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse.cpu()), finite)
            torch.testing.assert_close(lse.cpu()[finite], ref_lse[finite], atol=tol / 2, rtol=0)
            assert torch.equal(out.cpu()[~finite], torch.zeros_like(out.cpu()[~finite]))
            checked.append(f"{b}x{h}/{h_kv}x{sq}x{n} d{d}/{d_v} {layout} {dtype}")
            # NOTE: a CP-sharded cache's merge: the splits of 3 round-robin shares (the third empty for n < 3)
            # stacked, combined in one pass into the query's dtype
            parts = [_decode_attention_triton.split_partials(
                args[0], args[1][:, :, r::3], args[2][:, :, r::3], allowed=allowed[..., r::3].to(device), scale=0.3)
                for r in range(3)]
            merged = _decode_attention_triton.combine(torch.cat(parts), (b, h, sq, d_v), dtype=dtype, with_lse=False)
            assert merged.dtype == dtype
            torch.testing.assert_close(merged.float().cpu(), ref_out, atol=tol, rtol=tol)
    return checked
