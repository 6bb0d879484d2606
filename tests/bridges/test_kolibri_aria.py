"""Kolibri-1's and Aria's text model's bridges without a world: Kolibri-1's routing rule (``kolibri1.
logit_bias_route``) is transformers' ``Kolibri1TopKRouter`` bit for bit, and neither megatron's sigmoid rule nor
``biased_routing``'s; the tiny Kolibri-1's expert bias changes some of the parity input's tokens' experts (so the
parity in test_moe_parity holds it to account); settings megatron cannot reproduce refused by the bridges' pure
checks, naming the field (so every rank fails alike before any collective); the settings and on-disk names translated.
Parity (tp1, TP2 + SP + EP2), router_logits, expert reads and round trips: test_moe_parity; gradients:
test_gradients."""

import re

import pytest
import torch
import transformers

from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_models import _config

NAMES = {"kolibri1": "Kolibri1ForCausalLM", "aria_text": "AriaTextForCausalLM"}


def _bridge(arch: str, **overrides):
    return get_bridge(_config(arch, architectures=[NAMES[arch]], **overrides))


@pytest.mark.parametrize("normalize", (True, False))
def test_kolibri_routing_is_transformers_bit_for_bit(normalize):
    """Random logits and a bias of their size: the same experts and weights as transformers' router (fp32), for both
    ``norm_topk_prob``; megatron's sigmoid rule (the bias added to the sigmoid scores) and ERNIE 4.5's
    (``biased_routing``: softmax scores) choose other experts for some tokens."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from loongforge_hf.bridges import biased_routing
    from loongforge_hf.bridges.kolibri1 import logit_bias_route

    cfg = _config("kolibri1", norm_topk_prob=normalize)
    router = transformers.models.kolibri1.modeling_kolibri1.Kolibri1TopKRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g))
    logits, weights, chosen = router(torch.randn(64, 64, generator=g))
    probs, routing_map = logit_bias_route(logits, topk=3, bias=router.e_score_correction_bias, normalize=normalize)
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, chosen, True))
    assert torch.equal(probs, torch.zeros_like(probs).scatter(1, chosen, weights))
    _, megatron_map = topk_routing_with_score_function(logits, 3, use_pre_softmax=False, score_function="sigmoid",
                                                       expert_bias=router.e_score_correction_bias)
    _, ernie_map = biased_routing.route(logits.softmax(-1), 3, router.e_score_correction_bias, 1e-12, torch.float32)
    assert not torch.equal(megatron_map, routing_map) and not torch.equal(ernie_map, routing_map)


def test_kolibri_expert_bias_changes_the_routing(tmp_path):
    """The tiny Kolibri-1's ``moe.router.expert_bias`` (0.05 a standard deviation, as the other tiny biases; the
    logits' gaps are wider) changes some of the parity input's tokens' experts in layers 1 and 3, and no layer's
    for every token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        make_tiny_checkpoint(tmp_path / "kolibri1", "kolibri1", tokenizer=False), dtype=torch.float32)
    changed = []

    def count(router, _args, out):
        logits, biased = out[0], out[2].sort(-1).values
        plain = torch.topk(logits, router.top_k).indices.sort(-1).values
        changed.append(((biased != plain).any(-1).sum().item(), logits.shape[0]))

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(count)
    with torch.no_grad():  # NOTE: _moe_parity's input
        model(torch.randint(0, 203, (2, 12), generator=torch.Generator().manual_seed(7)))
    assert len(changed) == 4 and all(n < tokens for n, tokens in changed), changed
    assert changed[1][0] > 0 and changed[3][0] > 0, changed


@pytest.mark.parametrize("arch,overrides,field", [
    ("kolibri1", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ("kolibri1", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ("kolibri1", {"sliding_window": None, "layer_types": ["full_attention"] * 4}, "sliding_window=None"),
    ("kolibri1", {"layer_types": ["chunked_attention"] * 4}, "layer_types ['chunked_attention']"),
    ("kolibri1", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                      "original_max_position_embeddings": 32}}, "yarn"),
    ("aria_text", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("aria_text", {"moe_num_shared_experts": 0}, "moe_num_shared_experts=0"),
    ("aria_text", {"moe_topk": 9}, "moe_topk=9"),
    ("aria_text", {"attention_bias": True}, "attention_bias=True"),
    ("aria_text", {"mlp_bias": True}, "mlp_bias=True"),
])
def test_fields_megatron_cannot_express_refused(arch, overrides, field):
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)):
        _bridge(arch, **overrides)


def test_settings_translate():
    """Kolibri-1: every layer sparse, a fixed expert bias (its routing replaced), the router in fp32, a shared MLP, the
    window on the sliding layers, per-head q / k norms, the post norms and bias under the hub's names; Aria: softmax
    over the chosen logits, shared experts of intermediate_size x moe_num_shared_experts, stacked transposed experts."""
    kolibri = _bridge("kolibri1")
    kw = kolibri.transformer_config_kwargs()
    assert kw["moe_layer_freq"] == [1] * 4 and kw["moe_router_enable_expert_bias"] and kw["qk_layernorm"]
    assert kw["moe_router_bias_update_rate"] == 0.0 and kw["moe_router_dtype"] == "fp32"
    assert kw["moe_shared_expert_intermediate_size"] == 48 and not kw["moe_shared_expert_gate"]
    assert kw["window_size"] == (4, 0) and kw["window_attn_skip_freq"] == [1, 1, 0, 1]
    shapes = kolibri.expected_hf_shapes()
    assert shapes["model.layers.0.moe.router.expert_bias"] == (8,)
    assert shapes["model.layers.0.post_attn_norm.weight"] == shapes["model.layers.0.post_ffn_norm.weight"] == (64,)
    kw = _bridge("aria_text").transformer_config_kwargs()
    assert kw["moe_router_score_function"] == "softmax" and not kw["moe_router_pre_softmax"]
    assert (kw["moe_ffn_hidden_size"], kw["moe_shared_expert_intermediate_size"], kw["moe_router_topk"]) == (32, 64, 2)
    assert kw["moe_router_dtype"] is None and kw["moe_layer_freq"] == [1] * 4
    shapes = _bridge("aria_text").expected_hf_shapes()
    assert shapes["model.layers.0.mlp.experts.fc1.weight"] == (8, 64, 64)
    assert shapes["model.layers.0.mlp.experts.fc2.weight"] == (8, 32, 64)
    assert not any(re.search(r"\.experts\.\d", n) for n in shapes)
