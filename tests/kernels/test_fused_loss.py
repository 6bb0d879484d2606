"""The training loss through the fused linear cross-entropy equals the loss on materialised logits.

The checks run inside the ranks (``_fused_loss.py``): forward loss and parameter gradients, then one MegatronEngine step
with label smoothing, fused vs. materialised, fp32 within 1e-5, for a tied Qwen3 (TP2 with and without sequence
parallelism, PP2), an untied Llama (DP2) and Phi, whose LM head has a bias (vocabulary-split: its gradient from the
fused kernel; TP2 with sequence parallelism, PP2).
"""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._fused_loss import fused_matches_materialised


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fused-loss")
    return {"qwen3": make_tiny_checkpoint(tmp / "qwen3", "qwen3", tie_word_embeddings=True, tokenizer=False),
            "llama": make_tiny_checkpoint(tmp / "llama", "llama", tokenizer=False),
            "phi": make_tiny_checkpoint(tmp / "phi", "phi", tokenizer=False)}


def test_tied_qwen3_tp2_sp_and_pp2(checkpoints, tmp_path):
    layouts = ["tp2_sp", "pp2"]
    results = run_distributed(fused_matches_materialised, 2, str(checkpoints["qwen3"]), str(tmp_path), layouts,
                              timeout=400)
    assert [sorted(r) for r in results] == [sorted(layouts)] * 2


def test_untied_llama_dp2(checkpoints, tmp_path):
    results = run_distributed(fused_matches_materialised, 2, str(checkpoints["llama"]), str(tmp_path), ["dp2"],
                              timeout=400)
    assert [sorted(r) for r in results] == [["dp2"]] * 2


def test_phi_lm_head_bias_tp2_sp_and_pp2(checkpoints, tmp_path):
    """Phi's LM-head bias, its weight trained or frozen (the bias trained beside it either way)."""
    from ._fused_loss import FROZEN_HEAD_WEIGHT

    layouts = ["tp2_sp", "pp2", "tp2_sp" + FROZEN_HEAD_WEIGHT]
    results = run_distributed(fused_matches_materialised, 2, str(checkpoints["phi"]), str(tmp_path), layouts,
                              timeout=400)
    assert [sorted(r) for r in results] == [sorted(layouts)] * 2
