"""Over a shared weight-update group, one engine's full sync stays that engine's: three real servers, one restarted;
the other two receive the full sync's broadcasts without applying them and keep applying deltas."""
import pytest

from cpu_harness import Server, bf16_state, engine_mismatch, hf_config, hf_model, rl_steps, segments, write_hf_checkpoint
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import HttpEngine, NcclTransport, http_update_group

GROUP_TIMEOUT_S = 5


@pytest.fixture
def world(tmp_path):
    cfg = hf_config("llama", vocab=300)
    boot = write_hf_checkpoint(str(tmp_path / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    flags = ["--update-weight-group-timeout", str(GROUP_TIMEOUT_S)]
    servers = [Server(boot, str(tmp_path / f"server{k}.log"), extra=flags) for k in range(3)]
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
        assert all(ok for ok, _ in results.values()) and m["perf/update_weights_full_sync_engines"] == 3, results
        state = next(steps)
        results, m = sync(state)
        assert all(ok for ok, _ in results.values()) and m["perf/update_weights_full_sync_engines"] == 0, results
        assert [applied(e) for e in engines] == [{"full": 1, "delta": 1}] * 3

        servers[1].stop()  # engine 1 restarts: it comes back fresh, outside the group
        servers[1] = Server(world["boot"], str(world["root"] / "server1-restarted.log"), extra=world["flags"])
        servers[1].wait_healthy()
        engines[1].url = servers[1].url
        state = next(steps)
        results, m = sync(state)  # the group has a member that is gone: the sync fails and the group is aborted
        assert not any(ok for ok, _ in results.values()), results
        # Engines 0 and 2 did not commit it; a flush whose broadcast reached them before the failure may be written
        # (a sync is applied flush by flush): the next delta re-sends those positions, checked below.
        assert [applied(engines[k]) for k in (0, 2)] == [{"full": 1, "delta": 1}] * 2

        state = next(steps)
        results, m = sync(state)  # the group is re-created; engine 1 alone gets the full sync
        assert all(ok for ok, _ in results.values()), results
        assert m["perf/update_weights_full_sync_engines"] == 1 and transport.reconnects == 1, m
        assert [applied(e) for e in engines] == [{"full": 1, "delta": 2}, {"full": 1}, {"full": 1, "delta": 2}]
        for s in servers:
            assert engine_mismatch(s, state) is None

        state = next(steps)
        results, m = sync(state)
        assert all(ok for ok, _ in results.values()) and m["perf/update_weights_full_sync_engines"] == 0, results
        assert [applied(e) for e in engines] == [{"full": 1, "delta": 3}, {"full": 1, "delta": 1}, {"full": 1, "delta": 3}]
        for s in servers:
            assert engine_mismatch(s, state) is None
    finally:
        transport.close()
