"""The CUDA-only paths (flash varlen for packed documents, SDPA's fused kernels, the Triton split-key kernels of a
CP-sharded KV cache's partial attention, the soft-capped attention kernels) against the torch paths on CPU."""

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

import loongforge_hf.kernels.attention as attention_module
from loongforge_hf.kernels._triton import triton_paths
from loongforge_hf.kernels.attention import dot_product_attention, packed_attention, partial_attention
from loongforge_hf.kernels.cross_entropy import linear_cross_entropy
from loongforge_hf.kernels.rmsnorm import FUSED_RMS_NORM, rms_norm
from loongforge_hf.kernels.swiglu import swiglu

from .test_rmsnorm import reference as hf_rms_norm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D = 64
SCALE = 1 / math.sqrt(D)
# bf16 on the GPU against fp32 on the CPU from the same bf16 values: bf16's resolution, a little slack for sums.
ATOL, RTOL = 2e-2, 2e-2


def _grads(fn, tensors, proj):
    tensors = [t.clone().requires_grad_() for t in tensors]
    out = fn(*tensors)
    (out.float().reshape(proj.shape) * proj.to(out.device)).sum().backward()
    return [out.detach().float().reshape(proj.shape).cpu()] + [t.grad.float().cpu() for t in tensors]


def _close_all(gpu, cpu):
    for name, a, b in zip(("out", "dq", "dk", "dv"), gpu, cpu):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kv_heads", [6, 2])
@pytest.mark.parametrize("window,padded", [(None, False), ((4, 0), False), (None, True)])
def test_varlen_packed_matches_per_document_torch_path(monkeypatch, window, padded, kv_heads):
    if attention_module._varlen_attn is None:
        pytest.skip("torch.nn.attention.varlen is not in this torch")
    calls = []
    real = attention_module._varlen_attn
    monkeypatch.setattr(attention_module, "_varlen_attn", lambda *a, **k: calls.append(1) or real(*a, **k))
    cu, cu_padded = [0, 5, 12, 12, 20, 33], [0, 8, 16, 16, 24, 40]
    t = (cu_padded if padded else cu)[-1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, D, generator=g).to(torch.bfloat16) for h in (6, kv_heads, kv_heads))
    proj = torch.randn(t, 6 * D, generator=g)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor(cu, dtype=torch.int32), max_seqlen_q=13, max_seqlen_kv=13)
    if padded:
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = torch.tensor(cu_padded, dtype=torch.int32)

    def run(device, dtype):
        p = PackedSeqParams(**{f: (x.to(device) if torch.is_tensor(x) else x) for f, x in vars(params).items()})
        return _grads(lambda q, k, v: packed_attention(q, k, v, p, causal=True, scale=SCALE, window=window),
                      [x.to(device, dtype) for x in (q, k, v)], proj)

    _close_all(run("cuda", torch.bfloat16), run("cpu", torch.float32))
    # grouped-query attention goes to the varlen kernel only where it takes enable_gqa (torch >= 2.13)
    assert bool(calls) == (kv_heads == 6 or "enable_gqa" in attention_module._VARLEN_KWARGS)


@pytest.mark.parametrize("sq,skv", [(37, 37), (9, 37), (40, 40), (33, 33), (16, 48)])
def test_fused_sdpa_causal_gqa_matches_cpu(sq, skv):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sq, 3, 8, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(skv, 3, 2, D, generator=g).to(torch.bfloat16) for _ in range(2))
    proj = torch.randn(sq, 3, 8, D, generator=g)

    def run(device, dtype):
        return _grads(lambda q, k, v: dot_product_attention(q, k, v, causal=True, scale=SCALE),
                      [x.to(device, dtype) for x in (q, k, v)], proj)

    _close_all(run("cuda", torch.bfloat16), run("cpu", torch.float32))


def test_elementwise_ops_and_cross_entropy_on_cuda_match_cpu():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 9, 130, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(130, generator=g)).to(torch.bfloat16)
    torch.testing.assert_close(rms_norm(x.cuda(), w.cuda()).cpu(), rms_norm(x, w), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(swiglu(x.cuda()).cpu(), swiglu(x), atol=ATOL, rtol=RTOL)
    hidden = torch.randn(77, 64, generator=g).to(torch.bfloat16)
    weight = (0.3 * torch.randn(100, 64, generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, 97, (77,), generator=g)
    labels[::7] = -100

    def run(device):
        h, wt = hidden.to(device).requires_grad_(), weight.to(device).requires_grad_()
        loss = linear_cross_entropy(h, wt, labels.to(device), vocab_size=97, chunk_size=16)
        loss.backward()
        return [loss.detach().cpu(), h.grad.float().cpu(), wt.grad.float().cpu()]

    for a, b in zip(run("cuda"), run("cpu")):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("path", ["triton", "blocks"])
@pytest.mark.parametrize("batch, sq, keys", [(2, 2, 37), (1, 1, 4097), (3, 1, 300)])
def test_partial_attention_cuda_matches_blocked_fp32(batch, sq, keys, path):
    """``partial_attention`` in bf16 on CUDA (the Triton split-key kernels, or the blocked torch path) against the
    blocked path in fp32 on the CPU from the same values: outputs within bf16's resolution, log-sum-exps within 1e-3
    (Triton: fp32 scores) or bf16's resolution (blocks: scores computed in bf16, as transformers' eager attention
    does), a row with no allowed key zeros and -inf alike."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch, 16, sq, 128, generator=g).bfloat16()
    k, v = (torch.randn(batch, 8, keys, 128, generator=g).bfloat16() for _ in range(2))
    allowed = torch.rand(batch, 1, sq, keys, generator=g) > 0.2
    allowed[0, 0, -1] = False  # NOTE: the last query row of the first sample sees no key
    if path == "triton":
        pytest.importorskip("triton")
    with triton_paths(path == "triton"):
        out, lse = partial_attention(q.cuda(), k.cuda(), v.cuda(), allowed=allowed.cuda(), scale=0.1)
    ref_out, ref_lse = partial_attention(q.float(), k.float(), v.float(), allowed=allowed, scale=0.1)
    torch.testing.assert_close(out.cpu(), ref_out, atol=ATOL, rtol=RTOL)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    atol, rtol = (1e-3, 0.0) if path == "triton" else (ATOL, RTOL)
    torch.testing.assert_close(lse.cpu()[finite], ref_lse[finite], atol=atol, rtol=rtol)
    assert torch.equal(out[0, :, -1].cpu(), torch.zeros_like(out[0, :, -1].cpu()))


def test_decode_attention_kernels_cases_on_cuda():
    """The interpreter's cases of the split-key kernels (strided key buffers, MLA's wider keys, an empty share) in
    bf16 and fp16 on the GPU against the fp32 blocked path."""
    pytest.importorskip("triton")
    from tests.kernels._decode_attention_checks import check_decode_attention

    assert len(check_decode_attention("cuda", dtypes=(torch.bfloat16, torch.float16))) == 10


def test_softcap_attention_kernels_cases_on_cuda():
    """The interpreter's cases of the soft-capped flash-style kernels (GQA, queries at an offset, a sliding window, a
    padding mask with an empty row, packed documents) in bf16 and fp16 on the GPU against the fp32 eager math."""
    pytest.importorskip("triton")
    from tests.kernels._softcap_attention_checks import check_softcap_attention

    assert len(check_softcap_attention("cuda", dtypes=(torch.bfloat16, torch.float16))) == 14


def _gemma2_bf16(folder: str) -> dict:
    """Gemma 2 in bf16 on the GPU, a right-padded batch: our loss and embedding gradient (the soft-cap kernels
    counted) against transformers' eager attention in bf16. NOTE: not left-padded: transformers' loss then counts
    the last pad position's prediction of the first token, from a query that sees no key (uniform over the masked
    keys there, zeros here)."""
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.kernels import softcap_attention

    calls = []
    kernel = softcap_attention.softcap_attention
    softcap_attention.softcap_attention = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    ids = torch.randint(5, 200, (2, 96), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, -17:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    result = {}
    for name in ("ours", "theirs"):
        if name == "ours":
            model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                                      attn_implementation="eager").cuda()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grad = next(p.grad for n, p in model.named_parameters() if "embed" in n and p.grad is not None)
        result[name] = (out.loss.item(), grad.float().cpu()[:200])
        del model
    result["calls"] = len(calls)
    return result


def test_gemma2_bf16_training_step_takes_the_softcap_kernels(tmp_path):
    """Gemma 2's soft-capped attention (alternating sliding-window layers) in bf16 through the Triton kernels on
    every layer: loss within 2e-2 of transformers' eager bf16, embedding gradient within bf16's resolution (5e-2 of
    its largest)."""
    from loongforge_hf.parallel.spawn import run_distributed
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "gemma2", "gemma2", tokenizer=False, sliding_window=24)
    [r] = run_distributed(_gemma2_bf16, 1, str(folder), timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["calls"] > 0, r["calls"]
    assert abs(r["ours"][0] - r["theirs"][0]) < 2e-2, (r["ours"][0], r["theirs"][0])
    ours, theirs = r["ours"][1], r["theirs"][1]
    assert (ours - theirs).abs().max() <= 5e-2 * theirs.abs().max(), (ours - theirs).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_inference_inputs_take_the_aten_paths(monkeypatch, dtype):
    """A decode step's small inputs without grad (``_triton.launch_bound``) run RMSNorm as torch's ``F.rms_norm`` and
    the weight multiply, and SwiGLU as ``silu(gate) * up``, not the Triton kernels: HF's expressions (RMSNorm within
    one rounding of the normalised value: fp32 reductions may differ in their last bit; SwiGLU exactly). Inside a
    CUDA-graph capture and for large inputs the Triton kernels still run."""
    from loongforge_hf.kernels import _rmsnorm_triton, _swiglu_triton

    launched = []
    for module in (_rmsnorm_triton, _swiglu_triton):
        real = module.forward
        monkeypatch.setattr(module, "forward", lambda *a, _real=real, _m=module.__name__: launched.append(_m)
                            or _real(*a))
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(8, 1, 3 * 128, generator=g).to(dtype).cuda()
    k = qkv[..., 128:256]  # NOTE: a strided view, as megatron's k is for the k norm
    weight = (1 + 0.1 * torch.randn(128, generator=g)).to(dtype).cuda()
    h = torch.randn(8, 1, 2 * 96, generator=g).to(dtype).cuda()
    with torch.no_grad():
        got_norm, got_act = rms_norm(k, weight, 1e-6), swiglu(h)
    # NOTE: a torch without the fused RMSNorm kernel keeps the Triton one (rmsnorm.FUSED_RMS_NORM)
    assert launched == ([] if FUSED_RMS_NORM else ["loongforge_hf.kernels._rmsnorm_triton"])
    launched.clear()
    want = hf_rms_norm(k, weight, 1e-6)
    step = 2 * torch.finfo(dtype).eps * want.abs().clamp_min(1)  # NOTE: one rounding of the normalised value, x w
    assert bool(((got_norm - want).abs() <= step).all()), (got_norm - want).abs().max()
    gate, up = h.chunk(2, -1)
    assert torch.equal(got_act, torch.nn.functional.silu(gate) * up)

    big = torch.randn(4096, 128, generator=g).to(dtype).cuda()
    with torch.no_grad():
        rms_norm(big, weight, 1e-6)
    assert launched == ["loongforge_hf.kernels._rmsnorm_triton"]
    launched.clear()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        rms_norm(k, weight, 1e-6), swiglu(h)  # NOTE: a warm-up outside the capture (the norm's Triton kernel was
        # compiled by the large call above, with the same constants)
        launched.clear()
        with torch.cuda.graph(graph, stream=stream):
            out = rms_norm(k, weight, 1e-6)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    assert launched == ["loongforge_hf.kernels._rmsnorm_triton"]
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)


def test_moe_kernels_without_grad_on_cuda(monkeypatch):
    """The MoE kernels' inference paths (no autograd Function) on CUDA, Triton kernels included: equal to the
    training path's outputs (tests/kernels/test_inference_paths.py)."""
    from .test_inference_paths import check_moe_kernels_without_grad

    check_moe_kernels_without_grad(monkeypatch, "cuda")
