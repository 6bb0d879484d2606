"""megatron-core forward + backward on CPU processes over gloo, for each parallel layout we claim."""

import math

import pytest

from loongforge_hf.parallel.spawn import run_distributed

from ._megatron_smoke import build_and_step

LAYOUTS = {
    "tp2": (2, dict(tensor_parallel_size=2), False),
    "tp2_sp_kernels": (2, dict(tensor_parallel_size=2, sequence_parallel=True), False),
    "cp2_kernels": (2, dict(context_parallel_size=2), False),
    "pp2_1f1b": (2, dict(pipeline_parallel_size=2), False),
    "pp2_interleaved": (2, dict(pipeline_parallel_size=2, virtual_pipeline_parallel_size=2), False),
    "ep2_alltoall": (2, dict(expert_parallel_size=2), True),
    "dp2": (2, dict(), False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_backward(name):
    nprocs, layout, moe = LAYOUTS[name]
    spec = "kernels" if name.endswith("_kernels") else "megatron-local"
    results = run_distributed(build_and_step, nprocs, layout, moe=moe, spec=spec, timeout=240)
    last = [r for r in results if r["last_stage"]]
    assert last, "no rank reported the last pipeline stage"
    for r in last:
        assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"])
    for r in results:
        # every parameter of every rank received a gradient (embeddings, layers and output layer alike)
        assert r["with_grad"] == r["params"], r
