"""LaraMini's pure checks (``bridges/lara_mini.py``; its parity, gradients and round trip run in test_moe_parity.py
and test_gradients.py, its LoRA against PEFT in tests/integrations/test_lora_new_bridges.py; Bailing hybrid's refusal
in test_refused_triage.py)."""

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


def test_lara_mini_lora_in_projections_on_the_fused_rows():
    """Pure, TP1 / TP2: PEFT's in_proj_qkv / z / b / a (transformers' tree) are targets on the megatron in_proj the
    fused checkpoint tensor loads; each one's B rows, moved to megatron's order and sliced for a rank, are that rank's
    rows of its section of the fused on-disk in_proj in its adapter slot. DoRA on them is refused by name."""
    import re

    import peft
    import torch

    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.model import _layout_and_slices
    from loongforge_hf.lora.plan import plan_lora

    bridge = get_bridge(_config("lara_mini"))
    slots = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
    plan = plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear"))
    targets = sorted((t for t in plan.targets if t.layer == 0 and t.name in slots), key=lambda t: t.slot)
    assert [t.name for t in targets] == slots and [t.out_features for t in targets] == [80, 48, 4, 4]
    assert {t.hf_module for t in targets} == {f"model.layers.0.linear_attn.{n}" for n in slots}
    fused_map = next(m for m in bridge.mappings_for_layer(0) if m.megatron == targets[0].megatron_module + ".weight")
    on_disk = torch.randn(sum(t.out_features for t in targets), 3, generator=torch.Generator().manual_seed(0))
    kd, vd = 16, 48  # NOTE: rows [q | k | v | z | b | a] on disk: q, k of 16, v, z of 48, b, a of 4
    sections = dict(zip(slots, torch.split(on_disk, [2 * kd + vd, vd, 4, 4])))

    class Reader:
        def get_slice(self, name, dim, start, stop):
            assert name == "model.layers.0.linear_attn.in_proj.weight", name
            return on_disk[start:stop]
    for tp in (1, 2):
        for rank in range(tp):
            ctx = shard_context(bridge, tp_rank=rank, tp_size=tp, padded_vocab=bridge.hf_config.vocab_size)
            loaded, (layout, rows) = fused_map.load(Reader(), ctx, 0), _layout_and_slices(targets, ctx, 0)
            for t in targets:
                assert torch.equal(t.b_to_megatron(sections[t.name], ctx)[rows[t.name]], layout.slot(loaded, t.name))
                assert torch.equal(t.b_to_hf(t.b_to_megatron(sections[t.name], ctx), ctx), sections[t.name])
    with pytest.raises(LoraConfigError, match=re.escape(f"use_dora=True is not supported on {sorted(slots)}")):
        plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear", use_dora=True))
