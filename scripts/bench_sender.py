"""Sender benchmark: diff + encode throughput as a ratio to a plain memory copy of the same bytes, and wire bytes.

One real AdamW step (lr 1e-6, fp32 master weights) on a Llama-shaped model gives the bf16 states
before and after; the sender core (``DeltaState.positions`` + ``DeltaBucket`` encode, no transport)
runs over them and is timed against ``torch.clone`` of the same tensors, in the same process.

    python scripts/bench_sender.py [--hidden 512 --layers 8 --vocab 32000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_harness import hf_config, rl_states  # noqa: E402

from sglang.srt.weight_sync.delta.sender import DeltaBucket, DeltaState  # noqa: E402
from sglang.srt.weight_sync.delta.wire import changed_positions  # noqa: E402


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = hf_config("llama", vocab=args.vocab, hidden=args.hidden, layers=args.layers)
    old, new = rl_states(cfg, 1, seed=0, batch=1, seq=16)
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    n = sum(t.numel() for t in new.values())
    state = DeltaState(torch.device("cpu"))
    state.snapshot = old

    t_copy = best_of(lambda: [t.clone() for t in new.values()], args.repeats)
    t_ne = best_of(lambda: [torch.nonzero(old[k].view(torch.int16) != new[k].view(torch.int16)) for k in new], args.repeats)
    t_diff = best_of(lambda: [changed_positions(old[k], new[k]) for k in new], args.repeats)
    nnz = sum(changed_positions(old[k], new[k]).numel() for k in new)
    print(f"model: Llama-shaped, {n / 1e6:.1f}M params, {nbytes / 2**20:.0f} MiB bf16; density {nnz / n:.2%}")
    print(f"{'phase':<44} {'ms':>7} {'GB/s':>7} {'vs memcpy':>10}")
    row = lambda name, t: print(f"{name:<44} {1e3 * t:>7.1f} {nbytes / t / 1e9:>7.2f} {t_copy / t:>9.2f}x")  # noqa: E731
    row("memory copy (torch.clone)", t_copy)
    row("naive diff: torch.ne + nonzero", t_ne)
    row("diff: changed_positions (bytewise)", t_diff)
    sizes = {}
    for encoding in ("indices", "deltas"):
        def run():
            bucket = DeltaBucket(encoding, 1 << 62)
            for k, t in new.items():
                bucket.add(k, t, state.positions(k, t, old[k]))
            sizes[encoding] = sum(p.positions.numel() + p.values.numel() * 2 for p in bucket.take(version=2, base_version=1))
        row(f"diff + encode ({encoding}, checksum incl.)", best_of(run, args.repeats))
    import zstandard

    bucket = DeltaBucket("deltas", 1 << 62)
    for k, t in new.items():
        bucket.add(k, t, state.positions(k, t, old[k]))
    from sglang.srt.weight_sync.delta.wire import write_safetensors

    pl = bucket.take(version=2, base_version=1)[0]
    sizes["deltas_zstd"] = len(zstandard.ZstdCompressor(level=1).compress(write_safetensors(pl.spec, pl.positions, pl.values)))
    print(f"\nwire bytes at {nnz / n:.2%} density (full bf16 = {nbytes / 1e6:.1f} MB):")
    for enc, size in sizes.items():
        print(f"  {enc:<12} {size / 1e6:8.2f} MB  {nbytes / size:6.1f}x smaller")


if __name__ == "__main__":
    main()
