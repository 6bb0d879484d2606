"""MiniMax (Text-01 / M1): the lightning-attention kernel against a plain recurrence written here (outputs and
gradients, odd shapes, blocks that end mid-sequence, a state carried between calls) and against transformers' decay
tables; the bridge's refusals, pure and before any collective. Parity with transformers (logits, loss,
``router_logits``, left padding, packed documents, cached generate, bit-exact export; at cp2ep2 too) runs in
test_moe_parity, gradients (at CP2 too) in test_gradients."""

import pytest
import torch
import transformers

from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
from loongforge_hf.kernels.lightning_attention import decay_tables, lightning_attention, slope_rates
from loongforge_hf.testing.tiny_models import _config


def _recurrence(q, k, v, slope, state=None):
    """``S_t = exp(-slope) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``, token by token (fp64)."""
    b, h, s, d = q.shape
    state = torch.zeros(b, h, d, d, dtype=q.dtype) if state is None else state
    out = []
    for t in range(s):
        state = torch.exp(-slope) * state + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append(torch.einsum("bhd,bhde->bhe", q[:, :, t], state))
    return torch.stack(out, dim=2), state


def _tables(heads: int, block: int, dtype=torch.float64):
    slope = slope_rates(heads, layer=1, num_layers=4).to(dtype)
    return dict(zip(("slope_rate", "query_decay", "key_decay", "diagonal_decay"), (slope, *decay_tables(slope, block))))


def test_lightning_attention_matches_the_recurrence():
    """9 x 3 heads x 13 tokens x 7 channels in blocks of 4 (the last 1 long): outputs, final state and every input's
    gradient within 1e-10 (fp64) of the token-by-token recurrence; two calls with the state carried equal one."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 3, 13, 7, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    tables = _tables(3, 4)
    out, state = lightning_attention(q, k, v, **tables, output_final_state=True)
    ref, ref_state = _recurrence(q, k, v, tables["slope_rate"])
    assert (out - ref).abs().max() < 1e-10 and (state - ref_state).abs().max() < 1e-10
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-10
    first, mid = lightning_attention(*(x[:, :, :6] for x in (q, k, v)), **tables, output_final_state=True)
    rest = lightning_attention(*(x[:, :, 6:] for x in (q, k, v)), **tables, initial_state=mid)
    assert (torch.cat((first, rest), dim=2) - out).abs().max() < 1e-10


def test_decay_tables_are_transformers_buffers():
    """``slope_rates`` / ``decay_tables`` give transformers' ``MiniMaxLightningAttention`` buffers bit for bit."""
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    cfg = _config("minimax")
    layer = MiniMaxLightningAttention(cfg, layer_idx=2)
    slope = slope_rates(cfg.num_attention_heads, layer=2, num_layers=cfg.num_hidden_layers)
    for name, ours in zip(("slope_rate", "query_decay", "key_decay", "diagonal_decay"),
                          (slope, *decay_tables(slope, cfg.block_size))):
        assert torch.equal(ours, getattr(layer, name)), name


def _bridge(**overrides):
    return get_bridge(_config("minimax", architectures=["MiniMaxForCausalLM"], **overrides))


@pytest.mark.parametrize("overrides,field", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]}, "layer_types="),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types="),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"block_size": 0}, "block_size=0"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
])
def test_fields_megatron_cannot_express_refused(overrides, field):
    with pytest.raises(UnsupportedConfigError, match=field.replace("[", r"\[")):
        _bridge(**overrides)


def test_static_cache_refused():
    """The static cache (its fixed-shape step keeps no lightning state) by the bridge's generation refusal; the
    dynamic cache runs (context parallelism too: test_moe_parity's cp2ep2, test_gradients' cp2)."""
    bridge = _bridge()
    static = transformers.GenerationConfig(use_cache=True, cache_implementation="static")
    assert "cache_implementation='static'" in bridge.generation_refusal(static)
    assert bridge.generation_refusal(transformers.GenerationConfig(use_cache=True)) is None
