"""scripts/bench_gated_delta_rule.py's dry run on CPU (fp32, host clock): transformers' torch fallback and ours, one
document per row and packed documents, each checked against ours in fp32 (1e-5 relative). Keeps the script's code
paths working; its timings mean nothing on CPU and are not checked."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gated_delta_rule.py"


def test_cpu_dry_run(tmp_path):
    out = tmp_path / "delta_rule.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--paths", "transformers,torch",
                           "--seq", "100", "--docs", "3", "--batch", "2", "--reps", "1", "--warmup", "0",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={"LOONGFORGE_DEVICE": "cpu",
                                                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"transformers@100/1 document", "torch@100/1 document", "torch@100/3 documents"}
    for name, r in results.items():
        assert r["ms"] > 0 and r["max_rel_diff"] < 1e-5, (name, r)
    assert "max rel diff vs fp32" in proc.stdout
