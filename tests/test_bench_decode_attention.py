"""scripts/bench_decode_attention.py's dry run on CPU (no CUDA graph, host clock): the blocked and SDPA paths on two
key lengths, each checked against the fp32 blocked path (bf16 inputs: within bf16's resolution). Keeps the script's
code paths working; its timings mean nothing on CPU and are not checked."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode_attention.py"


def test_cpu_dry_run(tmp_path):
    out = tmp_path / "decode_attn.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--paths", "blocks,sdpa", "--keys", "64,600",
                           "--reps", "1", "--warmup", "0", "--graph-calls", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"blocks@64", "sdpa@64", "blocks@600", "sdpa@600"}
    for name, r in results.items():
        assert r["us"] > 0 and r["max_abs_diff"] < 2e-2, (name, r)
    assert "max |diff| vs fp32" in proc.stdout
