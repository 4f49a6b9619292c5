#!/usr/bin/env bash
# Build BUILD/gpu-bundle/site.zip for `make gpu-check` on a lent GPU machine (Python 3.12, no network, at most
# 64 MiB travels): requirements/gpu-bundle.txt installed for cp312 x86_64 into one directory, SGLang patched
# there by our apply script, and slime's package from SLIME_DIR patched the same way (the sharded-sender lane
# needs it and Megatron-core), zipped. Stamped: rebuilt only when its inputs change.
#   SLIME_COMMIT=... scripts/gpu_bundle.sh BUILD_DIR SLIME_DIR
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build}/gpu-bundle
SLIME=${2:?"usage: $0 BUILD_DIR SLIME_DIR (a slime checkout at the pin)"}
[ -d "$SLIME/slime" ] || { echo "gpu-bundle: no slime checkout at $SLIME" >&2; exit 2; }
stamp=$(cd "$ROOT" && { find requirements/gpu-bundle.txt scripts/gpu_bundle.sh scripts/apply_patches.sh \
  patches overlay -type f ! -name '*.pyc' ! -path '*/__pycache__/*' | sort | xargs cat;
  (cd "$SLIME" && find slime -type f -name '*.py' | sort | xargs cat); } | sha256sum | cut -c1-16)
if [ "$(cat "$OUT/.stamp" 2>/dev/null)" = "$stamp" ] && [ -f "$OUT/site.zip" ]; then
  echo "[gpu-bundle] up to date: $OUT/site.zip"; exit 0
fi
rm -rf "$OUT" && mkdir -p "$OUT/site"
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip install -q --no-deps --no-compile --only-binary=:all: \
  --ignore-requires-python --python-version 3.12 --implementation cp "${platforms[@]}" --target "$OUT/site" \
  -r "$ROOT/requirements/gpu-bundle.txt" 2>&1 | { grep -v "Location .* is ignored" || true; }
"$ROOT/scripts/apply_patches.sh" "$OUT/site/sglang"
cp -a "$SLIME" "$OUT/slime-tree" && "$ROOT/scripts/apply_patches.sh" "$OUT/slime-tree"
cp -a "$OUT/slime-tree/slime" "$OUT/site/slime" && rm -rf "$OUT/slime-tree"
(cd "$OUT/site" && python3 -m zipfile -c ../site.zip ./*)
rm -rf "$OUT/site"
echo "$stamp" > "$OUT/.stamp"
echo "[gpu-bundle] $OUT/site.zip: $(du -h "$OUT/site.zip" | cut -f1)"
