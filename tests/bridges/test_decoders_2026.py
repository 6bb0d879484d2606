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
         "mellum": "MellumForCausalLM", "flint": "FlintForCausalLM", "axk1": "AXK1ForCausalLM",
         "axk2": "AXK2ForCausalLM",
         "granite_swa": "GraniteSWAForCausalLM", "granitemoe_swa": "GraniteMoeSWAForCausalLM",
         "hyperclovax": "HyperCLOVAXForCausalLM", "bitnet": "BitNetForCausalLM",
         "diffllama": "DiffLlamaForCausalLM"}
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
    ("granite_swa", {"layer_rope_theta": [1e4, 5e5, 0, 1e4]}, "layer_rope_theta with several rotary bases"),
    ("granite_swa", {"layer_rope_theta": [1e4, 0]}, "layer_rope_theta has 2 entries for 4 layers"),
    ("granite_swa", {"rope_parameters": YARN}, "yarn"),
    ("granitemoe_swa", {"sliding_window": None}, "sliding_window=None"),
    ("granitemoe_swa", {"layer_types": ["chunked_attention"] * 4}, "layer_types ['chunked_attention']"),
    ("hyperclovax", {"attention_bias": True}, "attention_bias=True"),
    ("bitnet", {"quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                        "quantization_mode": "online"}}, "quantization_config="),
    ("diffllama", {"num_key_value_heads": 3, "num_attention_heads": 6}, "num_key_value_heads=3"),
    ("diffllama", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("axk1", {"q_lora_rank": 0}, "q_lora_rank=0"),
    ("axk1", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("axk2", {"gated_norm_rank": 0}, "gated_norm_rank=0"),
    ("axk2", {"attention_bias": True}, "attention_bias=True"),
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


def test_axk1_settings():
    """A.X-K1: GLM-4.7-Flash's bridge (dense / sparse by mlp_layer_types, rotary halves reordered where
    rope_interleave=False) with the MoE layers' output normalised (``post_mlp_layernorm`` at the decoder layer on
    disk); the released checkpoints' dense-layer ``post_mlp_layernorm`` (unused by transformers) and MTP layers are
    passed through, the MoE layers' read."""
    axk1 = _bridge("axk1")
    assert axk1.transformer_config_kwargs()["moe_layer_freq"] == [0, 1, 0, 1] and not axk1.interleaved_rope_on_disk
    assert axk1.moe_module().__name__ == "TransformedMoELayer" and axk1.mlp_module() is None
    shapes = axk1.expected_hf_shapes()
    assert "model.layers.1.post_mlp_layernorm.weight" in shapes and "model.layers.0.post_mlp_layernorm.weight" \
        not in shapes
    names = [f"model.layers.{i}.post_mlp_layernorm.weight" for i in range(5)] + ["model.layers.4.eh_proj.weight"]
    assert sorted(axk1.passthrough_names(names)) == sorted(names[i] for i in (0, 2, 4, 5))


def test_axk2_settings():
    """A.X-K2: DeepSeek-V3.2's DSA and routing (no expert groups where n_group is None), rotary pairs on disk; the
    gated norms' three tensors each (input norms everywhere, post-attention ones on the MoE layers), the fused query
    and gate projection reading both latents; no layout refused (context parallelism runs)."""
    axk2 = _bridge("axk2")
    kw = axk2.transformer_config_kwargs()
    assert kw["experimental_attention_variant"] == "dsa" and "moe_router_num_groups" not in kw
    assert axk2.interleaved_rope_on_disk and kw["moe_router_score_function"] == "sigmoid"
    shapes = axk2.expected_hf_shapes()
    assert shapes["model.layers.0.self_attn.q_b_proj.weight"] == (4 * (16 + 8 + 16), 64)
    assert shapes["model.layers.1.post_attention_layernorm.W_down.weight"] == (8, 64)
    assert "model.layers.0.post_attention_layernorm.weight" in shapes and "model.layers.1.post_attention_layernorm" \
        ".weight" not in shapes and "model.layers.0.input_layernorm.W_up.weight" in shapes
    assert not hasattr(axk2, "check_layout")  # NOTE: context parallelism runs (test_moe_parity's cp2ep2)


@pytest.mark.parametrize("config,arch", [
    ("HrmTextConfig", "HrmTextForCausalLM")])
def test_decoders_needing_new_layers_refused_by_name(config, arch):
    """HRM text (two weight-shared stacks run in nested loops, a prefix-LM mask): not bridged, refused by name listing
    what is supported (Doge: bridged, test_doge.py; LongCat-Flash: bridged, test_longcat_flash.py)."""
    import transformers

    cfg = getattr(transformers, config)(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        architectures=[arch])
    with pytest.raises(UnsupportedArchitectureError, match=f"{arch}.*YoutuForCausalLM"):
        get_bridge(cfg)
