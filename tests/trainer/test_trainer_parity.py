"""LoongTrainer against transformers.Trainer with the same TrainingArguments on a tiny Llama.

Tolerances: logged losses within 1e-3 relative, trained weights within 1e-3 (fp32; the remaining differences are
reduction order in TP/DP collectives).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._train_parity import train_hf, train_loong

LAYOUTS = {"tp1": (1, {}), "tp2": (2, {"tensor_parallel_size": 2}), "pp2": (2, {"pipeline_parallel_size": 2}),
           "pp2vpp2": (2, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2})}


def weights(folder: Path) -> dict:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_close_runs(ref_losses, ref_dir, got, got_dir):
    # four logged training losses, then eval_loss after training
    assert len(got["losses"]) == len(ref_losses) == 5
    assert got["losses"][:4] == pytest.approx(ref_losses[:4], rel=1e-3)
    if ref_losses[4] is not None:
        assert got["losses"][4] == pytest.approx(ref_losses[4], rel=1e-3)  # eval_loss not scaled by world size
    for key in ("loss", "grad_norm", "learning_rate", "tokens_per_second", "epoch"):
        assert key in got["keys"], got["keys"]
    a, b = weights(ref_dir), weights(got_dir)
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-3, msg=name)


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    src = make_tiny_checkpoint(tmp / "src", "llama")
    losses = run_distributed(train_hf, 1, str(src), str(tmp / "hf"), timeout=300)[0]
    return src, losses, tmp / "hf" / "final"


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_matches_transformers_trainer(single_process_reference, tmp_path, layout_name):
    src, ref_losses, ref_dir = single_process_reference
    nprocs, layout = LAYOUTS[layout_name]
    got = run_distributed(train_loong, nprocs, str(src), str(tmp_path / "lf"), layout, timeout=300)
    for r in got:
        assert r["losses"] == got[0]["losses"]  # every rank logs the same global loss
    assert got[0]["global_step"] == 4
    assert_close_runs(ref_losses, ref_dir, got[0], tmp_path / "lf" / "final")


def test_dp2_matches_transformers_trainer_ddp(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "llama")
    ref = run_distributed(train_hf, 2, str(src), str(tmp_path / "hf"), timeout=300)
    got = run_distributed(train_loong, 2, str(src), str(tmp_path / "lf"), {}, timeout=300)
    assert_close_runs(ref[0], tmp_path / "hf" / "final", got[0], tmp_path / "lf" / "final")
