#!/usr/bin/env bash
# Patch a pinned SGLang (or slime) tree for delta weight sync and copy the overlay into it.
#
#   scripts/apply_patches.sh [--check | --reverse] TARGET...
#
# TARGET: an SGLang git checkout (patched under python/), an installed package directory
# (.../site-packages/sglang), or a slime checkout. The version picks patches/<project>/<version>/,
# whose `series` file lists the patches in order. Every patch is checked before any is applied,
# so a tree is never left half-patched; running it twice says "already applied" and exits 0.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODE=apply
targets=()
for a in "$@"; do
  case "$a" in
    --check) MODE=check ;;
    --reverse) MODE=reverse ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "unknown option $a" >&2; exit 2 ;;
    *) targets+=("$a") ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || { echo "usage: $0 [--check|--reverse] TARGET..." >&2; exit 2; }

die() { echo "error: $*" >&2; exit 1; }
supported() { find "$ROOT/patches/$1" -mindepth 1 -maxdepth 1 -type d -printf '%f\n' 2>/dev/null | sort | xargs; }

# Resolve TARGET -> project, version, the directory patch paths are relative to, git apply flags.
resolve() {
  local t=$1
  if [ -f "$t/python/sglang/version.py" ]; then
    PROJECT=sglang; BASE=$t; APPLY_DIR=python; PKG=$t/python/sglang
  elif [ -f "$t/version.py" ] && [ -d "$t/srt" ]; then
    PROJECT=sglang; BASE=$(cd "$t/.." && pwd); APPLY_DIR=; PKG=$t
  elif [ -f "$t/slime/__init__.py" ] || [ -d "$t/slime/backends" ]; then
    PROJECT=slime; BASE=$t; APPLY_DIR=; PKG=$t
  else
    die "$t is neither an SGLang tree (python/sglang or a sglang package dir) nor a slime checkout"
  fi
  if [ $PROJECT = sglang ]; then
    # Built trees carry _version.py; a bare checkout answers through its tags; SGLANG_VERSION overrides.
    VERSION=${SGLANG_VERSION:-$(sed -n "s/^__version__ = version = '\(.*\)'/\1/p" "$PKG/_version.py" 2>/dev/null || true)}
    [ -n "$VERSION" ] || VERSION=$(git -C "$t" describe --tags --abbrev=0 2>/dev/null || true)
    [ -n "$VERSION" ] || die "$t: cannot tell the SGLang version (no _version.py, no tag); set SGLANG_VERSION"
    VERSION=v${VERSION#v}
  else
    # SLIME_COMMIT names the commit of a tree without git history (an archive); a ceiling keeps git from answering
    # with the HEAD of a repository around the tree
    local head=${SLIME_COMMIT:-}
    [ -n "$head" ] || head=$(GIT_CEILING_DIRECTORIES=$(dirname "$t") git -C "$t" rev-parse HEAD 2>/dev/null) ||
      die "$t: slime checkout without git history (need the pinned commit, or SLIME_COMMIT=<commit>)"
    VERSION=""
    for d in "$ROOT"/patches/slime/*/; do
      d=$(basename "$d"); [ "${head#"$d"}" != "$head" ] && VERSION=$d
    done
    [ -n "$VERSION" ] || die "$t: slime at ${head:0:12} has no patch set (supported: $(supported slime))"
  fi
  PDIR=$ROOT/patches/$PROJECT/$VERSION
  [ -f "$PDIR/series" ] || die "$t: $PROJECT $VERSION is not supported (supported: $(supported $PROJECT))"
  mapfile -t SERIES < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$PDIR/series")
}

# git apply relative to BASE, never discovering an enclosing repository of an installed package.
gapply() {
  (cd "$BASE" && GIT_CEILING_DIRECTORIES=$(dirname "$BASE") git apply ${APPLY_DIR:+--directory=$APPLY_DIR} "$@")
}
patches_fwd() { local i; for ((i=$1; i<${#SERIES[@]}; i++)); do echo "$PDIR/${SERIES[$i]}"; done; }
patches_rev() { local i; for ((i=$1-1; i>=0; i--)); do echo "$PDIR/${SERIES[$i]}"; done; }

# How many leading patches of the series are applied (the rest must apply cleanly); -1 = conflict.
applied_count() {
  local k n=${#SERIES[@]}
  for ((k=n; k>=0; k--)); do
    local ok=1
    if [ $k -gt 0 ]; then mapfile -t r < <(patches_rev $k); gapply --reverse --check "${r[@]}" 2>/dev/null || ok=0; fi
    if [ $ok = 1 ] && [ "$k" -lt "$n" ]; then mapfile -t f < <(patches_fwd "$k"); gapply --check "${f[@]}" 2>/dev/null || ok=0; fi
    [ $ok = 1 ] && { echo $k; return; }
  done
  echo -1
}

overlay_src() { echo "$ROOT/overlay/$PROJECT/$( [ $PROJECT = sglang ] && echo sglang || echo . )"; }
overlay_files() { local src; src=$(overlay_src); [ -d "$src" ] && (cd "$src" && find . -type f ! -name '*.pyc' ! -path '*/__pycache__/*' | sort) || true; }

for t in "${targets[@]}"; do
  t=$(cd "$t" && pwd)
  resolve "$t"
  n=${#SERIES[@]}
  k=$(applied_count)
  echo "$PROJECT $VERSION at $t: $k/$n patches applied"
  [ "$k" -ge 0 ] || die "$t: the series neither applies nor reverses cleanly (conflicting or partially patched tree); nothing changed"
  src=$(overlay_src)
  case $MODE in
    check)
      stale=0
      while read -r f; do [ -n "$f" ] || continue; cmp -s "$src/$f" "$PKG/$f" || { echo "  overlay differs: $f"; stale=1; }; done < <(overlay_files)
      for ((i=0; i<n; i++)); do [ $i -lt "$k" ] && s=applied || s=pending; echo "  [$s] ${SERIES[$i]}"; done
      [ "$k" = "$n" ] && [ $stale = 0 ] && echo "  everything applied" || echo "  would apply $((n-k)) patch(es)$([ $stale = 1 ] && echo ' and copy the overlay')"
      ;;
    apply)
      if [ "$k" = "$n" ]; then echo "  already applied"; else
        mapfile -t f < <(patches_fwd "$k"); gapply "${f[@]}"
        for ((i=k; i<n; i++)); do echo "  applied ${SERIES[$i]}"; done
      fi
      c=0; while read -r f; do [ -n "$f" ] || continue; mkdir -p "$(dirname "$PKG/$f")"; cmp -s "$src/$f" "$PKG/$f" || { cp "$src/$f" "$PKG/$f"; c=$((c+1)); }; done < <(overlay_files)
      echo "  overlay: $c file(s) copied, $(overlay_files | grep -c . || true) in place"
      ;;
    reverse)
      if [ "$k" = 0 ]; then echo "  no patches applied"; else
        mapfile -t r < <(patches_rev "$k"); gapply --reverse "${r[@]}"
        for ((i=k-1; i>=0; i--)); do echo "  reversed ${SERIES[$i]}"; done
      fi
      c=0; while read -r f; do [ -n "$f" ] || continue; [ -f "$PKG/$f" ] && { rm -f "$PKG/$f"; c=$((c+1)); }; done < <(overlay_files)
      find "$PKG" -type d -name __pycache__ -path '*weight_sync/delta*' -exec rm -rf {} + 2>/dev/null || true
      find "$PKG" -depth -type d -path '*weight_sync/delta*' -empty -delete 2>/dev/null || true
      echo "  overlay: $c file(s) removed"
      ;;
  esac
done
