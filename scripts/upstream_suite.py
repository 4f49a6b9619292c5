"""Upstream's own tests on its pristine tree and on the tree our patches produce, compared test by test.

  python scripts/upstream_suite.py --pristine DIR --patched DIR [--intended docs/compatibility.md] TEST...

Each tree runs the same TEST paths in its own pytest process (the tree as working directory and first on the path).
A test that passes pristine and does not pass patched fails the run, unless the list of intended differences in
``--intended`` names it with the test of ours that asserts the new behaviour. A listed item that no longer differs,
or that names a test of ours this repository lacks, fails too: the list stays true. Failures both trees share come
from the machine (no GPU, a missing service) and are counted, not judged.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OUT = "UPSTREAM_SUITE_OUT"
# a list item (its lines joined): - `tests/...::name`. ... Ours: `tests/test_ours.py::test_name`.
_ITEM = re.compile(r"^- `([^`]+::[^`]+)`.*\bOurs: `(tests/[^`]+\.py)::(\w+)`", re.S)


# -- the pytest plugin (loaded in each tree's run with -p upstream_suite) -------------------------------------------

_OUTCOMES: dict[str, str] = {}


def pytest_configure(config):
    """megatron-core imports ``typing.override`` (Python 3.12); on 3.11 it comes from typing_extensions, the same for
    both trees."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def pytest_collectreport(report):
    if report.failed:  # a module that does not import: every test in it is lost to this tree
        _record(report.nodeid, "error")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _record(report.nodeid, "passed" if report.passed else "skipped" if report.skipped else "failed")


def pytest_sessionfinish(session):
    with open(os.environ[_OUT], "w") as f:
        json.dump(_OUTCOMES, f, indent=1, sort_keys=True)


def _record(nodeid: str, outcome: str) -> None:
    if _OUTCOMES.get(nodeid) in (None, "passed"):  # a teardown error after a passing call counts
        _OUTCOMES[nodeid] = outcome


# -- the comparison ---------------------------------------------------------------------------------------------------

def run_tree(tree: str, tests: list[str], python: str) -> dict[str, str]:
    """nodeid -> passed | failed | skipped | error, for ``tests`` run in ``tree``."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, _OUT: out.name, "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONPATH": os.pathsep.join([os.path.abspath(tree), os.path.join(ROOT, "scripts")])}
        subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "upstream_suite",
                        "-o", "addopts=", "--continue-on-collection-errors", *tests],
                       cwd=tree, env=env, stdout=subprocess.DEVNULL, check=False)
        with open(out.name) as f:
            return json.load(f)


def intended(doc: str) -> dict[str, tuple[str, str]]:
    """upstream nodeid -> (our test file, our test function), from the list's items."""
    out = {}
    for item in re.split(r"\n(?=\S)", doc):  # an item and its indented lines
        m = _ITEM.match(" ".join(line.strip() for line in item.splitlines()))
        if m:
            out[m.group(1)] = (m.group(2), m.group(3))
    return out


def compare(pristine: dict[str, str], patched: dict[str, str], intended: dict[str, tuple[str, str]],
            repo: str = ROOT) -> tuple[list[str], list[str]]:
    """(problems, notes): a problem fails the run."""
    problems, notes = [], []
    for nodeid in sorted(set(pristine) | set(patched) | set(intended)):
        before, after = pristine.get(nodeid, "absent"), patched.get(nodeid, "absent")
        differs = before == "passed" and after != "passed"
        if nodeid in intended and before == after == "absent":
            continue  # not among the paths run
        if nodeid in intended:
            path, func = intended[nodeid]
            if not differs:
                problems.append(f"{nodeid}: listed as an intended difference, but it is {before} pristine and "
                                f"{after} patched: remove its item")
            elif not _defines(os.path.join(repo, path), func):
                problems.append(f"{nodeid}: its item names {path}::{func}, which does not exist")
        elif differs:
            problems.append(f"{nodeid}: passes pristine, {after} patched (not in the list of intended differences)")
        elif before != "passed" and after == "passed":
            notes.append(f"{nodeid}: {before} pristine, passes patched")
    return problems, notes


def _defines(path: str, func: str) -> bool:
    try:
        with open(path) as f:
            return re.search(rf"^def {func}\(", f.read(), re.M) is not None
    except OSError:
        return False


def counts(outcomes: dict[str, str]) -> str:
    order = ("passed", "failed", "error", "skipped")
    return ", ".join(f"{sum(v == k for v in outcomes.values())} {k}" for k in order)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pristine", required=True)
    ap.add_argument("--patched", required=True)
    ap.add_argument("--intended", default=os.path.join(ROOT, "docs", "compatibility.md"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("tests", nargs="+")
    a = ap.parse_args()
    python = os.path.abspath(shutil.which(a.python) or a.python)  # each run's working directory is its tree
    pristine = run_tree(a.pristine, a.tests, python)
    patched = run_tree(a.patched, a.tests, python)
    with open(a.intended) as f:
        listed = intended(f.read())
    problems, notes = compare(pristine, patched, listed)
    print(f"upstream's own tests ({len(a.tests)} paths): pristine {counts(pristine)}; patched {counts(patched)}; "
          f"{len(listed)} intended differences listed")
    for line in notes:
        print(f"  note: {line}")
    for line in problems:
        print(f"  FAIL: {line}")
    if not pristine:
        print("  FAIL: the pristine tree ran no test")
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
