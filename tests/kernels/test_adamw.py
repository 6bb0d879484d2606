"""LoongAdamW: on CPU exactly torch's AdamW (its fallback), the refused options, state dicts shared with torch's,
and the Triton step against torch's fused AdamW under ``TRITON_INTERPRET=1`` in a child process (see
test_triton_interpret.py for why a child)."""


import pytest
import torch

from loongforge_hf.kernels.adamw import LoongAdamW

from ._interpret import needs_triton, run_interpreted


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in ((7, 5), (4097,), (1,))]


def _groups(params):
    return [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0, "lr": 3e-3}]


def _run(opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    ps = [p for group in opt.param_groups for p in group["params"]]
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("fused", [None, False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_equals_torch_adamw(fused, dtype, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, fused=fused)
    ours = LoongAdamW(_groups([p.clone() for p in _params(dtype)]), **kw)
    ref = torch.optim.AdamW(_groups([p.clone() for p in _params(dtype)]), **kw)
    _run(ours, 3)
    _run(ref, 3)
    for ga, gb in zip(ours.param_groups, ref.param_groups):
        for a, b in zip(ga["params"], gb["params"]):
            assert torch.equal(a, b)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ours.state[a][key], ref.state[b][key]), key
                assert ours.state[a][key].device == ref.state[b][key].device


def test_state_dict_round_trip_with_torch_adamw():
    ours = LoongAdamW(_groups(_params()), lr=1e-2, fused=True)
    _run(ours, 2)
    ref = torch.optim.AdamW(_groups([p.detach().clone() for p in ours.param_groups[0]["params"]
                                     + ours.param_groups[1]["params"]]), lr=1e-2, fused=True)
    ref.load_state_dict(ours.state_dict())
    back = LoongAdamW(_groups([p.clone() for p in _params()]), lr=1e-2, fused=True)
    back.load_state_dict(ref.state_dict())
    for a, b in zip(ours.state.values(), back.state.values()):
        assert set(a) == set(b) == {"step", "exp_avg", "exp_avg_sq"}
        assert a["step"].dtype == b["step"].dtype and torch.equal(a["step"], b["step"])
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_refuses_amsgrad_and_maximize():
    with pytest.raises(ValueError, match="amsgrad"):
        LoongAdamW(_params(), amsgrad=True)
    with pytest.raises(ValueError, match="maximize"):
        LoongAdamW(_params(), maximize=True)
    opt = LoongAdamW(_params())
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()


def test_adopt_turns_a_torch_adamw_into_loong_adamw():
    ours = torch.optim.AdamW(_groups(_params()), lr=1e-2, weight_decay=0.1, fused=True)
    assert LoongAdamW.adopt(ours) is ours and isinstance(ours, LoongAdamW)
    ref = torch.optim.AdamW(_groups(_params()), lr=1e-2, weight_decay=0.1, fused=True)
    _run(ours, 2)
    _run(ref, 2)
    for a, b in zip(ours.param_groups[0]["params"], ref.param_groups[0]["params"]):
        assert torch.equal(a, b)
    with pytest.raises(TypeError):
        LoongAdamW.adopt(torch.optim.SGD(_params(), lr=0.1))


@needs_triton
def test_triton_step_matches_torch_fused_adamw_in_the_interpreter():
    checked = run_interpreted("from tests.kernels._adamw_checks import check_adamw, check_found_inf\n"
                              "check_adamw('cpu') + [check_found_inf('cpu')]")
    assert len(checked) == 2 * 2 * 3 * 4 * 3 + 1 and "found_inf" in checked
