#!/usr/bin/env bash
# Collects Transformer Engine for the project's offline GPU machines in ./.whl/te (git-ignored; run from the repo root
# on a machine with PyPI): TE's core wheel with only sm_90 (Hopper) cubins kept (scripts/device/prune_fatbin.py:
# 276 MB -> 32 MB), TE's python wheel, the wheels TE imports that those machines lack, and the sdist of TE's torch
# extension, which scripts/device/install_te.sh builds there. Development tooling, not part of the package.
# usage: bash scripts/device/fetch_te.sh [TE_VERSION (default 2.20.2)] [CUDA major (default 13)]
set -euo pipefail
VER="${1:-2.20.2}"; CU="${2:-13}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$ROOT/.whl/te"; WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$1" "${@:2}"; }
get "$WORK" "transformer_engine_cu${CU}==$VER"
get "$OUT" "transformer_engine==$VER" pydantic pydantic-core annotated-types typing-inspection typing_extensions \
  nvidia-cudnn-frontend nvdlfw-inspect
# pydantic pins one pydantic-core: keep the pair pip resolved for pydantic
python3 - "$OUT" <<'PY'
import sys, zipfile, glob, re
out = sys.argv[1]
[pyd] = glob.glob(f"{out}/pydantic-[0-9]*.whl")
meta = zipfile.ZipFile(pyd).read(next(n for n in zipfile.ZipFile(pyd).namelist() if n.endswith("METADATA"))).decode()
want = re.search(r"Requires-Dist: pydantic-core==([\w.]+)", meta).group(1)
have = glob.glob(f"{out}/pydantic_core-*.whl")
if not any(f"pydantic_core-{want}-" in h for h in have):
    sys.exit(f"pydantic needs pydantic-core=={want}, got {have}: download that version into {out}")
PY
core=("$WORK"/transformer_engine_cu${CU}-*.whl)
(cd "$WORK" && mkdir x && cd x && unzip -q "${core[0]}" \
  && python3 "$ROOT/scripts/device/prune_fatbin.py" transformer_engine/wheel_lib/libtransformer_engine.so --keep-sm 90 \
  && python3 - <<'PY'
import base64, glob, hashlib
rec = glob.glob("*.dist-info/RECORD")[0]
rows = []
for row in open(rec).read().splitlines():
    path = row.split(",")[0]
    if path.endswith("libtransformer_engine.so"):
        data = open(path, "rb").read()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        row = f"{path},sha256={digest},{len(data)}"
    rows.append(row)
open(rec, "w").write("\n".join(rows) + "\n")
PY
) && (cd "$WORK/x" && rm -f "$OUT/$(basename "${core[0]}")" && zip -q -9 -r "$OUT/$(basename "${core[0]}")" .)
url=$(python3 - "$VER" <<'PY'
import re, sys, urllib.request
page = urllib.request.urlopen("https://pypi.org/simple/transformer-engine-torch/", timeout=60).read().decode()
print(re.search(rf'href="([^"]*transformer_engine_torch-{re.escape(sys.argv[1])}\.tar\.gz[^"]*)"', page).group(1))
PY
)
curl -sSfL -o "$OUT/transformer_engine_torch-$VER.tar.gz" "${url%%#*}"
du -sh "$OUT"
