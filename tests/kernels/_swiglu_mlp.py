"""What the rank of test_swiglu_mlp.py runs (module-level so that the spawned process can import it)."""

import torch
import torch.nn.functional as F


def swiglu_mlp_matches_megatron_mlp() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    import loongforge_hf.kernels.specs as specs

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(1)
    torch.manual_seed(0)
    calls = []
    fused = specs.swiglu

    def counting(x):
        calls.append(tuple(x.shape))
        return fused(x)

    specs.swiglu = counting
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        config = TransformerConfig(num_layers=1, hidden_size=24, ffn_hidden_size=40, num_attention_heads=2,
                                   gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
                                   add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype,
                                   bf16=dtype == torch.bfloat16)
        sub = specs.get_layer_spec(qk_norm=False).submodules.mlp.submodules
        ours, theirs = specs.SwiGLUMLP(config, sub), MLP(config, sub)
        assert ours.fused_swiglu
        theirs.load_state_dict(ours.state_dict())
        x = torch.randn(5, 3, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
        grad = torch.randn(5, 3, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
        results = []
        for mlp in (ours, theirs):
            xi = x.clone().requires_grad_()
            calls.clear()
            y, bias = mlp(xi)
            assert bias is None
            y.backward(grad)
            results.append((y.detach(), xi.grad, [p.grad for p in mlp.parameters()], len(calls)))
        (y1, gx1, gp1, n1), (y2, gx2, gp2, n2) = results
        assert (n1, n2) == (1, 0), (n1, n2)        # ours went through swiglu, megatron's did not
        # NOTE: the forward is bit-identical (swiglu == silu(gate) * up op for op); the backward is ours in fp32.
        assert torch.equal(y1, y2), dtype
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(gx1, gx2, **tol)
        for a, b in zip(gp1, gp2):
            torch.testing.assert_close(a, b, **tol)
        out[str(dtype)] = float(y1.float().abs().sum())
    # another activation: megatron's own path
    config = TransformerConfig(num_layers=1, hidden_size=24, ffn_hidden_size=40, num_attention_heads=2,
                               gated_linear_unit=True, activation_func=F.gelu, bias_activation_fusion=False,
                               add_bias_linear=False, use_cpu_initialization=True)
    gelu = specs.SwiGLUMLP(config, specs.get_layer_spec(qk_norm=False).submodules.mlp.submodules)
    assert not gelu.fused_swiglu
    calls.clear()
    gelu(torch.randn(2, 1, 24))
    assert not calls
    specs.swiglu = fused
    return out
