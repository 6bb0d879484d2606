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


def test_unknown_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="supported: default, linear, llama3"):
        rope_inv_freq(16, base=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0})


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


# The Triton kernel (``_rope_triton.rotate``) on odd layouts: partial rotary, b = 1 and 3, head counts that are not
# powers of two, one broadcast position, strided q/k views of a fused QKV tensor, angles whose halves differ (the
# kernel reads each half as given), several row chunks per program (``TILE`` shrunk), forward and inverse, angles
# changed in place after use (the cached cos/sin tables are recomputed).
# Reference: the rotation in float64 from the same per-half angles (within [-4, 4]); fp32 within 1e-5, bf16 within
# one rounding (rtol 2^-7: the kernel rounds once) plus atol 1e-5 for results that cancel to near zero, where the
# rounding of the fp32 cos/sin and products (~1e-7 relative) times inputs of ~8 shows. Then through
# autograd (megatron's slot, megatron's cat(f, f) angles) against the torch path with _triton_checks' tolerances.
# On CPU it runs through Triton's interpreter in a child process (the interpreter is chosen at import).
ROPE_CASES = [(7, 3, 5, 16, 16, 7, 4096), (5, 1, 3, 24, 12, 5, 4096), (9, 3, 6, 20, 8, 1, 4096),
              (6, 3, 5, 16, 16, 6, 16), (33, 1, 1, 8, 4, 33, 4096), (4, 2, 3, 12, 6, 4, 8)]


def _rotate_reference(x, freqs, inverse):
    half, rot = freqs.shape[-1] // 2, freqs.shape[-1]
    xf, f = x.double(), freqs.double()
    c, s = f.cos(), f.sin()
    x1, x2 = xf[..., :half], xf[..., half:rot]
    if inverse:
        y1, y2 = x1 * c[..., :half] + x2 * s[..., half:], x2 * c[..., half:] - x1 * s[..., :half]
    else:
        y1, y2 = x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]
    return torch.cat((y1, y2, xf[..., rot:]), -1)


def check_rotate_layouts(device, cases=ROPE_CASES):
    """Run the checks above on ``device``; returns ``[s, b, h, d, rot, positions, chunks, BLOCK_S]`` per case and
    dtype."""
    from loongforge_hf.kernels import _rope_triton as R
    from loongforge_hf.kernels.rope import rotary_sbhd

    from ._triton_checks import _compare, _two_ulps

    g = torch.Generator().manual_seed(0)
    done, saved_tile = [], R.TILE
    try:
        for s_len, b, h, d, rot, f_len, tile in cases:
            R.TILE = tile
            config = R.launch_config(s_len, b, h, d, rot)
            for dtype, atol, rtol in ((torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-5, 2.0 ** -7)):
                qkv = (torch.randn(s_len, b, 3 * h * d + 5, generator=g) * 2).to(dtype).to(device)
                x = qkv[..., 5 + h * d:5 + 2 * h * d].unflatten(-1, (h, d))
                assert not x.is_contiguous()
                freqs = (torch.rand(f_len, 1, 1, rot, generator=g) * 8 - 4).to(device)
                # NOTE: the last pass changes the angles in place: their cached cos/sin tables must not be reused
                for inverse, scale in ((False, None), (True, None), (False, -0.5)):
                    if scale is not None:
                        assert R.cos_sin(freqs)[0] is R.cos_sin(freqs)[0], "tables computed once per angle tensor"
                        freqs.mul_(scale)
                    y = R.rotate(x, freqs, inverse=inverse)
                    assert y.is_contiguous() and y.shape == x.shape and y.dtype == dtype
                    torch.testing.assert_close(y.double(), _rotate_reference(x, freqs, inverse).to(dtype).double(),
                                               atol=atol, rtol=rtol)
                done.append([s_len, b, h, d, rot, f_len, config["chunks"], config["BLOCK_S"]])
            angles = torch.arange(s_len)[:, None] * (10000.0 ** (-torch.arange(0, rot, 2) / rot))[None]
            freqs = torch.cat((angles, angles), -1)[:, None, None, :].to(device)
            qkv = torch.randn(s_len, b, h, 3 * d, generator=g).to(torch.bfloat16).to(device)
            dy = torch.randn(s_len, b, h, d, generator=g).to(torch.bfloat16).to(device)
            _compare(f"rope{(s_len, b, h, d, rot)}", lambda qkv: rotary_sbhd(qkv[..., d:2 * d], freqs), [qkv], dy,
                     torch.bfloat16, atol16=max(_two_ulps(qkv), _two_ulps(dy)))
    finally:
        R.TILE = saved_tile
    return done


def test_triton_rope_kernel_odd_layouts_in_the_interpreter():
    from ._interpret import needs_triton, run_interpreted

    if needs_triton.args[0]:
        pytest.skip(needs_triton.kwargs["reason"])
    done = run_interpreted("from tests.kernels.test_rope import check_rotate_layouts\ncheck_rotate_layouts('cpu')")
    assert len(done) == 12
    chunks = {row[6] for row in done}
    blocks = {row[7] for row in done}
    assert max(chunks) > 1 and 1 in chunks and max(blocks) > 1, (chunks, blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_rope_kernel_odd_and_training_layouts_on_cuda():
    """The same checks on the GPU, plus bench_train's shape (a): q and k of micro-batch 4 split off one fused QKV
    output (and a micro-batch of 1 and of 3 at full length), head_dim 128, partial rotary at 64."""
    from loongforge_hf.kernels._triton import use_triton

    assert use_triton(torch.empty(1, device="cuda")), "triton is not importable on this GPU machine"
    big = [(4096, 4, 16, 128, 128, 4096, 4096), (4096, 4, 8, 128, 128, 4096, 4096), (4096, 1, 8, 128, 128, 1, 4096),
           (2048, 3, 5, 128, 64, 2048, 4096)]
    done = check_rotate_layouts("cuda", ROPE_CASES + big)
    assert len(done) == 2 * (len(ROPE_CASES) + len(big))
