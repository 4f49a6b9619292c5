"""CPU demo: a real patched SGLang server follows a training loop through delta syncs, bit-identically.

Trains a small Llama-shaped model (fp32 master weights, AdamW at an RL learning rate, real
forward/backward on random tokens), and after every step ships only the changed bf16 elements to
the server with the delta sender core — over disk files (default) or a gloo weight-update group —
then reads the engine's weights back and checks they equal the trainer's, bit for bit. Columns:
``encode ms`` is slime's ``delta_encode`` (diff + encode + send; over nccl it includes each flush's
apply), ``finalize ms`` its ``delta_finalize`` (waiting for the engine's last apply).

    python scripts/demo.py --workdir build/demo [--steps 5] [--transport disk|nccl] [--encoding deltas_zstd]
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
    engine_mismatch,
    hf_config,
    hf_model,
    join_update_group,
    rl_steps,
    segments,
    write_hf_checkpoint,
)

from sglang.srt.weight_sync.delta.sender import DeltaSender  # noqa: E402
from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine, NcclTransport  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="build/demo")
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 5)))
    ap.add_argument("--transport", choices=["disk", "nccl"], default=os.environ.get("TRANSPORT", "disk"))
    ap.add_argument("--encoding", choices=["indices", "deltas", "deltas_zstd"], default=os.environ.get("ENCODING") or None)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    encoding = args.encoding or ("deltas_zstd" if args.transport == "disk" else "indices")
    if args.transport == "nccl" and encoding == "deltas_zstd":
        raise SystemExit("deltas_zstd compresses files: it is disk-only (use indices or deltas with nccl)")
    os.makedirs(args.workdir, exist_ok=True)
    import sglang

    cfg = hf_config("llama", vocab=2048, hidden=512, layers=4)
    model = hf_model(cfg, seed=1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama-shaped, {n_params / 1e6:.1f}M params; SGLang {sglang.__version__}; "
          f"transport {args.transport}; encoding {encoding}")
    steps = rl_steps(model, args.steps, lr=args.lr)
    boot = write_hf_checkpoint(os.path.join(args.workdir, "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    t0 = time.time()
    server = Server(boot, os.path.join(args.workdir, "server.log")).wait_healthy()
    print(f"patched SGLang server up in {time.time() - t0:.0f}s (pid {server.proc.pid}); log {server.log.name}")
    try:
        engine = HttpEngine(server.url)
        if args.transport == "nccl":
            transport = NcclTransport(join_update_group(server, "demo"), "demo", [engine])
        else:
            transport = DiskTransport(os.path.join(args.workdir, "shared"), [engine], zstd=encoding == "deltas_zstd")
        sender = DeltaSender(transport, [engine], encoding=encoding, buffer_bytes=64 << 20)
        state = bf16_state(model)
        full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        print(f"{'step':>4} {'ver':>4} {'density':>8} {'wire bytes':>11} {'vs full':>8} {'encode ms':>9} "
              f"{'finalize ms':>11} {'identical':>9}")
        ok, step = True, 0
        while True:
            results = sender.update(segments(state))
            m = sender.pop_metrics()
            same = results[0][0] and engine_mismatch(server, state) is None
            ok &= same
            wire = m["perf/update_weights_wire_bytes"]
            print(f"{step if step else 'full':>4} {sender.version:>4} {m['perf/update_weights_density']:>8.2%} "
                  f"{int(wire):>11,} {full_bytes / wire:>7.1f}x {1e3 * m['perf/update_weights_encode_s']:>9.0f} "
                  f"{1e3 * m['perf/update_weights_finalize_s']:>11.0f} {str(same):>9}")
            if not results[0][0]:
                print(f"engine refused: {results[0][1]}")
            if step == args.steps:
                break
            step += 1
            state = next(steps)
        transport.close()
        print("all steps bit-identical" if ok else "MISMATCH")
        return 0 if ok else 1
    finally:
        server.stop()
        print(f"server stopped (pid {server.proc.pid})")


if __name__ == "__main__":
    sys.exit(main())
