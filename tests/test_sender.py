"""The sender core driven by a real training loop, into real receivers: in-process SGLang classes and a server."""
import logging
import math

import pytest
import torch

from cpu_harness import (
    Host,
    InProcessEngine,
    Server,
    bf16_state,
    engine_mismatch,
    hf_config,
    hf_model,
    join_update_group,
    nan_filled,
    rl_states,
    rl_steps,
    segments,
    sglang_model,
    write_hf_checkpoint,
)
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta.diff import encode_gathered
from sglang.srt.weight_sync.delta.receiver import delta_status
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine, NcclTransport
from sglang.srt.weight_sync.delta.wire import DeltaError, DeltaStatus, Refusal, zstd_level


class LocalEngine(InProcessEngine):
    """An in-process engine on a real SGLang model class, applying through the patched class (proves the patch
    bound the receiver); ``down`` makes it unreachable."""

    def __init__(self, cfg):
        super().__init__(Host(nan_filled(sglang_model(cfg)), chunk_bytes=64 << 10))
        self.down = False
        self.requests = 0

    def update_weights_from_disk(self, model_path, files, weight_version):
        if self.down:
            raise ConnectionError("engine unreachable")
        self.requests += 1
        return self.host.call("_apply_delta", model_path, files, weight_version)

    def status(self):
        if self.down:
            raise ConnectionError("engine unreachable")
        return super().status()


def reference(cfg, state):
    ref = nan_filled(sglang_model(cfg))
    ref.load_weights(list(state.items()))
    return ref


@pytest.mark.parametrize("arch, encoding", [
    ("qwen2", "deltas_zstd"), ("qwen3-tied", "indices"), ("qwen2-moe", "deltas"), ("qwen3-moe", "deltas_zstd"),
    ("qwen3-tied", "xor_zstd"), ("qwen3-moe", "xor_zstd"), ("qwen2", "planes_zstd")])
def test_training_loop_into_inprocess_receivers(tmp_path, caplog, arch, encoding):
    """Syncs after real training steps, each engine param bit-identical to a plain load of the trainer's state. The
    4 KiB buffer is below most params: each such one is a flush of its own, said once, at its largest."""
    caplog.set_level(logging.WARNING, logger="sglang.srt.weight_sync.delta.sync_run")
    cfg = hf_config(arch)
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    transport = DiskTransport(str(tmp_path), [engine], zstd=zstd_level(encoding))
    sender = DeltaSender(transport, [engine], encoding=encoding, buffer_bytes=4 << 10)  # several flushes
    state = bf16_state(trainer)
    segs = segments(state)
    assert len(segs) == (5 if "moe" in arch else 1)  # non-expert + 4 expert sub-passes
    results = sender.update(segs)
    assert results == {0: (True, results[0][1])} and results[0][0]
    m = sender.pop_metrics()
    assert m["perf/update_weights_full_sync_engines"] == 1 and m["perf/update_weights_density"] == 1.0
    assert_params_equal(engine.host.model, reference(cfg, state))
    for step, state in enumerate(rl_steps(trainer, 3), start=2):
        before = engine.requests
        results = sender.update(segments(state))
        assert results[0][0], results
        assert engine.requests - before == len(segs)  # one publish per segment
        m = sender.pop_metrics()
        assert 0 < m["perf/update_weights_density"] < 0.2 and m["perf/update_weights_flushes"] > len(segs)
        assert m["perf/update_weights_full_sync_engines"] == 0 and m["perf/update_weights_wire_bytes"] > 0
        assert m["perf/update_weights_xor"] == (encoding == "xor_zstd")  # the engine at the base rebuilds them
        assert sender.state.version == step
        assert_params_equal(engine.host.model, reference(cfg, state))
    transport.close()
    said = [r.getMessage() for r in caplog.records if "larger than the flush bound" in r.getMessage()]
    largest = max(state.items(), key=lambda kv: kv[1].nbytes)
    assert len(said) == 1 and said[0].startswith("delta sync v1: ") and \
        f"up to {largest[1].nbytes} B ({largest[0]})" in said[0], said


def test_the_disk_transport_announces_to_every_engine_at_once(tmp_path):
    """Three real in-process engines whose applies must overlap: a barrier that every apply waits at passes only
    if the announcement reached all three before any returned (one after another, it times out)."""
    import threading

    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    barrier = threading.Barrier(3, timeout=30)

    class Meeting(LocalEngine):
        def update_weights_from_disk(self, model_path, files, weight_version):
            barrier.wait()
            return super().update_weights_from_disk(model_path, files, weight_version)

    engines = [Meeting(cfg) for _ in range(3)]
    sender = DeltaSender(DiskTransport(str(tmp_path), engines), engines, encoding="deltas")
    for state in (bf16_state(trainer), next(rl_steps(trainer, 1))):
        results = sender.update(segments(state))
        assert all(ok for ok, _ in results.values()), results
    for e in engines:
        assert_params_equal(e.host.model, reference(cfg, state))


def test_unchanged_params_are_left_out_of_the_spec(tmp_path):
    import glob

    from sglang.srt.weight_sync.delta.files import read_safetensors

    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine], keep_files=True), [engine], encoding="deltas")
    first = bf16_state(trainer)
    assert sender.update(segments(first))[0][0]
    state = dict(next(rl_steps(trainer, 1)))
    state["model.norm.weight"] = first["model.norm.weight"]  # this one did not change
    assert sender.update(segments(state))[0][0]
    files = glob.glob(str(tmp_path / "weight_v000002" / "*.safetensors"))
    named = [p.name for f in files for p in read_safetensors(open(f, "rb").read(), f).spec.params]
    assert "model.norm.weight" not in named and "model.layers.0.self_attn.q_proj.weight" in named
    assert_params_equal(engine.host.model, reference(cfg, state))


def two_engines(tmp_path, arch, encoding, steps, **sender_kw):
    """A trainer, two in-process engines over disk, and a sender that already brought both to version 1."""
    cfg = hf_config(arch)
    trainer = hf_model(cfg)
    a, b = LocalEngine(cfg), LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [a, b]), [a, b], encoding=encoding, buffer_bytes=32 << 10,
                         **sender_kw)
    assert all(ok for ok, _ in sender.update(segments(bf16_state(trainer))).values())
    return cfg, rl_steps(trainer, steps), a, b, sender


def assert_both_hold(cfg, state, *engines):
    ref = reference(cfg, state)
    for e in engines:
        assert_params_equal(e.host.model, ref)


def test_unreachable_engine_gets_a_full_sync_and_both_end_identical(tmp_path):
    cfg, steps, a, b, sender = two_engines(tmp_path, "qwen2", "deltas", 3)
    b.down = True
    results = sender.update(segments(next(steps)))
    assert results[0][0] and not results[1][0] and "unreachable" in results[1][1]
    assert sender.state.version == 1  # not every engine acknowledged v2: the snapshot stays at v1
    b.down = False
    state = next(steps)
    results = sender.update(segments(state))
    assert results[0][0] and results[1][0], results
    m = sender.pop_metrics()
    assert m["perf/update_weights_full_sync_engines"] == 1 and m["perf/update_weights_failures"] == 0
    assert m["perf/update_weights_failures_total"] == 1 and m["perf/update_weights_resyncs"] == 1
    assert sender.state.version == 3
    assert_both_hold(cfg, state, a, b)
    state = next(steps)  # and the next sync is a delta for both
    assert all(ok for ok, _ in sender.update(segments(state)).values())
    assert sender.pop_metrics()["perf/update_weights_full_sync_engines"] == 0
    assert_both_hold(cfg, state, a, b)


class OlderEngine(LocalEngine):
    """Replies to ``delta_status`` as an engine before wire format 2 did: the same reply without ``wire_format``."""

    older = True

    def status(self):
        ranks = super().status()
        return [DeltaStatus.from_dict({k: v for k, v in r.to_dict().items() if k != "wire_format"}) if self.older
                else r for r in ranks]


def test_an_engine_on_an_older_wire_format_stops_the_sync_before_anything_is_sent(tmp_path):
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    a, b = LocalEngine(cfg), OlderEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [a, b]), [a, b], encoding="deltas", buffer_bytes=32 << 10)
    state = bf16_state(trainer)
    with pytest.raises(DeltaError, match=r"engines read delta wire formats \{1: \[1\]\} \(engine: formats\), this "
                                         "sender writes format 2") as e:
        sender.update(segments(state))
    assert e.value.code is Refusal.UNSUPPORTED and a.requests == b.requests == 0 and sender.version == 0
    b.older = False  # upgraded: asked again, and the sync goes through
    assert all(ok for ok, _ in sender.update(segments(state)).values())
    assert_both_hold(cfg, state, a, b)


def test_an_engine_loaded_outside_the_chain_refuses_deltas_then_gets_a_full_sync(tmp_path):
    from sglang.srt.weight_sync.delta.receiver import note_outside_load

    cfg, steps, a, b, sender = two_engines(tmp_path, "qwen3", "indices", 3)
    note_outside_load(b.host, "update_weights_from_disk")  # what the patched plain load paths call first
    b.host.model.load_weights(list(bf16_state(hf_model(cfg, seed=7)).items()))
    results = sender.update(segments(next(steps)))
    assert results[0][0] and not results[1][0]
    assert "weights were replaced by update_weights_from_disk since version 1: the engine needs a full sync" \
        in results[1][1], results
    assert sender.state.version == 1 and sender.status[1].needs_full
    state = next(steps)
    results = sender.update(segments(state))
    assert results[0][0] and results[1][0], results
    assert sender.pop_metrics()["perf/update_weights_full_sync_engines"] == 1
    assert_both_hold(cfg, state, a, b)


def test_a_restarted_trainer_continues_the_version_chain_of_running_engines(tmp_path):
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    steps = rl_steps(trainer, 3)
    first = DeltaSender(DiskTransport(str(tmp_path / "run1"), [engine]), [engine], encoding="deltas")
    for state in (bf16_state(trainer), next(steps), next(steps)):
        assert first.update(segments(state))[0][0]
    restarted = DeltaSender(DiskTransport(str(tmp_path / "run2"), [engine]), [engine], encoding="deltas")
    # the engine's status says version 3: the new sender's first (full) sync is version 4, not a refused 1
    assert restarted.update(segments(state))[0][0] and restarted.version == 4
    assert restarted.pop_metrics()["perf/update_weights_full_sync_engines"] == 1
    state = next(steps)
    assert restarted.update(segments(state))[0][0] and restarted.version == 5
    assert restarted.pop_metrics()["perf/update_weights_full_sync_engines"] == 0
    assert_params_equal(engine.host.model, reference(cfg, state))


def test_a_stale_full_sync_is_refused_and_the_sender_moves_above_the_engines_version(tmp_path):
    """A sender that never asked (status learned before another trainer advanced the engine) is refused with
    code off_chain and continues above the version the engine's status reports."""
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    late = DeltaSender(DiskTransport(str(tmp_path / "late"), [engine]), [engine], encoding="deltas")
    late._learn([0])  # the engine is fresh now
    state = bf16_state(trainer)
    first = DeltaSender(DiskTransport(str(tmp_path / "first"), [engine]), [engine], encoding="deltas")
    assert first.update(segments(state))[0][0] and first.update(segments(state))[0][0]
    ok, msg = late.update(segments(state))[0]
    assert not ok and "full sync version 1 is not newer than the committed version 2" in msg
    st = engine.status()[0]
    assert st.code == "off_chain" and st.request == [1, 0] and st.version == 2 and not st.needs_full
    assert late.version == 2 and late.status[0].needs_full
    assert late.update(segments(state))[0][0] and late.version == 3
    assert_params_equal(engine.host.model, reference(cfg, state))


def test_a_silently_corrupted_engine_is_caught_by_the_fingerprint_and_repaired_before_update_returns(tmp_path, caplog):
    cfg, steps, a, b, sender = two_engines(tmp_path, "qwen2-moe", "deltas", 4, fingerprint_every=2)
    assert all(ok for ok, _ in sender.update(segments(next(steps))).values())  # v2: checked, all equal
    m = sender.pop_metrics()
    assert m["perf/update_weights_fingerprint_mismatches"] == 0 and m["perf/update_weights_fingerprint_uncovered"] == 0
    param = dict(b.host.model.named_parameters())["model.layers.0.mlp.experts.w2_weight"]
    param.view(-1).view(torch.int16)[123] ^= 1  # one flipped bit no sync wrote (e.g. a stray kernel)
    assert all(ok for ok, _ in sender.update(segments(next(steps))).values())  # v3: not checked
    state = next(steps)
    results = sender.update(segments(state))  # v4: checked, b differs; repaired (v5, full) before update returns
    assert all(ok for ok, _ in results.values()), results
    m = sender.pop_metrics()
    assert (m["perf/update_weights_fingerprint_mismatches"], m["perf/update_weights_repairs"],
            m["perf/update_weights_full_sync_engines"]) == (1, 1, 1), m
    assert sender.version == 5
    mismatch = next(r.getMessage() for r in caplog.records if "fingerprint mismatch" in r.getMessage())
    assert "fingerprint mismatch after version 4 on 1 param(s), e.g. ['model.layers.0.mlp.experts." in mismatch
    assert_both_hold(cfg, state, a, b)


def test_deltas_zstd_is_refused_over_nccl():
    with pytest.raises(DeltaError, match="deltas_zstd compresses files: it is disk-only"):
        DeltaSender(NcclTransport(None, "g", []), [], encoding="deltas_zstd")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sender-server")
    cfg = hf_config("llama", vocab=300)
    boot = write_hf_checkpoint(str(root / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    srv = Server(boot, str(root / "server.log")).wait_healthy()
    yield srv, cfg, root
    srv.stop()


def engine_has(srv, state):
    name = engine_mismatch(srv, state)
    assert name is None, f"{name} differs on the engine"


def test_training_loop_into_a_server_over_disk_then_gloo(server):
    srv, cfg, root = server
    trainer = hf_model(cfg, seed=1)
    engine = HttpEngine(srv.url)
    disk = DiskTransport(str(root / "shared"), [engine], zstd=zstd_level("deltas_zstd"))
    sender = DeltaSender(disk, [engine], encoding="deltas_zstd", buffer_bytes=64 << 10, fingerprint_every=1)
    state = bf16_state(trainer)
    for k in range(3):
        results = sender.update(segments(state))
        assert results[0][0], results
        engine_has(srv, state)
        m = sender.pop_metrics()  # the server's /weights_checker fingerprint agreed with the trainer's
        assert m["perf/update_weights_fingerprint_mismatches"] == 0 and m["perf/update_weights_fingerprint_uncovered"] == 0
        state = next(rl_steps(trainer, 1, seed=k))
    assert m["perf/update_weights_compression_ratio"] > 1.0
    disk.close()

    pg = join_update_group(srv, "sender-gloo")
    nccl = NcclTransport(pg, "sender-gloo", [engine])
    sender2 = DeltaSender(nccl, [engine], encoding="indices", buffer_bytes=64 << 10)
    sender2.version = sender.version  # the engine is at the disk sender's version: continue the chain
    for k in range(3):  # a full sync over the group, then deltas
        results = sender2.update(segments(state))
        assert results[0][0], results
        engine_has(srv, state)
        state = next(rl_steps(trainer, 1, seed=10 + k))
    nccl.close()


def test_a_sync_aborted_midway_is_counted_and_the_engines_status_decides_what_follows(tmp_path, monkeypatch):
    """Nothing of v2 was announced (its segment never ended): the engine's status says committed version 1, not
    dirty, so the next delta — which re-sends every position v2 staged — makes it bit-identical, no full sync."""
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine]), [engine], encoding="indices", buffer_bytes=4 << 10)
    assert sender.update(segments(bf16_state(trainer)))[0][0]
    steps = rl_steps(trainer, 2)
    state = next(steps)

    def broken():  # the trainer's gather dies after the first chunk
        yield next(iter(segments(state)[0]()))
        raise RuntimeError("gather failed")

    results = sender.update([broken])
    assert not results[0][0] and "sync aborted: RuntimeError('gather failed')" in results[0][1]
    assert sender.pop_metrics()["perf/update_weights_failures"] == 1 and sender.state.version == 1
    st = engine.status()[0]
    assert (st.version, st.needs_full, st.pending) == (1, False, None) and not sender.status[0].needs_full
    state = next(steps)
    assert sender.update(segments(state))[0][0]
    assert sender.pop_metrics()["perf/update_weights_full_sync_engines"] == 0
    assert_params_equal(engine.host.model, reference(cfg, state))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3-tied"])
def test_xor_ctx_after_an_aborted_sync_leaves_out_positions_back_at_the_base(tmp_path, arch):
    """An aborted sync's positions are re-sent by the next; those whose value went back to the base (and, tied, a
    zero-based param's element that became +0.0) are steps of 0, which xor_ctx cannot code: the sender leaves them
    out of the flush (an engine at the base needs nothing there), and the engine takes xor_ctx bit-identically."""
    cfg = hf_config(arch)
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine], zstd=zstd_level("xor_ctx")), [engine],
                         encoding="xor_ctx", buffer_bytes=4 << 10)
    base = bf16_state(trainer)
    assert sender.update(segments(base))[0][0]
    v2, v3 = list(rl_steps(trainer, 2))
    chunks = iter(segments(v2)[0]())
    first, second = next(chunks), next(chunks)

    def broken():  # v2's first chunk is diffed (its positions staged) as the second comes, then the gather dies
        yield first
        yield second
        raise RuntimeError("gather failed")

    assert not sender.update([broken])[0][0]
    assert sender.state.staged
    back = 0
    for name, _ in first:  # half of what v2 changed there goes back to the base in v3
        moved = torch.nonzero(v2[name].view(torch.int16) != base[name].view(torch.int16))[::2, 0]
        v3[name].view(-1)[moved] = base[name].view(-1)[moved]
        back += moved.numel()
    assert back
    raw = sorted(sender.status[0].xor_raw)
    for name in raw:  # coded against zero: an element at +0.0 is a step of 0 too
        v3[name].view(-1)[:3] = 0.0
    assert (arch == "qwen3-tied") == bool(raw)
    assert sender.update(segments(v3))[0][0]
    m = sender.pop_metrics()
    assert m["perf/update_weights_ctx"] == 1 and m["perf/update_weights_full_sync_engines"] == 0
    assert_params_equal(engine.host.model, reference(cfg, v3))

def test_xor_zstd_goes_to_engines_at_the_base_and_planes_to_the_others(tmp_path):
    """Two engines, one of which misses a sync: while it is behind the snapshot's version, that sync's deltas are
    planes_zstd (right for any engine in range) for both; once both are back at the base, xor_zstd again. An engine
    whose views cannot give every base (a loader that transforms a param) refuses xor_zstd unwritten and gets
    planes_zstd from then on, by the status code alone."""
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engines = [LocalEngine(cfg), LocalEngine(cfg)]
    sender = DeltaSender(DiskTransport(str(tmp_path), engines, zstd=3), engines, encoding="xor_zstd")
    states = [bf16_state(trainer)] + list(rl_steps(trainer, 4))
    assert all(ok for ok, _ in sender.update(segments(states[0])).values())
    assert sender.update(segments(states[1]))[0][0] and sender.pop_metrics()["perf/update_weights_xor"] == 1
    native = engines[1].update_weights_from_disk
    engines[1].update_weights_from_disk = lambda *a: (_ for _ in ()).throw(ConnectionError("request lost"))
    results = sender.update(segments(states[2]))  # engine 1 misses version 3: the snapshot stays at 2
    assert results[0][0] and not results[1][0]
    engines[1].update_weights_from_disk = native
    results = sender.update(segments(states[3]))  # engine 0 at 3, engine 1 at 2: not both at the base
    assert all(ok for ok, _ in results.values()), results
    m = sender.pop_metrics()
    assert m["perf/update_weights_xor"] == 0 and m["perf/update_weights_full_sync_engines"] == 0
    results = sender.update(segments(states[4]))
    assert all(ok for ok, _ in results.values()) and sender.pop_metrics()["perf/update_weights_xor"] == 1
    for e in engines:
        assert_params_equal(e.host.model, reference(cfg, states[4]))


def test_an_engine_that_cannot_rebuild_xor_gets_planes(tmp_path):
    """An engine that says it can rebuild xor_zstd values but then cannot (here: its readiness withdrawn after the
    full sync, as when a view turns out unreadable) refuses the request unwritten with code ``no_base``; the sender
    learns that from the status and sends planes_zstd from then on, without a full sync."""
    from sglang.srt.weight_sync.delta.receiver import receiver_state

    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine], zstd=3), [engine], encoding="xor_zstd")
    states = [bf16_state(trainer)] + list(rl_steps(trainer, 2))
    assert sender.update(segments(states[0]))[0][0]
    st = receiver_state(engine.host.model)
    assert st.xor_ready and delta_status(engine.host.model).xor
    st.xor_ready = False
    ok, msg = sender.update(segments(states[1]))[0]
    assert not ok and "cannot read them all through recorded views" in msg
    assert sender.pop_metrics()["perf/update_weights_xor"] == 1
    status = delta_status(engine.host.model)
    assert (status.code, status.needs_full, status.version) == ("no_base", False, 1)
    assert_params_equal(engine.host.model, reference(cfg, states[0]))  # untouched
    assert sender.update(segments(states[2]))[0][0]
    m = sender.pop_metrics()
    assert m["perf/update_weights_xor"] == 0 and m["perf/update_weights_full_sync_engines"] == 0
    assert_params_equal(engine.host.model, reference(cfg, states[2]))


def test_the_disk_writer_queue_is_bounded(tmp_path, monkeypatch):
    """A sender faster than its disk waits in submit once two flushes are queued or being written (back-pressure),
    instead of holding every flush of a sync in host memory; every file still lands."""
    import threading

    from cpu_harness import full_flushes
    from sglang.srt.weight_sync.delta import transport as tr

    gate, native = threading.Event(), tr.flush_file
    monkeypatch.setattr(tr, "flush_file", lambda payload, level: gate.wait(30) and native(payload, level))
    writer = tr.AsyncSafetensorsWriter(max_queued=2)
    payloads = full_flushes({f"w{k}": torch.ones(4, dtype=torch.bfloat16) * k for k in range(3)}, version=1,
                            max_params=1)
    submitted = []
    t = threading.Thread(target=lambda: [submitted.append(writer.submit(str(tmp_path / f"f{k}"), p))
                                         for k, p in enumerate(payloads)])
    t.start()
    t.join(1.0)
    assert len(submitted) == 2 and t.is_alive()  # the third waits for a slot
    gate.set()
    t.join(30)
    assert len(submitted) == 3 and all(f.result(30) > 0 for f in submitted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0", "f1", "f2"]
    writer.close()


def test_the_snapshot_fold_lands_every_change_joined():
    """A commit folds what a sync sent into the snapshot, one scatter per slab: the snapshot equals the new
    tensors."""
    from sglang.srt.weight_sync.delta.snapshot import DeltaState

    g = torch.Generator().manual_seed(3)
    old = {f"p{k}": torch.randn(n, generator=g).to(torch.bfloat16) for k, n in enumerate([10, 100, 1000, 5000, 7])}
    new = {k: v.clone() for k, v in old.items()}
    for v in new.values():
        v[::3] += 1
    state = DeltaState(torch.device("cpu"))
    state.record(list(old.items()), [])  # the first sync: whole copies, cut from one slab
    state.commit(1)
    assert len({t.untyped_storage().data_ptr() for t in state.snapshot.values()}) == 1
    chunk = list(new.items())
    state.record(chunk, state.changes(chunk, [state.snapshot[k] for k, _ in chunk]))
    state.commit(2)
    for k, v in new.items():
        assert torch.equal(state.snapshot[k].view(torch.int16), v.view(torch.int16)), k


def test_a_commit_folds_behind_and_whatever_reads_the_snapshot_waits_for_it(monkeypatch):
    """``commit`` returns while its fold still runs on a thread; the snapshot, read through ``state.snapshot``, is
    the new tensors once it is done. A fold that fails (a recorded position outside its tensor, as memory corruption
    would leave it) drops the snapshot and is raised once, at the next read, naming the version."""
    import threading

    from sglang.srt.weight_sync.delta.snapshot import DeltaState

    g = torch.Generator().manual_seed(4)
    old = {f"p{k}": torch.randn(n, generator=g).to(torch.bfloat16) for k, n in enumerate([10, 1000, 70000])}
    new = {k: v.clone() for k, v in old.items()}
    for v in new.values():
        v[::7] += 1
    state = DeltaState(torch.device("cpu"))
    state.record(list(old.items()), [])
    state.commit(1)
    gate, fold = threading.Event(), DeltaState._fold
    monkeypatch.setattr(DeltaState, "_fold", lambda self, sent: (gate.wait(), fold(self, sent)))
    chunk = list(new.items())
    state.record(chunk, state.changes(chunk, [state.snapshot[k] for k, _ in chunk]))
    state.commit(2)
    assert state.version == 2 and state._folding.is_alive()  # commit returned before its fold
    gate.set()
    assert all(torch.equal(state.snapshot[k].view(torch.int16), v.view(torch.int16)) for k, v in new.items())
    monkeypatch.undo()
    newer = {k: v.clone().add_(1) for k, v in new.items()}
    chunk = list(newer.items())
    state.record(chunk, state.changes(chunk, [state.snapshot[k] for k, _ in chunk]))
    state._sent[0][2][-1] = 1 << 40  # a position far outside its tensor
    state.commit(3)
    with pytest.raises(DeltaError, match="folding version 3 into the snapshot failed"):
        state.snapshot
    assert state.snapshot == {}  # raised once; every param has no base now


def test_a_failed_snapshot_fold_is_counted_and_turns_the_next_sync_into_a_full_one(tmp_path, monkeypatch):
    """The sender runs the fold behind its sync; when it fails, the next sync finds no snapshot to diff against:
    every engine gets a full sync (counted as such and as a fold failure), which makes the snapshot again, and the
    sync after that is a delta. Engines end bit-identical throughout."""
    from sglang.srt.weight_sync.delta.snapshot import DeltaState

    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine]), [engine], encoding="deltas")
    assert sender.update(segments(bf16_state(trainer)))[0][0]
    steps = rl_steps(trainer, 3)
    fold = DeltaState._fold

    def broken(self, sent):
        raise RuntimeError("host memory error")

    monkeypatch.setattr(DeltaState, "_fold", broken)
    state = next(steps)
    assert sender.update(segments(state))[0][0]  # acknowledged: the fold that fails runs behind it
    monkeypatch.setattr(DeltaState, "_fold", fold)
    m = sender.pop_metrics()
    assert m["perf/update_weights_full_sync_engines"] == 0 and m["perf/update_weights_snapshot_fold_failures"] == 0
    for full in (1, 0):
        state = next(steps)
        assert sender.update(segments(state))[0][0]
        m = sender.pop_metrics()
        assert m["perf/update_weights_full_sync_engines"] == full, m
        assert m["perf/update_weights_snapshot_fold_failures"] == full and \
            m["perf/update_weights_snapshot_fold_failures_total"] == 1
        assert_params_equal(engine.host.model, reference(cfg, state))


@pytest.mark.parametrize("encoding", ["deltas", "xor_zstd"])
def test_a_chunk_added_whole_flushes_as_param_by_param(encoding):
    """The sender's usual chunk (one diff run over all of it, in order) goes into the bucket whole, with no call per
    param: its flush is the one ``add_found`` param by param makes (spec, positions, values, bases), unchanged
    params left out. A chunk that would reach the bucket's bound is refused whole (nothing added), so the caller's
    param-by-param loop puts the flush boundaries where they belong."""
    from sglang.srt.weight_sync.delta.bucket import DeltaBucket
    from sglang.srt.weight_sync.delta.snapshot import DeltaState

    g = torch.Generator().manual_seed(9)
    old = {f"layers.{k // 3}.w{k % 3}": torch.randn(50 + k, generator=g).to(torch.bfloat16) for k in range(12)}
    new = {n: t.clone() for n, t in old.items()}
    for k, t in enumerate(new.values()):
        if k not in (0, 5, 11):  # unchanged, first, middle and last
            t[k % 4::5] += 1
    state = DeltaState(torch.device("cpu"))
    state.record(list(old.items()), [])
    state.commit(1)
    chunk = list(new.items())
    found = state.changes(chunk, [state.snapshot[n] for n, _ in chunk], olds=encoding == "xor_zstd")
    whole, each = DeltaBucket(encoding, 1 << 20), DeltaBucket(encoding, 1 << 20)
    assert whole.add_chunk(chunk, found)
    (f,) = found
    for j, (name, t) in enumerate(chunk):
        if f.counts[j]:
            each.add_found(f, j, name, list(t.shape))
    assert len(whole) == len(each) == 9 and whole.nbytes == each.nbytes and whole.last == each.last
    (a,), (b,) = whole.take(version=2, base_version=1), each.take(version=2, base_version=1)
    assert a.spec.to_json() == b.spec.to_json() and torch.equal(a.positions, b.positions)
    assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))
    assert (a.base is None) == (encoding != "xor_zstd") and (a.base is None or torch.equal(a.base, b.base))
    small = DeltaBucket(encoding, f.idx.numel() * 6)  # the chunk would reach it
    assert not small.add_chunk(chunk, found) and len(small) == 0 and small.nbytes == 0


@pytest.mark.parametrize("encoding", ["deltas", "xor_zstd"])
def test_a_diff_run_stays_one_bucket_entry_from_diff_to_flush(monkeypatch, encoding):
    """Params one diff found together stay joined in the bucket (views of the run, not one entry per param): a flush
    takes one entry per stretch of the run, cut only at flush boundaries and where a param of its dtype goes
    another way (here one sent dense); unchanged params inside it are left out without cutting it. Every flush
    decodes, param by param, to the new tensors' bytes (``xor_zstd``: its bases are the snapshot's bytes there), and
    the recorded runs fold into the snapshot bit for bit."""
    from sglang.srt.weight_sync.delta import bucket
    from sglang.srt.weight_sync.delta.bucket import DeltaBucket
    from sglang.srt.weight_sync.delta.snapshot import DeltaState
    from sglang.srt.weight_sync.delta.ops import INT_VIEW
    from sglang.srt.weight_sync.delta.validate import validate_payload

    entries = []
    monkeypatch.setattr(bucket, "encode_gathered", lambda items, *a, **k: (
        entries.append([g.names for g in items]), encode_gathered(items, *a, **k))[1])
    g = torch.Generator().manual_seed(7)
    old = {f"m{k}.w": torch.randn(40 + k, generator=g).to(torch.float32 if k == 10 else torch.bfloat16)
           for k in range(30)}
    new = {n: t.clone() for n, t in old.items()}
    for k, (n, t) in enumerate(new.items()):
        if k not in (3, 4, 20):  # unchanged
            t[k % 5::6] += 1
    state = DeltaState(torch.device("cpu"))
    state.record(list(old.items()), [])
    state.commit(1)
    chunk = list(new.items())
    xor = encoding == "xor_zstd"
    found = state.changes(chunk, [state.snapshot[n] for n, _ in chunk], olds=xor)
    member = {k: (f, j) for f in found for j, k in enumerate(f.ks)}
    bucket, payloads = DeltaBucket(encoding, 10 * 8 * 6), []
    for k, (name, t) in enumerate(chunk):
        if bucket.should_flush(name):
            payloads += bucket.take(version=2, base_version=1)
        f, j = member[k]
        if not f.counts[j]:
            continue
        if k == 7:
            bucket.add(name, t, None, state.snapshot[name] if xor else None)
        else:
            bucket.add_found(f, j, name, list(t.shape))
    payloads += bucket.take(version=2, base_version=1)
    assert len(payloads) > 4 and [n for p in payloads for n in map(lambda q: q.name, p.spec.params)] == \
        [n for k, n in enumerate(new) if k not in (3, 4, 20)]
    stretches = [names for flush in entries for names in flush]
    assert len(stretches) < len(new) // 2, entries  # stretches of runs, not params
    assert ["m0.w", "m1.w", "m2.w", "m5.w", "m6.w"] in stretches and ["m7.w"] in stretches, entries  # m3, m4: no cut
    for p in payloads:
        positions = validate_payload(p.seal(spec_only=True), None)
        for q in p.spec.params:
            t, iv = new[q.name], INT_VIEW[new[q.name].element_size()]
            got = old[q.name].clone().view(-1)
            values = p.values[q.val_start:q.val_end]
            if q.dense:
                assert q.name == "m7.w"
                got = values
            else:
                got[positions.of(q)] = values
            assert torch.equal(got.view(iv), t.view(-1).view(iv)), q.name
            if xor:
                base = p.base[q.val_start:q.val_end]
                want = old[q.name].view(-1) if q.dense else old[q.name].view(-1)[positions.of(q)]
                assert torch.equal(base.view(iv), want.view(iv)), q.name
    state.record(chunk, found)  # the runs, unchanged members included, fold into the snapshot in one scatter each
    state.commit(2)
    for name, t in new.items():
        assert torch.equal(state.snapshot[name].view(torch.uint8), t.view(torch.uint8)), name


def test_an_engine_that_cannot_take_deltas_stops_the_sender_with_its_reason(tmp_path):
    """An engine refusing with code ``unsupported`` (here: launched with speculative decoding) fails its sync; the
    next ``update`` raises before sending anything, naming the engine and the reason, instead of retrying full syncs
    forever. A restarted engine without the condition is asked again and synced."""
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    engine.host.server_args.speculative_algorithm = "EAGLE"
    transport = DiskTransport(str(tmp_path), [engine])
    sender = DeltaSender(transport, [engine], encoding="deltas")
    results = sender.update(segments(bf16_state(trainer)))
    assert not results[0][0] and "speculative decoding (EAGLE)" in results[0][1], results
    state = next(rl_steps(trainer, 1))
    requests = engine.requests
    with pytest.raises(DeltaError, match=r"engine 0 cannot take delta weight updates: .*speculative decoding \(EAGLE\)"
                       ) as e:
        sender.update(segments(state))
    assert e.value.code is Refusal.UNSUPPORTED and engine.requests == requests
    restarted = LocalEngine(cfg)
    sender.engines[0] = transport.engines[0] = restarted
    assert sender.update(segments(state))[0][0]
    assert_params_equal(restarted.host.model, reference(cfg, state))
    transport.close()


def test_a_fingerprint_sync_checks_the_engines_before_generation_resumes(tmp_path):
    """Where the sender pauses generation itself (engines with ``pause_generation``), a sync that checks fingerprints
    reads them inside the pause: requests never compete with it, and none runs on weights not yet checked."""
    cfg = hf_config("qwen3")
    states = rl_states(cfg, 2, seed=0)
    calls = []

    class Pausing(InProcessEngine):
        def pause_generation(self):
            calls.append("pause")

        def continue_generation(self):
            calls.append("continue")

        def fingerprint(self):
            calls.append("fingerprint")
            return super().fingerprint()

    engine = Pausing(Host(sglang_model(cfg)))
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine]), [engine], encoding="deltas", fingerprint_every=2)
    for state in states:
        assert sender.update([lambda state=state: [list(state.items())]])[0][0]
    sender.transport.close()
    assert calls == ["pause", "continue", "pause", "fingerprint", "continue", "pause", "continue"], calls


def found_elsewhere(old, new, names):
    """``names``' changes from ``old`` to ``new`` with their fingerprint shares, as a trainer's ranks find them (a
    name without a change is left out)."""
    from sglang.srt.weight_sync.delta import fingerprint
    from sglang.srt.weight_sync.delta.diff import ChangeRun, Prediffed, changed_positions

    pos = {n: changed_positions(old[n], new[n]) for n in names}
    names = [n for n in names if pos[n].numel()]
    pos = [pos[n] for n in names]
    run = ChangeRun(list(range(len(names))), [p.numel() for p in pos], torch.cat(pos),
                    torch.cat([new[n].reshape(-1)[p] for n, p in zip(names, pos)]))
    shares = fingerprint.read_shares(fingerprint.tensor_shares([(n, new[n]) for n in names]))
    return Prediffed(list(names), [list(new[n].shape) for n in names], run, shares)


def test_changes_found_elsewhere_land_and_their_shares_must_cover_each_name_whole(tmp_path, caplog):
    """A trainer whose ranks diff their own shards hands the sender those params' changes as ``Prediffed``, with
    fingerprint shares; the sender keeps no snapshot of them. The shares must cover each such name whole: shares that
    leave a name out, or cover part of it (a rank's share lost), are a mismatch — never a name the engine cannot show —
    and the engine is repaired by a full sync (params whole again) before update returns."""
    from sglang.srt.weight_sync.delta import fingerprint, mix64

    cfg = hf_config("qwen2")
    engine = LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine]), [engine], encoding="deltas", fingerprint_every=1)
    states = rl_states(cfg, 4, seed=0)
    away = sorted(n for n in states[0] if ".mlp." in n)

    def first_half(name, t):
        bits = t.reshape(-1).view(torch.int16)[:t.numel() // 2]
        pos, total = torch.arange(bits.numel()), torch.zeros(1, dtype=torch.int64)
        mix64.point_sums(bits, pos, torch.full_like(pos, fingerprint.name_seed(name)), torch.zeros_like(pos), total,
                         mix64.i64(0xFFFF))
        return fingerprint.NameSum(total=int(total) & mix64.M64, count=bits.numel(), dtype="bfloat16")

    def segment(old, new, lie=None):
        def chunks():
            if sender.run.gathers:  # the only engine gets a full sync: every param whole
                return [list(new.items())]
            found = found_elsewhere(old, new, away)
            if lie == "left out":
                del found.shares[away[0]]
            elif lie == "part":
                found.shares[away[1]] = first_half(away[1], new[away[1]])
            return [[(n, t) for n, t in new.items() if n not in away], found]
        return chunks

    assert sender.update([segment(None, states[0])])[0][0]  # the first sync gathers
    sender.state.keep_elsewhere(away)
    assert not set(away) & set(sender.state.snapshot)
    for k, lie in [(1, None), (2, "left out"), (3, "part")]:
        results = sender.update([segment(states[k - 1], states[k], lie)])
        assert results[0][0], results
        m = sender.pop_metrics()
        assert m["perf/update_weights_fingerprint_uncovered"] == 0, (lie, m)
        assert (m["perf/update_weights_fingerprint_mismatches"], m.get("perf/update_weights_repairs", 0)) == \
            ((0, 0) if lie is None else (1, 1)), (lie, m)
        assert_params_equal(engine.host.model, reference(cfg, states[k]))
        assert not set(away) & set(sender.state.snapshot)  # a repair's full sync does not take them back
    lies = [r.getMessage() for r in caplog.records if "fingerprint mismatch" in r.getMessage()]
    assert len(lies) == 2 and repr(away[0]) in lies[0] and repr(away[1]) in lies[1], lies
    kept = next(n for n in states[3] if n not in away)  # its base is the sender's own snapshot: not from elsewhere
    results = sender.update([lambda: [found_elsewhere(states[2], states[3], [kept])]])
    assert not results[0][0] and "this sender keeps their base itself" in results[0][1], results
    sender.transport.close()


def with_facts(found, old, seg_log2, holders=3):
    """``found`` with its base values and its ``xor_ctx`` facts as a trainer's ranks find them: ``holders`` ranks
    each hold a random part of every base, count what they hold of each change's class (``ctx.held_counts``) in an
    aligned space, and the counts are summed."""
    from sglang.srt.weight_sync.delta import ctx

    run, names = found.run, found.names
    offs = ctx.aligned_starts([old[n].numel() for n in names], seg_log2)
    x = torch.cat([torch.arange(old[n].numel()) + int(offs[k]) for k, n in enumerate(names)])
    base = torch.cat([old[n].reshape(-1) for n in names])
    qx = run.idx + torch.repeat_interleave(torch.from_numpy(offs[:-1]), torch.tensor(run.counts))
    run.olds = base[torch.searchsorted(x, qx)]
    owner = torch.randint(0, holders, (x.numel(),), generator=torch.Generator().manual_seed(7))
    rows = sum(ctx.held_counts(x[owner == h], base[owner == h], qx, run.olds, seg_log2) for h in range(holders))
    run.facts = rows[:2]
    return found


def test_xor_ctx_codes_changes_found_elsewhere_from_the_ranks_facts(tmp_path):
    """The sharded sender's xor_ctx on the sender's side: changes found elsewhere come with their base values and
    the facts the ranks found (no base); with the sender's own params they share aligned flushes, which the
    engine decodes against its whole base, bit-identically. One lying count (a rank's wrong share) is refused by
    the engine before a write: it keeps the last version exactly."""
    from sglang.srt.weight_sync.delta import ctx

    cfg = hf_config("qwen2")
    engine = LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine], zstd=1), [engine], encoding="xor_ctx",
                         buffer_bytes=64 << 10)
    seg_log2 = ctx.seg_log2_for(64 << 10)
    states = rl_states(cfg, 3, seed=0)
    away = sorted(n for n in states[0] if ".mlp." in n or "embed" in n)

    def segment(old, new, lie=False):
        def chunks():
            if sender.run.gathers:
                return [list(new.items())]
            found = with_facts(found_elsewhere(old, new, away), old, seg_log2)
            if lie:
                found.run.facts[0, 5] += 1
            return [[(n, t) for n, t in new.items() if n not in away], found]
        return chunks

    assert sender.update([segment(None, states[0])])[0][0]
    sender.state.keep_elsewhere(away)
    assert sender.update([segment(states[0], states[1])])[0][0]
    m = sender.pop_metrics()
    assert m["perf/update_weights_ctx"] == 1, m
    assert_params_equal(engine.host.model, reference(cfg, states[1]))
    ok, why = sender.update([segment(states[1], states[2], lie=True)])[0]
    assert not ok and ("xor_ctx streams" in why or "checksum mismatch" in why), why
    assert_params_equal(engine.host.model, reference(cfg, states[1]))
    sender.transport.close()


def test_a_full_sync_for_one_engine_keeps_the_changes_found_elsewhere_for_the_others(tmp_path):
    """One engine needs a full sync (it missed one) while the other is at the base: as slime's sharded sender gives
    them, the params whole go to the first only and the changes found elsewhere to the second — the sync's wire
    bytes are a full sync's plus a delta's, not two full syncs'; both end bit-identical."""
    cfg = hf_config("qwen2")
    states = rl_states(cfg, 4, seed=0)
    away = sorted(n for n in states[0] if ".mlp." in n)
    states[2][away[0]] = states[1][away[0]].clone()  # unchanged in the mixed sync: no changes came for it
    a, b = LocalEngine(cfg), LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [a, b]), [a, b], encoding="deltas")

    def segment(old, new):
        def chunks():
            run = sender.run
            out = [found_elsewhere(old, new, away)] if run.targets["delta"] else []
            return out + [[(n, t) for n, t in new.items() if run.gathers or n not in away]]
        return chunks

    assert all(ok for ok, _ in sender.update([segment(None, states[0])]).values())  # both: full
    full_bytes = sender.pop_metrics()["perf/update_weights_wire_bytes"]
    sender.state.keep_elsewhere(away)
    b.down = True
    assert [ok for ok, _ in sender.update([segment(states[0], states[1])]).values()] == [True, False]
    sender.pop_metrics()
    b.down = False
    results = sender.update([segment(states[1], states[2])])  # a: a delta from v2; b: a full sync
    assert all(ok for ok, _ in results.values()), results
    m = sender.pop_metrics()
    assert m["perf/update_weights_full_sync_engines"] == 1 and m["perf/update_weights_density"] < 0.2, m
    assert m["perf/update_weights_wire_bytes"] < 1.3 * full_bytes, (m["perf/update_weights_wire_bytes"], full_bytes)
    assert_both_hold(cfg, states[2], a, b)
    assert all(ok for ok, _ in sender.update([segment(states[2], states[3])]).values())  # both: deltas
    assert_both_hold(cfg, states[3], a, b)
    assert not set(away) & set(sender.state.snapshot)
    sender.transport.close()


def pieces_of(found, name, cut):
    """``found`` as the sharded sender's rounds give a name with more changes than a round: ``name``'s positions
    below ``cut`` with every other name, then the rest of it alone, each piece with its range."""
    from sglang.srt.weight_sync.delta.diff import ChangeRun, Prediffed

    run, j = found.run, found.names.index(name)
    a, b = sum(run.counts[:j]), sum(run.counts[:j + 1])
    low = a + int((run.idx[a:b] < cut).sum())
    cols = [t for t in (run.idx, run.values, run.olds) if t is not None]
    head = [torch.cat([t[:low], t[b:]]) for t in cols]
    tail = [t[low:b] for t in cols]
    counts = list(run.counts)
    counts[j] = low - a
    numel = math.prod(found.shapes[j])
    first = Prediffed(found.names, found.shapes, ChangeRun(list(range(len(counts))), counts, *head), found.shares,
                      ranges={name: (0, cut)})
    second = Prediffed([name], [found.shapes[j]], ChangeRun([0], [b - low], *tail), {}, ranges={name: (cut, numel)})
    return first, second


@pytest.mark.parametrize("encoding", ["deltas", "xor_zstd", "xor_ctx"])
def test_a_param_found_elsewhere_in_pieces_lands_with_each_piece_in_its_own_flush(tmp_path, encoding):
    """The sharded sender splits a name with more changes than a round by position (for xor_ctx at a segment
    bound): its pieces come one after the other, each past the last, and each starts a flush of its own (an engine
    refuses a flush naming a param twice); the engine ends bit-identical. A piece that overlaps the last one, a
    name again without a range, or a range the param does not hold fail the sync before its flush: the engine
    keeps its version exactly."""
    from sglang.srt.weight_sync.delta import ctx

    cfg = hf_config("qwen2", vocab=2048)  # an embedding of two segments of 2**16
    engine = LocalEngine(cfg)
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine], zstd=zstd_level(encoding)), [engine],
                         encoding=encoding, buffer_bytes=4 << 10, fingerprint_every=1)
    seg_log2 = ctx.seg_log2_for(4 << 10)
    states = rl_states(cfg, 5, seed=0)
    embed = "model.embed_tokens.weight"
    away = sorted(n for n in states[0] if ".mlp." in n or n == embed)
    cut = 1 << seg_log2
    assert states[0][embed].numel() == 2 * cut

    def segment(old, new, lie=None):
        def chunks():
            if sender.run.gathers:
                return [list(new.items())]
            found = found_elsewhere(old, new, away)
            at = found.run.idx.split(found.run.counts)
            found.run.olds = None if encoding == "deltas" else \
                torch.cat([old[n].reshape(-1)[p] for n, p in zip(found.names, at)])
            first, second = pieces_of(found, embed, cut)
            if encoding == "xor_ctx":
                first, second = (with_facts(p, old, seg_log2) for p in (first, second))
            if lie == "overlaps":
                second.ranges = {embed: (cut - 1, 2 * cut)}
            elif lie == "no range":
                second.ranges = None
            elif lie == "outside":
                second.ranges = {embed: (cut, 2 * cut + 1)}
            return [[(n, t) for n, t in new.items() if n not in away], first, second]
        return chunks

    assert sender.update([segment(None, states[0])])[0][0]
    sender.state.keep_elsewhere(away)
    assert sender.update([segment(states[0], states[1])])[0][0]
    m = sender.pop_metrics()
    assert m["perf/update_weights_fingerprint_mismatches"] == 0 and m["perf/update_weights_density"] < 0.2, m
    assert_params_equal(engine.host.model, reference(cfg, states[1]))
    for k, (lie, why) in enumerate([("overlaps", "came twice in one sync"), ("no range", "came twice in one sync"),
                                    ("outside", f"a piece of positions [{cut}, {2 * cut + 1}) it does not hold")]):
        ok, msg = sender.update([segment(states[1], states[2 + k], lie)])[0]
        assert not ok and why in msg, (lie, msg)
        assert_params_equal(engine.host.model, reference(cfg, states[1]))
    sender.transport.close()
