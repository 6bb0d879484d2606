"""The flash path of attention with sinks (``kernels.sink_attention``) on a GPU, bf16: output and the q / k / v /
sink gradients against transformers' gpt-oss eager attention in fp32 on the same (bf16-rounded) inputs, largest
difference within 2e-2 of the largest value (bf16; the materialised path is held to the same bound beside it);
causal with grouped-query heads, a sliding window, queries the last tokens of longer keys, not causal, packed
documents (cu_seqlens) with a window; and ``sdpa`` under the sink rule takes the flash path on CUDA."""

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = 2e-2
SCALE = 64 ** -0.5


def _reference(q, k, v, sinks, allowed):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    return eager_attention_forward(module, q, k, v, mask, scaling=SCALE)[0].transpose(1, 2)


def _allowed(sq, skv, *, causal, window):
    rel = torch.arange(skv, device="cuda")[None, :] - torch.arange(skv - sq, skv, device="cuda")[:, None]
    allowed = torch.ones(sq, skv, dtype=torch.bool, device="cuda")
    if causal:
        allowed &= rel <= 0
    if window is not None:
        allowed &= rel >= -window[0]
    return allowed


def _leaves(*shapes, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).to("cuda", dtype).requires_grad_() for s in shapes]


def _check(run, ref_run, tensors, grad_shape):
    grad = torch.randn(*grad_shape, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    out = run(*tensors)
    out.backward(grad)
    got = [out.detach()] + [t.grad for t in tensors]
    ref_in = [t.detach().float().requires_grad_() for t in tensors]
    ref = ref_run(*ref_in)
    ref.backward(grad.float())
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, [ref.detach()] + [t.grad for t in ref_in]):
        rel = ((a.float() - b).abs().max() / b.abs().max()).item()
        assert rel < TOL, (name, rel)


CASES = {"causal": (256, 256, True, None), "window": (256, 256, True, (31, 0)), "queries_last": (64, 256, True, None),
         "not_causal": (128, 128, False, None)}


@pytest.mark.parametrize("sq,skv,causal,window", list(CASES.values()), ids=list(CASES))
def test_dense_flash_sinks_match_transformers(sq, skv, causal, window):
    from loongforge_hf.kernels import sink_attention

    q, k, v, sinks = _leaves((2, 8, sq, 64), (2, 2, skv, 64), (2, 2, skv, 64), (8,))
    allowed = _allowed(sq, skv, causal=causal, window=window)
    _check(lambda q, k, v, s: sink_attention.dense(q, k, v, sinks=s, causal=causal, scale=SCALE, window=window),
           lambda q, k, v, s: _reference(q, k, v, s, allowed), [q, k, v, sinks], (2, 8, sq, 64))


def test_packed_flash_sinks_match_transformers_per_document():
    from loongforge_hf.kernels import sink_attention

    lengths, window = [100, 156], (31, 0)
    q, k, v, sinks = _leaves((256, 8, 64), (256, 2, 64), (256, 2, 64), (8,))
    cu = torch.tensor([0, 100, 256], device="cuda", dtype=torch.int32)

    def reference(q, k, v, s):
        outs, start = [], 0
        for n in lengths:
            part = lambda x: x[start:start + n].transpose(0, 1)[None]  # noqa: E731
            outs.append(_reference(part(q), part(k), part(v), s, _allowed(n, n, causal=True, window=window))[0])
            start += n
        return torch.cat(outs, dim=1).transpose(0, 1)

    _check(lambda q, k, v, s: sink_attention.packed(q, k, v, cu, cu, 156, 156, sinks=s, causal=True, scale=SCALE,
                                                    window=window),
           reference, [q, k, v, sinks], (256, 8, 64))


def test_sdpa_takes_the_flash_path_under_sinks(monkeypatch):
    from loongforge_hf.kernels import attention, sink_attention

    q, k, v, sinks = _leaves((1, 8, 128, 64), (1, 2, 128, 64), (1, 2, 128, 64), (8,))
    calls = []
    real = sink_attention.dense
    monkeypatch.setattr(sink_attention, "dense", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with attention.attention_scores(sinks=sinks):
        out = attention.sdpa(q, k, v, causal=True, scale=SCALE)
    assert calls == [1]
    ref = _reference(q.float(), k.float(), v.float(), sinks.float(), _allowed(128, 128, causal=True, window=None))
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < TOL
