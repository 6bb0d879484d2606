"""Which megatron layer spec a bridge's model is built from."""

from __future__ import annotations


def layer_spec_for(bridge, config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=bridge.qk_norm, num_experts=bridge.num_experts())
