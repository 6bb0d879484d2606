#!/usr/bin/env bash
# Set up (once) and run the end-to-end demo: tiny Qwen3 checkpoint -> TP2 x PP2 -> train -> HF export -> reload.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
python examples/demo.py "$@"
