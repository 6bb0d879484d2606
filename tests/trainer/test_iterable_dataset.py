"""Streaming data: LoongTrainer on a ``datasets.IterableDataset`` logs transformers.Trainer's losses (1e-5 relative,
fp32) in one process, at TP2, and over two data-parallel ranks against Trainer on two processes (accelerate hands
each rank its slice of every global batch; the rows hold different numbers of label tokens)."""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._train_parity import streamed_losses


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("stream") / "llama", "llama"))


def test_one_process_and_tp2_match_trainer(folder, tmp_path):
    ref = run_distributed(streamed_losses, 1, folder, str(tmp_path / "hf"), False, timeout=300)[0]
    ours = run_distributed(streamed_losses, 1, folder, str(tmp_path / "lf"), True, timeout=300)[0]
    tp2 = run_distributed(streamed_losses, 2, folder, str(tmp_path / "tp2"), True, {"tensor_parallel_size": 2},
                          timeout=300)
    assert len(ref) == 4 and ref[0] != ref[-1], ref
    assert ours == pytest.approx(ref, rel=1e-5) and tp2[0] == tp2[1] == pytest.approx(ref, rel=1e-5), (ref, ours, tp2)


def test_two_data_parallel_ranks_match_trainer(folder, tmp_path):
    ref = run_distributed(streamed_losses, 2, folder, str(tmp_path / "hf"), False, timeout=300)
    ours = run_distributed(streamed_losses, 2, folder, str(tmp_path / "lf"), True, timeout=300)
    assert ref[0] == ref[1] and ours[0] == ours[1], (ref, ours)
    assert ours[0] == pytest.approx(ref[0], rel=1e-5), (ref, ours)
