"""scripts/bench_fp8_modes.py: the tiny dry run on CPU (FP8 GEMMs emulated) keeps its code paths working: every mode
of every round timed, the FP8 swap on for ``on`` / ``adaptive`` and off again, the order rotated, and the summary
computed from the round medians. Its timings mean nothing on CPU and are not checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_fp8_modes as M  # noqa: E402


def test_rotation_and_summary():
    assert [M.rotated(["bf16", "on", "adaptive"], r) for r in range(4)] == [
        ["bf16", "on", "adaptive"], ["on", "adaptive", "bf16"], ["adaptive", "bf16", "on"], ["bf16", "on", "adaptive"]]
    rounds = [{"bf16": 100.0, "on": 80.0, "adaptive": 82.0}, {"bf16": 90.0, "on": 100.0, "adaptive": 90.0}]
    s = M.summary(rounds, ["bf16", "on", "adaptive"])
    assert s["mean_ms"] == {"bf16": 95.0, "on": 90.0, "adaptive": 86.0}
    assert s["adaptive_vs_better"]["per_round"] == pytest.approx([0.025, 0.0])
    assert s["adaptive_vs_better"]["of_means"] == pytest.approx(86.0 / 90.0 - 1)
    assert "adaptive_vs_better" not in M.summary(rounds, ["bf16", "on"])


def test_tiny_dry_run(tmp_path):
    out = tmp_path / "modes.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_fp8_modes.py"), "--shape", "a", "--tiny", "--device",
                           "cpu", "--rounds", "2", "--steps", "2", "--skip", "1", "--out", str(out),
                           "--checkpoints", str(tmp_path / "checkpoints"), "--fp8-cache", str(tmp_path / "c.json")],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["modes"] == ["bf16", "on", "adaptive"] and len(report["rounds"]) == 2
    # the dict order of a round is the order the modes ran in
    assert [list(r) for r in report["rounds"]] == [["bf16", "on", "adaptive"], ["on", "adaptive", "bf16"]]
    assert all(v > 0 for r in report["rounds"] for v in r.values())
    assert all(len(blocks) == 2 and all(len(b) == 1 for b in blocks) for blocks in report["step_ms"].values())
    # every attention and MLP linear of the 2 tiny layers swapped in both FP8 modes; adaptive decided each GEMM
    assert report["fp8"]["on"]["swapped"] == report["fp8"]["adaptive"]["swapped"] == 8, report["fp8"]
    assert report["fp8"]["adaptive"]["fp8_gemms"].endswith("of 24"), report["fp8"]
    assert report["adaptive_vs_better"]["per_round"] == pytest.approx(
        [r["adaptive"] / min(r["bf16"], r["on"]) - 1 for r in report["rounds"]])
