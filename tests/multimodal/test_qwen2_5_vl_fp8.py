"""Qwen2.5-VL with ``fp8=``: the vision tower's linear layers (qkv, proj, the MLP, the patch merger; not the patch
embedding) and the language model's swapped together, row-wise recipe (the tiny model's widths are multiples of 16,
not of 128). On CPU the FP8 GEMMs are emulated from the same quantised operands, so the numbers below are FP8's
rounding: logits within 6% (relative Frobenius norm) of the bf16-free fp32 model, vision gradients within 15%; with
the swap undone the logits are bit-equal again. ``adaptive`` logs vision and language decisions on their own shapes.
``from_pretrained(fp8=...)`` refuses a CPU process before building anything."""

from pathlib import Path

import pytest

from loongforge_hf.kernels.fp8 import padded_rows
from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

from ._vl_fp8 import fp8_checks, fp8_tensor_parallel_checks

LAYERS = ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_fp8") / "src")


def test_vision_and_language_linears_in_fp8(checkpoint, tmp_path):
    (r,) = run_distributed(fp8_checks, 1, str(checkpoint), str(tmp_path / "fp8_autotune.json"), timeout=300)
    vision = [f"vision.0.blocks.{b}.{layer}" for b in range(2) for layer in LAYERS]
    vision += ["vision.0.merger.mlp.0", "vision.0.merger.mlp.2"]
    language = [f"0.decoder.layers.{i}.{m}" for i in range(4) for m in
                ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert sorted(r["swapped"]) == sorted(vision + language) and r["skipped"] == {}, r["swapped"]
    assert not any("patch_embed" in name for name in r["swapped"])
    # the vision tower's activations went through FP8: its 40 patches (rows padded to the GEMM's multiple of 16),
    # 32 wide (attention), 48 wide (MLP), and the 10 merged tokens 128 wide (merger)
    n = r["vision_tokens"]
    expected = {(padded_rows(n), 32), (padded_rows(n), 48), (padded_rows(n // 4), 128)}
    assert n == 40 and expected <= set(map(tuple, r["quantised"])), r["quantised"]
    assert 0 < r["logit_rel"] < 0.06, r["logit_rel"]
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=0.02)
    assert r["vision_grad_rel"] and all(0 < v < 0.15 for v in r["vision_grad_rel"].values()), r["vision_grad_rel"]
    assert r["disabled_equal"]
    comps = {row[0].split(":")[0] for row in r["adaptive_rows"]}
    assert comps == {"vision", "language"}, r["adaptive_rows"]
    vision_rows = [row for row in r["adaptive_rows"] if row[0].startswith("vision:")]
    # decided per power-of-two bucket of the token count: 40 patches -> 64, 10 merged tokens -> 16
    assert {row[2].split("x")[0] for row in vision_rows if row[1] == "fwd"} == {"64", "16"}
    # NOTE: the decisions are this CPU's timings: emulated FP8 normally loses every forward GEMM (all bf16: the logits
    # bit-equal the model before the swap); a loaded machine can time one the other way, and that layer then runs
    # FP8 (the logits differ). Either way the model runs what its table decided.
    fp8_forward = [row for row in r["adaptive_rows"] if row[1] == "fwd" and row[-1]]
    assert r["adaptive_equal"] == (not fp8_forward), fp8_forward
    assert r["cpu_error"] and "CUDA" in r["cpu_error"]


def test_fp8_with_the_vision_tower_split_over_two_ranks(checkpoint):
    """TP2, vision TP2: attention qkv / proj slices (48x32, 32x16) fit the row-wise GEMMs, the MLP slices (24 rows)
    do not and stay fp32; the merger is replicated. Logits within 6% of the unswapped model's on both ranks."""
    results = run_distributed(fp8_tensor_parallel_checks, 2, str(checkpoint), timeout=300)
    for r in results:
        assert {f"vision.0.blocks.{b}.attn.{m}" for b in range(2) for m in ("qkv", "proj")} <= set(r["swapped"]), r
        assert {"vision.0.merger.mlp.0", "vision.0.merger.mlp.2"} <= set(r["swapped"]), r
        mlp = {f"vision.0.blocks.{b}.mlp.{m}" for b in range(2) for m in ("gate_proj", "up_proj", "down_proj")}
        assert set(r["skipped"]) == mlp, r["skipped"]
        assert 0 < r["logit_rel"] < 0.06 and r["grads_finite"], r
