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


def test_every_engine_the_trainer_side_calls_implements_the_one_engine_interface():
    """``engine_api.DeltaEngine`` is the one interface a sender and its transports call: every class of ours that
    carries its calls (HTTP, slime's Ray actor, the harnesses, the tests' wrappers) descends from it, none redeclares
    it by duck typing."""
    import ast

    root = pathlib.Path(__file__).resolve().parent.parent
    bases, carriers = {}, set()
    for path in [*root.glob("overlay/**/*.py"), *root.glob("scripts/*.py"), *root.glob("tests/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
                methods = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
                if {"status", "update_weights_from_disk"} <= methods or {"status", "fingerprint"} <= methods:
                    carriers.add(node.name)

    def implements(name, seen=()):
        return name == "DeltaEngine" or any(implements(b, seen + (name,)) for b in bases.get(name, ())
                                            if b not in seen)

    assert {"HttpEngine", "_RayEngine", "InProcessEngine", "_PipeEngine"} <= carriers, carriers
    assert [c for c in sorted(carriers) if c != "DeltaEngine" and not implements(c)] == []
