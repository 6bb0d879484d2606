"""LoRA and DoRA on Gemma 3, OLMo 2, GLM-4 and EXAONE 4, whose layers normalise the attention and MLP outputs (post
norms inside megatron's attention and MLP modules here: the adapters' terms must land before them); Gemma's embedding is
scaled and tied to the LM head, OLMo 2's q / k norms span all heads (their weights split over TP), GLM-4 packs gate and
up in one linear and rotates half of each head in interleaved pairs, EXAONE 4 has a full layer without rotary embedding.
StarCoder2's norms are LayerNorms with biases and all its linears have biases (the adapters' terms beside them, DoRA's
rescaling without them); its two norms a layer are trained whole, weight and bias. GPT-NeoX runs its attention and MLP
side by side, with q / k / v in one linear (one adapter). Cohere runs them side by side after one LayerNorm without bias
(trained), with per-head q / k norms split over TP (trained), rotates interleaved pairs and scales its tied logits. Phi
runs them side by side after one LayerNorm with bias, with biases on every linear and on the LM head, which is trained
whole (weight and bias, split over the vocabulary) through ``modules_to_save``. GPT-J runs them side by side after one
LayerNorm with bias, with biases on the MLP's linears and the LM head (trained whole) but not on the attention's, and
rotates part of each head in interleaved pairs. StableLM runs them side by side after one LayerNorm with bias, with q /
k / v biases, per-head q / k LayerNorms split over TP (trained: an HF tensor per head) and GQA. Falcon
(40B's layout) runs them side by side after a LayerNorm each (trained), with biases on every linear, q / k / v in one
linear whose rows are megatron's per-KV-group order as they are (two groups) and tied embeddings. GPT-2's linears
are transformers' Conv1D (weights stored [in, out]; PEFT adapts them with fan_in_fan_out, A [r, in] / B [out, r] as
for a linear), q / k / v packed in c_attn (one adapter, B's rows reordered per head like the weight's), with learned
positions (the table trained whole through ``modules_to_save`` with the LayerNorms) and tied embeddings.
GPTBigCode (StarCoder's layer without multi_query; LoRA only) has GPT-2's layout with nn.Linear weights: c_attn's
per-head q / k / v rows as megatron's, its LayerNorms and untied LM head trained whole.

Checked against PEFT on the transformers model, from adapters PEFT wrote (every factor, magnitude and modules_to_save
tensor moved off its initial value), at TP=2 + SP, CP=2 and (PP2's models) PP=2: logits (1e-4) and loss (1e-5), every
A / B / magnitude gradient at HF shape (1e-5; not under PP), PEFT's trainable counts, greedy cached ``generate``
(PEFT's tokens, scores 1e-4), the adapter saved again bit for bit, the adapter folder in PEFT and the merged export in
transformers (1e-4), ``merge_and_unload`` (1e-4). The post norms (and OLMo 2's split q / k norms) are trained through
``modules_to_save``.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from ._lora_dora import DORA_KW, adapters_checks, assert_adapters_match_peft, write_adapters

POST_NORMS = ["post_attention_layernorm", "post_feedforward_layernorm"]
ADAPTERS = {
    "gemma3": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                            modules_to_save=POST_NORMS), "dora": DORA_KW},
    "olmo2": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                           modules_to_save=[*POST_NORMS, "q_norm", "k_norm"]), "dora": DORA_KW},
    # NOTE: GLM-4's post norms have names of their own, and gate / up are one packed linear (6 targets a layer)
    "glm4": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                          modules_to_save=["post_self_attn_layernorm", "post_mlp_layernorm"]), "dora": DORA_KW},
    "exaone4": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                             modules_to_save=[*POST_NORMS, "q_norm", "k_norm"]), "dora": DORA_KW},
    "starcoder2": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                modules_to_save=["input_layernorm", "post_attention_layernorm"]), "dora": DORA_KW},
    # NOTE: GPT-NeoX's q / k / v are one linear (one adapter, its B rows in megatron's per-head order as they are)
    "gpt_neox": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                              modules_to_save=["input_layernorm", "post_attention_layernorm"]), "dora": DORA_KW},
    # NOTE: Cohere's one norm a layer feeds both sublayers; its per-head q / k norms are [heads, head_dim], split
    # over TP with the heads
    "cohere": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                            modules_to_save=["input_layernorm", "q_norm", "k_norm"]), "dora": DORA_KW},
    # NOTE: Phi's LM head (weight and bias, split over the vocabulary) is not a LoRA target: trained whole
    "phi": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                         modules_to_save=["input_layernorm", "lm_head"]), "dora": DORA_KW},
    # NOTE: GPT-J's biases are on the MLP's linears only (the attention's adapters without one); its LM head with bias
    "gptj": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                          modules_to_save=["ln_1", "lm_head"]), "dora": DORA_KW},
    # NOTE: StableLM's per-head q / k LayerNorms: an HF tensor per head, one megatron tensor split over TP
    "stablelm": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                              modules_to_save=["input_layernorm", "q_layernorm", "k_layernorm"]), "dora": DORA_KW},
    # NOTE: Falcon-40B's two norms side by side (trained whole); q / k / v in one linear fused group by group
    "falcon": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                            modules_to_save=["ln_attn", "ln_mlp"]), "dora": DORA_KW},
    # NOTE: GPT-2's linears are Conv1D (PEFT's fan_in_fan_out), c_attn's q / k / v one adapter (B's rows reordered
    # per head); its norms and the position table are trained whole (wte is tied to the LM head: refused)
    "gpt2": {"lora": dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                          modules_to_save=["ln_1", "ln_2", "ln_f", "wpe"]), "dora": DORA_KW},
    # NOTE: GPTBigCode without multi_query (MQA's one KV head is replicated over TP, where an adapter on c_attn is
    # refused): nn.Linear c_attn (q / k / v per head, megatron's rows as they are), c_proj (attention and MLP), c_fc
    # named as PEFT matches them; its
    # LayerNorms and the untied LM head trained whole. LoRA only (DoRA on the same column / row-parallel linears with
    # biases: StarCoder2's, Falcon's), to keep the suite's time
    "gpt_bigcode_mha": {"lora": dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"],
                                     init_lora_weights=False, modules_to_save=["ln_1", "ln_2", "lm_head"])},
}
# NOTE: else q, k, v, o, gate, up, down; StarCoder2's c_fc, c_proj; GPT-NeoX's query_key_value, dense and two MLP
# ones; GPT-J's q, k, v, out_proj, fc_in, fc_out; GPT-2's c_attn, attn.c_proj, c_fc, mlp.c_proj
TARGETS_PER_LAYER = {"glm4": 6, "starcoder2": 6, "gpt_neox": 4, "phi": 6, "gptj": 6, "falcon": 4, "gpt2": 4,
                     "gpt_bigcode_mha": 4}
LAYOUTS = {"tp2_sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
           "pp2": (2, {"pipeline_parallel_size": 2}), "cp2": (2, {"context_parallel_size": 2})}


# NOTE: PP=2 for the models whose first or last stage holds more than Llama's (tied or scaled embeddings, learned
# positions, an LM head with a bias or trained whole, scaled logits); the pipeline's split of the layers is the same
# code for the others (CI time)
PP2 = ("gemma3", "cohere", "phi", "gptj", "falcon", "gpt2")
CASES = [(arch, layout) for arch in ADAPTERS for layout in LAYOUTS if layout != "pp2" or arch in PP2]


@pytest.fixture(scope="module")
def model(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"{request.param}-lora")
    return (*write_adapters(base, request.param, ADAPTERS[request.param]), base, request.param)


@pytest.mark.parametrize("model, layout", CASES, indirect=["model"], ids=[f"{a}-{lay}" for a, lay in CASES])
def test_adapters_match_peft(model, layout):
    folder, adapters, base, arch = model
    nprocs, sizes = LAYOUTS[layout]
    results = run_distributed(adapters_checks, nprocs, folder, adapters, str(base / layout), sizes, timeout=400)
    assert_adapters_match_peft(results, targets=TARGETS_PER_LAYER.get(arch, 7) * 4,
                               pipeline=sizes.get("pipeline_parallel_size", 1) > 1)
