"""What every training benchmark shares: one worker process per measurement, timed steps, peak memory, a profile.

Choices:
- One process per (stack, workload): the parent never touches the device, so each worker's memory peak and whatever
  it patches (Liger patches transformers' classes) stay its own. A worker writes one JSON result file; a worker that
  dies without writing one is reported with the tail of its output.
- Time: warm-up steps run first and are discarded (compilation, autotuning, allocator growth, lazy optimizer state).
  Each timed step ends with a device synchronize and is timed on the host clock (the steps measured here end with a
  host read of the loss anyway); the reported step time is the median of the timed steps, the mean is kept too.
- Memory: the allocator's peak since just before the first step. Weights, gradients and optimizer state already
  allocated then count, since the peak can only start from what is allocated at the reset.
- Out of device memory is a result, not a crash: the worker reports ``status="oom"`` with the peak it had reached.
- A profile is one more step after the timed ones, under ``torch.profiler``: ops ranked by their own device time.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

GIB = 1024 ** 3


class Device:
    """The few device questions a worker asks; CPU answers them with no-ops (used for dry runs)."""

    def __init__(self, kind: str) -> None:
        import torch

        self.torch = torch
        self.type = kind
        self.device = torch.device(kind)
        self.is_cuda = kind == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.is_cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return self.torch.cuda.memory_allocated() if self.is_cuda else 0

    def empty_cache(self) -> None:
        if self.is_cuda:
            self.torch.cuda.empty_cache()

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.is_cuda else 0

    def peak_reserved(self) -> int:
        return self.torch.cuda.max_memory_reserved() if self.is_cuda else 0

    def describe(self) -> dict:
        if not self.is_cuda:
            return {"type": "cpu", "name": platform.processor() or platform.machine()}
        props = self.torch.cuda.get_device_properties(0)
        return {"type": "cuda", "name": self.torch.cuda.get_device_name(0),
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / GIB, 1), "multiprocessors": props.multi_processor_count,
                "cuda": self.torch.version.cuda, "driver": _nvidia_smi("driver_version")}

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, getattr(self.torch, "OutOfMemoryError", ())) or "out of memory" in str(exc).lower()


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def versions(*modules: str) -> dict:
    """Installed versions of ``modules`` (None where one is missing), plus Python's."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in modules:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# ---- inside a worker ------------------------------------------------------------------------------------------

def time_steps(step: Callable[[Any], Any], batches: list, *, warmup: int, device: Device) -> dict:
    """Run ``step`` on each batch; the first ``warmup`` are discarded. ``step`` returns the step's loss."""
    if len(batches) <= warmup:
        raise ValueError(f"need more batches ({len(batches)}) than warm-up steps ({warmup}).")
    losses, seconds = [], []
    for i, batch in enumerate(batches):
        if i == warmup:
            device.synchronize()
        start = time.perf_counter()
        loss = step(batch)
        device.synchronize()
        elapsed = time.perf_counter() - start
        losses.append(float(loss))
        if i >= warmup:
            seconds.append(elapsed)
    return {"step_s": seconds, "median_step_s": statistics.median(seconds), "mean_step_s": statistics.fmean(seconds),
            "losses": losses}


def host_ms(fn: Callable[[], Any], *, synchronize: Callable[[], None], warmup: int, reps: int) -> float:
    """Mean host milliseconds per call of ``fn()`` when nothing waits for the device: what queuing its work costs
    the CPU (the launches and the python around them). ``reps`` calls must fit the device's launch queue."""
    for _ in range(warmup):
        fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    synchronize()
    return elapsed * 1e3 / reps


# ops whose callers ``profile_step(stacks=True)`` lists: the memory-bound passes that are not a layer's own kernel
STACK_OPS = ("aten::copy_", "aten::add_", "aten::mul_", "aten::mul", "aten::fill_", "aten::cat", "aten::sum")


def add_micro_args(parser, *, name: str, warmup: int, reps: int) -> None:
    """The options every single-op micro-benchmark takes: --device, --tiny, --warmup, --reps, --out."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run, e.g. on CPU)")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--out", default=f"outputs/{name}.json")


def device_name(device) -> str:
    """The GPU's name for a CUDA ``torch.device``, else its type."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def call_peak_mib(fn: Callable[[], Any], *, cuda: bool) -> float:
    """MiB the allocator's peak rose during one ``fn()`` beyond what was allocated before it (0 off CUDA)."""
    import torch

    if not cuda:
        fn()
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def median_ms(fn: Callable[[], Any], *, cuda: bool, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls after ``warmup``: CUDA events around each call on a GPU
    (device time of what ``fn`` launched), the host clock otherwise (a dry run only)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_diff(got, ref) -> float:
    """The largest difference of each tensor of ``got`` from ``ref``'s, relative to ``ref``'s largest value; the worst
    of them."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()
               for a, b in zip(got, ref))


def measure_path(step: Callable[[], Any], ref, *, cuda: bool, warmup: int, reps: int) -> dict:
    """One path of a side-by-side micro-benchmark, ``step()`` its outputs and gradients: ``max_rel_diff`` from
    ``ref`` (``rel_diff``), ``peak_mib`` of one call beyond its inputs (``call_peak_mib``), median ``ms``
    (``median_ms``)."""
    diff = rel_diff(step(), ref)
    peak_mib = call_peak_mib(step, cuda=cuda)
    return {"ms": median_ms(step, cuda=cuda, warmup=warmup, reps=reps), "peak_mib": peak_mib, "max_rel_diff": diff}


def _is_frame(name: str) -> bool:
    return ".py(" in name or name.startswith("<built-in")


def _is_our_frame(name: str) -> bool:
    """A python frame outside torch and triton (ours, megatron's, the script's)."""
    return ".py(" in name and not any(lib in name.split("(")[0] for lib in ("torch/", "triton/"))


def _call_sites(events, key, limit: int) -> list[dict]:
    """Where the ``STACK_OPS`` events come from: walking the profiler's parent links, the op that called it (e.g.
    ``aten::_to_copy`` for a dtype cast), the autograd node running it in the backward (``bwd:MulBackward0``; the
    backward runs on autograd's thread, without python frames) and the nearest python frames outside torch; grouped
    and ranked by the ops' own time."""
    sites: dict[tuple, list] = {}
    for e in events:
        if e.name not in STACK_OPS:
            continue
        frames, parent, caller = [], e.cpu_parent, None
        while parent is not None and len(frames) < 4:
            name = parent.name
            if caller is None and name.startswith("aten::"):
                caller = name
                frames.append(name)
            elif name.startswith("autograd::engine::evaluate_function: "):
                frames.append("bwd:" + name.split(": ", 1)[1])
            elif _is_our_frame(name):
                frames.append(name)
            parent = parent.cpu_parent
        row = sites.setdefault((e.name, tuple(frames)), [0, 0.0])
        row[0] += 1
        row[1] += key(e)
    ranked = sorted(sites.items(), key=lambda kv: kv[1][1], reverse=True)[:limit]
    return [{"name": name, "calls": n, "self_ms": round(us / 1e3, 3), "stack": list(frames)}
            for (name, frames), (n, us) in ranked if us > 0]


def profile_step(step: Callable[[Any], Any], batch: Any, *, device: Device, row_limit: int = 25,
                 stacks: bool = False) -> dict:
    """One step under ``torch.profiler``: ops ranked by their own (self) device time, with their share of the step.
    ``stacks``: also where the ``STACK_OPS`` come from (python call sites, grouped, ranked by device time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.is_cuda else [])
    device.synchronize()
    start = time.perf_counter()
    with profile(activities=activities, record_shapes=False, with_stack=stacks) as prof:
        step(batch)
        device.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()

    def self_device_us(e) -> float:
        for attr in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(e, attr):
                return float(getattr(e, attr))
        return 0.0

    def self_cpu_us(e) -> float:
        return float(e.self_cpu_time_total)

    # NOTE: the averages hold both host-side ops (aten::mm, with the device time of the kernels they launched) and
    # the kernels themselves; ranking both would count each kernel twice. Ops and kernels are ranked separately, and
    # device-side ranges named like a host op (``Optimizer.step#AdamW.step``) are annotations, not kernels.
    # NOTE: with ``stacks`` the python frames are events too (no kernels of their own): not ranked as ops.
    on_host = [e for e in events if str(getattr(e, "device_type", "CPU")).endswith("CPU") and not _is_frame(e.key)]
    host_names = {e.key for e in on_host}
    on_device = [e for e in events if e not in on_host and e.key not in host_names]
    key = self_device_us if device.is_cuda else self_cpu_us

    def ranked(group) -> tuple[float, list[dict]]:
        total = sum(key(e) for e in group) or 1.0
        rows = sorted(group, key=key, reverse=True)[:row_limit]
        return total, [{"name": e.key, "calls": int(e.count), "self_ms": round(key(e) / 1e3, 3),
                        "share": round(key(e) / total, 4)} for e in rows if key(e) > 0]

    ops_total, ops = ranked(on_host)
    _, kernels = ranked(on_device)
    sort_by = "self_device_time_total" if device.is_cuda else "self_cpu_time_total"
    try:
        table = events.table(sort_by=sort_by, row_limit=row_limit)
    except (AttributeError, KeyError, ValueError):
        table = events.table(sort_by="self_cuda_time_total" if device.is_cuda else "self_cpu_time_total",
                             row_limit=row_limit)
    out = {"wall_ms": round(wall * 1e3, 2), "total_self_ms": round(ops_total / 1e3, 2),
           "measured": "self device time" if device.is_cuda else "self CPU time", "ops": ops,
           "kernels": kernels, "table": table}
    if stacks:
        out["call_sites"] = _call_sites(prof.events(), key, row_limit)
    if device.is_cuda:
        out["idle"] = _idle_of(prof)
    return out


def _idle_of(prof) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        return idle_gaps(json.loads((Path(tmp) / "trace.json").read_text()))


def idle_step(step: Callable[[Any], Any], batch: Any, *, device: Device) -> dict | None:
    """``idle_gaps`` of one more step profiled without python frames (recording them slows the host several-fold,
    which makes the device wait more than it does unprofiled); None off CUDA."""
    if not device.is_cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    device.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(batch)
        device.synchronize()
    return _idle_of(prof)


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# NOTE: cudaMemcpyAsync blocks the host too when one side is pageable memory (a tensor's .item(), .tolist(), .cpu()).
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


class _Thread:
    """One host thread's spans, with their start and end times as arrays (a step has ~10^5 of them)."""

    def __init__(self, spans: list[dict]) -> None:
        import numpy as np

        self.spans = spans
        self.starts = np.array([e["ts"] for e in spans], dtype=float)
        self.ends = self.starts + np.array([e.get("dur", 0) for e in spans], dtype=float)

    def around(self, ts: float) -> list[dict]:
        """The spans running at ``ts``, innermost (shortest) first."""
        import numpy as np

        return sorted((self.spans[i] for i in np.nonzero((self.starts <= ts) & (self.ends >= ts))[0]),
                      key=lambda e: e.get("dur", 0))

    def site(self, ts: float, limit: int = 3) -> list[str]:
        """The frames running at ``ts``, innermost first: the innermost op and the nearest python frames outside torch
        and triton (python frames exist on the main thread; autograd's thread has ops only)."""
        site, op = [], None
        for e in self.around(ts):
            name, cat = e["name"], e.get("cat")
            if op is None and cat in ("cpu_op", "user_annotation"):
                op = name
                site.append(name)
            elif cat == "python_function" and _is_our_frame(name):
                site.append(name)
            if len(site) > limit:
                break
        return site

    def doing(self, ts: float) -> str:
        """What runs at ``ts``: the innermost span (op, python frame, runtime or driver call), with the nearest python
        frame outside torch and triton when that span is not one."""
        around = self.around(ts)
        if not around:
            return "(no span)"
        ours = next((e["name"] for e in around if e.get("cat") == "python_function" and _is_our_frame(e["name"])),
                    None)
        inner = around[0]["name"]
        return inner if ours is None or ours == inner else f"{inner} <- {ours}"


def idle_gaps(trace: dict, *, min_gap_us: float = 20.0, limit: int = 15, sample_us: float = 5.0) -> dict:
    """Where a profiled step leaves the GPU idle, from the profiler's chrome trace: the gaps between device activity
    (any stream) longer than ``min_gap_us``; for each, the host site that launched the first kernel after it (the
    launch's correlation id) and the host synchronisation the gap started in, if any (a sync call still running when
    the device went idle: the host then has to queue work again from an empty queue). Gaps are also summed by
    (synchronisation site, launch site), largest first, and ``host_in_gaps`` ranks what the launching thread was
    running during the gaps (sampled every ``sample_us``: the innermost span, with our nearest python frame)."""
    import numpy as np

    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in _DEVICE_CATS), key=lambda e: e["ts"])
    if not device:
        return {"busy_ms": 0.0, "idle_ms": 0.0, "gaps": [], "by_site": [], "host_in_gaps": []}
    # NOTE: Triton kernels are launched through the driver API (cuLaunchKernel), the others through the runtime.
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    spans: dict = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver"):
            spans.setdefault(e["tid"], []).append(e)
    threads = {tid: _Thread(group) for tid, group in spans.items()}
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"] in _SYNCS]
    gaps, busy, end = [], 0.0, device[0]["ts"]
    start = end
    for e in device:
        if e["ts"] - end > min_gap_us:
            gaps.append((end, e))
        busy += max(0.0, e["ts"] + e.get("dur", 0) - max(e["ts"], end))
        end = max(end, e["ts"] + e.get("dur", 0))
    rows, by_site, doing = [], {}, {}
    for gap_start, nxt in gaps:
        launch = runtime.get(nxt.get("args", {}).get("correlation"))
        site = threads[launch["tid"]].site(launch["ts"]) if launch and launch["tid"] in threads else []
        if launch and launch["tid"] in threads:
            # what the launching thread did while the device sat idle, sampled every ``sample_us``
            for t in np.arange(gap_start, min(launch["ts"], nxt["ts"]), sample_us):
                what = threads[launch["tid"]].doing(float(t))
                doing[what] = doing.get(what, 0.0) + sample_us / 1e3
        sync = next(([e["name"]] + (threads[e["tid"]].site(e["ts"]) if e["tid"] in threads else [])
                     for e in syncs if e["ts"] <= gap_start <= e["ts"] + e.get("dur", 0)), None)
        ms = (nxt["ts"] - gap_start) / 1e3
        rows.append({"ms": round(ms, 3), "at_ms": round((gap_start - start) / 1e3, 2), "next": nxt["name"][:80],
                     "launch_site": site, "sync": sync})
        key = (tuple(sync or ()), tuple(site[:2]))
        total = by_site.setdefault(key, [0, 0.0])
        total[0] += 1
        total[1] += ms
    ranked = sorted(by_site.items(), key=lambda kv: kv[1][1], reverse=True)[:limit]
    return {"busy_ms": round(busy / 1e3, 2), "idle_ms": round((end - start - busy) / 1e3, 2),
            "span_ms": round((end - start) / 1e3, 2), "gaps": sorted(rows, key=lambda r: -r["ms"])[:limit],
            "by_site": [{"sync": list(s), "launch_site": list(l), "gaps": n, "ms": round(ms, 3)}
                        for (s, l), (n, ms) in ranked],
            "host_in_gaps": [{"doing": what, "ms": round(ms, 3)}
                             for what, ms in sorted(doing.items(), key=lambda kv: -kv[1])[:3 * limit]]}


def worker_main(run: Callable[[], dict], *, result_path: str, device: Device) -> int:
    """Call ``run()`` and write its dict (or the failure) to ``result_path``. Exit code 0 unless writing fails."""
    try:
        result = {"status": "ok", **run()}
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a result
        status = "oom" if device.is_oom(exc) else "error"
        result = {"status": status, "error": "".join(traceback.format_exception(exc))[-6000:],
                  "peak_gib": round(device.peak() / GIB, 2) if device.is_cuda else None}
    Path(result_path).write_text(json.dumps(result, indent=1, default=str))
    return 0


# ---- in the parent ----------------------------------------------------------------------------------------------

def run_worker(argv: list[str], *, log_path: Path, timeout_s: float, env: dict | None = None,
               worker: Callable[[list[str]], int] | None = None) -> dict:
    """Run ``python <argv> --result FILE`` in a fresh process; its output goes to ``log_path``; return its result.
    ``worker``: call ``worker(argv[1:] + ["--result", FILE])`` in this process instead (CPU dry runs and tests: no
    process start, but nothing kept apart between workers, no timeout, and the output stays on this process's)."""
    fd, result = tempfile.mkstemp(suffix=".json", prefix="bench_worker_")
    os.close(fd)
    os.unlink(result)
    cmd = [sys.executable, *argv, "--result", result]
    start = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"\n===== {'(in process) ' if worker else ''}{' '.join(cmd)}\n")
        log.flush()
        if worker is not None:
            code = worker([*argv[1:], "--result", result])
        else:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                      env={**os.environ, **(env or {})})
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
    wall = round(time.perf_counter() - start, 1)
    if os.path.exists(result):
        out = json.loads(Path(result).read_text())
        os.unlink(result)
    else:
        out = {"status": "error", "error": f"worker exited ({code}) without a result; log tail:\n"
                                           f"{_tail(log_path, 4000)}"}
    out["worker_wall_s"] = wall
    return out


def _tail(path: Path, chars: int) -> str:
    text = Path(path).read_text(errors="replace")
    return text[-chars:]


def save_json(report: dict, path: Path) -> None:
    """Write ``report`` to ``path`` atomically (a partial file, then a rename): a run stopped mid-write leaves the
    previous report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header)))
             + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
