"""RoPE against transformers (inverse frequencies, cos/sin, rotate-half application, partial rotary) and against
megatron's RotaryEmbedding once our frequencies are installed in it."""

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as megatron_apply_rotary
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as hf_apply_partial_rotary

from loongforge_hf.kernels.rope import apply_rotary, rope_cos_sin, rope_inv_freq, set_megatron_inv_freq
from loongforge_hf.xpu import get_backend

LLAMA3 = [
    # Llama 3.1 8B's own numbers.
    dict(head_dim=128, theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original=8192),
    # A short context, so that the three bands (kept, blended, slowed) all occur within 8 frequencies.
    dict(head_dim=16, theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original=64),
    dict(head_dim=24, theta=10000.0, factor=32.0, low_freq_factor=2.0, high_freq_factor=16.0, original=256),
]


def _hf_config(head_dim, theta, rope_parameters, partial_rotary_factor=None):
    params = {"rope_theta": theta, **rope_parameters}
    if partial_rotary_factor is not None:
        params["partial_rotary_factor"] = partial_rotary_factor
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_parameters=params,
                       max_position_embeddings=4096)


@pytest.mark.parametrize("case", LLAMA3)
def test_llama3_inv_freq_matches_transformers(case):
    scaling = {"rope_type": "llama3", "factor": case["factor"], "low_freq_factor": case["low_freq_factor"],
               "high_freq_factor": case["high_freq_factor"], "original_max_position_embeddings": case["original"]}
    config = _hf_config(case["head_dim"], case["theta"], scaling)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    ours = rope_inv_freq(case["head_dim"], base=case["theta"], rope_scaling=scaling)
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)
    if case["original"] == 64:
        unscaled = rope_inv_freq(case["head_dim"], base=case["theta"])
        wavelength = 2 * math.pi / unscaled
        kept, slowed = wavelength < 64 / 4, wavelength > 64 / 1
        assert kept.any() and slowed.any() and (~kept & ~slowed).any()


@pytest.mark.parametrize("rope_type,extra", [("default", {}), ("linear", {"factor": 4.0})])
def test_default_and_linear_inv_freq_match_transformers(rope_type, extra):
    config = _hf_config(16, 10000.0, {"rope_type": rope_type, **extra})
    fn = ROPE_INIT_FUNCTIONS[rope_type] if rope_type != "default" else None
    expected = fn(config, None)[0] if fn else LlamaRotaryEmbedding(config).inv_freq
    torch.testing.assert_close(rope_inv_freq(16, base=10000.0, rope_scaling={"rope_type": rope_type, **extra}),
                               expected, atol=0, rtol=1e-6)


YARN = [
    # Qwen3's recommended long-context setting (head 128, theta 1e6, factor 4 over 32768)
    dict(head_dim=128, theta=1000000.0, rope={"factor": 4.0, "original_max_position_embeddings": 32768}),
    # a short context: kept, ramped and divided dims all within 12 frequencies; DeepSeek-style mscale ratio
    dict(head_dim=24, theta=10000.0, rope={"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16,
                                           "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 1.0}),
    dict(head_dim=16, theta=10000.0, rope={"factor": 4.0, "original_max_position_embeddings": 32, "truncate": False,
                                           "attention_factor": 1.3}),
]


@pytest.mark.parametrize("case", YARN)
def test_yarn_inv_freq_and_attention_factor_match_transformers(case):
    """The frequencies bit for bit (the same ops in the same order) and the cos / sin scale."""
    from loongforge_hf.kernels.rope import rope_attention_factor

    scaling = {"rope_type": "yarn", **case["rope"]}
    config = _hf_config(case["head_dim"], case["theta"], scaling)
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    ours = rope_inv_freq(case["head_dim"], base=case["theta"], rope_scaling=scaling)
    assert torch.equal(ours, expected)
    assert rope_attention_factor(scaling, config.max_position_embeddings) == pytest.approx(factor, rel=1e-12)
    unscaled = rope_inv_freq(case["head_dim"], base=case["theta"])
    assert (ours == unscaled).any() and (ours < unscaled).any()  # some dims kept, some interpolated


@pytest.mark.parametrize("long", [False, True])
def test_longrope_short_and_long_frequencies_match_transformers(long):
    """LongRoPE's short factors (a forward within original_max_position_embeddings) and long ones (past it), bit for
    bit transformers' (``seq_len`` past the switch picks the long factors there)."""
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 32,
               "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 3.5, 4.0],
               "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]}
    config = _hf_config(16, 10000.0, scaling)
    expected, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=33 if long else None)
    assert torch.equal(rope_inv_freq(16, base=10000.0, rope_scaling=scaling, longrope_long=long), expected)


def test_unknown_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="supported: default, linear, llama3, longrope, yarn"):
        rope_inv_freq(16, base=10000.0, rope_scaling={"rope_type": "dynamic", "factor": 4.0})


def reference_rotary(x, cos, sin):
    d = cos.shape[-1]
    x_rot, x_pass = x[..., :d], x[..., d:]
    rotated = torch.cat((-x_rot[..., d // 2:], x_rot[..., :d // 2]), dim=-1)
    return torch.cat((x_rot * cos.to(x.dtype) + rotated * sin.to(x.dtype), x_pass), dim=-1)


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-6, 1e-6), (torch.bfloat16, 0, 0)])
def test_full_rotary_matches_llama(dtype, atol, rtol):
    b, heads, s, d = 3, 7, 41, 16
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    config = _hf_config(d, 10000.0, scaling)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(b, heads, s, d, generator=g).to(dtype), torch.randn(b, 2, s, d, generator=g).to(dtype)
    positions = torch.arange(s).expand(b, s) + torch.tensor([[0], [5], [100]])
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions)
    cos, sin = rope_cos_sin(rope_inv_freq(d, base=10000.0, rope_scaling=scaling), positions, dtype=dtype)
    torch.testing.assert_close(cos, hf_cos, atol=atol, rtol=rtol)
    torch.testing.assert_close(sin, hf_sin, atol=atol, rtol=rtol)
    hf_q, hf_k = hf_apply_rotary(q, k, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos[:, None], sin[:, None]), hf_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(apply_rotary(k, cos[:, None], sin[:, None]), hf_k, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_matches_transformers_and_grads_match_reference(dtype):
    b, heads, s, d, rotary = 2, 3, 13, 24, 8
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(b, heads, s, d, generator=g).to(dtype), torch.randn(b, 1, s, d, generator=g).to(dtype)
    inv_freq = rope_inv_freq(d, base=10000.0, partial_rotary_factor=rotary / d)
    assert inv_freq.shape == (rotary // 2,)
    cos, sin = rope_cos_sin(inv_freq, torch.arange(s).expand(b, s), dtype=dtype)
    hf_q, hf_k = hf_apply_partial_rotary(q, k, cos, sin)
    assert torch.equal(apply_rotary(q, cos[:, None], sin[:, None]), hf_q)
    assert torch.equal(apply_rotary(k, cos[:, None], sin[:, None]), hf_k)
    grad = torch.randn(q.shape, generator=g).to(dtype)
    x1, x2 = q.clone().requires_grad_(), q.clone().requires_grad_()
    apply_rotary(x1, cos[:, None], sin[:, None]).backward(grad)
    reference_rotary(x2, cos[:, None], sin[:, None]).backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-6, rtol=1e-6)
    # the pass-through channels get the output grad untouched
    assert torch.equal(x1.grad[..., rotary:], grad[..., rotary:])


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_megatron_rotary_embedding_with_our_inv_freq_equals_hf_rotary(rotary_percent):
    get_backend()  # megatron places the frequencies on "the current device": the backend answers for it
    s, b, heads, d = 11, 2, 3, 16
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    rotary = RotaryEmbedding(kv_channels=d, rotary_percent=rotary_percent, rotary_base=10000,
                             use_cpu_initialization=True)
    inv_freq = rope_inv_freq(d, base=10000.0, partial_rotary_factor=rotary_percent, rope_scaling=scaling)
    rotary(s)  # fills megatron's cache with the unscaled frequencies: installing must drop it
    set_megatron_inv_freq(rotary, inv_freq)
    emb = rotary(s)  # [s, 1, 1, rotary_dim]
    config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                               apply_rope_fusion=False)
    x = torch.randn(s, b, heads, d, generator=torch.Generator().manual_seed(3))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(s))
    ours = apply_rotary(x, cos[:, None, None], sin[:, None, None])
    # NOTE: megatron reads the CP group only for packed (thd) inputs; a one-rank stand-in keeps the test off dist.
    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    torch.testing.assert_close(megatron_apply_rotary(x, emb, config=config, cp_group=one_rank), ours,
                               atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="frequencies"):
        set_megatron_inv_freq(rotary, inv_freq[:-1])


@pytest.mark.parametrize("rot", [16, 8])
def test_fused_rope_slot_takes_megatron_rotation_with_unfused_numerics(rot):
    """``enable_megatron_fused_rope`` routes megatron's rotation through ``rotary_sbhd``; on CPU (torch path) the
    result equals megatron's unfused rotation bit for bit, forward and backward, partial rotary included."""
    from megatron.core.models.common.embeddings import rope_utils

    from loongforge_hf.kernels.rope import enable_megatron_fused_rope, rotary_sbhd

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    saved = rope_utils.fused_apply_rotary_pos_emb
    try:
        assert enable_megatron_fused_rope(config) and config.apply_rope_fusion
        assert rope_utils.fused_apply_rotary_pos_emb in (rotary_sbhd, saved)
        g = torch.Generator().manual_seed(0)
        angles = torch.arange(9)[:, None] * (10000.0 ** (-torch.arange(0, rot, 2) / rot))[None]
        freqs = torch.cat((angles, angles), -1)[:, None, None, :]
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.randn(9, 2, 4, 16, generator=g).to(dtype)
            dy = torch.randn(9, 2, 4, 16, generator=g).to(dtype)
            a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
            fused = rope_utils.apply_rotary_pos_emb(a, freqs, config=config, cp_group=SimpleNamespace())
            unfused = rope_utils._apply_rotary_pos_emb_bshd(b, freqs)
            fused.backward(dy)
            unfused.backward(dy)
            assert torch.equal(fused, unfused) and torch.equal(a.grad, b.grad)
    finally:
        rope_utils.fused_apply_rotary_pos_emb = saved
    interleaved = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, rotary_interleaved=True)
    assert not enable_megatron_fused_rope(interleaved) and not interleaved.apply_rope_fusion
