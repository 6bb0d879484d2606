"""The benchmark harness's idle-time analysis on a hand-built profiler trace (no GPU needed: the analysis reads the
chrome trace torch.profiler writes)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("numpy")

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "_bench_harness.py"
_spec = importlib.util.spec_from_file_location("_bench_harness", _PATH)
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def _trace():
    """Main thread (tid 1): a python frame of ours running the step; a loss `.item()` (a blocking copy) from 100 to
    400 us, during which the device drains and goes idle at 300; the next kernel is launched at 450 from the optimizer.
    Autograd's thread (tid 2) launches the second kernel with no gap before it."""
    return {"traceEvents": [
        _x("lf/engine.py(10): step", "python_function", 0, 1000),
        _x("lf/engine.py(20): loss_value", "python_function", 90, 320),
        _x("aten::item", "cpu_op", 95, 310),
        _x("cudaMemcpyAsync", "cuda_runtime", 100, 300, correlation=9),
        _x("torch/optim/optimizer.py(5): wrapper", "python_function", 440, 100),
        _x("lf/optim.py(30): step", "python_function", 441, 90),
        _x("triton/runtime/jit.py(695): run", "python_function", 444, 30),
        _x("aten::_foreach_mul_", "cpu_op", 445, 20),
        _x("cudaLaunchKernel", "cuda_runtime", 450, 5, correlation=3),
        _x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 10, 40, tid=2),
        _x("cudaLaunchKernel", "cuda_runtime", 20, 5, tid=2, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 5, 5, correlation=1),
        # device: 50-200, 200-300 (back to back), idle 300-480, then 480-600; a 10 us gap 600-610 is below the bar
        _x("gemm_a", "kernel", 50, 150, tid=7, correlation=1),
        _x("gemm_b", "kernel", 200, 100, tid=7, correlation=2),
        _x("adam", "kernel", 480, 120, tid=7, correlation=3),
        _x("Memset", "gpu_memset", 610, 10, tid=7, correlation=4),
        _x("instant", "cpu_op", 0, 0) | {"ph": "i"},
    ]}


def test_idle_gaps_finds_the_gap_its_sync_and_the_launch_site():
    idle = H.idle_gaps(_trace(), min_gap_us=20)
    assert idle["span_ms"] == pytest.approx(0.57)
    assert idle["busy_ms"] == pytest.approx(0.38)
    assert idle["idle_ms"] == pytest.approx(0.19)  # the 180 us gap and the 10 us one below the bar
    assert len(idle["gaps"]) == 1
    gap = idle["gaps"][0]
    assert gap["ms"] == pytest.approx(0.18) and gap["at_ms"] == pytest.approx(0.25) and gap["next"] == "adam"
    # innermost op first, then our python frames (torch's and triton's own frames left out)
    assert gap["launch_site"] == ["aten::_foreach_mul_", "lf/optim.py(30): step", "lf/engine.py(10): step"]
    assert gap["sync"] == ["cudaMemcpyAsync", "aten::item", "lf/engine.py(20): loss_value", "lf/engine.py(10): step"]
    assert idle["by_site"] == [{"sync": gap["sync"], "launch_site": gap["launch_site"][:2], "gaps": 1,
                                "ms": pytest.approx(0.18)}]
    # the main thread during the gap (300 us until the launch at 450), sampled every 5 us: mostly the blocking copy
    doing = {row["doing"]: row["ms"] for row in idle["host_in_gaps"]}
    assert sum(doing.values()) == pytest.approx(0.15)
    assert idle["host_in_gaps"][0] == {"doing": "cudaMemcpyAsync <- lf/engine.py(20): loss_value",
                                       "ms": pytest.approx(0.105)}
    assert doing["lf/engine.py(10): step"] == pytest.approx(0.025)
    assert doing["aten::_foreach_mul_ <- lf/optim.py(30): step"] == pytest.approx(0.005)


def test_idle_gaps_without_a_sync_and_without_device_events():
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["name"] != "cudaMemcpyAsync"]
    gap = H.idle_gaps(trace)["gaps"][0]
    assert gap["sync"] is None and gap["launch_site"][0] == "aten::_foreach_mul_"
    host_only = {"traceEvents": [e for e in trace["traceEvents"] if e["cat"] not in ("kernel", "gpu_memset")]}
    assert H.idle_gaps(host_only) == {"busy_ms": 0.0, "idle_ms": 0.0, "gaps": [], "by_site": [], "host_in_gaps": []}
