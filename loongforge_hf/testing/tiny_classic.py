"""Tiny configs of the classic decoders (Persimmon, CodeGen, GPT-Neo, OPT, GPT-NeoX-Japanese) for
``tiny_models._config``: each hub layout shrunk, with the settings that set it apart from its bridge's base binding at
the tests' lengths."""

from __future__ import annotations

from loongforge_hf.testing.tiny_fairseq import FAIRSEQ_ARCHS, fairseq_config
from loongforge_hf.testing.tiny_lara import LARA_ARCHS, lara_config
from loongforge_hf.testing.tiny_vlm_text import VLM_TEXT_ARCHS, VLM_TEXT_NOT_AUTO, vlm_text_config  # noqa: F401

# NOTE: BioGPT and XGLM (OPT's bridge) in tiny_fairseq.py
CLASSIC_ARCHS = ("persimmon", "codegen", "gpt_neo", "opt", "gpt_neox_japanese", *FAIRSEQ_ARCHS, *VLM_TEXT_ARCHS,
                 *LARA_ARCHS)
# NOTE: the linears' biases randomised in make_tiny_checkpoint (HF: zeros), by model_type
CLASSIC_BIASED = ("persimmon", "codegen", "gpt_neo", "opt", "gpt_neox_japanese", *FAIRSEQ_ARCHS)


def classic_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``CLASSIC_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch in FAIRSEQ_ARCHS:
        return fairseq_config(arch, common)
    if arch in LARA_ARCHS:  # NOTE: LaraMini in tiny_lara.py
        return lara_config(arch, common)
    if arch in VLM_TEXT_ARCHS:  # NOTE: image-text families' language models: tiny_vlm_text.py
        return vlm_text_config(arch, common)
    if arch == "persimmon":
        # NOTE: Persimmon-8B's layout shrunk: GPT-NeoX's per-head fused q / k / v run sequentially, q / k LayerNorms
        # with biases, half of each 16-channel head rotated, relu2, biases on every linear but the LM head
        kw = {k: v for k, v in common.items() if k not in ("rms_norm_eps", "num_key_value_heads")}
        cfg = tf.PersimmonConfig(**kw, layer_norm_eps=1e-5, qk_layernorm=True, hidden_act="relu2",
                                 rope_parameters={"rope_type": "default", "rope_theta": 25000.0,
                                                  "partial_rotary_factor": 0.5})
    elif arch == "codegen":
        # NOTE: CodeGen-350M's layout shrunk: GPT-J's layer with q / v / k fused per quarter of the heads (8 heads,
        # two a quarter), 6 of each 8-channel head rotated in interleaved pairs, biases on the MLP and the LM head
        cfg = tf.CodeGenConfig(vocab_size=203, n_positions=128, n_ctx=128, n_embd=64, n_layer=4, n_head=8,
                               rotary_dim=6, n_inner=96, activation_function="gelu_new", resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
                               **ids)
    elif arch == "gpt_neo":
        # NOTE: GPT-Neo's layout shrunk: learned positions, global and local layers alternating with a window of 5
        # that binds at the tests' lengths, unscaled scores, q / k / v without biases, out_proj and the MLP with
        cfg = tf.GPTNeoConfig(vocab_size=203, max_position_embeddings=128, hidden_size=64, num_layers=4, num_heads=4,
                              attention_types=[[["global", "local"], 2]], window_size=5, intermediate_size=96,
                              activation_function="gelu_new", resid_dropout=0.0, embed_dropout=0.0,
                              attention_dropout=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True, **ids)
    elif arch == "opt":
        # NOTE: OPT-125m's layout shrunk: learned positions offset by 2, pre-LayerNorms, ReLU, biases everywhere,
        # tied embeddings
        cfg = tf.OPTConfig(vocab_size=203, max_position_embeddings=128, hidden_size=64, num_hidden_layers=4,
                           ffn_dim=96, num_attention_heads=4, word_embed_proj_dim=64, do_layer_norm_before=True,
                           activation_function="relu", dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
                           enable_bias=True, tie_word_embeddings=True, **ids)
    elif arch == "gpt_neox_japanese":
        # NOTE: gpt-neox-japanese-2.7b's layout shrunk: GPT-NeoX's per-head fused q / k / v run sequentially, no linear
        # biases but the last layer's dense_bias (randomised), half of each head rotated, an MLP 2 x wide, tied
        dropped = ("rms_norm_eps", "num_key_value_heads", "intermediate_size", "tie_word_embeddings")
        kw = {k: v for k, v in common.items() if k not in dropped}
        cfg = tf.GPTNeoXJapaneseConfig(**kw, intermediate_multiple_size=2, hidden_act="gelu", layer_norm_eps=1e-5,
                                       attention_dropout=0.0, hidden_dropout=0.0, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5})
    else:
        raise ValueError(f"unknown classic tiny arch {arch!r}; known: {CLASSIC_ARCHS}")
    return cfg
