"""Run a check of Triton kernels on CPU through Triton's interpreter, in a child process.

``TRITON_INTERPRET`` is read when a kernel is defined, so it must be set before the kernel modules are imported: the
check runs in a fresh interpreter. ``needs_triton`` skips where triton is not installed (the kernels never run there).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")


# NOTE: the interpreter holds kernel scalars as 1-element arrays and converts them for ``range`` with ``int(array)``,
# which numpy >= 2.4 refuses for arrays that are not 0-d; kernels looping to a runtime bound need the element read.
_SCALAR_INDEX_FIX = """
import triton.runtime.interpreter as _interp
_patch_tensor = _interp._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, '__index__', lambda self: int(self.handle.data.reshape(-1)[0]))
_interp._patch_lang_tensor = _patch_lang_tensor
"""


def run_interpreted(statement: str, *, timeout: float = 300) -> list:
    """Run ``statement`` (setup lines, then a last line that is an expression giving a JSON-able list) with
    ``TRITON_INTERPRET=1`` and return that list."""
    *setup, expression = statement.strip().splitlines()
    code = "\n".join(["import json", _SCALAR_INDEX_FIX, *setup, f"print(json.dumps({expression}))"])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
