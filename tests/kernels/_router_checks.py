"""The Triton router kernel (kernels/_router_triton.py) through Triton's interpreter against the torch path
(called in a child process by test_triton_interpret)."""

import torch


def distinct_logits(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """fp32 ``[tokens, experts]`` logits, each row a permutation of one grid: distinct values in every row, so the
    top k have no ties in any dtype (the tests of the router, on CPU, in the interpreter and on the GPU)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.linspace(-4, 4, experts)
    return torch.stack([grid[torch.randperm(experts, generator=g)] for _ in range(tokens)])


def assert_same_routing(got, want, tol: float, name: str = "") -> None:
    """``topk_softmax_fwd``'s outputs against the torch path's: the same map, the same experts per row (in any
    order), the dense probabilities within ``tol`` (relative; 1e-6 absolute)."""
    assert torch.equal(got[1], want[1]), name
    assert torch.equal(got[2].sort(1).values, want[2].sort(1).values), name
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=tol, atol=1e-6, msg=name or None)


def check_router() -> list[str]:
    """Indices and map equal, the fp32 probabilities within 1e-6 (the kernel's exp is not torch's; one bf16 ulp
    where they are bf16-rounded scores, ``pre_softmax``), the dense
    probabilities in bf16 within two bf16 ulps (2**-6 relative): the interpreter rounds fp32 to bf16 by truncation,
    not to nearest as the GPU and torch do, once for the probabilities and once more after scaling. Distinct logits
    (no ties at the k-th place)."""
    from loongforge_hf.kernels import _router_triton
    from loongforge_hf.kernels.router import _topk_softmax_torch

    checked = []
    for tokens, experts, k in ((37, 60, 6), (16, 128, 8), (5, 8, 1), (3, 7, 7)):
        base = distinct_logits(tokens, experts, seed=tokens)
        for dtype in (torch.float32, torch.bfloat16):
            for pre in (False, True):
                for scale in (None, 2.5):
                    x = base.to(dtype)
                    got = _router_triton.topk_softmax_fwd(x, k, pre, scale)
                    want = _topk_softmax_torch(x, k, pre, scale)
                    name = f"router({tokens}x{experts}, k={k}, {dtype}, pre={pre}, scale={scale})"
                    assert_same_routing(got, want, 1e-6 if dtype == torch.float32 else 2 ** -6, name)
                    order = want[2].argsort(1)
                    # NOTE: with pre_softmax the kept probabilities are the scores rounded to the dtype (one rounding)
                    ptol = 2 ** -7 if pre and dtype == torch.bfloat16 else 1e-6
                    torch.testing.assert_close(got[3].gather(1, got[2].argsort(1)), want[3].gather(1, order),
                                               rtol=ptol, atol=1e-6, msg=name)
                    checked.append(name)
    return checked
