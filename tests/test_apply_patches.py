"""scripts/apply_patches.sh on real SGLang files: check, apply, idempotence, reverse, refusals — never half-patched."""
import hashlib
import os
import re
import shutil
import subprocess

import pytest

import sglang

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "apply_patches.sh")
PKG = os.path.dirname(sglang.__file__)  # the patched package of this venv
SERIES_DIR = os.path.join(ROOT, "patches", "sglang", f"v{sglang.__version__}")
SERIES = [l.strip() for l in open(os.path.join(SERIES_DIR, "series")) if l.strip() and not l.startswith("#")]


def touched_files():
    files = set()
    for p in SERIES:
        files |= set(re.findall(r"^\+\+\+ b/sglang/(\S+)", open(os.path.join(SERIES_DIR, p)).read(), re.M))
    return sorted(files)


def run(*args, cwd=None):
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, cwd=cwd)


def digest(tree):
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(tree)):
        for f in sorted(files):
            if "__pycache__" in dirpath or f.endswith(".pyc"):
                continue
            p = os.path.join(dirpath, f)
            h.update(p[len(tree):].encode() + open(p, "rb").read())
    return h.hexdigest()


@pytest.fixture
def patched_pkg(tmp_path):
    """The files our patches touch, copied out of this venv's patched sglang (plus version files and overlay)."""
    dst = tmp_path / "site-packages" / "sglang"
    for rel in touched_files() + ["version.py", "_version.py"]:
        os.makedirs(dst / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(PKG, rel), dst / rel)
    shutil.copytree(os.path.join(PKG, "srt", "weight_sync", "delta"), dst / "srt" / "weight_sync" / "delta",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_check_reverse_apply_roundtrip(patched_pkg):
    before = digest(str(patched_pkg))
    r = run("--check", str(patched_pkg))
    assert r.returncode == 0 and f"{len(SERIES)}/{len(SERIES)} patches applied" in r.stdout and "everything applied" in r.stdout
    r = run("--reverse", str(patched_pkg))
    assert r.returncode == 0, r.stderr
    assert all(f"reversed {p}" in r.stdout for p in SERIES)
    assert not (patched_pkg / "srt" / "weight_sync" / "delta").exists()
    assert "delta" not in open(patched_pkg / "srt" / "managers" / "io_struct.py").read().split("class BaseReq")[0]
    r = run("--check", str(patched_pkg))
    assert r.returncode == 0 and f"would apply {len(SERIES)} patch(es) and copy the overlay" in r.stdout
    r = run(str(patched_pkg))
    assert r.returncode == 0 and all(f"applied {p}" in r.stdout for p in SERIES), r.stdout + r.stderr
    assert digest(str(patched_pkg)) == before
    r = run(str(patched_pkg))
    assert r.returncode == 0 and "already applied" in r.stdout and "0 file(s) copied" in r.stdout


def test_git_checkout_layout(patched_pkg, tmp_path):
    checkout = tmp_path / "sglang-checkout"
    shutil.copytree(patched_pkg, checkout / "python" / "sglang")
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    r = run("--reverse", str(checkout))
    assert r.returncode == 0, r.stderr
    r = run(str(checkout))
    assert r.returncode == 0 and "applied" in r.stdout, r.stderr
    assert (checkout / "python" / "sglang" / "srt" / "weight_sync" / "delta" / "receiver.py").exists()


def test_unknown_version_lists_supported(patched_pkg):
    (patched_pkg / "_version.py").write_text("__version__ = version = '0.4.0'\n")
    r = run("--check", str(patched_pkg))
    assert r.returncode == 1
    assert "sglang v0.4.0 is not supported (supported: v0.5.15.post1 v0.5.23)" in r.stderr


def test_conflicting_tree_is_left_untouched(patched_pkg):
    run("--reverse", str(patched_pkg))
    victim = patched_pkg / "srt" / "managers" / "io_struct.py"
    text = victim.read_text()
    victim.write_text(text.replace("class UpdateWeightsFromDistributedReqOutput(", "class RenamedUpstream(", 1))
    before = digest(str(patched_pkg))
    r = run(str(patched_pkg))
    assert r.returncode == 1
    assert "neither applies nor reverses cleanly" in r.stderr and "nothing changed" in r.stderr
    assert digest(str(patched_pkg)) == before


def test_not_a_tree(tmp_path):
    r = run("--check", str(tmp_path))
    assert r.returncode == 1 and "is neither an SGLang tree" in r.stderr
