"""The package's layout: engine modules never load the sender's diff, and no module outgrows a reviewer's read."""
import pathlib
import subprocess
import sys

import sglang.srt.weight_sync.delta as pkg

ENGINE = ("receiver", "fetch", "stage", "commit", "validate", "ingest", "versions", "views", "engine_state", "write_guard",
          "quant", "prefix_cache", "store.catch_up", "store.watch")


def test_engine_modules_import_nothing_of_the_sender():
    code = ("import sys\n" + "".join(f"import sglang.srt.weight_sync.delta.{m}\n" for m in ENGINE)
            + "print(sorted(m for m in sys.modules if m.startswith('sglang.srt.weight_sync.delta.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for sender_side in ("diff", "sender", "sync_run", "transport", "store.publish"):
        assert f"'sglang.srt.weight_sync.delta.{sender_side}'" not in loaded, loaded


def test_no_module_over_700_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in pathlib.Path(pkg.__file__).parent.glob("*.py")}
    assert max(sizes.values()) <= 700, sizes
