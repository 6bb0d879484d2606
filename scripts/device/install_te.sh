#!/usr/bin/env bash
# On an offline GPU machine, from the repo root with .whl carried: installs what scripts/device/fetch_te.sh collected
# into /tmp/site, building TE's torch extension from its sdist against the machine's torch (about 2 minutes on 16
# cores; the wheel it builds is copied to $OUT/tewheel when $OUT is set: put it in .whl/te/built to skip the build on
# the next machine). Then: export PYTHONPATH=/tmp/site:$PWD. Development tooling, not part of the package.
set -euo pipefail
R="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# NOTE: one pip call for every wheel that has files under transformer_engine/: with --target --upgrade, each later
# call replaces that whole top-level folder.
if ls .whl/te/built/transformer_engine_torch-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .whl/te/*.whl \
    .whl/te/built/*.whl
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .whl/te/*.whl
export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
build="$(mktemp -d)"
tar xzf .whl/te/transformer_engine_torch-*.tar.gz -C "$build"
cd "$build"/transformer_engine_torch-*
NVTE_FRAMEWORK=pytorch NVTE_WITH_NCCL_EP=0 NVTE_CUDA_ARCHS=90 NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="$(nproc)" \
  python3 -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$build/wheel" . > "$build/log" 2>&1 \
  || { tail -60 "$build/log"; exit 3; }
cd "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .whl/te/*.whl "$build"/wheel/*.whl
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/tewheel" && cp "$build"/wheel/*.whl "$OUT/tewheel/"; fi
