"""NEFTune (``neftune_noise_alpha``) under LoongTrainer against transformers.Trainer's, on a tiny Llama.

The noise is drawn as transformers draws it and each rank adds its own share, so every layout adds the numbers a
one-process transformers.Trainer run adds: logged losses within 1e-5 relative and trained weights within 1e-4 (fp32;
NEFTune with alpha 5 moves the losses by ~1e-2, three orders above the tolerance, see the first assertion). The
rows are 15 tokens, so under TP2 with SP and CP2 the noise's scale must come from the collator's length, not the
padded one.
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

from ._train_parity import train_loong, with_and_without
from .test_trainer_parity import weights

NEFTUNE = {"neftune_noise_alpha": 5.0}
DATA = {"seq": 15}  # NOTE: not a multiple of what TP2 with SP (2) and CP2 (4) need: the engine pads each micro-batch
LAYOUTS = {"tp1": (1, {}), "tp2": (2, {"tensor_parallel_size": 2}),
           "tp2_sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
           "cp2": (2, {"context_parallel_size": 2}), "pp2": (2, {"pipeline_parallel_size": 2})}


@pytest.fixture(scope="module")
def transformers_runs(tmp_path_factory):
    return with_and_without(tmp_path_factory.mktemp("neftune"), NEFTUNE, DATA)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_neftune_matches_transformers_trainer(transformers_runs, tmp_path, layout_name):
    src, plain, noisy, ref_dir = transformers_runs
    # the noise matters at this size: without it the training losses differ by far more than the tolerance
    assert max(abs(a - b) / abs(b) for a, b in zip(plain[:4], noisy[:4])) > 1e-3
    nprocs, layout = LAYOUTS[layout_name]
    got = run_distributed(train_loong, nprocs, str(src), str(tmp_path / "lf"), layout, NEFTUNE, DATA, timeout=300)[0]
    assert got["losses"][:4] == pytest.approx(noisy[:4], rel=1e-5)
    # evaluation after training adds no noise (transformers takes its hook off; eval mode adds none anyway)
    assert got["losses"][4] == pytest.approx(noisy[4], rel=1e-5)
    a, b = weights(ref_dir), weights(tmp_path / "lf" / "final")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-4, msg=name)


def hooks_after_training(folder: str, out_dir: str) -> dict:
    import loongforge_hf as lf
    from loongforge_hf.trainer.neftune import NoisyEmbeddings

    from ._train_parity import make_dataset, training_args

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor(make_dataset(n=2, **DATA)["input_ids"])
    try:
        NoisyEmbeddings(model.chunks, alpha=-1.0)
        refused = None
    except ValueError as err:
        refused = str(err)
    trainer = lf.LoongTrainer(model=model, args=training_args(out_dir, max_steps=1, **NEFTUNE),
                              train_dataset=make_dataset(**DATA))
    trainer.train()
    model.train()  # NOTE: a training-mode forward would add noise if a hook were left on
    with torch.no_grad():
        first, second = model(ids).logits, model(ids).logits
    return {"same": torch.equal(first, second), "refused": refused}


def test_neftune_hooks_come_off_after_training(transformers_runs, tmp_path):
    out = run_distributed(hooks_after_training, 1, str(transformers_runs[0]), str(tmp_path), timeout=300)[0]
    assert out["same"]
    assert "neftune_noise_alpha must be >= 0" in out["refused"]
