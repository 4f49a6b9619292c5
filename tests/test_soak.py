"""Soak: consecutive syncs into a real server that serves generation traffic throughout, faults injected at random
(seeded), zero drift after every sync, for each pause mode (``abort``, ``retract``, ``in_place``).

CI runs ``SOAK_SYNCS`` = 8 syncs per mode (first pin); ``make soak`` runs 200. Every injected fault must show up
in the sender's failure counter; after every sync the engine's fingerprint equals the trainer's last acknowledged
state, and at the end every param read back over HTTP does too. Three streams of requests run all along: none may
fail, only ``abort`` may return them early, and after every committed sync a probe finds no prefix-cache hit on KV
the old weights computed (while a failed sync, which changes no weights, keeps the probe's hit: the probe can see
one). Between two syncs the test waits until as many requests as there are streams, sent after the sync, have
completed (rollouts run between training steps). Every other sync checks the engine's fingerprint inside its own
pause (``fingerprint_every=2``), so the summary line each mode prints (``soak:``) compares requests that spanned no
sync, a plain sync and a fingerprint sync.
"""
import collections
import os
import random
import time

import pytest

from fault_world import World, first_file, flip_bit, resigned, sparse_param
from sglang.srt.weight_sync.delta import fingerprint
from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES
from traffic import Traffic

SYNCS = int(os.environ.get("SOAK_SYNCS", "8"))


def _truncate(vdir):
    path = first_file(vdir)
    os.truncate(path, os.path.getsize(path) // 2)


def _nan(pl):
    pl.values[sparse_param(pl).val_start] = float("nan")


FAULTS = {
    "bit flip in positions": dict(hook=flip_bit(POSITIONS)),
    "bit flip in values": dict(hook=flip_bit(VALUES)),
    "truncated file": dict(hook=_truncate),
    "missing file": dict(hook=lambda vdir: os.remove(first_file(vdir))),
    "NaN among values": dict(hook=resigned(_nan)),
    "engine unreachable": dict(url="http://127.0.0.1:9"),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("soak"))
    w.sender.fingerprint_every = 2
    yield w
    w.transport.close()
    w.server.stop()


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_soak(world, mode):
    world.engine.http.pause_mode = mode
    rng = random.Random(f"20261130-{mode}")
    injected = collections.Counter()
    totals = world.sender.pop_metrics()
    fingerprinted = 0
    t0 = time.perf_counter()
    with Traffic(lambda: world.server.url) as traffic:
        first = traffic.mark()
        traffic.probe()
        for i in range(SYNCS):
            kind = rng.choice(sorted(FAULTS)) if i < SYNCS - 1 and rng.random() < 0.3 else None
            spec = FAULTS.get(kind, {})
            world.hook = spec.get("hook")
            if "url" in spec:
                world.engine.http.url = spec["url"]
            before, start = world.sender.state.version, time.perf_counter()
            ok, msg, state = world.sync()
            world.hook, world.engine.http.url = None, world.server.url
            metrics = world.sender.pop_metrics()
            checked = "perf/update_weights_fingerprint_s" in metrics  # the sender's own check, inside the pause
            assert metrics.get("perf/update_weights_fingerprint_mismatches", 0) == 0, (i, kind, msg)
            if kind:
                assert not ok, f"sync {i}: {kind} went unnoticed"
                injected[kind] += 1
            else:
                assert ok, f"sync {i}: {msg}"
                world.state = state
                fingerprinted += checked
            acked = world.sender.state.version  # the engine holds exactly the last acknowledged state
            theirs = fingerprint.merge_ranks(fingerprint.check_version(world.engine.fingerprint(), acked))
            assert fingerprint.compare(world.state, theirs) == ([], []), f"sync {i} ({kind or 'no fault'}): drift"
            hits = traffic.probe()  # no later request reads KV the old weights computed
            if acked != before:
                assert hits == 0, f"sync {i}: a request after version {acked} reused {hits} tokens of older KV"
            elif mode != "abort":  # abort's pause flushes the cache even when the sync then fails
                assert hits > 0, f"sync {i} ({kind}): the probe's own prefix was lost without a weight change"
            traffic.window(start, "fingerprint" if checked else "plain")
            traffic.wait_completed()  # the rollout between two syncs: requests complete in peace
        traffic.stop()
        world.engine_holds(world.state, world.sender.version)  # zero drift after every fault
        summary = traffic.summary(first)
        reqs = traffic.since(first)
    metrics = {k: v - totals.get(k, 0) for k, v in metrics.items() if k.endswith("_total")}
    failed = [r for r in reqs if r.outcome == "failed"]
    assert not failed, [r.detail for r in failed[:3]]
    assert mode == "abort" or not any(r.outcome == "aborted" for r in reqs), summary
    assert sum(r.outcome == "completed" for r in reqs) >= SYNCS, summary  # traffic ran throughout
    assert metrics["perf/update_weights_failures_total"] == sum(injected.values()), (metrics, injected)
    print(f"\nsoak: {mode}: {SYNCS} syncs in {time.perf_counter() - t0:.0f}s, {sum(injected.values())} faults "
          f"({dict(sorted(injected.items()))}), {metrics['perf/update_weights_resyncs_total']:.0f} full re-syncs, "
          f"{fingerprinted} checked by the sender's fingerprint in the pause; drift 0; {summary}")
