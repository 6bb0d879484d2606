"""Fused linear cross-entropy against F.cross_entropy on materialised logits: loss and grads of hidden and weight,
ignore_index, padded vocabulary, z-loss, per-token reduction, chunking; vocab-parallel over TP=2 equals TP=1.
Token stats (entropy sum, top-1 count) against log_softmax / argmax on the same logits (fp32: 1e-5; the top-1 count
exactly, tied maxima included)."""

import pytest
import torch
import torch.nn.functional as F

from loongforge_hf.kernels.cross_entropy import linear_cross_entropy, logits_token_stats

N, H, V_REAL, V_PADDED = 37, 16, 41, 48


def _inputs(dtype, seed=0, n=N, v=V_PADDED):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g).to(dtype)
    weight = (torch.randn(v, H, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V_REAL, (n,), generator=g)
    labels[::5] = -100
    return hidden, weight, labels


def reference(hidden, weight, labels, *, vocab_size=V_REAL, z_loss=0.0, reduction="sum", label_smoothing=0.0):
    logits = (hidden @ weight[:vocab_size].t()).float()
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).square() * (labels != -100)
    return loss.sum() if reduction == "sum" else loss


def _grads(fn, hidden, weight, labels, grad_out=None, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, labels, **kw)
    loss.backward(grad_out)
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 1000])
@pytest.mark.parametrize("z_loss, label_smoothing", [(0.0, 0.0), (1e-3, 0.0), (0.0, 0.3), (1e-3, 0.1)])
def test_sum_matches_cross_entropy_on_materialised_logits_fp32(chunk_size, z_loss, label_smoothing):
    hidden, weight, labels = _inputs(torch.float32)
    loss, gh, gw = _grads(linear_cross_entropy, hidden, weight, labels, vocab_size=V_REAL, chunk_size=chunk_size,
                          z_loss=z_loss, label_smoothing=label_smoothing)
    ref_loss, ref_gh, ref_gw = _grads(reference, hidden, weight, labels, z_loss=z_loss,
                                      label_smoothing=label_smoothing)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, ref_gw, atol=1e-5, rtol=1e-5)
    assert torch.equal(gw[V_REAL:], torch.zeros(V_PADDED - V_REAL, H))  # padded rows take no gradient


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_softcap_is_cross_entropy_of_soft_capped_logits(reduction):
    """Gemma 2's final-logit soft-capping: loss, token stats and the grads of hidden and weight those of
    ``cap * tanh(logits / cap)`` through autograd (fp32, 1e-5), chunked; the cap matters here (logits up to ~5)."""
    hidden, weight, labels = _inputs(torch.float32, seed=4)
    hidden = hidden * 2
    cap = 3.0

    def capped(h, w, y, **kw):
        logits = (h @ w[:V_REAL].t()).float()
        logits = torch.tanh(logits / cap) * cap
        loss = F.cross_entropy(logits, y, ignore_index=-100, reduction="none")
        return loss.sum() if kw.get("reduction", "sum") == "sum" else loss

    grad_out = None if reduction == "sum" else torch.rand(N, generator=torch.Generator().manual_seed(1))
    stats = torch.zeros(2)
    ours = _grads(linear_cross_entropy, hidden, weight, labels, grad_out, vocab_size=V_REAL, chunk_size=5,
                  softcap=cap, reduction=reduction, token_stats=stats)
    ref = _grads(capped, hidden, weight, labels, grad_out, reduction=reduction)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    plain = _grads(linear_cross_entropy, hidden, weight, labels, grad_out, vocab_size=V_REAL, reduction=reduction)
    assert (plain[0] - ref[0]).abs().max() > 1e-2  # NOTE: the cap changes the loss
    logits = torch.tanh((hidden @ weight[:V_REAL].t()) / cap) * cap
    torch.testing.assert_close(stats, logits_token_stats(logits, labels), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_bias_is_cross_entropy_of_biased_logits(reduction, chunk_size):
    """Phi's LM head bias: loss, token stats and the grads of hidden, weight and bias those of autograd through
    ``hidden @ weight.T + bias`` (fp32, 1e-5), with z-loss and label smoothing, padded rows taking no gradient; the
    bias matters here (its scale is the logits')."""
    hidden, weight, labels = _inputs(torch.float32, seed=5)
    bias = torch.randn(V_PADDED, generator=torch.Generator().manual_seed(6))
    grad_out = None if reduction == "sum" else torch.rand(N, generator=torch.Generator().manual_seed(1))
    kw = dict(z_loss=1e-3, label_smoothing=0.2, reduction=reduction)

    def run(fn, **extra):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        loss = fn(h, w, b, **extra)
        loss.backward(grad_out)
        return loss.detach(), h.grad, w.grad, b.grad

    def biased(h, w, b):
        logits = (h @ w[:V_REAL].t() + b[:V_REAL]).float()
        loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none", label_smoothing=0.2)
        loss = loss + 1e-3 * torch.logsumexp(logits, dim=-1).square() * (labels != -100)
        return loss.sum() if reduction == "sum" else loss

    stats = torch.zeros(2)
    ours = run(lambda h, w, b: linear_cross_entropy(h, w, labels, vocab_size=V_REAL, chunk_size=chunk_size, bias=b,
                                                    token_stats=stats, **kw))
    ref = run(biased)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[3][V_REAL:], torch.zeros(V_PADDED - V_REAL))
    plain = linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL, **kw)
    assert (plain - ref[0]).abs().max() > 1e-2  # NOTE: the bias changes the loss
    torch.testing.assert_close(stats, logits_token_stats(hidden @ weight[:V_REAL].t() + bias[:V_REAL], labels),
                               atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match=r"bias must be \[48\]"):
        linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL, bias=bias[:V_REAL])


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("chunk_size, softcap, scale", [(None, None, None), (5, None, 0.5), (5, 3.0, None)])
def test_low_rank_is_cross_entropy_of_lora_logits(reduction, chunk_size, softcap, scale):
    """A LoRA adapter on the LM head (``low_rank=(z, B)``): loss and the grads of hidden, z and B those of autograd
    through ``hidden @ W.T + bias + z @ B.T`` then scaled / soft-capped (fp32, 1e-5), with z-loss and label
    smoothing; the frozen weight gets no gradient, B's padded rows none; the term matters here."""
    hidden, weight, labels = _inputs(torch.float32, seed=8)
    g = torch.Generator().manual_seed(9)
    z, b_lora, bias = torch.randn(N, 3, generator=g), torch.randn(V_PADDED, 3, generator=g), torch.randn(V_PADDED,
                                                                                                         generator=g)
    grad_out = None if reduction == "sum" else torch.rand(N, generator=torch.Generator().manual_seed(1))
    kw = dict(z_loss=1e-3, label_smoothing=0.2, reduction=reduction)

    def run(fn):
        h, zz, bb = (t.clone().requires_grad_() for t in (hidden, z, b_lora))
        loss = fn(h, zz, bb)
        loss.backward(grad_out)
        return loss.detach(), h.grad, zz.grad, bb.grad

    def adapted(h, zz, bb):
        logits = (h @ weight[:V_REAL].t() + bias[:V_REAL] + zz @ bb[:V_REAL].t()).float()
        logits = logits * scale if scale is not None else logits
        logits = softcap * torch.tanh(logits / softcap) if softcap is not None else logits
        loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none", label_smoothing=0.2)
        loss = loss + 1e-3 * torch.logsumexp(logits, dim=-1).square() * (labels != -100)
        return loss.sum() if reduction == "sum" else loss

    frozen = weight.clone()  # NOTE: requires_grad False: no [V, H] gradient is made
    ours = run(lambda h, zz, bb: linear_cross_entropy(h, frozen, labels, vocab_size=V_REAL, chunk_size=chunk_size,
                                                      bias=bias, softcap=softcap, logit_scale=scale,
                                                      low_rank=(zz, bb), **kw))
    ref = run(adapted)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[3][V_REAL:], torch.zeros(V_PADDED - V_REAL, 3))
    plain = linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL, bias=bias, softcap=softcap,
                                 logit_scale=scale, **kw)
    assert (plain - ref[0]).abs().max() > 1e-2  # NOTE: the adapter's term changes the loss
    with pytest.raises(ValueError, match=r"low_rank must be \(z \[37, r\], B \[48, r\]\)"):
        linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL, low_rank=(z, b_lora[:V_REAL]))


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_scale_is_cross_entropy_of_scaled_logits(reduction, dtype):
    """Cohere's ``logit_scale``: loss, token stats and the grads of hidden and weight those of autograd through
    ``(hidden @ weight.T) * scale`` (the product rounded to the input dtype, as transformers' multiply), with z-loss and
    label smoothing, chunked (fp32: 1e-5; bf16: the loss 1e-5, the grads within one bf16 rounding); the scale matters
    here."""
    hidden, weight, labels = _inputs(dtype, seed=7)
    scale = 0.3
    kw = dict(z_loss=1e-3, label_smoothing=0.2, reduction=reduction)

    def scaled(h, w, y, **unused):
        logits = ((h @ w[:V_REAL].t()) * scale).float()
        loss = F.cross_entropy(logits, y, ignore_index=-100, reduction="none", label_smoothing=0.2)
        loss = loss + 1e-3 * torch.logsumexp(logits, dim=-1).square() * (y != -100)
        return loss.sum() if reduction == "sum" else loss

    grad_out = None if reduction == "sum" else torch.rand(N, generator=torch.Generator().manual_seed(1))
    stats = torch.zeros(2)
    ours = _grads(linear_cross_entropy, hidden, weight, labels, grad_out, vocab_size=V_REAL, chunk_size=5,
                  logit_scale=scale, token_stats=stats, **kw)
    ref = _grads(scaled, hidden, weight, labels, grad_out)
    grad_tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(a.float(), b.float(), atol=grad_tol, rtol=grad_tol)
    plain = linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL, **kw)
    assert (plain - ref[0]).abs().max() > 1e-2  # NOTE: the scale changes the loss
    logits = (hidden @ weight[:V_REAL].t()) * scale
    torch.testing.assert_close(stats, logits_token_stats(logits, labels), atol=1e-4, rtol=1e-5)


def test_scaled_sum_backward_scales_the_precomputed_grads():
    hidden, weight, labels = _inputs(torch.float32, seed=3)
    f = lambda h, w, y, **kw: 0.25 * linear_cross_entropy(h, w, y, vocab_size=V_REAL, **kw)  # noqa: E731
    r = lambda h, w, y: 0.25 * reference(h, w, y)  # noqa: E731
    for ours, ref in zip(_grads(f, hidden, weight, labels, chunk_size=4), _grads(r, hidden, weight, labels)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 6])
def test_per_token_losses_and_grads_with_arbitrary_output_grads(chunk_size):
    hidden, weight, labels = _inputs(torch.float32, seed=1)
    grad_out = torch.randn(N, generator=torch.Generator().manual_seed(9))
    loss, gh, gw = _grads(linear_cross_entropy, hidden, weight, labels, grad_out, vocab_size=V_REAL,
                          reduction="none", chunk_size=chunk_size, z_loss=1e-3, label_smoothing=0.2)
    ref_loss, ref_gh, ref_gw = _grads(reference, hidden, weight, labels, grad_out, reduction="none", z_loss=1e-3,
                                      label_smoothing=0.2)
    assert loss.shape == (N,) and torch.equal(loss[labels == -100], torch.zeros(int((labels == -100).sum())))
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, ref_gw, atol=1e-5, rtol=1e-5)


def test_label_smoothing_is_transformers_label_smoother():
    """The smoothed sum over tokens divided by their count is transformers' LabelSmoother on the same logits (which
    normalises the smoothing term by the logits' vocabulary: the true one, without the padding rows)."""
    from transformers.trainer_pt_utils import LabelSmoother

    hidden, weight, labels = _inputs(torch.float32, seed=4)
    count = int((labels != -100).sum())
    for eps in (0.1, 0.5, 1.0):
        ours = linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL, chunk_size=6, label_smoothing=eps)
        logits = (hidden @ weight[:V_REAL].t())[None]
        theirs = LabelSmoother(epsilon=eps)({"logits": logits}, labels[None])
        torch.testing.assert_close(ours / count, theirs, atol=1e-6, rtol=1e-6)
    plain = linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL)
    assert abs(float(ours - plain)) > 1e-2 * float(plain)  # the smoothing changes the loss
    with pytest.raises(ValueError, match=r"label_smoothing must lie in \[0, 1\], got 1.5"):
        linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL, label_smoothing=1.5)


# bf16: logits are computed in bf16 on both sides and upcast; grads round to bf16 where autograd's do, but ours
# accumulate the weight grad over chunks in fp32. Bound: bf16's resolution.
def test_bf16_matches_reference():
    hidden, weight, labels = _inputs(torch.bfloat16, seed=2)
    loss, gh, gw = _grads(linear_cross_entropy, hidden, weight, labels, vocab_size=V_REAL, chunk_size=7)
    ref_loss, ref_gh, ref_gw = _grads(reference, hidden, weight, labels)
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(gh.float(), ref_gh.float(), atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(gw.float(), ref_gw.float(), atol=1e-2, rtol=1.6e-2)


# weight_grad_dtype=bf16 (MegatronEngine's optimizer_precision="model"): the weight grad accumulates over the chunks
# in bf16, one rounding per chunk (here 6 chunks) where the fp32 default rounds once; the loss and the hidden grad are
# the same computation. Bound: bf16's resolution times the number of chunks against the fp32-accumulated grads.
def test_bf16_weight_grad_accumulation():
    hidden, weight, labels = _inputs(torch.bfloat16, seed=2)
    chunks = -(-hidden.shape[0] // 7)
    assert chunks >= 4
    loss, gh, gw = _grads(linear_cross_entropy, hidden, weight, labels, vocab_size=V_REAL, chunk_size=7,
                          weight_grad_dtype=torch.bfloat16)
    ref_loss, ref_gh, ref_gw = _grads(linear_cross_entropy, hidden, weight, labels, vocab_size=V_REAL, chunk_size=7)
    assert gw.dtype == torch.bfloat16
    assert torch.equal(loss, ref_loss) and torch.equal(gh, ref_gh)
    torch.testing.assert_close(gw.float(), ref_gw.float(), atol=chunks * 2e-3, rtol=chunks * 2 ** -8)
    with pytest.raises(ValueError, match="weight_grad_dtype"):
        linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL, weight_grad_dtype=torch.float16)


def test_without_grad_needs_no_backward_state():
    hidden, weight, labels = _inputs(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL)
    torch.testing.assert_close(loss, reference(hidden, weight, labels), atol=1e-5, rtol=1e-5)


def test_bad_inputs_fail_with_names():
    hidden, weight, labels = _inputs(torch.float32)
    labels[3] = V_REAL  # a padded row: not a real token
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 41\)"):
        linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels.clamp(max=0), reduction="mean")
    with pytest.raises(ValueError, match="hidden must be"):
        linear_cross_entropy(hidden, weight[:, :-1], labels.clamp(max=0))
    with pytest.raises(ValueError, match="exceeds"):
        linear_cross_entropy(hidden, weight, labels.clamp(max=0), vocab_size=V_PADDED + 1)


def test_vocab_parallel_tp2_equals_tp1(distributed_op_results):
    # each rank asserted loss and grads at 1e-5 against TP=1 in its own process, and names the cases it checked
    for rank in distributed_op_results:
        assert rank["cross_entropy_tp2"] == ["padded_vocab_z_loss", "one_shard_all_padding", "per_token",
                                             "label_smoothing", "label_smoothing_per_token_one_shard_all_padding",
                                             "token_stats_ties_across_shards"]


def stats_reference(logits, labels, vocab_size=V_REAL):
    """[entropy sum, top-1 count] over non-ignored tokens, from the real vocabulary's logits (argmax: first max)."""
    logits = logits.float()[:, :vocab_size]
    valid = labels != -100
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    top1 = (logits.argmax(-1) == labels) & valid
    return torch.stack((entropy[valid].sum(), top1.sum().float()))


def tied_inputs(seed=1):
    """Rows 3 and 7 of the weight are equal and dominate the logits of the first tokens: their maximum is tied, so
    the label 7 is not argmax's pick there, the label 3 is."""
    hidden, weight, labels = _inputs(torch.float32, seed=seed)
    weight[7] = weight[3]
    hidden[:6] = weight[3] * 4 + 0.01 * hidden[:6]
    labels[:6] = torch.tensor([3, 7, 3, 7, -100, 3])
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [None, 1, 5])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_token_stats_match_log_softmax_and_argmax(chunk_size, reduction):
    hidden, weight, labels = tied_inputs()
    stats = torch.zeros(2)
    _grads(linear_cross_entropy, hidden, weight, labels, vocab_size=V_REAL, chunk_size=chunk_size,
           reduction=reduction, token_stats=stats, grad_out=None if reduction == "sum" else torch.ones(N))
    ref = stats_reference(hidden @ weight.t(), labels)
    torch.testing.assert_close(stats[0], ref[0], atol=1e-5, rtol=1e-5)
    assert stats[1] == ref[1] and 3 <= ref[1] < (labels != -100).sum()  # the tied rows count once, as argmax
    assert int(((hidden[:6] @ weight.t()).argmax(-1) == 3).sum()) == 6


def test_logits_token_stats_on_materialised_logits():
    hidden, weight, labels = tied_inputs()
    logits = (hidden @ weight.t())
    logits[:, V_REAL:] = 1e4  # padded vocabulary: never a prediction
    before = logits.clone()
    stats = logits_token_stats(logits.reshape(1, N, -1), labels.reshape(1, N), vocab_size=V_REAL)
    torch.testing.assert_close(stats, stats_reference(logits, labels), atol=1e-5, rtol=1e-5)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="token_stats must be"):
        linear_cross_entropy(hidden, weight, labels, vocab_size=V_REAL, token_stats=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="labels must lie"):
        logits_token_stats(logits, labels.clamp(min=V_REAL), vocab_size=V_REAL)
