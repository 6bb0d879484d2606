"""scripts/bench_clamped_experts.py's dry run on CPU (fp32, host clock): transformers' DeepSeek-V4 experts (eager and
grouped_mm), a weight pair per expert (megatron's SequentialMLP way) and ours (grouped), each path's output and
gradients checked against transformers' eager loop (1e-5 relative). Keeps the script's code paths working; its
timings mean nothing on CPU and are not checked."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_clamped_experts.py"
PATHS = ("hf-eager", "hf-grouped_mm", "sequential", "grouped")


def test_cpu_dry_run(tmp_path):
    out = tmp_path / "clamped_experts.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--reps", "1", "--warmup", "0",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={"LOONGFORGE_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {f"{p}@{t}" for p in PATHS for t in (64, 100)}
    for name, r in report["results"].items():
        assert r["ms"] > 0 and r["max_rel_diff"] < 1e-5, (name, r)
    assert report["shape"]["limit"] == 1.0 and "max rel diff vs hf-eager" in proc.stdout
