"""``label_smoothing_factor`` under LoongTrainer against transformers.Trainer's LabelSmoother, on a tiny Llama.

Trainer smooths a causal LM's loss over the label tokens of the whole batch (``num_items_in_batch``, over every
data-parallel rank); the engine computes the same inside its fused, vocab-parallel loss. Logged losses and ``eval_loss``
within 1e-5 relative, trained weights within 1e-4 (fp32), at TP1, TP2 with SP, CP2, PP2 and DP2 (two transformers
processes under DDP). The rows ignore ragged prompts, so batches and ranks hold different numbers of label tokens (a
per-batch or per-rank mean would weight the tokens differently); smoothing 0.3 moves the losses by more than ten times
the tolerance (first assertion; the random model's predictions are near uniform). An image-text model is refused under
LoongTrainer: Trainer would smooth its logits against unshifted labels.
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

from ._train_parity import train_hf, train_loong, with_and_without
from .test_trainer_parity import weights

SMOOTHING = {"label_smoothing_factor": 0.3}
DATA = {"ragged": True}
LAYOUTS = {"tp1": (1, {}), "tp2_sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
           "cp2": (2, {"context_parallel_size": 2}), "pp2": (2, {"pipeline_parallel_size": 2})}


@pytest.fixture(scope="module")
def transformers_runs(tmp_path_factory):
    return with_and_without(tmp_path_factory.mktemp("label-smoothing"), SMOOTHING, DATA)


def assert_matches(got: dict, ref_losses: list, ref_dir, got_dir) -> None:
    assert got["losses"][:4] == pytest.approx(ref_losses[:4], rel=1e-5)
    if ref_losses[4] is not None:
        assert got["losses"][4] == pytest.approx(ref_losses[4], rel=1e-5)  # eval_loss, smoothed as Trainer does
    a, b = weights(ref_dir), weights(got_dir)
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_label_smoothing_matches_transformers_trainer(transformers_runs, tmp_path, layout_name):
    src, plain, smoothed, ref_dir = transformers_runs
    # the smoothing matters at this size: without it the losses differ by far more than the tolerance
    assert min(abs(a - b) / abs(b) for a, b in zip(plain, smoothed)) > 1e-4  # ten times the tolerance
    nprocs, layout = LAYOUTS[layout_name]
    got = run_distributed(train_loong, nprocs, str(src), str(tmp_path / "lf"), layout, SMOOTHING, DATA, timeout=300)
    assert all(r["losses"] == got[0]["losses"] for r in got)
    assert_matches(got[0], smoothed, ref_dir, tmp_path / "lf" / "final")


def test_label_smoothing_dp2_matches_transformers_trainer_ddp(transformers_runs, tmp_path):
    """Evaluation in batches of 2 rows a rank: Trainer normalises each step's smoothed eval loss over both ranks'
    label tokens (not each rank's mean)."""
    # NOTE: adam_epsilon 1e-6 (both trainers): with 1e-8, Adam turns a near-zero gradient element's float noise
    # (DDP's and our reductions sum in other orders) into a step of up to lr of either sign; on a 2026-11-28 CI
    # machine one embedding element differed by 3.8e-4 after 4 steps that way (4.8e-6 at lm_head), 5e-6 with 1e-6
    src, kw = transformers_runs[0], {**SMOOTHING, "per_device_eval_batch_size": 2, "adam_epsilon": 1e-6}
    ref = run_distributed(train_hf, 2, str(src), str(tmp_path / "hf"), kw, DATA, timeout=300)
    got = run_distributed(train_loong, 2, str(src), str(tmp_path / "lf"), {}, kw, DATA, timeout=300)
    assert ref[0][4] is not None
    assert_matches(got[0], ref[0], tmp_path / "hf" / "final", tmp_path / "lf" / "final")


def image_text_trainers(folder: str, out_dir: str) -> dict:
    """LoongTrainer with label smoothing on a Qwen2.5-VL model: the ValueError's message or None; and whether
    LoongSFTTrainer (TRL shifts for every model) accepts it."""
    import trl

    import loongforge_hf as lf

    from ._train_parity import make_dataset, training_args

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    out = {}
    try:
        lf.LoongTrainer(model=model, args=training_args(out_dir, **SMOOTHING), train_dataset=make_dataset())
        out["trainer"] = None
    except ValueError as err:
        out["trainer"] = str(err)
    args = trl.SFTConfig(out_dir, use_cpu=True, report_to=[], bf16=False, max_steps=1, **SMOOTHING)
    trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=make_dataset())
    out["sft"] = trainer.label_smoother is not None
    return out


def test_image_text_model_refused_under_loong_trainer_not_sft(tmp_path):
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

    src = make_tiny_qwen2_5_vl(tmp_path / "src")
    out = run_distributed(image_text_trainers, 1, str(src), str(tmp_path / "out"), timeout=300)[0]
    assert "label_smoothing_factor with a qwen2_5_vl model" in out["trainer"], out["trainer"]
    assert out["sft"]
