"""Transformer Engine FP8 recipes on the GPU (``fp8_recipe="te_..."``, kernels/fp8_te.py): the model is built with TE's
linears in the attention and MLP slots and trains under megatron's FP8 context; 200 steps of each recipe the GPU runs
end within 1% of bf16's final loss (the criterion of test_gpu_fp8.py's own recipes), logits differ from bf16's by no
more than this backend's own block-wise FP8 does (x1.3), the exported checkpoint is the source bit for bit, a MoE
model keeps its routed experts in bf16, and a recipe the GPU cannot run (MXFP8 before compute capability 10.0) is
refused before anything is built; TE's linears accumulate their weight gradients into megatron's main_grad inside the
GEMM (the engine's fused_wgrad) and train as with the separate add; on 2 GPUs, TP2 with sequence parallelism trains as
bf16 does (1%).

Skipped where Transformer Engine does not import (it is optional; docs/fp8.md)."""

import importlib.util

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

from .test_gpu_fp8 import _batches, _llama, _rel, _train


def _te_imports() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU with FP8 tensor cores"),
              pytest.mark.skipif(not _te_imports(), reason="Transformer Engine is not installed")]

ENV = {"LOONGFORGE_DEVICE": "cuda"}
# NOTE: FP8 logits of the 4-layer random-weight model differ from bf16's by ~11% under either backend (H100,
# 2026-11-27: this backend's blockwise 0.106; TE tensorwise 0.107, blockwise 0.111, delayed 0.129), so TE's are
# held to this backend's own error on the same model; a wrong scale or a layer left out is far outside that.
LOGIT_VS_OURS = 1.3
# the whole gradient of the MoE model (every parameter's concatenated) against bf16's; measured 0.12-0.15
MOE_GRAD_TOL = 0.2


def _runnable_recipes() -> list[str]:
    from loongforge_hf.kernels.fp8_te import TE_RECIPES, _te_support

    return [r for r in TE_RECIPES if _te_support(r)[0]]


def test_te_recipes_train_within_one_percent_of_bf16(tmp_path):
    folder = str(_llama(tmp_path / "llama"))
    [bf16] = run_distributed(_train, 1, folder, str(tmp_path / "o1"), None, 200, timeout=600, env=ENV)
    final_bf16 = sum(bf16["losses"][-10:]) / 10
    assert bf16["losses"][-1] < 0.75 * bf16["losses"][0], bf16["losses"][::20]
    recipes = _runnable_recipes()
    assert {"te_delayed", "te_tensorwise"} <= set(recipes)  # any FP8 GPU runs these two
    for recipe in recipes:
        [on] = run_distributed(_train, 1, folder, str(tmp_path / f"o_{recipe}"), "on", 200, recipe, timeout=600,
                               env=ENV)
        assert on["swapped"] == 16  # 4 layers x (qkv, proj, fc1, fc2) are TE linears
        final = sum(on["losses"][-10:]) / 10
        print(recipe, final, final_bf16)
        assert abs(final - final_bf16) / final_bf16 < 0.01, (recipe, final, final_bf16, on["losses"][::20])


def _logits_and_export(folder: str, out: str, moe_folder: str, recipe: str) -> dict:
    import loongforge_hf as lf
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    from loongforge_hf.testing.round_trip import read_all

    batch = _batches(0, torch.device("cuda"))[0]
    ref = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        ref_logits = ref(input_ids=batch["input_ids"]).logits
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, fp8="on", fp8_recipe=recipe)
    layer = model.chunks[0].decoder.layers[0]
    result = {"types": [type(layer.self_attention.linear_qkv) is TEColumnParallelLinear,
                        type(layer.self_attention.linear_proj) is TERowParallelLinear,
                        type(layer.mlp.linear_fc1) is TEColumnParallelLinear,
                        type(layer.mlp.linear_fc2) is TERowParallelLinear],
              "report": (model.megatron.fp8.mode, model.megatron.fp8.recipe, len(model.megatron.fp8.swapped))}
    with torch.no_grad():
        # NOTE: delayed scaling quantises with scales from earlier passes' amax history (none yet on the first pass,
        # which runs at scale 1): one pass first, as in training, where every step but the first has a history.
        model(input_ids=batch["input_ids"])
        result["logit_rel"] = _rel(model(input_ids=batch["input_ids"]).logits, ref_logits)
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, fp8="on", fp8_recipe="blockwise")
    with torch.no_grad():
        result["ours_logit_rel"] = _rel(ours(input_ids=batch["input_ids"]).logits, ref_logits)
    del ours
    model.save_pretrained(out)
    src, exported = read_all(folder), read_all(out)
    result["export_keys_equal"] = sorted(src) == sorted(exported)
    result["export_bit_equal"] = all(torch.equal(src[k], exported[k]) for k in src if k in exported)

    # MoE: attention and the dense first layer's MLP in TE, routed experts in bf16; loss and gradients against bf16
    moe_ref = lf.AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.bfloat16)
    moe = lf.AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.bfloat16, fp8="on", fp8_recipe=recipe)
    result["moe_swapped"] = moe.megatron.fp8.swapped
    losses, grads = [], []
    for m in (moe_ref, moe):
        for _ in range(2):  # the second pass is compared (delayed scaling's history, as above)
            m.zero_grad(set_to_none=True)
            out_ = m(input_ids=batch["input_ids"], labels=batch["input_ids"])
            out_.loss.backward()
        losses.append(out_.loss.item())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    result["moe_losses"] = losses
    names = sorted(grads[0])
    result["moe_grad_rel"] = _rel(torch.cat([grads[1][n].flatten().float() for n in names if n in grads[1]]),
                                  torch.cat([grads[0][n].flatten().float() for n in names]))
    result["moe_grads_finite"] = all(bool(torch.isfinite(g).all()) for g in grads[1].values())
    result["moe_grad_names_equal"] = sorted(grads[0]) == sorted(grads[1])
    return result


def test_te_logits_export_and_moe(tmp_path):
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = str(_llama(tmp_path / "llama"))
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", tokenizer=False, dtype=torch.bfloat16, vocab_size=2048,
                               hidden_size=256, intermediate_size=512, moe_intermediate_size=128, head_dim=64,
                               max_position_embeddings=512)
    results = {recipe: run_distributed(_logits_and_export, 1, folder, str(tmp_path / f"export_{recipe}"), str(moe),
                                       recipe, timeout=600, env=ENV)[0] for recipe in _runnable_recipes()}
    for recipe, r in results.items():
        print(recipe, r["logit_rel"], r["ours_logit_rel"], r["moe_losses"], r["moe_grad_rel"])
    for recipe, r in results.items():
        assert all(r["types"]), r["types"]
        assert r["report"] == ("on", recipe, 16)
        assert r["ours_logit_rel"] < 0.2 and r["logit_rel"] < LOGIT_VS_OURS * r["ours_logit_rel"], r
        assert r["export_keys_equal"] and r["export_bit_equal"]
        # 4 layers x (qkv, proj) + the dense layer 0's fc1 / fc2; no expert
        assert len(r["moe_swapped"]) == 10 and not any("experts" in n for n in r["moe_swapped"]), r["moe_swapped"]
        ref_loss, loss = r["moe_losses"]
        assert abs(loss - ref_loss) / ref_loss < 0.01, r["moe_losses"]
        assert r["moe_grads_finite"] and r["moe_grad_names_equal"]
        assert r["moe_grad_rel"] < MOE_GRAD_TOL, r["moe_grad_rel"]


def _refused(folder: str, recipe: str) -> str:
    import loongforge_hf as lf
    from loongforge_hf.kernels.fp8 import Fp8Error

    try:
        lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, fp8="on", fp8_recipe=recipe)
    except Fp8Error as err:
        return str(err)
    return ""


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0),
                    reason="MXFP8 runs on this GPU")
def test_mxfp8_refused_before_hopper(tmp_path):
    folder = str(_llama(tmp_path / "llama"))
    [message] = run_distributed(_refused, 1, folder, "te_mxfp8", timeout=300, env=ENV)
    assert "does not run on this GPU" in message and "10.0" in message, message


def _train_tp2(folder: str, out_dir: str, recipe, steps: int) -> list:
    """TP2 with sequence parallelism: TE's linears split and communicating as megatron's local ones do."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, tensor_parallel_size=2,
                                                    sequence_parallel=True, fp8="on" if recipe else None,
                                                    fp8_recipe=recipe)
    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=1e-3, weight_decay=0.0,
                                          max_grad_norm=1.0, warmup_steps=10, bf16=True, report_to=[])
    engine = MegatronEngine(model, args=args)
    return [engine.train_step(_batches(step, model.device)).loss for step in range(steps)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_te_tensor_parallel_with_sequence_parallel_trains_as_bf16(tmp_path):
    folder = str(_llama(tmp_path / "llama"))
    bf16 = run_distributed(_train_tp2, 2, folder, str(tmp_path / "bf16"), None, 100, timeout=600, env=ENV)
    assert bf16[0] == bf16[1]  # every rank logs the same global loss
    final_bf16 = sum(bf16[0][-10:]) / 10
    for recipe in ("te_tensorwise", "te_delayed"):
        on = run_distributed(_train_tp2, 2, folder, str(tmp_path / recipe), recipe, 100, timeout=600, env=ENV)
        final = sum(on[0][-10:]) / 10
        print(recipe, final, final_bf16)
        assert on[0] == on[1]
        assert abs(final - final_bf16) / final_bf16 < 0.01, (recipe, final, final_bf16, on[0][::10])


def _train_wgrad(folder: str, out_dir: str, recipe: str, steps: int, fused: bool) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, fp8="on", fp8_recipe=recipe)
    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=1e-3, weight_decay=0.0,
                                          max_grad_norm=1.0, warmup_steps=10, bf16=True, report_to=[])
    engine = MegatronEngine(model, args=args, optimizer_precision="model", fused_wgrad=fused)
    te = [m for c in model.chunks for m in c.modules() if hasattr(m, "fuse_wgrad_accumulation")]
    losses = [engine.train_step(_batches(step, model.device)).loss for step in range(steps)]
    # DDP clears the flag when it zeroes the buffers; TE's fused backward sets it (and DDP's hook then skips its add)
    return {"losses": losses, "te_fused": sum(bool(m.fuse_wgrad_accumulation) for m in te),
            "added_by_te": sum(bool(m.weight.grad_added_to_main_grad) for m in te)}


@pytest.mark.parametrize("recipe", ["te_tensorwise", "te_delayed"])
def test_te_weight_gradients_accumulate_into_main_grad(tmp_path, recipe):
    """The engine switches TE's fuse_wgrad_accumulation on (16 linears) and the run follows the unfused one (the same
    GEMMs; into the bf16 buffer the fused sum rounds once per micro-batch, the unfused twice: GEMM, then add)."""
    folder = str(_llama(tmp_path / "llama"))
    [fused] = run_distributed(_train_wgrad, 1, folder, str(tmp_path / "fused"), recipe, 30, True, timeout=600,
                              env=ENV)
    [plain] = run_distributed(_train_wgrad, 1, folder, str(tmp_path / "plain"), recipe, 30, False, timeout=600,
                              env=ENV)
    print(recipe, fused["losses"][::6], plain["losses"][::6])
    assert (fused["te_fused"], fused["added_by_te"]) == (16, 16) and (plain["te_fused"], plain["added_by_te"]) == (0, 0)
    assert fused["losses"][0] == plain["losses"][0]  # the first forward precedes any weight gradient
    gap = max(abs(a - b) / b for a, b in zip(fused["losses"], plain["losses"]))
    assert gap < 3e-3, (recipe, gap, fused["losses"], plain["losses"])
