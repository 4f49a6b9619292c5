"""The command lines the docs show, read as a reader copies them: every ``bash`` block of the README and docs/, its
continuation lines joined and comments dropped, each line sorted by the parser it goes to."""
import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {"slime": "--",  # a flag set of slime's trainer (train.py's arguments)
         "sglang": "python -m sglang.launch_server ",
         "tools": "python -m sglang.srt.weight_sync.delta "}


def documented_commands():
    """[(where, kind, argv)]: kind is a key of :data:`KINDS`, or ``"shell"`` for a line none of them parses."""
    out = []
    for path in ["README.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        path = os.path.relpath(os.path.join(ROOT, path), ROOT)
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for block in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S):
            first = text[:block.start()].count("\n") + 2
            for n, line in _logical_lines(block.group(1)):
                kind = next((k for k, prefix in KINDS.items() if line.startswith(prefix)), "shell")
                argv = shlex.split(line[len(KINDS[kind]):] if kind in ("sglang", "tools") else line)
                out.append((f"{path}:{first + n}", kind, argv))
    return out


def _logical_lines(body: str):
    lines, start, cur = [], 0, ""
    for n, raw in enumerate(body.splitlines()):
        if not cur:
            start = n
        code = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if code.endswith("\\"):
            cur += code[:-1] + " "
            continue
        cur += code
        if cur.strip():
            lines.append((start, cur.strip()))
        cur = ""
    return lines
