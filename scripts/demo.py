"""CPU demo: a real patched SGLang server follows an RL-like training loop through delta syncs, bit-identically.

Trains a Qwen3-shaped model (tens of millions of parameters, fp32 master weights, AdamW at an RL
learning rate, real forward/backward on random tokens; offline tokenizer, no downloads) and after
every step ships only the changed bf16 elements to a patched SGLang server on CPU with the delta
sender core — over disk files (default) or a gloo weight-update group (``--transport nccl``: the
same ``torch.distributed`` code path as NCCL). Per step it shows density, wire bytes and their ratio
to a full sync, the sender's encode time, the transfer and the engine's apply time, the weight
versions, and whether the engine is bit-identical (the engine's weight fingerprint, computed through
its own loader's views, against the trainer's). At RL learning rates greedy answers rarely change, so it also
shows the log-probabilities of a fixed continuation before and after training, equal to those of a
second server that loads the final weights in full. It writes a PNG plot, stops its servers by PID
and leaves nothing running.

    python scripts/demo.py --workdir build/demo [--steps 5] [--transport disk|nccl] [--encoding xor_zstd]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_harness import (  # noqa: E402
    Server,
    bf16_state,
    hf_config,
    hf_model,
    join_update_group,
    rl_steps,
    segments,
    write_hf_checkpoint,
)

from sglang.srt.weight_sync.delta.sender import DeltaSender  # noqa: E402
from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine, NcclTransport  # noqa: E402
from sglang.srt.weight_sync.delta.diff import changed_positions, encode_flush
from sglang.srt.weight_sync.delta.files import flush_file, write_safetensors
from sglang.srt.weight_sync.delta.wire import DeltaEncoding, zstd_level

ENCODINGS = [e.value for e in DeltaEncoding]

PROMPT = "the quick brown fox jumps over the lazy dog"
CONTINUATION = " one two three four five"


def continuation_logprob(server, tokenizer) -> float:
    """Sum of the engine's log-probabilities of CONTINUATION after PROMPT (one prefill, no sampling)."""
    prompt = tokenizer(PROMPT)["input_ids"]
    ids = prompt + tokenizer(CONTINUATION)["input_ids"]
    r = server.post("/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
                                  "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    r.raise_for_status()
    logprobs = [lp for lp, _, _ in r.json()["meta_info"]["input_token_logprobs"] if lp is not None]
    return float(sum(logprobs[-(len(ids) - len(prompt)):]))


def projected_wire(old, new) -> dict:
    """Bytes each encoding would put on the wire for this step (one flush per dtype, as the sender groups them)."""
    import zstandard

    out = {e: 0 for e in ENCODINGS}
    by_dtype = {}
    for n, t in new.items():
        by_dtype.setdefault(t.dtype, []).append((n, t, changed_positions(old[n], t)))
    for entries in by_dtype.values():
        entries = [e for e in entries if e[2].numel()]
        for enc in ("indices", "deltas"):
            pl = encode_flush(entries, enc)
            data = write_safetensors(pl.spec, pl.positions, pl.values)
            out[enc] += len(data)
            if enc == "deltas":
                out["deltas_zstd"] += len(zstandard.ZstdCompressor(level=zstd_level("deltas_zstd")).compress(data))
        out["planes_zstd"] += len(flush_file(encode_flush(entries, "planes_zstd"), zstd_level("planes_zstd")))
        bases = [old[n].reshape(-1)[i] for n, _, i in entries]
        out["xor_zstd"] += len(flush_file(encode_flush(entries, "xor_zstd", bases=bases), zstd_level("xor_zstd")))
        wholes = [old[n] for n, _, _ in entries]
        out["xor_ctx"] += len(flush_file(encode_flush(entries, "xor_ctx", bases=wholes), zstd_level("xor_ctx")))
    return out


def plot(rows, full_bytes, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    from matplotlib.ticker import MaxNLocator

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.plot(steps, [100 * r["density"] for r in rows], marker="o")
    a.set_xlabel("training step")
    a.set_ylabel("changed bf16 elements (%)")
    a.set_title("density per step")
    for enc in ENCODINGS:
        b.plot(steps, [r["projected"][enc] / 1e6 for r in rows], marker="o", label=enc)
    b.axhline(full_bytes / 1e6, color="gray", linestyle="--", label="full sync (bf16)")
    b.set_yscale("log")
    b.set_xlabel("training step")
    b.set_ylabel("wire MB (log)")
    b.set_title("wire bytes per step, per encoding")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="build/demo")
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 5)))
    ap.add_argument("--transport", choices=["disk", "nccl"], default=os.environ.get("TRANSPORT", "disk"))
    ap.add_argument("--encoding", choices=ENCODINGS, default=os.environ.get("ENCODING") or None)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    args = ap.parse_args()
    encoding = args.encoding or ("xor_zstd" if args.transport == "disk" else "deltas")  # what the docs name
    if args.transport == "nccl" and DeltaEncoding(encoding).disk_only:
        raise SystemExit(f"{encoding} compresses files: it is disk-only (use indices or deltas with nccl)")
    os.makedirs(args.workdir, exist_ok=True)
    import sglang
    from tqdm import tqdm
    from transformers import AutoTokenizer

    cfg = hf_config("qwen3", vocab=args.vocab, hidden=args.hidden, layers=args.layers)
    model = hf_model(cfg, seed=1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3-shaped, {n_params / 1e6:.1f}M params; SGLang {sglang.__version__}; "
          f"transport {args.transport}; encoding {encoding}; {args.steps} steps")
    boot = write_hf_checkpoint(os.path.join(args.workdir, "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    tokenizer = AutoTokenizer.from_pretrained(boot)
    t0 = time.time()
    server = Server(boot, os.path.join(args.workdir, "server.log")).wait_healthy()
    print(f"patched SGLang server up in {time.time() - t0:.0f}s (pid {server.proc.pid}); log {server.log.name}")
    second = None
    try:
        engine = HttpEngine(server.url)
        if args.transport == "nccl":
            transport = NcclTransport(join_update_group(server, "demo"), "demo", [engine])
        else:
            transport = DiskTransport(os.path.join(args.workdir, "shared"), [engine], zstd=zstd_level(encoding))
        sender = DeltaSender(transport, [engine], encoding=encoding, buffer_bytes=64 << 20, fingerprint_every=1)
        state = bf16_state(model)
        full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        steps = rl_steps(model, args.steps, lr=args.lr)
        header = (f"{'step':>4} {'ver':>4} {'density':>8} {'wire bytes':>12} {'vs full':>8} {'encode ms':>9} "
                  f"{'transfer ms':>11} {'apply ms':>8} {'identical':>10}")
        rows, ok, prev, logprob_before = [], True, None, None
        bar = tqdm(total=args.steps + 1, desc="sync", unit="sync", file=sys.stderr, leave=False,
                   disable=not sys.stderr.isatty())  # progress for a terminal only: `make demo > file` keeps the table
        for step in range(args.steps + 1):
            if step:
                prev, state = state, next(steps)
            results = sender.update(segments(state))
            m = sender.pop_metrics()
            same = (results[0][0] and m["perf/update_weights_fingerprint_mismatches"] == 0
                    and m["perf/update_weights_fingerprint_uncovered"] == 0)
            ok &= same
            wire = m["perf/update_weights_wire_bytes"]
            row = dict(step=step, density=m["perf/update_weights_density"], wire=wire,
                       projected=projected_wire(prev, state) if prev is not None else None)
            if step == 0:
                bar.write(header)
                logprob_before = continuation_logprob(server, tokenizer)
            else:
                rows.append(row)
            bar.write(f"{step if step else 'full':>4} {sender.version:>4} {row['density']:>8.2%} {int(wire):>12,} "
                      f"{full_bytes / wire:>7.1f}x {1e3 * m['perf/update_weights_encode_s']:>9.0f} "
                      f"{1e3 * m.get('perf/update_weights_transfer_s', 0):>11.0f} "
                      f"{1e3 * m.get('perf/update_weights_apply_s', 0):>8.0f} {'yes' if same else 'NO':>10}")
            if not results[0][0]:
                bar.write(f"engine refused: {results[0][1]}")
            bar.update(1)
        bar.close()
        transport.close()
        logprob_after = continuation_logprob(server, tokenizer)
        final = write_hf_checkpoint(os.path.join(args.workdir, "final"), cfg, state)
        second = Server(final, os.path.join(args.workdir, "second.log")).wait_healthy()
        logprob_full = continuation_logprob(second, tokenizer)

        deltas = rows
        if deltas:
            total = int(sum(r["wire"] for r in deltas))
            print(f"\n{len(deltas)} delta syncs: mean density {sum(r['density'] for r in deltas) / len(deltas):.2%}, "
                  f"{total:,} wire bytes vs {full_bytes * len(deltas):,} for full syncs "
                  f"({full_bytes * len(deltas) / total:.1f}x fewer)")
            png = os.path.join(args.workdir, "demo.png")
            plot(deltas, full_bytes, png)
            print(f"plot: {png}")
        print(f"log-probability of {CONTINUATION.strip()!r} after {PROMPT!r}: before training {logprob_before:.6f}, "
              f"after {logprob_after:.6f} (delta-synced engine), {logprob_full:.6f} (second engine, full load)")
        ok &= logprob_after == logprob_full
        print("all steps bit-identical; delta-synced engine equals a full load" if ok else "MISMATCH")
        return 0 if ok else 1
    finally:
        for s in (server, second):
            if s is not None:
                s.stop()
                print(f"server stopped (pid {s.proc.pid})")


if __name__ == "__main__":
    sys.exit(main())
