"""Qwen3-VL-MoE against transformers' ``Qwen3VLMoeForConditionalGeneration``: logits, loss and vision gradients
within 1e-4 (fp32; measured below 1e-6) with the routed experts in either on-disk layout (transformers 5's
``[E, 2I, H]`` / ``[E, H, I]`` stacks and the hub's transposed ones, each exported as read, bit for bit), at TP1, EP2,
TP2 + SP with the tower and the experts split over TP, PP2 and CP2; LoongTrainer against transformers.Trainer; the
router outputs and transformers' router load-balancing loss (``output_router_logits``) in the forward and in
training."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_vl import make_tiny_qwen3_vl_moe

from ._vl_parity import compare_many, train_both, train_vl
from ._vl_qwen3 import compare_router_outputs

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


def _router_worlds(folder, layouts):
    return {name: compare_router_outputs(folder, layout) for name, layout in layouts}


def test_router_outputs_and_balance_loss_match_transformers(tmp_path):
    """text_config.output_router_logits with router_aux_loss_coef 0.3: the loss (language model + 0.3 x aux),
    ``aux_loss``, ``router_logits`` (one per MoE layer) and the routers' gradients equal transformers' at TP1, EP2,
    CP2 and TP2 + SP (1e-5); then LoongTrainer logs transformers.Trainer's losses, the aux term included."""
    folder = make_tiny_qwen3_vl_moe(tmp_path / "aux", output_router_logits=True, router_aux_loss_coef=0.3)
    one = run_distributed(_router_worlds, 1, str(folder), [("tp1", {})], timeout=300)[0]
    two = run_distributed(_router_worlds, 2, str(folder), [
        ("ep2", {"expert_parallel_size": 2}), ("cp2", {"context_parallel_size": 2}),
        ("tp2_sp", {"tensor_parallel_size": 2, "sequence_parallel": True})], timeout=400)
    for results in (one, *two):
        for name, r in results.items():
            assert r["router_layers"] == (3, 3) and r["aux"] > 1.0, (name, r)
            for key in ("loss_diff", "aux_diff", "router_logit_diff", "router_grad_diff", "logit_diff"):
                assert r[key] < 1e-5, (name, key, r)
    # NOTE: transformers.Trainer runs here, in a process without torch.distributed: in a spawned rank it wraps the
    # model in DDP, whose output pytree cannot rebuild transformers' vision output once it records router logits
    hf = train_vl(str(folder), str(tmp_path / "hf"), loong=False)
    loong = run_distributed(train_vl, 1, str(folder), str(tmp_path / "loong"), loong=True, timeout=300)[0]
    assert len(loong) == len(hf) == 3
    assert loong == pytest.approx(hf, rel=1e-4)


def test_generate_as_transformers(tmp_path):
    """Qwen3-VL-MoE ``generate`` (images, a text-only batch, videos; greedy and sampling; dynamic cache, static cache
    and uncached) against transformers' in fp32 within 1e-5 (TP1, hub expert layout; the two-rank layouts are
    test_qwen3_vl_generate.py's for the dense model and the text MoE models' generate tests)."""
    from tests._generation import assert_same_generation

    from ._vl_generate import SCENARIOS, generate_many, transformers_reference

    folder = str(make_tiny_qwen3_vl_moe(tmp_path / "gen", seed=1, hub_expert_layout=True))
    ref = transformers_reference(folder)
    runs = {"tp1": run_distributed(generate_many, 1, folder, [("tp1", {}, False)], timeout=300)}
    for layout, per_rank in runs.items():
        for rank, res in enumerate(r[layout] for r in per_rank):
            for name in SCENARIOS:
                for kind in ("cached", "static", "uncached"):
                    assert_same_generation(res[kind][name], ref["images"][name], f"{layout} {rank} {name} {kind}",
                                           atol=1e-5)
            assert_same_generation(res["text_only"]["greedy"], ref["text_only"]["greedy"], f"{layout} text",
                                   atol=1e-5)
            for kind in ("videos", "videos_static", "videos_uncached"):
                assert_same_generation(res[kind]["greedy"], ref["videos"]["greedy"], f"{layout} {rank} {kind}",
                                       atol=1e-5)
