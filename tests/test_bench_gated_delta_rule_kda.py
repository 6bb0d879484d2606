"""scripts/bench_gated_delta_rule.py's ``--rule kda`` on CPU, in process, its heads shrunk to 2 of 8 (the script's
Kimi-Linear shape takes minutes on CPU): transformers' Kimi Linear torch fallback and ours, one document per row and
packed documents, per-channel decays, each checked against ours in fp32 (1e-5 relative); fla's row says why it does
not run off CUDA. Timings mean nothing on CPU and are not checked."""

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_gated_delta_rule as bench  # noqa: E402


def test_kda_dry_run(tmp_path, monkeypatch, capsys):
    tiny = dataclasses.replace(bench.RULES["kda"], k_heads=2, v_heads=2, k_dim=8, v_dim=8)
    monkeypatch.setitem(bench.RULES, "kda", tiny)
    out = tmp_path / "kda.json"
    assert bench.main(["--rule", "kda", "--device", "cpu", "--seq", "40", "--docs", "3", "--batch", "2",
                       "--reps", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rule"] == "kda" and report["heads"] == [2, 2, 8, 8]
    results = report["results"]
    assert set(results) == {f"{p}@40/{row}" for p, row in [("transformers", "1 document"), ("torch", "1 document"),
                                                           ("fla", "1 document"), ("torch", "3 documents"),
                                                           ("fla", "3 documents")]}
    for name, r in results.items():
        if name.startswith("fla"):
            assert r["status"].startswith("unavailable"), (name, r)
        else:
            assert r["ms"] > 0 and r["max_rel_diff"] < 1e-5, (name, r)
    assert "max rel diff vs fp32" in capsys.readouterr().out
