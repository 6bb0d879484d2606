"""Laguna (``bridges/laguna.py``) without a world: its settings translated (a head count per layer, the gate rows per
head, a rope per layer type, the routing) and what megatron cannot reproduce refused by the bridge's pure checks
naming the field, so every rank fails alike before any collective. Parity (logits, loss, router_logits and the
balancing loss at TP1 and TP2 + SP + EP2), round trips: test_moe_parity; gradients (TP2 + SP + EP2, a gate per head
channel): test_gradients."""

import pytest

from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
from loongforge_hf.parallel import ParallelConfig
from loongforge_hf.testing.tiny_models import _config


def _bridge(**overrides):
    return get_bridge(_config("laguna", architectures=["LagunaForCausalLM"], **overrides))


def test_settings_translate():
    """The tiny Laguna: 4, 8, 2, 6 heads of 24 over 2 KV heads, a gate row per head (per head channel with
    ``gating="per-element"``), the full layers' rope on 12 channels and the sliding layers' on all 24, the window on
    layers 1 and 2, a dense first layer, sigmoid routing plus a fixed bias, scaled by 2.5, a shared expert."""
    laguna = _bridge()
    kw = laguna.transformer_config_kwargs()
    assert kw["num_attention_heads"] == 4 and kw["num_query_groups"] == 2 and kw["attention_output_gate"]
    assert kw["qk_layernorm"] and kw["window_size"] == (4, 0) and kw["window_attn_skip_freq"] == [0, 1, 1, 0]
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["moe_shared_expert_intermediate_size"] == 48
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0 and kw["moe_router_topk_scaling_factor"] == 2.5
    assert laguna.gate_width == 1 and _bridge(gating="per-element").gate_width == 24
    assert [laguna.rotary_width(kind) for kind in ("full_attention", "sliding_attention")] == [12, 24]
    shapes = laguna.expected_hf_shapes()
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (192, 64)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (64, 192)
    assert shapes["model.layers.3.self_attn.g_proj.weight"] == (6, 64)
    assert _bridge(gating="per-element").expected_hf_shapes()["model.layers.2.self_attn.g_proj.weight"] == (48, 64)
    assert {"model.layers.1.mlp.experts.e_score_correction_bias", "model.layers.1.mlp.shared_expert.up_proj.weight",
            "model.layers.1.mlp.experts.7.down_proj.weight"} <= set(shapes)
    bias = [m for m in laguna.moe_mappings() if m.megatron.endswith("expert_bias")]
    assert len(bias) == 1 and bias[0].hf_dtype is None  # NOTE: the model's dtype, as transformers keeps it
    laguna.check_layout(ParallelConfig(tensor_parallel_size=2))


@pytest.mark.parametrize("overrides,field", [
    ({"num_attention_heads_per_layer": [4, 8, 3, 6]}, r"num_attention_heads_per_layer=\[4, 8, 3, 6\]"),
    ({"num_attention_heads_per_layer": [4, 8]}, r"num_attention_heads_per_layer=\[4, 8\]"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"moe_router_logit_softcapping": 30.0}, "moe_router_logit_softcapping=30.0"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types="),
    ({"layer_types": ["chunked_attention"] * 4}, r"layer_types \['chunked_attention'\]"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_type='yarn'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32}}},
     r"rope_parameters\['sliding_attention'\].rope_type='llama3'"),
])
def test_refused_naming_the_field(overrides, field):
    with pytest.raises(UnsupportedConfigError, match=field):
        _bridge(**overrides)


def test_tensor_parallel_size_must_split_kv_heads():
    """TP 4 over 2 KV heads: refused naming the field (whole KV groups and their heads per rank)."""
    with pytest.raises(UnsupportedConfigError, match="num_key_value_heads=2 .*tensor_parallel_size=4"):
        _bridge().check_layout(ParallelConfig(tensor_parallel_size=4))


def test_expert_bias_and_gate_bind_on_the_parity_input(tmp_path):
    """On test_moe_parity's input the tiny Laguna's ``e_score_correction_bias`` changes some tokens' experts in every
    MoE layer and leaves others' (so the parity holds the bias and the scores to account), and each layer's softplus
    gate varies from token to token and head to head by more than 0.1 (a gate mapped to the wrong head shows)."""
    import torch
    import transformers

    from loongforge_hf.testing import make_tiny_checkpoint

    model = transformers.AutoModelForCausalLM.from_pretrained(
        make_tiny_checkpoint(tmp_path / "laguna", "laguna", tokenizer=False), dtype=torch.float32)
    changed, spread = [], []

    def route(router, args, _out):
        scores = torch.sigmoid(torch.nn.functional.linear(args[0].reshape(-1, router.hidden_dim), router.weight))
        biased, plain = (torch.topk(s, router.top_k).indices.sort(-1).values
                         for s in (scores + router.e_score_correction_bias, scores))
        changed.append(((biased != plain).any(-1).sum().item(), scores.shape[0]))

    def gate(proj, _args, out):
        spread.append(torch.nn.functional.softplus(out).std().item())

    for layer in model.model.layers:
        layer.self_attn.g_proj.register_forward_hook(gate)
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(route)
    with torch.no_grad():  # NOTE: _moe_parity's input
        model(torch.randint(0, 203, (2, 12), generator=torch.Generator().manual_seed(7)))
    assert len(changed) == 3 and all(0 < n < tokens for n, tokens in changed), changed
    assert len(spread) == 4 and min(spread) > 0.1, spread
