"""The 2026 decoders bridged on existing bridges (Apertus 1.5's language model, Youtu, Hy3, Mellum 2, Flint) without a
world: their settings translated, what megatron cannot reproduce refused by the bridges' pure checks naming the field
(so every rank fails alike before any collective), and the 2026 decoders that need a new kind of layer refused by
name. Parity (logits, loss, router_logits, balancing losses at TP1 and TP2 + SP, + EP2 for the MoE ones) and round
trips: test_dense_parity / test_moe_parity; gradients: test_gradients."""

import re

import pytest

from loongforge_hf.bridges import UnsupportedArchitectureError, UnsupportedConfigError, get_bridge
from loongforge_hf.testing.tiny_models import _config

NAMES = {"apertus1p5": "Apertus1p5TextForCausalLM", "youtu": "YoutuForCausalLM", "hy_v3": "HYV3ForCausalLM",
         "mellum": "MellumForCausalLM", "flint": "FlintForCausalLM"}
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}


def _bridge(arch: str, **overrides):
    return get_bridge(_config(arch, architectures=[NAMES[arch]], **overrides))


def test_settings_translate():
    """Hy3: a dense first layer, sigmoid scores plus a fixed bias, scaled, two shared experts, its router / bias /
    shared names, MTP layers passed through; Mellum 2: the window on its sliding layers, softmax top-k, ``mtp.*``
    passed through; Flint: sinks as megatron's learnable softmax offset (fp32), sigmoid routing without bias, no
    rotary embedding on the full layers, an ungated shared expert; Youtu: MLA with rotary pairs on disk."""
    hy = _bridge("hy_v3")
    kw = hy.transformer_config_kwargs()
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["qk_layernorm"] and kw["moe_router_dtype"] == "fp32"
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0 and kw["moe_router_topk_scaling_factor"] == 2.5
    assert kw["moe_shared_expert_intermediate_size"] == 64 and "moe_router_num_groups" not in kw
    shapes = hy.expected_hf_shapes()
    assert {"model.layers.1.mlp.router.gate.weight", "model.layers.1.mlp.expert_bias",
            "model.layers.1.mlp.shared_mlp.gate_proj.weight"} <= set(shapes)
    assert hy.attention_module() is None
    assert hy.passthrough_names(["model.layers.4.eh_proj.weight", "model.layers.3.mlp.expert_bias"]) == [
        "model.layers.4.eh_proj.weight"]
    mellum = _bridge("mellum")
    kw = mellum.transformer_config_kwargs()
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["window_attn_skip_freq"] == [0, 1, 1, 0]
    assert kw["window_size"] == (4, 0) and kw["moe_router_score_function"] == "softmax"
    assert not kw["moe_router_pre_softmax"] and kw["moe_shared_expert_intermediate_size"] is None
    assert mellum.sliding_layers == {1, 2} and mellum.rope_for("full_attention")["rope_theta"] == 500000.0
    assert mellum.passthrough_names(["mtp.fc.weight", "model.norm.weight"]) == ["mtp.fc.weight"]
    flint = _bridge("flint")
    kw = flint.transformer_config_kwargs()
    assert kw["softmax_type"] == "learnable" and kw["moe_router_score_function"] == "sigmoid"
    assert not kw.get("moe_router_enable_expert_bias") and kw["moe_shared_expert_intermediate_size"] == 48
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["window_attn_skip_freq"] == [0, 1, 1, 0]
    assert flint.attention_module().__name__ == "NoRopeSelfAttention"
    sinks = [m for m in flint.attention_mappings() if m.megatron.endswith("softmax_offset")]
    assert len(sinks) == 1 and str(sinks[0].hf_dtype) == "torch.float32"
    youtu = _bridge("youtu")
    assert youtu.interleaved_rope_on_disk and youtu.transformer_config_kwargs()["multi_latent_attention"]
    assert not _bridge("youtu", rope_interleave=False).interleaved_rope_on_disk


@pytest.mark.parametrize("arch,overrides,field", [
    ("apertus1p5", {"output_vocab_size": 100}, "output_vocab_size=100"),
    ("hy_v3", {"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types="),
    ("hy_v3", {"num_shared_experts": 0}, "num_shared_experts=0"),
    ("hy_v3", {"rope_parameters": YARN}, "yarn"),
    ("hy_v3", {"num_experts_per_tok": 1}, "norm_topk_prob=True with num_experts_per_tok=1"),
    ("mellum", {"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types="),
    ("mellum", {"layer_types": ["chunked_attention"] * 4}, "layer_types ['chunked_attention']"),
    ("mellum", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters['sliding_attention']"),
    ("flint", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("flint", {"num_experts_per_tok": 1}, "norm_topk_prob=True with num_experts_per_tok=1"),
    ("flint", {"rope_parameters": YARN}, "yarn"),
    ("flint", {"sliding_window": 0}, "sliding_window=0"),
])
def test_fields_megatron_cannot_express_refused(arch, overrides, field):
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        _bridge(arch, **overrides)


def test_youtu_tensor_parallel_without_sequence_parallel_refused():
    """Multi-latent attention's rotary-key gradient needs sequence parallelism under TP (``mla_latent.py``): refused by
    the pure layout check, naming the architecture."""
    from loongforge_hf.parallel.config import ParallelConfig

    with pytest.raises(UnsupportedConfigError, match="YoutuForCausalLM"):
        _bridge("youtu").check_layout(ParallelConfig(tensor_parallel_size=2))
    _bridge("youtu").check_layout(ParallelConfig(tensor_parallel_size=2, sequence_parallel=True))


@pytest.mark.parametrize("config,arch", [
    ("Kolibri1Config", "Kolibri1ForCausalLM"), ("LagunaConfig", "LagunaForCausalLM"),
    ("Lfm3Config", "Lfm3ForCausalLM"), ("HYV4Config", "HYV4ForCausalLM")])
def test_decoders_needing_new_layers_refused_by_name(config, arch):
    """Kolibri 1 (top-k of the logits plus a bias), Laguna (per-layer head counts, a softplus output gate), LFM3 (a
    per-head sigmoid output gate, sandwich norms around short convolutions) and Hy4 (hyper-connections): not bridged,
    refused by name listing what is supported."""
    import transformers

    cfg = getattr(transformers, config)(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        architectures=[arch])
    with pytest.raises(UnsupportedArchitectureError, match=f"{arch}.*YoutuForCausalLM"):
        get_bridge(cfg)
