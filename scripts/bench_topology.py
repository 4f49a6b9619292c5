"""``docs/benchmarks-topology.md``: the MoE topology shapes side by side, one table per measure, a column or a row
group per shape. Each shape's ``bench.py --shape <shape>`` run leaves its measurements under the work dir; the page
is rebuilt from every topology shape measured there, so one run refreshes its own rows and keeps the other's."""
from __future__ import annotations

import json
import os
import re
from statistics import mean

from bench import ENCODINGS, LINKS, SHAPES, TRANSPORT, faster, modeled, summarize
from md_pages import write_page

PAGE = "benchmarks-topology.md"
SECTION = re.compile(r"<!-- ([\w.:-]+):begin -->.*?<!-- \1:end -->", re.S)


def measured(workdir: str) -> list:
    """(shape, timing, memory) of every topology shape with both runs under ``workdir``, in SHAPES order."""
    out = []
    for shape in (s for s in SHAPES if s.endswith("-topology")):
        paths = [os.path.join(workdir, shape, f"{run}.json") for run in ("timing", "memory")]
        if all(map(os.path.exists, paths)):
            t, m = (json.load(open(p)) for p in paths)
            env = os.path.join(workdir, shape, "env.txt")
            t["env"] = open(env).read() if os.path.exists(env) else "this machine"
            out.append((shape, t, m))
    return out


def report(runs: list) -> str:
    mb = lambda b: f"{b / 1e6:,.1f} MB"  # noqa: E731
    ms = lambda s: f"{1e3 * s:,.0f}"  # noqa: E731
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    summ = {shape: summarize(t, m) for shape, t, m in runs}
    L = ["# Benchmarks: large MoE topologies", "",
         "What grows with the number of tensors rather than with their bytes: the layer and expert counts of "
         "Qwen3-30B-A3B and Qwen3-235B-A22B (128 experts per layer, top-8) at narrow widths (hidden 64, expert "
         "intermediate 32). Written by `make bench` (`scripts/bench.py`) with each topology shape, one run each. "
         "Columns and method as in [benchmarks.md](benchmarks.md); figures are ratios within a run.", ""]
    for shape, t, _ in runs:
        dens = [s["density"] for s in t["steps"]]
        L.append(f"- **{shape}**: {t['params'] / 1e6:.0f}M params ({t['tensors']:,} HF tensors), {mb(t['full_bytes'])} "
                 f"in bf16; {len(t['steps'])} AdamW steps at lr 1e-6 changed {min(dens):.2%}–{max(dens):.2%} of "
                 f"bf16 elements (mean {mean(dens):.2%}). Run on {t['env']}.")
    L += [""] + [f"![{shape}: wire bytes and modeled sync time](benchmarks-{shape}.png)" for shape, _, _ in runs]
    L += ["", "## Wire bytes and sync time (mean over steps)", "",
          "| shape | sync | path | wire bytes | vs full | sender ms | engine ms | vs full load | "
          + " | ".join(f"modeled @ {k}" for k in LINKS) + " |",
          "|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(LINKS)]
    for shape, t, _ in runs:
        full = " | ".join(f"{modeled(t['full_bytes'], t['full_load_s'], summ[shape]['indices'], bw)[0]:.2f} s"
                          for bw in LINKS.values())
        L.append(f"| {shape} | full | bf16, `load_weights` | {mb(t['full_bytes'])} | 1.0x | — | "
                 f"{ms(t['full_load_s'])} | — | {full} |")
        for e in ENCODINGS:
            s = summ[shape][e]
            cells = " | ".join("{1:.2f} s ({2})".format(*(lambda f, d: (f, d, faster(f, d)))(
                *modeled(t["full_bytes"], t["full_load_s"], s, bw))) for bw in LINKS.values())
            L.append(f"| {shape} | `{e}` | {TRANSPORT[e]} | {mb(s['wire'])} | {t['full_bytes'] / s['wire']:.1f}x "
                     f"smaller | {ms(s['encode'] + s['serialize'])} | {ms(s['apply'])} | "
                     f"{faster(t['full_load_s'], s['apply'])} | {cells} |")
    L += ["", "## Bytes per changed element", "",
          "| shape | step | density | " + " | ".join(f"`{e}`" for e in ENCODINGS) + " | whole-tensor XOR, zstd-1 |",
          "|---|---:|---:|" + "---:|" * (len(ENCODINGS) + 1)]
    for shape, t, _ in runs:
        for s in t["steps"]:
            L.append(f"| {shape} | {s['step']} | {s['density']:.2%} | "
                     + " | ".join(f"{s['enc'][e]['wire_bytes'] / s['nnz']:.2f}" for e in ENCODINGS)
                     + f" | {s['whole_tensor_xor_bytes'] / s['nnz']:.2f} |")
    L += ["", "## Cost per tensor", "",
          "Per encoding, mean over the steps: the sender's and the engine's time divided by the model's tensor count, "
          "and the host synchronizations of one apply (counted in the memory run). The second table takes the "
          "per-element work out (last step, `deltas`; medians): the sender on the model's tensors against the same "
          "bytes in few tensors, and the engine applying a sync that changes one element of every tensor.", "",
          "| shape | encoding | tensors named per sync | sender µs / tensor | engine µs / tensor | "
          "host syncs per apply |",
          "|---|---|---:|---:|---:|---:|"]
    for shape, t, _ in runs:
        for e in ENCODINGS:
            s = summ[shape][e]
            L.append(f"| {shape} | `{e}` | {s['tensors_sent']:,.0f} | "
                     f"{1e6 * (s['encode'] + s['serialize']) / t['tensors']:,.1f} | "
                     f"{1e6 * s['apply'] / t['tensors']:,.1f} | {s['host_syncs']} |")
    L += ["", "| shape | sender µs per tensor, per-element work out | engine µs per tensor, one element each | "
          "full sync through the wire vs plain `load_weights` |", "|---|---:|---:|---:|"]
    for shape, t, _ in runs:
        o = t["overhead"]
        per = 1e6 * (o["sender_s"] - o["sender_pieces_s"]) / (o["tensors"] - o["pieces"])
        L.append(f"| {shape} | {per:.1f} | {1e6 * o['engine_s'] / o['tensors']:.1f} | "
                 f"{t['full_wire_s'] / t['full_load_s']:.1f}x |")
    L += ["", "## Peak extra memory", "",
          "Peak RSS above the baseline before each phase, in the memory run (see [benchmarks.md](benchmarks.md)).", "",
          "| side | what | " + " | ".join(shape for shape, _, _ in runs) + " |",
          "|---|---|" + "---:|" * len(runs),
          "| sender | snapshot of the last acknowledged version | "
          + " | ".join(mib(t["full_bytes"]) for _, t, _ in runs) + " |"]
    for e in ENCODINGS:
        L.append(f"| sender | one sync, `{e}` | " + " | ".join(mib(summ[s][e]["encode_mem"]) for s, _, _ in runs)
                 + " |")
    L.append("| engine | full `load_weights` (upstream) | " + " | ".join(mib(m["full_load_mem"]) for _, _, m in runs)
             + " |")
    for e in ENCODINGS:
        L.append(f"| engine | apply one sync, `{e}` ({TRANSPORT[e]}) | "
                 + " | ".join(mib(summ[s][e]["apply_mem"]) for s, _, _ in runs) + " |")
    L.append("| engine | weight fingerprint (all params) | "
             + " | ".join(mib(m["fingerprint_engine_mem"]) for _, _, m in runs) + " |")
    L += ["", "## Fingerprint (the periodic bit-identity check)", ""]
    for shape, t, _ in runs:
        L.append(f"- **{shape}**: engine side over all params {ms(t['fingerprint_engine_s'])} ms "
                 f"({t['fingerprint_engine_s'] / t['full_load_s']:.1f}x a full `load_weights`); trainer side "
                 f"{ms(t['fingerprint_trainer_s'])} ms.")
    L += ["", "## Method", "", "```"]
    L += [f"make bench BENCH_ARGS='--shape {shape} --steps {len(t['steps'])}'" for shape, t, _ in runs]
    L += ["```", "",
          "The states come from a transformers `Qwen3MoeForCausalLM` with each shape's layer and expert counts (HF "
          "init, seed 1), trained with `torch.optim.AdamW(lr=1e-6, weight_decay=0)` on fp32 master weights; each "
          "step's bf16 cast is what the trainer ships. The engine is SGLang's own Qwen3-MoE class (patched tree, "
          "CPU, bf16). `scripts/bench_coding.py` adds each shape's encodings side by side below.", ""]
    return "\n".join(L)


def write(workdir: str, out: str) -> str:
    """Rebuild the page from every measured topology shape, keeping the other scripts' marked sections."""
    path = os.path.join(out, PAGE)
    old = open(path).read() if os.path.exists(path) else ""
    text = report(measured(workdir))
    kept = [m.group(0) for m in SECTION.finditer(old)]
    write_page(path, text.rstrip("\n") + "\n" + "".join("\n" + k + "\n" for k in kept))
    return text
