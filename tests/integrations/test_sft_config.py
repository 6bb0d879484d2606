"""``LoongSFTConfig``: trl's SFTConfig plus LoongTrainer's knobs, reaching the engine through LoongSFTTrainer.

One process trains the tiny Llama loaded in bf16 for 3 steps of full fine-tuning on the text scenario of
``_sft_parity`` three times: trl.SFTTrainer on the transformers model (torch AdamW on the bf16 parameters), then
LoongSFTTrainer with ``LoongSFTConfig(optimizer_precision="model")``, then LoongSFTTrainer given a
``LoongTrainingArguments`` with the same values (turned into a LoongSFTConfig, its knobs kept).

Tolerances are those of tests/trainer/test_optimizer_precision.py (bf16): logged losses within 1e-3 relative;
trained weights per tensor within 5e-4 in mean absolute difference and 2e-2 at most (the three steps' learning rates
sum to 1e-2, the same bound on an opposite-sign Adam update as there). The two Loong runs take the same path, so they
must agree exactly.
"""

from __future__ import annotations

import re

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from tests.trainer.test_optimizer_precision import (LOSS_REL, _assert_model_precision_state, _assert_weights_close,
                                                    _state_report)

from ._sft_parity import _tokenizer, make_dataset

LOONG_KNOBS = dict(optimizer_precision="model", dp_load_balance=False, dp_balance_refit=True,
                   dp_balance_refit_steps=3, adamw_kernel="triton")


def _kw(out_dir: str) -> dict:
    """The SFTConfig values of ``_sft_parity.sft_config`` (3 steps, lr 5e-3 linear, clipping, weight decay)."""
    return dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.1, max_grad_norm=0.5,
                logging_steps=1, seed=0, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                disable_tqdm=True, dataloader_drop_last=True, max_length=32, gradient_checkpointing=False)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _world(folder: str, out_dir: str) -> dict:
    import transformers
    import trl

    import loongforge_hf as lf

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ref = trl.SFTTrainer(model=model, args=trl.SFTConfig(**_kw(f"{out_dir}/trl")), train_dataset=make_dataset("text"),
                         processing_class=_tokenizer(folder))
    ref.train()
    ref.save_model(f"{out_dir}/trl/final")
    out = {"trl": _losses(ref)}

    configs = {"sft_config": lf.LoongSFTConfig(**_kw(f"{out_dir}/sft_config"), **LOONG_KNOBS),
               # NOTE: max_length is an SFTConfig field; a LoongTrainingArguments carries the rest (TRL's default
               # max_length 1024 does not truncate these short texts either).
               "training_args": lf.LoongTrainingArguments(
                   **{k: v for k, v in _kw(f"{out_dir}/training_args").items() if k != "max_length"}, **LOONG_KNOBS)}
    for name, args in configs.items():
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=make_dataset("text"),
                                     processing_class=_tokenizer(folder))
        trainer.train()
        trainer.save_model(f"{out_dir}/{name}/final")
        out[name] = {"losses": _losses(trainer), "state": _state_report(trainer),
                     "args_type": type(trainer.args).__name__,
                     "knobs": {k: getattr(trainer.args, k) for k in LOONG_KNOBS},
                     "learning_rate": trainer.args.learning_rate,
                     "engine_precision": trainer.engine.optimizer_precision,
                     "adamw": sorted({type(o).__name__ for o in trainer.engine.inner_optimizers()})}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft-config")
    src = make_tiny_checkpoint(tmp / "src", "llama")
    return tmp, run_distributed(_world, 1, str(src), str(tmp / "runs"), timeout=300)[0]


def test_model_precision_sft_config_matches_trl_bf16(runs):
    tmp, out = runs
    got = out["sft_config"]
    assert got["args_type"] == "LoongSFTConfig"
    assert got["engine_precision"] == "model" and got["adamw"] == ["LoongAdamW"]
    _assert_model_precision_state(got["state"])  # bf16 params, moments and grads; AdamW steps the model's params
    assert len(got["losses"]) == len(out["trl"]) == 3
    assert got["losses"] == pytest.approx(out["trl"], rel=LOSS_REL), (got["losses"], out["trl"])
    _assert_weights_close(tmp / "runs" / "sft_config" / "final", tmp / "runs" / "trl" / "final")


def test_training_arguments_keep_their_loong_fields(runs):
    tmp, out = runs
    got = out["training_args"]
    assert got["args_type"] == "LoongSFTConfig"
    assert got["knobs"] == LOONG_KNOBS
    assert got["learning_rate"] == 5e-3
    assert got["engine_precision"] == "model" and got["adamw"] == ["LoongAdamW"]
    _assert_model_precision_state(got["state"])
    assert got["losses"] == out["sft_config"]["losses"]


def test_as_sft_config_conversions(tmp_path):
    import transformers
    import trl

    import loongforge_hf as lf
    from loongforge_hf.integrations.trl import LoongSFTConfig, _as_sft_config
    from loongforge_hf.trainer.arguments import LOONG_FIELDS

    assert lf.LoongSFTConfig is LoongSFTConfig and "LoongSFTConfig" in lf.__all__
    assert sorted(LOONG_FIELDS) == sorted(LOONG_KNOBS)
    common = dict(use_cpu=True, report_to=[])
    loong = lf.LoongSFTConfig(str(tmp_path), optimizer_precision="model", max_length=64, **common)
    assert _as_sft_config(loong, None) is loong
    assert isinstance(loong, trl.SFTConfig) and loong.max_length == 64 and loong.learning_rate == 2e-5
    plain = trl.SFTConfig(str(tmp_path), **common)
    assert _as_sft_config(plain, None) is plain
    converted = _as_sft_config(transformers.TrainingArguments(str(tmp_path), learning_rate=3e-4, **common), None)
    assert type(converted) is trl.SFTConfig and converted.learning_rate == 3e-4
    training_args = lf.LoongTrainingArguments(str(tmp_path), learning_rate=3e-4, hub_token="secret", **LOONG_KNOBS,
                                              **common)
    converted = _as_sft_config(training_args, None)
    assert type(converted) is LoongSFTConfig
    assert {k: getattr(converted, k) for k in LOONG_KNOBS} == LOONG_KNOBS
    assert converted.learning_rate == 3e-4 and converted.hub_token == "secret"
    # the help texts are LoongTrainingArguments' own
    parser = transformers.HfArgumentParser(lf.LoongSFTConfig)
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optimizer_precision", "model",
                                                    "--dp_load_balance", "false", "--use_cpu", "true"])
    assert parsed.optimizer_precision == "model" and parsed.dp_load_balance is False
    helps = {a.dest: a.help for a in parser._actions}
    assert "8 bytes per parameter" in helps["optimizer_precision"]


def test_bad_loong_sft_config_is_refused(tmp_path):
    import loongforge_hf as lf

    with pytest.raises(ValueError, match="optimizer_precision must be one of 'fp32', 'model', got 'bf16'"):
        lf.LoongSFTConfig(str(tmp_path), optimizer_precision="bf16", use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="dp_balance_refit_steps must be >= 1, got 0"):
        lf.LoongSFTConfig(str(tmp_path), dp_balance_refit_steps=0, use_cpu=True, report_to=[])


@pytest.mark.parametrize("field, value, message", [
    ("loss_type", "dft", "loss_type='dft'"), ("use_liger_kernel", True, "use_liger_kernel=True"),
    ("activation_offloading", True, "activation_offloading=True")])
def test_sft_settings_the_engine_cannot_honour_are_refused(tmp_path, field, value, message):
    """SFTConfig fields that act in trl.SFTTrainer's compute_loss / training_step, which megatron's schedule never
    runs: refused instead of silently having no effect."""
    import trl

    from loongforge_hf.integrations.trl import _refuse_unsupported

    args = trl.SFTConfig(str(tmp_path), use_cpu=True, report_to=[], bf16=False, **{field: value})
    with pytest.raises(ValueError, match=re.escape(message)):
        _refuse_unsupported(args)


def test_evaluation_forward_gets_every_vision_input():
    """LoongSFTTrainer's evaluation ``compute_loss`` hands the model what its forward takes of a collated image-text
    batch (Idefics3's pixel mask, Gemma 3's token types, LLaVA-OneVision's images per sample among them) and drops
    TRL's other keys."""
    import types

    from loongforge_hf.integrations.trl import LoongSFTTrainer

    seen = {}

    def model(**kwargs):
        seen.update(kwargs)
        return types.SimpleNamespace(logits=None, loss=torch.tensor(1.5), aux_loss=None)

    metrics = {"eval": {"num_tokens": []}}
    trainer = types.SimpleNamespace(model=types.SimpleNamespace(training=False), _metrics=metrics,
                                    _total_train_tokens=7, aux_loss_enabled=False, label_smoother=None)
    vision = {"pixel_values": 1, "pixel_attention_mask": 2, "token_type_ids": 3, "batch_num_images": 4,
              "image_sizes": 5}
    loss = LoongSFTTrainer.compute_loss(trainer, model, {"input_ids": 0, "completion_mask": 9, **vision})
    assert float(loss) == 1.5 and seen == {"input_ids": 0, **vision} and metrics["eval"]["num_tokens"] == [7]
