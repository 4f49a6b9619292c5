"""`make bench` end to end at a tiny shape: states from real AdamW steps, the timing and memory runs (each applying
every encoding to a real SGLang model and checking the fingerprint), then the report and the plot."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_writes_its_report(tmp_path):
    out = tmp_path / "docs"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--shape", "tiny", "--steps", "2",
                        "--workdir", str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("every encoding bit-identical on the engine") == 2  # per step, in the timing run
    text = (out / "benchmarks.md").read_text()
    for e, path in (("indices", "nccl"), ("deltas", "nccl"), ("deltas_zstd", "disk"), ("planes_zstd", "disk"),
                    ("xor_zstd", "disk")):
        assert f"| delta `{e}` | {path} |" in text
    assert "## Bytes per changed element" in text and "whole-tensor XOR, zstd-1" in text
    assert re.findall(r"^\| (\d+) \| [\d.]+% \|", text, re.M) == ["1", "2"] * 3  # per-step tables: one row a step
    assert "## FP8 rollout engine" in text and r.stdout.count("measure: fp8 step") == 4  # both runs
    assert "(theirs)" in text
    overhead = json.load(open(tmp_path / "work" / "tiny" / "timing.json"))["overhead"]  # reported for MoE shapes
    assert overhead["pieces"] < overhead["tensors"] and overhead["engine_s"] > 0
    assert overhead["sender_s"] > 0 and overhead["sender_pieces_s"] > 0
    assert (out / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _the_topology_page_holds_every_measured_shape(tmp_path / "work", out)


def _the_topology_page_holds_every_measured_shape(work, out):
    """The tiny run's measurements standing in for both topology shapes: the shared page gets a row group per shape
    and keeps the other scripts' sections of either shape."""
    import shutil

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import bench_topology

    shapes = ("qwen3-30b-a3b-topology", "qwen3-235b-a22b-topology")
    tag = "bench-coding:qwen3-30b-a3b-topology"
    section = f"<!-- {tag}:begin -->\nkept\n<!-- {tag}:end -->"
    (out / bench_topology.PAGE).write_text("# old\n\n" + section + "\n")
    shutil.copytree(work / "tiny", work / shapes[0], ignore=shutil.ignore_patterns("*.safetensors", "wire"))
    bench_topology.write(str(work), str(out))
    text = (out / bench_topology.PAGE).read_text()
    assert "# old" not in text and text.count(section) == 1
    assert len(re.findall(r"^\| qwen3-30b-a3b-topology \| `\w+` \| (?:nccl|disk) \|", text, re.M)) == 6
    shutil.copytree(work / "tiny", work / shapes[1], ignore=shutil.ignore_patterns("*.safetensors", "wire"))
    bench_topology.write(str(work), str(out))
    text = (out / bench_topology.PAGE).read_text()
    for shape in shapes:
        assert len(re.findall(rf"^\| {shape} \| `\w+` \| (?:nccl|disk) \|", text, re.M)) == 6
        assert f"- **{shape}**:" in text and f"--shape {shape}" in text
    assert text.count(section) == 1 and max(len(x) for x in text.splitlines() if not x.startswith("|")) <= 120


def test_the_encodings_side_by_side(tmp_path):
    """`bench_coding.py` at the tiny shape: every format's row, both floors, and ours decoded with every check."""
    out = tmp_path / "docs"
    out.mkdir()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_coding.py"), "--shape", "tiny",
                        "--steps", "1", "--workdir", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = (out / "benchmarks.md").read_text()
    rows = dict(re.findall(r"^\| ([^|]+) \| ([\d.]+) \| [\d.]+x \|", text, re.M))
    assert len(rows) == 9 and float(rows["`xor_ctx` (ours)"]) < 0.7 * float(rows["`xor_zstd` (ours)"]), rows
    assert max(map(len, text.splitlines())) <= 200


def test_the_sharded_bench_reports_every_rank(tmp_path):
    """`--engine-tp 2` at the tiny shape: one process per rank, each rank checked bit-identical to its own plain load
    after every step; the report holds a row per rank with its syncs and ops per flush."""
    out = tmp_path / "docs"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--shape", "tiny", "--steps", "1",
                        "--engine-tp", "2", "--workdir", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = re.findall(r"^\| tiny \| 2 \| 1 \| (\d) \| .*\| \*\*[\d.]+x\*\* \| (\d+) \| [\d,]+ \| \d+ MiB \|$",
                      (out / "benchmarks-sharded.md").read_text(), re.M)
    assert [rank for rank, _ in rows] == ["0", "1"] and all(int(syncs) <= 6 for _, syncs in rows), rows
