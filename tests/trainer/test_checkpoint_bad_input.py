"""LoongTrainer checkpoints and bad input on 2 CPU ranks (PP=2): a write that fails on one rank (disk full, or
megatron's sharding validation, which runs on rank 0 alone) and an incomplete or corrupt checkpoint given to
``resume_from_checkpoint`` raise the same ``CheckpointError`` on every rank, naming the file, and leave no rank
waiting in a collective (a hang runs into ``run_distributed``'s timeout); a failed save leaves neither
``checkpoint-N`` nor its temporary folder.

All cases run in one world: each must leave the world usable for the next, which a rank stuck in a barrier would not.
"""

import errno
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

SAVE_CASES = {  # case: (what fails, on which rank, fragments of the message)
    "megatron_state_disk_full": ("megatron_state", 0, ["rank 0", "megatron state", "No space left on device"]),
    # megatron validates the sharding on rank 0 alone, then writes (collectives): rank 1 must not be left waiting
    "megatron_state_invalid": ("megatron_validation", 0, ["rank 0", "megatron state cannot be saved",
                                                          "Invalid access pattern"]),
    # building the optimizer's sharded state fails on rank 1 only (out of memory, say): rank 0 must not be left in
    # megatron's save validation (a collective) while rank 1 reports its error
    "optimizer_state_fails": ("optimizer_state", 1, ["rank 1", "megatron state cannot be saved", "MemoryError"]),
    "scheduler_disk_full": ("scheduler.pt", 0, ["rank 0", "scheduler.pt", "disk full"]),
    "megatron_rng_disk_full": ("megatron_rng", 1, ["rank 1", "megatron_rng_1.pt", "disk full"]),
    "trainer_state_disk_full": ("trainer_state", 0, ["rank 0", "trainer_state.json", "disk full"]),
    "rng_state_disk_full": ("rng_state", 1, ["rank 1", "RNG state", "disk full"]),
}
RESUME_CASES = {  # case: fragments of the message
    "no_megatron": ["has no megatron/ folder"],
    "no_scheduler": ["incomplete LoongTrainer checkpoint", "scheduler.pt missing"],
    "no_common": ["incomplete LoongTrainer checkpoint", "megatron/common.pt missing"],
    "bad_trainer_state": ["trainer_state.json", "corrupt checkpoint file"],
    "no_shard": [".distcp is missing", "incomplete LoongTrainer checkpoint"],
    "truncated_shard": [".distcp is truncated"],
    "bad_megatron_rng_rank1": ["rank 1", "megatron_rng_1.pt", "cannot be read"],
}


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _failing(what: str):
    """Patches that make the write ``what`` fail with a full disk."""
    from transformers import Trainer, TrainerState

    real_save = torch.save

    def save(obj, f, *a, **k):
        if what in str(f):
            _enospc()
        return real_save(obj, f, *a, **k)

    if what in ("scheduler.pt", "megatron_rng"):
        return [mock.patch("torch.save", save)]
    if what == "megatron_state":  # the file write of megatron's distributed-checkpoint writer
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        return [mock.patch.object(filesystem_async, "_write_item", _enospc)]
    if what == "optimizer_state":
        from loongforge_hf.trainer import optimizer_state

        def out_of_memory(*args, **kwargs):
            raise MemoryError("building the optimizer's sharded state")

        return [mock.patch.object(optimizer_state, "sharded_state_dict", out_of_memory)]
    if what == "megatron_validation":
        from megatron.core.dist_checkpointing import validation
        from megatron.core.dist_checkpointing.core import CheckpointingException

        def invalid(rank_sharding):
            raise CheckpointingException(f"Invalid access pattern for {rank_sharding[0][1].key}\n(the counts)")

        return [mock.patch.object(validation, "_validate_sharding_for_key", invalid)]
    if what == "trainer_state":
        return [mock.patch.object(TrainerState, "save_to_json", _enospc)]
    return [mock.patch.object(Trainer, "_save_rng_state", lambda self, d: _enospc())]


def _outcome(fn) -> dict:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test compares what each rank got
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": "no error", "message": ""}


def _corrupt(good: Path, bad: Path, case: str) -> None:
    shutil.copytree(good, bad)
    meg = bad / "megatron"
    if case == "no_megatron":
        shutil.rmtree(meg)
    elif case == "no_scheduler":
        (bad / "scheduler.pt").unlink()
    elif case == "no_common":
        (meg / "common.pt").unlink()
    elif case == "bad_trainer_state":
        (bad / "trainer_state.json").write_text("{not json")
    elif case == "no_shard":
        sorted(meg.glob("*.distcp"))[-1].unlink()
    elif case == "truncated_shard":
        shard = sorted(meg.glob("*.distcp"))[-1]
        shard.write_bytes(shard.read_bytes()[:100])
    elif case == "bad_megatron_rng_rank1":
        (bad / "megatron_rng_1.pt").write_bytes(b"not a torch file")


def save_and_resume_cases(folder: str, out_dir: str, args: dict | None = None) -> dict:
    """``args``: more TrainingArguments (``use_cpu=False`` on GPUs)."""
    import torch.distributed as dist

    import loongforge_hf as lf
    from tests.trainer._train_parity import make_dataset, training_args

    def arguments(path, **kw):
        return training_args(path, **kw, **(args or {}))

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, pipeline_parallel_size=2)
    rank = dist.get_rank()
    out = Path(out_dir)
    trainer = lf.LoongTrainer(model=model, args=arguments(str(out / "run"), max_steps=1),
                              train_dataset=make_dataset())
    trainer.train()
    results = {"device": str(model.device)}
    for case, (what, fail_rank, _) in SAVE_CASES.items():
        with ExitStack() as stack:
            for patch in (_failing(what) if rank == fail_rank else []):
                stack.enter_context(patch)
            results[case] = _outcome(lambda: trainer._save_checkpoint(trainer.model, trial=None))
        dist.barrier()
        results[case]["left"] = sorted(os.listdir(out / "run")) if (out / "run").is_dir() else []
    results.update(_save_model_cases(trainer, folder, out / "export", rank))
    results["clean_save"] = _outcome(lambda: trainer._save_checkpoint(trainer.model, trial=None))
    dist.barrier()
    results["clean_save"]["left"] = sorted(os.listdir(out / "run"))
    good = out / "run" / "checkpoint-1"
    for case in RESUME_CASES:
        bad = out / f"bad_{case}"
        if rank == 0:
            _corrupt(good, bad, case)
        dist.barrier()
        resumed = lf.LoongTrainer(model=model, args=arguments(str(out / f"resume_{case}"), max_steps=2),
                                  train_dataset=make_dataset())
        results[case] = _outcome(lambda: resumed.train(resume_from_checkpoint=str(bad)))
        dist.barrier()
    return results


def _save_model_cases(trainer, folder: str, export: Path, rank: int) -> dict:
    """save_model with a processing class: its files go in with the weights (one swap); when saving them fails
    (disk full on rank 0) every rank raises and the previous export stays as it was."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.model_max_length = 77  # differs from the source's tokenizer_config.json
    trainer.processing_class = tokenizer
    first = _outcome(lambda: trainer.save_model(str(export)))
    dist.barrier()
    before = {p.name: p.read_bytes() for p in sorted(export.iterdir())}
    with ExitStack() as stack:
        if rank == 0:
            stack.enter_context(mock.patch.object(type(tokenizer), "save_pretrained", _enospc))
        failed = _outcome(lambda: trainer.save_model(str(export)))
    dist.barrier()
    after = {p.name: p.read_bytes() for p in sorted(export.iterdir())}
    trainer.processing_class = None
    return {"save_model": {**first, "max_length": AutoTokenizer.from_pretrained(export).model_max_length,
                           "files": sorted(before)},
            "save_model_tokenizer_fails": {**failed, "unchanged": before == after,
                                           "left": sorted(p.name for p in export.parent.iterdir())}}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_bad")
    folder = make_tiny_checkpoint(tmp / "src", "llama")
    return run_distributed(save_and_resume_cases, 2, str(folder), str(tmp / "out"), timeout=400)


def check_failed_save(results, case):
    rank0, rank1 = (r[case] for r in results)
    assert rank0["type"] == "CheckpointError", rank0
    assert (rank1["type"], rank1["message"]) == (rank0["type"], rank0["message"])
    for fragment in SAVE_CASES[case][2]:
        assert fragment in rank0["message"], (fragment, rank0["message"])
    assert rank0["left"] == [], rank0["left"]  # neither checkpoint-1 nor .checkpoint-1.incomplete


def check_clean_save(results):
    for r in results:
        assert r["clean_save"]["type"] == "no error", r["clean_save"]
        assert r["clean_save"]["left"] == ["checkpoint-1"]


def check_bad_resume(results, case):
    rank0, rank1 = (r[case] for r in results)
    assert rank0["type"] == "CheckpointError", rank0
    assert (rank1["type"], rank1["message"]) == (rank0["type"], rank0["message"])
    for fragment in RESUME_CASES[case]:
        assert fragment in rank0["message"], (fragment, rank0["message"])


@pytest.mark.parametrize("case", list(SAVE_CASES))
def test_failed_checkpoint_write_raises_alike_and_leaves_nothing(results, case):
    check_failed_save(results, case)


def test_clean_save_after_failures(results):
    check_clean_save(results)


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_bad_checkpoint_to_resume_raises_alike_naming_the_file(results, case):
    check_bad_resume(results, case)


def test_save_model_writes_the_processing_class_with_the_weights(results):
    for r in results:
        assert r["save_model"]["type"] == "no error", r["save_model"]
        assert r["save_model"]["max_length"] == 77  # the trainer's tokenizer, not the source's copy
        assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
            r["save_model"]["files"])
    rank0, rank1 = (r["save_model_tokenizer_fails"] for r in results)
    assert rank0["type"] == "CheckpointError" and "could not save the processing class" in rank0["message"] \
        and "No space left on device" in rank0["message"], rank0
    assert (rank1["type"], rank1["message"]) == (rank0["type"], rank0["message"])
    assert rank0["unchanged"]  # the previous export, weights and tokenizer, as it was
    assert "export" in rank0["left"] and not any("incomplete" in n or n.startswith(".") for n in rank0["left"])
