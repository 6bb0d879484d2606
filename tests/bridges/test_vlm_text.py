"""The language models of image-text families as causal LMs, without a world: Emu3 (``llama.py``), Gemma 4 Unified
(``gemma4.py``) and Cohere Compass (``cohere.py``) translated, what megatron cannot reproduce refused by the bridges'
pure checks naming the field, MiniMax-M3-VL's and dots3-note's language models refused by name
(``vlm_text_refused.py``). Parity (logits and loss at TP1 and TP2 + SP) and round trips: test_dense_parity;
gradients at TP2 + SP: test_gradients."""

import pytest

from loongforge_hf.bridges import UnsupportedArchitectureError, UnsupportedConfigError, get_bridge
from loongforge_hf.testing.tiny_models import _config

NOPE_FULL = {"sliding_attention": {"rope_type": "default", "rope_theta": 5e4}, "full_attention": None}


def test_emu3_drops_its_sublayer_outputs():
    """Emu3's ``attention_dropout`` (0.1 in the hub's) drops the attention probabilities and both sublayers' outputs
    before the residual adds (megatron's ``hidden_dropout``), never the embedding output."""
    bridge = get_bridge(_config("emu3", attention_dropout=0.1))
    kw = bridge.transformer_config_kwargs()
    assert type(bridge).__name__ == "Emu3Bridge"
    assert kw["attention_dropout"] == 0.1 and kw["hidden_dropout"] == 0.1 and bridge.embedding_dropout == 0.0


def test_gemma4_unified_is_gemma4_text():
    """Gemma 4 Unified's text config has no per-layer-input or MoE fields (reading them raises): Gemma 4's
    declaration without either; its refusals hold (bidirectional attention over all tokens)."""
    bridge = get_bridge(_config("gemma4_unified"))
    assert type(bridge).__name__ == "Gemma4Bridge" and bridge.per_layer_size == 0 and bridge.kv_modes is None
    with pytest.raises(UnsupportedConfigError, match="use_bidirectional_attention='all'"):
        get_bridge(_config("gemma4_unified", use_bidirectional_attention="all"))


def test_cohere_compass_rope_per_layer_type():
    """Cohere Compass: rotate-half pairs (not Cohere's interleaved ones), the rotated types' rope without its M-RoPE
    section, no rotary embedding on the types whose entry is None, logits unscaled where ``logit_scale`` is None (as
    transformers' class)."""
    import transformers

    bridge = get_bridge(_config("cohere_compass"))
    kw = bridge.transformer_config_kwargs()
    assert not kw["rotary_interleaved"] and bridge.rope_parameters()["rope_theta"] == 5e4
    assert bridge.attention_module() is not None and kw["window_attn_skip_freq"] == [1, 1, 1, 0]
    unscaled = transformers.CohereCompassTextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                    rope_parameters=NOPE_FULL, architectures=[bridge.architectures[0]],
                                                    layer_types=["sliding_attention", "full_attention"])
    assert unscaled.logit_scale is None and get_bridge(unscaled).unset_logit_scale == 1.0


@pytest.mark.parametrize("rope", [
    {"sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
     "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
    {"sliding_attention": None, "full_attention": None},
    {"sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}])
def test_cohere_compass_ropes_refused(rope):
    """Two rotated types with different ropes (two tables), no rotated type, a layer type without an entry: refused
    naming ``rope_parameters`` before any collective."""
    cfg = _config("cohere_compass")
    cfg.rope_parameters = rope
    with pytest.raises(UnsupportedConfigError, match="rope_parameters="):
        get_bridge(cfg)


@pytest.mark.parametrize("config,arch", [("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM"),
                                         ("Dots3NoteTextConfig", "Dots3NoteForCausalLM")])
def test_image_text_language_models_refused_by_name(config, arch):
    """MiniMax-M3-VL's (block-sparse lightning-indexer attention) and dots3-note's (rescaled, gated MLA with sparse
    attention) language models: refused by name, listing what is supported."""
    import transformers

    cfg = getattr(transformers, config)(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, architectures=[arch])
    with pytest.raises(UnsupportedArchitectureError, match=f"{arch} is not supported.*CohereCompassForCausalLM"):
        get_bridge(cfg)
