"""Core attention against a plain softmax(QK^T)V with repeated heads: causal GQA, KV-cache alignment, padding masks,
sliding windows, packed documents, and context parallelism over 2 CPU ranks; outputs and grads of q, k, v. The
partial attention of a CP-sharded KV cache: shares of the keys combined by their log-sum-exp equal the whole."""

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge_hf.kernels.attention import (CoreAttention, combine_partial_attention, dot_product_attention,
                                             packed_attention, partial_attention)

from ._reference import allowed_mask, attention_reference

D = 8
SCALE = 1 / math.sqrt(D)


def _qkv(sq, b, heads, kv_heads, *, skv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    skv = sq if skv is None else skv
    shapes = ((sq, b, heads, D), (skv, b, kv_heads, D), (skv, b, kv_heads, D))
    return tuple(torch.randn(shape, generator=g).to(dtype) for shape in shapes)


def _run(fn, q, k, v, grad_seed=7):
    """Output and grads of q, k, v under a random projection of the output."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    (out.float() * proj.float()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _assert_all_close(ours, ref, atol, rtol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a.float().reshape(b.shape), b.float(), atol=atol, rtol=rtol, msg=name)


def _module(config_overrides=None, mask_type=AttnMaskType.causal, heads=6, kv_heads=2):
    kw = dict(num_layers=2, hidden_size=heads * D, num_attention_heads=heads, num_query_groups=kv_heads,
              kv_channels=D, attention_dropout=0.0)
    kw.update(config_overrides or {})
    # NOTE: a pg_collection without groups stands for one tensor-parallel and one context-parallel rank.
    return CoreAttention(TransformerConfig(**kw), layer_number=1, attn_mask_type=mask_type, attention_type="self",
                         pg_collection=SimpleNamespace(tp=None, cp=None))


# bf16 is compared with the fp32 reference on the same inputs, at bf16's resolution.
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 1.6e-2)])
@pytest.mark.parametrize("sq,b,heads,kv_heads", [(13, 3, 6, 2), (41, 1, 4, 4), (7, 2, 3, 1)])
def test_causal_gqa_module_matches_reference(dtype, atol, rtol, sq, b, heads, kv_heads):
    q, k, v = _qkv(sq, b, heads, kv_heads, dtype=dtype)
    module = _module(heads=heads, kv_heads=kv_heads)
    ours = _run(lambda q, k, v: module(q, k, v, None), q, k, v)
    assert ours[0].shape == (sq, b, heads * D) and ours[0].dtype == dtype
    ref = _run(lambda q, k, v: attention_reference(q, k, v, scale=SCALE, allowed=allowed_mask(sq, sq, causal=True)),
               q.float(), k.float(), v.float())
    _assert_all_close(ours, ref, atol, rtol)


def test_queries_shorter_than_keys_are_the_last_positions():
    q, k, v = _qkv(5, 2, 4, 2, skv=13)
    ours = _run(lambda q, k, v: dot_product_attention(q, k, v, causal=True, scale=SCALE), q, k, v)
    ref = _run(lambda q, k, v: attention_reference(q, k, v, scale=SCALE, allowed=allowed_mask(5, 13, causal=True)),
               q, k, v)
    _assert_all_close(ours, ref, 1e-5, 1e-5)


@pytest.mark.parametrize("mask_type,causal", [(AttnMaskType.padding_causal, True), (AttnMaskType.padding, False)])
def test_padding_mask_megatron_convention(mask_type, causal):
    sq, b = 11, 3
    q, k, v = _qkv(sq, b, 4, 2)
    padded = torch.zeros(b, 1, 1, sq, dtype=torch.bool)
    padded[0, ..., :3] = True  # left padding: with the causal rule, rows 0..2 of sample 0 see nothing
    padded[2, ..., -4:] = True
    module = _module(mask_type=mask_type, heads=4)
    ours = _run(lambda q, k, v: module(q, k, v, padded), q, k, v)
    allowed = ~padded & (allowed_mask(sq, sq, causal=causal) if causal else True)
    ref = _run(lambda q, k, v: attention_reference(q, k, v, scale=SCALE, allowed=allowed), q, k, v)
    _assert_all_close(ours, ref, 1e-5, 1e-5)
    if causal:
        assert torch.equal(ours[0][:3, 0], torch.zeros(3, 4 * D))


def test_float_mask_is_added_to_the_scores():
    q, k, v = _qkv(9, 2, 4, 2)
    bias = torch.randn(2, 1, 9, 9, generator=torch.Generator().manual_seed(4))
    ours = dot_product_attention(q, k, v, causal=True, scale=SCALE, mask=bias)
    groups = 2
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k.repeat_interleave(groups, 2)) * SCALE + bias
    scores = scores.masked_fill(~allowed_mask(9, 9, causal=True), float("-inf"))
    ref = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v.repeat_interleave(groups, 2))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_sliding_window_from_config():
    sq = 17
    q, k, v = _qkv(sq, 2, 4, 2)
    module = _module({"window_size": (4, 0)}, heads=4)
    ours = _run(lambda q, k, v: module(q, k, v, None), q, k, v)
    allowed = allowed_mask(sq, sq, causal=True, window=(4, 0))
    ref = _run(lambda q, k, v: attention_reference(q, k, v, scale=SCALE, allowed=allowed), q, k, v)
    _assert_all_close(ours, ref, 1e-5, 1e-5)
    skipped = _module({"window_size": (4, 0), "window_attn_skip_freq": 1}, heads=4)  # every layer global
    assert skipped.window is None


@pytest.mark.parametrize("sq,size", [(17, 5), (15, 5), (6, 8)])
def test_chunked_attention_without_a_mask(sq, size, monkeypatch):
    """Llama 4's chunked attention (``attention_chunks``) on queries and keys of the same tokens without a mask runs as
    causal SDPA over the chunks batched (17 tokens: three whole chunks of 5 and a partial one; 15: whole chunks
    only), and keys that fit in one chunk (6 of 8) as plain causal attention: both the reference within chunks (fp32,
    1e-5), and neither builds a mask (``within_chunks`` not called)."""
    from loongforge_hf.kernels import attention

    q, k, v = _qkv(sq, 2, 4, 2)
    module = _module(heads=4)
    monkeypatch.setattr(attention, "within_chunks", lambda *a, **kw: pytest.fail("a chunk mask was built"))
    with attention.attention_chunks(size):
        ours = _run(lambda q, k, v: module(q, k, v, None), q, k, v)
    pos = torch.arange(sq)
    allowed = allowed_mask(sq, sq, causal=True) & (pos[:, None] // size == pos[None, :] // size)
    ref = _run(lambda q, k, v: attention_reference(q, k, v, scale=SCALE, allowed=allowed), q, k, v)
    _assert_all_close(ours, ref, 1e-5, 1e-5)


def _packed_params(cu, cu_padded=None):
    cu = torch.tensor(cu, dtype=torch.int32)
    padded = None if cu_padded is None else torch.tensor(cu_padded, dtype=torch.int32)
    lengths = (padded if padded is not None else cu).diff()
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=int(lengths.max()),
                           max_seqlen_kv=int(lengths.max()))


def test_packed_documents_equal_each_document_alone():
    cu = [0, 5, 12, 12, 20, 21]  # includes an empty and a one-token document
    q, k, v = (t[:, 0] for t in _qkv(21, 1, 6, 2))  # thd: [t, h, d]
    module = _module()
    ours = _run(lambda q, k, v: module(q, k, v, None, packed_seq_params=_packed_params(cu)), q, k, v)
    assert ours[0].shape == (21, 6 * D)

    def per_document(q, k, v):
        outs = []
        for a, b in zip(cu[:-1], cu[1:]):
            if b > a:
                outs.append(attention_reference(q[a:b, None], k[a:b, None], v[a:b, None], scale=SCALE,
                                                allowed=allowed_mask(b - a, b - a, causal=True))[:, 0])
        return torch.cat(outs)

    _assert_all_close(ours, _run(per_document, q, k, v), 1e-5, 1e-5)


def test_padded_packed_documents_keep_real_tokens_exact():
    cu, cu_padded = [0, 5, 11], [0, 8, 16]
    q, k, v = (t[:, 0] for t in _qkv(16, 1, 4, 2, seed=3))
    out = packed_attention(q, k, v, _packed_params(cu, cu_padded), causal=True, scale=SCALE)
    for (a, b), start in zip(((0, 5), (5, 11)), (0, 8)):
        n = b - a
        rows = slice(start, start + n)
        ref = attention_reference(q[rows, None], k[rows, None], v[rows, None], scale=SCALE,
                                  allowed=allowed_mask(n, n, causal=True))[:, 0]
        torch.testing.assert_close(out[rows].reshape(n, -1), ref, atol=1e-5, rtol=1e-5)


def test_eval_mode_ignores_dropout_and_bad_calls_raise():
    q, k, v = _qkv(6, 2, 6, 2)
    module = _module({"attention_dropout": 0.5}).eval()
    ref = attention_reference(q, k, v, scale=SCALE, allowed=allowed_mask(6, 6, causal=True))
    torch.testing.assert_close(module(q, k, v, None), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attention_bias"):
        module(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="qkv_format='sbhd'"):
        module(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="attention_mask must be None"):
        module(q[:, 0], k[:, 0], v[:, 0], torch.zeros(1, dtype=torch.bool), packed_seq_params=_packed_params([0, 6]))
    with pytest.raises(ValueError, match="softmax_type must be"):
        _module({"softmax_type": "sigmoid"})


def test_softmax_scale_from_argument():
    q, k, v = _qkv(6, 1, 6, 2)
    module = CoreAttention(TransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=2,
                                             kv_channels=D, attention_dropout=0.0),
                           layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                           softmax_scale=0.3, pg_collection=SimpleNamespace(tp=None, cp=None))
    ref = attention_reference(q, k, v, scale=0.3, allowed=allowed_mask(6, 6, causal=True))
    torch.testing.assert_close(module(q, k, v, None), ref, atol=1e-5, rtol=1e-5)


def test_context_parallel_cp2_equals_full_attention(distributed_op_results):
    # each rank asserted its output rows and its q/k/v grads at 1e-5 against full attention in its own process
    expected = ["causal_gqa_module", "sliding_window", "padding_mask", "packed_padded", "dropout_runs"]
    for rank in distributed_op_results:
        assert rank["attention_cp2"] == expected


@pytest.mark.parametrize("shares, block", [(1, 512), (2, 512), (5, 512), (1, 2), (1, 3), (2, 1)])
def test_partial_attention_shares_combine_to_whole(shares, block):
    """``partial_attention`` over round-robin shares of the keys (as a CP-sharded KV cache holds them; with 5 shares of
    4 keys one is empty), combined by ``combine_partial_attention``, equals attention over every key within 1e-5:
    grouped-query heads, value heads wider than key heads, a per-row key mask; a query row with no key allowed gives
    zeros (as CoreAttention). ``block``: the keys taken in blocks of that length and the rest (4 keys: 2 blocks of 2;
    1 of 3 and a rest of 1; 2 x 2 per share of 2)."""
    g = torch.Generator().manual_seed(3)
    b, h, h_kv, sq, skv = 2, 4, 2, 3, 4
    q, k = torch.randn(sq, b, h, D, generator=g), torch.randn(skv, b, h_kv, D, generator=g)
    v = torch.randn(skv, b, h_kv, D + 3, generator=g)
    allowed = torch.rand(b, 1, sq, skv, generator=g) > 0.3
    allowed[1, 0, 0] = False  # NOTE: no key for one query row
    allowed[0, 0, 1] = True
    ref = attention_reference(q, k, v, scale=SCALE, allowed=allowed)
    outs, lses = [], []
    for r in range(shares):
        keys = slice(r, None, shares)
        out, lse = partial_attention(q.permute(1, 2, 0, 3), k[keys].permute(1, 2, 0, 3), v[keys].permute(1, 2, 0, 3),
                                     allowed=allowed[..., keys], scale=SCALE, block=block)
        outs.append(out)
        lses.append(lse)
    got = combine_partial_attention(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got.permute(2, 0, 1, 3).reshape(ref.shape), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1, :, 0], torch.zeros_like(got[1, :, 0]))


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_softcapped_scores_match_transformers_eager(window):
    """Gemma 2's ``attn_logit_softcapping`` (``CoreAttention.softcap``): output and grads as transformers' eager
    attention (scores ``cap * tanh(q k^T * scale / cap)``, then mask and softmax), with GQA, causal and a window
    (fp32, 1e-5); 0.05+ off in the output without the cap; packed documents each alone."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    cap = 1.5
    q, k, v = _qkv(11, 2, 6, 2, seed=3)
    q = q * 3  # NOTE: scores past the cap's linear range
    module = _module({"window_size": window} if window else None)
    module.softcap = cap
    ours = _run(lambda q, k, v: module(q, k, v, None), q, k, v)
    allowed = allowed_mask(11, 11, causal=True, window=window)
    bias = torch.zeros(11, 11).masked_fill(~allowed, float("-inf"))

    def eager(q, k, v):
        hf = SimpleNamespace(num_key_value_groups=3, training=False)
        out, _ = eager_attention_forward(hf, q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                         bias, scaling=SCALE, softcap=cap)
        return out.permute(1, 0, 2, 3).reshape(11, 2, -1)

    _assert_all_close(ours, _run(eager, q, k, v), atol=1e-5, rtol=1e-5)
    module.softcap = None
    assert (module(q, k, v, None) - ours[0]).abs().max() > 0.05
    module.softcap = cap
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 11], dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor([0, 5, 11], dtype=torch.int32), max_seqlen_q=6,
                             max_seqlen_kv=6)
    packed = module(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=params)
    alone = torch.cat([module(q[a:b, :1], k[a:b, :1], v[a:b, :1], None)[:, 0] for a, b in ((0, 5), (5, 11))])
    torch.testing.assert_close(packed, alone, atol=1e-6, rtol=1e-6)
