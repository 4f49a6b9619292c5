"""``make bench BENCH_ARGS="--shape S --engine-tp 2 [--engine-ep 2]"``: a sharded engine's delta apply, per rank.

One process per engine rank on a gloo world (one CPU thread each, as each rank of a GPU engine has its own device),
the real SGLang model class at that TP/EP width. Every rank takes a full sync, then per trained step the same
``deltas`` request (as a broadcast delivers it: the spec parsed from its JSON inside the clock), and is checked
bit-identical to its own plain ``load_weights`` of the same state. Per rank: the apply against that plain load
(median over steps), host synchronizations and computing ops (a kernel launch each on a GPU) per flush, the changed
elements the rank wrote, and the peak extra RSS of the apply (a second run with ``MALLOC_MMAP_THRESHOLD_``, as
``make bench``). Writes ``docs/benchmarks-sharded.md`` from every width measured under the work dir.
"""
from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import statistics
import time
import traceback

import torch

from bench import MEMORY_RUN, PeakRSS, model_config, plain_load


def _rank(rank: int, tp: int, ep: int, shape: str, paths: list, port: int, out: "mp.Queue") -> None:
    try:
        out.put((rank, _measure_rank(rank, tp, ep, shape, paths, port)))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _measure_rank(rank: int, tp: int, ep: int, shape: str, paths: list, port: int) -> dict:
    from safetensors.torch import load_file
    from torch.utils._python_dispatch import TorchDispatchMode

    from cpu_harness import Host, SyncCounter, delta_flushes, full_flushes, init_sglang_inprocess, sglang_model
    from sglang.srt.weight_sync.delta import views
    from sglang.srt.weight_sync.delta.ops import gc_paused
    from sglang.srt.weight_sync.delta.receiver import receiver_state
    from sglang.srt.weight_sync.delta.wire import DeltaPayload, DeltaSpec, received_params

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += not func.is_view
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    init_sglang_inprocess(tp_rank=rank, tp_size=tp, init_method=f"tcp://127.0.0.1:{port}", ep_size=ep)
    states = [load_file(p) for p in paths]
    cfg = model_config(shape)
    host, ref = Host(sglang_model(cfg)), sglang_model(cfg)
    written = [0]
    native_write = views._write_bits

    def counting_write(flat, offsets, bits):  # how many elements this rank writes (the bench's own count)
        written[0] += offsets.numel()
        native_write(flat, offsets, bits)

    views._write_bits = counting_write
    barrier = lambda: torch.distributed.barrier()  # noqa: E731 - ranks start each clocked apply together
    with gc_paused():
        ok, msg = host.call("_apply_delta_payload", full_flushes(states[0], version=1))
    assert ok, msg
    state = receiver_state(host.model)
    res = {"rank": rank, "tensors": len(states[0]), "unheld": len(state.unheld), "steps": []}
    for step in range(1, len(states)):
        payloads = delta_flushes(states[step - 1], states[step], "deltas", version=step + 1, base_version=step)
        requests = [(p.spec.to_json(), p) for p in payloads]
        written[0] = 0
        barrier()
        with gc_paused():
            if MEMORY_RUN:
                with PeakRSS() as mem, SyncCounter() as syncs, Launches() as launches:
                    ok, msg = host.call("_apply_delta_payload", [
                        DeltaPayload(DeltaSpec.from_json(t), p.positions, p.values, params_text=received_params(t))
                        for t, p in requests])
                dt = 0.0
            else:
                t0 = time.perf_counter()
                ok, msg = host.call("_apply_delta_payload", [
                    DeltaPayload(DeltaSpec.from_json(t), p.positions, p.values, params_text=received_params(t))
                    for t, p in requests])
                dt = time.perf_counter() - t0
        assert ok, msg
        barrier()
        loads = []
        for _ in range(3):
            t0 = time.perf_counter()
            plain_load(ref, states[step])
            loads.append(time.perf_counter() - t0)
        for (n, a), (_, b) in zip(host.model.named_parameters(), ref.named_parameters()):
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{rank} {step}: {n}"
        res["steps"].append({
            "step": step, "apply_s": dt, "load_s": statistics.median(loads), "flushes": len(payloads),
            "changed": sum(p.values.numel() for p in payloads), "written": written[0],
            "syncs": len(syncs.ops) if MEMORY_RUN else None, "launches": launches.n if MEMORY_RUN else None,
            "apply_mem": mem.extra if MEMORY_RUN else None})
    return res


def run(shape: str, tp: int, ep: int, paths: list, out_json: str) -> None:
    """Both runs (timing, then memory) of one width; their ranks' results side by side in ``out_json``."""
    from cpu_harness import free_port

    results = {"shape": shape, "tp": tp, "ep": ep}
    for run_name, env in (("timing", {}), ("memory", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # read by each rank's allocator at its start (spawned processes inherit it)
        try:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            port = free_port()
            procs = [ctx.Process(target=_rank, args=(r, tp, ep, shape, paths, port, q)) for r in range(tp)]
            for p in procs:
                p.start()
            got = dict(q.get(timeout=3600) for _ in procs)
            for p in procs:
                p.join(60)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        failed = [v for v in got.values() if isinstance(v, str)]
        if failed:
            raise SystemExit("bench_sharded: a rank failed:\n" + "\n".join(failed))
        results[run_name] = [got[r] for r in range(tp)]
        print(f"bench_sharded: {shape} tp={tp} ep={ep} {run_name} run done", flush=True)
    json.dump(results, open(out_json, "w"), indent=1)


def report(workdir: str, env: str) -> str:
    """``docs/benchmarks-sharded.md``: a row per rank of every width measured under ``workdir``."""
    L = ["# Sharded engines: a delta's apply per rank", "", f"Environment: {env}.", "",
         "Generated by `make bench BENCH_ARGS=\"--shape S --engine-tp T --engine-ep E\"` (`scripts/bench_sharded.py`).",
         "One process per engine rank (gloo, one CPU thread each); `deltas` requests as a broadcast delivers them; "
         "every rank bit-identical to its own plain `load_weights` of the same state after every step. Medians over "
         "the steps; syncs and ops are per flush, counted in the memory run (whose times are not used).", "",
         "| shape | TP | EP | rank | HF tensors | not held | changed / step | written by the rank | apply | plain load "
         "| apply / load | host syncs / flush | ops / flush | peak extra RSS |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for path in sorted(glob.glob(os.path.join(workdir, "*", "sharded-tp*-ep*.json"))):
        r = json.load(open(path))
        for t, m in zip(r["timing"], r["memory"]):
            med = lambda rows, k: statistics.median(s[k] for s in rows)  # noqa: E731
            flushes = med(m["steps"], "flushes")
            apply_s, load_s = med(t["steps"], "apply_s"), med(t["steps"], "load_s")
            L.append(f"| {r['shape']} | {r['tp']} | {r['ep']} | {t['rank']} | {t['tensors']:,} | {t['unheld']:,} | "
                     f"{med(t['steps'], 'changed'):,.0f} | {med(t['steps'], 'written'):,.0f} | {apply_s * 1e3:.1f} ms | "
                     f"{load_s * 1e3:.1f} ms | **{apply_s / load_s:.2f}x** | "
                     f"{med(m['steps'], 'syncs') / flushes:.0f} | {med(m['steps'], 'launches') / flushes:,.0f} | "
                     f"{max(s['apply_mem'] for s in m['steps']) / 2**20:.0f} MiB |")
    L += ["", "`not held`: HF names this rank's loader took without writing anything in the full sync (other ranks' "
          "experts): a delta skips them. `written by the rank`: elements its writes landed (a TP shard's rank writes "
          "its part of each changed tensor).", ""]
    return "\n".join(L)
