"""Qwen3-VL-MoE against transformers' ``Qwen3VLMoeForConditionalGeneration``: logits, loss and vision gradients
within 1e-4 (fp32; measured below 1e-6) with the routed experts in either on-disk layout (transformers 5's
``[E, 2I, H]`` / ``[E, H, I]`` stacks and the hub's transposed ones, each exported as read, bit for bit), at TP1, EP2,
TP2 + SP with the tower and the experts split over TP, PP2 and CP2; LoongTrainer against transformers.Trainer; the
router load-balancing loss refused before anything is built."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_vl import make_tiny_qwen3_vl_moe

from ._vl_parity import compare_many, train_both

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "processor_config.json")
TWO_RANKS = {  # name: (hub expert layout, from_pretrained keywords)
    "ep2": (False, {"expert_parallel_size": 2}),
    "tp2_sp_vision_tp2": (False, {"tensor_parallel_size": 2, "sequence_parallel": True,
                                  "vision_tensor_parallel_size": 2}),
    "pp2_hub_layout": (True, {"pipeline_parallel_size": 2}),
    "cp2_hub_layout": (True, {"context_parallel_size": 2}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("qwen3_vl_moe")
    return {False: make_tiny_qwen3_vl_moe(base / "transformers_layout"),
            True: make_tiny_qwen3_vl_moe(base / "hub_layout", hub_expert_layout=True)}


def check(result: dict, *, grads: bool) -> None:
    assert result["logits_shape"] == (*result["batch_shape"], 204), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if grads:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL, result


def check_round_trip(src, dst):
    _check_round_trip(src, dst, side_files=SIDE_FILES)


def test_expert_layouts_one_rank(checkpoints, tmp_path):
    hub = read_all(checkpoints[True])["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert hub.shape == (4, 64, 96)  # [E, H, 2I]: the layout differs from transformers' [E, 2I, H]
    cases = [(str(hub_layout), str(folder), {}, str(tmp_path / str(hub_layout)))
             for hub_layout, folder in checkpoints.items()]
    results = run_distributed(compare_many, 1, cases, timeout=300)[0]
    for hub_layout, folder in checkpoints.items():
        check(results[str(hub_layout)], grads=True)
        check_round_trip(folder, tmp_path / str(hub_layout))


def test_layouts_two_ranks(checkpoints, tmp_path):
    cases = [(n, str(checkpoints[hub]), layout, str(tmp_path / n), "default", 4)
             for n, (hub, layout) in TWO_RANKS.items()]
    per_rank = run_distributed(compare_many, 2, cases, timeout=600)
    for results in per_rank:
        for n, (_, layout) in TWO_RANKS.items():
            check(results[n], grads=layout.get("pipeline_parallel_size", 1) == 1)
    for n, (hub, _) in TWO_RANKS.items():
        check_round_trip(checkpoints[hub], tmp_path / n)


def test_trainer_matches_transformers_trainer(checkpoints, tmp_path):
    """Three steps with the ViT frozen (experts, router and mergers train): LoongTrainer (TP1) logs
    transformers.Trainer's losses; the routed experts move."""
    folder = checkpoints[True]
    got = run_distributed(train_both, 1, str(folder), str(tmp_path), timeout=300)[0]
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    src, out = read_all(folder), read_all(tmp_path / "loong" / "final")
    assert sorted(src) == sorted(out)
    layers = "model.language_model.layers"
    for name in (f"{layers}.0.mlp.experts.gate_up_proj", f"{layers}.2.mlp.experts.down_proj",
                 f"{layers}.0.mlp.gate.weight"):
        assert src[name].shape == out[name].shape and not torch.equal(src[name], out[name]), name


def test_router_balance_loss_refused(tmp_path):
    import loongforge_hf as lf

    folder = make_tiny_qwen3_vl_moe(tmp_path / "aux", output_router_logits=True)
    with pytest.raises(ValueError, match="router load-balancing loss is not computed for image-text models"):
        lf.AutoModelForImageTextToText.from_pretrained(folder)
