"""Packing: documents packed into one row (position ids restart, -100 at boundaries) train exactly like unpacked ones.

Tolerance: 1e-5 relative (fp32; only summation order differs).
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._packing import forward_packed_vs_unpacked, train_packed_or_padded


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pack") / "src", "qwen3")


@pytest.mark.parametrize("nprocs,layout", [(1, {}), (2, {"tensor_parallel_size": 2}),
                                           (2, {"context_parallel_size": 2})], ids=["tp1", "tp2", "cp2"])
def test_packed_forward_equals_unpacked(checkpoint, nprocs, layout):
    """cp2: the model's forward takes any length (the documents have 3-13 tokens), padded for megatron inside."""
    for packed, unpacked in run_distributed(forward_packed_vs_unpacked, nprocs, str(checkpoint), layout,
                                            timeout=240):
        assert packed == pytest.approx(unpacked, rel=1e-5)


def test_packed_training_equals_padded_training(checkpoint, tmp_path):
    packed = run_distributed(train_packed_or_padded, 1, str(checkpoint), str(tmp_path / "p"), {}, True,
                             timeout=240)[0]
    padded = run_distributed(train_packed_or_padded, 1, str(checkpoint), str(tmp_path / "u"), {}, False,
                             timeout=240)[0]
    assert len(packed) == 3
    assert packed == pytest.approx(padded, rel=1e-5)


def test_packed_training_under_context_parallelism_equals_one_rank(checkpoint, tmp_path):
    """CP2: each rank runs its two load-balanced chunks of the packed row (padded by the engine to a multiple of 4 with
    a document of pads), its rows of the document mask, and scores its share of the labels."""
    one = run_distributed(train_packed_or_padded, 1, str(checkpoint), str(tmp_path / "one"), {}, True,
                          timeout=240)[0]
    cp2 = run_distributed(train_packed_or_padded, 2, str(checkpoint), str(tmp_path / "cp2"),
                          {"context_parallel_size": 2}, True, timeout=240)
    assert len(one) == 3
    for losses in cp2:
        assert losses == pytest.approx(one, rel=1e-5)


def test_packed_rows_may_exceed_max_position_embeddings(tmp_path):
    """Packed rows (3 documents of 3-13 tokens) are longer than max_position_embeddings=16 while every document fits:
    training runs and equals the padded run; a document that itself exceeds the limit is refused by name."""
    from loongforge_hf.trainer.data import DataError, check_batch

    short = make_tiny_checkpoint(tmp_path / "short", "qwen3", max_position_embeddings=16)
    packed = run_distributed(train_packed_or_padded, 1, str(short), str(tmp_path / "p"), {}, True, timeout=240)[0]
    padded = run_distributed(train_packed_or_padded, 1, str(short), str(tmp_path / "u"), {}, False, timeout=240)[0]
    assert len(packed) == 3 and packed == pytest.approx(padded, rel=1e-5)

    ids = torch.zeros(1, 24, dtype=torch.long)
    check_batch({"input_ids": ids, "labels": ids, "position_ids": torch.arange(12).repeat(2)[None]}, max_positions=16)
    with pytest.raises(DataError, match="A document of 20 tokens"):
        check_batch({"input_ids": ids, "labels": ids,
                     "position_ids": torch.cat([torch.arange(20), torch.arange(4)])[None]}, max_positions=16)
    with pytest.raises(DataError, match="Sequence length 24 is longer"):
        check_batch({"input_ids": ids, "labels": ids}, max_positions=16)
