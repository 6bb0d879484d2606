"""MoE and MLA bridges against transformers: logits and loss within 1e-4 (fp32) under expert, tensor, expert-tensor,
context and pipeline parallel layouts, transformers' output type (``MoeCausalLMOutputWithPast``), and DeepSeek's
``router_logits`` (asked for by the forward keyword: one per MoE layer, fp32, within 1e-5); bit-exact HF -> megatron
-> HF round trips that transformers loads back. Every layer runs our kernels' attention (SDPA ``CoreAttention``, MLA's
``MLACoreAttention``), ``RMSNorm`` and (not MLA) fused rope.

Starting a rank costs more than a tiny model, so one world per world size runs each of its layouts in turn over several
tiny checkpoints (1 rank: tp1; 2 ranks: ep2, ep2seq, cp2ep2, tp2etp1; 4 ranks: tp2ep2, pp2ep2). Routed experts are
the grouped expert MLP (``kernels.grouped_mlp.GroupedMLP``) except in ep2seq, which runs megatron's SequentialMLP
(``LOONGFORGE_MOE_GROUPED_GEMM=0``):
- tp1:     every model, plus variants: DeepSeek-V3 with YaRN rope and with multi-token-prediction tensors in the
           checkpoint, DeepSeek-V2 with group-limited routing, Qwen3-MoE without top-k renormalisation and with
           decoder_sparse_step=2, and a bf16 DeepSeek-V3 (transformers keeps its router in fp32: the round trip must
           keep both dtypes; parity there is bf16's, against transformers in bf16);
- ep2:     every model; each rank must read exactly the experts it owns; a model whose experts do not divide by
           expert_parallel_size is refused on every rank before the process group starts;
- ep2seq:  Qwen3-MoE and GraniteMoE with SequentialMLP experts (the same checkpoints, the other expert layout);
- cp2ep2:  every model, the sequence split over two context-parallel ranks that are also the two expert ranks;
- tp2ep2:  every model: Qwen3-MoE (q/k norms), Mixtral, DeepSeek-V3 and DeepSeek-V2 (MLA without q_lora_rank),
           sequence parallel;
- pp2ep2:  every model (DeepSeek-V3 with its dense first layer on stage 0);
- tp2etp1: Qwen3-MoE, Mixtral, DeepSeek-V2 and DeepSeek-V3 with rotary dims in halves on disk (rope_interleave=False),
           GLM-4.5 with q/k norms, sequence parallel, experts whole on each TP rank (expert_tensor_parallel_size=1);
           also the models below said to run there (two ranks instead of tp2ep2's four, for CI time: their
           tensor-parallel splits and the bit-exact round trip; expert parallelism with TP: test_gradients).
YaRN on Qwen3-MoE (after its q/k norms) at tp1, cp2ep2 and tp2ep2, on Mixtral (no q/k norms) at tp1 and tp2ep2.
GLM-4.5 (``glm4_moe``: grouped-query attention with q/k/v biases and half-rotary heads, DeepSeek-V3's routing and
shared experts) and Qwen2-MoE (``qwen2_moe``: q/k/v biases, softmax routing without renormalisation, a shared expert
scaled by its sigmoid gate) and gpt-oss (``gpt_oss``: attention sinks, biases on every linear, sliding-window layers,
YaRN, experts stacked on disk with a clamped GLU and biases; also at tp2etp1), GraniteMoE (``granitemoe``: Granite's
multipliers, experts stacked on disk; also at ep2seq) and ERNIE 4.5 MoE (``ernie4_5_moe``: interleaved rotary pairs,
tied embeddings, dense first and last layers, shared experts, softmax routing on the scores plus a fixed expert bias
that changes some tokens' experts; its ``router_logits`` and transformers' balancing loss within 1e-5; the hub's
multi-token-prediction tensors passed through; also at tp2etp1) and OLMoE (``olmoe``: q / k norms over all heads,
split over TP with the heads, every layer sparse, softmax routing without renormalisation; its ``router_logits`` and
transformers' balancing loss within 1e-5; also at tp2etp1) and MiniMax-M2 (``minimax_m2``: q / k norms over all
heads as OLMoE's, half of each head rotary, every layer sparse, sigmoid routing on the scores plus a fixed expert bias
that changes some tokens' experts, which transformers' balancing loss does not count; its ``router_logits`` and that
loss within 1e-5; Mixtral's names on disk) are among "every model"; tp1 also runs GLM-4.5 with q/k
norms and an MTP layer, and OLMoE with norm_topk_prob on. Llama 4 (``llama4``: dense and MoE layers alternating,
sigmoid top-1 routing that scales the expert's input, a shared expert, L2 q / k norms and 5-position attention chunks
on the rotary layers, a NoPE layer with a query temperature, experts stacked on disk; its ``router_logits``, no
balancing loss; also at tp2etp1) is among "every model". FlexOlmo (``flex_olmo``: OLMo 2's post norms, the MoE
layer's output normalised too, and q / k norms over all heads, OLMoE's experts; its ``router_logits`` and transformers'
balancing loss within 1e-5) and Granite MoE with a shared MLP (``granitemoeshared``) run at tp1 and ep2 (gradients at
TP2 + SP + EP2: test_gradients). dots.llm1 (``dots1``: Qwen3's per-head q / k norms,
DeepSeek-V3's sigmoid routing on the scores plus a fixed expert bias that changes some tokens' experts, scaling and
shared experts, a dense first layer, a binding window on the last two layers; its ``router_logits``, no balancing loss)
and HunYuan-MoE (``hunyuan_v1_moe``: per-head q / k norms after the rotation, in megatron's q / k norm slots with the
rotation moved into them, fixed NTK-alpha rope, softmax top-k experts beside a shared MLP in every layer; its
``router_logits``, no balancing loss) are among "every model".
Qwen3-Next (``qwen3_next``: Gated DeltaNet layers with in-projections fused per key head, gated full-attention layers,
zero-centred norms, partial rotary, a dense first layer, a sigmoid-gated shared expert) and Qwen3.5-MoE's text model
(``qwen3_5_moe``: the same layers with Qwen3.5's separate in-projections, every layer sparse) run at tp1 and tp2ep2,
Qwen3-Next also at ep2 and pp2ep2, Qwen3.5-MoE also at cp2ep2 (the Gated DeltaNets' states passed between the
context-parallel ranks, ``parallel/delta_rule_cp.py``), with their
``router_logits`` and transformers' balancing loss within 1e-5, Qwen3-Next's hub ``mtp.*`` tensors passed through
(padding, packed documents, generate: test_qwen3_5).
PhiMoE (``phimoe``: LayerNorms with biases, q / k / v / o and LM-head biases, sparsemixer top-2 routing whose jitter
window masks some experts, LongRoPE's fixed mscale; its ``router_logits`` and transformers' balancing loss within 1e-5)
runs at tp1, ep2 and tp2etp1 (gradients at TP2 + SP + EP2: test_gradients; the training-mode sparsemixer:
test_phimoe_routing).
Cohere2-MoE (``cohere2_moe``: Cohere2's attention and MLP side by side after one LayerNorm without bias, with the
experts as the MLP; interleaved rotary pairs, a dense first full layer that rotates, windowed layers, a full layer
without rotary embedding, scaled and tied logits, softmax top-k experts and a shared one averaged with them; its
``router_logits`` within 1e-5, no balancing loss) at tp1 and tp2ep2, and with RMSNorms, sigmoid routing and the shared
expert summed (``cohere2_moe_rms``) at tp1 and ep2. AFMoE (``afmoe``: gated attention with per-head q / k norms, norms
before and after each sublayer, rotary embedding on the windowed layers only, muP's scaled embedding, a dense first
layer, sigmoid routing on the scores plus an expert bias that changes some tokens' experts, scaled, two shared experts;
its ``router_logits`` within 1e-5, no balancing loss) at tp1, ep2 and tp2etp1 (gradients at TP2 + SP + EP2:
test_gradients; refusals and the expert bias: test_cohere2_moe_afmoe).
EXAONE-MoE (``exaone_moe``: pre-norm layers with per-head q / k norms, a 5-token window on layers 0-2 and a full layer
3 without rotary embedding, a dense first layer, sigmoid routing on the scores plus a bias that changes some tokens'
experts, scaled, two shared experts, the bias beside the gate on disk) and Solar Open (``solar_open``: q / k / v
biases, every layer sparse, GLM-4.5's grouped sigmoid routing with a bias, a shared expert) at tp1 and tp2etp1, their
``router_logits`` within 1e-5, no balancing loss; DBRX (``dbrx``: LayerNorms without bias, q / k / v fused in ``Wqkv``
and clamped where about a tenth of them reach the clamp, softmax top-3 of 8 experts renormalised, read expert by
expert from 2-D ``w1`` / ``v1`` / ``w2``; its ``router_logits`` and transformers' balancing loss with
``moe_loss_weight`` within 1e-5) at tp1 and tp2etp1 (gradients at TP2 + SP + EP2: test_gradients; refusals:
test_moe_new_bridges). MiMo-V2-Flash (``mimo_v2_flash``: full layers 0 and 3 with 2 KV heads, sliding layers 1 and 2
with 4, sinks and a binding 5-token window; value heads of 16 beside q / k heads of 24, scaled by 0.6; a rope theta per
layer type on a third of each head; a dense first layer, top 4 of 8 experts in 2 of 4 groups by sigmoid scores plus a
bias, scaled, no shared experts; its ``router_logits`` within 1e-5, no balancing loss; the hub's ``model.mtp.*``
tensors passed through) at tp1 and tp2etp1 (gradients at TP2 + SP + EP2: test_gradients; refusals:
test_moe_new_bridges).
DeepSeek-V3.2 (``deepseek_v32``: GLM-4.7-Flash's MLA and experts with YaRN, DeepSeek Sparse Attention's indexer rotating
its heads' first dims in halves) and GLM-5 (``glm_moe_dsa``: rms_norm_eps 1e-5, the indexer's rotary dims in pairs,
layers 1 and 3 reusing the top-k of layers 0 and 2) at tp1, cp2ep2 and tp2ep2: each query attends to the top 4 of up
to 12 keys (the logits move by ~0.2 with every key kept: test_dsa), megatron's DSA core attention (``SparseAttention``;
at cp2ep2 each rank's queries over the whole sequence's keys and index keys), the indexer tensors in the bit-exact
round trip, ``router_logits`` within 1e-5, greedy generate and a 2-beam search with the KV cache (keys and indexer keys
cached; at cp2ep2 the prompt split over CP fills the whole cache on each rank, ``cp_kv_cache="replicated"``, the
default sharded one refused by name) token for token transformers' (with its cache; at tp1 and cp2ep2 each step's
logits within 1e-4) and ours without (gradients at TP2 + SP + EP2 and CP2: test_gradients; padding, refusals:
test_dsa).
Kimi Linear (``kimi_linear``: Kimi Delta Attention layers, a per-channel decay, beside a NoPE MLA layer, a dense
first layer, DeepSeek-V3's grouped sigmoid routing with a bias and a shared expert, Mixtral's names on disk) at tp1,
cp2ep2 and tp2ep2, its ``router_logits`` within 1e-5 (gradients at TP2 + SP + EP2 and CP2: test_gradients; long
sequences, padding, packed documents, generate: test_qwen3_5).
Hy3 (``hy_v3``: per-head q / k norms, a dense first layer, sigmoid routing plus a bias, scaled, two shared experts,
its own router / bias / shared-expert names, an MTP layer passed through; ``router_logits``, no balancing loss),
Mellum 2 (``mellum``: a binding 5-token window on layers 1 and 2, a rope theta per layer type, a dense first layer,
softmax top-3 of 8 experts; ``router_logits`` and transformers' balancing loss) and Flint (``flint``: sinks, full
layers without rotary embedding beside windowed rotary ones, sigmoid routing without bias, an ungated shared expert;
``router_logits`` and the balancing loss) at tp1 and tp2etp1 (gradients at TP2 + SP + EP2: test_gradients; refusals:
test_decoders_2026).
Granite-MoE SWA (``granitemoe_swa``: Granite's multipliers, sinks, a binding 5-token window on layers 1 and 3, layer 2
without rotary embedding, softmax top-2 of 4 experts under transformers 5's names beside a shared MLP;
``router_logits`` and the balancing loss) at tp1 and tp2etp1 (gradients at TP2 + SP + EP2: test_gradients; cached
generate: test_granite_swa_bitnet_diffllama).
A.X-K1 (``axk1``: GLM-4.7-Flash's layout with rotary halves on disk, the MoE layers' output normalised by
``post_mlp_layernorm``; ``router_logits``, no balancing loss; an MTP layer passed through) at tp1 and tp2etp1
(gradients at TP2 + SP + EP2: test_gradients; settings and refusals: test_decoders_2026); at tp1 also from a folder
without the gates' ``e_score_correction_bias``, as the hub's (test_axk1_checkpoint_without_expert_bias).
A.X-K2 (``axk2``: DeepSeek-V3.2's layout with the top 4 of 12 keys, input / MoE-layer norms with a low-rank sigmoid
gate, a query projection of the normalised and raw latents that also gates each head's output; the indexer reads the
normalised half; ``router_logits``; left padding; greedy generate and a 2-beam search with the KV cache as
DeepSeek-V3.2's) at tp1 (also with expert groups), cp2ep2 and tp2ep2 (gradients at TP2 + SP + EP2: test_gradients).
MiniMax (``minimax``: lightning-attention layers 0, 2, 3 in blocks of 5 tokens, a softmax-attention layer 1, residuals
after the norms scaled by alpha / beta factors other than 1, Mixtral's experts; ``router_logits`` and the balancing
loss; left padding at the real tokens, a packed row's documents, greedy generate and a 2-beam search over a
left-padded batch with the cache: transformers' tokens) at tp1, cp2ep2 (the lightning states passed between the
chunks; a packed row's documents across them; generate without the cache, the cached one refused by name) and tp2etp1
(gradients at TP2 + SP + EP2 and CP2: test_gradients; kernel, refusals: test_minimax).
Kolibri-1 (``kolibri1``: per-head q / k norms, norms after each sublayer too, a binding 5-token window on layers 0, 1,
3, the full layer 2 without rotary embedding; in every layer the top 3 of 8 experts by the logits plus a bias, weighted
by their sigmoid, renormalised, beside a shared MLP; at tp1 also without renormalising, and in bf16 with its fp32
bias) and Aria's text model (``aria_text``: Llama's layout, softmax top-2 of 8 experts stacked and transposed on
disk beside shared experts) at tp1 and tp2etp1, their ``router_logits`` (fp32, within 1e-5; no balancing loss)
(gradients at TP2 + SP + EP2: test_gradients; routing, refusals: test_kolibri_aria).
Laguna (``laguna``: 4, 8, 2, 6 query heads of 24 in layers 0-3 over 2 KV heads, a softplus output gate per head,
per-head q / k norms, full layers 0 and 3 rotating half of each head (theta 5e5) beside a binding 5-token window on
layers 1 and 2 rotating all of it (theta 1e4), a dense first layer, the top 2 of 8 experts by sigmoid scores plus a
bias that changes some tokens' experts, renormalised and scaled by 2.5, beside a shared expert; ``router_logits`` and
transformers' balancing loss within 1e-5) at tp1 and tp2etp1 (gradients at TP2 + SP + EP2: test_gradients; settings,
refusals, the bias and gate binding: test_laguna).
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.round_trip import check_round_trip, read_all
from loongforge_hf.testing.tiny_models import hf_causal_lm

from ._moe_parity import run_plan

TOL = 1e-4
ROUTER_TOL = 1e-5  # router_logits: fp32 gating on both sides
# NOTE: the tiny DeepSeek, GLM-4.5 and dots.llm1 checkpoints: 4 layers, the first dense (first_k_dense_replace=1)
MLA_MOE_LAYERS = 3
GLM_LITE_MOE_LAYERS = 2  # NOTE: the tiny GLM-4.7-Flash: layers 1 and 3 (mlp_layer_types)
ERNIE_MOE_LAYERS = 2  # the tiny ERNIE 4.5 MoE: layers 1 and 2 of 4 (moe_layer_start_index=1, moe_layer_end_index=2)
OLMOE_MOE_LAYERS = 4  # the tiny OLMoE: every layer
MINIMAX_MOE_LAYERS = 4  # the tiny MiniMax-M2: every layer
HUNYUAN_MOE_LAYERS = 4  # the tiny HunYuan-MoE: every layer
PHIMOE_MOE_LAYERS = 4  # the tiny PhiMoE: every layer
LLAMA4_MOE_LAYERS = 2  # the tiny Llama 4: layers 1 and 3 (interleave_moe_layer_step=2)
DENSE_FIRST_MOE_LAYERS = 3  # the tiny Cohere2-MoE and AFMoE: layers 1-3 (the first dense)
HYBRID_MOE_LAYERS = {"qwen3_next": 3, "qwen3_5_moe": 4}  # NOTE: Qwen3-Next's first layer dense (mlp_only_layers)
# NOTE: megatron's own rotary path (rotary_interleaved), not the fused-rope slot
INTERLEAVED_ROPE = ("ernie4_5_moe", "llama4", "cohere2_moe", "cohere2_moe_rms")
BF16_TOL = {"logit_diff": 0.1, "loss_diff": 0.02}
SP = {"sequence_parallel": True}

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
CHECKPOINTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", {"mtp_layers": 1}),
    "deepseek_v3_bf16": ("deepseek_v3", {"dtype": torch.bfloat16}),
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v3_yarn": ("deepseek_v3", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}}),
    "deepseek_v3_halves": ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None}),
    "deepseek_v2_grouped": ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_routed_experts": 8,
                                            "n_group": 4, "topk_group": 2}),
    "qwen3_moe_sparse2": ("qwen3_moe", {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []}),
    "qwen3_moe_3_experts": ("qwen3_moe", {"num_experts": 3, "tokenizer": False}),
    "glm4_moe": ("glm4_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    # NOTE: sinks, biases on every linear, windowed layers, YaRN, stacked experts with a clamped GLU
    "gpt_oss": ("gpt_oss", {}),
    # NOTE: Granite's four multipliers, experts stacked on disk with [gate; up] rows
    "granitemoe": ("granitemoe", {}),
    # NOTE: interleaved rotary pairs, tied embeddings, dense first and last layers, shared experts, softmax routing on
    # scores plus a bias that changes some tokens' experts, the hub's multi-token-prediction tensors
    "ernie4_5_moe": ("ernie4_5_moe", {"mtp_layers": 1}),
    # NOTE: q / k norms over all heads (the k norm over the 2 kv heads), top 3 of 8 experts in every layer, not
    # renormalised (as the hub's), and renormalised
    "olmoe": ("olmoe", {}),
    "olmoe_norm_topk": ("olmoe", {"norm_topk_prob": True}),
    # NOTE: q / k norms over all heads, half of each head rotary, sigmoid routing on the scores plus a bias that
    # changes some tokens' experts, Mixtral's names on disk (block_sparse_moe, w1 / w3 / w2)
    "minimax_m2": ("minimax_m2", {}),
    # NOTE: dense and MoE layers alternating, sigmoid top-1 routing on the experts' input, a shared expert, L2 q / k
    # norms and 5-position attention chunks on the rotary layers (CP2's query chunks are 3 long), a NoPE layer with a
    # query temperature, interleaved rotary pairs, experts stacked on disk
    "llama4": ("llama4", {}),
    # NOTE: per-head q / k norms, sigmoid routing on the scores plus a bias that changes some tokens' experts, scaled,
    # two shared experts, a dense first layer, a 5-token window on layers 2 and 3
    "dots1": ("dots1", {}),
    # NOTE: per-head q / k norms after the rotation, NTK-alpha rope, softmax top-k experts and a shared MLP, the router
    # in fp32 (gate.wg)
    "hunyuan_v1_moe": ("hunyuan_v1_moe", {}),
    # NOTE: OLMo 2's post norms (the MoE layer's output normalised) and q / k norms over all heads with OLMoE's experts
    "flex_olmo": ("flex_olmo", {}),
    # NOTE: Granite MoE's multipliers and stacked experts with a shared MLP ([gate; up] rows) beside them
    "granitemoeshared": ("granitemoeshared", {}),
    "qwen3_next": ("qwen3_next", {"mtp_layers": 1}),  # NOTE: the hub's mtp.* tensors passed through
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    # NOTE: LayerNorms, q / k / v / o and LM-head biases, sparsemixer top-2 routing (its jitter window masking some
    # experts), LongRoPE's fixed mscale
    "phimoe": ("phimoe", {}),
    # NOTE: one LayerNorm before the attention and the experts side by side, a shared expert averaged in; with
    # RMSNorms, sigmoid routing and the shared expert summed
    "cohere2_moe": ("cohere2_moe", {}),
    "cohere2_moe_rms": ("cohere2_moe", {"rms_norm_eps": 1e-6, "expert_selection_fn": "sigmoid",
                                        "shared_expert_combination_strategy": "sum"}),
    # NOTE: gated attention, sandwich norms, rope on the windowed layers only, muP, sigmoid routing with an expert bias
    "afmoe": ("afmoe", {}),
    # NOTE: per-head q/k norms, no biases, no expert groups, an MTP layer in the checkpoint
    # NOTE: YaRN (its attention factor on q's and k's rotary channels: after Qwen3-MoE's q / k norms; in Mixtral's
    # empty q / k norm slots)
    "qwen3_moe_yarn": ("qwen3_moe", {"rope_parameters": YARN}),
    # NOTE: head_dim given: transformers' YaRN reads config.head_dim, which Mixtral's config leaves None
    "mixtral_yarn": ("mixtral", {"rope_parameters": YARN, "head_dim": 16}),
    "glm4_moe_qk_norm": ("glm4_moe", {"use_qk_norm": True, "attention_bias": False, "n_group": 1, "topk_group": 1,
                                      "mtp_layers": 1}),
    # NOTE: MLA family (S32): GLM-4.7-Flash (rms_norm_eps 1e-5, mlp_layer_types, an MTP layer), Mistral 4 (softmax
    # routing, YaRN on a third of each query head, experts stacked on disk), MiniCPM3 (dense, muP, LongRoPE)
    "glm4_moe_lite": ("glm4_moe_lite", {"mtp_layers": 1}),
    # NOTE: A.X-K1: GLM-4.7-Flash's layout with the MoE layers' post_mlp_layernorm, rotary halves on disk
    "axk1": ("axk1", {"mtp_layers": 1}),
    # NOTE: ... without the gates' e_score_correction_bias, as the hub's A.X-K1 checkpoints (WITHOUT)
    "axk1_no_bias": ("axk1", {}),
    # NOTE: A.X-K2: DeepSeek-V3.2's layout (DSA: the top 4 of 12 keys) with gated norms and the gated query projection
    "axk2": ("axk2", {}),
    "axk2_grouped": ("axk2", {"n_group": 4, "topk_group": 2}),  # NOTE: A.X-K2's own group scoring (top-2 sums)
    "mistral4": ("mistral4", {}),
    "minicpm3": ("minicpm3", {}),
    # NOTE: K-EXAONE (pre-norm, per-head q / k norms, windowed layers and a full one without rope, a dense first
    # layer, sigmoid routing plus a bias, two shared experts, the bias beside the gate on disk) and Solar Open (q / k /
    # v biases, every layer sparse, GLM-4.5's grouped sigmoid routing)
    "exaone_moe": ("exaone_moe", {}),
    "solar_open": ("solar_open", {}),
    # NOTE: DBRX: LayerNorms without bias, q / k / v fused and clamped, softmax top-3 experts stored as 2-D tensors,
    # transformers' balancing loss weighted by ffn_config.moe_loss_weight
    "dbrx": ("dbrx", {}),
    # NOTE: MiMo-V2-Flash: sliding layers with twice the KV heads, sinks and a window; value heads narrower than q / k
    # and scaled; a rope theta per layer type on a third of each head; grouped sigmoid routing plus a bias, no shared
    # experts; the hub's model.mtp.* tensors passed through
    "mimo_v2_flash": ("mimo_v2_flash", {"mtp_layers": 1}),
    # NOTE: DeepSeek Sparse Attention: the top 4 of 12 keys per query; DeepSeek-V3.2 with YaRN and its indexer's
    # rotary halves, GLM-5 with interleaved pairs and layers 1 and 3 reusing layer 0's / 2's top-k
    "deepseek_v32": ("deepseek_v32", {}),
    "glm_moe_dsa": ("glm_moe_dsa", {}),
    "kimi_linear": ("kimi_linear", {}),
    # NOTE: Hy3 (per-head q / k norms, a dense first layer, sigmoid routing plus a bias, scaled, two shared experts,
    # the router and bias under their own names, an MTP layer passed through), Mellum 2 (windowed layers, a rope theta
    # per layer type, softmax top-k, transformers' balancing loss) and Flint (sinks, NoPE full layers, windowed rotary
    # layers, sigmoid routing without bias, an ungated shared expert, transformers' balancing loss)
    "hy_v3": ("hy_v3", {"mtp_layers": 1}),
    "mellum": ("mellum", {}),
    "flint": ("flint", {}),
    # NOTE: MiniMax (Text-01 / M1): lightning-attention layers (blocks of 5 tokens) beside a softmax-attention one,
    # residuals taken after the norms and scaled, Mixtral's experts and names
    "minimax": ("minimax", {}),
    # NOTE: Granite-MoE SWA: Granite's multipliers, sinks, windows, a NoPE layer, softmax top-2 of 4 experts (under
    # transformers 5's names) beside a shared MLP, transformers' balancing loss
    "granitemoe_swa": ("granitemoe_swa", {}),
    # NOTE: Kolibri-1: sandwich norms, NoPE full layer, windowed rotary layers, the top k of the logits plus a bias
    # weighted by their sigmoid, a shared MLP; Aria's text model: experts stacked and transposed on disk, shared ones
    "kolibri1": ("kolibri1", {}),
    "aria_text": ("aria_text", {}),
    # NOTE: Laguna: a head count per layer, a softplus gate per head, a rope theta and rotary share per layer type
    "laguna": ("laguna", {}),
    # NOTE: LaraMini: Gated DeltaNet layers (one fused in_proj on disk), a windowed rotary layer and a NoPE full one
    # (ungated, plain norms), softmax top-2 of 4 experts stacked on disk beside an ungated shared expert
    "lara_mini": ("lara_mini", {}),
    # NOTE: ... Kolibri-1 without renormalising the top k (transformers' default), and in bf16 (the router weight in
    # bf16, its bias in fp32: the round trip keeps both)
    "kolibri1_unnormalised": ("kolibri1", {"norm_topk_prob": False}),
    "kolibri1_bf16": ("kolibri1", {"dtype": torch.bfloat16}),
}

MODELS = ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2", "glm4_moe", "qwen2_moe", "gpt_oss", "granitemoe",
          "ernie4_5_moe", "olmoe", "llama4", "minimax_m2", "dots1",
          "hunyuan_v1_moe")
HYBRID = ("qwen3_next", "qwen3_5_moe")  # NOTE: Gated DeltaNet layers
LEAN = ("flex_olmo", "granitemoeshared")  # NOTE: at tp1 and ep2 only (CI time); gradients at TP2 + SP + EP2
SMALL_MOE = ("phimoe", "afmoe")  # NOTE: at tp1, ep2 and tp2etp1 (CI time); gradients at TP2 + SP + EP2
MLA_FAMILY = ("glm4_moe_lite", "mistral4", "axk1")  # NOTE: at tp1 and tp2etp1 (CI time); gradients at TP2 + SP + EP2
# NOTE: at tp1, cp2ep2 and tp2ep2 (CI time); gradients at TP2 + SP + EP2 and CP2
DSA = ("deepseek_v32", "glm_moe_dsa", "axk2")
DENSE_MLA = ("minicpm3",)  # NOTE: no experts: at tp1 and tp2sp, checked by test_dense_mla_parity
KDA = ("kimi_linear",)  # NOTE: at tp1, cp2ep2 and tp2ep2 (CI time); gradients at TP2 + SP + EP2 and CP2
# NOTE: at tp1 and tp2etp1 (two ranks, not tp2ep2's four: CI time); gradients at TP2 + SP + EP2
NEW_MOE = ("exaone_moe", "solar_open", "dbrx", "mimo_v2_flash", "hy_v3", "mellum", "flint", "minimax", "granitemoe_swa",
           "kolibri1", "aria_text", "laguna", "lara_mini")
LAYOUTS = {
    "tp1": (1, {}, (*MODELS, *HYBRID, *LEAN, *SMALL_MOE, *MLA_FAMILY, *DSA, *DENSE_MLA, "deepseek_v3_yarn",
                    "deepseek_v2_grouped", "qwen3_moe_sparse2",
                    "deepseek_v3_bf16", "glm4_moe_qk_norm", "qwen3_moe_yarn", "mixtral_yarn", "olmoe_norm_topk",
                    "cohere2_moe", "cohere2_moe_rms", *NEW_MOE, *KDA, "axk2_grouped", "axk1_no_bias",
                    "kolibri1_unnormalised", "kolibri1_bf16")),
    "ep2": (2, {"expert_parallel_size": 2}, (*MODELS, "qwen3_next", *LEAN, *SMALL_MOE, "cohere2_moe_rms")),
    "ep2seq": (2, {"expert_parallel_size": 2, "moe_grouped_gemm": False}, ("qwen3_moe", "granitemoe")),
    "cp2ep2": (2, {"context_parallel_size": 2, "expert_parallel_size": 2},
               (*MODELS, "qwen3_moe_yarn", "qwen3_5_moe", *KDA, "lara_mini", "mimo_v2_flash", *DSA, "minimax")),
    "tp2ep2": (4, {"tensor_parallel_size": 2, "expert_parallel_size": 2, **SP},
               (*MODELS, *HYBRID, *DSA, "qwen3_moe_yarn", "mixtral_yarn", "cohere2_moe", *KDA)),
    "pp2ep2": (4, {"pipeline_parallel_size": 2, "expert_parallel_size": 2}, (*MODELS, "qwen3_next")),
    "tp2etp1": (2, {"tensor_parallel_size": 2, "expert_tensor_parallel_size": 1, **SP},
                ("qwen3_moe", "mixtral", "deepseek_v3_halves", "deepseek_v2", "glm4_moe_qk_norm", "gpt_oss",
                 "ernie4_5_moe", "olmoe", "llama4", *SMALL_MOE, *MLA_FAMILY, *NEW_MOE)),
    "tp2sp": (2, {"tensor_parallel_size": 2, **SP}, DENSE_MLA),
}
# NOTE: checkpoints with tensors deleted from the files (checked by their own tests)
WITHOUT = {"axk1_no_bias": r"\.mlp\.gate\.e_score_correction_bias$"}
CASES = [(layout, name) for layout, (_, _, names) in LAYOUTS.items() for name in names
         if name not in (*DENSE_MLA, *WITHOUT)]


def drop_tensors(folder: Path, pattern: str) -> Path:
    """``folder`` with the tensors whose names match ``pattern`` deleted from its files and its index."""
    from safetensors.torch import load_file, save_file

    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        kept = {n: t for n, t in tensors.items() if not re.search(pattern, n)}
        if len(kept) < len(tensors):
            save_file(kept, shard, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {n: f for n, f in data["weight_map"].items() if not re.search(pattern, n)}
        index.write_text(json.dumps(data))
    return folder


class Worlds:
    """Builds the tiny checkpoints once and runs each world once, on first use of one of its layouts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sources: dict[str, Path] = {}
        self.results: dict[str, dict] = {}

    def source(self, name: str) -> Path:
        if name not in self.sources:
            arch, kw = CHECKPOINTS[name]
            self.sources[name] = make_tiny_checkpoint(self.root / "src" / name, arch, **kw)
            if name in WITHOUT:
                drop_tensors(self.sources[name], WITHOUT[name])
        return self.sources[name]

    def out(self, layout: str, name: str) -> Path:
        return self.root / "out" / layout / name

    def run(self, layout: str) -> list[dict]:
        """Per rank, {case name: result} of ``layout`` (and "bad_layout" for the 2-rank world)."""
        nprocs = LAYOUTS[layout][0]
        if nprocs not in self.results:
            plan = [(name, kwargs, [(n, str(self.source(n)), str(self.out(name, n))) for n in names])
                    for name, (size, kwargs, names) in LAYOUTS.items() if size == nprocs]
            bad = (str(self.source("qwen3_moe_3_experts")), LAYOUTS["ep2"][1]) if nprocs == 2 else None
            self.results[nprocs] = run_distributed(run_plan, nprocs, plan, bad_layout=bad, timeout=600)
        return [{**per_rank[layout], "bad_layout": per_rank.get("bad_layout")} for per_rank in self.results[nprocs]]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> Worlds:
    return Worlds(tmp_path_factory.mktemp("moe"))


def check_loads_in_transformers(src: Path, dst: Path) -> None:
    ref, back = hf_causal_lm(src, dtype="auto"), hf_causal_lm(dst, dtype="auto")
    for p in (*ref.parameters(), *back.parameters()):
        # NOTE: transformers keeps tensors mapped from the files, at offsets that differ between two files of the same
        # tensors; some CPU kernels round by the address's alignment (Qwen3.5-MoE's logits 7e-8 apart), so both run
        # from fresh copies (the tensors' bytes are compared in check_round_trip)
        p.data = p.data.clone()
    ids = torch.randint(0, 203, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, back(ids).logits)


@pytest.mark.parametrize("layout,name", CASES, ids=[f"{layout}-{name}" for layout, name in CASES])
def test_parity_and_round_trip(worlds, layout, name):
    for rank, results in enumerate(worlds.run(layout)):
        r = results[name]
        assert r["logits_shape"] == (2, 12, 203)
        tol = BF16_TOL if name.endswith("_bf16") else {"logit_diff": TOL, "loss_diff": TOL}
        assert r["dtype"] == ("torch.bfloat16" if name.endswith("_bf16") else "torch.float32")
        assert r["logit_diff"] < tol["logit_diff"], (rank, r)
        assert r["loss_diff"] < tol["loss_diff"], (rank, r)
        if r["grads_ok"] is not None:
            assert r["grads_ok"], (rank, r)
        grouped = LAYOUTS[layout][1].get("moe_grouped_gemm", True)
        assert r["experts_module"] == ["GroupedMLP" if grouped else "SequentialMLP"], (rank, r)
        # our kernels in the attention and norm slots; the fused-rope slot for every rope but MLA's own
        mla = name.startswith(("deepseek", *MLA_FAMILY, *DSA, *KDA))  # NOTE: Kimi Linear's full layers
        # NOTE: DeepSeek Sparse Attention's core attention (bridges/sparse_attention.py)
        core = "SparseAttention" if name in DSA else "MLACoreAttention" if mla else "CoreAttention"
        core = "NormedHalfIndexer" if name.startswith("axk2") else core  # NOTE: its indexer reads the normed half
        assert r["core_attention"] == [core], (rank, r)
        if name in (*DSA, "minimax"):  # NOTE: left padding: the indexer's scores and the attention skip the padded
            # keys; MiniMax's lightning layers zero the padded tokens' q / k / v
            assert r["padded_diff"] < TOL, (rank, r)
        if name == "minimax":  # NOTE: a packed row's documents each as transformers runs it alone; generate's tokens
            # (under CP without the cache: the split prefill cannot fill the lightning states, refused by name)
            assert len(r["packed_diffs"]) == 3 and max(r["packed_diffs"]) < TOL, (rank, r)
            g = dict(r["generate_matches"])
            if layout == "cp2ep2":
                assert "cannot carry the states of recurrent" in g.pop("cached_refusal"), (rank, g)
            assert g == {"greedy": True, "beams": True}, (rank, r)
        if name in ("deepseek_v32", "glm_moe_dsa", "axk2"):  # NOTE: generate with DSA's KV cache (greedy, 2 beams)
            # gives transformers' tokens and our uncached ones; every layer caches its heads' keys, a full one its
            # indexer's (A.X-K2: the gated query and output through the cached steps). At tp1 each step's logits are
            # within 1e-4 of transformers' cached ones. NOTE: not under TP2 + SP: the tiny GLM-5's and A.X-K2's index
            # scores nearly tie at the top-k's edge on some queries, where transformers' own cached and uncached
            # logits differ (by 0.15 and 1.5e-2), and so do ours with another rounding (steps padded to 2 tokens)
            g, heads = r["generate_matches"], 4 // LAYOUTS[layout][1].get("tensor_parallel_size", 1)
            assert g["greedy"] == g["beams"] == {"transformers": True, "uncached": True}, (rank, r)
            if layout in ("tp1", "cp2ep2"):
                assert g["logit_diff"] < TOL, (rank, g)
            if layout == "cp2ep2":
                assert "cp_kv_cache='sharded' is not supported for" in g["sharded_refusal"], (rank, g)
            full = (0, 2) if name == "glm_moe_dsa" else (0, 1, 2, 3)
            assert g["cache_layers"] == [("SparseAttentionCacheLayer", (2, heads, 14, 24),
                                          (2, 14, 16) if i in full else None) for i in range(4)], (rank, r)
        # YaRN's attention factor in the q / k norm slots (kernels.rope.rotary_scale_module)
        yarn = name.endswith("_yarn") or name == "gpt_oss"
        # NOTE: GraniteMoE's final norm scaled by 1 / logits_scaling (on the last stage), its layers' outputs by the
        # residual multiplier
        scaled = {"ScaledRMSNorm"} if name.startswith("granitemoe") else set()
        # NOTE: OLMoE's q / k norms over all heads (olmo2.full_width_norm) in the q / k norm slots
        full_width = ["FullWidthKNorm", "FullWidthQNorm"] if name.startswith(("olmoe", "minimax_m2", "flex_olmo")) \
            else []
        # NOTE: Llama 4's L2 q / k norms (rotary layers) and query temperature (its NoPE layer 3: on the last stage
        # under PP, checked below) in the q / k slots
        llama4 = ["L2Norm"] if name == "llama4" else []
        # NOTE: HunYuan's q / k norms after the rotation (the rotation in the slot, before the norm)
        llama4 += ["RotateThenNorm"] if name == "hunyuan_v1_moe" else []
        scaled |= {"QueryTemperature"} if name == "llama4" else set()
        # NOTE: PhiMoE's LayerNorms with biases, LongRoPE's mscale on the rotary channels; Cohere2-MoE's LayerNorms
        # without bias
        expected = {"phimoe": ["LayerNorm", "RotaryScale"], "cohere2_moe": ["LayerNormWithoutBias"],
                    "dbrx": ["LayerNormWithoutBias"]}.get(
            name, ["RMSNorm"])
        # NOTE: MLA's q / kv latent norms with transformers' eps for them (specs.LatentRMSNorm)
        assert sorted(set(r["norms"]) - scaled) == sorted(
            [*expected, *full_width, *llama4, *(["RotaryScale"] if yarn and not mla else []),
             *(["LatentRMSNorm"] if mla else []),
             *(["GatedNorm", "NormedAndRawLatent"] if name.startswith("axk2") else [])]), (rank, r)
        assert r["rope_fusion"] is (not mla and name not in INTERLEAVED_ROPE), (rank, r)
        # megatron's allgather dispatcher where expert and expert-tensor parallel are 1 (no chunk-sort copies)
        single = "expert_parallel_size" not in LAYOUTS[layout][1] and (
            LAYOUTS[layout][1].get("expert_tensor_parallel_size", LAYOUTS[layout][1].get("tensor_parallel_size", 1))
            == 1)
        assert r["dispatcher"] == ("allgather" if single else "alltoall"), (rank, r)
        # ... in its host-sync-free form (kernels/moe_permute.py), whose dispatch these parity checks go through
        assert r["dispatcher_classes"] == (["SyncFreeAllGatherDispatcher"] if single
                                           else ["MoEAlltoAllTokenDispatcher"]), (rank, r)
        mlp = {m.removeprefix("Scaled") if name.startswith("granitemoe") else m for m in r["mlp_modules"]}
        # NOTE: FlexOlmo's and AFMoE's MoE layer with its post norm, Cohere2-MoE's halved
        # (layer_outputs.transformed_moe); AFMoE's dense MLP with its post norm (transformed_mlp)
        moe = "TransformedMoELayer" if name in ("flex_olmo", "cohere2_moe", "afmoe", "axk1") or name.startswith(
            "kolibri1") else "MoELayer"
        dense = "TransformedMLP" if name == "afmoe" else "SwiGLUMLP"
        assert mlp <= {moe, dense} and moe in mlp, (rank, r)
        # transformers' output type; DeepSeek's and GLM-4.5's forward asks for router_logits: per MoE layer, none
        # for dense ones
        assert r["output_type"] == r["ref_output_type"] == "MoeCausalLMOutputWithPast", (rank, r)
        if name == "llama4":  # NOTE: router_logits; transformers' Llama 4 adds no balancing loss
            assert r["no_aux_loss"] and r["router_counts"] == (LLAMA4_MOE_LAYERS,) * 2, (rank, r)
            assert r["router_dtypes"] == ["torch.float32"] and r["router_diff"] < ROUTER_TOL, (rank, r)
        if name.startswith(("cohere2_moe", "afmoe")):  # NOTE: router_logits (model dtype); no balancing loss
            assert r["no_aux_loss"] and r["router_counts"] == (DENSE_FIRST_MOE_LAYERS,) * 2, (rank, r)
            assert r["router_dtypes"] == ["torch.float32"] and r["router_diff"] < ROUTER_TOL, (rank, r)
        if name == "hunyuan_v1_moe":  # NOTE: router_logits (fp32 gate.wg); transformers adds no balancing loss
            assert r["no_aux_loss"] and r["router_counts"] == (HUNYUAN_MOE_LAYERS,) * 2, (rank, r)
            assert r["router_dtypes"] == ["torch.float32"] and r["router_diff"] < ROUTER_TOL, (rank, r)
        if name.startswith(("deepseek", "glm4_moe", "dots1", "mistral4", "exaone_moe", "solar_open", "mimo_v2_flash",
                            "hy_v3", "axk1", *DSA, *KDA)):
            layers = {"glm4_moe_lite": GLM_LITE_MOE_LAYERS, "axk1": GLM_LITE_MOE_LAYERS, "axk2": GLM_LITE_MOE_LAYERS,
                      "axk2_grouped": GLM_LITE_MOE_LAYERS, "solar_open": 4}.get(name, MLA_MOE_LAYERS)
            assert r["no_aux_loss"] and r["router_counts"] == (layers,) * 2, (rank, r)
            assert r["router_dtypes"] == ["torch.float32"], (rank, r)
            assert r["router_diff"] < (tol["logit_diff"] if name.endswith("_bf16") else ROUTER_TOL), (rank, r)
        if name.startswith("ernie4_5_moe"):  # NOTE: router_logits and transformers' balancing loss (in the loss too)
            assert r["router_counts"] == (ERNIE_MOE_LAYERS,) * 2 and r["router_dtypes"] == ["torch.float32"], (rank, r)
            assert r["router_diff"] < ROUTER_TOL and r["aux_diff"] is not None and r["aux_diff"] < ROUTER_TOL, (rank, r)
        if name.startswith(("olmoe", "minimax", "flex_olmo")):  # NOTE: router_logits (model dtype), the balancing
            layers = MINIMAX_MOE_LAYERS if name.startswith("minimax") else OLMOE_MOE_LAYERS  # loss; every layer sparse
            assert r["router_counts"] == (layers,) * 2 and r["router_dtypes"] == ["torch.float32"], (rank, r)
            assert r["router_diff"] < ROUTER_TOL and r["aux_diff"] is not None and r["aux_diff"] < ROUTER_TOL, (rank, r)
        if name in ("mellum", "flint", "laguna"):  # NOTE: router_logits (fp32), the balancing loss; layers 1-3
            assert r["router_counts"] == (DENSE_FIRST_MOE_LAYERS,) * 2 and r["router_dtypes"] == ["torch.float32"], (
                rank, r)
            assert r["router_diff"] < ROUTER_TOL and r["aux_diff"] is not None and r["aux_diff"] < ROUTER_TOL, (rank, r)
        if name.startswith(("kolibri1", "aria_text")):  # NOTE: router_logits, every layer sparse; no aux loss
            assert r["no_aux_loss"] and r["router_counts"] == (4, 4), (rank, r)
            assert r["router_dtypes"] == ["torch.float32"], (rank, r)
            assert r["router_diff"] < (tol["logit_diff"] if name.endswith("_bf16") else ROUTER_TOL), (rank, r)
        if name in ("granitemoe_swa", "lara_mini"):  # NOTE: router_logits, the balancing loss, every layer sparse
            assert r["router_counts"] == (4, 4) and r["router_dtypes"] == ["torch.float32"], (rank, r)
            assert r["router_diff"] < ROUTER_TOL and r["aux_diff"] is not None and r["aux_diff"] < ROUTER_TOL, (rank, r)
        if name == "dbrx":  # NOTE: router_logits and the balancing loss (moe_loss_weight times it in the loss)
            assert r["router_counts"] == (4, 4) and r["router_dtypes"] == ["torch.float32"], (rank, r)
            assert r["router_diff"] < ROUTER_TOL and r["aux_diff"] is not None and r["aux_diff"] < ROUTER_TOL, (rank, r)
        if name == "phimoe":  # NOTE: router_logits (model dtype) and transformers' balancing loss, every layer sparse
            assert r["router_counts"] == (PHIMOE_MOE_LAYERS,) * 2 and r["router_dtypes"] == ["torch.float32"], (rank, r)
            assert r["router_diff"] < ROUTER_TOL and r["aux_diff"] is not None and r["aux_diff"] < ROUTER_TOL, (rank, r)
        if name in HYBRID:  # NOTE: router_logits and the balancing loss (in the loss too), as OLMoE's
            assert r["router_counts"] == (HYBRID_MOE_LAYERS[name],) * 2, (rank, r)
            assert r["router_dtypes"] == ["torch.float32"], (rank, r)
            assert r["router_diff"] < ROUTER_TOL and r["aux_diff"] is not None and r["aux_diff"] < ROUTER_TOL, (rank, r)
    if name == "llama4":
        assert any("QueryTemperature" in results[name]["norms"] for results in worlds.run(layout))
    src, out = worlds.source(name), worlds.out(layout, name)
    check_round_trip(src, out)
    check_loads_in_transformers(src, out)


def test_expert_parallel_ranks_read_only_their_experts(worlds):
    """EP rank e of 2 holds and reads experts [e * N / 2, (e + 1) * N / 2) of every MoE layer, nothing else."""
    for layout in ("ep2", "ep2seq", "tp2ep2"):
        for rank, results in enumerate(worlds.run(layout)):
            for name in LAYOUTS[layout][2]:
                r = results[name]
                n = r["num_experts"]
                ep = r["ep_rank"]
                owned = list(range(ep * n // 2, (ep + 1) * n // 2))
                assert r["experts_read"] == owned, (layout, rank, name, r["experts_read"])
                assert r["local_experts"] == [n // 2], (layout, rank, name)


@pytest.mark.parametrize("name,prefix,tensor,count", [
    ("deepseek_v3", "model.layers.4.", "model.layers.4.eh_proj.weight", 9),
    ("glm4_moe_lite", "model.layers.4.", "model.layers.4.eh_proj.weight", 9),
    ("glm4_moe_qk_norm", "model.layers.4.", "model.layers.4.eh_proj.weight", 9),
    ("ernie4_5_moe", "model.mtp_", "model.mtp_linear_proj.0.weight", 6),
    ("qwen3_next", "mtp.", "mtp.fc.weight", 7),
    ("mimo_v2_flash", "model.mtp.", "model.mtp.layers.0.eh_proj.weight", 7),
    ("hy_v3", "model.layers.4.", "model.layers.4.eh_proj.weight", 9),
    ("axk1", "model.layers.4.", "model.layers.4.eh_proj.weight", 9)])
def test_mtp_layers_skipped_with_warning_and_written_back(worlds, name, prefix, tensor, count):
    warned = worlds.run("tp1")[0][name]["warnings"]
    assert any(prefix.rstrip(".") in w and "multi-token prediction" in w for w in warned), warned
    out = read_all(worlds.out("tp1", name))
    mtp = sorted(n for n in out if n.startswith(prefix))
    assert tensor in mtp and len(mtp) == count


def test_axk1_checkpoint_without_expert_bias(worlds, tmp_path):
    """The hub's A.X-K1 checkpoints have no ``mlp.gate.e_score_correction_bias``; transformers starts it at zero and
    does not list it as missing. From such a folder (tp1): logits, loss and router_logits within 1e-4 / 1e-5 of
    transformers' on it, the same loading info; the export holds the biases as fp32 zeros, and every tensor equal to
    what transformers' save_pretrained writes (names, dtypes, bytes); transformers loads it back bit-exact. A folder
    that also lacks another tensor fails the shape check naming that one alone, before any process group starts."""
    import torch.distributed as dist

    import loongforge_hf as lf
    from loongforge_hf.bridges.checkpoint_io import CheckpointError, CheckpointReader
    from loongforge_hf.bridges.fp8_checkpoint import dequantizing_reader
    from loongforge_hf.bridges.optional_tensors import missing_keys
    from loongforge_hf.bridges.registry import get_bridge

    r = worlds.run("tp1")[0]["axk1_no_bias"]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["grads_ok"], r
    assert r["router_counts"] == (GLM_LITE_MOE_LAYERS,) * 2 and r["router_diff"] < ROUTER_TOL, r
    mine, theirs = r["loading_info"]
    assert mine == theirs and not mine["missing_keys"] and not mine["unexpected_keys"], (mine, theirs)
    src, out = worlds.source("axk1_no_bias"), worlds.out("tp1", "axk1_no_bias")
    biases = {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 3)}
    source, exported = read_all(src), read_all(out)
    assert not biases & set(source) and set(exported) == set(source) | biases
    assert all(exported[n].dtype == torch.float32 and torch.equal(exported[n], torch.zeros(8)) for n in biases)
    hf_causal_lm(src, dtype=torch.float32).save_pretrained(tmp_path / "hf")
    saved = read_all(tmp_path / "hf")
    assert sorted(saved) == sorted(exported)
    assert all(t.dtype == exported[n].dtype and torch.equal(t, exported[n]) for n, t in saved.items())
    check_loads_in_transformers(src, out)
    with CheckpointReader(src) as raw:  # NOTE: the filled tensors read in slices too; missing unless ignored
        bridge = get_bridge(transformers.AutoConfig.from_pretrained(src))
        reader = dequantizing_reader(raw, bridge=bridge)
        assert sorted(reader.filled) == sorted(biases) and dequantizing_reader(reader, bridge=bridge) is reader
        assert torch.equal(reader.get_slice(min(biases), dim=0, start=2, stop=5), torch.zeros(3))
        assert missing_keys(reader, bridge) == set()
        bridge.hf_config.architectures = ["Glm4MoeLiteForCausalLM"]  # NOTE: a class that ignores no missing key
        assert missing_keys(reader, bridge) == biases
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    drop_tensors(broken, r"^model\.layers\.1\.post_mlp_layernorm\.weight$")
    started = dist.is_initialized()
    with pytest.raises(CheckpointError, match=r"\(1 tensor\(s\)\):\n  'model\.layers\.1\.post_mlp_layernorm\.weight': "
                                              r"missing \(expected shape \(64,\)\)$"):
        lf.AutoModelForCausalLM.from_pretrained(broken, dtype=torch.float32)
    assert dist.is_initialized() is started


def test_ernie_expert_bias_changes_the_routing(worlds):
    """The tiny ERNIE 4.5 MoE's ``e_score_correction_bias`` changes some of the parity input's tokens' experts in every
    MoE layer, and leaves others' (so the parity above holds the bias and the scores to account)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(worlds.source("ernie4_5_moe"), dtype=torch.float32)
    changed = []

    def count(router, args, _out):
        scores = torch.softmax(torch.nn.functional.linear(args[0].float(), router.weight), dim=-1)
        bias = router.moe_statics.e_score_correction_bias
        biased, plain = (torch.topk(s, router.top_k).indices.sort(-1).values for s in (scores + bias, scores))
        changed.append(((biased != plain).any(-1).sum().item(), scores.shape[0]))

    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(count)
    with torch.no_grad():  # NOTE: _moe_parity's input
        model(torch.randint(0, 203, (2, 12), generator=torch.Generator().manual_seed(7)))
    assert len(changed) == ERNIE_MOE_LAYERS and all(0 < n < tokens for n, tokens in changed), changed


def test_minimax_m2_expert_bias_changes_the_routing(worlds):
    """The tiny MiniMax-M2's ``e_score_correction_bias`` changes some of the parity input's tokens' experts in every
    layer (so the parity above holds the bias, and the balancing loss's unbiased counts, to account)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(worlds.source("minimax_m2"), dtype=torch.float32)
    changed = []

    def count(block, args, _out):
        scores = torch.sigmoid(torch.nn.functional.linear(args[0].flatten(0, 1), block.gate.weight))
        biased, plain = (torch.topk(s, block.top_k).indices.sort(-1).values
                         for s in (scores + block.e_score_correction_bias, scores))
        changed.append(((biased != plain).any(-1).sum().item(), scores.shape[0]))

    for layer in model.model.layers:
        layer.mlp.register_forward_hook(count)
    with torch.no_grad():  # NOTE: _moe_parity's input
        model(torch.randint(0, 203, (2, 12), generator=torch.Generator().manual_seed(7)))
    assert len(changed) == MINIMAX_MOE_LAYERS and all(0 < n < tokens for n, tokens in changed), changed


def test_dots1_expert_bias_changes_the_routing(worlds):
    """The tiny dots.llm1's ``e_score_correction_bias`` changes some of the parity input's tokens' experts in every MoE
    layer (no expert groups there, so the bias alone decides)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(worlds.source("dots1"), dtype=torch.float32)
    changed = []

    def count(router, args, _out):
        scores = torch.sigmoid(torch.nn.functional.linear(args[0].flatten(0, 1), router.weight))
        biased, plain = (torch.topk(s, router.top_k).indices.sort(-1).values
                         for s in (scores + router.e_score_correction_bias, scores))
        changed.append(((biased != plain).any(-1).sum().item(), scores.shape[0]))

    for layer in model.model.layers[1:]:
        layer.mlp.gate.register_forward_hook(count)
    with torch.no_grad():  # NOTE: _moe_parity's input
        model(torch.randint(0, 203, (2, 12), generator=torch.Generator().manual_seed(7)))
    assert len(changed) == MLA_MOE_LAYERS and all(0 < n < tokens for n, tokens in changed), changed


def test_experts_not_divisible_by_expert_parallel_size(worlds):
    outcomes = [results["bad_layout"] for results in worlds.run("ep2")]
    for o in outcomes:
        assert o["type"] == "ParallelLayoutError", o
        assert "num_experts=3 is not divisible by expert_parallel_size=2" in o["message"], o
        assert not o["collective_started"], o
    assert outcomes[0]["message"] == outcomes[1]["message"]


@pytest.mark.parametrize("layout", ["tp1", "tp2sp"])
def test_dense_mla_parity(worlds, layout):
    """MiniCPM3 (dense MLA with rotary halves, muP's scales, tied embeddings, LongRoPE's short factors): logits and
    loss within 1e-4 of transformers', finite gradients, a bit-exact export transformers loads."""
    for rank, results in enumerate(worlds.run(layout)):
        r = results["minicpm3"]
        assert r["logits_shape"] == (2, 12, 203) and r["output_type"] == r["ref_output_type"], (rank, r)
        assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["grads_ok"], (rank, r)
        assert r["core_attention"] == ["MLACoreAttention"] and r["mlp_modules"] == ["ScaledSwiGLUMLP"], (rank, r)
        assert "LatentRMSNorm" in r["norms"], (rank, r)
    src, out = worlds.source("minicpm3"), worlds.out(layout, "minicpm3")
    check_round_trip(src, out)
    check_loads_in_transformers(src, out)
