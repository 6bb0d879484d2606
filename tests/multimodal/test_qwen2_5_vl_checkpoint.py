"""LoongTrainer checkpoints of Qwen2.5-VL hold the vision tower: every parameter trained (tower and projector too), a
run at TP2 with the tower split over TP saves at step 2 and the runs resumed from a copy of that checkpoint (at TP2
with the tower split, at TP2 with it replicated, at PP2, and at TP1 in one process) log the uninterrupted run's
losses for steps 3-4 (1e-5 relative; fp32) and export the same trained tower (1e-5). Before, saving any Qwen2.5-VL
training checkpoint failed (megatron's optimizer found the tower's parameters in no model state). And the gradient
norm with the tower split over TP (clipping) equals one process's."""

from __future__ import annotations

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

from ._vl_checkpoint import one_rank_resume, two_rank_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("vl-ckpt")
    folder = str(make_tiny_qwen2_5_vl(base / "vl"))
    two = run_distributed(two_rank_runs, 2, folder, str(base / "two"), timeout=600)
    one = run_distributed(one_rank_resume, 1, folder, str(base / "one"), str(base / "two/full/checkpoint-2"),
                          timeout=300)[0]
    return base, two, one


def _tower(folder) -> dict:
    from safetensors.torch import load_file
    import glob

    tensors = {}
    for f in glob.glob(f"{folder}/*.safetensors"):
        tensors.update({k: v for k, v in load_file(f).items() if k.startswith(("visual.", "model.visual."))})
    return tensors


@pytest.mark.parametrize("name", ["tp2_split", "tp2_replicated", "pp2", "tp1"])
def test_resumed_run_matches_uninterrupted(runs, name):
    base, two, one = runs
    full = two[0]["full"]
    assert "megatron" in full["checkpoint_files"], full["checkpoint_files"]
    got = one if name == "tp1" else two[0][name]
    assert len(full["losses"]) == 4 and len(got["losses"]) == 4, (full, got)
    assert got["losses"] == pytest.approx(full["losses"], rel=1e-5), (name, got["losses"], full["losses"])
    trained, resumed = _tower(base / "two/full/final"), _tower(base / ("one/tp1" if name == "tp1" else f"two/{name}")
                                                               / "final")
    original = _tower(base / "vl")
    assert trained.keys() == resumed.keys() == original.keys() and len(trained) > 20
    assert any(not torch.equal(trained[k], original[k]) for k in trained)  # the tower trained
    for k in trained:
        torch.testing.assert_close(resumed[k], trained[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_split_tower_gradient_norm_counts_every_shard(runs):
    """The tower trained alone (language frozen), clipped at 0.05: with the tower split over TP the logged grad norms
    and losses are one process's (1e-5 relative). Before, the split weights carried no tensor-parallel attributes, so
    megatron's norm counted TP rank 0's shards only (0.98368 against 0.98372 here, more where the ViT's weights carry
    more of the gradient) and clipping scaled by that."""
    _, two, one = runs
    ref, got = one["clipped"], two[0]["clipped_split"]
    assert len(ref) == len(got) == 3 and all(norm > 0.05 for _, norm in ref), (ref, got)
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5), (got, ref)
