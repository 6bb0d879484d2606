"""PhiMoE's sparsemixer routing (``bridges/phimoe.py``) against transformers' own ``sparsemixer``: in eval and in
training (Gumbel-sampled picks, the rand > 0.75 scale, the Heun's-method gradient) from the same random draws, the
weights, experts and logits' gradient equal exactly; a bad expert count is refused by name."""

import pytest
import torch
from transformers.models.phimoe import modeling_phimoe as hf

from loongforge_hf.bridges.config_map import UnsupportedConfigError
from loongforge_hf.bridges.phimoe import PhimoeBridge, sparsemixer


@pytest.mark.parametrize("training", [False, True])
def test_sparsemixer_matches_transformers(training):
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 2
    grad_out = torch.randn(64, 2, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (hf.sparsemixer, lambda x, **kw: sparsemixer(x, kw["jitter_eps"], kw["training"])):
        x = logits.clone().requires_grad_(True)
        torch.manual_seed(3)
        weights, experts = fn(x, jitter_eps=0.3, training=training)
        (weights * grad_out).sum().backward()
        results.append((weights.detach(), experts, x.grad))
    (w_ref, e_ref, g_ref), (w, e, g) = results
    assert torch.equal(e, e_ref) and torch.equal(w, w_ref) and torch.equal(g, g_ref)
    assert bool((e[:, 0] != e[:, 1]).all())
    if training:  # NOTE: the draws change some picks from eval's, and some weights to a third
        assert not torch.equal(e, sparsemixer(logits, 0.3, False)[1])


def test_phimoe_refuses_other_expert_counts():
    from loongforge_hf.testing.tiny_models import _config

    with pytest.raises(UnsupportedConfigError, match="num_experts_per_tok=3"):
        PhimoeBridge(_config("phimoe", num_experts_per_tok=3))
