"""gpu-check's sharded lanes (``scripts/gpu_check.py`` runs them; ``--dry-run`` runs them on the CPU, so CI keeps them
working).

* **TP=2 × EP=2 engine ranks**: a Qwen3-MoE engine as two ranks, one GPU each (NCCL; gloo on the dry run), takes a full
  sync and then ``deltas_zstd`` and ``xor_zstd`` deltas over disk: every rank bit-identical to a plain load of the same
  state on that rank, no loader call in a delta (the experts a rank does not hold cost nothing), and its apply timed
  against that rank's plain ``load_weights``. Needs two GPUs.
* **A real server**: ``sglang.launch_server`` (``--tp 2`` with two GPUs) with CUDA graphs and the overlap scheduler on,
  through a training loop over disk with the fingerprint checked after every sync, generating between syncs. Needs
  SGLang's own CUDA kernels (the bundle's import stub cannot serve).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import torch

GROUP_RANKS, EP = 2, 2
PLAN = {2: "deltas_zstd", 3: "xor_zstd"}  # v1: the full sync


def _moe_config(args):
    from cpu_harness import hf_config

    cfg = hf_config("qwen3-moe", vocab=args.vocab, hidden=args.hidden, layers=args.layers)
    cfg.num_experts = 8
    return cfg


def _rank(rank: int, device_type: str, init: str, root: str, args, stubbed: bool, out) -> None:
    """One engine rank: apply every published version, compare with a plain load on this rank, time both."""
    try:
        if stubbed:  # a spawned process starts without the parent's import hooks
            from gpu_check import install_sgl_kernel_stub

            install_sgl_kernel_stub()
        from cpu_harness import Host, init_sglang_inprocess, nan_filled, sglang_model

        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)
        init_sglang_inprocess(tp_rank=rank, tp_size=GROUP_RANKS, init_method=init, ep_size=EP,
                              backend="nccl" if device.type == "cuda" else "gloo", device=device.type)
        cfg = _moe_config(args)
        states = torch.load(os.path.join(root, "states.pt"))
        host = Host(nan_filled(sglang_model(cfg).to(device)))
        host.device = device
        loads, native = [], host.model.load_weights
        lines = []
        for v in [1] + list(PLAN):
            vdir = os.path.join(root, f"weight_v{v:06d}")
            host.model.load_weights = lambda w: loads.append(v) or native(w)
            _sync(device)
            t0 = time.perf_counter()
            ok, msg = host.call("_apply_delta", vdir, sorted(os.listdir(vdir)), str(v))
            _sync(device)
            t_apply = time.perf_counter() - t0
            host.model.load_weights = native
            ref = nan_filled(sglang_model(cfg).to(device))
            items = list(states[v - 1].items())
            with torch.no_grad():
                t0 = time.perf_counter()
                ref.load_weights(items)
                _sync(device)
                t_load = time.perf_counter() - t0
            bad = next((n for (n, a), (_, b) in zip(host.model.named_parameters(), ref.named_parameters())
                        if not torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))),
                       None)
            lines.append((v, ok and bad is None, msg if not ok else f"first differing param: {bad}" if bad else "",
                          t_apply, t_load))
        out.put((rank, lines, sorted(set(loads) - {1}), None))
    except BaseException:
        out.put((rank, [], [], traceback.format_exc()))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_sharded_ranks(report, args, device, workdir, stubbed: bool) -> None:
    from cpu_harness import delta_flushes, free_port, full_flushes, publish_request, rl_states

    what = f"TP={GROUP_RANKS} x EP={EP} Qwen3-MoE engine ranks"
    if device.type == "cuda" and torch.cuda.device_count() < GROUP_RANKS:
        report.skip(what, f"{torch.cuda.device_count()} GPU(s), needs {GROUP_RANKS}")
        return
    report.add(f"\nsharded lane: {what}, one {'GPU' if device.type == 'cuda' else 'CPU process'} each, full sync then "
               f"{', '.join(PLAN.values())} over disk")
    root = os.path.join(workdir, "sharded")
    os.makedirs(root)
    cfg = _moe_config(args)
    states = rl_states(cfg, len(PLAN) + 1, seed=0)
    torch.save(states, os.path.join(root, "states.pt"))
    publish_request(root, 1, full_flushes(states[0], version=1, max_params=40), zstd=False)
    for v, enc in PLAN.items():
        publish_request(root, v, delta_flushes(states[v - 2], states[v - 1], enc, version=v, base_version=v - 1,
                                        max_params=40), zstd=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, device.type, init, root, args, stubbed, out)) for r in range(GROUP_RANKS)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, lines, delta_loads, error = out.get(timeout=900)
        results[rank] = (lines, delta_loads, error)
    for p in procs:
        p.join(60)
    for rank in sorted(results):
        lines, delta_loads, error = results[rank]
        if error:
            report.check(False, f"rank {rank} stopped:\n```\n{error}```")
            continue
        for v, ok, msg, t_apply, t_load in lines:
            kind = "full sync" if v == 1 else PLAN[v]
            report.check(ok, f"rank {rank} v{v} {kind}: bit-identical to a plain load on the rank; apply "
                             f"{1e3 * t_apply:.1f} ms vs load_weights {1e3 * t_load:.1f} ms "
                             f"({t_apply / t_load:.2f}x)" + (f" — {msg}" if msg else ""))
        report.check(not delta_loads, f"rank {rank}: no loader call in a delta (other ranks' experts skipped)"
                                      + (f" — loader called in v{delta_loads}" if delta_loads else ""))


def check_server(report, args, device, workdir, stubbed: bool) -> None:
    from cpu_harness import Server, bf16_state, engine_mismatch, hf_config, hf_model, rl_steps, segments, \
        write_hf_checkpoint
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine

    tp = GROUP_RANKS if device.type == "cuda" and torch.cuda.device_count() >= GROUP_RANKS else 1
    flags = "CUDA graphs and the overlap scheduler on" if device.type == "cuda" else "SGLang's CPU flags"
    what = f"a real launch_server --tp {tp} ({flags}) through {args.steps} syncs"
    if stubbed:
        report.skip(what, "sgl_kernel is the bundle's import stub, which cannot serve; run where SGLang is installed")
        return
    report.add(f"\nserver lane: {what}")
    cfg = hf_config("llama", vocab=args.vocab, hidden=args.hidden, layers=args.layers)  # read back by name
    root = os.path.join(workdir, "server")
    trainer = hf_model(cfg, seed=1)
    boot = write_hf_checkpoint(os.path.join(root, "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    server = Server(boot, os.path.join(root, "server.log"), extra=["--tp", str(tp)], device=device.type)
    try:
        server.wait_healthy(timeout=900)
        engine = HttpEngine(server.url)
        transport = DiskTransport(os.path.join(root, "shared"), [engine], zstd=1)
        sender = DeltaSender(transport, [engine], encoding="deltas_zstd", fingerprint_every=1)
        states = [bf16_state(trainer)] + list(rl_steps(trainer, args.steps, lr=1e-6, batch=2, seq=64))
        for step, state in enumerate(states):
            ok, msg = sender.update(segments(state))[0]
            m = sender.pop_metrics()
            r = server.post("/generate", {"input_ids": list(range(3, 19)), "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
            served = r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8
            bad = engine_mismatch(server, state) if ok and tp == 1 else None  # a TP rank reads back its shard
            good = ok and served and bad is None and m["perf/update_weights_fingerprint_mismatches"] == 0
            report.check(good, f"server step {step} ({'full sync' if not step else 'delta'}): fingerprint equal, "
                               f"{'every param read back equal, ' if tp == 1 else ''}a request served after it"
                               + ("" if good else f" — {msg}; served {served}; first differing param: {bad}"))
        transport.close()
    finally:
        server.stop()
