"""scripts/bench_lora.py's tiny dry run on CPU: transformers + PEFT and loongforge-hf's LoRA on workloads (a) dense and
(c) MoE (experts and router adapted as PEFT's target_parameters) train the same adapters from the same first loss.

One process (``--in-process``), one step per stack: the run is there to keep every code path of the script working;
its timings mean nothing on CPU and are not checked. First-step losses (B = 0, so the base model's loss) measured
within 1e-5 relative of each other (bf16 weights, megatron's layers against transformers'); checked at 1e-4.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_lora.py"
FIRST_LOSS_REL = 1e-4


def test_tiny_dry_run_trains_the_same_adapters_on_both_stacks(tmp_path):
    out = tmp_path / "bench_lora.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--in-process",
                           "--stacks", "peft,loongforge", "--shapes", "a,c", "--steps", "1", "--warmup", "0",
                           "--out", str(out), "--checkpoints", str(tmp_path / "checkpoints")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["workloads"]) == {"a", "c"}
    for key, entry in report["workloads"].items():
        results = entry["results"]
        for stack, r in results.items():
            assert r["status"] == "ok", f"({key}) {stack}: {r.get('error')}"
            assert r["lora_config"]["r"] == 16 and r["lora_config"]["lora_alpha"] == 32
        peft_row, ours = results["peft"], results["loongforge"]
        assert ours["trainable_parameters"] == peft_row["trainable_parameters"] > 0, key
        assert ours["losses"][0] == pytest.approx(peft_row["losses"][0], rel=FIRST_LOSS_REL), key
        assert any(line.startswith("first-step loss:") for line in entry["agreement"])
    # the MoE workload adapts the routed experts and the router, as PEFT's rewrite of "all-linear" gives them
    assert sorted(report["workloads"]["c"]["results"]["loongforge"]["lora_config"]["target_parameters"]) == [
        "down_proj", "gate.weight", "gate_up_proj"]
    assert "first-step loss:" in proc.stdout


def test_tiny_dora_dry_run(tmp_path):
    """``--use-dora`` on the dense workload: PEFT's and loongforge-hf's DoRA train the same parameters (magnitudes
    included) from the same first loss."""
    out = tmp_path / "bench_dora.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--in-process", "--use-dora",
                           "--stacks", "peft,loongforge", "--shapes", "a", "--steps", "1", "--warmup", "0",
                           "--out", str(out), "--checkpoints", str(tmp_path / "checkpoints")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["lora"]["use_dora"] is True
    results = report["workloads"]["a"]["results"]
    for stack, r in results.items():
        assert r["status"] == "ok", f"{stack}: {r.get('error')}"
        assert r["lora_config"]["use_dora"] is True
    assert results["loongforge"]["trainable_parameters"] == results["peft"]["trainable_parameters"] > 0
    assert results["loongforge"]["losses"][0] == pytest.approx(results["peft"]["losses"][0], rel=FIRST_LOSS_REL)
    assert "DoRA r=16" in proc.stdout
