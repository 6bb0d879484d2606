#!/usr/bin/env bash
# Create ./.venv (once) with loongforge-hf and its dependencies. Sourced by scripts/demo.sh and scripts/test.sh.
# - A torch the interpreter already has is kept (the venv sees system site-packages), e.g. a user's CUDA build.
# - Without one: a GPU machine gets PyPI's torch; a CPU-only machine gets torch==2.13.0 (the CPU wheel where pip's
#   local index has it). LOONGFORGE_TORCH_SPEC overrides the requirement.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.loongforge-installed"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if [ -n "${LOONGFORGE_TORCH_SPEC:-}" ]; then spec="$LOONGFORGE_TORCH_SPEC"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then spec="torch"
    else spec="torch==2.13.0"; fi
    "$VENV/bin/python" -m pip install -q "$spec"
  fi
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
