#!/usr/bin/env bash
# Rebuild the slime image's SGLang tree and check that our patch set applies on top of it.
#   scripts/check_image_tree.sh SLIME_DIR [WORK_DIR]
# The image (docker/Dockerfile in slime) installs SGLang v0.5.15.post1 and applies slime's
# docker/patch/latest/ patches (scripts/slime_sglang_patches.sh); we reproduce that on the released
# wheel and then run apply_patches.sh --check and apply on it.
set -euo pipefail
SLIME=${1:?usage: check_image_tree.sh SLIME_DIR [WORK_DIR]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${2:-$ROOT/build/image-tree}
PIN=0.5.15.post1

SLIME=$(cd "$SLIME" && pwd)
echo "slime at $(git -C "$SLIME" rev-parse --short=12 HEAD 2>/dev/null || echo '?')"
rm -rf "$WORK" && mkdir -p "$WORK/wheel" && WORK=$(cd "$WORK" && pwd)
python3 -m pip download -q --no-deps "sglang==$PIN" -d "$WORK/wheel" 2>&1 | grep -vE "Location .* is ignored" || true
python3 -m zipfile -e "$WORK"/wheel/sglang-*.whl "$WORK/tree"
cd "$WORK/tree"
rm -rf sglang-*.dist-info
git init -q && git add -A && git -c user.name=check -c user.email=check@localhost commit -qm "sglang $PIN wheel"
"$ROOT/scripts/slime_sglang_patches.sh" "$SLIME" "$WORK/tree"
git -c user.name=check -c user.email=check@localhost commit -qam "slime latest patches"
"$ROOT/scripts/apply_patches.sh" --check "$WORK/tree/sglang"
"$ROOT/scripts/apply_patches.sh" "$WORK/tree/sglang"
"$ROOT/scripts/apply_patches.sh" --check "$WORK/tree/sglang"
echo "OK: our series applies on top of the image's SGLang tree"
