"""LoongSFTTrainer against trl.SFTTrainer (with PEFT for LoRA) on the transformers model, same SFTConfig.

Scenarios (see ``_sft_parity.SCENARIOS``): LoRA on all linears over a text dataset; rsLoRA on q/v with norms in
modules_to_save over chat messages with assistant_only_loss; DoRA on all linears over the same messages (also with
sequence parallelism); full fine-tuning over prompt/completion (completion-only loss); full fine-tuning with packing
(BFD, padding-free batches); LoRA with NEFTune; LoRA with label smoothing (evaluating after every step). TP=1 and TP=2;
the chat LoRA, NEFTune and label-smoothing scenarios also with sequence parallelism and at PP=2, as packing; all but the
prompt/completion scenario at CP=2. The LoRA text scenario also evaluates after every step. At TP=2, a LoRA run resumed
from its step-2 checkpoint logs the losses of the uninterrupted run.

Tolerances (fp32): every logged loss (and eval loss) within 1e-4 relative: only reduction order differs, so later steps
agree as closely as the first; TRL's entropy (1e-4), mean_token_accuracy (1e-6) and num_tokens (exact) in every train
and eval log; the saved adapter loaded with ``PeftModel.from_pretrained`` on the transformers model gives the trained
Loong model's logits within 1e-3.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._sft_parity import (SCENARIOS, assert_matches, moe_sft, plain_trainers_refuse, resume_matches_uninterrupted,
                          run_loong, run_trl)

NAMES = list(SCENARIOS)
# variable-length batches: one length per step under PP
PP_NAMES = ["lora_qv_messages", "full_packing", "lora_neftune", "lora_label_smoothing", "dora_messages"]


def _tp1_world(folder: str, out_dir: str) -> dict:
    """One process: the trl references, LoongSFTTrainer at TP=1, and plain trainers given a Loong model."""
    return {"trl": run_trl(folder, out_dir + "/trl", NAMES), "loong": run_loong(folder, out_dir + "/tp1", {}, NAMES),
            "plain": plain_trainers_refuse(folder, out_dir + "/plain")}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sft-src") / "llama", "llama")


@pytest.fixture(scope="module")
def tp1(src, tmp_path_factory):
    return run_distributed(_tp1_world, 1, str(src), str(tmp_path_factory.mktemp("sft-tp1")), timeout=500)[0]


def _tp2_world(folder: str, out_dir: str) -> dict:
    layout = {"tensor_parallel_size": 2}
    return {"loong": run_loong(folder, out_dir + "/runs", layout, NAMES),
            "sp": run_loong(folder, out_dir + "/sp", {**layout, "sequence_parallel": True}, SP_NAMES),
            "pp": run_loong(folder, out_dir + "/pp", {"pipeline_parallel_size": 2}, PP_NAMES),
            "cp": run_loong(folder, out_dir + "/cp", {"context_parallel_size": 2}, CP_NAMES),
            "gc": run_loong(folder, out_dir + "/gc", layout, GC_NAMES, gradient_checkpointing=True),
            "resume": resume_matches_uninterrupted(folder, out_dir + "/resume", layout),
            "resume_dora_tp2_sp": resume_matches_uninterrupted(folder, out_dir + "/resume-dora",
                                                               {**layout, "sequence_parallel": True}, PARTIAL_DORA),
            "resume_patterns": resume_matches_uninterrupted(folder, out_dir + "/resume-patterns", layout,
                                                            PATTERN_LORA),
            **{f"resume_partial_{name}": resume_matches_uninterrupted(folder, f"{out_dir}/resume-partial-{name}",
                                                                      partial_layout, PARTIAL_LORA)
               for name, partial_layout in PARTIAL_LAYOUTS.items()}}


@pytest.fixture(scope="module")
def tp2(src, tmp_path_factory):
    return run_distributed(_tp2_world, 2, str(src), str(tmp_path_factory.mktemp("sft-tp2")), timeout=500)


# LoRA on layers 0 and 2 of 4: megatron stacks a layer's tensors over all 4 layers; the adapters' over the two
PARTIAL_LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"], layers_to_transform=[0, 2])
PARTIAL_DORA = {**PARTIAL_LORA, "use_dora": True}
# q_proj at r 8 in layer 1 only (its checkpoint stacks: r 4 over layers 0, 2, 3 and r 8 over layer 1), v_proj's alpha
PATTERN_LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"model.layers.1.self_attn.q_proj": 8},
                    alpha_pattern={"v_proj": 16})
PARTIAL_LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}, "dp2": {}}
GC_NAMES = ["lora_qv_messages", "full_prompt_completion", "lora_neftune", "dora_messages"]
SP_NAMES = ["lora_qv_messages", "lora_neftune", "lora_label_smoothing", "dora_messages"]
CP_NAMES = ["lora_text", "lora_qv_messages", "full_packing", "lora_neftune", "lora_label_smoothing"]


@pytest.mark.parametrize("name", NAMES)
def test_tp1_matches_trl(tp1, name):
    assert_matches(name, tp1["trl"][name], tp1["loong"][name])


@pytest.mark.parametrize("name", NAMES)
def test_tp2_matches_trl(tp1, tp2, name):
    for rank in tp2:
        assert rank["loong"][name]["losses"] == tp2[0]["loong"][name]["losses"]
    assert_matches(name, tp1["trl"][name], tp2[0]["loong"][name])


@pytest.mark.parametrize("name", SP_NAMES)
def test_tp2_sequence_parallel_lora_matches_trl(tp1, tp2, name):
    """Sequence-parallel adapters, and norms in modules_to_save whose gradients megatron sums over TP; NEFTune's
    noise, each TP rank adding its sequence part."""
    assert_matches(name, tp1["trl"][name], tp2[0]["sp"][name])


@pytest.mark.parametrize("name", GC_NAMES)
def test_tp2_gradient_checkpointing_matches_trl(tp1, tp2, name):
    """SFTConfig(gradient_checkpointing=True): every layer recomputed by megatron-core, LoRA behind a frozen
    embedding included; the losses are TRL's (run without checkpointing)."""
    for rank in tp2:
        assert rank["gc"][name]["recompute"] and not rank["loong"][name]["recompute"]
        assert rank["gc"][name]["losses"] == tp2[0]["gc"][name]["losses"]
    assert_matches(name, tp1["trl"][name], tp2[0]["gc"][name])


@pytest.mark.parametrize("name", PP_NAMES)
def test_pp2_matches_trl(tp1, tp2, name):
    for rank in tp2:
        assert rank["pp"][name]["losses"] == tp2[0]["pp"][name]["losses"]
    # NOTE: the engine pads each step's micro-batches to one length for the pipeline after TRL's collator, so the
    # token counts are TRL's (packed, padding-free batches included)
    assert_matches(name, tp1["trl"][name], tp2[0]["pp"][name])


@pytest.mark.parametrize("name", CP_NAMES)
def test_cp2_matches_trl(tp1, tp2, name):
    """Context parallelism: each rank holds two of the four sequence chunks (megatron's load-balanced causal split);
    the engine pads TRL's batches to a multiple of 2 x CP (packed padding-free rows with a document of pads), and the
    losses, token metrics and evaluation are TRL's on the whole sequences."""
    for rank in tp2:
        assert rank["cp"][name]["losses"] == tp2[0]["cp"][name]["losses"]
    assert_matches(name, tp1["trl"][name], tp2[0]["cp"][name])


DP_NAMES = ["lora_text", "lora_label_smoothing"]


def test_dp2_matches_trl_ddp(src, tmp_path):
    """Two data-parallel ranks against trl.SFTTrainer on two processes (DDP), evaluating after every step with 2 rows
    a rank: the ranks' eval batches hold different numbers of label tokens, and TRL's eval loss (unlike
    transformers.Trainer's) averages each rank's own mean (it passes its loss no num_items_in_batch there)."""
    ref = run_distributed(run_trl, 2, str(src), str(tmp_path / "trl"), DP_NAMES, timeout=500)
    got = run_distributed(run_loong, 2, str(src), str(tmp_path / "lf"), {}, DP_NAMES, timeout=500)
    for name in DP_NAMES:
        assert got[1][name]["losses"] == got[0][name]["losses"]
        assert_matches(name, ref[0][name], got[0][name])


def test_tp2_lora_resume_matches_uninterrupted_run(tp2):
    res = tp2[0]["resume"]
    assert res["resumed"] == res["full"] and len(res["full"]) == 4
    assert {"adapter_config.json", "adapter_model.safetensors", "megatron", "training_args.bin"} <= \
        set(res["checkpoint_files"])
    assert res["model_card"]  # NOTE: trl.SFTTrainer writes output_dir/README.md at each checkpoint


@pytest.mark.parametrize("layout", list(PARTIAL_LAYOUTS))
def test_partial_layer_lora_resume_matches_uninterrupted_run(tp2, layout):
    """LoRA on some layers only (layers_to_transform): the step-2 checkpoint writes (it used to fail megatron's
    sharding validation on rank 0 while rank 1 waited in the save: a hang) and steps 3-4 after the resume log the
    uninterrupted run's losses exactly (TP2: split adapters; PP2: one adapted layer a stage; DP2: replicated)."""
    for rank in tp2:
        res = rank[f"resume_partial_{layout}"]
        assert res["resumed"] == res["full"] and len(res["full"]) == 4, res


def test_partial_layer_dora_resume_matches_uninterrupted_run(tp2):
    """DoRA's magnitudes in the megatron checkpoint (split over TP with column-parallel rows, replicated with
    row-parallel ones; stacked over the adapted layers): the resumed run logs the uninterrupted one's losses."""
    for rank in tp2:
        res = rank["resume_dora_tp2_sp"]
        assert res["resumed"] == res["full"] and len(res["full"]) == 4, res


def test_rank_pattern_lora_resume_matches_uninterrupted_run(tp2):
    """rank_pattern giving one layer's q_proj another rank: megatron's stack of that adapter over the layers splits in
    one stack per rank (keys of their own); the step-2 checkpoint writes and the resumed run logs the same losses."""
    for rank in tp2:
        res = rank["resume_patterns"]
        assert res["resumed"] == res["full"] and len(res["full"]) == 4, res


def test_trainable_parameter_counts(tp1):
    """What print_trainable_parameters reports for the two LoRA scenarios (all-linear r=4; q/v r=4 + every norm)."""
    h, f, layers, kv = 64, 96, 4, 32
    all_linear = layers * 4 * (h + h + h + kv + h + kv + h + h + h + f + h + f + f + h)
    assert tp1["loong"]["lora_text"]["trainable"][0] == all_linear
    qv_norms = layers * 4 * (h + h + h + kv) + (2 * layers + 1) * h
    assert tp1["loong"]["lora_qv_messages"]["trainable"][0] == qv_norms


def test_plain_trainers_refuse_loong_models(tp1):
    sft_message, trainer_message = tp1["plain"]
    for message in (sft_message, trainer_message):
        assert all(name in message for name in ("LoongTrainer", "LoongSFTTrainer", "LoongDPOTrainer")), message


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_router_aux_loss(tmp_path, arch):
    """Qwen3-MoE and Qwen2-MoE (its gated shared expert beside the routed ones) with SFTConfig(router_aux_loss_coef=
    0.1): TRL's router load-balancing loss (transformers' formula, coef * aux / accumulation steps per micro-batch)
    under activation recompute: the train losses, the aux_loss metric, the eval loss and eval aux_loss are TRL's
    (1e-4), on one process and with pipeline parallel 2."""
    folder = make_tiny_checkpoint(tmp_path / "moe", arch, router_aux_loss_coef=0.01)
    res = run_distributed(moe_sft, 1, str(folder), str(tmp_path / "out"), timeout=300)[0]
    pp2 = run_distributed(moe_sft, 2, str(folder), str(tmp_path / "pp2"), True, {"pipeline_parallel_size": 2},
                          timeout=300)
    for loong in [res["loong"]] + [r["loong"] for r in pp2]:
        for key in ("loss", "aux_loss", "eval_loss", "eval_aux_loss"):
            assert len(loong[key]) == (3 if key in ("loss", "aux_loss") else 1), (key, loong)
            assert loong[key] == pytest.approx(res["trl"][key], rel=1e-4), (key, loong, res["trl"])


PHI3_NAMES = ["lora_text", "dora_messages", "full_packing"]
SMOLLM3_NAMES = ["lora_text", "full_packing"]
PHI3_LAYOUT = {"tensor_parallel_size": 2, "sequence_parallel": True}
# NOTE: a resume at TP1 (DP2 on the two ranks) with PHI3_LAYOUT's global batch
AT_TP1 = {"other_layout": {}, "other_overrides": {"per_device_train_batch_size": 1}}


def resumed_elsewhere_matches(res: dict) -> None:
    """The steps after the checkpoint resumed under another tensor-parallel size log the uninterrupted run's losses
    (rel 1e-5: the sums are split differently; a section read in the wrong order moves them by 1e-3 or more)."""
    assert isinstance(res["other"], list), res["other"]
    assert [s for s, _ in res["other"]] == [s for s, _ in res["full"]] == [1, 2, 3, 4], res  # 1-2: the checkpoint's
    assert [x for _, x in res["other"]] == pytest.approx([x for _, x in res["full"]], rel=1e-5), res


def _phi3_world(folder: str, out_dir: str) -> dict:
    return {"runs": run_loong(folder, out_dir + "/runs", PHI3_LAYOUT, PHI3_NAMES),
            "resume": resume_matches_uninterrupted(folder, out_dir + "/resume", PHI3_LAYOUT, **AT_TP1)}


def test_phi3_matches_trl(tmp_path):
    """Phi-3 (q / k / v and gate / up packed in one HF linear each, partial rotary, a 7-token sliding window that the
    packed documents outrun): all-linear LoRA (one adapter per packed linear, as PEFT's), DoRA and full fine-tuning
    with packing against trl.SFTTrainer, at TP=2 with sequence parallelism (losses, eval losses and token metrics as
    above; the saved adapters in PEFT); an all-linear LoRA run resumed from its checkpoint logs the same losses, at
    TP2 and at TP1 (the gate_up_proj adapter's B, each rank's gate and up rows, keyed per section)."""
    # NOTE: seed 1: the seed-0 weights' lora_text run predicts no label token at all (accuracy 0 in every TRL log)
    folder = str(make_tiny_checkpoint(tmp_path / "phi3", "phi3", seed=1))
    trl_runs = run_distributed(run_trl, 1, folder, str(tmp_path / "trl"), PHI3_NAMES, timeout=400)[0]
    ranks = run_distributed(_phi3_world, 2, folder, str(tmp_path / "tp2-sp"), timeout=400)
    loong = [rank["runs"] for rank in ranks]
    for name in PHI3_NAMES:
        assert loong[1][name]["losses"] == loong[0][name]["losses"], name
        assert_matches(name, trl_runs[name], loong[0][name])
    for rank in ranks:  # an all-linear LoRA run (packed linears, the norms trained) resumed from its step-2 checkpoint
        assert rank["resume"]["resumed"] == rank["resume"]["full"] and len(rank["resume"]["full"]) == 4, rank
        resumed_elsewhere_matches(rank["resume"])


# NOTE: each seed is one whose lora_text run predicts some label token (assert_matches' accuracy guard): SmolLM3's
# seed 1, Gemma 3's seeds 0-4, OLMoE's 0-2 and Phi's 0 predict none (Qwen3.5's full_weight_decay run: seeds 0-2;
# Qwen3-Next's: seeds 0 and 3)
# NOTE: the architectures whose training differs in more than their layers (the loss: soft-capped, scaled or biased
# logits; tied or scaled embeddings; multipliers; learned positions; Conv1D or packed linears; sinks; experts and
# balancing losses; recurrent layers; CP). Those with only layer code of their own (OLMo 3, Gemma, Ministral, Seed-OSS,
# Arcee, Helium, ERNIE 4.5, GLM-4, EXAONE 4, StarCoder2, GPT-NeoX, GPT-J, StableLM, Falcon) left this sweep for CI time:
# their gradients against transformers at TP2 + SP and CP2 are test_gradients', the all-linear LoRA of those with
# packed or biased linears against PEFT test_lora_post_norms' (the others' are Llama's linears, test_lora's), and the
# trainer's steps are the same code for every architecture
ARCH_SEEDS = {"smollm3": 0, "gemma3": 5, "granite": 0, "olmo2": 0, "gemma2": 0, "gpt_oss": 0, "granitemoe": 0,
              "ernie4_5_moe": 0, "olmoe": 3, "cohere": 0, "phi": 1, "gpt2": 0, "gpt_bigcode": 0, "llama4": 0,
              "qwen3_5": 3, "qwen3_next": 1}


# NOTE: gpt-oss: transformers' eager attention (the only one with its sinks on CPU: flex attention refuses them there)
# lets packed documents attend to each other, so the full fine-tuning compared is unpacked, with a weight decay that
# shows in the losses (the sinks are decayed, as Trainer decays them); packed rows: tests/bridges/test_gpt_oss.py
# NOTE: GPT-2: all-linear LoRA on its Conv1D linears (PEFT's fan_in_fan_out) and full fine-tuning with packing
# (learned positions restarting per document), the default pair
ARCH_NAMES = {"gpt_oss": ["lora_text", "full_weight_decay"]}
# NOTE: Llama 4: PEFT's "all-linear" wraps its router (an nn.Linear returning scores and logits) and fails, so LoRA
# (the experts and the router as target_parameters) is compared with TRL in test_lora_moe_bridges.py
ARCH_NAMES["llama4"] = ["full_packing"]
# NOTE: Qwen3.5: transformers' torch fallback (no fla kernels here) runs a packed row's Gated DeltaNet recurrence across
# documents, which ours restarts (tests/bridges/test_qwen3_5.py), and LoRA on its in-projections / gated q_proj is
# refused ("all-linear" with it): full fine-tuning without packing, with a decay that shows (A_log, dt_bias, the conv)
ARCH_NAMES["qwen3_5"] = ["full_weight_decay"]
# NOTE: Qwen3-Next (Qwen3.5's layers with experts, a gated shared expert and TRL's balancing loss): as Qwen3.5
ARCH_NAMES["qwen3_next"] = ["full_weight_decay"]
# NOTE: Llama 4's transformers model adds no router balancing loss whatever router_aux_loss_coef says (0.001 in its
# config, which turns TRL's on): the engine adds none (bridges/router_balance.py); TRL 1.16's own would need
# config.num_experts (Llama 4 has num_local_experts), so its reference run is told the coefficient is 0
ARCH_TRL_ARGS = {"llama4": {"router_aux_loss_coef": 0.0}}
# NOTE: TRL 1.16's fused loss reads the balancing loss's expert count from config.num_experts, which GraniteMoeConfig
# does not have (num_local_experts): the reference run needs the field (the bridge reads num_local_experts)
ARCH_OVERRIDES = {"granitemoe": {"num_experts": 4}}
# NOTE: PEFT rewrites ERNIE 4.5 MoE's and OLMoE's "all-linear" (as Qwen2-MoE's) into adapters on the routed expert
# stacks, which LoRA here adapts with every expert whole on its rank
ARCH_LAYOUTS = {arch: {**PHI3_LAYOUT, "expert_tensor_parallel_size": 1} for arch in ("ernie4_5_moe", "olmoe")}
# NOTE: GPTBigCode's multi-query attention (StarCoder's; TP replicates its one KV head, where an adapter on c_attn's
# k / v rows is refused): CP2 (all-linear LoRA on its nn.Linear c_attn / c_proj / c_fc, as PEFT's)
ARCH_LAYOUTS["gpt_bigcode"] = {"context_parallel_size": 2}


def _arch_world(folder: str, out_dir: str, resume: str | None, names: list[str], layout: dict) -> dict:
    """``resume``: "lora" or "full", a run of that kind resumed from its step-2 checkpoint (or None)."""
    out = {"runs": run_loong(folder, out_dir + "/runs", layout, names)}
    if resume:
        # NOTE: full: the hybrid's Gated DeltaNet rows (sections per TP rank) resumed at TP1 too
        out["resume"] = resume_matches_uninterrupted(folder, out_dir + "/resume", PHI3_LAYOUT, full=resume == "full",
                                                     **(AT_TP1 if resume == "full" else {}))
    return out


# NOTE: OLMo 2: a LoRA run training its split q / k norms; Qwen3.5: full fine-tuning of a hybrid stack (Gated
# DeltaNet and attention layers: the checkpoint keys each layer on its own, trainer/checkpoint.layers_differ)
ARCH_RESUME = {"olmo2": "lora", "qwen3_5": "full"}


def _trl_runs(cases: list) -> dict:
    """``run_trl`` of each (arch, folder, out_dir, names, extra keywords) in one process."""
    return {arch: run_trl(folder, out_dir, names, **extra) for arch, folder, out_dir, names, extra in cases}


def _arch_worlds(cases: list) -> dict:
    """``_arch_world`` of each (arch, folder, out_dir, resume, names, layout) in one world."""
    return {arch: _arch_world(*args) for arch, *args in cases}


@pytest.fixture(scope="module")
def architectures(tmp_path_factory):
    """Every architecture of ARCH_SEEDS: the TRL references in one process, ours in one two-rank world (a launch
    each, not one per architecture)."""
    root = tmp_path_factory.mktemp("sft-architectures")
    folders = {arch: str(make_tiny_checkpoint(root / arch, arch, seed=seed, **ARCH_OVERRIDES.get(arch, {})))
               for arch, seed in ARCH_SEEDS.items()}
    names = {arch: ARCH_NAMES.get(arch, SMOLLM3_NAMES) for arch in ARCH_SEEDS}
    trl = run_distributed(_trl_runs, 1, [(arch, folders[arch], str(root / arch / "trl"), names[arch],
                                          ARCH_TRL_ARGS.get(arch, {})) for arch in ARCH_SEEDS], timeout=1500)[0]
    ranks = run_distributed(_arch_worlds, 2, [(arch, folders[arch], str(root / arch / "tp2-sp"), ARCH_RESUME.get(arch),
                                               names[arch], ARCH_LAYOUTS.get(arch, PHI3_LAYOUT))
                                              for arch in ARCH_SEEDS], timeout=1500)
    return trl, ranks, names


@pytest.mark.parametrize("arch", list(ARCH_SEEDS))
def test_architecture_matches_trl(architectures, arch):
    """Architectures whose training differs in more than their layers: SmolLM3 (the model TRL's examples train;
    layers 1 and 3 without rotary embedding), Gemma 3 (zero-centred norms, post-attention / post-MLP norms, the scaled
    embedding tied to the LM head, a 5-token window on three of four layers, two rotary bases), Granite (embedding,
    residual, attention and logits multipliers), OLMo 2 (norms after the sublayers only, q / k norms over all heads,
    split over the two TP ranks), Gemma 2 (soft-capped scores and logits: the fused loss's), Cohere (one LayerNorm
    without bias before the attention and the MLP side by side, interleaved rotary pairs, per-head q / k norms, logits
    scaled in the fused loss too), Phi (one LayerNorm before the attention and the MLP side by side, biases on every
    linear and on the LM head: the fused loss's, 0.4 of each head rotated), GPT-2 (learned positions, Conv1D linears
    adapted as PEFT's fan_in_fan_out, q / k / v packed in c_attn, tied embeddings), GPTBigCode (StarCoder: learned
    positions, one KV head fused after the query heads in c_attn; at CP=2, one KV head not splitting over TP),
    GraniteMoE (Granite's multipliers on megatron's MoE layers), ERNIE 4.5 MoE (interleaved rotary pairs, tied
    embeddings, shared experts, experts chosen on softmax scores plus a fixed bias, transformers' balancing loss, which
    TRL turns on), OLMoE (q / k norms over all heads, split over the TP ranks; experts in every layer; the balancing
    loss), Llama 4 (dense and MoE layers alternating, top-1 sigmoid routing on the experts' input, a shared expert,
    chunked attention and a NoPE layer's query temperature over packed rows; no balancing loss, as its transformers
    model), Qwen3.5 and Qwen3-Next (Gated DeltaNet and gated full-attention layers; Qwen3-Next's experts, gated shared
    expert and balancing loss; fully fine-tuned without packing, with weight decay), gpt-oss (attention sinks, biases,
    windowed layers, YaRN, experts with a clamped GLU: all-linear LoRA adapts its attention, as PEFT's; fully
    fine-tuned without packing, with weight decay): all-linear LoRA and full fine-tuning with packing against
    trl.SFTTrainer, at TP=2 with sequence parallelism (losses, eval losses and token metrics as above). OLMo 2: a LoRA
    run training the norms (its split q / k norms included) resumed from its checkpoint logs the same losses; Qwen3.5:
    a full fine-tuning run resumed from its checkpoint too (a hybrid stack's checkpoint), at TP2 and at TP1 (its Gated
    DeltaNet rows keyed per section: parallel/tp_sections.py)."""
    trl, per_rank, names = architectures
    ranks = [rank[arch] for rank in per_rank]
    for name in names[arch]:
        assert ranks[1]["runs"][name]["losses"] == ranks[0]["runs"][name]["losses"], name
        assert_matches(name, trl[arch][name], ranks[0]["runs"][name])
    for rank in ranks:
        if "resume" in rank:
            assert rank["resume"]["resumed"] == rank["resume"]["full"] and len(rank["resume"]["full"]) == 4, rank
        if "other" in rank.get("resume", {}):
            resumed_elsewhere_matches(rank["resume"])
