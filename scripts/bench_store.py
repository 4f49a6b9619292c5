"""The version store, measured (``make bench`` runs it after ``bench.py``, on the same trained states): a late
joiner's catch-up from the store against the full sync the trainer would otherwise send it, the trainer's upload per
sync against the number of engines, and compaction's throughput — on a directory and on a real S3 server
(SeaweedFS). Writes the "The version store" section of docs/benchmarks.md.

Everything runs in one process on the bench's model (SGLang's model class in-process, CPU): the figures are ratios
within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_pages import section_heading, section_marks, write_page  # noqa: E402  (beside this script)



def run(paths, shape: str, workdir: str) -> dict:
    import torch
    from safetensors.torch import load_file

    from bench import model_config
    from cpu_harness import Host, InProcessEngine, sglang_model
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.store.publish import StoreTransport
    from sglang.srt.weight_sync.delta.tools import main as cli
    from sglang.srt.weight_sync.delta.transport import DiskTransport
    from store_server import SeaweedS3

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    states = [load_file(p) for p in paths]
    cfg = model_config(shape)
    full_bytes = sum(t.numel() * t.element_size() for t in states[0].values())

    def engine():
        return InProcessEngine(Host(sglang_model(cfg)))

    def segments(state):
        items = list(state.items())
        return [lambda: [items[k:k + 64] for k in range(0, len(items), 64)]]

    out = {"full_bytes": full_bytes, "versions": len(states), "stores": {}}
    push_dir = os.path.join(workdir, "push")
    os.makedirs(push_dir, exist_ok=True)
    e = engine()
    sender = DeltaSender(DiskTransport(push_dir, [e], zstd=1), [e], encoding="xor_zstd")
    t0 = time.perf_counter()
    assert sender.update(segments(states[-1]))[0][0]  # the full sync a late joiner costs the trainer without a store
    out["full_sync_s"] = time.perf_counter() - t0
    out["full_sync_bytes"] = sender.pop_metrics()["perf/update_weights_wire_bytes"]
    del e, sender
    s3 = SeaweedS3(os.path.join(workdir, "seaweed"))
    try:
        for kind, url in (("posix", os.path.join(workdir, "store")), ("s3", s3.url())):
            if kind == "posix":
                import shutil

                shutil.rmtree(url, ignore_errors=True)
                os.makedirs(url)
            row = {}
            pushed = engine()
            transport = StoreTransport(url, [pushed], zstd=1)
            sender = DeltaSender(transport, [pushed], encoding="xor_zstd", fingerprint_every=len(states) - 1)
            uploads = []
            for v, state in enumerate(states, start=1):
                assert sender.update(segments(state))[0][0]
                uploads.append(transport.upload_bytes)
            row["upload_1"] = uploads[1:]
            late = engine()
            t0 = time.perf_counter()
            ok, msg = late.catch_up(url)
            row["catch_up_s"] = time.perf_counter() - t0
            assert ok and "anchor 1" in msg, msg
            t0 = time.perf_counter()
            assert cli(["store", "compact", url]) == 0
            row["compact_s"] = time.perf_counter() - t0
            out["stores"][kind] = row
            del late, pushed, sender
        # the trainer's upload per sync with 1 engine pushed vs 1 pushed + 3 that catch up from the store
        url = s3.url()
        engines = [engine()]
        transport = StoreTransport(url, engines, zstd=1)
        sender = DeltaSender(transport, engines, encoding="xor_zstd", fingerprint_every=len(states) - 1)
        uploads = []
        for v, state in enumerate(states, start=1):
            if v == 3:
                extra = [engine() for _ in range(3)]  # they join mid-run: the sender tells them to catch up
                transport.close()
                transport = StoreTransport(url, engines + extra, zstd=1)
                sender.attach(transport, engines + extra)
            assert all(ok for ok, _ in sender.update(segments(state)).values())
            uploads.append(transport.upload_bytes)
        out["upload_4"] = uploads[1:]
        out["catch_ups_4"] = 3
    finally:
        s3.stop()
    return out


def report(m: dict, shape: str) -> str:
    mb = 1e6
    begin, end = section_marks("bench-store", shape)
    lines = [begin, section_heading("The version store", shape), "",
             f"Written by `make bench` (`scripts/bench_store.py`) on the same {m['versions']} states (the first a full "
             f"sync of {m['full_bytes'] / mb:.1f} MB, then AdamW steps), `xor_zstd`, in-process SGLang model classes on "
             "CPU, one run. A late joiner catches up to the last version (the anchor, then the chain); without a store "
             "the trainer would send it a full sync.", "",
             "| store | late joiner's catch-up | vs the trainer's full sync to it | trainer upload per delta sync "
             "| compaction (anchor + chain) |",
             "|---|---:|---:|---:|---:|"]
    for kind, row in m["stores"].items():
        up = sum(row["upload_1"]) / len(row["upload_1"])
        lines.append(f"| {kind} | {row['catch_up_s']:.2f} s | {row['catch_up_s'] / m['full_sync_s']:.2f}x "
                     f"({m['full_sync_s']:.2f} s, {m['full_sync_bytes'] / mb:.0f} MB from the trainer) | "
                     f"{up / mb:.2f} MB | {row['compact_s']:.2f} s ({m['full_bytes'] / row['compact_s'] / mb:.0f} MB/s "
                     f"of model) |")
    one, four = m["stores"]["s3"]["upload_1"], m["upload_4"]
    ratio = sum(four) / sum(one)
    lines += ["", f"**Trainer upload per sync against the number of engines** (s3): one engine pushed throughout, "
              f"{sum(one) / len(one) / mb:.2f} MB per delta sync; one pushed plus three that join at version 3 and "
              f"catch up from the store, {sum(four) / len(four) / mb:.2f} MB: **{ratio:.2f}x**. The trainer writes each "
              "version once; engines read it. The catch-up time is the engine reading the anchor (the whole model) and "
              "applying the chain: it does not touch the trainer, and on a GPU host it is bounded by the store's read "
              "bandwidth to that host.", end]
    return "\n".join(lines)


def with_section(path: str, text: str, begin: str, end: str) -> None:
    doc = open(path).read() if os.path.exists(path) else ""
    if begin in doc:
        doc = doc[:doc.index(begin)] + text + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    write_page(path, doc)


def main():
    from bench import doc_name, train_states

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--out", default="docs")
    args, _ = ap.parse_known_args()  # make bench passes BENCH_ARGS to both scripts
    workdir = os.path.join(args.workdir, args.shape)
    m = run(train_states(args.shape, args.steps, workdir), args.shape, os.path.join(workdir, "store-bench"))
    json.dump(m, open(os.path.join(workdir, "store.json"), "w"), indent=1)
    text = report(m, args.shape)
    with_section(os.path.join(args.out, doc_name(args.shape, "md")), text, *section_marks("bench-store", args.shape))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
