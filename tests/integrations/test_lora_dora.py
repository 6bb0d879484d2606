"""DoRA (``peft.LoraConfig(use_dora=True)``) on megatron parallel layers, against PEFT and plain torch.

- Layer math at TP=2, with and without sequence parallelism and an active dropout: outputs and the gradients of the
  input, A, B and the magnitude against the DoRA formula on full tensors (fp32, 1e-5).
- A DoRA adapter written by PEFT (factors and magnitudes moved off their initial values, so the rescaling is not 1)
  loaded at TP=1 (Qwen2: biased q/k/v; DeepSeek-V3's multi-latent attention, rotary rows kept in halves in the
  checkpoint and in pairs by megatron, so B's rows and the magnitudes are permuted), TP=2, TP=2 + SP, PP=2 and CP=2
  (Llama; DeepSeek-V3 at TP=2 + SP): logits (1e-4) and loss (1e-5) against
  PEFT's, every adapter gradient (A, B, magnitude; not under PP, where the loss is on the last stage only) within
  1e-5, PEFT's parameter counts; greedy cached ``generate`` gives PEFT's tokens (scores 1e-4); saved again it is
  the same file; the merged export in transformers and merge_and_unload give the same logits (1e-4).
- get_peft_model's initial magnitudes equal PEFT's (1e-6) at TP=1 and TP=2.
- Refused as PEFT refuses it: DoRA on MoE experts / router (target_parameters).
Training against trl.SFTTrainer with DoRA: the ``dora_messages`` scenario of test_sft.py.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._lora_dora import DORA_KW, init_checks, kept_norm_checks, layer_checks, model_checks
from ._lora_load import write_peft_adapter

MLA = {"rope_interleave": False, "q_lora_rank": None}  # NOTE: q_proj; rotary rows in halves (RopeColumnParallel)
MLA_DORA = {**DORA_KW, "target_modules": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
TWO_RANK_LAYOUTS = {"tp2": {"tensor_parallel_size": 2},
                    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
                    "pp2": {"pipeline_parallel_size": 2}, "cp2": {"context_parallel_size": 2}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("dora-src")
    out = {}
    for arch, overrides, kw in (("llama", {}, DORA_KW), ("qwen2", {}, DORA_KW), ("deepseek_v3", MLA, MLA_DORA)):
        folder = make_tiny_checkpoint(base / arch, arch, **overrides)
        write_peft_adapter(str(folder), str(base / f"{arch}-adapter"), kw)
        out[arch] = (str(folder), str(base / f"{arch}-adapter"))
    return out


def _one_rank(checkpoints: dict, out_dir: str) -> dict:
    folder, adapter = checkpoints["qwen2"]
    return {"model": model_checks(folder, adapter, out_dir + "/tp1", {}),
            "init": init_checks(folder, out_dir + "/init", {}),
            "kept": kept_norm_checks(folder),
            "mla": model_checks(*checkpoints["deepseek_v3"], out_dir + "/mla", {})}


def _two_ranks(checkpoints: dict, out_dir: str) -> dict:
    folder, adapter = checkpoints["llama"]
    out = {"layers": layer_checks(), "init": init_checks(folder, out_dir + "/init", {"tensor_parallel_size": 2})}
    for name, layout in TWO_RANK_LAYOUTS.items():
        out[name] = model_checks(folder, adapter, f"{out_dir}/{name}", layout)
    out["mla_tp2_sp"] = model_checks(*checkpoints["deepseek_v3"], out_dir + "/mla",
                                     TWO_RANK_LAYOUTS["tp2_sp"])
    return out


@pytest.fixture(scope="module")
def one_rank(checkpoints, tmp_path_factory):
    return run_distributed(_one_rank, 1, checkpoints, str(tmp_path_factory.mktemp("dora-1")), timeout=400)[0]


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    return run_distributed(_two_ranks, 2, checkpoints, str(tmp_path_factory.mktemp("dora-2")), timeout=600)


def test_layer_math_matches_the_formula(two_ranks):
    for r in two_ranks:
        assert r["layers"] == [f"{kind}_sp{sp}_drop{d}" for sp in (0, 1) for d in (0, 1) for kind in ("column", "row")]


def _check_model(res: dict, rank0: bool, pipeline: bool, targets: int = 7 * 4) -> None:
    assert res["counts"] == res["peft_counts"]
    assert res["targets"] == targets  # 7 linears in each of 4 layers (Llama, Qwen2)
    assert res["adapter_vs_base_logits"] > 1e-2  # NOTE: the adapter moves the logits: the comparisons test it
    if not pipeline:
        assert res["grads_compared"] == 3 * targets  # A, B and magnitude of each
    assert res["unchanged_after_merged_export"]
    assert res["merge_and_unload_diff"] < 1e-4
    assert res["generate_same_tokens"] and res["generate_scores_diff"] < 1e-4, res
    if rank0:
        assert res["same_tensors"]
        assert res["adapter_logits_diff"] < 1e-4 and res["merged_logits_diff"] < 1e-4


def test_tp1_biased_qkv_matches_peft(one_rank):
    _check_model(one_rank["model"], True, False)


def test_multi_latent_attention_matches_peft(one_rank, two_ranks):
    _check_model(one_rank["mla"], True, False, targets=4 * 4)  # q, kv_a, kv_b, o in each of 4 layers
    for rank, r in enumerate(two_ranks):
        _check_model(r["mla_tp2_sp"], rank == 0, False, targets=4 * 4)


@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_parallel_layout_matches_peft(two_ranks, layout):
    for rank, r in enumerate(two_ranks):
        _check_model(r[layout], rank == 0, layout == "pp2")


def test_initial_magnitudes_are_peft_s(one_rank, two_ranks):
    for res in (one_rank["init"], two_ranks[0]["init"], two_ranks[1]["init"]):
        assert res["counts"] == res["peft_counts"]
    assert one_rank["init"]["magnitudes"] == two_ranks[0]["init"]["magnitudes"] == 7 * 4


def test_row_norms_kept_without_grad_until_a_tensor_changes(one_rank):
    """generate / evaluation: the second no-grad forward computes no row norm (the first: one per megatron linear,
    qkv, proj, fc1, fc2 in each of 4 layers); after in-place changes of A, B and a base weight the no-grad logits
    move and equal a grad-mode forward's (which recomputes) bit for bit."""
    kept = one_rank["kept"]
    assert kept["computed"] == (4 * 4, 0), kept
    assert kept["after_change_equal"] and kept["change_moved_logits"] > 1e-3, kept


def test_dora_on_expert_parameters_is_refused(tmp_path):
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    folder = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folder))
    with pytest.raises(LoraConfigError, match="use_dora=True: DoRA does not apply to target_parameters"):
        plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear", use_dora=True))
    plan = plan_lora(bridge, peft.LoraConfig(r=2, target_modules=["q_proj", "o_proj"], use_dora=True))
    assert {t.kind for t in plan.targets} == {"qkv", "row"}
