"""The README's first command, in-process and shorter: examples/demo.py on TP2 x PP2 (4 CPU processes), 6 steps.

Checks what the demo promises: the loss goes down, the export is a complete HF folder, and plain transformers on the
export reproduces the trained loongforge model's logits (fp32).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


@pytest.fixture(scope="module")
def demo_module():
    # NOTE: imported as `demo` with examples/ on sys.path, which the spawned ranks inherit: they unpickle the rank
    # function by importing `demo` themselves.
    spec = importlib.util.spec_from_file_location("demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(DEMO.parent))
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        sys.path.remove(str(DEMO.parent))
        sys.modules.pop(spec.name, None)


@pytest.mark.timeout(600)
def test_demo_end_to_end(demo_module, tmp_path):
    summary = demo_module.main(["--steps", "6", "--out", str(tmp_path / "demo")])

    assert summary["layout"] == "TP2 x PP2 x DP1"
    assert summary["loss_after"] < summary["loss_before"]
    assert len(summary["train_losses"]) >= 2 and summary["train_losses"][-1] < summary["train_losses"][0]
    files = set(summary["files"])
    assert "config.json" in files
    assert any(name.endswith(".safetensors") for name in files)
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    assert Path(summary["export"]) == tmp_path / "demo" / "export"
    assert summary["max_abs_logits_diff"] < 1e-4
    # greedy generate at TP2 x PP2 (KV cache) equals transformers' generate on the export, token for token
    assert len(summary["generated"]) == demo_module.NEW_TOKENS
    assert summary["generated"] == summary["generated_by_transformers"], summary
