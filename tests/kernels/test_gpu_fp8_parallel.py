"""FP8 in the layouts the single-GPU FP8 tests leave out, for this backend's block-wise recipe and, where it imports,
Transformer Engine's (tensor-wise current scaling and delayed scaling):

- activation recomputation (1 GPU): a recomputed layer quantises again in the backward; the losses follow the run
  without recomputation step for step (TE's delayed scaling must not move its amax history in the second forward);
- pipeline parallelism (PP2, 2 GPUs): each stage's linears run FP8 under megatron's 1F1B schedule; 100 steps end
  within 1% of bf16 PP2 (the criterion of test_gpu_fp8.py), every stage logs the same loss;
- expert parallelism (EP2, 2 GPUs, a Qwen3-MoE model): the block-wise recipe runs the routed experts' grouped GEMMs in
  FP8 too, TE's recipes the attention and the dense layer; 100 steps within 1% of bf16 EP2;
- context parallelism (CP2) and virtual pipeline stages (PP2 x VPP2, interleaved 1F1B), 2 GPUs: as PP2;
- gpt-oss (1 GPU): the attention projections (with their biases) in FP8, the experts (biases, clamped GLU) left in
  bf16 and reported; 100 steps within 1% of bf16.
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

from .test_gpu_fp8 import _batches, _llama
from .test_gpu_fp8_te import _te_imports

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA GPU with block-wise FP8 GEMMs (SM90+)")]

ENV = {"LOONGFORGE_DEVICE": "cuda"}
RECIPES = ["blockwise"] + (["te_tensorwise", "te_delayed"] if _te_imports() else [])
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
# NOTE: with and without recomputation the same FP8 GEMMs see the same operands; only non-deterministic reductions
# (attention backward, atomics) could make the runs differ: on an H200 (2026-11-27) the 30 losses were equal in every
# printed digit for all three recipes. The bound leaves room for such reductions on other GPUs; a recomputed forward
# quantised with other scales than the first one (a delayed-scaling history moved twice) or a layer skipped in the
# recompute is expected far above it (not measured).
RECOMPUTE_TOL = 3e-3


def _moe(folder):
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(folder, "qwen3_moe", tokenizer=False, dtype=torch.bfloat16, vocab_size=2048,
                                hidden_size=512, intermediate_size=1536, moe_intermediate_size=256, head_dim=64,
                                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)


def _train(folder: str, out_dir: str, recipe, steps: int, layout: dict, recompute: bool = False) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, fp8="on" if recipe else None,
                                                    fp8_recipe=recipe, **layout)
    calls = [0]
    first = model.chunks[0].decoder.layers[0].self_attention.linear_qkv
    first.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    if recompute:
        model.activation_checkpointing_enable()
    report = getattr(model.megatron, "fp8", None)
    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=1e-3, weight_decay=0.0,
                                          max_grad_norm=1.0, warmup_steps=10, bf16=True, report_to=[])
    engine = MegatronEngine(model, args=args)
    losses = [engine.train_step(_batches(step, model.device)).loss for step in range(steps)]
    return {"losses": losses, "swapped": sorted(report.swapped) if report else [],
            "skipped": dict(report.skipped) if report else {}, "qkv_calls_per_step": calls[0] / steps}


def _final(losses: list) -> float:
    return sum(losses[-10:]) / 10


def test_fp8_with_activation_recomputation_follows_the_run_without(tmp_path):
    folder = str(_llama(tmp_path / "llama"))
    for recipe in RECIPES:
        [plain] = run_distributed(_train, 1, folder, str(tmp_path / f"plain_{recipe}"), recipe, 30, {},
                                  timeout=600, env=ENV)
        [again] = run_distributed(_train, 1, folder, str(tmp_path / f"recompute_{recipe}"), recipe, 30, {}, True,
                                  timeout=600, env=ENV)
        print(recipe, plain["losses"][::6], again["losses"][::6])
        assert len(plain["swapped"]) == len(again["swapped"]) == 16
        # 4 micro-batches a step: each layer's forward runs once without recomputation, twice with it
        assert plain["qkv_calls_per_step"] == 4 and again["qkv_calls_per_step"] == 8, (plain, again)
        gap = max(abs(a - b) / b for a, b in zip(again["losses"], plain["losses"]))
        assert gap < RECOMPUTE_TOL, (recipe, gap, plain["losses"], again["losses"])
        assert again["losses"][-1] < 0.85 * again["losses"][0]


def _check_layout(tmp_path, folder: str, layout: dict, swapped: dict) -> list:
    bf16 = run_distributed(_train, 2, folder, str(tmp_path / "bf16"), None, 100, layout, timeout=600, env=ENV)
    assert bf16[0]["losses"] == bf16[1]["losses"]  # every rank logs the global loss
    assert bf16[0]["losses"][-1] < 0.75 * bf16[0]["losses"][0], bf16[0]["losses"][::10]
    for recipe in RECIPES:
        on = run_distributed(_train, 2, folder, str(tmp_path / recipe), recipe, 100, layout, timeout=600, env=ENV)
        print(recipe, layout, _final(on[0]["losses"]), _final(bf16[0]["losses"]))
        assert on[0]["losses"] == on[1]["losses"]
        assert [len(r["swapped"]) for r in on] == swapped[recipe.startswith("te_")], [r["swapped"] for r in on]
        final, reference = _final(on[0]["losses"]), _final(bf16[0]["losses"])
        assert abs(final - reference) / reference < 0.01, (recipe, final, reference, on[0]["losses"][::10])
    return bf16[0]["losses"]


# per layout: the checkpoint, and the FP8 layers of each rank for this backend's recipe / TE's
# - PP2: 2 of the 4 layers a stage, each with qkv / proj / fc1 / fc2 in FP8 (both backends);
# - EP2: 4 layers x (qkv, proj) + the dense layer 0's fc1 / fc2 on each rank; the block-wise recipe also runs each MoE
#   layer's local experts (one grouped module a layer) in FP8, TE's recipes leave them in bf16;
# - CP2: every layer on both ranks, each holding half of every sequence.
LAYOUTS = {"pp2": ("llama", {"pipeline_parallel_size": 2}, {False: [8, 8], True: [8, 8]}),
           "ep2": ("moe", {"expert_parallel_size": 2}, {False: [13, 13], True: [10, 10]}),
           "cp2": ("llama", {"context_parallel_size": 2}, {False: [16, 16], True: [16, 16]})}


@two_gpus
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_layout_trains_as_bf16(tmp_path, name):
    model, layout, swapped = LAYOUTS[name]
    folder = (_llama if model == "llama" else _moe)(tmp_path / model)
    _check_layout(tmp_path, str(folder), layout, swapped)


@two_gpus
def test_fp8_virtual_pipeline_stages_train_as_bf16(tmp_path):
    # one layer per virtual stage, two stages a rank
    folder = str(_llama(tmp_path / "llama"))
    interleaved = _check_layout(tmp_path, folder, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2},
                                {False: [8, 8], True: [8, 8]})
    # the interleaved schedule's steady state (4 micro-batches a step) exchanges tensors as plain PP2 does (NCCL
    # here; tests/trainer/test_interleaved_pipeline.py on the CPU backend): bf16 losses equal up to rounding
    plain = run_distributed(_train, 2, folder, str(tmp_path / "pp2"), None, 10, {"pipeline_parallel_size": 2},
                            timeout=600, env=ENV)[0]["losses"]
    assert max(abs(a - b) / b for a, b in zip(interleaved[:10], plain)) < 2e-3, (interleaved[:10], plain)


def _gpt_oss(folder):
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(folder, "gpt_oss", tokenizer=False, dtype=torch.bfloat16, vocab_size=2048,
                                hidden_size=512, intermediate_size=512, head_dim=64, num_attention_heads=8,
                                num_key_value_heads=4, max_position_embeddings=512, sliding_window=64)


def test_gpt_oss_fp8_trains_as_bf16(tmp_path):
    """gpt-oss on one GPU with this backend's block-wise recipe: q/k/v and o (with their biases) of its 4 layers run
    FP8, its experts (biases, the clamped GLU) stay bf16 and are reported; 100 steps end within 1% of bf16."""
    folder = str(_gpt_oss(tmp_path / "gpt_oss"))
    bf16 = run_distributed(_train, 1, folder, str(tmp_path / "bf16"), None, 100, {}, timeout=600, env=ENV)[0]
    assert bf16["losses"][-1] < 0.75 * bf16["losses"][0], bf16["losses"][::10]
    on = run_distributed(_train, 1, folder, str(tmp_path / "fp8"), "blockwise", 100, {}, timeout=600, env=ENV)[0]
    assert len(on["swapped"]) == 8 and all(".self_attention." in n for n in on["swapped"]), on["swapped"]
    assert len(on["skipped"]) == 4 and all("expert biases" in why for why in on["skipped"].values()), on["skipped"]
    final, reference = _final(on["losses"]), _final(bf16["losses"])
    assert abs(final - reference) / reference < 0.01, (final, reference, on["losses"][::10])
