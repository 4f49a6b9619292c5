"""Disk transport with four real servers: each publish is announced to every engine at once (finalize does not grow
with the engine count), and every engine ends bit-identical. Runs with ``make soak`` (four servers)."""
import threading
import time

import pytest

from cpu_harness import Server, bf16_state, engine_mismatch, hf_config, hf_model, rl_steps, segments, write_hf_checkpoint
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine

ENGINES = 4


class TimedEngine(HttpEngine):
    """A plain HTTP client of a real server that notes when each announcement was in flight."""

    def __init__(self, url, spans):
        super().__init__(url, timeout=120)
        self.spans = spans

    def update_weights_from_disk(self, model_path, files, weight_version):
        t0 = time.perf_counter()
        try:
            return super().update_weights_from_disk(model_path, files, weight_version)
        finally:
            with self.spans["lock"]:
                self.spans["calls"].append((t0, time.perf_counter()))


@pytest.fixture
def servers(tmp_path):
    cfg = hf_config("llama", vocab=300)
    boot = write_hf_checkpoint(str(tmp_path / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    out = [Server(boot, str(tmp_path / f"server{k}.log")) for k in range(ENGINES)]
    try:
        for s in out:
            s.wait_healthy()
        yield dict(servers=out, cfg=cfg, root=tmp_path)
    finally:
        for s in out:
            s.stop()


def test_every_engine_gets_each_publish_at_once(servers):
    spans = {"lock": threading.Lock(), "calls": []}
    engines = [TimedEngine(s.url, spans) for s in servers["servers"]]
    transport = DiskTransport(str(servers["root"] / "shared"), engines)
    sender = DeltaSender(transport, engines, encoding="deltas", buffer_bytes=16 << 10)
    steps = rl_steps(hf_model(servers["cfg"], seed=1), 3)
    finalize = []
    try:
        for k, state in enumerate(steps):
            spans["calls"].clear()
            results = sender.update(segments(state, subpasses=1))  # one publish per sync: one announcement each
            m = sender.pop_metrics()
            assert all(ok for ok, _ in results.values()), results
            assert m["perf/update_weights_full_sync_engines"] == (ENGINES if k == 0 else 0), m
            calls = sorted(spans["calls"])
            assert len(calls) == ENGINES, calls
            # all four announcements were in flight together: the last one started before the first one ended
            assert calls[-1][0] < min(end for _, end in calls), calls
            finalize.append((m["perf/update_weights_finalize_s"], max(end - start for start, end in calls)))
            for s in servers["servers"]:
                assert engine_mismatch(s, state) is None
    finally:
        transport.close()
    print(f"per sync, finalize with {ENGINES} engines / the slowest engine's apply (s): "
          f"{', '.join(f'{t:.2f}/{a:.2f}' for t, a in finalize)}")
