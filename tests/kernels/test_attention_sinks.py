"""Attention sinks (gpt-oss's ``sinks``, megatron's ``softmax_type``) against transformers' own gpt-oss eager
attention: causal GQA, a sliding window, queries shorter than the keys, padding masks (fully masked rows give zeros),
packed documents, soft-capping combined with sinks, the CP-sharded KV cache's partial attention merged by its
log-sum-exp (also on the Triton split-key path, in Triton's interpreter), the dynamic and static KV caches' decode
steps, and context / tensor parallelism over 2 CPU ranks. Outputs and grads of q, k, v and the sinks, fp32 at 1e-5
(the interpreter's bf16 case at bf16's resolution, 2e-2)."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from loongforge_hf.kernels.attention import (CoreAttention, attention_scores, combine_partial_attention,
                                             dot_product_attention, partial_attention)
from loongforge_hf.parallel.spawn import run_distributed

from ._interpret import needs_triton, run_interpreted
from ._reference import allowed_mask, load_balanced_rows

D = 8
SCALE = 1 / math.sqrt(D)
TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(sq, b, heads, kv_heads, *, skv=None, seed=0):
    """megatron layout, fp32: q ``[sq, b, h, d]``, k / v ``[skv, b, h_kv, d]``, and sinks ``[h]`` of ~1-3."""
    g = torch.Generator().manual_seed(seed)
    skv = sq if skv is None else skv
    shapes = ((sq, b, heads, D), (skv, b, kv_heads, D), (skv, b, kv_heads, D))
    q, k, v = (torch.randn(shape, generator=g) for shape in shapes)
    return q, k, v, 1.0 + 2 * torch.rand(heads, generator=g)


def eager(q, k, v, sinks, allowed=None):
    """transformers' gpt-oss ``eager_attention_forward`` in megatron layout (``[sq, b, h * d]``); ``allowed``
    (bool, True = may attend, broadcast to ``[b, h, sq, skv]``) as its additive mask."""
    hf = SimpleNamespace(num_key_value_groups=q.shape[2] // k.shape[2], sinks=sinks, training=False)
    bias = None if allowed is None else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    out, _ = eager_attention_forward(hf, q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), bias,
                                     scaling=SCALE)
    return out.permute(1, 0, 2, 3).reshape(q.shape[0], q.shape[1], -1)


def _grads(fn, *tensors, proj=None):
    """``fn``'s output and the grads of ``tensors`` under a projection of the output (default: random)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)) if proj is None else proj
    (out * proj).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _close(ours, ref, names=("out", "dq", "dk", "dv", "dsinks")):
    for name, a, b in zip(names, ours, ref):
        torch.testing.assert_close(a.reshape(b.shape), b, **TOL, msg=name)


def _config(heads=6, kv_heads=2, **overrides):
    return TransformerConfig(**{**dict(num_layers=2, hidden_size=heads * D, num_attention_heads=heads,
                                       num_query_groups=kv_heads, kv_channels=D, attention_dropout=0.0,
                                       softmax_type="learnable"), **overrides})


def _module(heads=6, kv_heads=2, mask_type=AttnMaskType.causal, sinks=None, **overrides):
    # NOTE: a pg_collection without groups stands for one tensor-parallel and one context-parallel rank.
    module = CoreAttention(_config(heads, kv_heads, **overrides), layer_number=1, attn_mask_type=mask_type,
                           attention_type="self", pg_collection=SimpleNamespace(tp=None, cp=None))
    if sinks is not None:
        with torch.no_grad():
            module.softmax_offset.copy_(sinks)
    return module


def _module_grads(module, fn, *tensors, proj=None):
    """``_grads`` of ``fn`` through ``module``, with the grad of its ``softmax_offset`` last."""
    module.zero_grad(set_to_none=True)
    return _grads(fn, *tensors, proj=proj) + [module.softmax_offset.grad]


@pytest.mark.parametrize("sq,skv,b,heads,kv_heads,window", [
    (13, 13, 3, 6, 2, None),  # causal, grouped-query
    (9, 9, 2, 4, 4, None),  # one key head per query head
    (17, 17, 2, 4, 2, (4, 0)),  # sliding window
    (5, 13, 2, 4, 2, None),  # queries are the last keys (a KV cache's step)
    (6, 11, 1, 3, 1, (3, 0)),  # both
])
def test_sinks_match_transformers_eager(sq, skv, b, heads, kv_heads, window):
    """``dot_product_attention`` under ``attention_scores(sinks=...)``: output and grads of q, k, v, sinks as
    transformers' gpt-oss eager attention; 0.05+ off without the sinks."""
    q, k, v, sinks = _qkv(sq, b, heads, kv_heads, skv=skv)
    allowed = allowed_mask(sq, skv, causal=True, window=window)

    def ours(q, k, v, sinks):
        with attention_scores(sinks=sinks):
            out = dot_product_attention(q, k, v, causal=True, scale=SCALE, window=window)
        return out.reshape(sq, b, -1)

    got = _grads(ours, q, k, v, sinks)
    _close(got, _grads(lambda q, k, v, s: eager(q, k, v, s, allowed), q, k, v, sinks))
    plain = dot_product_attention(q, k, v, causal=True, scale=SCALE, window=window).reshape(sq, b, -1)
    assert (plain - got[0]).abs().max() > 0.05


def test_core_attention_learnable_end_to_end():
    """``CoreAttention`` with ``softmax_type='learnable'``: a ``softmax_offset`` parameter of its heads, split over TP
    on dim 0, zeros at init; forward and grads (the parameter's too) as transformers' eager attention."""
    q, k, v, sinks = _qkv(11, 2, 6, 2, seed=1)
    module = _module()
    offset = module.softmax_offset
    assert isinstance(offset, torch.nn.Parameter) and offset.shape == (6,) and offset.dtype == torch.float32
    assert torch.equal(offset, torch.zeros(6)) and module.sinks is offset
    assert (offset.tensor_model_parallel, offset.partition_dim, offset.partition_stride) == (True, 0, 1)
    assert [name for name, _ in module.named_parameters()] == ["softmax_offset"]
    with torch.no_grad():
        offset.copy_(sinks)
    got = _module_grads(module, lambda q, k, v: module(q, k, v, None), q, k, v)
    assert got[0].shape == (11, 2, 6 * D)
    _close(got, _grads(lambda q, k, v, s: eager(q, k, v, s, allowed_mask(11, 11, causal=True)), q, k, v, sinks))


def test_off_by_one_and_vanilla():
    """``off-by-one``: a sink fixed at 0 for every head, no parameter; ``vanilla``: no sink, no parameter; another
    ``softmax_type`` raises."""
    q, k, v, _ = _qkv(7, 2, 4, 2, seed=2)
    fixed = _module(4, 2, softmax_type="off-by-one")
    assert fixed.softmax_offset is None and fixed.sinks == 0.0 and not list(fixed.parameters())
    torch.testing.assert_close(fixed(q, k, v, None), eager(q, k, v, torch.zeros(4), allowed_mask(7, 7, causal=True)),
                               **TOL)
    vanilla = _module(4, 2, softmax_type="vanilla")
    assert vanilla.sinks is None and not list(vanilla.parameters())
    ref = eager(q, k, v, torch.full((4,), float("-inf")), allowed_mask(7, 7, causal=True))  # NOTE: no sink mass
    torch.testing.assert_close(vanilla(q, k, v, None), ref, **TOL)
    with pytest.raises(ValueError, match="softmax_type must be 'vanilla', 'off-by-one' or 'learnable'"):
        _module(4, 2, softmax_type="sigmoid")


def test_padding_mask_fully_masked_rows_give_zeros():
    """megatron's bool mask (True = not allowed) with the causal rule: left padding leaves rows that see no key; they
    give zeros (all their mass on the sink), and their neighbours are exact, grads too."""
    sq, b = 9, 2
    q, k, v, sinks = _qkv(sq, b, 4, 2, seed=3)
    padded = torch.zeros(b, 1, 1, sq, dtype=torch.bool)
    padded[0, ..., :3] = True
    module = _module(4, 2, mask_type=AttnMaskType.padding_causal, sinks=sinks)
    got = _module_grads(module, lambda q, k, v: module(q, k, v, padded), q, k, v)
    allowed = ~padded & allowed_mask(sq, sq, causal=True)
    _close(got, _grads(lambda q, k, v, s: eager(q, k, v, s, allowed), q, k, v, sinks))
    assert torch.equal(got[0][:3, 0], torch.zeros(3, 4 * D))


def _thd_params(cu):
    cu = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(cu.diff().max()),
                           max_seqlen_kv=int(cu.diff().max()))


def test_packed_documents_each_with_its_sinks():
    """Packed documents (``thd``; an empty and a one-token document among them): each document's rows as
    transformers' eager attention over that document alone, grads of q, k, v and the sinks (summed over them)."""
    cu = [0, 5, 12, 12, 20, 21]
    q, k, v, sinks = (t[:, 0] if t.dim() == 4 else t for t in _qkv(21, 1, 6, 2, seed=4))
    module = _module(sinks=sinks)
    got = _module_grads(module, lambda q, k, v: module(q, k, v, None, packed_seq_params=_thd_params(cu)), q, k, v)
    assert got[0].shape == (21, 6 * D)

    def per_document(q, k, v, sinks):
        return torch.cat([eager(q[a:e, None], k[a:e, None], v[a:e, None], sinks,
                                allowed_mask(e - a, e - a, causal=True))[:, 0]
                          for a, e in zip(cu[:-1], cu[1:]) if e > a])

    _close(got, _grads(per_document, q, k, v, sinks))


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_softcap_then_mask_then_sink(window):
    """A soft-cap and sinks together: ``cap * tanh(q k^T * scale / cap)``, then the mask, then the sink column, as a
    hand reference (transformers has no model with both); output and grads, 0.05+ off with the cap alone."""
    cap, sq, b = 1.5, 11, 2
    q, k, v, sinks = _qkv(sq, b, 6, 2, seed=5)
    q = q * 3  # NOTE: scores past the cap's linear range
    module = _module(sinks=sinks, **({"window_size": window} if window else {}))
    module.softcap = cap
    got = _module_grads(module, lambda q, k, v: module(q, k, v, None), q, k, v)
    allowed = allowed_mask(sq, sq, causal=True, window=window)

    def reference(q, k, v, sinks):
        k, v = k.repeat_interleave(3, dim=2), v.repeat_interleave(3, dim=2)
        scores = torch.tanh(torch.einsum("qbhd,kbhd->bhqk", q, k) * SCALE / cap) * cap
        scores = scores.masked_fill(~allowed, float("-inf"))
        column = sinks.view(1, -1, 1, 1).expand(b, -1, sq, 1)
        probs = torch.cat((scores, column), dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(sq, b, -1)

    _close(got, _grads(reference, q, k, v, sinks))
    capped_only = _module(softmax_type="vanilla", **({"window_size": window} if window else {}))
    capped_only.softcap = cap
    assert (capped_only(q, k, v, None) - got[0]).abs().max() > 0.05


@pytest.mark.parametrize("shares, block", [(1, 512), (2, 512), (3, 512), (2, 1), (1, 2)])
def test_partial_attention_shares_with_sinks(shares, block):
    """``partial_attention`` over round-robin shares of the keys (a CP-sharded KV cache's), combined by
    ``combine_partial_attention(..., sinks=)`` (the total log-sum-exp, then ``sigmoid(lse - sink)``), equals
    transformers' eager attention over every key: output and grads of q, k, v, sinks; a query row with no allowed
    key gives zeros (forward), as an off-by-one sink (a float) does too."""
    g = torch.Generator().manual_seed(6)
    b, h, h_kv, sq, skv = 2, 4, 2, 3, 6
    q, k, v = torch.randn(sq, b, h, D, generator=g), torch.randn(skv, b, h_kv, D, generator=g), \
        torch.randn(skv, b, h_kv, D, generator=g)
    sinks = 1.0 + 2 * torch.rand(h, generator=g)
    allowed = torch.rand(b, 1, sq, skv, generator=g) > 0.3
    allowed[..., 0] = True  # NOTE: every row sees a key here (grads); an empty row is checked below

    def merged(q, k, v, sinks, allowed=allowed):
        outs, lses = [], []
        for r in range(shares):
            keys = slice(r, None, shares)
            out, lse = partial_attention(q.permute(1, 2, 0, 3), k[keys].permute(1, 2, 0, 3),
                                         v[keys].permute(1, 2, 0, 3), allowed=allowed[..., keys], scale=SCALE,
                                         block=block)
            outs.append(out)
            lses.append(lse)
        return combine_partial_attention(torch.stack(outs), torch.stack(lses), sinks=sinks).permute(2, 0, 1, 3)

    got = _grads(lambda *t: merged(*t).reshape(sq, b, -1), q, k, v, sinks)
    _close(got, _grads(lambda q, k, v, s: eager(q, k, v, s, allowed), q, k, v, sinks))
    with torch.no_grad():
        empty = allowed.clone()
        empty[1, 0, 0] = False
        out = merged(q, k, v, sinks, empty)
        torch.testing.assert_close(out.reshape(sq, b, -1), eager(q, k, v, sinks, empty), **TOL)
        assert torch.equal(out[0, 1], torch.zeros(h, D))
        torch.testing.assert_close(merged(q, k, v, 0.0).reshape(sq, b, -1), eager(q, k, v, torch.zeros(h), allowed),
                                   **TOL)


def test_kv_cache_steps_with_sinks():
    """The dynamic KV cache (``kv_cache.attached``): a prefill of 7 tokens then two one-token steps, with a left-padded
    row (transformers' 2-D mask), give the rows of attention over the whole sequence with sinks; the static cache's
    fixed decode step (``static_cache._fixed_attention``, over its whole buffer under a slot mask) as well."""
    from loongforge_hf.kv_cache import LoongKVCache, _key_padding_mask, _Step, attached
    from loongforge_hf.static_cache import LoongStaticCache, _fixed_attention

    s, b, prompt = 9, 2, 7
    q, k, v, sinks = _qkv(s, b, 6, 2, seed=8)
    mask_2d = torch.ones(b, s, dtype=torch.long)
    mask_2d[1, :2] = 0  # NOTE: row 1 left-padded
    allowed = allowed_mask(s, s, causal=True) & mask_2d.bool()[:, None, None, :]
    ref = eager(q, k, v, sinks, allowed)
    real = mask_2d.bool().T[..., None]  # NOTE: padding queries' rows are not compared (transformers' either)
    module = _module(sinks=sinks)
    for cache in (LoongKVCache([module], shard_over_cp=False),
                  LoongStaticCache([module], max_cache_len=s, shard_over_cp=False)):
        outs = []
        with torch.no_grad():
            for start, end in ((0, prompt), (prompt, prompt + 1), (prompt + 1, s)):
                rows = slice(start, end)
                if isinstance(cache, LoongStaticCache) and start > 0:  # NOTE: the fixed step's call
                    slots = torch.zeros(b, 1, 1, cache.slots, dtype=torch.bool)
                    slots[..., :end] = mask_2d[:, None, None, :end].bool()
                    outs.append(_fixed_attention(module, q[rows], k[rows], v[rows], None, layer=cache.layers[0],
                                                 allowed=slots, decode=None, shard=None))
                else:
                    mask = _key_padding_mask(mask_2d[:, :end], batch=b, past=start, given=end - start,
                                             padded=end - start, device=q.device)
                    step = _Step(past=start, given=end - start, padded=end - start, mask=mask)
                    with attached([module], cache, step):
                        outs.append(module(q[rows], k[rows], v[rows], None))
                cache.filled += end - start
        got = torch.cat(outs)
        torch.testing.assert_close(got * real, ref * real, **TOL, msg=type(cache).__name__)


def check_sharded_sinks_triton() -> list:
    """``sharded_attention`` with sinks on its Triton path (the split-key kernels' combine with the log-sum-exp, then
    the sink weight) in a one-rank world, against transformers' eager attention: run under ``TRITON_INTERPRET=1``
    by the test below (and fit for a GPU)."""
    from loongforge_hf.kernels import _decode_attention_triton
    from loongforge_hf.kernels._triton import triton_paths
    from loongforge_hf.kernels.attention import sharded_attention

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    checked = []
    g = torch.Generator().manual_seed(12)
    b, h, h_kv, n = 2, 4, 2, 70
    q, k, v = torch.randn(n, b, h, D, generator=g), torch.randn(n, b, h_kv, D, generator=g), \
        torch.randn(n, b, h_kv, D, generator=g)
    sinks = 1.0 + 2 * torch.rand(h, generator=g)
    allowed = torch.rand(b, 1, 1, n, generator=g) > 0.3
    allowed[1] = False  # NOTE: a row with no allowed key: zeros
    ref = eager(q[-1:], k, v, sinks, allowed)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        args = [t.to(dtype).permute(1, 2, 0, 3) for t in (q[-1:], k, v)]
        assert _decode_attention_triton.usable(*args)
        with triton_paths(True), attention_scores(sinks=sinks):
            got = sharded_attention(*args, allowed=allowed, scale=SCALE, group=dist.group.WORLD)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float().permute(2, 0, 1, 3).reshape(ref.shape), ref, atol=tol, rtol=tol)
        assert torch.equal(got[1].float(), torch.zeros_like(got[1].float()))
        checked.append(str(dtype))
    return checked


@needs_triton
def test_sharded_sinks_on_the_triton_path_in_the_interpreter():
    checked = run_interpreted("from tests.kernels.test_attention_sinks import check_sharded_sinks_triton\n"
                              "check_sharded_sinks_triton()")
    assert checked == ["torch.float32", "torch.bfloat16"]


# ---------------------------------------------------------------------------------- 2 ranks: CP=2, then TP=2

def _parallel_world() -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from loongforge_hf.kernels.attention import packed_attention, sharded_attention
    from loongforge_hf.parallel import ParallelConfig, initialize_parallel

    checked = []
    cp = 2
    initialize_parallel(ParallelConfig(context_parallel_size=cp))
    group = ps.get_context_parallel_group()
    rank = dist.get_rank(group)
    s, b, heads, kv_heads = 16, 2, 4, 2
    q, k, v, sinks = _qkv(s, b, heads, kv_heads, seed=9)
    rows = load_balanced_rows(s, cp, rank)

    # CoreAttention under CP: this rank's load-balanced rows of the whole-sequence result; the sinks' grads summed
    # over the CP ranks (as the data-parallel + CP gradient reduction does)
    module = CoreAttention(_config(heads, kv_heads, context_parallel_size=cp), layer_number=1,
                           attn_mask_type=AttnMaskType.causal, attention_type="self")
    assert module.cp_group is not None
    with torch.no_grad():
        module.softmax_offset.copy_(sinks)
    proj = torch.randn(s, b, heads * D, generator=torch.Generator().manual_seed(11))
    full = _grads(lambda q, k, v, sinks: eager(q, k, v, sinks, allowed_mask(s, s, causal=True)), q, k, v, sinks,
                  proj=proj)
    ours = _module_grads(module, lambda q, k, v: module(q, k, v, None), q[rows], k[rows], v[rows], proj=proj[rows])
    dist.all_reduce(ours[4], group=group)
    _close(ours, [t[rows] for t in full[:4]] + [full[4]])
    checked.append("core_attention_cp2")

    # a sliding window and packed documents (each load-balanced on its own) under CP
    window = (5, 0)
    with attention_scores(sinks=sinks):
        got = dot_product_attention(q[rows], k[rows], v[rows], causal=True, scale=SCALE, window=window,
                                    cp_group=group).reshape(len(rows), b, -1)
    _close([got], [eager(q, k, v, sinks, allowed_mask(s, s, causal=True, window=window))[rows]])
    cu = [0, 8, 12, 24]
    t = torch.randn(24, 3, heads, D, generator=torch.Generator().manual_seed(10))
    qt, kt, vt = t[:, 0], t[:, 1, :kv_heads], t[:, 2, :kv_heads]
    rows_t = torch.cat([a + load_balanced_rows(e - a, cp, rank) for a, e in zip(cu[:-1], cu[1:])])
    with attention_scores(sinks=sinks):
        got = packed_attention(qt[rows_t], kt[rows_t], vt[rows_t], _thd_params(cu), causal=True, scale=SCALE,
                               cp_group=group).reshape(len(rows_t), -1)
    ref = torch.cat([eager(qt[a:e, None], kt[a:e, None], vt[a:e, None], sinks,
                           allowed_mask(e - a, e - a, causal=True))[:, 0] for a, e in zip(cu[:-1], cu[1:])])
    _close([got], [ref[rows_t]])
    checked.append("window_and_packed_cp2")

    # the CP-sharded KV cache's attention: the same queries on both ranks, the keys round robin
    allowed = allowed_mask(3, s, causal=True)[None, None].expand(b, 1, 3, s).clone()
    allowed[1, ..., :4] = False  # NOTE: padding keys of row 1
    share = slice(rank, None, cp)
    with torch.no_grad(), attention_scores(sinks=sinks):
        got = sharded_attention(q[-3:].permute(1, 2, 0, 3), k[share].permute(1, 2, 0, 3), v[share].permute(1, 2, 0, 3),
                                allowed=allowed[..., share], scale=SCALE, group=group)
    _close([got.permute(2, 0, 1, 3).reshape(3, b, -1)], [eager(q[-3:], k, v, sinks, allowed)])
    checked.append("sharded_kv_cache_cp2")

    # TP=2: each rank holds half the heads and their sinks; the checkpoint's softmax_offset is split along dim 0
    tp = 2
    initialize_parallel(ParallelConfig(tensor_parallel_size=tp))
    rank = ps.get_tensor_model_parallel_rank()
    module = CoreAttention(_config(heads, kv_heads, tensor_model_parallel_size=tp), layer_number=1,
                           attn_mask_type=AttnMaskType.causal, attention_type="self")
    assert module.softmax_offset.shape == (heads // tp,)
    mine = slice(rank * heads // tp, (rank + 1) * heads // tp)
    mine_kv = slice(rank * kv_heads // tp, (rank + 1) * kv_heads // tp)
    with torch.no_grad():
        module.softmax_offset.copy_(sinks[mine])
    got = module(q[:, :, mine], k[:, :, mine_kv], v[:, :, mine_kv], None)
    ref = eager(q, k, v, sinks, allowed_mask(s, s, causal=True)).reshape(s, b, heads, D)[:, :, mine]
    _close([got], [ref.reshape(s, b, -1)])
    state = module.sharded_state_dict(prefix="decoder.layers.0.self_attention.core_attention.")
    tensor = state["decoder.layers.0.self_attention.core_attention.softmax_offset"]
    assert isinstance(tensor, ShardedTensor) and list(state) == [tensor.key]
    assert (tuple(tensor.global_shape), tuple(tensor.global_offset)) == ((heads,), (rank * heads // tp,))
    assert tensor.data is module.softmax_offset
    checked.append("tensor_parallel2")
    return checked


def test_context_and_tensor_parallel_sinks():
    """Over 2 CPU ranks: CoreAttention with sinks under CP=2 (rows, grads of q, k, v and the sinks summed over the
    ranks), a window and packed documents under CP, the CP-sharded KV cache's merged attention, and TP=2 (each
    rank's heads with their sinks; ``sharded_state_dict`` splits ``softmax_offset`` on dim 0), at 1e-5."""
    expected = ["core_attention_cp2", "window_and_packed_cp2", "sharded_kv_cache_cp2", "tensor_parallel2"]
    for checked in run_distributed(_parallel_world, 2, timeout=240):
        assert checked == expected
