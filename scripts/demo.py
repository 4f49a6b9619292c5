"""CPU demo: a real patched SGLang server follows a training loop through delta syncs, bit-identically.

Trains a small Llama-shaped model (fp32 master weights, AdamW at an RL learning rate, real
forward/backward on random tokens), and after every step ships only the changed bf16 elements to
the server — over disk files (default) or a gloo weight-update group — then reads the engine's
weights back and checks they equal the trainer's, bit for bit.

    python scripts/demo.py --workdir build/demo [--steps 5] [--transport disk|nccl] [--encoding deltas_zstd]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_harness import (  # noqa: E402
    Server,
    bf16_state,
    delta_flushes,
    free_port,
    full_flushes,
    hf_config,
    hf_model,
    rl_steps,
    write_hf_checkpoint,
)

from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES, dtype_to_str, write_safetensors  # noqa: E402


def publish_disk(server, root, payloads, zstd):
    wire = 0
    for pl in payloads:
        vdir = os.path.join(root, f"weight_v{pl.spec.version:06d}")
        os.makedirs(vdir, exist_ok=True)
        name = f"rank0000_flush{pl.spec.flush:06d}.safetensors"
        data = write_safetensors(pl.spec, pl.positions, pl.values)
        if zstd:
            data = zstandard.ZstdCompressor(level=1).compress(data)
        with open(os.path.join(vdir, name + ".tmp"), "wb") as f:
            f.write(data)
        os.replace(os.path.join(vdir, name + ".tmp"), os.path.join(vdir, name))
        wire += len(data)
        r = server.post("/update_weights_from_disk", {"model_path": vdir, "load_format": "delta", "files": [name],
                                                      "weight_version": str(pl.spec.version)})
        if r.status_code != 200:
            raise SystemExit(f"engine refused version {pl.spec.version}: {r.text}")
    return wire


class GlooLink:
    """This process is rank 0 of the engine's weight-update group (the trainer's role)."""

    def __init__(self, server, sessions):
        from sglang.srt.utils.common import init_custom_process_group

        self.server, self.sessions = server, sessions
        port, box = free_port(), {}
        t = threading.Thread(target=lambda: box.setdefault("pg", init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name="demo")))
        t.start()
        r = server.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                       "rank_offset": 1, "world_size": 2, "group_name": "demo",
                                                       "backend": "gloo"})
        t.join(60)
        if r.status_code != 200:
            raise SystemExit(f"init_weights_update_group failed: {r.text}")
        self.pg = box["pg"]

    def publish(self, payloads):
        wire = 0
        for pl in payloads:
            if self.sessions:
                self.server.post("/begin_weight_update", {})
            t = threading.Thread(target=lambda: [torch.distributed.broadcast(x, src=0, group=self.pg)
                                                 for x in (pl.positions, pl.values)])
            t.start()
            r = self.server.post("/update_weights_from_distributed", {
                "names": [POSITIONS, VALUES], "dtypes": ["uint8", dtype_to_str(pl.values.dtype)],
                "shapes": [[pl.positions.numel()], [pl.values.numel()]], "group_name": "demo", "load_format": "delta",
                "delta": pl.spec.to_json(), "weight_version": str(pl.spec.version)})
            t.join(60)
            if self.sessions:
                self.server.post("/end_weight_update", {})
            if r.status_code != 200:
                raise SystemExit(f"engine refused version {pl.spec.version}: {r.text}")
            wire += pl.positions.numel() + pl.values.numel() * pl.values.element_size()
        return wire


def engine_equals(server, state) -> bool:
    for n, want in state.items():
        r = server.post("/get_weights_by_name", {"name": n, "truncate_size": 1 << 30})
        got = torch.tensor(r.json(), dtype=torch.float32).to(torch.bfloat16)[: want.shape[0]]
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            return False
    return True


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
    boot = write_hf_checkpoint(os.path.join(args.workdir, "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    t0 = time.time()
    server = Server(boot, os.path.join(args.workdir, "server.log")).wait_healthy()
    print(f"patched SGLang server up in {time.time() - t0:.0f}s (pid {server.proc.pid}); log {server.log.name}")
    try:
        link = GlooLink(server, not sglang.__version__.startswith("0.5.15")) if args.transport == "nccl" else None
        publish = (lambda pls: link.publish(pls)) if link else \
            (lambda pls: publish_disk(server, args.workdir, pls, encoding == "deltas_zstd"))
        state = bf16_state(model)
        full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        t = time.time()
        publish(full_flushes(state, version=1))
        print(f"full sync v1: {full_bytes / 1e6:.1f} MB in {1e3 * (time.time() - t):.0f} ms, "
              f"bit-identical: {engine_equals(server, state)}")
        print(f"{'step':>4} {'ver':>4} {'density':>8} {'wire bytes':>11} {'vs full':>8} {'encode ms':>9} "
              f"{'apply ms':>8} {'identical':>9}")
        ok = True
        for step, new in enumerate(rl_steps(model, args.steps, lr=args.lr), start=1):
            v = step + 1
            t = time.time()
            payloads = delta_flushes(state, new, encoding, version=v, base_version=v - 1)
            t_enc = time.time() - t
            nnz = sum(p.nnz for pl in payloads for p in pl.spec.params)
            t = time.time()
            wire = publish(payloads)
            t_apply = time.time() - t
            same = engine_equals(server, new)
            ok &= same
            print(f"{step:>4} {v:>4} {nnz / n_params:>8.2%} {wire:>11,} {full_bytes / wire:>7.1f}x "
                  f"{1e3 * t_enc:>9.0f} {1e3 * t_apply:>8.0f} {str(same):>9}")
            state = new
        print("all steps bit-identical" if ok else "MISMATCH")
        return 0 if ok else 1
    finally:
        server.stop()
        print(f"server stopped (pid {server.proc.pid})")


if __name__ == "__main__":
    sys.exit(main())
