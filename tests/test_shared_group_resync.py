"""Over a shared weight-update group, one engine's full sync stays that engine's: two real servers, one restarted;
the other receives the full sync's broadcasts without applying them and keeps applying deltas. With a version store
beside the group, an engine that joins late catches up from the store and nothing crosses the group for it."""
import os

import pytest

from cpu_harness import Server, bf16_state, engine_mismatch, hf_config, hf_model, rl_steps, segments, write_hf_checkpoint
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.store.publish import NcclStoreTransport, StoreTransport
from sglang.srt.weight_sync.delta.transport import HttpEngine, NcclTransport, http_update_group

GROUP_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("resync")
    cfg = hf_config("llama", vocab=300)
    boot = write_hf_checkpoint(str(tmp_path / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    flags = ["--update-weight-group-timeout", str(GROUP_TIMEOUT_S)]
    servers = [Server(boot, str(tmp_path / f"server{k}.log"), extra=flags) for k in range(2)]
    try:
        for s in servers:
            s.wait_healthy()
        yield dict(boot=boot, flags=flags, servers=servers, root=tmp_path, cfg=cfg)
    finally:
        for s in servers:
            s.stop()


def applied(engine):
    (st,) = engine.status()
    return st.applied


def test_a_restarted_engine_gets_the_only_full_sync(world):
    servers = world["servers"]
    engines = [HttpEngine(s.url, timeout=120) for s in servers]
    connect = lambda: http_update_group(engines, "resync", backend="gloo", timeout_s=GROUP_TIMEOUT_S)  # noqa: E731
    transport = NcclTransport(connect(), "resync", engines, reconnect=connect, timeout_s=30)
    sender = DeltaSender(transport, engines, encoding="deltas", buffer_bytes=32 << 10)
    trainer = hf_model(world["cfg"], seed=1)
    steps = rl_steps(trainer, 10)
    try:
        def sync(state):
            results = sender.update(segments(state))
            return results, sender.pop_metrics()

        state = bf16_state(trainer)
        results, m = sync(state)
        assert all(ok for ok, _ in results.values()) and m["perf/update_weights_full_sync_engines"] == 2, results
        state = next(steps)
        results, m = sync(state)
        assert all(ok for ok, _ in results.values()) and m["perf/update_weights_full_sync_engines"] == 0, results
        assert [applied(e) for e in engines] == [{"full": 1, "delta": 1}] * 2

        servers[1].stop()  # engine 1 restarts: it comes back fresh, outside the group
        servers[1] = Server(world["boot"], str(world["root"] / "server1-restarted.log"), extra=world["flags"])
        servers[1].wait_healthy()
        engines[1].url = servers[1].url
        state = next(steps)
        results, m = sync(state)  # the group has a member that is gone: the sync fails and the group is aborted
        assert not any(ok for ok, _ in results.values()), results
        # How much of it reached engine 0 is timing: a broadcast reaches live members before the dead one's
        # link fails it, so it holds none of it, some flushes (not committed; the sender re-sends their
        # positions), all of it (committed), or wrote part and then failed a flush (dirty). Each state has one
        # right next step, asserted below; every outcome ends bit-identical.
        mid = {0: engines[0].status()[0]}
        for k, st in mid.items():
            assert (st.version, st.applied) in [(2, {"full": 1, "delta": 1}), (3, {"full": 1, "delta": 2})], (k, st)
            assert st.needs_full == (st.reason == "dirty") and (st.reason != "dirty" or st.version == 2), (k, st)
        dirty = [k for k, st in mid.items() if st.needs_full]

        def bumped(k, kind):  # engine k's applied counts after one more sync of this kind
            before = dict(mid[k].applied) if k in mid else {}
            return {**before, kind: before.get(kind, 0) + 1}

        state = next(steps)
        results, m = sync(state)  # the group is re-created; engine 1 and any dirty engine get a full sync
        assert all(ok for ok, _ in results.values()), results
        assert m["perf/update_weights_full_sync_engines"] == 1 + len(dirty) and transport.reconnects == 1, (m, mid)
        assert [applied(e) for e in engines] == [bumped(k, "full" if k in dirty or k == 1 else "delta")
                                                 for k in range(2)], mid
        for s in servers:
            assert engine_mismatch(s, state) is None
        after = [applied(e) for e in engines]

        state = next(steps)
        results, m = sync(state)
        assert all(ok for ok, _ in results.values()) and m["perf/update_weights_full_sync_engines"] == 0, results
        assert [applied(e) for e in engines] == [{**a, "delta": a.get("delta", 0) + 1} for a in after]
        for s in servers:
            assert engine_mismatch(s, state) is None
    finally:
        transport.close()


def test_beside_the_group_a_store_lets_a_late_engine_catch_up_with_nothing_crossing_the_group(world):
    """``--update-weight-store`` beside nccl: each request is broadcast and filed in the store, the first sync's full
    broadcast as the store's anchor. Engine 1 stays out of the group for three syncs (whatever version it held
    before); when it joins, the sync broadcasts the delta alone and engine 1 catches up from the store by itself:
    the anchor, then the chain. Both end bit-identical at the store's HEAD."""
    servers, root = world["servers"], world["root"]
    engines = [HttpEngine(s.url, timeout=120) for s in servers]
    url = str(root / "store")
    os.makedirs(url)

    def joined(members):
        connect = lambda: http_update_group(members, "beside", backend="gloo", timeout_s=GROUP_TIMEOUT_S)  # noqa
        return NcclStoreTransport(connect(), "beside", members, StoreTransport(url, members, zstd=1),
                                  reconnect=connect, timeout_s=30)

    transport = joined(engines[:1])
    sender = DeltaSender(transport, engines[:1], encoding="deltas", buffer_bytes=32 << 10)
    trainer = hf_model(world["cfg"], seed=3)
    steps = rl_steps(trainer, 4, seed=5)
    try:
        state = bf16_state(trainer)
        assert sender.update(segments(state))[0][0]
        full = sender.pop_metrics()
        assert full["perf/update_weights_full_sync_engines"] == 1
        for _ in range(2):
            state = next(steps)
            assert sender.update(segments(state))[0][0]
            assert sender.pop_metrics()["perf/update_weights_full_sync_engines"] == 0
        transport.close()
        transport = joined(engines)  # engine 1 joins (as slime re-connects its engines)
        sender.attach(transport, engines)
        state = next(steps)
        results = sender.update(segments(state))
        assert all(ok for ok, _ in results.values()), results
        m = sender.pop_metrics()
        assert (m["perf/update_weights_full_sync_engines"], m["perf/update_weights_catch_ups"]) == (0, 1), m
        assert "anchor" in results[1][1], results  # its version was not on this chain: the anchor, then deltas
        assert m["perf/update_weights_wire_bytes"] * 10 < full["perf/update_weights_wire_bytes"], (m, full)
        for s in servers:
            assert engine_mismatch(s, state) is None
        head = [st.version for e in engines for st in e.status()]
        assert head == [sender.version] * 2 and transport.head_version == sender.version
    finally:
        transport.close()
