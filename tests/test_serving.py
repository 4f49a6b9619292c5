"""A patched server with an API key, serving requests around delta syncs.

The key guards the delta paths (and the fingerprint) like every other SGLang admin path. The
sender pauses the engine for the whole multi-flush sync, so no forward pass sees a half-applied
model; requests in flight return (aborted, as slime's pause does) and none is lost.
"""
import concurrent.futures
import time

import pytest
import requests

from cpu_harness import Server, bf16_state, engine_mismatch, hf_config, hf_model, rl_steps, segments, write_hf_checkpoint
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine

KEY = "delta-test-key"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    cfg = hf_config("llama", vocab=300)
    boot = bf16_state(hf_model(cfg, seed=2))
    server = Server(write_hf_checkpoint(str(root / "boot"), cfg, boot), str(root / "server.log"),
                    api_key=KEY).wait_healthy()
    yield dict(root=root, cfg=cfg, boot=boot, server=server)
    server.stop()


def test_the_api_key_guards_the_delta_paths(world):
    intruder = HttpEngine(world["server"].url)  # no key
    transport = DiskTransport(str(world["root"] / "intruder"), [intruder])
    ok, msg = DeltaSender(transport, [intruder]).update(segments(bf16_state(hf_model(world["cfg"], seed=5))))[0]
    transport.close()
    assert not ok and "401" in msg, msg
    with pytest.raises(RuntimeError, match="401"):
        intruder.fingerprint()
    assert engine_mismatch(world["server"], world["boot"]) is None  # untouched


def test_requests_in_flight_when_a_sync_starts_all_return(world):
    """slime's discipline: the sync pauses the engine (in-flight requests return, aborted) and nothing new is
    sent until it resumes; every request gets its answer and the server keeps serving the new weights."""
    server = world["server"]
    engine = HttpEngine(server.url, api_key=KEY)
    transport = DiskTransport(str(world["root"] / "shared"), [engine])
    sender = DeltaSender(transport, [engine], encoding="deltas", buffer_bytes=16 << 10, fingerprint_every=1)
    trainer = hf_model(world["cfg"], seed=1)

    def generate(i, tokens):
        r = requests.post(server.url + "/generate", headers=server.headers, timeout=300, json={
            "text": f"request {i}", "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                        "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["meta_info"]["finish_reason"]["type"]

    state = bf16_state(trainer)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for k in range(3):
            in_flight = [pool.submit(generate, i, 240) for i in range(8)]
            time.sleep(0.5)
            ok, msg = sender.update(segments(state))[0]
            assert ok, msg
            reasons = [f.result() for f in in_flight]
            assert set(reasons) <= {"abort", "length"}, reasons
            assert [f.result() for f in [pool.submit(generate, i, 8) for i in range(8)]] == ["length"] * 8
            state = next(rl_steps(trainer, 1, seed=k))
    transport.close()
    assert sender.pop_metrics()["perf/update_weights_fingerprint_mismatches"] == 0
    assert engine_mismatch(server, sender.state.snapshot) is None
