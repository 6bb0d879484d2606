#!/usr/bin/env bash
# Set up (once) and run the test suite on CPU processes. Extra arguments go to pytest.
# Two pytest workers (pytest-xdist), each test file whole on one (its module fixtures built once): the suite's
# process worlds leave about a third of two cores idle; LOONGFORGE_TEST_WORKERS=0 runs it in one process.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
WORKERS="${LOONGFORGE_TEST_WORKERS:-2}"
PARALLEL=()
if [ "$WORKERS" != "0" ]; then PARALLEL=(-n "$WORKERS" --dist loadfile); fi
# megatron-core torch.compile's some of its fusions (jit_fuser: the router's, the token dispatcher's, activations): on
# CPU processes each rank compiles them with inductor (a C++ build per shape), a fifth of the suite's time on a fresh
# machine for code that runs the same eagerly; the tests run them eagerly (TORCHDYNAMO_DISABLE=0 compiles them again)
export TORCHDYNAMO_DISABLE="${TORCHDYNAMO_DISABLE:-1}"
LOONGFORGE_DEVICE="${LOONGFORGE_DEVICE:-cpu}" python -m pytest -q -p no:cacheprovider ${PARALLEL[@]+"${PARALLEL[@]}"} "$@"
