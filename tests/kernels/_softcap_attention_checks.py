"""The soft-capped flash-style attention (``softcap_attention``) against transformers' eager math
(``attention._materialised``): outputs and q / k / v gradients, run on CPU under ``TRITON_INTERPRET=1`` by
test_triton_interpret.py and on a GPU by test_gpu_paths.py."""

import torch

from loongforge_hf.kernels.attention import _materialised, _ScoreRule
from loongforge_hf.kernels.softcap_attention import softcap_attention

# (batch, heads, key heads, queries, keys, head dim, causal, query offset, window, mask): several query and key
# blocks (64 rows a block), grouped-query heads, head sizes that are not powers of two, queries at the end of the
# keys (a context-parallel chunk / KV cache) and elsewhere, Gemma 2's sliding window, a padding mask with a row that
# sees no key, a mask with packed documents, no causal rule.
CASES = [
    (2, 4, 2, 130, 130, 40, True, None, None, None),
    (1, 2, 1, 70, 150, 32, True, "end", None, None),
    (1, 2, 2, 40, 100, 16, True, 30, None, None),
    (2, 4, 1, 100, 100, 24, True, None, (17, 0), None),
    (2, 2, 2, 80, 80, 32, True, None, None, "padding"),
    (1, 2, 1, 90, 90, 48, True, None, (30, 0), "documents"),
    (2, 2, 1, 50, 70, 32, False, None, None, None),
]


def _mask(kind: str | None, b: int, sq: int, skv: int) -> torch.Tensor | None:
    """megatron's bool mask (True = masked) ``[b, 1, sq, skv]``."""
    if kind is None:
        return None
    mask = torch.zeros(b, 1, sq, skv, dtype=torch.bool)
    if kind == "padding":  # NOTE: the first row left-padded by 9 keys; its first query sees none (a padding row)
        mask[0, :, :, :9] = True
    else:  # NOTE: three documents
        doc = torch.tensor([0] * 30 + [1] * 45 + [2] * (skv - 75))
        mask[:] = doc[:sq, None] != doc[None, :]
    return mask


def _allowed(causal: bool, offset: int, sq: int, skv: int, window, mask) -> torch.Tensor:
    rel = torch.arange(skv)[None, :] - torch.arange(offset, offset + sq)[:, None]
    allowed = torch.ones(sq, skv, dtype=torch.bool)
    if causal:
        allowed &= rel <= 0
    if window is not None:
        allowed &= rel >= -window[0]
    allowed = allowed[None, None]
    return allowed if mask is None else allowed & ~mask


def check_softcap_attention(device: str = "cpu", dtypes=(torch.float32,), cap: float = 5.0) -> list:
    """Outputs and gradients within 2e-5 (fp32 in and out: only summation order differs) or bf16's resolution of the
    fp32 reference on the same bf16 values (3e-2 outputs, 5e-2 gradients relative to their largest); rows that see no
    key give zeros and no gradient. Returns what it checked."""
    checked = []
    for dtype in dtypes:
        for i, (b, h, hk, sq, skv, d, causal, offset, window, kind) in enumerate(CASES):
            g = torch.Generator().manual_seed(i)
            q, k, v, grad = (torch.randn(*shape, generator=g) * 2
                             for shape in ((b, h, sq, d), (b, hk, skv, d), (b, hk, skv, d), (b, h, sq, d)))
            q, k, v, grad = (t.to(device=device, dtype=dtype) for t in (q, k, v, grad))
            offset = skv - sq if offset in (None, "end") else offset
            mask = _mask(kind, b, sq, skv)
            scale = d ** -0.5

            def run(fn, *inputs):
                inputs = [t.detach().requires_grad_(True) for t in inputs]
                out = fn(*inputs)
                out.backward(grad.to(out.dtype))
                return [out.detach().float(), *(t.grad.float() for t in inputs)]

            ours = run(lambda q, k, v: softcap_attention(
                q, k, v, cap=cap, scale=scale, causal=causal, q_offset=offset,
                window=None if window is None else window, mask=None if mask is None else mask.to(device)), q, k, v)
            allowed = _allowed(causal, offset, sq, skv, window, mask).to(device)
            rule = _ScoreRule(cap, None)
            ref = run(lambda q, k, v: _materialised(q, k, v, allowed, scale=scale, rule=rule, dropout_p=0.0),
                      *(t.float() for t in (q, k, v)))
            for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
                err = (a - r).abs().max().item()
                bound = 2e-5 if dtype == torch.float32 else (3e-2 if name == "out" else 5e-2) * r.abs().max().item()
                assert err <= bound, (i, str(dtype), name, err, bound)
            if kind == "padding":
                assert not ours[0][0, :, 0].any() and not ours[1][0, :, 0].any(), i
            checked.append((i, str(dtype)))
    return checked
