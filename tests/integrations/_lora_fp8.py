"""Rank functions for test_lora_fp8.py: LoRA and DoRA adapters on FP8-swapped megatron linears (CPU emulation)."""

from __future__ import annotations

import torch

LORA_KW = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def disable_checks(folder: str) -> dict:
    """Logits of the FP8 model without adapters, and of the same model with LoRA / DoRA adapters (random B), outside
    and inside ``disable_adapter()`` and after ``merge_and_unload`` (differences as floats)."""
    import peft

    import loongforge_hf as lf
    from loongforge_hf.kernels.fp8_linear import swap_linears
    from loongforge_hf.lora import get_peft_model

    ids = torch.randint(4, 203, (2, 16), generator=torch.Generator().manual_seed(1))

    def load():
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return model, len(swap_linears(model.chunks, mode="on", recipe="blockwise").swapped)

    base, swapped = load()
    with torch.no_grad():
        expected = base(input_ids=ids).logits
    out = {"swapped": swapped}
    for name, extra in (("lora", {}), ("dora", {"use_dora": True})):
        model, _ = load()
        model = get_peft_model(model, peft.LoraConfig(**LORA_KW, **extra))
        with torch.no_grad():
            adapted = model(input_ids=ids).logits
            with model.disable_adapter():
                disabled = model(input_ids=ids).logits
        out[name] = {"adapter_effect": float((adapted - expected).abs().max()),
                     "disabled_diff": float((disabled - expected).abs().max())}
    return out


def dora_layer_check() -> dict:
    """One FP8-swapped ColumnParallelLinear (with bias) carrying DoRA adapters on two of its three fused targets: its
    output is the FP8 base output (the same layer inside ``lora_disabled``) plus DoRA's term on it, and the adapters'
    gradients are that formula's (fp32, 1e-5)."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loongforge_hf.kernels.fp8_linear import swap_linears
    from loongforge_hf.lora.layers import FusedLayout, LoraAdapter, attach_adapters
    from loongforge_hf.parallel import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig())
    hidden, rows, r, scaling = 128, 128, 4, 0.5
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, perform_initialization=False)
    g = torch.Generator().manual_seed(3)
    holder = torch.nn.Module()
    holder.linear_fc1 = ColumnParallelLinear(hidden, 3 * rows, config=config, init_method=None, bias=True,
                                             gather_output=False, skip_bias_add=False)
    module = holder.linear_fc1
    with torch.no_grad():
        module.weight.copy_(torch.randn(3 * rows, hidden, generator=g) / hidden ** 0.5)
        module.bias.copy_(torch.randn(3 * rows, generator=g))
    module.weight.requires_grad_(False)
    module.bias.requires_grad_(False)
    swapped = swap_linears([holder], mode="on", recipe="blockwise").swapped
    layout = FusedLayout(groups=1, slots=(("gate", rows), ("mid", rows), ("up", rows)))
    adapters = {}
    for name in ("gate", "up"):
        adapters[name] = LoraAdapter(torch.randn(r, hidden, generator=g), torch.randn(rows, r, generator=g) / 4,
                                     scaling=scaling, dropout=0.0, split="B")
        adapters[name].add_magnitude(torch.rand(rows, generator=g) + 10, split=True)
    attach_adapters(module, adapters, layout)
    x = torch.randn(8, 2, hidden, generator=g)
    proj = torch.randn(8, 2, 3 * rows, generator=g)
    out, _ = module(x)
    (out * proj).sum().backward()
    module.lora_disabled = True
    with torch.no_grad():
        base, _ = module(x)
    module.lora_disabled = False

    ref = {n: [t.detach().clone().requires_grad_() for t in (a.A, a.B, a.magnitude)] for n, a in adapters.items()}
    weight, bias = module.weight.detach(), module.bias.detach()
    pieces = {}
    for n, (a, b, m) in ref.items():
        w = layout.slot(weight, n)
        s = m / torch.linalg.vector_norm(w + scaling * b @ a, dim=1).detach()  # NOTE: detached, as in PEFT
        plain = layout.slot((base - bias).movedim(-1, 0), n).movedim(0, -1)
        pieces[n] = (s - 1) * plain + s * F.linear(F.linear(x, a), b) * scaling
    expected = base + layout.interleave(pieces)
    (expected * proj).sum().backward()
    result = {"swapped": len(swapped), "out_diff": float((out - expected).abs().max()),
              "dora_effect": float((out - base).abs().max())}
    for n, a in adapters.items():
        for got, want, what in zip((a.A, a.B, a.magnitude), ref[n], "ABm"):
            result[f"{n}.{what}_grad_diff"] = float((got.grad - want.grad).abs().max() / want.grad.abs().max())
    return result
