"""LoongAdamW's Triton step on a GPU: against torch's fused AdamW (5 steps, fp32 and bf16, weight decay, grad_scale,
found_inf; tolerances in _adamw_checks.py), state dicts loaded into torch's fused AdamW continue identically, and
``MegatronEngine(fused_adam="triton")`` trains like ``fused_adam=True`` (torch's fused AdamW)."""

import copy

import pytest
import torch

from loongforge_hf.kernels.adamw import LoongAdamW
from loongforge_hf.parallel.spawn import run_distributed
from ._adamw_checks import check_adamw, check_found_inf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_triton_step_matches_torch_fused_adamw():
    checked = check_adamw("cuda", steps=5)
    assert len(checked) == 2 * 2 * 3 * 4 * 5
    assert check_found_inf("cuda") == "found_inf"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_into_torch_fused_adamw(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=g).to(dtype) for s in ((300, 700), (4097,), (64,))]
    ours = LoongAdamW([p.clone() for p in params], lr=1e-3, weight_decay=0.1)
    assert all(group["fused"] for group in ours.param_groups)  # the default for CUDA parameters
    for _ in range(3):
        for p in ours.param_groups[0]["params"]:
            p.grad = torch.randn(p.shape, device="cuda", generator=g).to(dtype)
        ours.grad_scale = torch.tensor(2.0, device="cuda")
        ours.step()
    del ours.grad_scale
    ref = torch.optim.AdamW([p.detach().clone() for p in ours.param_groups[0]["params"]], lr=1e-3,
                            weight_decay=0.1, fused=True)
    # NOTE: a deep copy: load_state_dict keeps tensors that already have the right dtype and device, so both
    # optimizers would otherwise share (and both advance) the same step counts and moments.
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    for a, b in zip(ours.param_groups[0]["params"], ref.param_groups[0]["params"]):
        sa, sb = ours.state[a], ref.state[b]
        assert sb["step"].is_cuda and sb["step"].dtype == torch.float32 and float(sb["step"]) == 3.0
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        grad = torch.randn(a.shape, device="cuda", generator=g).to(dtype)
        a.grad, b.grad = grad.clone(), grad.clone()
    ours.step()
    ref.step()
    for a, b in zip(ours.param_groups[0]["params"], ref.param_groups[0]["params"]):
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=2.0 ** -7, atol=1e-7)
        torch.testing.assert_close(a.float(), b.float(), **tol)


def _train(folder: str, out_dir: str, fused_adam, optimizer_precision: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    model = lf.AutoModelForCausalLM.from_pretrained(folder, tensor_parallel_size=1, dtype=torch.bfloat16)
    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=1e-3, weight_decay=0.01,
                                          max_grad_norm=1.0, report_to=[])
    engine = MegatronEngine(model, args=args, fused_adam=fused_adam, optimizer_precision=optimizer_precision)
    kinds = sorted({type(o).__name__ for o in engine.inner_optimizers()})
    for o in engine.inner_optimizers():
        if isinstance(o, LoongAdamW):
            o.triton_min_numel = 1024  # the tiny model's matrices go through the kernel
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(4, model.config.vocab_size, (2, 64), generator=g).cuda() for _ in range(5)]
    losses = [engine.train_step([{"input_ids": ids, "labels": ids}]).loss for ids in batches]
    weights = {k: v.float().cpu() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    return {"losses": losses, "weights": weights, "kinds": kinds}


@pytest.mark.parametrize("optimizer_precision", ["fp32", "model"])
def test_engine_triton_adamw_trains_like_torch_fused(tmp_path, optimizer_precision):
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=False, hidden_size=128,
                                  intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    env = {"LOONGFORGE_DEVICE": "cuda"}
    runs = {kind: run_distributed(_train, 1, str(folder), str(tmp_path / str(kind)), kind, optimizer_precision,
                                  timeout=600, env=env)[0] for kind in (True, False, "triton")}
    torch_fused, torch_foreach, triton = runs[True], runs[False], runs["triton"]
    assert torch_fused["kinds"] == ["AdamW"] and triton["kinds"] == ["LoongAdamW"], (torch_fused, triton["kinds"])
    tol = dict(rtol=1e-4, atol=1e-5) if optimizer_precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(torch.tensor(triton["losses"]), torch.tensor(torch_fused["losses"]), **tol)
    # Adam's update m / (sqrt(v) + eps) is ill-conditioned where gradients are tiny (embedding rows of rare tokens):
    # there torch's own fused and foreach implementations already differ by more than rounding. The Triton step must
    # be as close to torch's fused one as torch's foreach one is, per tensor (largest difference), plus rounding.
    slack = 1e-6 if optimizer_precision == "fp32" else 2.0 ** -7
    for name, w in torch_fused["weights"].items():
        torch_gap = (torch_foreach["weights"][name] - w).abs().max().item()
        ours_gap = (triton["weights"][name] - w).abs().max().item()
        assert ours_gap <= 2 * torch_gap + slack * w.abs().max().item(), (name, ours_gap, torch_gap)
