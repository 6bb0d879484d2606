"""Tiny configs of the language models of image-text families, as their own causal LMs (Emu3, Gemma 4 Unified,
Cohere Compass), for ``tiny_models._config`` through ``tiny_classic``: each hub layout shrunk, with the settings that
set it apart from its bridge's base binding at the tests' lengths."""

from __future__ import annotations

VLM_TEXT_ARCHS = ("emu3", "gemma4_unified", "cohere_compass")
# NOTE: causal LMs whose text config transformers' AutoModelForCausalLM does not map (Emu3's ``emu3_text_model``)
VLM_TEXT_NOT_AUTO = {"emu3": "Emu3ForCausalLM"}


def vlm_text_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``VLM_TEXT_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    if arch == "emu3":
        # NOTE: Emu3-Chat's language model shrunk: Llama's layout; its 0.1 dropout off (the gradient tests compare
        # training steps; test_vlm_text checks the dropouts' translation)
        cfg = tf.Emu3TextConfig(**common, attention_dropout=0.0,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cfg.architectures = ["Emu3ForCausalLM"]
        return cfg
    if arch == "gemma4_unified":
        # NOTE: Gemma 4 12B's text layout shrunk as tiny_models' gemma4: a binding 5-token window on layers 0 and 2,
        # full layers with a larger head, fewer KV heads and values from the key projection, proportional rope
        # there, a logit cap that binds; no per-layer inputs nor MoE block (the Unified config has neither field)
        cfg = tf.Gemma4UnifiedTextConfig(**{**common, "num_attention_heads": 8, "num_key_value_heads": 4,
                                            "head_dim": 16, "tie_word_embeddings": True}, global_head_dim=32,
                                         num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=5,
                                         final_logit_softcapping=3.0,
                                         layer_types=["sliding_attention", "full_attention"] * 2,
                                         rope_parameters={"full_attention": {"rope_type": "proportional",
                                                                             "partial_rotary_factor": 0.5,
                                                                             "rope_theta": 1000000.0},
                                                          "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 10000.0}})
        cfg.architectures = ["Gemma4UnifiedForCausalLM"]
        return cfg
    if arch == "cohere_compass":
        # NOTE: Cohere Compass's language model shrunk: Cohere2's layer (three windowed layers to one full, the
        # window binding at 5 tokens), rotate-half rope on the sliding layers only (with an M-RoPE section, as the
        # hub's), none on the full one, logits scaled
        kw = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        cfg = tf.CohereCompassTextConfig(**kw, layer_norm_eps=1e-5, logit_scale=0.25, sliding_window=5,
                                         layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                         rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 50000.0,
                                                                                "mrope_section": [4, 2, 2]},
                                                          "full_attention": None})
        cfg.architectures = ["CohereCompassForCausalLM"]
        return cfg
    raise ValueError(f"unknown image-text family tiny arch {arch!r}; known: {VLM_TEXT_ARCHS}")
