"""``parallel.spawn.run_distributed``: CPU worlds fork from the preloaded server unless the parent's environment
changed since it started (then spawn); either way a rank sees the parent's directory and environment, its share of
the cores and random seeds of its own, and prints where the parent prints; a rank's exception comes back with its
traceback, and a world past its timeout is killed."""

import os
import time
from types import SimpleNamespace

import pytest

from loongforge_hf.parallel.spawn import ChildProcessError_, run_distributed

from ._spawn_fns import a_tensor, fail_on_rank_one, say_hello, sleep_long, where_am_i

pytestmark = pytest.mark.skipif(os.environ.get("LOONGFORGE_DEVICE") != "cpu", reason="the CPU worlds' start")


def test_forked_ranks_take_the_parents_directory_and_thread_share(tmp_path, monkeypatch):
    run_distributed(where_am_i, 1)  # the server exists from here on (an earlier test may have started it)
    monkeypatch.chdir(tmp_path)
    got = run_distributed(where_am_i, 2)
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    for rank, r in enumerate(got):
        assert r["ppid"] != os.getpid(), "forked from the server, not spawned by this process"
        assert r["rank"] == rank and r["cwd"] == str(tmp_path) and r["marker"] is None
        assert r["threads"] == share and r["omp"] == str(share), r
    assert got[0]["ppid"] == got[1]["ppid"]
    # fresh seeds in every rank, as a new interpreter has (forks of one server would otherwise draw alike)
    draws = [r["draws"] for r in got] + [d["draws"] for d in run_distributed(where_am_i, 2)]
    assert len({t for t, _ in draws}) == len(draws) and len({n for _, n in draws}) == len(draws), draws


def test_ranks_print_to_the_parents_current_output(capfd):
    """``capfd`` points this process's stdout / stderr elsewhere than when the server started (an earlier test's
    world): forked ranks still print where this process prints."""
    run_distributed(say_hello, 2)
    out, err = capfd.readouterr()
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, (out, err)
    assert "rank 0 warns" in err and "rank 1 warns" in err, (out, err)


def test_a_changed_environment_spawns(monkeypatch):
    run_distributed(where_am_i, 1)
    monkeypatch.setenv("LF_SPAWN_TEST", "on")
    got = run_distributed(where_am_i, 1)
    assert got[0]["ppid"] == os.getpid() and got[0]["marker"] == "on", got


def test_a_rank_error_comes_back_and_a_late_world_is_killed():
    with pytest.raises(ChildProcessError_, match="rank 1 of 2 failed:(.|\n)*rank one says no"):
        run_distributed(fail_on_rank_one, 2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="sleep_long did not finish on 2 ranks within 3s"):
        run_distributed(sleep_long, 2, timeout=3)
    assert time.monotonic() - start < 30


def test_a_result_travels_by_value(monkeypatch):
    """A rank's result is plain pickle bytes: through the queue's own pickler a tensor would travel as a file
    descriptor the parent fetches from the rank's process, gone once the rank has exited (the demo's test failed so,
    with FileNotFoundError, on a loaded machine). Here ``_child`` runs in this process with a list for its queue."""
    import pickle

    import torch

    from loongforge_hf.parallel import spawn

    monkeypatch.setattr(os, "environ", dict(os.environ))  # NOTE: _child sets the rank's variables
    sent = []
    spawn._child(0, 1, 29500, {}, a_tensor, (), {}, SimpleNamespace(put=sent.append))
    (rank, ok, value), = sent
    assert rank == 0 and ok and isinstance(value, bytes)
    assert torch.equal(pickle.loads(value)["t"], torch.arange(6.0).reshape(2, 3))
    assert run_distributed(a_tensor, 2)[1]["t"].sum() == 15
