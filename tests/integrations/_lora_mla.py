"""Rank functions for test_lora_mla.py: LoRA on DeepSeek-V2/V3 (multi-latent attention) against PEFT.

The model checks are ``_lora_moe.moe_model_checks`` (logits, loss, every attention adapter's gradient, PEFT's
counts, DDP buffers, the adapter folder in PEFT, the merged export in transformers, a PEFT-written adapter loaded
here); the SFT runs are ``_sft_parity``'s against trl.SFTTrainer.
"""

from __future__ import annotations

from ._lora_load import write_peft_adapter
from ._lora_moe import moe_model_checks

# tiny checkpoints by name: (arch, make_tiny_checkpoint overrides)
CHECKPOINTS = {
    "deepseek_v3": ("deepseek_v3", {"mtp_layers": 1}),   # q_lora_rank (q_a_proj / q_b_proj), rotary rows in pairs
    "deepseek_v3_halves": ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None}),  # q_proj, in halves
    "deepseek_v2": ("deepseek_v2", {}),                  # q_proj, softmax routing, two shared experts
}
MLA_ATTENTION = ["q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
# init_lora_weights=False keeps B random, so every adapter changes the logits
LORA_KW = {
    # MLA's projections (each model has the q ones it has) with its latent norm and the LM head trained whole
    "attention": dict(r=4, lora_alpha=8, target_modules=MLA_ATTENTION, init_lora_weights=False,
                      modules_to_save=["kv_a_layernorm", "lm_head"]),
    # attention, routed experts and router (PEFT's rewrite: expert stacks and gate.weight as target_parameters)
    "all_linear": dict(r=2, lora_alpha=6, target_modules="all-linear", init_lora_weights=False),
}
# (checkpoint, LoraConfig) of the model checks by case name, per layout
ONE_RANK_CASES = {"deepseek_v3/attention": ("deepseek_v3", "attention"),
                  "deepseek_v3_halves/all_linear": ("deepseek_v3_halves", "all_linear"),
                  "deepseek_v2/all_linear": ("deepseek_v2", "all_linear")}
TWO_RANK_LAYOUTS = {
    # rotary rows of kv_a_proj_with_mqa permuted whole, then split over TP (its one block spans both shards)
    "tp2_sp_etp1": ({"tensor_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1},
                    ("deepseek_v3_halves/all_linear", "deepseek_v3/attention")),
    "ep2_dp2": ({"expert_parallel_size": 2}, ("deepseek_v2/all_linear",)),
    "pp2": ({"pipeline_parallel_size": 2}, ("deepseek_v3/attention",)),
    # each rank half of every sequence, the experts split over the same two ranks
    "cp2_ep2": ({"context_parallel_size": 2, "expert_parallel_size": 2},
                ("deepseek_v3/attention", "deepseek_v2/all_linear")),
}
# chat messages with the loss on the assistant turns (the tiny model learns to end them: TRL's token accuracy moves)
SFT_SCENARIOS = {
    "lora_all_linear": ("messages", {"learning_rate": 1e-1, "assistant_only_loss": True},
                        dict(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")),
}


def write_peft_adapters(folders: dict, out_dir: str) -> dict:
    """A PEFT-written adapter (random factors) for every model-check case, by case name."""
    adapters = {}
    for case, (checkpoint, kw) in ONE_RANK_CASES.items():
        adapters[case] = f"{out_dir}/{case.replace('/', '-')}-peft-adapter"
        write_peft_adapter(folders[checkpoint], adapters[case], LORA_KW[kw])
    return adapters


def one_rank_checks(folders: dict, out_dir: str, adapters: dict) -> dict:
    from ._sft_parity import run_loong, run_trl

    out = {case: moe_model_checks(folders[checkpoint], f"{out_dir}/{case}", {}, adapters[case], LORA_KW[kw])
           for case, (checkpoint, kw) in ONE_RANK_CASES.items()}
    names = list(SFT_SCENARIOS)
    out["sft"] = {"trl": run_trl(folders["deepseek_v3"], out_dir + "/trl", names, SFT_SCENARIOS),
                  "loong": run_loong(folders["deepseek_v3"], out_dir + "/loong", {}, names, SFT_SCENARIOS)}
    return out


def two_rank_checks(folders: dict, out_dir: str, adapters: dict) -> dict:
    from ._sft_parity import run_loong

    out = {}
    for layout_name, (layout, cases) in TWO_RANK_LAYOUTS.items():
        for case in cases:
            checkpoint, kw = ONE_RANK_CASES[case]
            out[f"{layout_name}/{case}"] = moe_model_checks(folders[checkpoint], f"{out_dir}/{layout_name}-{case}",
                                                            layout, adapters[case], LORA_KW[kw])
    layout = {**TWO_RANK_LAYOUTS["tp2_sp_etp1"][0], "expert_parallel_size": 2}
    out["sft"] = run_loong(folders["deepseek_v3"], out_dir + "/sft", layout, list(SFT_SCENARIOS), SFT_SCENARIOS)
    out["sft_cp2_ep2"] = run_loong(folders["deepseek_v3"], out_dir + "/sft-cp", TWO_RANK_LAYOUTS["cp2_ep2"][0],
                                   list(SFT_SCENARIOS), SFT_SCENARIOS)
    return out
