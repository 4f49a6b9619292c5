"""Receiver benchmark: delta apply and the weight fingerprint vs a full ``load_weights`` of the same SGLang model.

A Llama-shaped model (~70M params, bf16) takes one real AdamW step at lr 1e-6 from fp32 master
weights; the delta between the two bf16 states is applied through the receiver's shared path
(``_apply_delta_payload``: validate, densify, masked ``load_weights``) and compared with
upstream's full ``model.load_weights`` of the new state. Times are medians of repeats; the extra
memory is the peak process RSS above the pre-apply baseline, sampled every millisecond by a
thread, in a second run of this script with ``MALLOC_MMAP_THRESHOLD_=65536``: every tensor buffer
is then its own mapping, returned to the OS when freed, so RSS follows live tensors (that run's
times are inflated by page faults and are not shown).

    python scripts/bench_receiver.py [--hidden 512 --layers 8 --vocab 32000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_harness import Host, delta_flushes, full_flushes, hf_config, rl_states, sglang_model  # noqa: E402


class PeakRSS:
    """Peak RSS above the baseline while the block runs (1 ms sampling)."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = False
        self.t = threading.Thread(target=self._sample, daemon=True)
        self.t.start()
        return self

    def _sample(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.extra = self.peak - self.base


def timed(fn, repeats, prepare=lambda: ()):
    """Median time and max peak extra RSS of ``fn(*prepare())``; ``prepare`` runs outside the measurement."""
    times, extras = [], []
    for _ in range(repeats):
        args = prepare()
        with PeakRSS() as m:
            t = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t)
        extras.append(m.extra)
        del args
    return statistics.median(times), max(extras)


def main():
    memory_run = os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None  # see the module docstring
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = hf_config("llama", vocab=args.vocab, hidden=args.hidden, layers=args.layers)
    old, new = rl_states(cfg, 1, seed=0, batch=1, seq=16)
    n = sum(t.numel() for t in new.values())
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    nnz = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in new)
    print(f"model: Llama-shaped, {n / 1e6:.1f}M params, {nbytes / 2**20:.0f} MiB bf16; one AdamW step at lr 1e-6 "
          f"changed {nnz / n:.2%} of elements")

    model = sglang_model(cfg)
    items = list(new.items())
    t_full, m_full = timed(lambda: model.load_weights(items), args.repeats)
    row = (lambda name, t, m: print(f"{name:<40} {m / 2**20:>15.1f}")) if memory_run else \
        (lambda name, t, m: print(f"{name:<40} {1e3 * t:>8.0f} {t / t_full:>7.2f}x"))
    print(f"{'path':<40} {'peak extra MiB':>15}" if memory_run else f"{'path':<40} {'time ms':>8} {'vs full':>8}")
    row("full load_weights (upstream)", t_full, m_full)
    version = [0]

    for encoding in ("indices", "deltas"):
        for cap_mib in (512, 32):
            host = Host(model, chunk_bytes=cap_mib << 20)
            version[0] += 1
            at = old if version[0] % 2 else new  # the engine alternates old -> new -> old ...
            ok, msg = host.call("_apply_delta_payload", full_flushes(at, version=version[0]))
            assert ok, msg

            def prepare():
                version[0] += 1
                a, b = (old, new) if version[0] % 2 == 0 else (new, old)
                return (delta_flushes(a, b, encoding, version=version[0], base_version=version[0] - 1),)

            def apply(payloads):
                ok, msg = host.call("_apply_delta_payload", payloads)
                assert ok, msg

            t, m = timed(apply, args.repeats, prepare)
            row(f"delta apply {encoding} (chunk cap {cap_mib} MiB)", t, m)
    from sglang.srt.weight_sync.delta import fingerprint
    from sglang.srt.weight_sync.delta.receiver import fingerprint_payload

    t, m = timed(lambda: fingerprint_payload(model), args.repeats)
    row("fingerprint, engine side (all params)", t, m)
    t, m = timed(lambda: [fingerprint.tensor_fingerprint(k, v) for k, v in new.items()], args.repeats)
    row("fingerprint, trainer side (all params)", t, m)
    if not memory_run:
        print("time: median of repeats; delta apply = validate + densify + masked load_weights (encode is sender-side)")
        sys.stdout.flush()
        import subprocess

        subprocess.run([sys.executable] + sys.argv, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"), check=True)
    else:
        print("peak extra: max sampled RSS above the pre-apply baseline")


if __name__ == "__main__":
    main()
