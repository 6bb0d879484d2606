"""scripts/bench_softcap_attention.py's dry run on CPU (fp32, host clock): transformers' eager Gemma 2 attention and
our materialised path on a full and a sliding layer, each path's output and gradients checked against transformers'
in fp32 (1e-5 relative). Keeps the script's code paths working; its timings mean nothing on CPU and are not checked."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_softcap_attention.py"


def test_cpu_dry_run(tmp_path):
    out = tmp_path / "softcap_attn.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--paths", "transformers,materialised",
                           "--seq", "64,100", "--window", "40", "--reps", "1", "--warmup", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={"LOONGFORGE_DEVICE": "cpu",
                                                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {f"{p}@{s}/{layer}" for p in ("transformers", "materialised") for s in (64, 100)
                            for layer in ("full", "sliding")}
    for name, r in results.items():
        assert r["ms"] > 0 and r["max_rel_diff"] < 1e-5, (name, r)
    assert "max rel diff vs fp32" in proc.stdout
