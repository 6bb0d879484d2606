"""Cohere2-MoE's and AFMoE's bridges without a world: settings megatron cannot reproduce refused by the bridges' pure
checks, naming the field (so every rank fails alike before any collective); the hub's settings translated; the tiny
AFMoE's expert bias changes some of the parity input's tokens' experts (so the parity in test_moe_parity holds it to
account). Parity, expert parallelism and round trips: test_moe_parity; gradients: test_gradients."""

import re

import pytest
import torch
import transformers

from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_models import _config

NAMES = {"cohere2_moe": "Cohere2MoeForCausalLM", "afmoe": "AfmoeForCausalLM"}


def _bridge(arch: str, **overrides):
    return get_bridge(_config(arch, architectures=[NAMES[arch]], **overrides))


@pytest.mark.parametrize("arch,overrides,field", [
    ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": False}, "norm_topk_prob=False"),
    ("cohere2_moe", {"expert_selection_fn": "relu"}, "expert_selection_fn='relu'"),
    ("cohere2_moe", {"shared_expert_combination_strategy": "max"}, "shared_expert_combination_strategy='max'"),
    ("cohere2_moe", {"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types="),
    ("cohere2_moe", {"attention_bias": True}, "attention_bias=True"),
    ("cohere2_moe", {"layer_types": ["chunked_attention"] * 4}, "layer_types ['chunked_attention']"),
    ("afmoe", {"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ("afmoe", {"num_shared_experts": 0}, "num_shared_experts=0"),
    ("afmoe", {"attention_bias": True}, "attention_bias=True"),
    ("afmoe", {"route_scale": None}, "route_scale=None"),
    ("afmoe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                   "original_max_position_embeddings": 32}}, "yarn"),
])
def test_fields_megatron_cannot_express_refused(arch, overrides, field):
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        _bridge(arch, **overrides)


def test_settings_translate():
    """Cohere2-MoE: the dense prefix's width, experts of intermediate_size, one shared expert, LayerNorm or RMSNorm by
    which epsilon is set, sigmoid routing renormalised; AFMoE: sigmoid scores plus a fixed expert bias, scaled by
    route_scale, two shared experts, the attention's output gate, the first layer dense."""
    kw = _bridge("cohere2_moe").transformer_config_kwargs()
    assert (kw["ffn_hidden_size"], kw["moe_ffn_hidden_size"], kw["moe_shared_expert_intermediate_size"]) == (96, 32, 32)
    assert kw["normalization"] == "LayerNorm" and kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["rotary_interleaved"]
    assert kw["moe_router_score_function"] == "softmax" and not kw["moe_router_pre_softmax"]
    rms = _bridge("cohere2_moe", rms_norm_eps=1e-6, expert_selection_fn="sigmoid", num_shared_experts=0)
    kw = rms.transformer_config_kwargs()
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == 1e-6
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_shared_expert_intermediate_size"] is None
    assert rms.moe_module() is None and not any("shared_experts" in n for n in rms.expected_hf_shapes())
    kw = _bridge("afmoe").transformer_config_kwargs()
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0 and kw["moe_router_topk_scaling_factor"] == 2.5
    assert kw["moe_shared_expert_intermediate_size"] == 64 and kw["attention_output_gate"] and kw["qk_layernorm"]
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["window_attn_skip_freq"] == [1, 1, 0, 1]


def test_afmoe_expert_bias_changes_the_routing(tmp_path):
    """The tiny AFMoE's ``expert_bias`` changes some of the parity input's tokens' experts in every MoE layer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        make_tiny_checkpoint(tmp_path / "afmoe", "afmoe", tokenizer=False), dtype=torch.float32)
    changed = []

    def count(router, args, _out):
        scores = torch.sigmoid(router.gate(args[0].flatten(0, 1)))
        biased, plain = (torch.topk(s, router.top_k).indices.sort(-1).values for s in (scores + args[1], scores))
        changed.append(((biased != plain).any(-1).sum().item(), scores.shape[0]))

    for layer in model.model.layers[1:]:
        layer.mlp.router.register_forward_hook(count)
    with torch.no_grad():  # NOTE: _moe_parity's input
        model(torch.randint(0, 203, (2, 12), generator=torch.Generator().manual_seed(7)))
    assert len(changed) == 3 and all(0 < n < tokens for n, tokens in changed), changed
