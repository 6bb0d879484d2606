"""``optimizer_precision="model"``: weights, grads and AdamW moments in the model's dtype (bf16 here).

Compared with transformers.Trainer on the same tiny Llama loaded in bf16 (torch AdamW, same TrainingArguments and
batches), and with itself under TP2 / PP2 / DP2 / PP2 x VPP2 and after a resume; a tiny Qwen3-MoE under EP2 (dense
part DP2, experts split over the two ranks) against itself on one rank.

Tolerances (bf16): logged losses within 1e-3 relative (the runs differ by reduction order and where bf16 rounds:
megatron sums per-token losses and scales the grads once per step, Trainer scales each micro-batch's loss; measured
~5e-5). Trained weights: per tensor, the mean absolute difference within 5e-4 and the largest within 2e-2. The largest
is bounded by Adam itself: an element whose gradient is about zero may take an update of the opposite sign in one run,
at most 2 x lr per step, and the four steps' learning rates sum to 1e-2. The mean is what fails if the state is not
bf16: the RMSNorm weights sit near 1.0, where bf16's spacing (3.9e-3 to 7.8e-3) is about an update (lr 5e-3), so in
bf16 most of their updates round away, while fp32 main weights keep them and move those means by ~2.5e-3 (measured).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

LOSS_REL = 1e-3
WEIGHT_MEAN, WEIGHT_MAX = 5e-4, 2e-2


def _args_kw(out_dir: str, **overrides) -> dict:
    kw = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
              learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5,
              logging_steps=1, seed=0, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
              dataloader_drop_last=True)
    kw.update(overrides)
    return kw


def _state_report(trainer) -> dict:
    """What the engine keeps: optimizer classes, the dtypes of params / moments / grad buffers, and whether the torch
    optimizer steps the model's own parameters (no separate main-weight copy)."""
    from megatron.core.optimizer import FP32Optimizer

    engine = trainer.engine
    subs = getattr(engine.optimizer, "chained_optimizers", None) or [engine.optimizer]
    model_params = {id(p) for chunk in trainer.model.megatron.chunks for p in chunk.parameters() if p.requires_grad}
    opt_params = [p for opt in engine.inner_optimizers() for g in opt.param_groups for p in g["params"]]
    return {
        "all_fp32_optimizer": all(isinstance(s, FP32Optimizer) for s in subs),
        "steps_model_params": {id(p) for p in opt_params} == model_params and len(opt_params) == len(model_params),
        "param_dtypes": sorted({str(p.dtype) for p in opt_params}),
        "moment_dtypes": sorted({str(v.dtype) for opt in engine.inner_optimizers() for s in opt.state.values()
                                 for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}),
        "moments_per_param": sorted({sum(k in s for k in ("exp_avg", "exp_avg_sq"))
                                     for opt in engine.inner_optimizers() for s in opt.state.values()}),
        "grad_buffer_dtypes": sorted({str(b.grad_data.dtype) for c in engine.chunks for b in c.buffers}),
    }


def _train_hf(folder: str, out_dir: str) -> list:
    import transformers

    from tests.trainer._train_parity import losses_of, make_dataset

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**_args_kw(out_dir)),
                                   train_dataset=make_dataset())
    trainer.train()
    trainer.save_model(out_dir + "/final")
    return losses_of(trainer.state.log_history)


def _train_loong(folder: str, out_dir: str, layout: dict, **overrides) -> tuple:
    import loongforge_hf as lf
    from tests.trainer._train_parity import losses_of, make_dataset, stop_after_callback

    stop_after = overrides.pop("stop_after", None)
    resume = overrides.pop("resume", None)
    n = overrides.pop("n", 16)

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **layout)
    args = lf.LoongTrainingArguments(**_args_kw(out_dir, optimizer_precision="model", **overrides))
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=make_dataset(n=n),
                              callbacks=[stop_after_callback(stop_after)])
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(out_dir + "/final")
    steps = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return losses_of(trainer.state.log_history), steps, _state_report(trainer)


RESUME_KW = dict(max_steps=6, save_strategy="steps", save_steps=3, gradient_accumulation_steps=1, n=24)


def _one_rank(folder: str, moe_folder: str, out_dir: str) -> dict:
    """transformers.Trainer in bf16, then LoongTrainer "model" on one rank (the Llama and the MoE)."""
    return {"hf": _train_hf(folder, f"{out_dir}/hf"), "tp1": _train_loong(folder, f"{out_dir}/tp1", {}),
            "moe": _train_loong(moe_folder, f"{out_dir}/moe", {})}


# layouts of the two-rank "model" runs: (checkpoint, layout), compared with the same checkpoint's one-rank run
LAYOUTS = {"tp2": ("tp1", {"tensor_parallel_size": 2}), "pp2": ("tp1", {"pipeline_parallel_size": 2}),
           "dp2": ("tp1", {}), "pp2vpp2": ("tp1", {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}),
           "moe_ep2": ("moe", {"expert_parallel_size": 2})}


def _two_ranks(folder: str, moe_folder: str, out_dir: str) -> dict:
    """The LAYOUTS "model" runs (the same global batches as one rank); then a TP2 run with checkpoints, killed after 3
    steps and resumed."""
    out = {}
    for name, (ref, layout) in LAYOUTS.items():
        # NOTE: DP2 (and EP2, whose dense part is DP2) takes one sample per rank and micro-batch: the global batch of
        # a step is the same 4 samples.
        dp2 = layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1) == 1
        out[name] = _train_loong(moe_folder if ref == "moe" else folder, f"{out_dir}/{name}", layout,
                                 **({"per_device_train_batch_size": 1} if dp2 else {}))
    tp2 = LAYOUTS["tp2"][1]
    out["full"] = _train_loong(folder, f"{out_dir}/full", tp2, **RESUME_KW)
    out["killed"] = _train_loong(folder, f"{out_dir}/resumed", tp2, stop_after=3, **RESUME_KW)
    out["resumed"] = _train_loong(folder, f"{out_dir}/resumed", tp2, resume=f"{out_dir}/resumed/checkpoint-3",
                                  **RESUME_KW)
    return out


def _weights(folder: Path) -> dict:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_weights_close(got_dir: Path, ref_dir: Path) -> None:
    a, b = _weights(ref_dir), _weights(got_dir)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.bfloat16, name
        diff = (a[name].float() - b[name].float()).abs()
        assert diff.mean() <= WEIGHT_MEAN and diff.max() <= WEIGHT_MAX, (name, float(diff.mean()), float(diff.max()))


def _assert_model_precision_state(report: dict) -> None:
    assert report["all_fp32_optimizer"], report          # megatron's non-mixed optimizer, no main-weight copies
    assert report["steps_model_params"], report          # torch AdamW steps the model's own (bf16) parameters
    assert report["param_dtypes"] == ["torch.bfloat16"], report
    assert report["moment_dtypes"] == ["torch.bfloat16"], report
    assert report["moments_per_param"] == [2], report    # every parameter has its two moments
    assert report["grad_buffer_dtypes"] == ["torch.bfloat16"], report


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("optim_precision")
    src = make_tiny_checkpoint(tmp / "src", "llama")
    moe = make_tiny_checkpoint(tmp / "moe", "qwen3_moe")
    one = run_distributed(_one_rank, 1, str(src), str(moe), str(tmp / "one"), timeout=300)[0]
    two = run_distributed(_two_ranks, 2, str(src), str(moe), str(tmp / "two"), timeout=400)
    return tmp, one, two


def test_model_precision_matches_transformers_trainer_bf16(runs):
    tmp, one, _ = runs
    losses, _, report = one["tp1"]
    assert len(losses) == len(one["hf"]) == 4
    assert losses == pytest.approx(one["hf"], rel=LOSS_REL)
    _assert_model_precision_state(report)
    _assert_weights_close(tmp / "one" / "tp1" / "final", tmp / "one" / "hf" / "final")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_precision_layouts_match_one_rank(runs, layout):
    tmp, one, two = runs
    ref = LAYOUTS[layout][0]
    _assert_model_precision_state(one[ref][2])
    for rank in two:
        losses, _, report = rank[layout]
        assert losses == two[0][layout][0]  # every rank logs the same global loss
        assert losses == pytest.approx(one[ref][0], rel=LOSS_REL), (layout, losses, one[ref][0])
        _assert_model_precision_state(report)
    _assert_weights_close(tmp / "two" / layout / "final", tmp / "one" / ref / "final")


def test_model_precision_resume_continues_the_same_losses(runs):
    tmp, _, two = runs
    full = dict(two[0]["full"][1])
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in two[0]["killed"][1]] == [1, 2, 3]
    assert (tmp / "two" / "resumed" / "checkpoint-3" / "megatron").is_dir()
    resumed = dict(two[0]["resumed"][1])
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), (step, resumed[step], full[step])
    _assert_model_precision_state(two[0]["resumed"][2])
    for name, t in _weights(tmp / "two" / "full" / "final").items():
        torch.testing.assert_close(_weights(tmp / "two" / "resumed" / "final")[name], t, rtol=0, atol=0, msg=name)


def test_bad_optimizer_precision_is_refused(tmp_path):
    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    with pytest.raises(ValueError, match="optimizer_precision must be one of 'fp32', 'model', got 'bf16'"):
        lf.LoongTrainingArguments(output_dir=str(tmp_path), optimizer_precision="bf16", use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="optimizer_precision must be one of 'fp32', 'model', got 'fp16'"):
        MegatronEngine(model=None, args=None, optimizer_precision="fp16")
    with pytest.raises(ValueError, match="adamw_kernel must be one of 'torch', 'triton', got 'apex'"):
        lf.LoongTrainingArguments(output_dir=str(tmp_path), adamw_kernel="apex", use_cpu=True, report_to=[])


def _with_fused_adam_installed(folder: str, out_dir: str) -> dict:
    """megatron's optimizer module as it is where Transformer Engine or Apex imports (it then builds their FusedAdam,
    megatron-core 0.16.1 optimizer/__init__.py:12-34): the engine still steps torch's AdamW, moments in bf16."""
    import megatron.core.optimizer as megatron_optimizer
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    class FusedAdamStandIn(torch.optim.Adam):  # takes the FusedAdam-only keyword megatron passes to it
        def __init__(self, params, adam_w_mode=True, **kwargs):
            super().__init__(params, **kwargs)

    megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER = FusedAdamStandIn, False
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    args = transformers.TrainingArguments(out_dir, use_cpu=True, learning_rate=1e-3, report_to=[])
    engine = MegatronEngine(model, args=args, optimizer_precision="model")
    ids = torch.randint(4, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    engine.train_step([{"input_ids": ids, "labels": ids}])
    return {"types": sorted({type(o).__name__ for o in engine.inner_optimizers()}),
            "moment_dtypes": sorted({str(v.dtype) for o in engine.inner_optimizers() for s in o.state.values()
                                     for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}),
            "flag_restored": megatron_optimizer.USING_PYTORCH_OPTIMIZER is False}


def test_engine_builds_torch_adamw_where_te_or_apex_is_installed(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "llama")
    [result] = run_distributed(_with_fused_adam_installed, 1, str(src), str(tmp_path / "out"), timeout=300)
    assert result == {"types": ["AdamW"], "moment_dtypes": ["torch.bfloat16"], "flag_restored": True}, result
