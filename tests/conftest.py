import os

os.environ.setdefault("LOONGFORGE_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_runtest_logfinish(nodeid, location):
    """Fail loudly when a test leaves the process environment or ``sys.path`` changed after its fixtures are torn
    down: every later CPU world would then start its ranks with "spawn" instead of the preloaded fork server
    (``parallel/spawn.py``), and the suite takes twice as long (a test that built a megatron model in this process,
    which sets ``NVTE_*`` variables, did so)."""
    import sys

    spawn = sys.modules.get("loongforge_hf.parallel.spawn")
    if spawn is None or not spawn._SERVER or os.environ.get("LOONGFORGE_SPAWN") == "spawn":
        return
    here = {"env": spawn._stable_env(), "path": list(sys.path)}
    if here != spawn._SERVER:
        env0, env1 = spawn._SERVER["env"], here["env"]
        changed = sorted(k for k in env0.keys() | env1.keys() if env0.get(k) != env1.get(k))
        raise RuntimeError(f"{nodeid} left the environment ({changed}) or sys.path changed: later worlds would "
                           "spawn instead of forking from the preloaded server; run models in a world "
                           "(run_distributed) and restore what a test changes (monkeypatch).")
