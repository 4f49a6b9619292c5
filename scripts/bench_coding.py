"""The encodings side by side on the same states (``make bench`` runs it after ``bench.py``): bytes per changed
element, encode and decode time, and the modeled sync time at 1 and 10 Gbit/s, for ours (``xor_ctx``, ``xor_zstd``,
``deltas_zstd``, through the code the CLI and the engines run), slime's own ``xor`` and ``overwrite`` and the
published formats rebuilt from their descriptions; beside them the entropy floors of the change, computed here.
Writes the "The encodings side by side" section of docs/benchmarks.md (a ``*-topology`` shape: of its own page).
One process, one run, CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_pages import section_heading, section_marks  # noqa: E402  (beside this script)

LINKS = {"1 Gbit/s": 1e9 / 8, "10 Gbit/s": 10e9 / 8}


def _zstd1(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=1).compress(data)


def _unzstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(data)


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from sglang.srt.weight_sync.delta.diff import changed_positions

    return changed_positions(a, b)


def ours(encoding: str, old: dict, new: dict):
    """(bytes, encode s, decode s) of one sync's flushes (one per dtype) through the CLI's and engines' code."""
    from sglang.srt.weight_sync.delta.diff import encode_flush
    from sglang.srt.weight_sync.delta.files import flush_file, maybe_zstd_decompress, read_safetensors
    from sglang.srt.weight_sync.delta.validate import uncode, unxor, validate_payload
    from sglang.srt.weight_sync.delta.wire import zstd_level

    t0 = time.perf_counter()
    files = []
    by_dtype = {}
    for n, b in new.items():
        by_dtype.setdefault(b.dtype, []).append(n)
    for names in by_dtype.values():
        entries = [(n, new[n], _changed(old[n], new[n])) for n in names]
        entries = [e for e in entries if e[2].numel()]
        bases = None
        if encoding == "xor_zstd":
            bases = [old[n].reshape(-1)[i] for n, _, i in entries]
        elif encoding == "xor_ctx":
            bases = [old[n] for n, _, _ in entries]
        files.append(flush_file(encode_flush(entries, encoding, bases=bases, version=1, base_version=0),
                                zstd_level(encoding)))
    enc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for data in files:
        pl = read_safetensors(maybe_zstd_decompress(data, 1 << 40))
        names = [p.name for p in pl.spec.params]
        if pl.coded:
            pl = uncode(pl, None, lambda pieces: torch.cat([old[names[k]].reshape(-1)[a:a + m] for k, a, m in pieces]))
        elif pl.xored:
            pl = unxor(pl, None, lambda ps, ix: torch.cat([old[p.name].reshape(-1)[i] for p, i in zip(ps, ix)]))
        validate_payload(pl, None)
    return sum(map(len, files)), enc_s, time.perf_counter() - t0


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def slime_xor(old: dict, new: dict):
    """slime's ``xor``: per tensor, zstd-1 of the whole tensor's bytes XOR the snapshot's."""
    t0 = time.perf_counter()
    blobs = {n: _zstd1(torch.bitwise_xor(_bytes_of(old[n]), _bytes_of(b)).numpy().tobytes()) for n, b in new.items()}
    enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for n, z in blobs.items():
        torch.bitwise_xor(_bytes_of(old[n]), torch.frombuffer(bytearray(_unzstd(z)), dtype=torch.uint8))
    return sum(map(len, blobs.values())), enc, time.perf_counter() - t0


def slime_overwrite(old: dict, new: dict):
    """slime's ``overwrite``: per tensor, zstd-1 of (u32 count, u32 changed byte positions, the new bytes)."""
    t0 = time.perf_counter()
    blobs = {}
    for n, b in new.items():
        nb, ob = _bytes_of(b), _bytes_of(old[n])
        pos = torch.nonzero(nb != ob)[:, 0].to(torch.int32)
        if pos.numel():
            blobs[n] = _zstd1(torch.tensor([pos.numel()], dtype=torch.int32).numpy().tobytes()
                              + pos.numpy().tobytes() + nb[pos.long()].numpy().tobytes())
    enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for n, z in blobs.items():
        raw = torch.frombuffer(bytearray(_unzstd(z)), dtype=torch.uint8)
        k = int(raw[:4].view(torch.int32))
        out = _bytes_of(old[n]).clone()
        out[raw[4:4 + 4 * k].view(torch.int32).long()] = raw[4 + 4 * k:]
    return sum(map(len, blobs.values())), enc, time.perf_counter() - t0


def coo(old: dict, new: dict, index: str):
    """Index + raw value formats: ``pulse`` (gaps as uint8, or uint16/uint32 where they do not fit, + raw values,
    zstd-1 per tensor), ``int32`` (TRL's and verl's layout: int32 flat index + raw values, uncompressed)."""
    t0 = time.perf_counter()
    blobs = {}
    for n, b in new.items():
        idx = _changed(old[n], b)
        if not idx.numel():
            continue
        vals = b.reshape(-1)[idx].contiguous().view(torch.uint8).numpy().tobytes()
        if index == "pulse":
            gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1
            top = int(gaps.max())
            dt = torch.uint8 if top < 256 else torch.int16 if top < 32768 else torch.int32
            blobs[n] = (dt, idx.numel(), _zstd1(gaps.to(dt).numpy().tobytes() + vals))
        else:
            blobs[n] = (torch.int32, idx.numel(), idx.to(torch.int32).numpy().tobytes() + vals)
    enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for n, (dt, k, blob) in blobs.items():
        out = old[n].reshape(-1).clone()
        raw = torch.frombuffer(bytearray(_unzstd(blob) if index == "pulse" else blob), dtype=torch.uint8)
        w = k * torch.empty((), dtype=dt).element_size()
        ints = raw[:w].view(dt).long()
        idx = torch.cumsum(ints + 1, 0) - 1 if index == "pulse" else ints
        out[idx] = raw[w:].clone().view(out.dtype)
    return sum(len(b) for _, _, b in blobs.values()), enc, time.perf_counter() - t0


def _h(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(1e-300, 1 - 1e-16)
    return -(p * torch.log2(p) + (1 - p) * torch.log2(1 - p))


def _entropy_bits(counts: torch.Tensor) -> float:
    counts = counts[counts > 0].double()
    return float(-(counts * torch.log2(counts / counts.sum())).sum())


def floors(old: dict, new: dict) -> dict:
    """Bytes per changed element of the change's entropy: order-0 (the mask as independent bits at the overall
    density, the XOR values as 16-bit symbols) and given the base (the mask per param and base exponent, the ULP
    steps per base exponent). bf16 params only."""
    n_all = changed = 0
    mask_ctx = 0.0
    xors, steps = [], []
    for n, b in new.items():
        if b.dtype != torch.bfloat16:
            continue
        a = old[n].reshape(-1).view(torch.int16).to(torch.int32) & 0xFFFF
        c = b.reshape(-1).view(torch.int16).to(torch.int32) & 0xFFFF
        m = a != c
        n_all += m.numel()
        changed += int(m.sum())
        e = (a >> 7) & 0xFF
        size = torch.bincount(e, minlength=256).double()
        hit = torch.bincount(e[m], minlength=256).double()
        mask_ctx += float((size * _h(hit / size.clamp(min=1))).sum())
        xors.append(a[m] ^ c[m])
        key = lambda x: torch.where(x >= 0x8000, -(x & 0x7FFF) - 1, x)  # noqa: E731
        steps.append((key(c[m]) - key(a[m])) * 256 + e[m])  # the step, with its base exponent beside it
    xor, step = torch.cat(xors), torch.cat(steps)
    mask0 = n_all * float(_h(torch.tensor(changed / n_all, dtype=torch.float64)))
    val0 = _entropy_bits(torch.bincount(xor, minlength=1 << 16))
    _, joint = torch.unique(step, return_counts=True)
    ctx_bits = _entropy_bits(joint) - _entropy_bits(torch.bincount(step % 256, minlength=256))  # H(step | exponent)
    return {"order0": (mask0 + val0) / 8 / changed, "mask0": mask0 / 8 / changed, "xor0": val0 / 8 / changed,
            "given_base": (mask_ctx + ctx_bits) / 8 / changed, "mask_ctx": mask_ctx / 8 / changed,
            "step_ctx": ctx_bits / 8 / changed, "changed": changed, "elements": n_all}


FORMATS = [  # (row label, how it is made)
    ("`xor_ctx` (ours)", lambda o, n: ours("xor_ctx", o, n)),
    ("`xor_zstd` (ours)", lambda o, n: ours("xor_zstd", o, n)),
    ("`deltas_zstd` (ours)", lambda o, n: ours("deltas_zstd", o, n)),
    ("slime `xor` (whole-tensor XOR, zstd-1)", slime_xor),
    ("slime `overwrite` (u32 byte positions + bytes, zstd-1)", slime_overwrite),
    ("PULSE / grail (uint8/uint16 COO gaps + raw bf16, zstd-1)", lambda o, n: coo(o, n, "pulse")),
    ("TRL, verl `delta_sharded` (int32 index + raw bf16)", lambda o, n: coo(o, n, "int32")),
]


def measure(paths) -> dict:
    from safetensors.torch import load_file

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = {"steps": [], "formats": {label: [] for label, _ in FORMATS}}
    prev = load_file(paths[0])
    for k, path in enumerate(paths[1:], start=1):
        cur = load_file(path)
        f = floors(prev, cur)
        out["steps"].append(f)
        for label, fn in FORMATS:
            size, enc, dec = fn(prev, cur)
            out["formats"][label].append({"bytes": size, "encode_s": enc, "decode_s": dec})
            print(f"step {k}: {label}: {size / f['changed']:.3f} B/changed, encode {enc:.2f} s, decode {dec:.2f} s",
                  flush=True)
        prev = cur
    return out


def report(m: dict, shape: str) -> str:
    steps = m["steps"]
    changed = sum(s["changed"] for s in steps)
    density = changed / sum(s["elements"] for s in steps)

    def mean(key):
        return sum(s[key] * s["changed"] for s in steps) / changed

    ref = sum(r["bytes"] for r in m["formats"]["`xor_zstd` (ours)"])
    begin, end = section_marks("bench-coding", shape)
    lines = [begin, section_heading("The encodings side by side", shape), "", textwrap.fill(
             f"Written by `make bench` (`scripts/bench_coding.py`) on the same {len(steps) + 1} states: {len(steps)} "
             f"AdamW steps at lr 1e-6, {100 * density:.2f}% of the bf16 elements changed on average. Ours run "
             "through the code the CLI and the engines run (the decode includes every check and the checksum); "
             "slime's formats and the published ones are rebuilt here from their descriptions (slime's from its "
             "source at the pin). Times: one run on this CPU, all steps together; modeled sync time = encode + "
             "bytes over the link + decode, one engine. The floors are the change's entropy, computed here.", 120), "",
             "| format | B per changed element | vs `xor_zstd` | encode s | decode s | "
             + " | ".join(f"sync s at {k}" for k in LINKS) + " |",
             "|---|---|---|---|---|" + "---|" * len(LINKS)]
    for label, rows in m["formats"].items():
        size = sum(r["bytes"] for r in rows)
        enc, dec = sum(r["encode_s"] for r in rows), sum(r["decode_s"] for r in rows)
        modeled = " | ".join(f"{enc + size / bw + dec:,.2f}" for bw in LINKS.values())
        lines.append(f"| {label} | {size / changed:.3f} | {size / ref:.2f}x | {enc:,.2f} | {dec:,.2f} | {modeled} |")
    lines.append(f"| floor, order-0 (mask {mean('mask0'):.3f} + XOR values {mean('xor0'):.3f}) | "
                 f"{mean('order0'):.3f} | {mean('order0') * changed / ref:.2f}x | | |" + " |" * len(LINKS))
    lines.append(f"| floor, given the base (mask per param and exponent {mean('mask_ctx'):.3f} + ULP steps per "
                 f"exponent {mean('step_ctx'):.3f}) | {mean('given_base'):.3f} | "
                 f"{mean('given_base') * changed / ref:.2f}x | | |" + " |" * len(LINKS))
    def total(label):
        rows = m["formats"][label]
        return sum(r["bytes"] for r in rows), sum(r["encode_s"] + r["decode_s"] for r in rows)

    (ctx_b, ctx_s), (xor_b, xor_s) = total("`xor_ctx` (ours)"), total("`xor_zstd` (ours)")
    link = (xor_b - ctx_b) / (ctx_s - xor_s) if ctx_s > xor_s else float("inf")
    lines += ["", textwrap.fill(
        f"Here `xor_ctx` beats `xor_zstd` on links slower than {link * 8 / 1e6:,.1f} Mbit/s (the bytes it saves over "
        "the time it adds). Its encode and decode include a pass over the base of every changed segment (its "
        "classes, a stable sort by class): O(model) work, here on this CPU's two cores; on a GPU it is a few "
        "elementwise kernels and a radix sort per segment (`make gpu-check` times it; not run yet). Its bytes do not "
        "depend on the device.", 120), end]
    return "\n".join(lines)


def main():
    from bench import doc_name, train_states
    from bench_store import with_section

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--out", default="docs")
    args, _ = ap.parse_known_args()  # make bench passes BENCH_ARGS to every script
    workdir = os.path.join(args.workdir, args.shape)
    m = measure(train_states(args.shape, args.steps, workdir))
    json.dump(m, open(os.path.join(workdir, "coding.json"), "w"), indent=1)
    text = report(m, args.shape)
    with_section(os.path.join(args.out, doc_name(args.shape, "md")), text, *section_marks("bench-coding", args.shape))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
