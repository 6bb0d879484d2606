import os

os.environ.setdefault("LOONGFORGE_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):  # NOTE: each worker's worlds on its own ports
    _lo = 20000 + 1000 * int(os.environ["PYTEST_XDIST_WORKER"][2:])  # NOTE: below the ephemeral ports (32768+)
    os.environ.setdefault("LOONGFORGE_SPAWN_PORTS", f"{_lo}-{_lo + 999}")


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


# NOTE: the heaviest test files (by their tests' durations on a 2-core CI machine, about longest first) run first, so
# the two pytest-xdist workers (scripts/test.sh, a file whole on one worker) finish together; the others keep their
# order (pytest collects the top-level test files after the folders: a long one there made the run's tail)
_HEAVY_FIRST = ("tests/test_generation_cache.py", "tests/bridges/test_dense_parity.py",
                "tests/integrations/test_lora_new_bridges.py", "tests/integrations/test_dpo.py",
                "tests/integrations/test_sft.py", "tests/bridges/test_moe_parity.py",
                "tests/bridges/test_gradients.py", "tests/integrations/test_lora_moe_bridges.py",
                "tests/test_launchers.py", "tests/multimodal/test_qwen3_5_vl.py",
                "tests/test_bench_generate.py", "tests/bridges/test_deepseek_v4.py",
                "tests/bridges/test_qwen3_5.py", "tests/bridges/test_from_pretrained_kwargs.py",
                "tests/kernels/test_triton_interpret.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # NOTE: stable: files stay whole
