"""scripts/bench_generate.py's tiny dry run on CPU: transformers' generate and loongforge-hf's with its dynamic KV
cache, its static cache (the fixed-shape decode step, eagerly: no CUDA graph on CPU) and without a cache, each run
once on the same random prompts (transformers' compiled static cache runs on a GPU only). The run keeps the
script's code paths working; its timings mean nothing on CPU and are not checked, nor is the share of tokens equal
to transformers' (bf16 weights: a near tie may flip; fp32 parity is tests/test_generation_cache.py's)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_generate.py"


def test_tiny_dry_run_times_the_four_cpu_stacks(tmp_path):
    out = tmp_path / "bench_generate.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--reps", "1", "--warmup", "0",
                           "--batch", "2", "--prompt", "16", "--new", "4", "--checkpoint", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"transformers", "loongforge_cache", "loongforge_static", "loongforge_no_cache"}
    for r in report["results"].values():
        assert r["ms"] > 0 and 0.0 <= r["same_tokens_as_transformers"] <= 1.0
    assert "tokens = transformers'" in proc.stdout
