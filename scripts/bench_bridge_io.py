"""Bridge load/export on CPU at TP=2: from_pretrained and save_pretrained against plain safetensors reads and writes.

The checkpoint: Llama-3-8B's config (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256, untied LM
head, rope theta 500000) cut to 2 layers: 1.49 B parameters, 2.97 GB in bfloat16 (the dtype Llama 3 ships in).
Random weights, written once by transformers' own ``save_pretrained(max_shard_size="1GB")`` (3 shards) and cached
under outputs/. Everything below runs in one invocation, side by side:

- load: ``from_pretrained(dtype=bfloat16, tensor_parallel_size=2)`` on 2 CPU processes (gloo), wall time of the slower
  rank, against (a) one process reading every tensor of every shard with safetensors (``safe_open``, each tensor
  copied out of the memory map into the process's own memory, as a load must) - the baseline of the target - and
  (b) the 2 ranks at once, each reading with ``safe_open(...).get_slice`` exactly the slices it needs.
- memory: peak RSS of each rank (``VmHWM``, the counter behind ``getrusage().ru_maxrss``, reset through
  ``/proc/self/clear_refs`` before each phase) minus the rank's RSS after its imports, against the rank's own parameter
  bytes + the largest single tensor of the checkpoint. Target: load <= 1.5x baseline (a); peak <= 1.2x that sum.
- export: ``save_pretrained(max_shard_size="1GB")`` wall time and peak RSS per rank, against one process writing the
  same tensors, in the same shards, with ``safetensors.torch.save_file``.
- the process groups' creation (gloo, inside ``from_pretrained``) is shown on its own, and the load less it.
- the bridge reads and writes on ``LOONGFORGE_IO_THREADS`` threads per rank (default: the CPUs this process may use,
  e.g. under ``taskset``, over the 2 ranks, at most 16); the number used is printed and recorded.
- a breakdown of where the bridge's time goes (wrapped functions, summed per rank), and CPU seconds next to wall
  seconds: on a shared machine the wall time of a phase also counts other processes' turns on the cores.
- page cache: warm; every phase reads files the page cache holds (the baseline read runs just before the load), so
  the numbers are about the bridge's own work, not the disk. Written files are flushed (``os.sync``, untimed) after
  each write phase, so one phase's dirty pages don't slow the next. Each run starts a fresh 2-rank world.

    python scripts/bench_bridge_io.py [--repeats 5] [--out outputs/bench_bridge_io.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

# NOTE: runnable as ``python3 scripts/bench_bridge_io.py`` from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loongforge_hf.parallel.spawn import run_distributed  # noqa: E402

LLAMA3_8B_2L = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
TP = 2
SHARD_SIZE = "1GB"
GB = 1e9


# ---- the checkpoint ---------------------------------------------------------------------------------------------

def ensure_checkpoint(folder: Path) -> Path:
    """Write the synthetic checkpoint with transformers once; later runs reuse it."""
    if (folder / "config.json").is_file() and (folder / "model.safetensors.index.json").is_file():
        return folder
    import transformers

    print(f"writing the synthetic checkpoint to {folder} (once) ...", flush=True)
    config = transformers.LlamaConfig(**LLAMA3_8B_2L)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size=SHARD_SIZE)
    del model
    os.replace(partial, folder)
    return folder


def shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# ---- memory counters --------------------------------------------------------------------------------------------

def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak() -> None:
    """Restart VmHWM (and ru_maxrss) from the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---- timing -----------------------------------------------------------------------------------------------------

class Clock:
    """Wall and CPU seconds (this process, all its threads) of a ``with`` block."""

    def __enter__(self) -> "Clock":
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self._wall, time.process_time() - self._cpu


# ---- baselines --------------------------------------------------------------------------------------------------

def raw_full_read(folder: Path) -> Clock:
    """One process: every tensor of every shard into its own memory, through safetensors."""
    from safetensors import safe_open

    state = {}
    with Clock() as clock:
        for path in shard_files(folder):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name).clone()
    return clock


def raw_full_write(folder: Path, out: Path) -> Clock:
    """One process: the same tensors, in the same shards, written with safetensors' save_file (reads untimed)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = {}
    for path in shard_files(folder):
        with safe_open(str(path), framework="pt") as f:
            shards[path.name] = {name: f.get_tensor(name).clone() for name in f.keys()}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with Clock() as clock:
        for name, tensors in shards.items():
            save_file(tensors, str(out / name), metadata={"format": "pt"})
    os.sync()
    shutil.rmtree(out)
    return clock


def split_of(name: str) -> int | None:
    """Along which dim a TP rank holds a slice of this HF tensor (None: it holds all of it)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    if "norm" in name:
        return None
    return 0


def read_own_slices(folder: Path, rank: int) -> int:
    """This rank's slices of every tensor, through safe_open(...).get_slice, copied into the rank's memory."""
    from safetensors import safe_open

    held = []
    for path in shard_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                dim = split_of(name)
                if dim is None:
                    held.append(part[:].clone())
                    continue
                size = part.get_shape()[dim] // TP
                index = (slice(None),) * dim + (slice(rank * size, (rank + 1) * size),)
                held.append(part[index].clone())
    return sum(t.numel() * t.element_size() for t in held)


# ---- inside each rank -------------------------------------------------------------------------------------------

class Timers:
    """Wraps functions so their wall time adds up under a label (a coarse profile of the bridge)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:  # NOTE: an older checkout without this function: its time shows under the caller's label
            return
        timers = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.seconds[label] = timers.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, attr, timed)


def rank_run(folder: str, export_dir: str) -> dict:
    import megatron.core  # noqa: F401 - imports stay out of timings and memory
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf
    import loongforge_hf.parallel as parallel
    from loongforge_hf.bridges import builder, checkpoint_io, exporter, loader, writer

    timers = Timers()
    timers.wrap(transformers.AutoConfig, "from_pretrained", "load: config")
    timers.wrap(parallel, "initialize_parallel", "load: process groups")
    timers.wrap(builder, "build_megatron_model", "load: build megatron model")
    timers.wrap(loader, "load_into", "load: load_into (all)")
    timers.wrap(checkpoint_io.CheckpointReader, "get_slice", "load: load_into: read slices")
    timers.wrap(checkpoint_io.CheckpointReader, "get", "load: load_into: read whole tensors")
    timers.wrap(exporter, "gather_to_first", "export: gather shards over TP")
    timers.wrap(exporter, "_for_each_part", "export: TP shards -> blocks (1st rank)")
    timers.wrap(writer.CheckpointWriter, "add_part", "export: writer.add_part (to disk)")
    timers.wrap(writer.CheckpointWriter, "add", "export: writer.add (to disk)")
    timers.wrap(writer.CheckpointWriter, "__exit__", "export: writer finish (rename)")

    gc.collect()
    reset_peak()
    base_kb = status_kb("VmRSS")
    with Clock() as load:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, tensor_parallel_size=TP)
    load_peak_kb = status_kb("VmHWM")
    rank = dist.get_rank()
    own_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    gc.collect()
    dist.barrier()
    with Clock() as slices:
        read_own_slices(Path(folder), rank)
    dist.barrier()

    gc.collect()
    reset_peak()
    dist.barrier()
    with Clock() as export:
        model.save_pretrained(export_dir, max_shard_size=SHARD_SIZE)
    export_peak_kb = status_kb("VmHWM")
    dist.barrier()
    if rank == 0:
        os.sync()
    groups_s = timers.seconds.get("load: process groups", 0.0)
    # NOTE: 1 for a checkout from before the threaded reads (a side-by-side run against older code)
    try:
        from loongforge_hf.bridges.parallel_io import io_threads as threads_of
    except ImportError:
        threads_of = getattr(checkpoint_io, "io_threads", lambda: 1)
    io_threads = threads_of()
    return {"rank": rank, "load_s": load.wall, "load_cpu_s": load.cpu, "load_groups_s": groups_s,
            "load_without_groups_s": load.wall - groups_s, "io_threads": io_threads,
            "slices_s": slices.wall, "slices_cpu_s": slices.cpu,
            "export_s": export.wall, "export_cpu_s": export.cpu, "base_rss_gb": base_kb * 1024 / GB,
            "load_peak_gb": (load_peak_kb - base_kb) * 1024 / GB,
            "export_peak_gb": (export_peak_kb - base_kb) * 1024 / GB, "own_param_gb": own_bytes / GB,
            "profile_s": timers.seconds}


# ---- the run ----------------------------------------------------------------------------------------------------

def largest_tensor_bytes(folder: Path) -> tuple[str, int]:
    from loongforge_hf.bridges.checkpoint_io import CheckpointReader

    with CheckpointReader(folder) as reader:
        sizes = {n: reader.dtype(n).itemsize * torch.Size(reader.shape(n)).numel() for n in reader.keys()}
    name = max(sizes, key=sizes.get)
    return name, sizes[name]


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def one_run(folder: Path, cache: Path) -> dict:
    """Raw read, then a fresh 2-rank world (load, own-slice read, export), then raw write."""
    load_before = os.getloadavg()[0]
    raw_read = raw_full_read(folder)
    gc.collect()
    ranks = run_distributed(rank_run, TP, str(folder), str(cache / "export"), timeout=900)
    raw_write = raw_full_write(folder, cache / "raw_write")
    return {"loadavg_before": load_before, "loadavg_after": os.getloadavg()[0], "raw_read_s": raw_read.wall,
            "raw_read_cpu_s": raw_read.cpu, "raw_write_s": raw_write.wall, "raw_write_cpu_s": raw_write.cpu,
            "ranks": ranks}


def summarize(runs: list[dict]) -> dict:
    """Medians over the runs; bridge phases take their slower rank (wall) or their busier rank (CPU)."""
    out = {}
    for key in ("raw_read_s", "raw_read_cpu_s", "raw_write_s", "raw_write_cpu_s"):
        out[key] = statistics.median(r[key] for r in runs)
    for key in ("load_s", "load_cpu_s", "load_groups_s", "load_without_groups_s", "slices_s", "slices_cpu_s",
                "export_s", "export_cpu_s"):
        out[key] = statistics.median(max(x[key] for x in r["ranks"]) for r in runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs, each in a fresh 2-rank world (medians reported)")
    parser.add_argument("--cache", default="outputs/bench_bridge_io", help="where the checkpoint and exports live")
    parser.add_argument("--out", default="outputs/bench_bridge_io.json", help="where to write the JSON results")
    args = parser.parse_args()

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    folder = ensure_checkpoint(cache / "llama3-8b-2layers-bf16")
    largest_name, largest = largest_tensor_bytes(folder)
    ckpt_bytes = sum(p.stat().st_size for p in shard_files(folder))

    runs = []
    for i in range(args.repeats):
        runs.append(one_run(folder, cache))
        r = runs[-1]
        print(f"run {i + 1} (load average {r['loadavg_before']:.1f}): raw read {r['raw_read_s']:.2f}s, "
              f"load {max(x['load_s'] for x in r['ranks']):.2f}s, raw write {r['raw_write_s']:.2f}s, "
              f"export {max(x['export_s'] for x in r['ranks']):.2f}s", flush=True)
    shutil.rmtree(cache / "export", ignore_errors=True)
    s = summarize(runs)

    memory = []
    for rank in range(TP):
        rows = [r["ranks"][rank] for r in runs]
        budget = rows[0]["own_param_gb"] + largest / GB
        load_peak, export_peak = max(x["load_peak_gb"] for x in rows), max(x["export_peak_gb"] for x in rows)
        memory.append({"rank": rank, "own_param_gb": rows[0]["own_param_gb"], "own_plus_largest_gb": budget,
                       "load_peak_gb": load_peak, "load_peak_ratio": load_peak / budget,
                       "export_peak_gb": export_peak, "export_peak_ratio": export_peak / budget})
    profile: dict[str, list] = {}
    for r in runs:
        for x in r["ranks"]:
            for label, sec in x["profile_s"].items():
                profile.setdefault(label, [[] for _ in range(TP)])[x["rank"]].append(sec)
    profile = {label: [statistics.median(v) if v else None for v in per] for label, per in sorted(profile.items())}

    print(f"\ncheckpoint: {ckpt_bytes / GB:.2f} GB in {len(shard_files(folder))} shards, largest tensor {largest_name} "
          f"{largest / GB:.3f} GB; TP={TP} on 2 CPU processes, {runs[0]['ranks'][0]['io_threads']} I/O threads per "
          f"rank; medians of {args.repeats} runs\n")
    print(f"{'phase':<46} {'wall s':>7} {'ratio':>6} {'CPU s':>7} {'ratio':>6}")

    def row(label, wall, cpu, base_wall, base_cpu):
        print(f"{label:<46} {wall:>7.2f} {wall / base_wall:>6.2f} {cpu:>7.2f} {cpu / base_cpu:>6.2f}")

    row("raw read, 1 process, all shards (baseline)", s["raw_read_s"], s["raw_read_cpu_s"], s["raw_read_s"],
        s["raw_read_cpu_s"])
    row("raw read, 2 ranks at once, own slices", s["slices_s"], s["slices_cpu_s"], s["raw_read_s"],
        s["raw_read_cpu_s"])
    row("from_pretrained, TP=2 (target <= 1.5)", s["load_s"], s["load_cpu_s"], s["raw_read_s"], s["raw_read_cpu_s"])
    print(f"{'  of which creating the process groups':<46} {s['load_groups_s']:>7.2f} "
          f"{s['load_groups_s'] / s['raw_read_s']:>6.2f}")
    print(f"{'  from_pretrained less the process groups':<46} {s['load_without_groups_s']:>7.2f} "
          f"{s['load_without_groups_s'] / s['raw_read_s']:>6.2f}")
    row("raw write, 1 process, save_file (baseline)", s["raw_write_s"], s["raw_write_cpu_s"], s["raw_write_s"],
        s["raw_write_cpu_s"])
    row("save_pretrained, TP=2", s["export_s"], s["export_cpu_s"], s["raw_write_s"], s["raw_write_cpu_s"])
    print(f"\n{'rank':<5} {'own GB':>7} {'own+largest':>11} {'load peak':>10} {'ratio':>6} {'export peak':>12} "
          f"{'ratio':>6}   (peak RSS above the RSS after imports, GB; worst run; target ratio <= 1.2)")
    for m in memory:
        print(f"{m['rank']:<5} {m['own_param_gb']:>7.3f} {m['own_plus_largest_gb']:>11.3f} {m['load_peak_gb']:>10.3f} "
              f"{m['load_peak_ratio']:>6.2f} {m['export_peak_gb']:>12.3f} {m['export_peak_ratio']:>6.2f}")
    print("\nprofile, wall seconds per rank (medians of the runs):")
    for label, values in profile.items():
        print(f"  {label:<40} " + "  ".join("      -" if v is None else f"{v:7.2f}" for v in values))

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "ram_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB,
                    "python": platform.python_version(), "torch": torch.__version__},
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "checkpoint": {"config": LLAMA3_8B_2L, "dtype": "bfloat16", "bytes": ckpt_bytes,
                       "shards": len(shard_files(folder)), "largest_tensor": largest_name,
                       "largest_tensor_bytes": largest},
        "tensor_parallel_size": TP, "max_shard_size": SHARD_SIZE,
        "io_threads_per_rank": runs[0]["ranks"][0]["io_threads"],
        "summary": s, "memory": memory, "profile_median_s": profile, "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
