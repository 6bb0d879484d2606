"""The Triton kernels (RMSNorm, SwiGLU, RoPE) on CPU through Triton's interpreter, against their torch paths.

Run in a child process: ``TRITON_INTERPRET`` is read when a kernel is defined, so it must be set before the kernel
modules are imported. Skipped where triton is not installed (the kernels then never run).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_torch_paths_in_the_interpreter():
    code = ("import json, torch\nfrom tests.kernels._triton_checks import check_all\n"
            "print(json.dumps(check_all('cpu', dtypes=(torch.float32, torch.bfloat16))))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    checked = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(c.startswith("rms_norm(") for c in checked) and any(c.startswith("swiglu") for c in checked)
    assert any(c.startswith("rms_norm_view") for c in checked) and any(c.startswith("rope") for c in checked)
