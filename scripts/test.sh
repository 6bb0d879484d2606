#!/usr/bin/env bash
# Set up (once) and run the test suite on CPU processes. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
LOONGFORGE_DEVICE="${LOONGFORGE_DEVICE:-cpu}" python -m pytest -q -p no:cacheprovider "$@"
