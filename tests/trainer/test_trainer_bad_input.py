"""LoongTrainer refuses bad data with a clear message on every rank (no hang)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _train_expecting_error(folder: str, out_dir: str, case: str):
    import datasets

    import loongforge_hf as lf
    from tests.trainer._train_parity import make_dataset, training_args

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if case == "no_input_ids":
        ds = datasets.Dataset.from_dict({"text": ["tok5 tok6"] * 8})
        args = training_args(out_dir)
    elif case == "too_long":
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # only rank 1's share holds an over-long sequence: the other rank must stop too, not hang
        seq = 200 if rank == 1 else 16
        ds = make_dataset(n=16, seq=16)
        ds = datasets.Dataset.from_dict({"input_ids": [r + [5] * (seq - 16) for r in ds["input_ids"]],
                                         "labels": [r + [5] * (seq - 16) for r in ds["labels"]]})
        args = training_args(out_dir)
    elif case == "empty":
        ds = make_dataset().select([])
        args = training_args(out_dir)
    elif case == "zero_batch":
        ds = make_dataset()
        args = training_args(out_dir, per_device_train_batch_size=0)
    try:
        lf.LoongTrainer(model=model, args=args, train_dataset=ds).train()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e)
    return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bad") / "src", "llama")


@pytest.mark.parametrize("case,pattern", [
    ("no_input_ids", "no 'input_ids' column"),
    ("too_long", "longer than the model's max_position_embeddings"),
    ("zero_batch", "must be >= 1|positive"),
    ("empty", "train_dataset is empty"),
])
def test_bad_data_fails_clearly_on_every_rank(checkpoint, tmp_path, case, pattern):
    import re

    results = run_distributed(_train_expecting_error, 2, str(checkpoint), str(tmp_path / "o"), case, timeout=180)
    for r in results:
        assert r is not None, f"{case}: training did not fail"
        assert re.search(pattern, r[1]), r


def _train_on_empty_iterable(folder: str, out_dir: str):
    import logging

    import datasets

    import loongforge_hf as lf
    from tests.trainer._train_parity import make_dataset, training_args

    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("loongforge_hf.trainer.loong_trainer").addHandler(handler)

    def nothing():
        yield from ()

    empty = datasets.IterableDataset.from_generator(nothing, features=make_dataset().features)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = lf.LoongTrainer(model=model, args=training_args(out_dir), train_dataset=empty)
    trainer.train()
    assert isinstance(empty, datasets.IterableDataset)
    return trainer.state.global_step, said


def test_an_exhausted_iterable_dataset_stops_training_with_a_warning(checkpoint, tmp_path):
    """As transformers.Trainer: an IterableDataset without a sample ends training at step 0 with a warning, on
    every rank (no hang waiting for the other's batch)."""
    for step, said in run_distributed(_train_on_empty_iterable, 2, str(checkpoint), str(tmp_path / "o"),
                                      timeout=180):
        assert step == 0
        assert any("gave no batch in epoch 0" in m and "max_steps=4" in m for m in said), said
