"""EXAONE-MoE's, Solar Open's, DBRX's and MiMo-V2-Flash's bridges without a world: settings megatron cannot reproduce
refused by the bridges' pure checks, naming the field (so every rank fails alike before any collective), and layouts
MiMo-V2-Flash cannot run; the hub's settings translated. Parity (logits, loss, router_logits and DBRX's balancing loss
at TP1 and TP2 + SP + EP2), the experts each EP rank reads and round trips: test_moe_parity; gradients:
test_gradients."""

import re

import pytest

from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
from loongforge_hf.bridges import config_map as C
from loongforge_hf.testing.tiny_models import _config

NAMES = {"exaone_moe": "ExaoneMoeForCausalLM", "solar_open": "SolarOpenForCausalLM", "dbrx": "DbrxForCausalLM"}
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}


def _bridge(arch: str, **overrides):
    return get_bridge(_config(arch, architectures=[NAMES[arch]], **overrides))


def _dbrx(**fields):
    """The tiny DBRX config with ``attn.<field>`` / ``ffn.<field>`` of its sub-configs or top-level fields set."""
    config = _config("dbrx", architectures=[NAMES["dbrx"]])
    for key, value in fields.items():
        part, _, name = key.rpartition(".")
        setattr({"attn": config.attn_config, "ffn": config.ffn_config}.get(part, config), name, value)
    return config


@pytest.mark.parametrize("arch,overrides,field", [
    ("exaone_moe", {"num_shared_experts": 0}, "num_shared_experts=0"),
    ("exaone_moe", {"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types="),
    ("exaone_moe", {"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types="),
    ("exaone_moe", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("exaone_moe", {"n_group": 3}, "n_group=3"),
    ("exaone_moe", {"rope_parameters": YARN}, "yarn"),
    ("exaone_moe", {"layer_types": ["chunked_attention"] * 4}, "layer_types ['chunked_attention']"),
    ("solar_open", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ("solar_open", {"n_shared_experts": 0}, "n_shared_experts=0"),
    ("solar_open", {"num_experts_per_tok": 6}, "num_experts_per_tok=6"),
])
def test_fields_megatron_cannot_express_refused(arch, overrides, field):
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        _bridge(arch, **overrides)


@pytest.mark.parametrize("fields,field", [
    ({"ffn.moe_jitter_eps": 0.01}, "moe_jitter_eps=0.01"),
    ({"ffn.moe_normalize_expert_weights": 2.0}, "moe_normalize_expert_weights=2.0"),
    ({"ffn.moe_top_k": 1}, "moe_top_k=1"),
    ({"ffn.ffn_act_fn": {"name": "gelu"}}, "ffn_act_fn={'name': 'gelu'}"),
    ({"attn.attn_pdrop": 0.1}, "attn_config.attn_pdrop=0.1"),
    ({"resid_pdrop": 0.1}, "resid_pdrop=0.1"),
    ({"attn.clip_qkv": -1.0}, "clip_qkv=-1.0"),
    ({"rope_parameters": YARN}, "yarn"),
])
def test_dbrx_fields_megatron_cannot_express_refused(fields, field):
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        get_bridge(_dbrx(**fields))


def test_settings_translate():
    """EXAONE-MoE: a dense first layer, sigmoid scores plus a fixed bias, scaled, two shared experts, the window on the
    sliding layers, no rope on the full ones, the bias beside the gate on disk; Solar Open: every layer sparse, q / k /
    v biases, GLM-4.5's expert groups."""
    exaone = _bridge("exaone_moe")
    kw = exaone.transformer_config_kwargs()
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["window_attn_skip_freq"] == [1, 1, 1, 0]
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0 and kw["moe_router_topk_scaling_factor"] == 2.5
    assert kw["moe_shared_expert_intermediate_size"] == 64 and kw["qk_layernorm"] and kw["moe_router_dtype"] == "fp32"
    assert "model.layers.1.mlp.e_score_correction_bias" in exaone.expected_hf_shapes()
    assert exaone.attention_module().__name__ == "NoRopeSelfAttention"
    # NOTE: transformers rotates no layer with a window of 0 and only full layers (its window is never None)
    nope = _bridge("exaone_moe", sliding_window=0, layer_types=["full_attention"] * 4)
    assert nope.attention_module().__name__ == "NoRopeSelfAttention"
    assert "window_attn_skip_freq" not in nope.transformer_config_kwargs()
    assert exaone.passthrough_names(["mtp.fc.weight", "model.norm.weight"]) == ["mtp.fc.weight"]
    kw = _bridge("solar_open").transformer_config_kwargs()
    assert kw["moe_layer_freq"] == [1, 1, 1, 1] and kw["add_qkv_bias"] and not kw["qk_layernorm"]
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (4, 2)
    dbrx = get_bridge(_dbrx())
    kw = dbrx.transformer_config_kwargs()
    assert kw["normalization"] == "LayerNorm" and kw["layernorm_epsilon"] == 1e-5 and kw["moe_layer_freq"] == [1] * 4
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (8, 3, 32)
    assert kw["moe_router_score_function"] == "softmax" and not kw["moe_router_pre_softmax"]
    assert get_bridge(_dbrx(**{"ffn.moe_normalize_expert_weights": None})).transformer_config_kwargs()[
        "moe_router_pre_softmax"]
    assert dbrx.attention_module().__name__ == "ClippedSelfAttention"
    assert dbrx.expected_hf_shapes()["transformer.blocks.0.ffn.experts.mlp.w2"] == (8 * 32, 64)
    # NOTE: transformers' DBRX reads its balancing-loss coefficient from ffn_config
    config = _dbrx(output_router_logits=True)
    assert C.router_aux_loss_coef_of(config) == 0.05 == C.router_aux_loss_coef_field(_dbrx())


def _mimo(**overrides):
    return get_bridge(_config("mimo_v2_flash", architectures=["MiMoV2FlashForCausalLM"], **overrides))


def test_mimo_v2_flash_translated():
    """MiMo-V2-Flash: the full layers' KV heads in megatron's shared config (the sliding layers twice as many in their
    own), sinks as megatron's learnable softmax offset, the window on the sliding layers only, the hub's routing
    (sigmoid plus a bias, groups, scaled, no shared experts), a dense first layer, partial rotary."""
    bridge = _mimo()
    kw = bridge.transformer_config_kwargs()
    assert (kw["num_query_groups"], kw["kv_channels"], kw["softmax_type"]) == (2, 24, "learnable")
    assert kw["window_size"] == (4, 0) and kw["window_attn_skip_freq"] == [0, 1, 1, 0]
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["moe_shared_expert_intermediate_size"] is None
    assert (kw["moe_router_score_function"], kw["moe_router_topk_scaling_factor"]) == ("sigmoid", 2.5)
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (4, 2)
    assert bridge.rope_parameters()["partial_rotary_factor"] == 0.334
    shapes = bridge.expected_hf_shapes()
    assert shapes["model.layers.1.self_attn.v_proj.weight"] == (4 * 16, 64)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (2 * 24, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 4 * 16)
    assert "model.layers.2.self_attn.attention_sink_bias" in shapes
    assert "model.layers.3.self_attn.attention_sink_bias" not in shapes
    assert bridge.passthrough_names(["model.mtp.layers.0.eh_proj.weight", "model.norm.weight"]) == [
        "model.mtp.layers.0.eh_proj.weight"]


@pytest.mark.parametrize("overrides,field", [
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types="),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "partial_rotary_factor {'full_attention': 0.5, 'sliding_attention': 0.334}"),
    ({"rope_parameters": {"full_attention": YARN, "sliding_attention": YARN}}, "yarn"),
    ({"rope_parameters": {kind: {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
                          for kind in ("full_attention", "sliding_attention")}}, "rope_type='llama3'"),
    ({"v_head_dim": 32}, "v_head_dim=32"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
])
def test_mimo_v2_flash_fields_refused(overrides, field):
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        _mimo(**overrides)


@pytest.mark.parametrize("layout,field", [({"tensor_parallel_size": 4}, "num_key_value_heads=2")])
def test_mimo_v2_flash_layouts_refused(layout, field):
    """Each TP rank must hold whole KV heads of both layer types (a pure check, run before any collective); context
    parallelism runs (test_moe_parity's cp2ep2, test_gradients' cp2: values narrower than keys gathered with them)."""
    from loongforge_hf.parallel.config import ParallelConfig

    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        _mimo().check_layout(ParallelConfig(**layout))
    _mimo().check_layout(ParallelConfig(context_parallel_size=2))


def test_mimo_v2_flash_lora_on_qkv_planned():
    """LoRA on q / k / v (the value heads narrower than the query / key heads: refused before) plans as linear_qkv
    slots, the v slot per KV group as wide as a value head; against PEFT in tests/integrations/
    test_lora_new_bridges.py."""
    import peft

    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.lora.model import _layout_and_slices
    from loongforge_hf.lora.plan import plan_lora

    bridge = _mimo()
    plan = plan_lora(bridge, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    layer0 = [t for t in plan.targets if t.layer == 0 and t.kind == "qkv"]
    ctx = shard_context(bridge, tp_rank=0, tp_size=1, padded_vocab=bridge.hf_config.vocab_size)
    layout, _ = _layout_and_slices(layer0, ctx, 0)
    c = bridge.hf_config
    assert dict(layout.slots)["v_proj"] == c.v_head_dim != c.head_dim, layout.slots
