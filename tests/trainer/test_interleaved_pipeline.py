"""Virtual pipeline stages (megatron's interleaved 1F1B) at PP=2 with more micro-batches than stages, the steady state
the other PP2 x VPP2 tests (2 micro-batches a step) never reach: there the previous and the next stage are one peer,
and megatron-core's default batched p2p paired the activation and the gradient sent to it the wrong way round
(silently: equal shapes). The engine's steps must equal one process's: losses and gradient norms within 1e-5 (fp32;
what differs is where the pipeline splits the reductions). Steps that are not whole groups of PP micro-batches, which
megatron's interleaved schedule refuses mid-schedule, are refused first in the user's terms (engine, LoongTrainer),
and LoongTrainer leaves out an epoch's trailing micro-batches that do not fill a group.
"""

import pytest
import torch

from loongforge_hf.bridges.builder import interleaved_p2p_settings
from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

VPP = {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}
TOL = 1e-5


def _micro_batches(step: int, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(4, 203, (count * 2, 16), generator=g)
    return [{"input_ids": b, "labels": b} for b in ids.split(2)]


def _steps(folder: str, out_dir: str, layout: dict, micro_batches: int) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    refused = None
    if layout:
        try:  # refused on every rank before any collective
            lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    megatron_config={"batch_p2p_comm": True}, **layout)
        except ValueError as err:
            refused = str(err)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=1e-3, weight_decay=0.0, max_grad_norm=1.0,
                                          report_to=[], use_cpu=True)
    engine = MegatronEngine(model, args=args)
    results = [engine.train_step(_micro_batches(step, micro_batches)) for step in range(3)]
    out = {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results], "refused": refused,
           "p2p": (model.megatron.config.overlap_p2p_comm, model.megatron.config.batch_p2p_comm)}
    if layout:
        try:  # a step that is not whole groups of PP micro-batches: said before megatron's schedule starts
            engine.train_step(_micro_batches(9, 3))
        except ValueError as err:
            out["engine_refused"] = str(err)
        out.update(_trainer_windows(folder, out_dir + "/trainer", layout))
    return out


def _trainer_windows(folder: str, out_dir: str, layout: dict) -> dict:
    """LoongTrainer under VPP: gradient_accumulation_steps=1 refused when the trainer is built; an epoch of 5
    micro-batches in windows of 2 trains 2 steps, the last lone micro-batch left out with a warning."""
    import logging

    import loongforge_hf as lf

    from ._train_parity import make_dataset, training_args

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    out = {}
    try:
        lf.LoongTrainer(model=model, args=training_args(out_dir, gradient_accumulation_steps=1),
                        train_dataset=make_dataset(n=10))
    except ValueError as err:
        out["trainer_refused"] = str(err)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("loongforge_hf.trainer.loong_trainer").addHandler(handler)
    args = training_args(out_dir, max_steps=-1, num_train_epochs=1, dataloader_drop_last=False)
    result = lf.LoongTrainer(model=model, args=args, train_dataset=make_dataset(n=10)).train()
    out.update(global_step=result.global_step, warnings=messages)
    return out


def test_interleaved_pipeline_steps_equal_one_process_with_four_micro_batches(tmp_path):
    folder = str(make_tiny_checkpoint(tmp_path / "llama", "llama"))
    [ref] = run_distributed(_steps, 1, folder, str(tmp_path / "one"), {}, 4, timeout=300)
    got = run_distributed(_steps, 2, folder, str(tmp_path / "vpp"), VPP, 4, timeout=300)
    for r in got:
        assert r["p2p"] == (True, False)
        assert "batch_p2p_comm" in r["refused"] and "pipeline_parallel_size=2" in r["refused"], r["refused"]
        assert r["losses"] == pytest.approx(ref["losses"], rel=TOL)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=TOL)
        assert "multiple of pipeline_parallel_size=2" in r["engine_refused"] and "has 3" in r["engine_refused"]
        assert "multiple of pipeline_parallel_size=2" in r["trainer_refused"], r["trainer_refused"]
        assert r["global_step"] == 2
        assert any("last 1 micro-batch(es)" in m for m in r["warnings"]), r["warnings"]


def test_p2p_settings_of_the_interleaved_schedule():
    assert interleaved_p2p_settings(2, {}) == {"overlap_p2p_comm": True, "batch_p2p_comm": False}
    # what megatron_config sets is left to it (and not returned, so it is not passed twice)
    assert interleaved_p2p_settings(2, {"overlap_p2p_comm": False}) == {"batch_p2p_comm": False}
    assert interleaved_p2p_settings(4, {"overlap_p2p_comm": False, "batch_p2p_comm": True}) == {}
    with pytest.raises(ValueError, match="batch_p2p_comm=True with virtual pipeline stages"):
        interleaved_p2p_settings(2, {"overlap_p2p_comm": False, "batch_p2p_comm": True})
    with pytest.raises(ValueError, match="cannot both be True"):
        interleaved_p2p_settings(4, {"batch_p2p_comm": True})
