"""No broadcast can hang: every branch of the weight-update group's failure handling, on gloo, against a real server.

The engine receives a request's blobs in full before it judges anything; what it refuses unreceived (a group it
does not have, a declaration past its bound) the sender notices at once — every engine answered, yet its
broadcast is pending — and a broadcast that merely takes too long meets the sender's deadline. Either way the
sender aborts the group, and its next sync re-creates it through ``NcclTransport.reconnect`` (here
``http_update_group``, the product's helper for plain SGLang servers) and recovers by itself. CUDA/NCCL runs
the same code in ``make gpu-check``.
"""
import time

import pytest

from cpu_harness import Server, bf16_state, engine_mismatch, hf_config, hf_model, rl_steps, segments, write_hf_checkpoint
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import HttpEngine, NcclTransport, http_update_group
from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES, DeltaStatus

GROUP_TIMEOUT_S = 5


class Tampering(HttpEngine):
    """A real HttpEngine whose next distributed request can be delayed or sent to another group name."""

    delay_s, group = 0.0, None

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, delta, weight_version):
        delay, group, self.delay_s, self.group = self.delay_s, self.group, 0.0, None
        time.sleep(delay)
        return super().update_weights_from_distributed(names, dtypes, shapes, group or group_name, delta, weight_version)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("deadlines")
    cfg = hf_config("llama", vocab=300)
    boot = write_hf_checkpoint(str(root / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    srv = Server(boot, str(root / "server.log"), extra=["--update-weight-group-timeout", str(GROUP_TIMEOUT_S)]).wait_healthy()
    engine = Tampering(srv.url, timeout=120)
    connect = lambda: http_update_group([engine], "deadlines", backend="gloo", timeout_s=GROUP_TIMEOUT_S)  # noqa: E731
    transport = NcclTransport(connect(), "deadlines", [engine], reconnect=connect, timeout_s=30)
    sender = DeltaSender(transport, [engine], encoding="deltas", buffer_bytes=32 << 10)
    trainer = hf_model(cfg, seed=1)
    state = bf16_state(trainer)
    assert sender.update(segments(state))[0][0]
    yield dict(srv=srv, engine=engine, transport=transport, sender=sender, steps=rl_steps(trainer, 10), state=state)
    transport.close()
    srv.stop()


def _status(engine) -> DeltaStatus:
    (st,) = engine.status()
    return st


def _recovers(w, full: bool):
    """The next sync re-creates the group (product code) and leaves the engine bit-identical."""
    reconnects = w["transport"].reconnects
    state = next(w["steps"])
    assert w["sender"].update(segments(state))[0][0]
    assert w["transport"].reconnects == reconnects + 1
    assert w["sender"].pop_metrics()["perf/update_weights_full_sync_engines"] == (1 if full else 0)
    assert engine_mismatch(w["srv"], state) is None
    w["state"] = state


def test_a_broadcast_the_engine_refuses_unreceived_is_aborted_at_once(world):
    w = world
    w["engine"].group = "no-such-group"  # the engine cannot receive: it refuses before the broadcast
    t0 = time.monotonic()
    ok, msg = w["sender"].update(segments(next(w["steps"])))[0]
    elapsed = time.monotonic() - t0
    assert not ok and "every engine answered but the broadcast did not complete" in msg, msg
    assert elapsed < 10, elapsed  # not the 30 s deadline, not the 5 s group timeout of every later flush
    st = _status(w["engine"])
    assert (st.code, st.received, st.version, st.needs_full) == ("not_received", False, w["sender"].state.version, False)
    assert engine_mismatch(w["srv"], w["state"]) is None  # untouched
    _recovers(w, full=False)  # the engine's status allows a delta: no full sync


def test_a_broadcast_past_its_deadline_is_aborted_and_the_engine_gives_up_too(world):
    w = world
    w["transport"].timeout_s = 1.0
    # The engine joins late: the sender's deadline passes first. (gloo cannot cancel the sender's pending
    # send — it ends at the group timeout — so the engine joins only after that, to find nobody sending.)
    late = GROUP_TIMEOUT_S + 2
    w["engine"].delay_s = late
    try:
        t0 = time.monotonic()
        ok, msg = w["sender"].update(segments(next(w["steps"])))[0]
        elapsed = time.monotonic() - t0
    finally:
        w["transport"].timeout_s = 30
    assert not ok and "the broadcast did not complete within 1 s" in msg, msg
    # bounded by the engine's own wait: it joined late, then gave up after its group timeout
    assert elapsed < late + GROUP_TIMEOUT_S + 10, elapsed
    st = _status(w["engine"])
    assert (st.code, st.received) == ("not_received", False) and not st.needs_full
    assert engine_mismatch(w["srv"], w["state"]) is None
    _recovers(w, full=False)


def test_a_declaration_past_the_engines_bound_is_refused_unreceived(world):
    w = world
    bound = _status(w["engine"]).max_request_bytes
    assert bound > 0
    ok, msg = w["engine"].update_weights_from_distributed(
        [POSITIONS, VALUES], ["uint8", "bfloat16"], [[0], [bound]], "deadlines", "{}", "99")
    assert not ok and f"exceeds this engine's max_request_bytes {bound}" in msg, msg
    assert _status(w["engine"]).received is False
    w["transport"].broken = True  # nothing was broadcast; the next sync re-creates the group all the same
    _recovers(w, full=False)


def test_the_sender_never_declares_more_than_the_engines_bound(world):
    w = world
    w["sender"].status[0].max_request_bytes = 1000  # as an engine with a tiny bound would report
    try:
        ok, msg = w["sender"].update(segments(next(w["steps"])))[0]
    finally:
        w["sender"].status[0].max_request_bytes = _status(w["engine"]).max_request_bytes
    assert not ok and "exceeds the engines' max_request_bytes 1000" in msg, msg
    st = _status(w["engine"])  # flushes before the oversized one may have landed: the version is pending, not dirty
    assert st.version == w["sender"].state.version and not st.needs_full
    w["transport"].broken = True
    _recovers(w, full=False)
