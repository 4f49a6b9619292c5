#!/usr/bin/env bash
# Apply slime's own SGLang patches (docker/patch/latest, in the order slime's image applies them) to a
# directory that holds an installed `sglang/` package, reproducing the image's SGLang tree.
#   scripts/slime_sglang_patches.sh SLIME_DIR DIR        apply
#   scripts/slime_sglang_patches.sh SLIME_DIR --list     print the patch files (for build stamps)
# Their C++ and test hunks live outside sglang/ and are dropped by --include.
set -euo pipefail
SLIME=${1:?usage: slime_sglang_patches.sh SLIME_DIR DIR|--list}
DIR=${2:?usage: slime_sglang_patches.sh SLIME_DIR DIR|--list}
PATCHES=(sglang.patch sglang-top_p.patch sglang-release_hicache.patch sglang-pull_weights.patch sglang-deterministic.patch)
if [ "$DIR" = --list ]; then
  for p in "${PATCHES[@]}"; do echo "$SLIME/docker/patch/latest/$p"; done
  exit 0
fi
DIR=$(cd "$DIR" && pwd)
for p in "${PATCHES[@]}"; do
  # a ceiling keeps git from treating DIR as a subdirectory of some enclosing repository
  (cd "$DIR" && GIT_CEILING_DIRECTORIES=$(dirname "$DIR") git apply -p2 --include='sglang/*' "$SLIME/docker/patch/latest/$p")
  echo "slime's $p applied"
done
