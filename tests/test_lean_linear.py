"""``lean_linear.lean_linears``: megatron's linear layers at tensor-parallel size 1 run as plain matrix products inside
``generate``. The logits of a forward without gradients are bitwise those of megatron's own forward (fp32 and bf16;
a model with qkv biases, and a mixture-of-experts model), every plain Column/Row linear layer takes the lean subclass
and its own class back on exit; a layer with its own ``_forward_impl`` (as the FP8 swap gives them) and every layer
under tensor parallelism are left alone."""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _run(folder: str) -> dict:
    import functools
    from types import SimpleNamespace

    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    import loongforge_hf as lf
    from loongforge_hf.lean_linear import lean_linears

    def lean(linears):
        return sum(type(m) not in (ColumnParallelLinear, RowParallelLinear) for m in linears)

    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        linears = [m for m in model.chunks[0].modules() if type(m) in (ColumnParallelLinear, RowParallelLinear)]
        kept = linears[1]  # NOTE: as the FP8 swap leaves a layer: an instance _forward_impl
        kept._forward_impl = functools.partial(type(kept)._forward_impl, kept)
        ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model(input_ids=ids).logits
            with lean_linears(model):
                swapped = lean(linears)
                got = model(input_ids=ids).logits
            with lean_linears(SimpleNamespace(parallel=SimpleNamespace(tensor_parallel_size=2), chunks=model.chunks)):
                under_tp = lean(linears)
        found[str(dtype)] = {"equal": bool(torch.equal(ref, got)), "linears": len(linears), "swapped": swapped,
                             "after": lean(linears), "under_tp": under_tp}
    return found


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_lean_linears_give_megatron_logits_bitwise(tmp_path, arch):
    folder = make_tiny_checkpoint(tmp_path / arch, arch)
    found = run_distributed(_run, 1, str(folder), timeout=300)[0]
    for dtype, res in found.items():
        assert res["equal"], (dtype, res)
        assert res["swapped"] == res["linears"] - 1 and res["linears"] > 4, (dtype, res)
        assert res["after"] == 0 and res["under_tp"] == 0, (dtype, res)
