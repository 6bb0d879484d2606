"""Gradients of every parameter against transformers', under tensor, sequence, context and expert parallelism (where
a forward can be exact and a backward not).

Our model's loss backward, the gradients reduced as megatron's DDP reduces them (norms and router over the TP ranks
that split the tokens; experts whole on each rank over the expert-data-parallel group), then written through the
bridge's own export as an HF checkpoint, and compared tensor by tensor with transformers' gradients of the same loss
(fp32): each tensor's largest difference within 1e-4 of its largest gradient (measured ~1e-6; megatron-core's
multi-latent attention with column-parallel down projections lost the other ranks' heads' share of the rotary key's
gradient, 0.3% off on the last layer's ``kv_a_proj_with_mqa`` and more on every earlier tensor, before
``bridges/mla_latent.py``).

Layouts and models: the mixture-of-experts models (DeepSeek-V3 with q_lora_rank and rotary rows in pairs, DeepSeek-V3
with rotary rows in halves and no q_lora_rank, DeepSeek-V2, Qwen3-MoE, Mixtral, GLM-4.5 with q/k norms, Qwen2-MoE with
its gated shared expert, gpt-oss, GraniteMoE, ERNIE 4.5 MoE with its expert bias, which takes no gradient:
``e_score_correction_bias`` must come back unchanged, OLMoE with q / k norms over all heads) at TP1, TP2 + SP with the
experts whole on each rank (expert_tensor_parallel_size=1) and split over TP (its default), TP2 + SP + EP2, CP2 and CP2
+ EP2; dense models (Qwen3 with tied embeddings, Qwen2 with attention biases, Llama 3 with its rope scaling, Phi-3 with
packed q / k / v and gate / up, partial rotary and a sliding window, SmolLM3 with layers without rotary embedding, Gemma
3 with its post norms, scaled embedding and two rotary bases, Granite with its multipliers, OLMo 2 with its post norms
and full-width q / k norms, OLMo 3 with windowed layers and YaRN on the full one, Gemma with zero-centred norms and its
scaled embedding, Gemma 2 with soft-capped scores and logits, Ministral with the window on every other layer, Seed-OSS
with q/k/v biases, Arcee with its ungated relu2 MLP, Helium and ERNIE 4.5 with interleaved rotary pairs, GLM-4 with half
of each head rotated in interleaved pairs, norms after the sublayers and a packed gate / up, EXAONE 4 with windowed
layers and a full one without rotary embedding, StarCoder2 with LayerNorms and linears with biases, an ungated MLP and a
window, GPT-NeoX with the attention and the MLP side by side and q / k / v fused per head, Cohere with one LayerNorm
without bias before both, interleaved rotary pairs, scaled logits and per-head q / k norms split over TP, Cohere2 with
windowed layers and a full one without rotary embedding, Phi with one LayerNorm before the attention and MLP side by
side, biases on every linear and on the LM head (its gradient too, the head's weight tied to the embedding), partial
rotary and per-head q / k LayerNorms with biases split over TP, GPT-J with one LayerNorm before both, biases on the MLP
and the LM head but not the attention and part of each head rotated in interleaved pairs, StableLM with LayerNorms, q /
k / v biases, a quarter of each head rotated and, as StableLM 2 12B, the attention and the MLP side by side with a
LayerNorm per head on q and k (each head's weight its own, split over TP), or sequential as StableLM 2 1.6B) at TP1,
TP2 + SP and CP2, and those with layers of their own code (TP2_NO_SP) at TP2 without SP too.
Falcon (40B's two LayerNorms side by side with KV groups fused group by group and biases; the older layout run
sequentially with q / k / v per head) is among the dense models; Falcon-7B's multi-query attention (one KV head)
runs at TP1, CP2 and TP2 + SP (the head replicated on both ranks, their gradients summed as the engine sums them), as
GPTBigCode's (StarCoder: GPT-2's layer with nn.Linear weights); GPTBigCode without multi_query (q / k / v per head, an
untied LM head) is among the dense models.
Llama 4 (sigmoid top-1 routing on the experts' input, a shared expert, L2 q / k norms, chunked attention and a NoPE
layer's query temperature) is among the mixture-of-experts models. MiniMax-M2 (q / k norms over all heads, split over
TP, half-rotary heads, sigmoid routing plus a fixed expert bias) at TP2 + SP + EP2, as dots.llm1 (per-head q / k norms,
sigmoid routing plus a fixed expert bias, scaled, shared experts, a dense first layer, windowed last layers) and
HunYuan-MoE (per-head q / k norms after the rotation, softmax experts beside a shared MLP), FlexOlmo (OLMo 2's post
norms, the MoE layer's output too, full-width q / k norms) and Granite MoE with a shared MLP, PhiMoE (LayerNorms
with biases, attention and LM-head biases, sparsemixer routing as in eval), Cohere2-MoE (the attention and the experts
side by side after one LayerNorm, a shared expert averaged in) and AFMoE (gated attention, sandwich norms, muP's
scaled embedding, sigmoid routing plus a fixed expert bias, which takes no gradient: it must come back unchanged).
HunYuan dense, Apertus (xIELU's learned scalars, whose gradient each TP rank holds a share of until summed over TP) and
EXAONE 3 (Llama under GPT-2-style names) at TP2 + SP.
MiMo-V2-Flash (sliding layers with twice the KV heads and attention sinks, value heads narrower than q / k and
scaled, a rope theta per layer type on a third of each head, grouped sigmoid routing plus a fixed bias) at TP2 + SP +
EP2.
DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention, the top 4 of 12 keys; GLM-5 with layers reusing an earlier top-k)
at TP2 + SP + EP2 and CP2 (each rank's queries over the whole sequence's keys, values and index keys); their indexers
take no gradient (transformers runs them under no_grad): unchanged.
Ministral 3, VaultGemma, CWM and NanoChat (norms without weights, flipped rotary signs) at TP2 + SP.
Hy3 (sigmoid routing plus a fixed bias, which takes no gradient, shared experts), Mellum 2 (windowed layers, a rope
theta per layer type) and Flint (sinks, full layers without rotary embedding, sigmoid routing, an ungated shared
expert) at TP2 + SP + EP2; Apertus 1.5's language model and Youtu (dense MLA, tied embeddings) at TP2 + SP.
Kimi Linear (Kimi Delta Attention's per-channel decay and low-rank gates, their down projections replicated over TP;
a NoPE MLA layer; grouped sigmoid routing, a shared expert) at TP2 + SP + EP2 and CP2.
Kolibri-1 (sandwich norms, a NoPE full layer, experts chosen on the logits plus a fixed bias and weighted by their
sigmoid, a shared MLP) and Aria's text model (experts stacked and transposed on disk, shared experts) at TP2 + SP + EP2.
Laguna (a head count per layer, split over TP, a softplus output gate per head channel (``gating="per-element"``;
one per head: test_moe_parity) fused beside the queries, a rope per layer type, sigmoid routing plus a fixed bias,
which takes no gradient, a shared expert) at TP2 + SP + EP2.
MiniMax (lightning-attention layers with their norm over all heads split over TP, residuals after the norms scaled,
softmax top-2 experts) at TP2 + SP + EP2 and CP2 (the lightning states passed between the chunks).
The language models of Emu3 (Llama's layout), Gemma 4 Unified (Gemma 4's text model) and Cohere Compass (Cohere2's
layer, rotate-half rope on the sliding layers only) at TP2 + SP.
GLM-4-9B (biased q / k / v, half of each head rotated in interleaved pairs, a packed gate / up), OLMo (norms without
parameters, q / k / v clamped by ``clip_qkv``), Nemotron (LayerNorm1P with biases, an ungated relu2 MLP, half-rotary
heads) and Jais-2 (LayerNorms, biases on every linear but the LM head, an ungated relu2 MLP) at TP2 + SP.
Qwen3-Next (Gated DeltaNet in-projections fused per key head, a dense first layer, a sigmoid-gated shared expert) at
TP1 and TP2 + SP + EP2, Qwen3.5-MoE's text model at TP1; Qwen3.5 (Gated DeltaNet layers, their states passed
between the CP ranks) at TP1, TP2, TP2 + SP and CP2.
The pad token as a real input (every third token, in the labels too; ``*_pad`` layouts): transformers' embedding
with ``padding_idx`` gives its row no gradient from lookups, but the tied LM head's (bridges/embedding_padding.py):
Qwen3 tied with the pad row on the second TP rank (pad_token_id 150 of 203) and Llama 3 untied (pad 0) at TP1,
TP2 + SP, PP2 and CP2 (the training engine's gradients: its schedule, DDP's reductions, the sum of the tied
embedding's two copies under PP, before its optimizer step; under CP each rank's buffers gathered from the
distributed optimizer's shards, without which they were 0.96 to 1.15 off), Gemma's scaled embedding (tied) and GPT-2
(no padding_idx in transformers: the row keeps its lookup gradient) at TP1. Measured without the padding:
``embed_tokens`` off by 4e6 (Llama 3) to 8e7 (Gemma) times its largest gradient (the pad row, zeros as transformers
initialises it, meets the first norm at its epsilon), at every layout; with the pad row's whole gradient dropped on
the embedding (the tied head's too at TP1 / TP2 + SP): 0.93 (Qwen3), 1.0 (Gemma); GPT-2 padded: 0.03.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._gradients import gradient_checks

CHECKPOINTS = {
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_halves": ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None}),
    "deepseek_v2": ("deepseek_v2", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "glm4_moe": ("glm4_moe", {"use_qk_norm": True}),  # q/k/v biases, q/k norms, half-rotary heads
    "qwen2_moe": ("qwen2_moe", {}),  # the shared expert's sigmoid gate
    "granitemoe": ("granitemoe", {}),  # Granite's multipliers on megatron's MoE layers, experts stacked on disk
    "gpt_oss": ("gpt_oss", {}),  # sinks, biases everywhere, windowed layers, YaRN, stacked experts, clamped GLU
    # NOTE: interleaved rotary pairs, tied embeddings, shared experts, softmax routing on scores plus a fixed bias
    "ernie4_5_moe": ("ernie4_5_moe", {}),
    "olmoe": ("olmoe", {}),  # q / k norms over all heads (split over TP) before the rotation, every layer sparse
    # NOTE: sigmoid top-1 routing on the experts' input, a shared expert, dense layers between, L2 q / k norms,
    # chunked attention, a NoPE layer with a query temperature
    "llama4": ("llama4", {}),
    # NOTE: q / k norms over all heads (split over TP), half-rotary heads, sigmoid routing plus a fixed expert bias
    "minimax_m2": ("minimax_m2", {}),
    # NOTE: per-head q / k norms, sigmoid routing plus a fixed expert bias, scaled, shared experts, windowed layers
    "dots1": ("dots1", {}),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", {}),  # NOTE: q / k norms after the rotation, a shared MLP, NTK-alpha rope
    # NOTE: OLMo 2's post norms (the MoE layer's output too) and full-width q / k norms with OLMoE's experts; Granite
    # MoE with a shared MLP: at TP2 + SP + EP2
    "flex_olmo": ("flex_olmo", {}),
    "granitemoeshared": ("granitemoeshared", {}),
    # NOTE: LayerNorms with biases, attention and LM-head biases, sparsemixer routing (eval), at TP2 + SP + EP2
    "phimoe": ("phimoe", {}),
    # NOTE: Cohere2-MoE (one LayerNorm before the attention and experts side by side, a shared expert averaged in,
    # interleaved rotary pairs, windowed layers, a full one without rope, a dense first layer) and AFMoE (gated
    # attention, sandwich norms, muP, sigmoid routing plus a fixed expert bias, shared experts): at TP2 + SP + EP2
    "cohere2_moe": ("cohere2_moe", {}),
    "afmoe": ("afmoe", {}),
    # NOTE: HunYuan dense (q / k norms after the rotation), Apertus (xIELU's two learned scalars per layer, each TP rank
    # holding a share of their gradient) and EXAONE 3 (Llama under GPT-2-style names): at TP2 + SP
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
    "apertus": ("apertus", {}),
    "exaone": ("exaone", {}),
    # NOTE: GLM-4-9B's half-rotary heads in interleaved pairs with biased q / k / v and a packed gate / up; OLMo's
    # norms without parameters and q / k / v clamped (the clamp binds); Nemotron's LayerNorm1P with biases and its
    # ungated relu2 MLP, half-rotary heads: at TP2 + SP
    "glm": ("glm", {}),
    "olmo": ("olmo", {}),
    "nemotron": ("nemotron", {}),
    "jais2": ("jais2", {}),  # NOTE: LayerNorms, biases on q / k / v / o and up / down, an ungated relu2 MLP: TP2 + SP
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3_tied_pad150": ("qwen3", {"tie_word_embeddings": True, "pad_token_id": 150}),  # NOTE: on TP rank 1 of 2
    "qwen2": ("qwen2", {}),  # attention biases
    "llama3": ("llama3", {}),
    "phi3": ("phi3", {}),  # packed qkv_proj / gate_up_proj, partial rotary, a sliding window
    "smollm3": ("smollm3", {}),  # layers without rotary embedding
    "gemma3": ("gemma3", {}),  # post norms, zero-centred norms, scaled embedding, two rope bases, windowed layers
    "granite": ("granite", {}),  # embedding, residual, attention and logits multipliers
    "olmo2": ("olmo2", {}),  # post norms only, q / k norms over all heads (split over TP)
    "olmo3": ("olmo3", {}),  # OLMo 2 with windowed layers, YaRN on the full layer
    "gemma": ("gemma", {}),  # zero-centred norms, the scaled embedding tied to the LM head
    "gemma2": ("gemma2", {}),  # Gemma 3's layout with one rope, score and logit soft-capping
    "ministral": ("ministral", {}),  # the window on every other layer
    "seed_oss": ("seed_oss", {}),  # q/k/v biases, head_dim of its own
    "arcee": ("arcee", {}),  # an MLP without a gate, relu2
    "helium": ("helium", {}),  # interleaved rotary pairs
    "ernie4_5": ("ernie4_5", {}),  # interleaved rotary pairs, tied embeddings, head_dim of its own
    "glm4": ("glm4", {}),  # q/k/v biases, half-rotary heads in interleaved pairs, sandwich norms, packed gate_up
    "exaone4": ("exaone4", {}),  # post norms, per-head q / k norms, windowed layers and a full one without rope
    "starcoder2": ("starcoder2", {}),  # LayerNorms with biases, biases on every linear, an ungated MLP, a window
    "gpt_neox": ("gpt_neox", {}),  # attention and MLP side by side, LayerNorms, q / k / v fused per head
    # NOTE: one LayerNorm without bias before the attention and MLP side by side, interleaved rotary pairs, scaled
    # logits; Cohere with per-head q / k norms (split over TP), Cohere2 with windowed layers and a full one without rope
    "cohere": ("cohere", {}),
    "cohere2": ("cohere2", {}),
    # NOTE: one LayerNorm before both sublayers, biases everywhere incl. the LM head's (its weight tied here), partial
    # rotary, q / k LayerNorms over each head (off in the hub's checkpoints). Worst measured 2.4e-5, q_layernorm.bias:
    # transformers' own fp32 gradient is 1.4e-5 off its fp64 one there (the norms' small inputs)
    "phi": ("phi", {"qk_layernorm": True, "tie_word_embeddings": True}),
    # NOTE: one LayerNorm before both sublayers, biases on the MLP and the LM head only, interleaved partial rotary.
    # Worst measured 1.2e-5 (the last layer's q_proj at TP2; 5.7e-6 at TP1)
    "gptj": ("gptj", {}),
    # NOTE: StableLM 2 12B's layout (per-head q / k LayerNorms split over TP, side by side) and 1.6B's (sequential)
    "stablelm": ("stablelm", {}),
    "stablelm_sequential": ("stablelm", {"qk_layernorm": False, "use_parallel_residual": False}),
    # NOTE: Falcon-40B's layout (two norms side by side, 2 KV groups fused group by group, biases), the older layout
    # run sequentially with q / k / v per head, and Falcon-7B's multi-query attention (one KV head)
    "falcon": ("falcon", {}),
    "falcon_sequential": ("falcon_mqa", {"parallel_attn": False, "multi_query": False, "bias": True}),
    "falcon_mqa": ("falcon_mqa", {}),
    # NOTE: learned absolute positions (their table's gradient too, on every TP rank alike), Conv1D weights, c_attn
    "gpt2": ("gpt2", {}),
    # NOTE: GPTBigCode (StarCoder): GPT-2's layer with nn.Linear weights and multi-query attention (one KV head), and
    # without multi_query (q / k / v per head) with an untied LM head
    "gpt_bigcode": ("gpt_bigcode", {}),
    "gpt_bigcode_mha": ("gpt_bigcode_mha", {}),
    # NOTE: Gated DeltaNet layers (in-projections, conv, A_log / dt_bias split by heads over TP, the gated norm's
    # weight shared by the heads) and a gated full-attention layer with zero-centred q / k norms; CP passes the states
    "qwen3_5": ("qwen3_5", {}),
    # NOTE: Qwen3.5's layers with experts and a gated shared expert; Qwen3-Next's in-projections fused per key head
    "qwen3_next": ("qwen3_next", {}),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    "glm4_moe_lite": ("glm4_moe_lite", {}),
    "mistral4": ("mistral4", {}),
    "minicpm3": ("minicpm3", {}),
    # NOTE: K-EXAONE (per-head q / k norms, windowed layers and a full one without rope, sigmoid routing plus a fixed
    # expert bias, shared experts) and Solar Open (q / k / v biases, grouped sigmoid routing): at TP2 + SP + EP2
    "exaone_moe": ("exaone_moe", {}),
    "solar_open": ("solar_open", {}),
    # NOTE: DBRX (LayerNorms without bias, q / k / v fused and clamped, experts in 2-D tensors): at TP2 + SP + EP2
    "dbrx": ("dbrx", {}),
    # NOTE: MiMo-V2-Flash (sliding layers with twice the KV heads and sinks, narrower scaled values, a rope theta per
    # layer type, grouped sigmoid routing plus a fixed bias, no shared experts): at TP2 + SP + EP2
    "mimo_v2_flash": ("mimo_v2_flash", {}),
    # NOTE: Ministral 3 (YaRN with an mscale ratio), VaultGemma (Gemma 2 without post norms: soft-caps, zero-centred
    # norms, windows), CWM (windowed layers, llama3 rope) and NanoChat (norms without weights, one on the embedding,
    # flipped rotary signs, q / k norms after the rotation, relu2, a logit soft-cap): at TP2 + SP
    "ministral3": ("ministral3", {}),
    "vaultgemma": ("vaultgemma", {}),
    "cwm": ("cwm", {}),
    "nanochat": ("nanochat", {}),
    # NOTE: DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention; GLM-5 with shared indexer layers): at TP2 + SP + EP2
    # and CP2.
    # transformers' indexer runs under no_grad: its tensors take no gradient and must come back unchanged
    "deepseek_v32": ("deepseek_v32", {}),
    "glm_moe_dsa": ("glm_moe_dsa", {}),
    # NOTE: Kimi Linear (KDA's per-channel decay from low-rank gates, replicated down projections under TP; a NoPE
    # MLA layer; grouped sigmoid routing with a bias, which takes no gradient): at TP2 + SP + EP2 and CP2
    "kimi_linear": ("kimi_linear", {}),
    # NOTE: Hy3 (sigmoid routing plus a fixed bias, scaled, shared experts), Mellum 2 (windows, a rope theta per layer
    # type, softmax top-k) and Flint (sinks, NoPE full layers, sigmoid routing, an ungated shared expert): at TP2 + SP
    # + EP2; Apertus 1.5's language model (xIELU) and Youtu (dense MLA): at TP2 + SP
    "hy_v3": ("hy_v3", {}),
    "mellum": ("mellum", {}),
    "flint": ("flint", {}),
    "apertus1p5": ("apertus1p5", {}),
    "youtu": ("youtu", {}),
    # NOTE: A.X-K1 (GLM-4.7-Flash's layout, the MoE layers' output normalised): at TP2 + SP + EP2
    "axk1": ("axk1", {}),
    # NOTE: A.X-K2 (DSA, gated norms, the gated query projection): at TP2 + SP + EP2
    "axk2": ("axk2", {}),
    # NOTE: Granite SWA (sinks, windows, a NoPE layer), HyperCLOVAX (post norms) and BitNet (sub-norms over TP-split
    # widths): at TP2 + SP; Granite-MoE SWA (its experts under transformers 5's names, a shared MLP): TP2 + SP + EP2
    "granite_swa": ("granite_swa", {}),
    "hyperclovax": ("hyperclovax", {}),
    "bitnet": ("bitnet", {}),
    "granitemoe_swa": ("granitemoe_swa", {}),
    # NOTE: DiffLlama (differential attention: heads paired across the halves, the lambdas' gradients summed over TP)
    "diffllama": ("diffllama", {}),
    # NOTE: MiniMax (lightning-attention layers, the norm over all heads split over TP; residuals after the norms,
    # scaled; softmax top-2 experts): at TP2 + SP + EP2 and CP2
    "minimax": ("minimax", {}),
    # NOTE: Persimmon (q / k LayerNorms with biases over TP-split heads, relu2), CodeGen (q / v / k fused by shards),
    # GPT-Neo (unscaled scores, windowed local layers, out_proj's bias beside unbiased q / k / v) and OPT (positions
    # two rows down their table), GPT-NeoX-Japanese (the last layer's dense_bias alone): at TP2 + SP
    "persimmon": ("persimmon", {}),
    "codegen": ("codegen", {}),
    "gpt_neo": ("gpt_neo", {}),
    "opt": ("opt", {}),
    "gpt_neox_japanese": ("gpt_neox_japanese", {}),
    # NOTE: BioGPT / XGLM (OPT's bridge; the token embedding scaled, XGLM's fixed sinusoidal table): at TP2 + SP
    "biogpt": ("biogpt", {}),
    "xglm": ("xglm", {}),
    # NOTE: Kolibri-1 (sandwich norms, a NoPE full layer, the top k of the logits plus a bias weighted by their
    # sigmoid, a shared MLP) and Aria's text model (experts stacked and transposed on disk, shared experts): at TP2 +
    # SP + EP2
    "kolibri1": ("kolibri1", {}),
    "aria_text": ("aria_text", {}),
    # NOTE: Laguna (a head count per layer, a softplus gate per head channel, a rope per layer type, sigmoid routing
    # plus a fixed bias, a shared expert): at TP2 + SP + EP2
    "laguna": ("laguna", {"gating": "per-element"}),
    # NOTE: LaraMini (Gated DeltaNet from one fused in_proj, a windowed rotary layer and a NoPE one, softmax top-k
    # experts stacked on disk, an ungated shared expert): at TP2 + SP + EP2
    "lara_mini": ("lara_mini", {}),
    # NOTE: Emu3's, Gemma 4 Unified's and Cohere Compass's language models (Llama's layout; Gemma 4's text model;
    # Cohere2's layer with rotate-half rope on the sliding layers only): at TP2 + SP
    "emu3": ("emu3", {}),
    "gemma4_unified": ("gemma4_unified", {}),
    "cohere_compass": ("cohere_compass", {}),
}
MOE = ("deepseek_v3", "deepseek_v3_halves", "deepseek_v2", "qwen3_moe", "mixtral", "glm4_moe", "qwen2_moe",
       "gpt_oss", "granitemoe", "ernie4_5_moe", "olmoe", "llama4")
DENSE = ("qwen3_tied", "qwen2", "llama3", "phi3", "smollm3", "gemma3", "granite", "olmo2", "olmo3", "gemma",
         "gemma2", "ministral", "seed_oss", "arcee",
         "helium", "ernie4_5", "glm4", "exaone4", "starcoder2", "gpt_neox", "cohere", "cohere2", "phi", "gptj",
         "stablelm", "stablelm_sequential", "falcon", "falcon_sequential", "gpt2", "gpt_bigcode_mha")
MQA = ("falcon_mqa", "gpt_bigcode")  # NOTE: one KV head, replicated on each TP rank (parallel/kv_replicas.py)
DELTANET = ("qwen3_5",)  # NOTE: Gated DeltaNet layers (under CP: parallel/delta_rule_cp.py)
DELTANET_MOE = ("qwen3_next", "qwen3_5_moe")
# NOTE: TP2 without SP (an all-reduce where SP scatters): Llama's layout and the layers of their own code (side by side,
# post norms, soft caps, learned positions, Gated DeltaNet); every DENSE one runs at TP2 + SP (CI time)
TP2_NO_SP = ("llama3", "gemma2", "gemma3", "olmo2", "cohere", "phi", "gptj", "stablelm", "falcon", "gpt_neox", "gpt2",
             "qwen3_5")
# name -> (processes, layout, checkpoints)
LAYOUTS = {
    "tp1": (1, {}, MOE + DENSE + MQA + DELTANET + DELTANET_MOE),
    "tp2_sp_etp1": (2, {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1}, MOE),
    "tp2_sp_ep2": (2, {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2,
                       "expert_tensor_parallel_size": 1},
                   MOE + ("qwen3_next", "minimax_m2", "dots1", "hunyuan_v1_moe", "flex_olmo", "granitemoeshared",
                          "phimoe", "cohere2_moe", "afmoe", "glm4_moe_lite", "mistral4", "exaone_moe",
                          "solar_open", "dbrx", "deepseek_v32", "glm_moe_dsa", "mimo_v2_flash", "kimi_linear",
                          "hy_v3", "mellum", "flint", "axk1", "axk2", "granitemoe_swa", "minimax", "kolibri1",
                          "aria_text", "laguna", "lara_mini")),
    "cp2": (2, {"context_parallel_size": 2}, MOE + DENSE + MQA + DELTANET + ("kimi_linear", "mimo_v2_flash",
                                                                             "deepseek_v32", "glm_moe_dsa",
                                                                             "minimax")),
    "cp2_ep2": (2, {"context_parallel_size": 2, "expert_parallel_size": 2}, MOE),
    "tp2": (2, {"tensor_parallel_size": 2}, TP2_NO_SP),
    "tp2_sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": True},  # MoE: experts split too
               MOE + DENSE + DELTANET + MQA + ("glm", "olmo", "nemotron", "hunyuan_v1_dense", "apertus", "exaone",
                                               "jais2", "minicpm3", "ministral3", "vaultgemma", "cwm",
                                               "nanochat", "apertus1p5", "youtu", "granite_swa", "hyperclovax",
                                               "bitnet", "diffllama", "persimmon", "codegen", "gpt_neo", "opt",
                                               "gpt_neox_japanese", "biogpt", "xglm", "emu3", "gemma4_unified",
                                               "cohere_compass")),
}
# NOTE: the pad id as a real token (_gradients.with_pad_tokens)
PAD_LAYOUTS = {
    "tp1_pad": (1, {}, ("qwen3_tied_pad150", "llama3", "gemma", "gpt2")),
    "tp2_sp_pad": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}, ("qwen3_tied_pad150", "llama3")),
    "pp2_pad": (2, {"pipeline_parallel_size": 2}, ("qwen3_tied_pad150", "llama3")),  # NOTE: the engine's step
    "cp2_pad": (2, {"context_parallel_size": 2}, ("qwen3_tied_pad150", "llama3")),
}
ENGINE_LAYOUTS = ("pp2_pad", "cp2_pad")  # NOTE: the training engine's gradients (_gradients._save_engine_gradients)
CASES = [(layout, model) for layout, (_, _, models) in {**LAYOUTS, **PAD_LAYOUTS}.items() for model in models]
TOL = 1e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("grads")
    folders = {n: str(make_tiny_checkpoint(base / n, arch, tokenizer=False, **kw))
               for n, (arch, kw) in CHECKPOINTS.items()}
    layouts = {**LAYOUTS, **PAD_LAYOUTS}
    out = {}
    for size in sorted({s for s, _, _ in layouts.values()}):
        cases = [(f"{layout}/{model}", folders[model], kw, layout in PAD_LAYOUTS)
                 for layout, (s, kw, models) in layouts.items() if s == size for model in models]
        engine = tuple(case for case, *_ in cases if case.split("/")[0] in ENGINE_LAYOUTS)
        out.update(run_distributed(gradient_checks, size, cases, engine=engine, timeout=600)[0])
    return out


@pytest.mark.parametrize("layout, model", CASES, ids=[f"{layout}-{model}" for layout, model in CASES])
def test_gradients_match_transformers(results, layout, model):
    res = results[f"{layout}/{model}"]
    assert not res["missing"], res["missing"]
    worst = max(res["diffs"].items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, (worst, sorted(res["diffs"].items(), key=lambda kv: -kv[1])[:5])
