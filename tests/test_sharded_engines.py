"""Sharded engines: real SGLang MoE classes (Qwen3-MoE, DeepSeek-V3's MLA) on gloo ranks at TP=2, EP=2 and TP=4 with
EP=2, bf16 and block FP8. A full sync, then a delta per encoding (``deltas`` over a gloo broadcast from a sender
process, ``deltas_zstd``, ``xor_zstd`` and ``xor_ctx`` over disk): after each, every rank bit-identical to a plain
load of the same state on that rank. Names a rank does not hold (another rank's experts) cost nothing: no loader call
at all in a delta. A file one rank cannot read, and a request naming an expert no rank has, are refused alike on
every rank, untouched. And a real ``launch_server --tp 2`` (SGLang's CPU backend runs no expert parallelism) through
a training loop, and following a version store (whole versions, staged while it serves)."""
import multiprocessing as mp
import os
import traceback

import pytest
import torch

from cpu_harness import (FP8_BLOCK, Server, bf16_state, delta_flushes, fp8_block_quantize, free_port, full_flushes,
                         hf_config, hf_model, join_update_group, publish_request, rl_states, rl_steps, segments,
                         write_hf_checkpoint)
from delta_helpers import GlooSender
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine, NcclTransport
from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES, dtype_to_str, zstd_level

GROUP = "sharded-test"
# version -> how it travels (v1: the full sync, over disk)
PLAN = {2: ("deltas", "broadcast"), 3: ("deltas_zstd", "disk"), 4: ("xor_zstd", "disk"), 5: ("deltas_zstd", "disk"),
        6: ("xor_ctx", "disk")}


def config(arch: str, quant):
    # FP8: 128x128 blocks, whole in every TP shard (a rank's K/V: one 128-wide head)
    cfg = hf_config(arch, hidden=512 if quant else 256, layers=2)
    cfg.num_experts = cfg.n_routed_experts = 8
    return cfg


def _rank(rank, world, ep, arch, quant, root, sender_init, errors):
    try:
        torch.set_num_threads(1)
        from cpu_harness import Host, init_sglang_inprocess, nan_filled, sglang_model
        from sglang.srt.utils.common import init_custom_process_group
        from sglang.srt.weight_sync.delta.receiver import delta_status, receiver_state

        init_sglang_inprocess(tp_rank=rank, tp_size=world, init_method=f"tcp://127.0.0.1:{root[1]}", ep_size=ep)
        root = root[0]
        states = torch.load(os.path.join(root, "states.pt"))
        cfg = config(arch, quant)
        host = Host(nan_filled(sglang_model(cfg, quant)), chunk_bytes=64 << 10)
        host._model_update_group[GROUP] = init_custom_process_group(
            backend="gloo", init_method=sender_init, world_size=world + 1, rank=rank + 1, group_name=GROUP)

        def holds(v):
            ref = nan_filled(sglang_model(cfg, quant))
            ref.load_weights(list(states[v - 1].items()))
            for (n, a), (_, b) in zip(host.model.named_parameters(), ref.named_parameters()):
                assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"rank {rank} v{v}: {n}"

        def disk(v, files=None, name="weight"):
            vdir = os.path.join(root, f"{name}_v{v:06d}")
            return host.call("_apply_delta", vdir, files or sorted(os.listdir(vdir)), str(v))

        ok, msg = disk(1)
        assert ok, msg
        holds(1)
        st = receiver_state(host.model)
        experts = {n for n in st.manifest if ".mlp.experts." in n}
        assert st.unheld <= experts and len(st.unheld) == len(experts) * (ep - 1) // ep, (len(st.unheld), len(experts))
        assert not st.dense  # FP8 experts of other ranks travel sparse too (no rank asks for them whole)
        loads = []
        native = host.model.load_weights
        host.model.load_weights = lambda weights: loads.append(len(list(weights))) or native(weights)
        for v, (encoding, transport) in PLAN.items():
            if transport == "broadcast":
                for spec, positions, values in torch.load(os.path.join(root, f"broadcast_v{v}.pt")):
                    ok, msg = host.call("_apply_delta_from_distributed", spec, [POSITIONS, VALUES],
                                        ["uint8", dtype_to_str(values.dtype)], [[positions.numel()], [values.numel()]],
                                        GROUP, str(v))
                    assert ok, f"rank {rank} v{v}: {msg}"
            else:
                if v == 5:  # first, a file only the reading rank is told of (not yet visible on its node)
                    files = sorted(os.listdir(os.path.join(root, f"weight_v{v:06d}")))
                    ok, msg = disk(v, files + (["late.safetensors"] if rank == 0 else []))
                    assert not ok and "file 'late.safetensors': cannot read" in msg, f"rank {rank}: {msg}"
                    holds(v - 1)
                    status = delta_status(host.model)
                    assert status.version == v - 1 and not status.needs_full and status.code == "malformed", status
                    # a request naming an expert that exists on no rank
                    ok, msg = disk(v, name="unknown")
                    assert not ok and delta_status(host.model).code == "manifest", f"rank {rank}: {msg}"
                    holds(v - 1)
                ok, msg = disk(v)
                assert ok, f"rank {rank} v{v}: {msg}"
            holds(v)
            assert receiver_state(host.model).version == v
        assert loads == [], loads  # every delta went through recorded views; other ranks' names were skipped
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


@pytest.mark.parametrize("arch, quant, world, ep", [
    ("qwen3-moe", None, 2, 1), ("qwen3-moe", None, 2, 2), ("qwen3-moe", "fp8", 2, 2), ("qwen3-moe", None, 4, 2),
    ("deepseek-v3", None, 2, 2), ("deepseek-v3", "fp8", 2, 2)])
def test_every_rank_of_a_sharded_engine_takes_each_delta_bit_identically(tmp_path, arch, quant, world, ep):
    cfg = config(arch, quant)
    states = rl_states(cfg, len(PLAN), seed=0)
    if quant:
        states = [fp8_block_quantize(s) for s in states]
    root = str(tmp_path)
    torch.save(states, os.path.join(root, "states.pt"))
    publish_request(root, 1, full_flushes(states[0], version=1, max_params=40), zstd=False)
    for v, (encoding, transport) in PLAN.items():
        payloads = delta_flushes(states[v - 2], states[v - 1], encoding, version=v, base_version=v - 1, max_params=40)
        if transport == "broadcast":
            torch.save([(pl.spec.to_json(), pl.positions, pl.values) for pl in payloads],
                       os.path.join(root, f"broadcast_v{v}.pt"))
            broadcast = payloads
        else:
            publish_request(root, v, payloads, zstd=True)
    expert = next(n for n in states[0] if ".mlp.experts.0.gate_proj.weight" in n)
    old, new = dict(states[3]), dict(states[4])
    old[expert.replace(".0.", ".99.")], new[expert.replace(".0.", ".99.")] = old[expert], new[expert]  # on no rank
    publish_request(root, 5, delta_flushes(old, new, "deltas_zstd", version=5, base_version=4), zstd=True, name="unknown")

    sender = GlooSender(group_name=GROUP, world_size=world + 1)
    for pl in broadcast:
        sender.send(pl)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    tp_port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, ep, arch, FP8_BLOCK if quant else None, (root, tp_port),
                                             sender.init_method, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    sender.close()
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_a_tp2_server_takes_a_training_loop_over_disk_then_gloo(tmp_path):
    """A real server with ``--tp 2`` (a Qwen3-MoE, every expert sharded over both ranks): the sender's own loop, its
    fingerprint checked against every rank's share after every sync; ``xor_zstd`` files (the first rank reads them
    once, the ranks rebuild together), ``xor_ctx`` files (the ranks share each changed segment's base), then a gloo
    group the server's two ranks join (a full sync, then ``deltas``)."""
    cfg = config("qwen3-moe", None)
    boot = write_hf_checkpoint(str(tmp_path / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    srv = Server(boot, str(tmp_path / "server.log"), extra=["--tp", "2"],
                 env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}).wait_healthy()  # one core per rank
    try:
        trainer = hf_model(cfg, seed=1)
        state = bf16_state(trainer)
        engine = HttpEngine(srv.url)
        disk = DiskTransport(str(tmp_path / "shared"), [engine], zstd=zstd_level("xor_zstd"))
        ctx = DiskTransport(str(tmp_path / "shared-ctx"), [engine], zstd=zstd_level("xor_ctx"))
        for encoding, transport in (("xor_zstd", disk), ("xor_ctx", ctx), ("deltas", None)):
            if transport is None:
                transport = NcclTransport(join_update_group(srv, "tp2-gloo", tp=2), "tp2-gloo", [engine])
            sender = DeltaSender(transport, [engine], encoding=encoding, buffer_bytes=256 << 10, fingerprint_every=1)
            sender.version = max(s.version or 0 for s in engine.status())  # continue the engine's chain
            for k in range(3):  # a full sync, then deltas
                results = sender.update(segments(state))
                assert results[0][0], results
                m = sender.pop_metrics()
                assert m["perf/update_weights_fingerprint_mismatches"] == 0, m
                assert m["perf/update_weights_fingerprint_uncovered"] == 0, m
                assert k == 0 or m["perf/update_weights_xor"] == encoding.startswith("xor"), m
                assert k == 0 or m["perf/update_weights_ctx"] == (encoding == "xor_ctx"), m
                state = next(rl_steps(trainer, 1, seed=k))
            assert [s.version for s in engine.status()] == [sender.version] * 2  # both ranks
            transport.close()
    finally:
        srv.stop()


def test_a_tp2_server_follows_a_store_whole_versions_staged_while_it_serves(tmp_path):
    """A real server with ``--tp 2`` following a directory store, its decoded-request bound a few KiB (so every
    version goes past it: the first rank digest-checks the rest and both ranks take the verdict): it stages each
    version on its first rank while it serves, both ranks end bit-identical at HEAD (every rank's fingerprint share),
    the commit reads nothing from the store. A version broken in its last object is not written on any rank: both stay
    at the last whole version, not dirty, serving; repaired, the store brings them to HEAD."""
    import time

    from sglang.srt.weight_sync.delta import fingerprint
    from sglang.srt.weight_sync.delta.store.publish import StoreTransport

    cfg = config("qwen3-moe", None)
    store = str(tmp_path / "store")
    os.makedirs(store)
    trainer = hf_model(cfg, seed=1)
    state = bf16_state(trainer)
    sender = DeltaSender(StoreTransport(store, [], zstd=3), [], encoding="xor_zstd", buffer_bytes=64 << 10)
    sender.update(segments(state))  # version 1: the anchor (no engine pushed to: the store's HEAD is the result)
    assert sender.transport.head_version == 1
    boot = write_hf_checkpoint(str(tmp_path / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    srv = Server(boot, str(tmp_path / "server.log"), env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}, extra=[
        "--tp", "2", "--update-weight-store", store, "--update-weight-store-poll-s", "0.3",
        "--update-weight-delta-chunk-bytes", "4096"]).wait_healthy()
    engine = HttpEngine(srv.url)

    def at(version, state, timeout=180):
        t0 = time.time()
        while [s.version for s in engine.status()] != [version] * 2:
            assert time.time() - t0 < timeout, engine.status()
            time.sleep(0.3)
        theirs = fingerprint.merge_ranks(fingerprint.check_version(engine.fingerprint(), version))
        assert fingerprint.compare(state, theirs) == ([], []), version

    try:
        at(1, state)
        steps = rl_steps(trainer, 3)
        for v in (2, 3):
            state = next(steps)
            sender.update(segments(state))
            at(v, state)
            timing = engine.status()[0].timing  # the first rank staged it; its commit read nothing
            assert timing["staged_bytes"] > 0 and timing["in_pause_bytes"] == 0, timing
        kept = {}

        def break_last(vdir):  # after each publish of the version, its newest file flipped (the one before mended)
            for path, data in kept.items():
                with open(path, "wb") as f:
                    f.write(data)
            last = os.path.join(vdir, sorted(f for f in os.listdir(vdir) if f.endswith(".safetensors"))[-1])
            with open(last, "rb") as f:
                data = f.read()
            kept.clear()
            kept[last] = data
            with open(last, "wb") as f:
                f.write(data[:-1] + bytes([data[-1] ^ 1]))

        sender.transport.hook = break_last
        at3, state = state, next(steps)
        sender.update(segments(state))
        sender.transport.hook = None
        time.sleep(3)  # the follower tries, and refuses, several times
        statuses = engine.status()
        assert [(s.version, s.needs_full) for s in statuses] == [(3, False)] * 2, statuses
        at(3, at3)
        r = srv.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        for path, data in kept.items():
            with open(path, "wb") as f:
                f.write(data)
        at(4, state)
    finally:
        srv.stop()
        sender.transport.close()
