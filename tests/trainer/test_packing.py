"""Packing: documents packed into one row (position ids restart, -100 at boundaries) train exactly like unpacked ones.

Tolerance: 1e-5 relative (fp32; only summation order differs).
"""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._packing import forward_packed_vs_unpacked, train_packed_or_padded


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pack") / "src", "qwen3")


@pytest.mark.parametrize("nprocs,layout", [(1, {}), (2, {"tensor_parallel_size": 2})], ids=["tp1", "tp2"])
def test_packed_forward_equals_unpacked(checkpoint, nprocs, layout):
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
