"""bf16, ``fp8="on"`` and ``fp8="adaptive"`` of one model, interleaved in one process on one device.

``bench_train.py`` runs each row in its own process, one after the other; on a host-bound step (workload (a)) the
machine's state moves a whole row by several percent between processes, more than the difference to be measured
(``adaptive`` against the better of bf16 and ``on``, issue 8's 2% bound). Here one model is built once (as
``bench_train.py``'s ``loongforge optimizer=model`` row: model-precision optimizer state, LoongAdamW) and each round
runs every mode for ``--steps`` training steps, the FP8 swap put on and taken off between them
(``kernels.fp8_linear.enable_fp8`` / ``disable_fp8``, what ``from_pretrained(fp8=...)`` calls after the build); the
order of the modes rotates from round to round. Reported per round: each mode's median step (the first ``--skip``
steps of a block dropped); per mode: the mean of its round medians; and ``adaptive`` against the better of bf16 and
``on`` per round and on average. Training goes on across blocks (weights and optimizer state are shared), which does
not change what a step computes.

    python scripts/bench_fp8_modes.py --shape a [--modes bf16,on,adaptive] [--rounds 5] [--steps 14] [--skip 3]
    python scripts/bench_fp8_modes.py --shape a --tiny --device cpu     # a dry run (FP8 emulated)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402
import bench_train as B  # noqa: E402

MODES = ("bf16", "on", "adaptive")


def fp8_sized(w: B.Workload) -> B.Workload:
    """``w`` whose ``--tiny`` sizes are multiples of 128 (the FP8 GEMM granule), so that a dry run swaps layers."""
    tiny = dict(w.tiny, hidden_size=128, intermediate_size=256, head_dim=32, moe_intermediate_size=128)
    return dataclasses.replace(w, key=f"{w.key}-fp8", tiny=tiny)


def rotated(modes: list[str], round_index: int) -> list[str]:
    """The order of the modes in round ``round_index``: shifted by one each round."""
    shift = round_index % len(modes)
    return modes[shift:] + modes[:shift]


def set_mode(chunks, mode: str, *, recipe: str | None, device: H.Device, cache: str | None):
    """Put the FP8 swap of ``mode`` on the built ``chunks`` (none for bf16); the report, or None."""
    from loongforge_hf.kernels.fp8_linear import enable_fp8, swap_linears

    if mode == "bf16":
        return None
    if device.is_cuda:
        return enable_fp8(chunks, mode, recipe=recipe, cache_path=cache)
    # NOTE: off CUDA the FP8 GEMMs are emulated (a dry run of this script; enable_fp8 refuses such a device)
    return swap_linears(chunks, mode=mode, recipe=recipe or "blockwise", cache_path=cache)


def summary(rounds: list[dict], modes: list[str]) -> dict:
    """Means of the round medians per mode, and ``adaptive`` against the better of bf16 and ``on``."""
    out = {"mean_ms": {m: statistics.fmean(r[m] for r in rounds) for m in modes}}
    if {"bf16", "on", "adaptive"} <= set(modes):
        per_round = [r["adaptive"] / min(r["bf16"], r["on"]) - 1 for r in rounds]
        out["adaptive_vs_better"] = {"per_round": per_round, "mean": statistics.fmean(per_round),
                                     "of_means": out["mean_ms"]["adaptive"]
                                     / min(out["mean_ms"]["bf16"], out["mean_ms"]["on"]) - 1}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="a", choices=sorted(B.WORKLOADS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=14, help="steps per mode and round")
    p.add_argument("--skip", type=int, default=3, help="steps of each block left out of its median")
    p.add_argument("--recipe", default=None, help="fp8_recipe of the FP8 modes (default: the GPU's)")
    p.add_argument("--fp8-cache", default=None, help="the adaptive timing cache (default: the library's)")
    p.add_argument("--checkpoints", default="/tmp/loongforge_bench_train")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="outputs/bench_fp8_modes.json")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES] + (["(none)"] if not modes else [])
    if bad or len(set(modes)) != len(modes):
        p.error(f"--modes takes distinct values of {MODES}, got {args.modes!r}")
    if args.steps <= args.skip or args.rounds < 1:
        p.error("need --rounds >= 1 and --steps > --skip")

    import torch

    from loongforge_hf.kernels.fp8_linear import disable_fp8

    device = H.Device(args.device)
    w = fp8_sized(B.WORKLOADS[args.shape]) if args.tiny else B.WORKLOADS[args.shape]
    folder = Path(args.checkpoints) / (f"{w.key}-tiny" if args.tiny else w.key)
    if not (folder / "config.json").is_file():
        B.write_checkpoint(w, tiny=args.tiny, folder=folder, device=device)
    step, info = B.build_loongforge(str(folder), device, optimizer_precision="model")
    chunks = step.model.chunks
    cfg, seq, mb = B.sizes(w, args.tiny)
    g = torch.Generator(device=device.device).manual_seed(B.SEED)
    batch = torch.randint(0, cfg["vocab_size"], (mb, seq), generator=g, device=device.device)

    rounds, swapped, steps_ms = [], {}, {}
    for r in range(args.rounds):
        medians = {}
        for mode in rotated(modes, r):
            report = set_mode(chunks, mode, recipe=args.recipe, device=device, cache=args.fp8_cache)
            try:
                timing = H.time_steps(step, [[batch]] * args.steps, warmup=args.skip, device=device)
            finally:
                disable_fp8(chunks)
            medians[mode] = timing["median_step_s"] * 1e3
            steps_ms.setdefault(mode, []).append([round(t * 1e3, 2) for t in timing["step_s"]])
            if report is not None:
                swapped[mode] = {"recipe": report.recipe, "swapped": len(report.swapped)}
                if report.autotuner is not None:
                    rows = report.autotuner.rows
                    swapped[mode]["fp8_gemms"] = f"{sum(1 for row in rows if row[-1])} of {len(rows)}"
        rounds.append(medians)
        print(f"round {r + 1}: " + ", ".join(f"{m} {medians[m]:.1f} ms" for m in modes), flush=True)

    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]), "device": device.describe(), "workload": w.title,
              "tiny": args.tiny, "steps": args.steps, "skip": args.skip, "modes": modes, "fp8": swapped,
              "rounds": rounds, **summary(rounds, modes), "step_ms": steps_ms, "info": info}
    print("\n| mode | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " | mean |")
    print("|---|" + "---:|" * (len(rounds) + 1))
    for m in modes:
        print(f"| {m} | " + " | ".join(f"{r[m]:.1f}" for r in rounds) + f" | {result['mean_ms'][m]:.1f} |")
    if "adaptive_vs_better" in result:
        a = result["adaptive_vs_better"]
        print("\nadaptive vs the better of bf16 and on: per round "
              + ", ".join(f"{x:+.1%}" for x in a["per_round"]) + f"; mean {a['mean']:+.2%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    H.save_json(result, out)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
