"""Run inside the ranks of tests/parallel/test_spawn.py."""

import os
import time


def where_am_i() -> dict:
    import numpy
    import torch

    return {"draws": (torch.rand(1).item(), float(numpy.random.rand())), "ppid": os.getppid(), "cwd": os.getcwd(),
            "marker": os.environ.get("LF_SPAWN_TEST"), "rank": int(os.environ["RANK"]),
            "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}


def fail_on_rank_one() -> int:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank one says no")
    return 0


def sleep_long() -> None:
    time.sleep(120)


def say_hello() -> None:
    import sys

    print(f"rank {os.environ['RANK']} says hello")
    print(f"rank {os.environ['RANK']} warns", file=sys.stderr)


def a_tensor() -> dict:
    import torch

    return {"t": torch.arange(6.0).reshape(2, 3)}
