"""Tiny random checkpoints in the hub's on-disk format, written by ``transformers`` itself (no download).

Sizes are chosen to exercise what the bridges must get right: GQA (heads != KV heads), head_dim != hidden/heads for
Qwen3, several safetensors shards, vocab not a multiple of 128 (so padding is tested), odd layer counts on request.
MoE models have a dense first layer where the architecture allows one, 4-8 experts, and router weights large enough
that no two experts tie for a token (a near tie could flip with summation order and make parity flaky);
DeepSeek-V3's, ERNIE 4.5 MoE's, MiniMax-M2's and dots.llm1's ``e_score_correction_bias`` is random too, and
``mtp_layers`` appends multi-token-prediction tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_hybrids import HYBRID_ARCHS, hybrid_config
from loongforge_hf.testing.tiny_deepseek_v4 import V4_ARCHS, v4_config, randomize as v4_randomize
from loongforge_hf.testing.tiny_hy_v4 import HY_V4_ARCHS, hy_v4_config, randomize as hy_v4_randomize
from loongforge_hf.testing.tiny_classic import CLASSIC_ARCHS, CLASSIC_BIASED, VLM_TEXT_NOT_AUTO, classic_config
from loongforge_hf.testing.tiny_mla_moe import MLA_MOE_ARCHS, mla_moe_config
from loongforge_hf.testing.tiny_mamba import MAMBA_ARCHS, mamba_config
from loongforge_hf.testing.tiny_minimax import MINIMAX_ARCHS, minimax_config
from loongforge_hf.testing.tiny_dense_small import DENSE_SMALL_ARCHS, dense_small_config
from loongforge_hf.testing.tiny_lfm3 import LFM3_ARCHS, lfm3_config
from loongforge_hf.testing.tiny_kolibri_aria import KOLIBRI_ARIA_ARCHS, kolibri_aria_config
from loongforge_hf.testing.tiny_jetmoe import JETMOE_ARCHS, jetmoe_config
from loongforge_hf.testing.tiny_recurrent_gemma import RECURRENT_GEMMA_ARCHS, recurrent_gemma_config
from loongforge_hf.testing.tiny_laguna import LAGUNA_ARCHS, laguna_config

TINY_ARCHS = ("llama", "llama3", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral", "deepseek_v3",
              "deepseek_v2", "glm4_moe", "qwen2_moe", "smollm3", "gemma3",
              "granite", "olmo2", "olmo3", "gemma", "gemma2", "ministral", "seed_oss",
              "arcee", "helium", "ernie4_5", "gpt_oss", "glm4", "granitemoe", "starcoder2",
              "exaone4", "ernie4_5_moe", "olmoe", "gpt_neox", "cohere", "cohere2", "phi", "gptj", "stablelm",
              "llama4", "falcon", "falcon_mqa", "gpt2", "gpt_bigcode", "gpt_bigcode_mha", "qwen3_5",
              "qwen3_next", "qwen3_5_moe", "minimax_m2", "glm", "olmo", "nemotron", "dots1", "hunyuan_v1_moe",
              "granitemoehybrid", "hunyuan_v1_dense", "apertus", "lfm2", "lfm2_moe",
              "flex_olmo", "granitemoeshared", "exaone", "bamba", "nemotron_h",
              "phimoe", "jais2", "cohere2_moe", "afmoe", "gemma4", "glm4_moe_lite", "mistral4", "minicpm3",
              "deepseek_v32", "glm_moe_dsa",
              "falcon_h1", "olmo_hybrid", "gemma4_moe", "exaone_moe", "solar_open", "dbrx", "mimo_v2_flash",
              "ministral3", "vaultgemma", "cwm", "nanochat", "kimi_linear", "apertus1p5", "youtu", "hy_v3", "mellum",
              "flint", *V4_ARCHS, *MAMBA_ARCHS, *MLA_MOE_ARCHS, *DENSE_SMALL_ARCHS, *CLASSIC_ARCHS, *MINIMAX_ARCHS,
              *HY_V4_ARCHS, *KOLIBRI_ARIA_ARCHS, *LFM3_ARCHS, *JETMOE_ARCHS, *RECURRENT_GEMMA_ARCHS, *LAGUNA_ARCHS)

# Phi-3.5 / Phi-4-mini's LongRoPE for the tiny Phi-3 (make_tiny_checkpoint(..., "phi3", **PHI3_LONGROPE)), shrunk:
# short factors up to 32 positions, an attention factor of sqrt(1 + ln(128 / 32) / ln(32)) = 1.18
PHI3_LONGROPE = dict(original_max_position_embeddings=32, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 32, "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})
# linears' biases randomised in the tiny checkpoints
_RANDOM_BIASES = ("gpt_oss", "starcoder2", "gpt_neox", "phi", "gptj", "stablelm", "falcon", "gpt2", "gpt_bigcode",
                  "solar_open", "glm", "nemotron", "granitemoehybrid", "lfm2", "bamba", "nemotron_h", "phimoe",
                  "jais2", "falcon_h1", "jetmoe", *MAMBA_ARCHS, *CLASSIC_BIASED, *RECURRENT_GEMMA_ARCHS)
# causal LMs that transformers' AutoModelForCausalLM does not map (Mistral Small 4 ships as an image-text model)
_NOT_AUTO = {"mistral4": "Mistral4ForCausalLM", **VLM_TEXT_NOT_AUTO}
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            moe_intermediate_size=32, first_k_dense_replace=1)


def _config(arch: str, **overrides):
    import transformers as tf

    common = dict(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "llama3":
        cfg = tf.LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                        "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 32})
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**{**common, "head_dim": 24})
    elif arch == "mistral":
        cfg = tf.MistralConfig(**{**common, "sliding_window": 6})
    elif arch == "phi3":
        # NOTE: Phi-4-mini's partial rotary (0.75 of each head) and a sliding window that binds at the tests' lengths
        cfg = tf.Phi3Config(**common, sliding_window=7, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                         "partial_rotary_factor": 0.75})
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{**common, "head_dim": 24}, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=[0])
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(**{**common, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2)
    elif arch == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**{**common, **_MLA}, q_lora_rank=32, n_routed_experts=8, n_shared_experts=1,
                                  num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, rope_interleave=True)
    elif arch == "deepseek_v2":
        cfg = tf.DeepseekV2Config(**{**common, **_MLA}, q_lora_rank=None, n_routed_experts=4, n_shared_experts=2,
                                  num_experts_per_tok=2, topk_method="greedy", routed_scaling_factor=1.5)
    elif arch == "glm4_moe_lite":
        # NOTE: GLM-4.7-Flash's rms_norm_eps (its latent norms keep 1e-6); dense / sparse from mlp_layer_types
        mla = {k: v for k, v in _MLA.items() if k != "first_k_dense_replace"}
        cfg = tf.Glm4MoeLiteConfig(**{**common, **mla, "rms_norm_eps": 1e-5}, q_lora_rank=32, n_routed_experts=8,
                                   n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                                   routed_scaling_factor=1.8, norm_topk_prob=True,
                                   mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    elif arch in ("deepseek_v32", "glm_moe_dsa"):
        # NOTE: DeepSeek Sparse Attention: each query keeps the top 4 keys (tests run 12 tokens); V3.2 with YaRN and
        # its rotary halves in the indexer, GLM-5 with rms_norm_eps 1e-5, pairs and layers reusing an earlier top-k
        dsa = dict(q_lora_rank=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4,
                   routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=4, index_head_dim=16, index_n_heads=4)
        if arch == "deepseek_v32":
            cfg = tf.DeepseekV32Config(**{**common, **_MLA}, **dsa, n_group=4, topk_group=2, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0})
        else:
            cfg = tf.GlmMoeDsaConfig(**{**common, **_MLA, "rms_norm_eps": 1e-5}, **dsa, n_group=1, topk_group=1,
                                     indexer_types=["full", "shared", "full", "shared"])
    elif arch == "mistral4":
        # NOTE: softmax routing, YaRN over the rotary third of each 24-dim query head, Llama 4's query scale (1 below
        # original_max_position_embeddings)
        cfg = tf.Mistral4Config(**{**common, **_MLA}, q_lora_rank=32, n_routed_experts=8, n_shared_experts=1,
                                num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.5,
                                norm_topk_prob=True, rope_parameters={
                                    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
                                    "partial_rotary_factor": 8 / 24})
    elif arch == "minicpm3":
        # NOTE: dense MLA with rotary halves, muP's three scales, tied embeddings, LongRoPE's short factors
        mla = {k: v for k, v in _MLA.items() if k not in ("first_k_dense_replace", "moe_intermediate_size")}
        cfg = tf.MiniCPM3Config(**{**common, **mla, "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
                                q_lora_rank=32, scale_emb=12, scale_depth=1.4, dim_model_base=16, rope_parameters={
                                    "rope_type": "longrope", "rope_theta": 10000.0,
                                    "original_max_position_embeddings": 128, "short_factor": [1.0, 1.2, 1.7, 2.5],
                                    "long_factor": [1.0, 1.5, 2.5, 4.0]})
    elif arch == "smollm3":
        # NOTE: layers 1 and 3 without rotary embedding (SmolLM3-3B: every fourth)
        cfg = tf.SmolLM3Config(**common, no_rope_layer_interval=2)
    elif arch == "qwen2_moe":
        # NOTE: Qwen1.5-MoE's softmax routing without renormalisation, a gated shared expert, a dense first layer
        cfg = tf.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1,
                                mlp_only_layers=[0])
    elif arch == "glm4_moe":
        # NOTE: GLM-4.5's q/k/v biases and half-rotary heads (head_dim 24: not hidden / heads); DeepSeek-V3's routing
        cfg = tf.Glm4MoeConfig(**{**common, "head_dim": 24}, attention_bias=True, moe_intermediate_size=32,
                               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
                               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5})
    elif arch == "gemma":
        # NOTE: head_dim 24 (Gemma: 256, not hidden / heads), tied embeddings
        cfg = tf.GemmaConfig(**{**common, "head_dim": 24, "tie_word_embeddings": True})
        cfg.architectures = ["GemmaForCausalLM"]
    elif arch == "gemma2":
        # NOTE: Gemma 2's layout shrunk: a binding 5-token window on every other layer, head_dim 24 and
        # query_pre_attn_scalar 20, score and logit soft-capping that bind at the tiny model's magnitudes
        cfg = tf.Gemma2Config(**{**common, "head_dim": 24, "tie_word_embeddings": True}, sliding_window=5,
                              query_pre_attn_scalar=20, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
        cfg.architectures = ["Gemma2ForCausalLM"]
    elif arch == "gemma3":
        # NOTE: Gemma 3's layout shrunk: a binding 5-token window on layers 0, 1, 3 (pattern 3), head_dim 24 and
        # query_pre_attn_scalar 20 (neither hidden / heads), and the 4B+ models' linear scaling on the full layers'
        # rope (their base 1e6, the sliding layers' 1e4); tied embeddings, as every Gemma 3
        cfg = tf.Gemma3TextConfig(**{**common, "head_dim": 24, "tie_word_embeddings": True}, sliding_window=5,
                                  sliding_window_pattern=3, query_pre_attn_scalar=20,
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1000000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 10000.0}})
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif arch in ("gemma4", "gemma4_moe"):
        # NOTE: Gemma 4 31B's text layout shrunk: a binding 5-token window on layers 0 and 2, full layers with a
        # larger head (32, the sliding ones' 16), fewer KV heads (2, the sliding ones' 4) and values from the key
        # projection (attention_k_eq_v), proportional rope there (half of each head rotating), a logit cap that
        # binds; no per-layer inputs. gemma4_moe: 26B-A4B's MoE block shrunk (its 128 experts, top 8, of 704 beside
        # a dense MLP of 2112: 8 experts, top 2, of 32 beside one of 96)
        moe = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32) \
            if arch == "gemma4_moe" else {}
        cfg = tf.Gemma4TextConfig(**{**common, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
                                     "tie_word_embeddings": True}, global_head_dim=32, num_global_key_value_heads=2,
                                  attention_k_eq_v=True, **moe,
                                  hidden_size_per_layer_input=0, sliding_window=5, final_logit_softcapping=3.0,
                                  layer_types=["sliding_attention", "full_attention"] * 2,
                                  rope_parameters={"full_attention": {"rope_type": "proportional",
                                                                      "partial_rotary_factor": 0.5,
                                                                      "rope_theta": 1000000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 10000.0}})
        cfg.architectures = ["Gemma4ForCausalLM"]
    elif arch == "olmo2":
        cfg = tf.Olmo2Config(**common)
    elif arch == "olmo_hybrid":
        # NOTE: OLMo Hybrid's layout shrunk: Gated DeltaNet layers 0, 2, 3 (2 key heads serving 4 value heads of
        # another size, beta doubled: linear_allow_neg_eigval) and an OLMo 3 style full-attention layer 1 without
        # rotary embedding (the released checkpoints'); A from [0.1, 2] so the recurrent state outlives a few tokens
        cfg = tf.OlmoHybridConfig(**common, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                  linear_value_head_dim=12, linear_conv_kernel_dim=4, linear_a_log_min=0.1,
                                  linear_a_log_max=2.0, rope_parameters={"rope_type": "default", "rope_theta": None},
                                  layer_types=["linear_attention", "full_attention", "linear_attention",
                                               "linear_attention"])
        cfg.architectures = ["OlmoHybridForCausalLM"]
    elif arch == "kimi_linear":
        # NOTE: Kimi Linear's layout shrunk: KDA layers 0, 2, 3 (4 heads of 16; HF's A_log / dt_bias init, a forget
        # gate randomised below so the decay varies by token and channel), a NoPE MLA layer 1 (no q_lora_rank, as the
        # released model), a dense first layer, then 4 sigmoid-routed experts in 2 groups with a bias, a shared expert
        kw = {k: v for k, v in common.items() if k != "num_key_value_heads"}
        cfg = tf.KimiLinearConfig(**kw, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
                                  qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, num_local_experts=4,
                                  num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                  routed_scaling_factor=2.5, linear_num_heads=4, linear_head_dim=16,
                                  linear_conv_kernel_dim=4,
                                  layer_types=["linear_attention", "full_attention", "linear_attention",
                                               "linear_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3)
        cfg.architectures = ["KimiLinearForCausalLM"]
    elif arch == "olmo3":
        # NOTE: OLMo 3's layout shrunk: a binding 5-token window on layers 0, 1, 3, YaRN on the full layer's rope (its
        # attention factor 1.14)
        kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        cfg = tf.Olmo3Config(**common, sliding_window=5, layer_types=kinds,
                             rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 32,
                                                                 "rope_theta": 500000.0},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})
    elif arch == "ministral":
        # NOTE: a binding 5-token window on layers 0 and 2 only (Ministral's layer_types); head_dim given (transformers
        # reads it, Ministral's config leaves it None)
        cfg = tf.MinistralConfig(**{**common, "head_dim": 16}, sliding_window=5,
                                 layer_types=["sliding_attention", "full_attention"] * 2)
    elif arch == "ministral3":
        # NOTE: Ministral 3's YaRN shrunk (factor 4 over 32 positions; mscale / mscale_all_dim 1 / 0.5: an attention
        # factor of 1.06, the hub's is 1) and Llama 4's query scale, 1 below original_max_position_embeddings
        cfg = tf.Ministral3Config(**{**common, "head_dim": 24}, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5, "llama_4_scaling_beta": 0.1})
    elif arch == "vaultgemma":
        # NOTE: Gemma 2's tiny layout without the post norms: a binding 5-token window on every other layer, score and
        # logit soft-capping that bind
        cfg = tf.VaultGemmaConfig(**{**common, "head_dim": 24, "tie_word_embeddings": True}, sliding_window=5,
                                  query_pre_attn_scalar=20, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    elif arch == "cwm":
        # NOTE: a binding 5-token window on layers 1-3 (CWM's every fourth layer full), llama3 rope scaling shrunk
        cfg = tf.CwmConfig(**{**common, "head_dim": 16}, sliding_window=5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    elif arch == "nanochat":
        # NOTE: norms without weights (one on the embedding too), flipped rotary signs, q / k norms after the
        # rotation, an ungated relu2 MLP, a logit soft-cap that binds at the tiny model's magnitudes
        cfg = tf.NanoChatConfig(**common, final_logit_softcapping=3.0)
    elif arch == "seed_oss":
        # NOTE: q/k/v biases, head_dim 24 (Seed-OSS: 128, not hidden / heads); dropouts off (parity runs train too)
        cfg = tf.SeedOssConfig(**{**common, "head_dim": 24}, attention_dropout=0.0, residual_dropout=0.0)
    elif arch == "arcee":
        cfg = tf.ArceeConfig(**common)  # NOTE: relu2, an MLP without a gate
    elif arch == "starcoder2":
        # NOTE: StarCoder2's layout shrunk: LayerNorms (norm_epsilon), biases on every linear and norm (randomised in
        # make_tiny_checkpoint), an ungated gelu-tanh MLP, a binding 5-token window on every layer, tied embeddings
        cfg = tf.Starcoder2Config(**{**{k: v for k, v in common.items() if k != "rms_norm_eps"},
                                     "tie_word_embeddings": True}, norm_epsilon=1e-5, sliding_window=5,
                                  rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    elif arch == "gpt_neox":
        # NOTE: Pythia's layout shrunk: parallel residual, LayerNorms and linears with biases (randomised in
        # make_tiny_checkpoint), q / k / v fused per head (no GQA), a quarter of each head rotated, exact GELU
        cfg = tf.GPTNeoXConfig(**{k: v for k, v in common.items() if k not in ("rms_norm_eps", "num_key_value_heads")},
                               layer_norm_eps=1e-5, hidden_act="gelu", use_parallel_residual=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25})
    elif arch in ("cohere", "cohere2"):
        # NOTE: Command-R's layout shrunk: one LayerNorm (no bias) before the attention and the MLP side by side,
        # interleaved rotary pairs, tied embeddings, logits scaled by 0.3; Cohere: Command R+'s per-head q / k norms;
        # Cohere2: Command R7B's binding window (5 tokens) on layers 0-2 and a full layer without rotary embedding
        kw = dict(**{**{k: v for k, v in common.items() if k != "rms_norm_eps"}, "tie_word_embeddings": True},
                  layer_norm_eps=1e-5, logit_scale=0.3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cfg = tf.CohereConfig(**kw, use_qk_norm=True) if arch == "cohere" else tf.Cohere2Config(
            **kw, sliding_window=5, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    elif arch == "phi":
        # NOTE: phi-2's layout shrunk: one LayerNorm before the attention and the MLP side by side, biases on every
        # linear and the LM head (randomised in make_tiny_checkpoint), 0.4 of each 20-channel head rotated (8), gelu_new
        cfg = tf.PhiConfig(**{**{k: v for k, v in common.items() if k != "rms_norm_eps"}, "hidden_size": 80},
                           layer_norm_eps=1e-5, resid_pdrop=0.0, embd_pdrop=0.0,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.4})
    elif arch == "gptj":
        # NOTE: GPT-J-6B's layout shrunk: one LayerNorm (ln_1) before the attention and the MLP side by side, biases on
        # the MLP and the LM head only (randomised in make_tiny_checkpoint), 6 of each 16-channel head rotated in
        # interleaved pairs, gelu_new
        cfg = tf.GPTJConfig(vocab_size=203, n_positions=128, n_embd=64, n_layer=4, n_head=4, rotary_dim=6, n_inner=96,
                            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            layer_norm_epsilon=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    elif arch == "gpt2":
        # NOTE: GPT-2's layout shrunk: learned absolute positions (128), Conv1D weights ([in, out]), c_attn packing
        # q / k / v, LayerNorms and biases on every linear (randomised in make_tiny_checkpoint), gelu_new, tied
        # embeddings
        cfg = tf.GPT2Config(vocab_size=203, n_positions=128, n_embd=64, n_layer=4, n_head=4, n_inner=96,
                            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            layer_norm_epsilon=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
        cfg.architectures = ["GPT2LMHeadModel"]
    elif arch in ("gpt_bigcode", "gpt_bigcode_mha"):
        # NOTE: gpt_bigcode: StarCoder's layout shrunk: GPT-2's layer with nn.Linear weights, multi-query attention
        # (c_attn [q of every head, k, v]), learned positions (128), gelu_pytorch_tanh, tied embeddings (biases
        # randomised in make_tiny_checkpoint); gpt_bigcode_mha: without multi_query (c_attn [head, (q, k, v)]), an
        # untied LM head
        mqa = arch == "gpt_bigcode"
        cfg = tf.GPTBigCodeConfig(vocab_size=203, n_positions=128, n_embd=64, n_layer=4, n_head=4, n_inner=96,
                                  activation_function="gelu_pytorch_tanh", resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, layer_norm_epsilon=1e-5, multi_query=mqa, tie_word_embeddings=mqa,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
        cfg.architectures = ["GPTBigCodeForCausalLM"]
    elif arch == "stablelm":
        # NOTE: StableLM 2 12B's layout shrunk, with 1.6B's q / k / v biases: LayerNorms, one before the attention and
        # the MLP side by side, per-head q / k LayerNorms, a quarter of each head rotated, GQA
        cfg = tf.StableLmConfig(**{k: v for k, v in common.items() if k != "rms_norm_eps"}, layer_norm_eps=1e-5,
                                use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.25})
    elif arch in ("falcon", "falcon_mqa"):
        # NOTE: falcon: Falcon-40B's layout shrunk (2 KV groups fused as [group, (q, q, k, v)], ln_attn / ln_mlp both
        # reading the layer input), with biases on every linear (the hub's have none; randomised in
        # make_tiny_checkpoint) and tied embeddings; falcon_mqa: Falcon-7B's (one input_layernorm before the
        # attention and the MLP side by side, multi-query attention: one KV head), no biases, an untied LM head
        kw = dict(vocab_size=203, hidden_size=64, ffn_hidden_size=96, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=128, layer_norm_epsilon=1e-5, activation="gelu", bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cfg = tf.FalconConfig(**kw, new_decoder_architecture=True, num_kv_heads=2, bias=True,
                              tie_word_embeddings=True) if arch == "falcon" else tf.FalconConfig(
            **kw, new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
            tie_word_embeddings=False)
    elif arch == "helium":
        cfg = tf.HeliumConfig(**{**common, "head_dim": 16})  # NOTE: interleaved rotary pairs
    elif arch == "ernie4_5":
        cfg = tf.Ernie4_5Config(**{**common, "head_dim": 24})  # NOTE: interleaved rotary pairs
    elif arch == "gpt_oss":
        # NOTE: gpt-oss's layout shrunk: a binding 5-token window on every other layer, YaRN as the hub's (truncate
        # off) over 32 original positions, 4 experts (top 2), and a swiglu_limit that binds at the tiny model's
        # magnitudes (biases, sinks and router are randomised in make_tiny_checkpoint)
        cfg = tf.GptOssConfig(**{**common, "intermediate_size": 48, "head_dim": 16}, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.3,
                              layer_types=["sliding_attention", "full_attention"] * 2,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 32})
    elif arch == "glm4":
        # NOTE: GLM-4-0414's layout: q/k/v biases, head_dim 24, half of each head rotated in interleaved pairs, the
        # sandwich norms, gate_up_proj packed
        cfg = tf.Glm4Config(**{**common, "head_dim": 24}, attention_bias=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5})
    elif arch == "glm":
        # NOTE: GLM-4-9B's layout: q/k/v biases (randomised in make_tiny_checkpoint), head_dim 24, half of each head
        # rotated in interleaved pairs, gate_up_proj packed, no post norms
        cfg = tf.GlmConfig(**{**common, "head_dim": 24}, attention_bias=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5})
    elif arch == "olmo":
        # NOTE: OLMo's layout: norms without weight or bias, q / k / v clamped at 0.25 (OLMo-7B-0424: 8.0), which
        # binds for about one entry in ten at the tiny model's magnitudes
        cfg = tf.OlmoConfig(**{k: v for k, v in common.items() if k != "rms_norm_eps"}, clip_qkv=0.25)
    elif arch == "nemotron":
        # NOTE: Minitron's layout shrunk: LayerNorm1P (weight stored minus one, around 0 here) with biases, an ungated
        # relu2 MLP, half of each head rotated in rotate-half pairs, head_dim 24 (not hidden / heads)
        cfg = tf.NemotronConfig(**{**{k: v for k, v in common.items() if k != "rms_norm_eps"}, "head_dim": 24},
                                norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                "partial_rotary_factor": 0.5})
    elif arch == "exaone":
        # NOTE: EXAONE 3.5's layout shrunk (Llama's under GPT-2-style names), llama3 rope scaling; architectures as
        # the hub's (transformers writes LlamaForCausalLM: make_tiny_checkpoint puts the hub's name back)
        cfg = tf.ExaoneConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 1000000.0,
                                                         "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 32})
    elif arch == "exaone4":
        # NOTE: EXAONE-4.0-32B's layout shrunk: post norms only, per-head q / k norms, a binding 5-token window on
        # layers 0-2 and a full layer without rotary embedding (layer 3), llama3 rope scaling
        cfg = tf.Exaone4Config(**{**common, "head_dim": 24}, sliding_window=5, sliding_window_pattern=4,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32})
    elif arch == "granitemoe":
        # NOTE: granite-3.1-3b-a800m's multipliers and a mixture of 4 experts (top 2) in every layer, stacked on disk
        cfg = tf.GraniteMoeConfig(**{**common, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
                                  embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1,
                                  logits_scaling=6.0)
    elif arch == "granitemoeshared":
        # NOTE: Granite MoE's tiny layout (granitemoe's multipliers, 4 experts, top 2) with a shared MLP of 48
        cfg = tf.GraniteMoeSharedConfig(**{**common, "intermediate_size": 48}, num_local_experts=4,
                                        num_experts_per_tok=2, shared_intermediate_size=48, embedding_multiplier=12.0,
                                        residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=6.0)
    elif arch == "ernie4_5_moe":
        # NOTE: ERNIE-4.5-21B-A3B's layout shrunk: tied embeddings, a dense first and last layer (start / end index),
        # 8 experts (top 3) and 2 shared ones in between; its e_score_correction_bias is randomised in
        # make_tiny_checkpoint, large enough to change some tokens' experts
        cfg = tf.Ernie4_5_MoeConfig(**{**common, "tie_word_embeddings": True}, moe_num_experts=8, moe_k=3,
                                    moe_intermediate_size=32, moe_num_shared_experts=2, moe_layer_start_index=1,
                                    moe_layer_end_index=2)
    elif arch == "olmoe":
        # NOTE: OLMoE-1B-7B's layout shrunk: q / k norms over all heads (GQA here, so the k norm is narrower), 8
        # experts (top 3) in every layer, softmax scores not renormalised (norm_topk_prob off, as the hub's)
        cfg = tf.OlmoeConfig(**{**common, "intermediate_size": 32}, num_experts=8, num_experts_per_tok=3,
                             norm_topk_prob=False)
    elif arch == "flex_olmo":
        # NOTE: FlexOlmo-7x7B's layout shrunk: OLMo 2's post norms and q / k norms over all heads (the k norm over the
        # 2 kv heads), 8 experts (top 3) in every layer, softmax scores not renormalised (as the hub's)
        cfg = tf.FlexOlmoConfig(**{**common, "intermediate_size": 32}, num_experts=8, num_experts_per_tok=3,
                                norm_topk_prob=False)
    elif arch == "minimax_m2":
        # NOTE: MiniMax-M2's layout shrunk: q / k norms over all heads (GQA here, so the k norm is narrower), half of
        # each head rotary (rotary_dim 12 of 24, as 64 of 128), 8 experts (top 3) in every layer, sigmoid routing on
        # the scores plus an e_score_correction_bias randomised below (large enough to change some tokens' experts)
        cfg = tf.MiniMaxM2Config(**{**common, "intermediate_size": 32, "head_dim": 24}, rotary_dim=12,
                                 num_local_experts=8, num_experts_per_tok=3)
    elif arch == "jais2":
        # NOTE: Jais-2's layout shrunk: LayerNorms, biases on q / k / v / o and up / down, an ungated relu2 MLP
        cfg = tf.Jais2Config(**{k: v for k, v in common.items() if k != "rms_norm_eps"}, layer_norm_eps=1e-5)
    elif arch == "phimoe":
        # NOTE: Phi-3.5-MoE's layout shrunk: LayerNorms, q / k / v / o and LM-head biases, 4 experts (top 2) by
        # sparsemixer with a jitter (relative logit window) wide enough to mask some experts, LongRoPE's fixed mscale
        cfg = tf.PhimoeConfig(**{**common, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
                              attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3,
                              input_jitter_noise=0.01, rope_parameters={
                                  "rope_type": "longrope", "rope_theta": 10000.0, "short_mscale": 1.2,
                                  "long_mscale": 1.2, "original_max_position_embeddings": 32,
                                  "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.0, 5.0],
                                  "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]})
    elif arch == "cohere2_moe":
        # NOTE: Command A MoE's layout shrunk: Cohere2's layer (one LayerNorm before the attention and the MLP side by
        # side, interleaved rotary pairs, tied embeddings, logits scaled by 0.3), a dense first full layer that rotates
        # (transformers' force_rope) and is wider (prefix_dense_intermediate_size), a binding 5-token window on layers
        # 1 and 2, a full layer 3 without rotary embedding; 4 experts (top 2, softmax) and a shared one, averaged
        cfg = tf.Cohere2MoeConfig(**{**{k: v for k, v in common.items() if k != "rms_norm_eps"}, "head_dim": 16,
                                     "intermediate_size": 32, "tie_word_embeddings": True},
                                  layer_norm_eps=1e-5, logit_scale=0.3, sliding_window=5,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                  layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                               "full_attention"],
                                  mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                                  prefix_dense_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                                  num_shared_experts=1, shared_expert_combination_strategy="average")
    elif arch == "afmoe":
        # NOTE: Trinity's layout shrunk: gated attention with per-head q / k norms, norms before and after each
        # sublayer, a binding 5-token window on layers 0, 1, 3 (the only ones rotated), the full layer 2 without rotary
        # embedding, muP's scaled embedding, a dense first layer, 8 experts (top 3) by sigmoid scores plus an expert
        # bias randomised below, scaled by 2.5, and 2 shared ones
        cfg = tf.AfmoeConfig(**{**common, "head_dim": 16}, moe_intermediate_size=32, num_dense_layers=1,
                             num_experts=8, num_experts_per_tok=3, num_shared_experts=2, route_scale=2.5,
                             sliding_window=5, mup_enabled=True,
                             layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                          "sliding_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "dots1":
        # NOTE: dots.llm1's layout shrunk: Qwen3's per-head q / k norms (head_dim 24), a dense first layer, 8 experts
        # (top 3) and 2 shared ones, sigmoid routing on the scores plus an e_score_correction_bias randomised below,
        # renormalised and scaled by 2.5, no expert groups (as the hub's); a binding 5-token window on layers 2 and 3
        # (max_window_layers: the hub's models have none)
        cfg = tf.Dots1Config(**{**common, "head_dim": 24}, moe_intermediate_size=32, n_routed_experts=8,
                             n_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=True,
                             routed_scaling_factor=2.5, first_k_dense_replace=1, sliding_window=5, max_window_layers=2)
    elif arch == "exaone_moe":
        # NOTE: K-EXAONE's layout shrunk: pre-norm layers with per-head q / k norms, a binding 5-token window on
        # layers 0-2 and a full layer 3 without rotary embedding, a dense first layer (mlp_layer_types), 8 experts
        # (top 3) by sigmoid scores plus a bias randomised below, scaled by 2.5, 2 shared ones
        cfg = tf.ExaoneMoeConfig(**{**common, "head_dim": 24}, moe_intermediate_size=32, num_experts=8,
                                 num_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1,
                                 routed_scaling_factor=2.5, first_k_dense_replace=1, sliding_window=5,
                                 sliding_window_pattern=4, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0})
    elif arch == "mimo_v2_flash":
        # NOTE: MiMo-V2-Flash's layout shrunk: full layers 0 and 3 (2 KV heads), sliding layers 1 and 2 with twice the
        # KV heads, sinks and a binding 5-token window; value heads of 16 (q / k: 24) scaled by 0.6, a third of each
        # head rotary with a theta per layer type; a dense first layer, 8 experts (top 4 in 2 of 4 groups) by
        # sigmoid scores plus a bias randomised below, scaled by 2.5, no shared experts
        kw = {k: v for k, v in common.items() if k != "intermediate_size"}
        rope = {kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.334}
                for kind, theta in (("full_attention", 50000.0), ("sliding_attention", 1000.0))}
        cfg = tf.MiMoV2FlashConfig(**kw, intermediate_size=96, head_dim=24, v_head_dim=16, sliding_window=5,
                                   attention_value_scale=0.6, moe_intermediate_size=32, n_routed_experts=8,
                                   num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                   layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                "full_attention"], rope_parameters=rope)
    elif arch == "solar_open":
        # NOTE: Solar Open's layout shrunk: q / k / v biases (none on o_proj), head_dim 24, every layer sparse with
        # GLM-4.5's routing (8 experts, top 4 in 2 of 4 groups, a bias randomised below, scaled by 2.5), a shared one
        kw = {k: v for k, v in common.items() if k != "intermediate_size"}
        cfg = tf.SolarOpenConfig(**kw, head_dim=24, attention_bias=True, moe_intermediate_size=32,
                                 n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
                                 topk_group=2, routed_scaling_factor=2.5,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "dbrx":
        # NOTE: DBRX's layout shrunk: LayerNorms without bias, q / k / v fused in Wqkv (2 KV heads) and clamped at
        # 0.25 (about a tenth of the parity input's q / k / v values reach it), 8 experts (top 3) renormalised by their
        # 1-norm in every layer, stored as [8 * 32, 64]; transformers' balancing loss weighted by moe_loss_weight
        cfg = tf.DbrxConfig(d_model=64, n_heads=4, n_layers=4, max_seq_len=128, vocab_size=203, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                            attn_config={"kv_n_heads": 2, "clip_qkv": 0.25, "rope_theta": 10000.0},
                            ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 3,
                                        "moe_jitter_eps": 0, "moe_loss_weight": 0.05,
                                        "moe_normalize_expert_weights": 1.0},
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "hunyuan_v1_moe":
        # NOTE: Hunyuan-A13B's layout shrunk: per-head q / k norms after the rotation, the hub's fixed NTK-alpha rope,
        # 8 experts (top 3) of intermediate_size beside a shared MLP of that size, in every layer
        cfg = tf.HunYuanMoEV1Config(**{**common, "intermediate_size": 32, "head_dim": 24}, num_experts=8, moe_topk=3,
                                    rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                     "rope_theta": 10000.0})
    elif arch == "hunyuan_v1_dense":
        # NOTE: Hunyuan-7B's layout shrunk: per-head q / k norms after the rotation, the hub's fixed NTK-alpha rope
        cfg = tf.HunYuanDenseV1Config(**{**common, "head_dim": 24},
                                      rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                       "rope_theta": 10000.0})
    elif arch == "apertus":
        # NOTE: Apertus-8B's layout shrunk: per-head q / k norms, an ungated MLP with xIELU (its alpha_p / alpha_n
        # randomised in make_tiny_checkpoint), llama3 rope scaling
        cfg = tf.ApertusConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0,
                                                          "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 32})
    elif arch == "apertus1p5":
        # NOTE: Apertus 1.5's language model with a full-width LM head (output_vocab_size null): Apertus's layout
        cfg = tf.Apertus1p5TextConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0,
                                                                 "factor": 8.0, "low_freq_factor": 1.0,
                                                                 "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 32})
    elif arch == "youtu":
        # NOTE: Youtu-LLM's layout shrunk: dense MLA (q_lora_rank, rotary pairs on disk), tied embeddings; no pad id
        # (YoutuConfig's default): transformers 5.24's Youtu zeroes the pad row of every checkpoint it loads (its
        # _init_weights writes through .data), which would hide that row of a saved checkpoint from it. The other
        # fixtures' init range (YoutuConfig's 2 / sqrt(5 * hidden) gives logits of ~10, whose fp32 ulp is 1e-6)
        mla = {k: v for k, v in _MLA.items() if k not in ("first_k_dense_replace", "moe_intermediate_size")}
        cfg = tf.YoutuConfig(**{**common, **mla, "tie_word_embeddings": True, "pad_token_id": None}, q_lora_rank=32,
                             rope_interleave=True, initializer_range=0.02,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "hy_v3":
        # NOTE: Hy3's layout shrunk: per-head q / k norms (head_dim 24), a dense first layer (mlp_layer_types), 8
        # experts (top 3) by sigmoid scores plus a bias randomised below, renormalised and scaled by 2.5, 2 shared ones
        cfg = tf.HYV3Config(**{**common, "head_dim": 24}, num_experts=8, num_experts_per_tok=3, num_shared_experts=2,
                            moe_intermediate_size=32, router_scaling_factor=2.5,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "mellum":
        # NOTE: Mellum 2's layout shrunk: per-head q / k norms (head_dim 24), a binding 5-token window on layers 1 and
        # 2, a rope theta per layer type, a dense first layer, softmax top 3 of 8 experts renormalised
        cfg = tf.MellumConfig(**{**common, "head_dim": 24}, num_experts=8, num_experts_per_tok=3,
                              moe_intermediate_size=32, sliding_window=5,
                              layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                           "full_attention"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    elif arch == "flint":
        # NOTE: Flint's layout shrunk: per-head q / k norms (head_dim 24) and sinks (randomised below), a binding
        # 5-token window on the rotary layers 1 and 2, full layers 0 and 3 without rotary embedding, a dense first
        # layer, the top 3 of 8 experts by sigmoid scores, renormalised, beside an ungated shared expert
        cfg = tf.FlintConfig(**{**common, "head_dim": 24}, num_experts=8, num_experts_per_tok=3,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48, sliding_window=5,
                             mlp_only_layers=[0], layer_types=["full_attention", "sliding_attention",
                                                               "sliding_attention", "full_attention"])
    elif arch == "llama4":
        # NOTE: Llama 4 Scout's layout shrunk: dense (intermediate_size_mlp) and MoE layers alternating (4 experts,
        # top 1, a shared expert), layer 3 NoPE with a temperature that varies at the tests' lengths (floor_scale 3),
        # L2 q / k norms and 5-position attention chunks on the rotary layers, llama3 rope scaling
        cfg = tf.Llama4TextConfig(**{**common, "intermediate_size": 32, "head_dim": 16}, intermediate_size_mlp=96,
                                  num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                  attention_chunk_size=5, floor_scale=3, attn_scale=0.5, use_qk_norm=True,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 32})
    elif arch == "granite":
        # NOTE: Granite 3's four multipliers, none of them 1 (granite-3.1-2b: 12, 0.22, 0.015625, 8), tied embeddings
        cfg = tf.GraniteConfig(**{**common, "tie_word_embeddings": True}, embedding_multiplier=12.0,
                               residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=8.0)
    elif arch == "qwen3_5":
        # NOTE: Qwen3.5's layout shrunk: Gated DeltaNet layers 0, 1, 3 (2 key heads serving 4 value heads of another
        # size) and a gated full-attention layer 2 with partial rotary (a quarter of each head), zero-centred norms
        cfg = tf.Qwen3_5TextConfig(**{**common, "head_dim": 16}, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                                   layer_types=["linear_attention", "linear_attention", "full_attention",
                                                "linear_attention"],
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25})
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    elif arch in ("qwen3_next", "qwen3_5_moe"):
        # NOTE: Qwen3-Next's / Qwen3.5-MoE's layout shrunk: Gated DeltaNet layers 0 and 2 (2 key heads serving 4 value
        # heads of another size) and gated full-attention layers 1 and 3 (a full one on each of two pipeline stages),
        # 4 experts (top 2) and a gated shared expert; Qwen3-Next's first layer dense (mlp_only_layers)
        kw = dict(**{**common, "head_dim": 16}, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention"] * 2, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        if arch == "qwen3_next":
            cfg = tf.Qwen3NextConfig(**kw, mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True)
            cfg.architectures = ["Qwen3NextForCausalLM"]
        else:
            # NOTE: transformers' Qwen3.5-MoE config has no intermediate_size (every layer sparse): none passed
            cfg = tf.Qwen3_5MoeTextConfig(**{k: v for k, v in kw.items() if k != "intermediate_size"})
            cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    elif arch in MLA_MOE_ARCHS:  # NOTE: MLA MoE decoders on DeepSeek's bridge: tiny_mla_moe.py
        cfg = mla_moe_config(arch, common, _MLA)
    elif arch in HYBRID_ARCHS:  # NOTE: the Mamba2 / short-conv hybrids' layouts: tiny_hybrids.py
        cfg = hybrid_config(arch, common)
    elif arch in (*V4_ARCHS, *HY_V4_ARCHS):  # NOTE: DeepSeek-V4's, Beam's, HY-V4's: tiny_deepseek_v4.py, tiny_hy_v4.py
        cfg = (v4_config if arch in V4_ARCHS else hy_v4_config)(arch, common)
    elif arch in CLASSIC_ARCHS:  # NOTE: Persimmon, CodeGen, GPT-Neo, OPT: tiny_classic.py
        cfg = classic_config(arch, common)
    elif arch in DENSE_SMALL_ARCHS:  # NOTE: Granite SWA / Granite-MoE SWA, HyperCLOVAX, BitNet: tiny_dense_small.py
        cfg = dense_small_config(arch, common)
    elif arch in MAMBA_ARCHS:  # NOTE: the pure state-space stacks: tiny_mamba.py
        cfg = mamba_config(arch, common)
    elif arch in LFM3_ARCHS:  # NOTE: LFM3's layer kinds: tiny_lfm3.py
        cfg = lfm3_config(arch, common)
    elif arch in MINIMAX_ARCHS:  # NOTE: lightning / softmax attention hybrids: tiny_minimax.py
        cfg = minimax_config(arch, common)
    elif arch in LAGUNA_ARCHS:  # NOTE: per-layer heads, a softplus gate per head: tiny_laguna.py
        cfg = laguna_config(arch, common)
    elif arch in JETMOE_ARCHS:  # NOTE: mixture of attention heads: tiny_jetmoe.py
        cfg = jetmoe_config(arch, common)
    elif arch in KOLIBRI_ARIA_ARCHS:  # NOTE: Kolibri-1's and Aria's text MoE: tiny_kolibri_aria.py
        cfg = kolibri_aria_config(arch, common)
    elif arch in RECURRENT_GEMMA_ARCHS:  # NOTE: Griffin's recurrent blocks and local attention: tiny_recurrent_gemma.py
        cfg = recurrent_gemma_config(arch, common)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {TINY_ARCHS}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def hf_causal_lm(folder: str | Path, **kwargs):
    """transformers' model of the checkpoint in ``folder``, by its config's architecture (also where
    AutoModelForCausalLM does not map the config: ``_NOT_AUTO``)."""
    import transformers

    arch = transformers.AutoConfig.from_pretrained(folder).architectures[0]
    cls = getattr(transformers, arch) if arch in _NOT_AUTO.values() else transformers.AutoModelForCausalLM
    return cls.from_pretrained(folder, **kwargs)


def make_tiny_tokenizer(folder: str | Path, vocab_size: int = 203):
    """A word-level tokenizer over ``tok0 .. tokN`` saved next to the model (transformers' on-disk format)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, vocab_size):
        vocab[f"tok{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(folder)
    return fast


def make_tiny_checkpoint(folder: str | Path, arch: str = "qwen3", *, seed: int = 0, max_shard_size: str = "100KB",
                         tokenizer: bool = True, dtype: torch.dtype = torch.float32, mtp_layers: int = 0,
                         **overrides) -> Path:
    """Write a tiny random ``arch`` checkpoint with ``transformers`` (several shards) and return its folder.

    ``mtp_layers`` appends that many DeepSeek-style multi-token-prediction layers (``model.layers.{L + i}.*``, which
    transformers does not build) in a shard of their own, as the hub's DeepSeek-V3 checkpoints carry them.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    cfg = _config(arch, **overrides)
    torch.manual_seed(seed)
    if arch in _NOT_AUTO:  # NOTE: transformers' AutoModelForCausalLM does not map its config
        import transformers

        model = getattr(transformers, _NOT_AUTO[arch])._from_config(cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        # NOTE: random norm weights (HF initialises them to 1), so a bridge that drops a norm cannot pass; Gemma's
        # store weight - 1 (scales around 1 there too)
        zero_centred = ("gemma", "gemma2", "vaultgemma", "gemma3_text", "qwen3_5_text", "qwen3_next",
                        "qwen3_5_moe_text", "nemotron")
        centre = 0.0 if getattr(cfg, "model_type", "") in zero_centred else 1.0
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:  # NOTE: Qwen3.5's gated norm stores its weight itself (around 1)
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(("layernorm.mlp.fc1.weight", "layernorm.mlp.fc2.weight", "q_gate_proj.weight",
                                "self_attn.g_proj.weight")):
                p.copy_(0.3 * torch.randn_like(p))  # NOTE: A.X-K2's, LFM3's gates vary by token
            # NOTE: LayerNorms' biases (StarCoder2) around 0; GPT-J's ln_*; DBRX's attention sits in a module named
            # norm_attn_norm (its norms are norm_1 / norm_2 there)
            elif "norm" in name.replace("norm_attn_norm.", "") or ".ln_" in name:
                p.copy_((0.0 if name.endswith("bias") else centre) + 0.1 * torch.randn_like(p))
            elif name.endswith(("linear_attn.dt_bias", "mamba.dt_bias", "mamba.D", "mixer.dt_bias", "mixer.D")):
                # NOTE: HF: ones (so that a swap with A_log would show)
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(("mixer.A_log", "mamba.A_log")) and cfg.model_type in MAMBA_ARCHS:  # NOTE: alike per row
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # NOTE: Apertus's xIELU: HF's init, moved
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "mlp.gate.wg.weight", "mixer.gate.weight",
                                "feed_forward.gate.weight", "mlp.router.gate.weight", "ffn.router.layer.weight")):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("router.proj.weight"):  # NOTE: Gemma 4's (its input ~ H^-1/2 a channel)
                p.copy_(2.0 * torch.randn_like(p))
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # NOTE: Gemma 4's (HF: ones)
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(("forget_gate.f_a_proj.weight", "forget_gate.f_b_proj.weight", "g_a_proj.weight",
                                "g_b_proj.weight")):  # NOTE: Kimi Linear's gates vary from token to token
                p.copy_(0.25 * torch.randn_like(p))
            elif name.endswith("shared_expert_gate.weight") or ".altup." in name:  # NOTE: varies by token; 3n's AltUp
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(("router.weight", "self_attn.sinks")):  # NOTE: gpt-oss (its init leaves sinks empty)
                p.copy_((0.2 if name.endswith("weight") else 1.0) * torch.randn_like(p))
            elif name.endswith("bias") and getattr(cfg, "model_type", "") in _RANDOM_BIASES:  # NOTE: HF: zeros
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith(("e_score_correction_bias", "mlp.expert_bias")):  # NOTE: ERNIE 4.5's, AFMoE's (frozen)
                p.copy_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "feed_forward.expert_bias")):
                b.copy_(0.05 * torch.randn_like(b))
            elif name.endswith("layer_scalar"):  # NOTE: Gemma 4's (HF: ones)
                b.copy_(1.0 + 0.3 * torch.randn_like(b))
        if arch in (*V4_ARCHS, *HY_V4_ARCHS):  # NOTE: DeepSeek-V4's / Beam's / HY-V4's constant inits (tiny_*.py)
            (v4_randomize if arch in V4_ARCHS else hy_v4_randomize)(model)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if arch == "exaone":  # NOTE: the hub's architecture name (transformers writes LlamaForCausalLM)
        import json

        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "architectures": ["ExaoneForCausalLM"]}, indent=2))
    if arch == "olmo_hybrid":
        _hub_conv_layout(folder, cfg)
    if mtp_layers:
        _append_mtp_layers(folder, cfg, mtp_layers, dtype=dtype)
    if tokenizer:
        make_tiny_tokenizer(folder, vocab_size=cfg.vocab_size)
    return folder


def _hub_conv_layout(folder: Path, cfg) -> None:
    """OLMo Hybrid's ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` as the hub's checkpoints hold them (the key, key and
    value channels of transformers' fused ``conv1d``): transformers 5.24 saves the fused conv cut into three equal
    parts (its ``Concatenate``'s reverse is an even ``Chunk``), which it reads back alike but which name the wrong
    channels wherever the value width differs from the key width."""
    from safetensors.torch import load_file, save_file

    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    shards = {f: load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))}
    named = {n: (f, t) for f, tensors in shards.items() for n, t in tensors.items()}
    for i in range(cfg.num_hidden_layers):
        names = [f"model.layers.{i}.linear_attn.{x}_conv1d.weight" for x in "qkv"]
        if names[0] in named:
            fused = torch.cat([named[n][1] for n in names])
            for n, part in zip(names, torch.split(fused, [kd, kd, vd])):
                shards[named[n][0]][n] = part.contiguous()
    for f, tensors in shards.items():
        save_file(tensors, str(f), metadata={"format": "pt"})


def _append_mtp_layers(folder: Path, cfg, count: int, *, dtype: torch.dtype) -> None:
    """Random tensors named like DeepSeek-V3's (or ERNIE 4.5 MoE's, Qwen3-Next's) multi-token-prediction layers, in a
    shard of their own."""
    import json

    from safetensors.torch import save_file

    index_path = folder / "model.safetensors.index.json"
    if not index_path.is_file():
        raise ValueError("mtp_layers needs a sharded checkpoint (pass a small max_shard_size).")
    h, v = cfg.hidden_size, cfg.vocab_size
    tensors = {}
    for i in range(count):
        if cfg.model_type == "ernie4_5_moe":  # NOTE: the hub's ERNIE-4.5-21B-A3B-PT: model.mtp_*.{i} beside the layers
            shapes = {f"model.mtp_emb_norm.{i}.weight": (h,), f"model.mtp_hidden_norm.{i}.weight": (h,),
                      f"model.mtp_linear_proj.{i}.weight": (h, 2 * h),
                      f"model.mtp_block.{i}.input_layernorm.weight": (h,),
                      f"model.mtp_block.{i}.self_attn.o_proj.weight": (h, h),
                      f"model.mtp_block.{i}.mlp.experts.0.down_proj.weight": (h, cfg.moe_intermediate_size)}
        elif cfg.model_type in ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_text"):  # NOTE: the hub's: mtp.* beside
            mlp = "mlp.down_proj.weight" if cfg.model_type == "qwen3_5_text" else "mlp.experts.0.down_proj.weight"
            shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,), "mtp.pre_fc_norm_embedding.weight": (h,),
                      "mtp.pre_fc_norm_hidden.weight": (h,), f"mtp.layers.{i}.input_layernorm.weight": (h,),
                      f"mtp.layers.{i}.self_attn.o_proj.weight": (h, h),
                      f"mtp.layers.{i}.{mlp}": (h, getattr(cfg, "moe_intermediate_size", None)
                                                or cfg.intermediate_size)}
        elif cfg.model_type == "mimo_v2_flash":  # NOTE: model.mtp.layers.{i}.*, which transformers ignores
            p = f"model.mtp.layers.{i}"
            shapes = {f"{p}.{n}": shape for n, shape in {
                "enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                "input_layernorm.weight": (h,), "self_attn.o_proj.weight": (h, h), "final_layernorm.weight": (h,),
                "mlp.down_proj.weight": (h, cfg.intermediate_size)}.items()}
        else:
            p = f"model.layers.{cfg.num_hidden_layers + i}"
            shapes = {f"{p}.{n}": shape for n, shape in {
                "embed_tokens.weight": (v, h), "enorm.weight": (h,), "hnorm.weight": (h,),
                "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h),
                "input_layernorm.weight": (h,), "self_attn.o_proj.weight": (h, h),
                "mlp.experts.0.down_proj.weight": (h, cfg.moe_intermediate_size)}.items()}
        tensors.update({n: torch.randn(shape).to(dtype) for n, shape in shapes.items()})
    shard = "model-mtp.safetensors"
    save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    index = json.loads(index_path.read_text())
    index["weight_map"].update({n: shard for n in tensors})
    if "total_size" in index.get("metadata", {}):
        index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
