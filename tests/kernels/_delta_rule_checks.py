"""The Triton state pass of the gated delta rule (``kernels._delta_rule_triton``) against the torch loop of
``kernels.gated_delta_rule`` (``state_pass`` and its backward ``_state_pass_grads``), run under
``TRITON_INTERPRET=1`` (``test_gated_delta_rule.py``)."""

import torch

from loongforge_hf.kernels import gated_delta_rule as rule


SMALL = ((1, 2, 3, 7, 8, 12, True), (2, 1, 2, 16, 16, 80, False))
QWEN3_5 = ((1, 32, 64, 64, 128, 128, False), (2, 4, 9, 64, 128, 128, True))  # NOTE: 4096 tokens of 32 value heads


def check_state_pass(shapes=SMALL, device: str = "cpu") -> list:
    """Largest differences (relative to each reference's largest value) of every output and gradient, over ``shapes``
    ``(batch, heads, chunks, chunk, k_dim, v_dim, with an initial state)``: by default chunks / key / value dims below
    and off Triton's 16-wide tiles and a value dim over two blocks."""
    gen = torch.Generator().manual_seed(0)
    worst = []
    for b, h, n, c, k, v, with_initial in shapes:
        w, k_end = (0.3 * torch.randn(b, h, n, c, k, generator=gen) for _ in range(2))
        u = torch.randn(b, h, n, c, v, generator=gen)
        decay = torch.rand(b, h, n, generator=gen)
        initial = torch.randn(b, h, k, v, generator=gen) if with_initial else torch.zeros(b, h, k, v)
        grads = [torch.randn(b, h, n, k, v, generator=gen), torch.randn(b, h, n, c, v, generator=gen),
                 torch.randn(b, h, k, v, generator=gen)]
        grads = [t.to(device) for t in grads]
        results = []
        for triton in (True, False):
            inputs = [t.to(device) for t in (w, u, k_end, decay, initial)]
            with rule_triton(triton):
                outs = rule.state_pass(*inputs)
                results.append([*outs, *rule._state_pass_grads(inputs[0], inputs[2], inputs[3], *outs[:2], *grads)])
        for got, want in zip(*results):
            worst.append(float((got - want).abs().max() / want.abs().max()))
    return worst


def rule_triton(enabled: bool):
    from loongforge_hf.kernels._triton import triton_paths

    return triton_paths(enabled)
