"""FP8 on the GPU: Triton quantisation against the torch reference, scaled GEMMs against the dequantised product,
fp8_linear outputs and gradients against bf16 (relative Frobenius error < 6%), a 200-step training run whose final
loss is within 1% of bf16, and adaptive mode's per-shape decisions written to its JSON cache."""

import json

import pytest
import torch

from loongforge_hf.kernels import fp8
from loongforge_hf.parallel.spawn import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU with FP8 tensor cores")]

# NOTE: e4m3 rounds each operand by up to 2**-4 relative (about 3.6% RMS for Gaussian data); a GEMM's relative
# Frobenius error against bf16 stays near that, so 6% leaves room without hiding a wrong scale (which gives >50%).
REL_TOL = 0.06
RECIPES = list(fp8.RECIPES)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _skip_unsupported(recipe):
    if fp8.is_blockwise(recipe) and not fp8.blockwise_supported(torch.cuda.current_device(), recipe):
        pytest.skip(f"block-wise scaled_mm is not available with torch {torch.__version__} on "
                    f"{torch.cuda.get_device_name()} (row-wise is used there)")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="block-wise FP8 GEMMs are cuBLAS's on SM90+")
def test_block_wise_probe_passes_for_each_recipe_on_sm90():
    """The probe that picks the default recipe (and admits an explicit block-wise one) on Hopper with this torch."""
    assert fp8.blockwise_supported(torch.cuda.current_device(), "blockwise")
    assert fp8.blockwise_supported(torch.cuda.current_device(), "blockwise_wgrad2d")


@pytest.mark.parametrize("shape", [(4096, 1024), (37, 300), (1, 128)])
def test_triton_quantisation_matches_torch(shape):
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 2, shape[1], device="cuda")
    x[0, : min(128, shape[1])] = 0
    for view, pad in ((x, 1), (x.t(), 128)):  # the transposed view is what the weight-gradient GEMM quantises
        got, ref = fp8.quantize_tiles(view, pad_to=pad), fp8.quantize_tiles(view.cpu(), pad_to=pad)
        torch.testing.assert_close(got.scale.cpu(), ref.scale, rtol=0, atol=0)
        torch.testing.assert_close(got.data.cpu().float(), ref.data.float(), rtol=0, atol=0)
        assert got.scale.stride(0) == 1  # K-tile-major, as scaled_mm reads 1x128 scales
        got, ref = fp8.quantize_rows(view, pad_to=16), fp8.quantize_rows(view.cpu(), pad_to=16)
        torch.testing.assert_close(got.scale.cpu(), ref.scale, rtol=0, atol=0)
        torch.testing.assert_close(got.data.cpu().float(), ref.data.float(), rtol=0, atol=0)
    got, ref = fp8.quantize_blocks(x), fp8.quantize_blocks(x.cpu())
    torch.testing.assert_close(got.scale.cpu(), ref.scale, rtol=0, atol=0)
    torch.testing.assert_close(got.data.cpu().float(), ref.data.float(), rtol=0, atol=0)
    for kind in ("tiles", "blocks"):  # both operands of an activation (the Triton kernels against the torch path)
        for got, ref in zip(fp8.quantize_operands(x, kind), fp8.quantize_operands(x.cpu(), kind)):
            assert got.kind == ref.kind and got.data.shape == ref.data.shape
            torch.testing.assert_close(got.scale.cpu(), ref.scale, rtol=0, atol=0)
            torch.testing.assert_close(got.data.cpu().float(), ref.data.float(), rtol=0, atol=0)
    x[-1, -1] = float("nan")
    with pytest.raises(fp8.Fp8Error, match="inf or NaN"):
        fp8.quantize_tiles(x)


@pytest.mark.parametrize("shape", [(4096, 1024), (384, 640), (128, 128)])
def test_dual_blocks_match_torch(shape):
    """The forward's quantisation of a weight into 128x128 blocks of w and of w.T (the second read through the
    transposed view) equals the torch reference and its transpose bit for bit."""
    w = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 2, shape[1], device="cuda")
    w[:128, :128] = 0
    wq, wtq = fp8.quantize_blocks_dual(w)
    ref = fp8.quantize_blocks(w.cpu())
    for q, (data, scale) in ((wq, (ref.data, ref.scale)), (wtq, (ref.data.t(), ref.scale.t()))):
        assert q.kind == "blocks" and q.data.is_contiguous() and q.data.shape == data.shape
        torch.testing.assert_close(q.scale.cpu(), scale, rtol=0, atol=0)
        torch.testing.assert_close(q.data.cpu().float(), data.float(), rtol=0, atol=0)


@pytest.mark.parametrize("pair", fp8.PAIRS)
def test_scaled_gemm_matches_dequantised_product(pair):
    _skip_unsupported("rowwise" if pair[0] == "rows" else "blockwise")
    x = torch.randn(1000 if pair[0] != "blocks" else 1024, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 2048, device="cuda", dtype=torch.bfloat16)
    a, b = fp8.quantize(x, pair[0]), fp8.quantize(w, pair[1])
    got = fp8.scaled_matmul(a, b, out_dtype=torch.float32)
    assert _rel(got, fp8.dequantize(a) @ fp8.dequantize(b).t()) < 5e-3


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [4096, 1000])
def test_fp8_linear_output_and_grads_against_bf16(recipe, tokens):
    _skip_unsupported(recipe)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, 1024, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(3072, 1024, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    proj = torch.randn(tokens, 3072, device="cuda", generator=g).to(torch.bfloat16)
    y = fp8.fp8_linear(x, w, recipe=recipe)
    y.backward(proj)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = x2 @ w2.t()
    y2.backward(proj)
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    errors = {"out": _rel(y, y2), "dgrad": _rel(x.grad, x2.grad), "wgrad": _rel(w.grad, w2.grad)}
    assert all(e < REL_TOL for e in errors.values()), errors


@pytest.mark.parametrize("recipe", RECIPES)
def test_any_token_count_runs(recipe):
    """0, 1, 17, 1000 tokens (an expert's share is anything): the padded FP8 GEMMs run and match bf16 (the MoE bench
    once failed here with CUBLAS_STATUS_NOT_SUPPORTED)."""
    _skip_unsupported(recipe)
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(1024, 512, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    for tokens in (0, 1, 17, 1000):
        x = torch.randn(tokens, 512, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        proj = torch.randn(tokens, 1024, device="cuda", generator=g).to(torch.bfloat16)
        w.grad = None
        y = fp8.fp8_linear(x, w, recipe=recipe)
        y.backward(proj)
        assert y.shape == (tokens, 1024) and x.grad.shape == x.shape
        if tokens == 0:
            assert torch.equal(w.grad, torch.zeros_like(w))
            continue
        xf, wf, pf = x.detach().float(), w.detach().float(), proj.float()
        errors = {"out": _rel(y, xf @ wf.t()), "dgrad": _rel(x.grad, pf @ wf), "wgrad": _rel(w.grad, pf.t() @ xf)}
        assert all(e < REL_TOL for e in errors.values()), (tokens, errors)


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_experts_with_uneven_and_empty_experts(recipe):
    """The FP8 expert loop of the grouped MoE module (8 experts, some without tokens, counts not multiples of 16)
    against the bf16 grouped GEMM."""
    _skip_unsupported(recipe)
    from types import SimpleNamespace

    from loongforge_hf.kernels.fp8_linear import Fp8GroupedExperts
    from loongforge_hf.kernels.grouped_mlp import grouped_gated_mlp

    g = torch.Generator(device="cuda").manual_seed(2)
    counts = [0, 1, 17, 300, 0, 5, 129, 60]
    x = torch.randn(sum(counts), 512, device="cuda", generator=g).to(torch.bfloat16)
    probs = torch.rand(sum(counts), device="cuda", generator=g)
    fc1 = torch.nn.Parameter((torch.randn(8, 768, 512, device="cuda", generator=g) * 0.05).to(torch.bfloat16))
    fc2 = torch.nn.Parameter((torch.randn(8, 512, 384, device="cuda", generator=g) * 0.05).to(torch.bfloat16))
    module = SimpleNamespace(config=SimpleNamespace(moe_apply_probs_on_input=False),
                             linear_fc1=SimpleNamespace(weight=fc1), linear_fc2=SimpleNamespace(weight=fc2))
    experts = Fp8GroupedExperts(module, name="experts", settings=fp8_settings(recipe))
    xa = x.clone().requires_grad_()
    out, _ = experts(xa, torch.tensor(counts, device="cuda"), probs)
    proj = torch.randn(*x.shape, device="cuda", generator=g).to(torch.bfloat16)
    out.backward(proj)
    got = fc1.grad.clone(), fc2.grad.clone(), xa.grad
    fc1.grad = fc2.grad = None
    xr = x.float().requires_grad_()
    w1, w2 = fc1.detach().float().requires_grad_(), fc2.detach().float().requires_grad_()
    ref = grouped_gated_mlp(xr, w1, w2, counts, probs, use_grouped_mm=False)
    ref.backward(proj.float())
    # NOTE: two FP8 GEMMs in a row: about sqrt(2) times one GEMM's error (see the CPU test).
    tol = 0.09
    assert _rel(out, ref) < tol and _rel(got[2], xr.grad) < tol, (_rel(out, ref), _rel(got[2], xr.grad))
    for g_fp8, g_ref in ((got[0], w1.grad), (got[1], w2.grad)):
        for e, c in enumerate(counts):
            if c == 0:
                assert torch.equal(g_fp8[e], torch.zeros_like(g_fp8[e]))
        used = [e for e, c in enumerate(counts) if c]
        assert _rel(g_fp8[used], g_ref[used]) < tol


def fp8_settings(recipe):
    from loongforge_hf.kernels.fp8_linear import Fp8Settings

    return Fp8Settings(mode="on", recipe=recipe)


def _llama(folder):
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(folder, "llama", tokenizer=False, dtype=torch.bfloat16, vocab_size=2048,
                                hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=4, head_dim=64, max_position_embeddings=512)


def _train(folder: str, out_dir: str, fp8_mode, steps: int, recipe=None) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, fp8=fp8_mode, fp8_recipe=recipe)
    report = getattr(model.megatron, "fp8", None)
    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=1e-3, weight_decay=0.0,
                                          max_grad_norm=1.0, warmup_steps=10, bf16=True, report_to=[])
    engine = MegatronEngine(model, args=args)
    losses = [engine.train_step(_batches(step, model.device)).loss for step in range(steps)]
    result = {"losses": losses, "swapped": len(report.swapped) if report else 0}
    if report is not None and report.autotuner is not None:
        result["table"] = report.autotuner.table()
        result["decisions"] = {name: {str(k): list(v) for k, v in m._forward_impl.decisions.items()}
                               for name, m in _swapped_modules(model)}
    return result


def _batches(step: int, device) -> list[dict]:
    """4 micro-batches of 8 x 256 fresh tokens: each token follows from the previous one by a fixed rule half of the
    time and is random otherwise, so the loss falls to a floor (about 4.5) that memorising cannot lower."""
    g = torch.Generator().manual_seed(step)
    seq = [torch.randint(4, 2048, (32, 1), generator=g)]
    for _ in range(255):
        rule = (seq[-1] * 37 + 11) % 2044 + 4
        noise = torch.randint(4, 2048, (32, 1), generator=g)
        seq.append(torch.where(torch.rand(32, 1, generator=g) < 0.5, rule, noise))
    data = torch.cat(seq, dim=1).to(device)
    return [{"input_ids": b, "labels": b} for b in data.split(8)]


def _swapped_modules(model):
    from loongforge_hf.kernels.fp8_linear import Fp8ForwardImpl, eligible_linears

    return [(n, m) for n, m in eligible_linears(model.chunks)
            if isinstance(vars(m).get("_forward_impl"), Fp8ForwardImpl)]


def test_fp8_training_final_loss_within_one_percent_of_bf16(tmp_path):
    folder = str(_llama(tmp_path / "llama"))
    env = {"LOONGFORGE_DEVICE": "cuda"}
    [bf16] = run_distributed(_train, 1, folder, str(tmp_path / "o1"), None, 200, timeout=600, env=env)
    final_bf16 = sum(bf16["losses"][-10:]) / 10
    assert bf16["losses"][-1] < 0.75 * bf16["losses"][0], bf16["losses"][::20]  # it learned the rule
    for recipe in (None, "blockwise_wgrad2d"):  # the default (blockwise where the GPU runs it) and the opt-in one
        [on] = run_distributed(_train, 1, folder, str(tmp_path / f"o_{recipe}"), "on", 200, recipe, timeout=600,
                               env=env)
        assert on["swapped"] == 16  # 4 layers x (qkv, proj, fc1, fc2)
        final_fp8 = sum(on["losses"][-10:]) / 10
        print(recipe, final_fp8, final_bf16)
        assert abs(final_fp8 - final_bf16) / final_bf16 < 0.01, (recipe, final_fp8, final_bf16, on["losses"][::20])


def test_adaptive_decides_per_shape_and_writes_its_cache(tmp_path):
    folder = str(_llama(tmp_path / "llama"))
    cache = tmp_path / "fp8_autotune.json"
    env = {"LOONGFORGE_DEVICE": "cuda", "LOONGFORGE_HF_FP8_CACHE": str(cache)}
    [first] = run_distributed(_train, 1, folder, str(tmp_path / "o1"), "adaptive", 2, timeout=600, env=env)
    entries = json.loads(cache.read_text())["entries"]
    gpu = torch.cuda.get_device_name()
    # 4 distinct layer shapes (qkv 1024x512, proj 512x512, fc1 3072x512, fc2 512x1536) x 3 GEMMs, 2048 tokens a step
    shapes = {(e["gemm"], e["m"], e["n"], e["k"]) for e in entries.values() if e["gpu"] == gpu}
    assert len(shapes) == 12, sorted(shapes)
    assert ("fwd", 2048, 3072, 512) in shapes and ("wgrad", 3072, 512, 2048) in shapes
    assert all(set(e) == {"gpu", "recipe", "gemm", "m", "n", "k", "bf16_ms", "fp8_ms"} for e in entries.values())
    assert len(first["decisions"]) == 16 and "choice" in first["table"]
    print(first["table"])
    mtime = cache.stat().st_mtime_ns
    [second] = run_distributed(_train, 1, folder, str(tmp_path / "o2"), "adaptive", 2, timeout=600, env=env)
    assert cache.stat().st_mtime_ns == mtime  # every shape came from the cache: nothing timed, nothing written
    assert second["decisions"] == first["decisions"]
