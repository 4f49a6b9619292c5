"""The docs say what the code does, where a claim can be read from the code: every status code, metric, flag and make
target the code defines is documented, and every one the docs name exists."""
import glob
import os
import re

from sglang.srt.weight_sync.delta.wire import Refusal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# slime's own flags the docs name (defined in slime itself, not in our patches)
SLIME_OWN = {"--update-weight-mode", "--update-weight-transport", "--update-weight-buffer-size",
             "--update-weight-disk-dir", "--update-weight-disk-keep-files", "--update-weight-delta-encoding"}


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def docs():
    return {p: read(p) for p in ["README.md"] + sorted(os.path.relpath(d, ROOT) for d in
                                                       glob.glob(os.path.join(ROOT, "docs", "*.md")))}


def listed_names(text: str, heading: str):
    """The backquoted names that head the list items (or the table rows) under ``heading``."""
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("- `"):
            names.update(re.findall(r"`([a-z_0-9]+)`", line[2:].split(": ", 1)[0]))
        elif line.startswith("| `"):
            names.update(re.findall(r"`([a-z_0-9]+)`", line.split("|")[1]))
    return names


def test_every_status_code_is_in_the_troubleshooting_list_and_every_item_is_a_code():
    rows = listed_names(read("docs", "troubleshooting.md"), "## Status codes")
    assert rows == {r.value for r in Refusal}, (rows ^ {r.value for r in Refusal})


def _metrics_of_a_sync(tmp_path):
    from cpu_harness import InProcessEngine, Host, bf16_state, hf_config, hf_model, nan_filled, rl_steps, segments, \
        sglang_model
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport

    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engine = InProcessEngine(Host(nan_filled(sglang_model(cfg))))
    transport = DiskTransport(str(tmp_path), [engine], zstd=1, stage_timeout=60)  # staged: its metrics too
    sender = DeltaSender(transport, [engine], encoding="xor_zstd", fingerprint_every=1)
    keys = set()
    for state in [bf16_state(trainer), next(rl_steps(trainer, 1))]:
        assert sender.update(segments(state))[0][0]
        keys |= set(sender.pop_metrics())
    transport.close()
    return keys


def test_every_metric_a_sync_reports_is_in_the_metrics_list_and_every_item_is_one(tmp_path):
    prefix = "perf/update_weights_"
    emitted = {k[len(prefix):] for k in _metrics_of_a_sync(tmp_path)}
    totals = {k[:-len("_total")] for k in emitted if k.endswith("_total")}
    emitted = (emitted - {f"{k}_total" for k in totals}) | totals  # a counter's per-sync name: e.g. repairs
    sharded = read("overlay", "slime", "slime", "backends", "megatron_utils", "update_weight", "delta_sharded.py")
    assert 'p = "perf/update_weights_sharded_"' in sharded
    emitted |= {"sharded_" + m for m in re.findall(r'p \+ "([a-z_]+)"', sharded)}
    run = read("overlay", "sglang", "sglang", "srt", "weight_sync", "delta", "sync_run.py")
    emitted |= set(re.findall(r'm\[p \+ "([a-z_]+)"\] =', run))  # a metric only some syncs report (a draft's share)
    rows = listed_names(read("docs", "reference.md"), "### Metrics")
    assert emitted == rows, f"undocumented: {sorted(emitted - rows)}; no such metric: {sorted(rows - emitted)}"


def _our_flags():
    ours = set()
    for p in glob.glob(os.path.join(ROOT, "patches", "sglang", "*", "*.patch")):
        ours |= {"--" + f.replace("_", "-") for f in re.findall(r"^\+    (update_weight_[a-z_0-9]+): ", read(p), re.M)}
    for p in glob.glob(os.path.join(ROOT, "patches", "slime", "*", "*.patch")):
        ours |= set(re.findall(r'^\+\s+"(--update-weight-[a-z0-9-]+)",$', read(p), re.M))
    args = read("overlay", "slime", "slime", "utils", "delta_sync_args.py")
    ours |= set(re.findall(r'^\s+"(--update-weight-[a-z0-9-]+)",$', args, re.M))
    return ours


def test_every_flag_we_define_is_documented_and_every_documented_flag_exists():
    ours = _our_flags()
    assert {"--update-weight-store", "--update-weight-pause-mode", "--update-weight-delta-chunk-bytes"} <= ours
    reference = read("docs", "reference.md")
    missing = [f for f in sorted(ours) if f"`{f}`" not in reference and f"`--[no-]{f[2:]}`" not in reference]
    assert not missing, f"flags missing from docs/reference.md: {missing}"
    named = set()
    for text in docs().values():
        named |= set(re.findall(r"--update-weight-[a-z0-9-]*[a-z0-9]", text))
    assert named <= ours | SLIME_OWN, sorted(named - ours - SLIME_OWN)


def test_every_make_target_is_documented_and_every_documented_one_exists():
    makefile = read("Makefile")
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, re.M))
    phony = set(re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split())
    text = "\n".join(docs().values())
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", text))
    assert named <= targets, sorted(named - targets)
    assert phony <= named, f"targets no doc names: {sorted(phony - named)}"


def test_no_line_of_the_docs_is_over_120_characters():
    """The written docs line by line, tables and code included (a long table is a list); the benchmark pages and
    the generated sections of the others (between ``<!-- name:begin -->`` and ``<!-- name:end -->``), whose writers
    wrap their prose (``scripts/md_pages.py``), in their prose."""
    long = []
    for path, text in docs().items():
        written, fence, generated = "benchmarks" not in path, False, False
        for k, line in enumerate(text.split("\n"), 1):
            fence ^= line.startswith("```")
            generated = (generated or re.match(r"<!-- [\w-]+:(begin|start) -->", line)) and \
                not re.match(r"<!-- [\w-]+:end -->", line)
            prose = not fence and not line.startswith("|")
            if len(line) > 120 and ((written and not generated) or prose):
                long.append(f"{path}:{k}")
    assert not long, long


def test_the_readme_stays_short():
    assert len(read("README.md").splitlines()) <= 200


def test_every_python_file_the_repo_holds_compiles():
    """Scripts that only CI's demo or a bench runs are compiled here, so a broken line fails the tests, not CI's end."""
    import ast
    files = [p for d in ("scripts", "overlay", "tests", "examples") for p in
             glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)]
    assert len(files) > 20
    for p in files:
        ast.parse(read(p), filename=os.path.relpath(p, ROOT))


def test_the_benchmark_writers_wrap_prose_and_leave_tables_and_code_whole():
    from md_pages import wrap_prose

    row, code = "| " + " | ".join(["cell"] * 40) + " |", "    x = " + "1 + " * 40
    doc = "\n".join(["- **a**: " + "word " * 60, row, "```", code, "```", "1. " + "step " * 40])
    out = wrap_prose(doc).split("\n")
    assert row in out and code in out and max(len(x) for x in out if x not in (row, code)) <= 120
    assert out[1].startswith("  word") and any(x.startswith("   step") for x in out)
    assert " ".join(x.strip() for x in out if x not in (row, code, "```")).split() == \
        " ".join(["- **a**: " + "word " * 60, "1. " + "step " * 40]).split()


def test_memory_md_tables_are_the_models_output_of_the_benchs_formulas():
    """docs/memory.md's figures multiply out the budgets ``make bench-memory`` asserts (``scripts/memory_model.py``
    imports them): a budget changed without the page fails here."""
    import memory_model

    text = read("docs", "memory.md")
    got = text.split(memory_model.MARK[0], 1)[1].split(memory_model.MARK[1], 1)[0]
    want = memory_model.section().split(memory_model.MARK[0], 1)[1].split(memory_model.MARK[1], 1)[0]
    assert " ".join(got.split()) == " ".join(want.split())
    assert all(f"### {name}" in got for name in ("Qwen3-235B-A22B", "DeepSeek-V3 671B", "Kimi-K2 1T"))


def test_upstreams_intended_differences_name_tests_of_ours_and_the_comparison_judges_by_them():
    """docs/compatibility.md's list of slime tests a patched tree changes on purpose: each item names a test of ours
    that exists. The comparison (scripts/upstream_suite.py) fails a test that passes pristine and not patched unless an
    item names it, an item whose test no longer differs, and an item that names a test of ours this repository lacks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("upstream_suite", os.path.join(ROOT, "scripts", "upstream_suite.py"))
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    rows = suite.intended(read("docs", "compatibility.md"))
    assert rows, "no intended differences parsed from docs/compatibility.md"
    up = "tests/test_megatron_argument_validation.py::test_update_weight_delta_requires_disk_transport"
    assert up in rows
    same = {"tests/t.py::a": "passed", "tests/t.py::gpu": "failed"}
    differs = {**same, up: "passed"}
    assert suite.compare(differs, {**same, up: "failed"}, rows) == ([], [])
    assert suite.compare(differs, {**same, up: "failed"}, {}) == \
        ([f"{up}: passes pristine, failed patched (not in the list of intended differences)"], [])
    assert suite.compare(differs, {**same, up: "passed"}, rows)[0] == \
        [f"{up}: listed as an intended difference, but it is passed pristine and passed patched: remove its item"]
    assert suite.compare(differs, {"tests/t.py::gpu": "failed"}, {})[0] == \
        ["tests/t.py::a: passes pristine, absent patched (not in the list of intended differences)",
         f"{up}: passes pristine, absent patched (not in the list of intended differences)"]
    gone = {up: ("tests/test_slime_upstream.py", "test_no_such_test")}
    assert suite.compare(differs, {**same, up: "failed"}, gone)[0] == \
        [f"{up}: its item names tests/test_slime_upstream.py::test_no_such_test, which does not exist"]
    assert suite.compare(same, same, rows) == ([], [])  # a listed test among no path run is not judged
    assert suite.compare({"tests/t.py::b": "error"}, {"tests/t.py::b": "passed"}, {}) == \
        ([], ["tests/t.py::b: error pristine, passes patched"])


def test_every_documented_server_and_tool_command_line_parses(tmp_path):
    """Each command line of the docs' ``bash`` blocks through its real parser: SGLang's server arguments (a tiny real
    model at ``--model-path``; ``...`` dropped) and the delta tools' command line. slime's flag sets go through slime's
    own ``parse_args`` in ``make test-slime`` (tests/test_slime_upstream.py). No line that names one of our flags
    escapes a parser."""
    import contextlib
    import io

    from cpu_harness import bf16_state, hf_config, hf_model, write_hf_checkpoint
    from doc_commands import documented_commands
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.weight_sync.delta.tools import parser

    cfg = hf_config("qwen2")
    model_dir = write_hf_checkpoint(str(tmp_path / "model"), cfg, bf16_state(hf_model(cfg)))
    commands = documented_commands()
    assert {kind for _, kind, _ in commands} >= {"slime", "sglang", "tools"}
    stray = [where for where, kind, argv in commands if kind == "shell" and any("--update-weight" in a for a in argv)]
    assert not stray, f"command lines with our flags that no parser reads: {stray}"
    for where, kind, argv in commands:
        argv = [a for a in argv if a != "..."]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                if kind == "sglang":
                    if "--model-path" in argv:
                        argv[argv.index("--model-path") + 1] = model_dir
                    else:
                        argv = ["--model-path", model_dir, *argv]
                    prepare_server_args(argv + ["--device", "cpu"])
                elif kind == "tools":
                    parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"{where}: {' '.join(argv)}: {err.getvalue().strip().splitlines()[-1]}")


def test_the_layout_table_names_every_script_and_overlay_module():
    """development.md's layout table: each script, and each module of the overlay (but package markers), by name."""
    table = read("docs", "development.md").split("## Layout and tests", 1)[1].split("\n\n", 2)[1]
    names = {f for f in os.listdir(os.path.join(ROOT, "scripts")) if f.endswith((".py", ".sh"))}
    for base in ("overlay/sglang/sglang/srt/weight_sync/delta", "overlay/sglang/sglang/srt/weight_sync/delta/store",
                 "overlay/slime/slime/backends/megatron_utils/update_weight", "overlay/slime/slime/utils"):
        names |= {f for f in os.listdir(os.path.join(ROOT, base)) if f.endswith(".py") and not f.startswith("__")}
    missing = sorted(n for n in names if f"`{n}`" not in table and f"/{n}`" not in table)
    assert not missing, f"not in development.md's layout table: {missing}"


def test_the_readmes_figures_are_the_benchmark_and_memory_pages():
    """Each figure of the README's performance table is the one docs/benchmarks.md holds: wire bytes (rounded MB),
    the ratio to a full sync, and the bytes per changed element over the steps (a range, or one value); its host
    memory per rank is memory.md's."""
    bench = read("docs", "benchmarks.md")
    wire = {m.group(1): (float(m.group(2)), m.group(3)) for m in re.finditer(
        r"^\| delta `(\w+)` \| \w+ \| ([\d.]+) MB \| ([\d.]+x smaller) \|", bench, re.M)}
    per_step = bench.split("## Bytes per changed element", 1)[1].split("\n\n")[2].splitlines()
    head = [c.strip().strip("`") for c in per_step[0].strip("|").split("|")]
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in per_step[2:]]

    def span(col):
        vals = [float(r[head.index(col)]) for r in rows]
        return f"{vals[0]:.1f}" if min(vals) == max(vals) else f"{min(vals):.2f}–{max(vals):.2f}"

    readme = read("README.md").split("## Performance", 1)[1]
    checked = 0
    for m in re.finditer(r"^\| (?:`(\w+)`|slime's `xor` scheme)[^|]* \| (—|\d+ MB) \| (—|[\d.]+x smaller) \| ([\d.–]+) \|$",
                         readme, re.M):
        enc, mb, ratio, per = m.groups()
        if enc is None:
            assert per == span("whole-tensor XOR, zstd-1"), m.group(0)
        else:
            assert (mb, ratio, per) == (f"{round(wire[enc][0])} MB", wire[enc][1], span(enc)), m.group(0)
        checked += 1
    assert checked == 4, checked
    # the host memory it quotes: memory.md's Qwen3-235B snapshot row (the memory model's output)
    qwen = read("docs", "memory.md").split("### Qwen3-235B-A22B", 1)[1].split("\n### ", 1)[0]
    snapshot = re.search(r"^\| snapshot of its owned slices \|.*\| ([\d.]+ GB) \| [\d.]+ GB \|$", qwen, re.M).group(1)
    assert f"({snapshot} for slime's Qwen3-235B recipe" in " ".join(read("README.md").split()), snapshot


def test_the_xor_ctx_ratio_the_written_docs_quote_is_every_benchmark_pages():
    """``xor_ctx``'s bytes against ``xor_zstd``'s, as reference.md and wire-format.md quote it ("on both"): the ratio
    of every encodings-side-by-side table of the benchmark pages."""
    ratios = set()
    for page in ("benchmarks.md", "benchmarks-topology.md"):
        ratios |= set(re.findall(r"^\| `xor_ctx` \(ours\) \| [\d.]+ \| ([\d.]+x) \|", read("docs", page), re.M))
    assert len(ratios) == 1, ratios
    ratio = ratios.pop()
    for page in ("reference.md", "wire-format.md"):
        quoted = re.findall(r"([\d.]+x) `xor_zstd`'s bytes", " ".join(read("docs", page).split()))
        assert quoted and set(quoted) == {ratio}, (page, quoted, ratio)
