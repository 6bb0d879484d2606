"""scripts/bench_launch_cost.py's dry run on CPU (no triton rows, host clock): every op's dispatched, aten and HF
paths run and agree with transformers' expressions (bf16: within bf16's resolution at these magnitudes). Keeps the
script's code paths working; its timings mean nothing on CPU and are not checked."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_launch_cost.py"


def test_cpu_dry_run(tmp_path):
    out = tmp_path / "launch_cost.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--batch", "2", "--reps", "3",
                           "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    ops = {"rmsnorm [b, 1, 1024]": ("dispatched", "aten", "hf"), "q norm [1, b, 16, 128]": ("dispatched", "aten", "hf"),
           "swiglu [b, 1, 6144]": ("dispatched", "aten"), "rope [1, b, 16, 128]": ("dispatched", "aten")}
    assert set(results) == {f"{op}: {path}" for op, paths in ops.items() for path in paths}
    for name, r in results.items():
        assert r["host_us"] > 0 and r["max_abs_diff"] < 5e-2, (name, r)
    assert "host µs / call" in proc.stdout
