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

from ._arguments_parity import data_parallel_cases
from ._train_parity import (both, dropout_seed_runs, eval_predict_run, refused_arguments, train_hf, train_loong,
                            warnings_and_cache_clears)

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
    """Ragged prompts and evaluation in batches of 2 rows a rank: the ranks hold different numbers of label tokens,
    and eval_loss is Trainer's (each step's loss over both ranks' tokens, not the mean of each rank's mean: those
    differ by ~2e-4 here), within 1e-5."""
    src = make_tiny_checkpoint(tmp_path / "src", "llama")
    kw, data = {"per_device_eval_batch_size": 2}, {"ragged": True}
    ref = run_distributed(train_hf, 2, str(src), str(tmp_path / "hf"), kw, data, timeout=300)
    got = run_distributed(train_loong, 2, str(src), str(tmp_path / "lf"), {}, kw, data, timeout=300)
    assert_close_runs(ref[0], tmp_path / "hf" / "final", got[0], tmp_path / "lf" / "final")
    assert got[0]["losses"][4] == pytest.approx(ref[0][4], rel=1e-5)


def test_load_best_model_at_end_matches_transformers_trainer(single_process_reference, tmp_path):
    """Evaluation and a checkpoint every step, one kept: the best (step 1) survives the rotation and is reloaded at
    the end (megatron state from its checkpoint), as transformers.Trainer does; final weights within 1e-4."""
    src = single_process_reference[0]
    runs = run_distributed(both, 1, "best_model_run", str(src), str(tmp_path), timeout=300)[0]
    hf, lf = runs["hf"], runs["lf"]
    assert lf["evals"] == pytest.approx(hf["evals"], rel=1e-3)
    assert (lf["best_step"], lf["best"], lf["kept"]) == (hf["best_step"], hf["best"], hf["kept"])
    assert hf["best_step"] != 3  # the run must reload an earlier step for this test to tell anything
    assert lf["eval_after"] == pytest.approx(hf["eval_after"], rel=1e-4)
    a, b = weights(tmp_path / "hf" / "final"), weights(tmp_path / "lf" / "final")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-4, msg=name)


def test_arguments_loong_trainer_cannot_honour_are_refused(single_process_reference, tmp_path):
    src = single_process_reference[0]
    out = run_distributed(refused_arguments, 1, str(src), str(tmp_path), timeout=300)[0]
    assert out.pop("accepted") is None
    for name, message in out.items():
        assert message is not None and "LoongTrainer does not support" in message, (name, message)
    assert "optim='sgd'" in out["optim"]
    assert "bf16_full_eval with a model in torch.float32" in out["bf16_full_eval"]


def test_settings_without_effect_warn_and_empty_cache_steps_apply(single_process_reference, tmp_path):
    """bf16=True on a float32 model (no autocast here) and torch_compile=True warn instead of passing silently;
    torch_empty_cache_steps=1 empties the device cache at each of the 2 steps, as Trainer does."""
    out = run_distributed(warnings_and_cache_clears, 1, str(single_process_reference[0]), str(tmp_path),
                          timeout=300)[0]
    assert any("bf16=True with a float32 model" in w for w in out["warnings"]), out["warnings"]
    assert any("torch_compile=True has no effect" in w for w in out["warnings"]), out["warnings"]
    assert out["clears"] == 2


def test_training_seed_reaches_megatron_dropout(tmp_path):
    """TrainingArguments.seed seeds megatron's model-parallel RNG streams (attention dropout): other seed, other
    losses; same seed, same losses. Also: the step callbacks fire in transformers.Trainer's order, on_substep_end
    after each micro-batch but a step's last (gradient accumulation 2) and on_pre_optimizer_step before the update."""
    src = make_tiny_checkpoint(tmp_path / "src", "qwen2", tokenizer=False, attention_dropout=0.3)
    out = run_distributed(dropout_seed_runs, 1, str(src), str(tmp_path), [0, 0, 1], timeout=300)[0]
    runs = out["runs"]
    assert runs[0]["losses"] == runs[1]["losses"]
    assert runs[0]["losses"] != runs[2]["losses"]
    assert runs[0]["events"] == out["trainer_events"]
    assert [e for e, _ in out["trainer_events"][:5]] == [  # the first step (on_step_end sees global_step 1)
        "on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]


def test_logged_values_match_transformers_trainer(single_process_reference, tmp_path):
    """include_num_input_tokens_seen="non_padding", the epoch fraction with a partial last accumulation window,
    grad_norm logged without clipping (max_grad_norm=0), total_flos counted; losses and norms within 1e-3."""
    src = single_process_reference[0]
    runs = run_distributed(both, 1, "logging_run", str(src), str(tmp_path), timeout=300)[0]
    hf, lf = runs["hf"], runs["lf"]
    assert lf["loss"] == pytest.approx(hf["loss"], rel=1e-3)
    assert None not in lf["grad_norm"] and lf["grad_norm"] == pytest.approx(hf["grad_norm"], rel=1e-3)
    assert lf["epoch"] == pytest.approx(hf["epoch"], abs=1e-9) and len(hf["epoch"]) == 8
    assert lf["num_input_tokens_seen"] == hf["num_input_tokens_seen"]
    assert lf["total_flos"] > 0 and hf["total_flos"] > 0


def test_dp2_packed_tokens_seen_match_transformers_trainer(single_process_reference, tmp_path):
    """DP2 with padding-free packing: num_input_tokens_seen ("all") sums each rank's own tokens, as
    transformers.Trainer on two processes does (it was this rank's count times two: 228 for 235); losses within
    1e-5."""
    src = single_process_reference[0]
    runs = run_distributed(both, 2, "packed_tokens_run", str(src), str(tmp_path), timeout=300)[0]
    hf, lf = runs["hf"], runs["lf"]
    assert len(lf["loss"]) == len(hf["loss"]) and lf["loss"] == pytest.approx(hf["loss"], rel=1e-5)
    assert lf["tokens"] == hf["tokens"]


@pytest.mark.parametrize("layout_name", ["tp1", "tp2", "pp2", "dp2"])
def test_evaluate_and_predict_match_transformers_trainer(single_process_reference, tmp_path, layout_name):
    """evaluate() with compute_metrics (logits, labels, inputs, losses) and predict() on 7 rows in batches of 3: under
    TP2 / PP2 (one data-parallel rank) every rank gets each row once, as transformers.Trainer on one process (the
    gather went over all processes: every row twice), and the last batch's one row keeps its logits (megatron's
    cross-entropy worked in place on them); logits within 1e-5, metrics within 1e-6, the same steps per second."""
    src = single_process_reference[0]
    # dp2: two data-parallel ranks against transformers.Trainer on two processes (rows split and gathered back)
    nprocs, layout = LAYOUTS[layout_name] if layout_name != "dp2" else (2, {})
    ref = run_distributed(eval_predict_run, 1 if layout_name != "dp2" else 2, "hf", str(src), str(tmp_path / "hf"),
                          timeout=300)[0]
    got = run_distributed(eval_predict_run, nprocs, "lf", str(src), str(tmp_path / "lf"), layout, timeout=300)
    for r in got:
        assert r["metrics"].keys() == ref["metrics"].keys() and r["metrics"]["eval_rows"] == 7
        # eval_steps_per_second / test_steps_per_second count the loop's steps of eval_batch_size rows per
        # data-parallel rank, as Trainer counts them (it divided by eval_batch_size x processes: 2 steps under TP2)
        assert r["metrics"]["eval_loop_steps"] == r["metrics"]["logged_loop_steps"] == r["test_metrics"][
            "test_loop_steps"] == (3 if layout_name != "dp2" else 2)
        assert r["metrics"] == pytest.approx(ref["metrics"], rel=1e-6)
        assert r["test_metrics"] == pytest.approx(ref["test_metrics"], rel=1e-6)
        for key in ("predictions", "label_ids", "inputs", "losses"):
            assert r["seen"][key].shape == ref["seen"][key].shape, key
        torch.testing.assert_close(torch.from_numpy(r["seen"]["predictions"]),
                                   torch.from_numpy(ref["seen"]["predictions"]), rtol=1e-5, atol=1e-5)
        assert (r["seen"]["label_ids"] == ref["seen"]["label_ids"]).all()
        assert (r["seen"]["inputs"] == ref["seen"]["inputs"]).all()
        torch.testing.assert_close(torch.from_numpy(r["seen"]["losses"]), torch.from_numpy(ref["seen"]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for key in ("predictions", "unlabelled"):
            assert r[key].shape == ref[key].shape, key
            torch.testing.assert_close(torch.from_numpy(r[key]), torch.from_numpy(ref[key]), rtol=1e-5, atol=1e-5)
        assert (r["label_ids"] == ref["label_ids"]).all()


def test_dp2_training_arguments_match_transformers_trainer(single_process_reference, tmp_path):
    """DP2, one world. accelerator_config: split_batches (each rank 1 of a batch's 2 rows, 4 steps),
    even_batches=False (7 rows: the last rank's last batch 1 row; evaluation gathers the uneven batches into
    Trainer's eval_loss) and use_seedable_sampler=False (another order) train as transformers.Trainer on two
    processes, losses within 1e-5; what the data-parallel ranks cannot honour is refused. The DataLoader arguments
    reach the DataLoaders (also the balanced one of a packing collator). ddp_timeout (default 1800 s, as transformers)
    is set on the default and megatron's groups, and a gloo collective fails after it. A second LoongTrainer on the
    same model trains as a second transformers.Trainer does (megatron's DDP hooks of the first run asserted), the
    first trains again after it, and a dropped trainer's gradient buffer is freed."""
    src = single_process_reference[0]
    ranks = run_distributed(data_parallel_cases, 2, str(src), str(tmp_path), timeout=300)
    for rank, got in enumerate(ranks):
        runs = got["accelerator_config"]
        for name, hf in runs["hf"].items():
            lf = runs["lf"][name]
            assert (lf["rows"], lf["steps"]) == (hf["rows"], hf["steps"]), (name, lf, hf)
            assert lf["losses"] == pytest.approx(hf["losses"], rel=1e-5), name
        assert runs["hf"]["split_batches"]["rows"] == [1] * 8
        assert runs["hf"]["even_batches_off"]["rows"] == [[2, 2], [2, 1]][rank]
        assert runs["hf"]["seedable_off"]["losses"] != pytest.approx(runs["hf"]["default"]["losses"], rel=1e-5)
        even = runs["lf"]["even_batches_off"]
        assert even["eval_loss"] == pytest.approx(even["eval_loss_trainer"], rel=1e-6)

        refused = got["refused"]
        assert "give the 2 data-parallel ranks [2, 1] batches" in refused["uneven_shards"]
        assert "[3, 2] batches" in refused["uneven_split"]
        assert "must be a multiple of 2" in refused["split_indivisible"]

        loaders = got["dataloader"]
        assert loaders["lf"] == {**loaders["hf"], "balanced": "BalancedDataLoader"}
        assert loaders["hf"]["train"] == {"prefetch_factor": 7, "pin_memory": True, "in_order": False,
                                          "persistent_workers": True, "num_workers": 2, "context": "spawn"}
        assert loaders["lf"]["packed"] == loaders["hf"]["train"] and loaders["lf"]["eval_kept"]

        two = got["two_trainers"]
        # the first trainer trains again after the second with its own AdamW state (moments, step count), as Trainer
        for key in ("first", "second", "first_again"):
            assert two["lf"][key] == pytest.approx(two["hf"][key], rel=1e-5), key
        assert len(two["lf"]["first_again"]) == 2 and two["lf"]["second_buffer_freed"]
        assert two["lf"]["final_loss"] == pytest.approx(two["hf"]["final_loss"], rel=1e-5)

        assert got["ddp_timeout"] == {"loaded": dict.fromkeys(("default", "data_parallel", "tensor_parallel"), 1800.0),
                                      "trainer": dict.fromkeys(("default", "data_parallel", "tensor_parallel"), 7200.0)}
        assert set(got["short_timeout"]["timeouts"].values()) == {1.0}
    short = ranks[0]["short_timeout"]  # rank 1 joined 3 s late
    assert "Timed out" in short["error"] and short["waited"] < 2.5, short
