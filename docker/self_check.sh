#!/usr/bin/env bash
# The image build's last step: every patch reported applied, and the patched modules import.
#   docker/self_check.sh SGLANG_TREE SLIME_TREE
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
for tree in "$@"; do
  out=$("$HERE/scripts/apply_patches.sh" --check "$tree")
  echo "$out"
  grep -q "everything applied" <<<"$out" || { echo "self-check: $tree is not fully patched" >&2; exit 1; }
done
python - <<'PY'
import sglang.srt.weight_sync.delta.receiver  # noqa: F401  the engine side, bound by the SGLang patches
import sglang.srt.weight_sync.delta.tools  # noqa: F401
from sglang.srt.managers.io_struct import DeltaSpec, UpdateWeightFromDiskReqInput  # noqa: F401
from slime.utils.delta_sync_args import sparse_delta_updater_cls  # noqa: F401
from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (  # noqa: F401
    UpdateWeightFromDistributedDelta,
)
assert "files" in UpdateWeightFromDiskReqInput.__annotations__ or hasattr(UpdateWeightFromDiskReqInput, "files")
print("self-check: delta weight sync patched and importable")
PY
