"""Qwen2.5-VL beyond still images on one layout: videos (with ``second_per_grid_ts`` time positions) against
transformers, context parallelism of the language model against transformers, packed samples against the same
samples padded (and LoongTrainer training on packed batches)."""

from pathlib import Path

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

from ._vl_features import run_many, train_mixed_with_and_without_overlap

TOL = 1e-4
PACKED_TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_features") / "src")


def check_parity(r: dict) -> None:
    assert r["same_grad_names"], r
    assert r["shape"] == (*r["batch_shape"], 204), r
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["grad_diff"] < TOL, r


def check_packed(r: dict) -> None:
    assert r["rows"][0] == 2, r  # max_length 60 splits the samples over two rows
    assert abs(r["loss_packed"] - r["loss_padded"]) < PACKED_TOL, r
    assert r["logit_diff"] < PACKED_TOL, r


def test_videos_and_packing_one_rank(checkpoint, tmp_path):
    """Images and videos mixed in a batch (a video of 3 temporal patches, 0.5 s each; one of 2 at 1.5 s) at TP1, also
    with the language model and the vision tower recomputed (per-component activation checkpointing);
    packed vs padded at TP1 (and the padded loss against transformers'); LoongTrainer and LoongSFTTrainer on packed
    batches log the losses LoongTrainer logs on padded batches of the same samples."""
    d = str(checkpoint)
    calls = [("video", "compare_videos", d, {}),
             ("recompute", "compare_videos", d, {"language_recompute": True, "vision_recompute": True}),
             ("packed", "compare_packed", d, {}),
             ("hf_padded", "hf_padded_loss", d), ("train", "train_packed", d, str(tmp_path))]
    got = run_distributed(run_many, 1, calls, timeout=400)[0]
    check_parity(got["video"])
    check_parity(got["recompute"])
    # each first layer ran once more in backward with recompute, once without
    assert got["video"]["forward_calls"] == {"attention": 1, "vision_attention": 1}, got["video"]
    assert got["recompute"]["forward_calls"] == {"attention": 2, "vision_attention": 2}, got["recompute"]
    check_packed(got["packed"])
    assert got["packed"]["loss_padded"] == pytest.approx(got["hf_padded"], abs=TOL)
    train = got["train"]
    assert len(train["packed"]) == len(train["padded"]) == 3
    assert train["packed"] == pytest.approx(train["padded"], rel=1e-4)
    assert train["sft_packed"] == pytest.approx(train["padded"], rel=1e-4)
    assert train["packed"][-1] < train["packed"][0]


def test_context_parallel_and_packing_two_ranks(checkpoint, tmp_path):
    """CP2 with vision recompute (images + videos, the sequence padded to a multiple of 2 x CP: chunk boundaries cut
    an image and a video; each CP rank encodes its share of them), logits gathered, vision gradients summed over the
    CP group; TP2 with sequence parallelism
    and vision TP2 (each rank splices only its part of the sequence); packed vs padded under TP2 with vision TP2."""
    d = str(checkpoint)
    calls = [("cp2", "compare_videos", d, {"context_parallel_size": 2, "vision_recompute": True}),
             ("tp2_sp_vision_tp2", "compare_videos", d, {"tensor_parallel_size": 2, "sequence_parallel": True,
                                                         "vision_tensor_parallel_size": 2}),
             ("train_cp2", "train_layout", d, str(tmp_path / "cp2"), {"context_parallel_size": 2}),
             ("train_tp2", "train_layout", d, str(tmp_path / "tp2"), {"tensor_parallel_size": 2}),
             ("packed_tp2", "compare_packed", d, {"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2})]
    results = run_distributed(run_many, 2, calls, timeout=400)
    # NOTE: under CP each rank encodes its share of the images and videos (encoder_parallel.py), once per forward
    # (recompute runs the tower again in the backward); the two shares are all of them
    shares = [got["cp2"]["patches"][0] for got in results]
    assert sum(shares) == results[0]["cp2"]["all_patches"] and all(0 < n < sum(shares) for n in shares), shares
    for got in results:
        check_parity(got["cp2"])
        check_parity(got["tp2_sp_vision_tp2"])
        check_packed(got["packed_tp2"])
        # LoongTrainer under CP2 (each rank scores its share of the tokens) logs the losses it logs under TP2
        assert len(got["train_cp2"]) == 3 and got["train_cp2"] == pytest.approx(got["train_tp2"], rel=1e-4), got


@pytest.mark.parametrize("nprocs, layout", [(1, {}), (2, {"pipeline_parallel_size": 2})], ids=["tp1", "pp2"])
def test_trainable_tower_with_text_only_micro_batches(checkpoint, tmp_path, nprocs, layout):
    """A step whose micro-batches (the last one included) have no image still reaches every trainable tower
    parameter: megatron's DDP with overlapped gradient reduction (the engine's default) asserted on the next step
    before. The run equals one without the overlap (same losses and grad norms, 1e-6)."""
    runs = run_distributed(train_mixed_with_and_without_overlap, nprocs, str(checkpoint), str(tmp_path), layout,
                           timeout=300)[-1]
    assert runs[True]["losses"] == pytest.approx(runs[False]["losses"], rel=1e-6)
    assert runs[True]["grad_norms"] == pytest.approx(runs[False]["grad_norms"], rel=1e-6)
    assert all(n > 0 for n in runs[True]["grad_norms"])
