"""The Triton kernels against their torch paths (the reference), run on one device: CUDA in the ``gpu`` tests, the CPU
under ``TRITON_INTERPRET=1`` in test_triton_interpret.py. ``LOONGFORGE_TRITON`` switches between the two paths.

Tolerances: fp32 1e-5; bf16 / fp16 three rounding steps of the output dtype (rtol 2.4e-2 bf16, 3e-3 fp16): the
kernels use fp32 math like the torch paths, but their fp32 reductions and ``exp`` round differently in the last bit,
which can flip either of the two roundings to 16 bits that HF's RMSNorm and SwiGLU make (the normalised input or
``silu(gate)``, then the product), and a flipped first rounding moves the product by one more step. RMSNorm's weight
grad sums over rows products with the rounded normalised input, where such flips add up like a random walk: its atol
is scaled by sqrt(rows). In fp32 that weight grad is a sum over ``rows`` terms taken in another order (per-program
partial sums, then their sum): with rounding errors of eps/2 * |partial sum| per addition and partial sums growing
like sqrt(k) * sigma (sigma the rms of the terms), the difference between two orders has a standard deviation of
about 0.35 * rows * eps * sigma, so its atol is the larger of 1e-5 and ``rows * eps * sigma`` (~3 standard
deviations; 4.8e-4 for 4000 rows of unit terms, where 2.3e-5 was seen on an H200).
RoPE in bf16 / fp16: the torch path (megatron's unfused rotation) rounds ``x * cos`` and ``rotate(x) * sin`` to 16 bits
before adding them, the kernel rounds once; where the two terms cancel, the result keeps the terms' rounding error, up
to one unit in the last place of the largest term each, so its atol is two such units at the largest |input| (an
fp16 output of 0.043 off by 2.3e-3 was seen on an H200 at inputs of magnitude 2-4, where a unit is 2.0e-3).
"""

import math

import torch

from loongforge_hf.kernels._triton import triton_paths

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2.4e-2), torch.float16: (2e-3, 3e-3)}


def _both_paths(fn, tensors, grad):
    out = []
    for enabled in (True, False):
        with triton_paths(enabled):
            leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in tensors]
            y = fn(*leaves)
            y.backward(grad)
            out.append([y.detach()] + [t.grad for t in leaves if t.requires_grad])
    return out


def _reduction_atol(x, dy):
    """fp32 atol of RMSNorm's weight grad, a sum over rows (see the module docstring)."""
    xf = x.detach().float().reshape(-1, x.shape[-1])
    terms = dy.float().reshape(xf.shape) * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    rows = xf.shape[0]
    return max(1e-5, rows * torch.finfo(torch.float32).eps * float(terms.pow(2).mean().sqrt()))


def two_ulps(x: torch.Tensor) -> float:
    """Two units in the last place of ``x.dtype`` at the largest |x|."""
    top = float(x.detach().abs().max())
    return 2.0 * 2.0 ** math.floor(math.log2(top)) * torch.finfo(x.dtype).eps if top > 0 else 0.0


def _compare(name, fn, tensors, grad, dtype, last_atol_scale=1.0, last_atol_fp32=None, atol16=None):
    atol, rtol = TOL[dtype]
    if atol16 is not None and dtype != torch.float32:
        atol = max(atol, atol16)
    tri, ref = _both_paths(fn, tensors, grad)
    assert len(tri) == len(ref)
    for i, (a, b) in enumerate(zip(tri, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, i, a.dtype, b.dtype, a.shape, b.shape)
        last = i == len(tri) - 1
        scale = last_atol_scale if last and dtype != torch.float32 else 1.0
        tol = last_atol_fp32 if last and dtype == torch.float32 and last_atol_fp32 is not None else atol * scale
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=rtol,
                                   msg=lambda m: f"{name}[{i}]: {m}")


def check_all(device: str, dtypes=(torch.float32, torch.bfloat16, torch.float16), big: bool = False) -> list[str]:
    from loongforge_hf.kernels.cross_entropy import linear_cross_entropy
    from loongforge_hf.kernels.rmsnorm import rms_norm
    from loongforge_hf.kernels.rope import rotary_sbhd
    from loongforge_hf.kernels.clamped_glu import QUICK_GELU_ALPHA, SILU_ALPHA, clamped_glu
    from loongforge_hf.kernels.swiglu import swiglu

    g = torch.Generator().manual_seed(0)
    checked = []
    # (300, 41): several backward programs, several row tiles each, a partial last tile
    norm_shapes = [(3, 7, 41), (5, 41), (2, 1, 3, 17), (300, 41)] + ([(4, 1000, 1024), (2048, 4, 128)] if big else [])
    glu_shapes = [(3, 7, 82), (5, 2 * 1100), (2, 1, 3, 34)] + ([(2, 1024, 2 * 3072)] if big else [])
    for dtype in dtypes:
        for shape in norm_shapes:
            for zero_centered in (False, True):
                x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
                w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
                dy = torch.randn(shape, generator=g).to(dtype).to(device)
                name = f"rms_norm{shape}{dtype}zc={zero_centered}"
                _compare(name, lambda x, w: rms_norm(x, w, 1e-6, zero_centered_gamma=zero_centered), [x, w], dy,
                         dtype, last_atol_scale=math.sqrt(x.numel() // shape[-1]),
                         last_atol_fp32=_reduction_atol(x, dy))
                checked.append(name)
            # q/k norm: a strided view of heads split off a fused projection
            qkv = (torch.randn(shape[:-1] + (3 * shape[-1],), generator=g) * 3).to(dtype).to(device)
            w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
            dy = torch.randn(shape, generator=g).to(dtype).to(device)
            name = f"rms_norm_view{shape}{dtype}"
            _compare(name, lambda qkv, w: rms_norm(qkv[..., shape[-1]:2 * shape[-1]], w, 1e-6), [qkv, w], dy, dtype,
                     last_atol_scale=math.sqrt(dy.numel() // shape[-1]),
                     last_atol_fp32=_reduction_atol(qkv[..., shape[-1]:2 * shape[-1]], dy))
            checked.append(name)
        for shape in glu_shapes:
            x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
            dy = torch.randn(shape[:-1] + (shape[-1] // 2,), generator=g).to(dtype).to(device)
            name = f"swiglu{shape}{dtype}"
            _compare(name, swiglu, [x], dy, dtype)
            checked.append(name)
            # NOTE: DeepSeek-V4's clamp; 1.3 rounds in 16 bits; gpt-oss's clamped GLU
            for limit, offset, alpha in ((2.0, 0.0, SILU_ALPHA), (1.3, 1.0, SILU_ALPHA), (2.0, 1.0, QUICK_GELU_ALPHA)):
                name = f"clamped_swiglu{shape}{dtype}limit={limit}offset={offset}alpha={alpha}"
                _compare(name, lambda x: clamped_glu(x, limit=limit, offset=offset, alpha=alpha), [x], dy, dtype)
                checked.append(name)
        # rotary: [s, b, heads, d] with angles [s, 1, 1, rot]; full and partial rotary, a strided q view
        rope_shapes = [(7, 3, 5, 16, 16), (5, 2, 3, 24, 12)] + ([(4096, 2, 16, 128, 128)] if big else [])
        for s_len, b, heads, d, rot in rope_shapes:
            angles = torch.arange(s_len)[:, None] * (10000.0 ** (-torch.arange(0, rot, 2) / rot))[None]
            freqs = torch.cat((angles, angles), -1)[:, None, None, :].to(device)
            qkv = torch.randn(s_len, b, heads, 3 * d, generator=g).to(dtype).to(device)
            dy = torch.randn(s_len, b, heads, d, generator=g).to(dtype).to(device)
            name = f"rope{(s_len, b, heads, d, rot)}{dtype}"
            _compare(name, lambda qkv: rotary_sbhd(qkv[..., d:2 * d], freqs), [qkv], dy, dtype,
                     atol16=max(two_ulps(qkv), two_ulps(dy)))
            checked.append(name)
        # linear cross-entropy, one rank: padded vocabulary, ignored tokens, z-loss, label smoothing, sum and
        # per-token reductions
        n, h, rows, vocab = (1000, 256, 5120, 5003) if big else (37, 16, 45, 41)
        hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
        weight = (torch.randn(rows, h, generator=g) * 0.3).to(dtype).to(device)
        labels = torch.randint(0, vocab, (n,), generator=g)
        labels[::5] = -100
        labels = labels.to(device)
        for reduction, z_loss, chunk, eps in (("sum", 0.0, None, 0.0), ("sum", 1e-3, 7, 0.0), ("none", 1e-3, 9, 0.0),
                                              ("sum", 0.0, 7, 0.3), ("none", 1e-3, 9, 0.2)):
            name = f"linear_cross_entropy_{reduction}_z{z_loss}_c{chunk}_ls{eps}{dtype}"
            grad = (torch.ones((), dtype=torch.float32) * 0.5 if reduction == "sum"
                    else torch.rand(n, generator=g)).to(device)

            def fn(hidden, weight, reduction=reduction, z_loss=z_loss, chunk=chunk, eps=eps):
                return linear_cross_entropy(hidden, weight, labels, vocab_size=vocab, z_loss=z_loss,
                                            chunk_size=chunk, reduction=reduction, label_smoothing=eps)
            # NOTE: the loss is an fp32 sum over tokens of fp32 terms: rtol only; grads as the other kernels
            _compare(name, fn, [hidden, weight], grad, dtype, last_atol_scale=math.sqrt(n))
            checked.append(name)
        # a LoRA adapter's term on the head (``low_rank``: z @ B^T added to each chunk's logits): the grads of
        # hidden, weight, z and B (the last a sum over tokens, as the loss)
        z = torch.randn(n, 4, generator=g).to(dtype).to(device)
        b_lora = (torch.randn(rows, 4, generator=g) * 0.3).to(dtype).to(device)
        for reduction in ("sum", "none"):
            name = f"lora_cross_entropy_{reduction}{dtype}"
            grad = (torch.ones((), dtype=torch.float32) * 0.5 if reduction == "sum"
                    else torch.rand(n, generator=g)).to(device)

            def fn(hidden, weight, z, b, reduction=reduction):
                return linear_cross_entropy(hidden, weight, labels, vocab_size=vocab, chunk_size=7,
                                            reduction=reduction, low_rank=(z, b))
            _compare(name, fn, [hidden, weight, z, b_lora], grad, dtype, last_atol_scale=math.sqrt(n))
            checked.append(name)
        # token stats (entropy sum, top-1 count) from the kernel's first pass against the torch path; row 3 and a
        # later row (in the kernel's next column block when the vocabulary has one) tie for the maximum of the first
        # tokens (argmax's pick: row 3). Same logits in both paths: the entropy differs by fp32 summation order only
        # (rtol 1e-5), the count not at all.
        second = 4099 if vocab > 4099 else 7
        tied_weight, tied_hidden, tied_labels = weight.clone(), hidden.clone(), labels.clone()
        tied_weight[second] = tied_weight[3]
        tied_hidden[:6] = tied_weight[3] * 4
        tied_labels[:6] = torch.tensor([3, second, 3, second, -100, 3], device=device)
        found = []
        for enabled in (True, False):
            with triton_paths(enabled):
                stats = torch.zeros(2, device=device)
                linear_cross_entropy(tied_hidden, tied_weight, tied_labels, vocab_size=vocab, chunk_size=11,
                                     token_stats=stats)
                found.append(stats.cpu())
        name = f"token_stats{dtype}"
        torch.testing.assert_close(found[0][0], found[1][0], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        assert found[0][1] == found[1][1] and found[0][1] >= 3, (name, found)
        checked.append(name)
    return checked
