"""Kill a run after a checkpoint and resume it: the losses continue exactly as in the uninterrupted run."""

import json

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._train_parity import resume_runs, train_loong_resumable


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    src = make_tiny_checkpoint(tmp / "src", "llama")
    steps = run_distributed(train_loong_resumable, 2, str(src), str(tmp / "run"), {"tensor_parallel_size": 2},
                            timeout=300)[0]
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5, 6]
    return src, dict(steps), tmp / "run"


def test_checkpoint_layout_and_rotation(uninterrupted):
    _, _, run = uninterrupted
    names = sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-3", "checkpoint-6"]
    ckpt = run / "checkpoint-3"
    for f in ("config.json", "trainer_state.json", "scheduler.pt", "megatron", "training_args.bin"):
        assert (ckpt / f).exists(), f
    assert list(ckpt.glob("*.safetensors")), "no HF weights in the checkpoint"
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 3
    assert not any(p.name.startswith(".") for p in run.iterdir())  # no incomplete temporary folders left
    # save_model() into output_dir kept the checkpoints and wrote a loadable HF export beside them
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(run)
    assert (run / "training_args.bin").is_file()  # NOTE: as Trainer.save_model writes it


@pytest.mark.parametrize("resume_layout", [
    pytest.param((2, {"tensor_parallel_size": 2}), id="same-layout-tp2"),
    pytest.param((2, {"pipeline_parallel_size": 2}), id="tp2-to-pp2"),
    pytest.param((1, {}), id="tp2-to-tp1"),
    pytest.param((2, {"context_parallel_size": 2}), id="tp2-to-cp2"),
])
def test_resume_continues_the_same_losses(uninterrupted, tmp_path, resume_layout):
    src, full, _ = uninterrupted
    killed = run_distributed(train_loong_resumable, 2, str(src), str(tmp_path / "run"), {"tensor_parallel_size": 2},
                             stop_after=3, timeout=300)[0]
    assert [s for s, _ in killed] == [1, 2, 3]
    nprocs, layout = resume_layout
    resumed = run_distributed(train_loong_resumable, nprocs, str(src), str(tmp_path / "run"), layout,
                              resume=str(tmp_path / "run" / "checkpoint-3"), timeout=300)[0]
    resumed = dict(resumed)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6] or sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), (step, resumed[step], full[step])


@pytest.mark.parametrize("rows", [pytest.param(24, id="mid-epoch"), pytest.param(6, id="epoch-boundary")])
def test_resume_restores_trainers_random_state(uninterrupted, tmp_path, rows):
    """NEFTune draws its noise from torch's default generator: a resumed run adds the uninterrupted run's noise only
    if Trainer's saved random state comes back (as Trainer restores it: after the skipped batches mid-epoch, before
    the next epoch's order at a boundary; 6 rows make step 3 an epoch's end). One process."""
    out = run_distributed(resume_runs, 1, str(uninterrupted[0]), str(tmp_path), rows, {"neftune_noise_alpha": 5.0},
                          timeout=300)[0]
    full, resumed = out["uninterrupted"], out["resumed"]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6), (step, resumed[step], full[step])
