"""``lean_linear.lean_linears``: megatron's linear layers run without their autograd machinery inside ``generate``.
The logits of a forward without gradients are bitwise those of megatron's own forward (fp32 and bf16) on every rank
of: one rank (a model with qkv biases, and a mixture-of-experts model), TP2, TP2 with sequence parallelism. Every
plain Column/Row linear layer takes the lean subclass and its own class back on exit; a layer with its own
``_forward_impl`` (as the FP8 swap gives them) is left alone, and ``LOONGFORGE_LEAN_LINEARS=0`` leaves them all."""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint


def _run(folder: str, layout: dict) -> dict:
    import functools
    import os

    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    import loongforge_hf as lf
    from loongforge_hf.lean_linear import lean_linears

    def lean(linears):
        return sum(type(m) not in (ColumnParallelLinear, RowParallelLinear) for m in linears)

    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **layout)
        linears = [m for m in model.chunks[0].modules() if type(m) in (ColumnParallelLinear, RowParallelLinear)]
        kept = linears[1]  # NOTE: as the FP8 swap leaves a layer: an instance _forward_impl
        kept._forward_impl = functools.partial(type(kept)._forward_impl, kept)
        ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0)).to(model.device)
        with torch.no_grad():
            ref = model(input_ids=ids).logits
            with lean_linears(model):
                swapped = lean(linears)
                got = model(input_ids=ids).logits
            os.environ["LOONGFORGE_LEAN_LINEARS"] = "0"
            try:
                with lean_linears(model):
                    switched_off = lean(linears)
            finally:
                del os.environ["LOONGFORGE_LEAN_LINEARS"]
        found[str(dtype)] = {"equal": bool(torch.equal(ref, got)), "linears": len(linears), "swapped": swapped,
                             "after": lean(linears), "switched_off": switched_off}
    return found


@pytest.mark.parametrize("arch, nprocs, layout", [
    ("qwen2", 1, {}), ("qwen3_moe", 1, {}), ("qwen2", 2, {"tensor_parallel_size": 2}),
    ("qwen2", 2, {"tensor_parallel_size": 2, "sequence_parallel": True})], ids=["tp1", "tp1_moe", "tp2", "tp2_sp"])
def test_lean_linears_give_megatron_logits_bitwise(tmp_path, arch, nprocs, layout):
    folder = make_tiny_checkpoint(tmp_path / arch, arch)
    for rank, found in enumerate(run_distributed(_run, nprocs, str(folder), layout, timeout=300)):
        for dtype, res in found.items():
            what = (rank, dtype, res)
            assert res["equal"], what
            assert res["swapped"] == res["linears"] - 1 and res["linears"] > 4, what
            assert res["after"] == 0 and res["switched_off"] == 0, what
