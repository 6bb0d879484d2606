"""LaraMini's pure checks (``bridges/lara_mini.py``; its parity, gradients and round trip run in test_moe_parity.py
and test_gradients.py; Bailing hybrid's refusal in test_refused_triage.py)."""

import pytest

from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
from loongforge_hf.testing.tiny_models import _config


def test_lara_mini_settings():
    """Plain norms, no output gate, the window on the sliding layer, no rotary embedding on the full one, the Gated
    DeltaNet's fused in_proj and out_norm as on disk, experts stacked, an ungated shared expert."""
    bridge = get_bridge(_config("lara_mini"))
    kw = bridge.transformer_config_kwargs()
    assert not kw["layernorm_zero_centered_gamma"] and not kw["attention_output_gate"]
    assert kw["window_size"] == (4, 0) and kw["window_attn_skip_freq"] == [0, 1, 0, 0]
    assert kw["moe_router_score_function"] == "softmax" and not kw["moe_router_pre_softmax"]
    shapes = bridge.expected_hf_shapes()
    assert shapes["model.layers.0.linear_attn.in_proj.weight"] == (2 * 16 + 2 * 48 + 2 * 4, 64)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)
    assert "model.layers.0.linear_attn.out_norm.weight" in shapes and "model.layers.1.self_attn.q_proj.weight" in \
        shapes and not any("shared_expert_gate" in n or "in_proj_qkv" in n for n in shapes)


@pytest.mark.parametrize("overrides,field", [
    ({"layer_types": ["linear_attention", "chunked_attention", "linear_attention", "full_attention"]},
     "chunked_attention"),
    ({"sliding_window": 0}, "sliding_window=0"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False")])
def test_lara_mini_refusals(overrides, field):
    """Fields megatron cannot express, refused naming the field from the config alone (every rank alike)."""
    with pytest.raises(UnsupportedConfigError, match=field):
        get_bridge(_config("lara_mini", **overrides))


def test_lara_mini_linear_heads_over_tp_refused():
    """One key head does not split over TP2: the pure layout check names the field."""
    from loongforge_hf.parallel.config import ParallelConfig

    bridge = get_bridge(_config("lara_mini", linear_num_key_heads=1, linear_num_value_heads=2))
    with pytest.raises(UnsupportedConfigError, match="linear_num_key_heads=1 does not split"):
        bridge.check_layout(ParallelConfig(tensor_parallel_size=2))
