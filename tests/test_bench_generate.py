"""scripts/bench_generate.py's tiny dry run on CPU: transformers' generate and loongforge-hf's with its dynamic KV
cache, its static cache (the fixed-shape decode step, eagerly: no CUDA graph on CPU) and without a cache, each run
once on the same random prompts (transformers' compiled static cache runs on a GPU only). The run keeps the
script's code paths working; its timings mean nothing on CPU and are not checked, nor is the share of tokens equal
to transformers' (bf16 weights: a near tie may flip; fp32 parity is tests/test_generation_cache.py's)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_generate.py"


@pytest.mark.parametrize("shape", ["a", "c"])
def test_tiny_dry_run_times_the_four_cpu_stacks(tmp_path, shape):
    """Workload (a)'s dense model, and (c)'s mixture of experts (``--shape c``)."""
    out = tmp_path / "bench_generate.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--reps", "1", "--warmup", "0",
                           "--batch", "2", "--prompt", "16", "--new", "4", "--checkpoint", str(tmp_path),
                           "--shape", shape, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workload"].startswith({"a": "Qwen3-0.6B", "c": "Qwen3-30B-A3B"}[shape])
    assert (tmp_path / ("tiny" if shape == "a" else "tiny_c") / "config.json").is_file()
    assert set(report["results"]) == {"transformers", "loongforge_cache", "loongforge_static", "loongforge_no_cache"}
    for r in report["results"].values():
        assert r["ms"] > 0 and 0.0 <= r["same_tokens_as_transformers"] <= 1.0
    assert report["results"]["loongforge_static"]["kept_step_reused"] is True  # NOTE: the timed calls replay
    assert report["results"]["loongforge_static"]["graphed"] is False  # NOTE: no device graph on CPU
    assert "tokens = transformers'" in proc.stdout


@pytest.mark.parametrize("layout", ["tensor", "context"])
def test_tiny_parallel_dry_run_under_torchrun(tmp_path, layout):
    """``--tensor-parallel-size 2`` under torchrun (2 CPU processes, gloo): transformers' own tensor parallelism
    (``tp_plan="auto"``) and ours at TP2 on the same prompts; ``--context-parallel-size 2 --skip-no-cache
    --cp-kv-cache sharded,replicated``: transformers alone on each rank, ours at CP2 with the cache sharded over the
    two ranks and replicated on both, no ``use_cache=False`` run; rank 0 writes the report."""
    out = tmp_path / f"bench_generate_{layout}2.json"
    extra = ["--tensor-parallel-size", "2"] if layout == "tensor" else ["--context-parallel-size", "2",
                                                                        "--skip-no-cache", "--cp-kv-cache",
                                                                        "sharded,replicated"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT),
                           "--tiny", "--device", "cpu", "--reps", "1", "--warmup", "0", "--batch", "2", "--prompt",
                           "16", "--new", "4", "--checkpoint", str(tmp_path), *extra,
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LOONGFORGE_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sizes = (2, 1) if layout == "tensor" else (1, 2)
    assert (report["tensor_parallel_size"], report["context_parallel_size"]) == sizes
    ours = {"loongforge_cache", "loongforge_static"}
    if layout == "tensor":
        assert set(report["results"]) == {"transformers", "loongforge_no_cache", *ours}
        static = ["loongforge_static"]
    else:
        layouts = ("sharded", "replicated")
        assert set(report["results"]) == {"transformers", *(f"{s}_{c}" for s in ours for c in layouts)}
        static = ["loongforge_static_sharded", "loongforge_static_replicated"]
        assert "loongforge-hf, static cache (no graph) (CP KV cache replicated)" in proc.stdout  # NOTE: CPU
    assert all(r["ms"] > 0 for r in report["results"].values())
    assert all(report["results"][key]["kept_step_reused"] is True for key in static)
