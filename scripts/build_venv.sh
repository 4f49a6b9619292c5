#!/usr/bin/env bash
# Build (or reuse) the CPU venv for one SGLang pin and patch its installed sglang package.
#   scripts/build_venv.sh 0.5.15.post1 [BUILD_DIR] [slime SLIME_DIR]
# The optional flavor "slime" adds requirements/slime-test*.txt (Megatron, Ray) in venv-<pin>-slime and
# patches sglang as slime's image does (slime's own SGLang patches from SLIME_DIR first, then ours).
# Two stamps keep it incremental: the venv is rebuilt only when requirements or shims change;
# sglang is reinstalled pristine and re-patched only when patches, overlay or the apply script change.
set -euo pipefail
PIN=${1:?usage: build_venv.sh <sglang-version> [build-dir] [slime SLIME_DIR]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${2:-$ROOT/build}
FLAVOR=${3:-}
SLIME_DIR=${4:-}
[ "$FLAVOR" != slime ] || [ -d "$SLIME_DIR" ] || { echo "build_venv.sh: flavor slime needs SLIME_DIR" >&2; exit 2; }
[ -z "$SLIME_DIR" ] || SLIME_DIR=$(cd "$SLIME_DIR" && pwd)  # the patch scripts run from other directories
V=$BUILD/venv-$PIN${FLAVOR:+-$FLAVOR}
PY=${PYTHON:-python3}
req=$ROOT/requirements
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip() { "$V/bin/pip" "$@" 2>&1 | { grep -vE "Location .* is ignored" || true; }; return "${PIPESTATUS[0]}"; }

[ -f "$req/sglang-$PIN.txt" ] || { echo "unknown pin $PIN (have: $(find "$req" -name 'sglang-*.nodeps.txt' -printf '%f\n' | sed -n 's/^sglang-\(.*\)\.nodeps\.txt$/\1/p' | sort | xargs))" >&2; exit 2; }

hash_of() { (cd "$ROOT" && cat "$@" | sha256sum | cut -c1-16); }
extra=(); [ -n "$FLAVOR" ] && extra=("requirements/$FLAVOR-test.txt" "requirements/$FLAVOR-test.nodeps.txt")
venv_hash=$(hash_of scripts/build_venv.sh requirements/common.txt "requirements/sglang-$PIN.txt" \
  "requirements/sglang-$PIN.nodeps.txt" tests/cpu_shims/*.py "${extra[@]}")
slime_patches=(); [ -n "$FLAVOR" ] && mapfile -t slime_patches < <("$ROOT/scripts/slime_sglang_patches.sh" "$SLIME_DIR" --list)
patch_hash=$(cd "$ROOT" && { find scripts/apply_patches.sh scripts/slime_sglang_patches.sh patches overlay -type f \
  ! -name '*.pyc' ! -path '*/__pycache__/*' | sort | xargs cat; cat /dev/null "${slime_patches[@]}"; } | sha256sum | cut -c1-16)

if [ "$(cat "$V/.venv-stamp" 2>/dev/null)" != "$venv_hash" ]; then
  echo "[venv $PIN] building $V"
  "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || {
    echo "build_venv.sh: the CPU venvs need Python 3.11; $PY is $("$PY" -V 2>&1 || echo missing):" \
      "pass PYTHON=/path/to/python3.11" >&2; exit 2; }
  rm -rf "$V"
  "$PY" -m venv "$V"
  pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}  # its CPU build: see the README
  pip install -q -r "$req/common.txt" -r "$req/sglang-$PIN.txt"
  pip install -q --no-deps -r "$req/sglang-$PIN.nodeps.txt"
  if [ -n "$FLAVOR" ]; then
    pip install -q -r "$req/$FLAVOR-test.txt"
    pip install -q --no-deps --ignore-requires-python -r "$req/$FLAVOR-test.nodeps.txt"
  fi
  SP=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp "$ROOT"/tests/cpu_shims/*.py "$SP/"
  for m in "$ROOT"/tests/cpu_shims/*.py; do n=$(basename "$m" .py); echo "import $n" > "$SP/$n.pth"; done
  echo "$venv_hash" > "$V/.venv-stamp"
  rm -f "$V/.patch-stamp"
else
  echo "[venv $PIN] up to date"
fi

if [ "$(cat "$V/.patch-stamp" 2>/dev/null)" != "$patch_hash" ]; then
  SP=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ -f "$V/.patch-stamp" ] || [ -d "$SP/sglang/srt/weight_sync/delta" ]; then
    echo "[venv $PIN] reinstalling pristine sglang"
    rm -rf "$SP/sglang"  # files that patches added are not in pip's RECORD
    pip install -q --no-deps --force-reinstall "sglang==$PIN"
  fi
  [ -z "$FLAVOR" ] || "$ROOT/scripts/slime_sglang_patches.sh" "$SLIME_DIR" "$SP"
  "$ROOT/scripts/apply_patches.sh" "$SP/sglang"
  echo "$patch_hash" > "$V/.patch-stamp"
else
  echo "[venv $PIN] patches up to date"
fi
