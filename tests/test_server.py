"""A real patched SGLang server on CPU: a full sync, then delta syncs over HTTP — disk files and a gloo group."""
import threading
import time

import pytest
import torch

from cpu_harness import (
    Server,
    bf16_state,
    delta_flushes,
    engine_mismatch,
    full_flushes,
    hf_config,
    hf_model,
    join_update_group,
    rl_states,
    write_hf_checkpoint,
)
from delta_helpers import SGLANG_VERSION
from sglang.srt.weight_sync.delta.files import flush_file
from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES, dtype_to_str

SESSIONS = not SGLANG_VERSION.startswith("0.5.15")  # v0.5.23 wraps distributed updates in a session


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    cfg = hf_config("llama", vocab=300)
    states = rl_states(cfg, 4)
    # The server starts from other weights (seed 2): only the full sync can make it equal the trainer.
    boot = write_hf_checkpoint(str(root / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    server = Server(boot, str(root / "server.log"),  # tests/cpu_shims/delta_test_faults.py: a slow engine on demand
                    env={"SGLANG_DELTA_TEST_SLOW_FILE": str(root / "slow")}).wait_healthy()
    yield {"root": root, "cfg": cfg, "states": states, "server": server}
    server.stop()


def publish(world, payloads, zstd=False):
    """Write one sync's flushes as files, announce each over HTTP; return the responses."""
    out = []
    for pl in payloads:
        vdir = world["root"] / f"weight_v{pl.spec.version:06d}"
        vdir.mkdir(exist_ok=True)
        name = f"rank0000_flush{pl.spec.flush:06d}.safetensors"
        (vdir / name).write_bytes(flush_file(pl, 1 if zstd else None))
        out.append(world["server"].post("/update_weights_from_disk", {
            "model_path": str(vdir), "load_format": "delta", "files": [name], "weight_version": str(pl.spec.version)}))
    return out


def assert_engine_has(server, state):
    name = engine_mismatch(server, state)
    assert name is None, f"{name} differs on the engine"


def test_full_sync_then_deltas_over_disk(world):
    states = world["states"]
    rs = publish(world, full_flushes(states[0], version=1, max_params=6))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    assert_engine_has(world["server"], states[0])
    for v, enc in ((2, "deltas"), (3, "deltas_zstd")):
        rs = publish(world, delta_flushes(states[v - 2], states[v - 1], enc, version=v, base_version=v - 1, max_params=8),
                     zstd=enc == "deltas_zstd")
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        assert_engine_has(world["server"], states[v - 1])


def test_bad_delta_is_refused_with_400_and_weights_untouched(world):
    states = world["states"]
    payload = delta_flushes(states[2], states[3], "indices", version=4, base_version=3)[0]
    payload.values[0] = (payload.values[0].float() + 1).to(payload.values.dtype)  # corrupted after encoding
    r = publish(world, [payload])[0]
    assert r.status_code == 400
    assert "checksum mismatch" in r.json()["message"]
    assert_engine_has(world["server"], states[2])


def test_delta_over_gloo_group(world):
    server, states = world["server"], world["states"]
    pg = join_update_group(server, "delta-http")
    for v, enc in ((4, "indices"), (5, "deltas")):
        for pl in delta_flushes(states[v - 2], states[v - 1], enc, version=v, base_version=v - 1, max_params=10):
            if SESSIONS:
                assert server.post("/begin_weight_update", {}).status_code == 200
            sender = threading.Thread(target=lambda: [torch.distributed.broadcast(x, src=0, group=pg)
                                                      for x in (pl.positions, pl.values)])
            sender.start()
            r = server.post("/update_weights_from_distributed", {
                "names": [POSITIONS, VALUES], "dtypes": ["uint8", dtype_to_str(pl.values.dtype)],
                "shapes": [[pl.positions.numel()], [pl.values.numel()]], "group_name": "delta-http",
                "load_format": "delta", "delta": pl.spec.to_json(), "weight_version": str(v)})
            sender.join(60)
            assert r.status_code == 200, r.text
            if SESSIONS:
                assert server.post("/end_weight_update", {}).status_code == 200
        assert_engine_has(server, states[v - 1])
    assert server.post("/destroy_weights_update_group", {"group_name": "delta-http"}).status_code == 200


def test_generate_equals_a_server_fully_loaded(world):
    """Greedy tokens and logprobs after delta syncs equal a second server that loaded the same weights in full."""
    req = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 8, "temperature": 0},
           "return_logprob": True}
    after_deltas = world["server"].post("/generate", req).json()
    ckpt = write_hf_checkpoint(str(world["root"] / "step4"), world["cfg"], world["states"][4])
    second = Server(ckpt, str(world["root"] / "second.log")).wait_healthy()
    try:
        full = second.post("/generate", req).json()
    finally:
        second.stop()
    assert after_deltas["text"] == full["text"]
    assert after_deltas["meta_info"]["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"]


def test_a_delta_sender_sends_xor_ctx_that_the_server_applies_bit_identically(world):
    """``DeltaSender(encoding="xor_ctx")`` over disk: a full sync, then deltas the server decodes against its committed
    bytes (its status says it can), each bit-identical."""
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine
    from cpu_harness import segments

    engine = HttpEngine(world["server"].url)
    transport = DiskTransport(str(world["root"] / "ctx"), [engine], zstd=1)
    sender = DeltaSender(transport, [engine], encoding="xor_ctx")
    try:
        for k, state in enumerate(world["states"][:4]):
            results = sender.update(segments(state))
            m = sender.pop_metrics()
            assert all(ok for ok, _ in results.values()), results
            assert m["perf/update_weights_ctx"] == (k > 0) and m["perf/update_weights_full_sync_engines"] == (k == 0), m
            assert_engine_has(world["server"], state)
    finally:
        transport.close()


def test_weights_released_without_a_host_copy_get_a_full_sync_after_resume(world):
    """slime's ``--offload-rollout`` releases an engine's weight memory between rollouts; without
    ``--enable-weights-cpu-backup`` their bytes are gone on resume (on a GPU: the CPU's memory saver keeps them).
    After a release and resume the engine serves nothing and says it needs a full sync (``released``): the next delta
    is refused, nothing written, and the sender sends the full sync by itself, bit-identical, before deltas continue
    and generation resumes."""
    from cpu_harness import segments
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine

    server, states = world["server"], world["states"]
    engine = HttpEngine(server.url)
    transport = DiskTransport(str(world["root"] / "offload"), [engine], zstd=1)
    sender = DeltaSender(transport, [engine], encoding="xor_zstd")
    try:
        assert all(ok for ok, _ in sender.update(segments(states[0])).values())
        sender.pop_metrics()
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            r = server.post(path, {"tags": ["weights"]})
            assert r.status_code == 200, r.text
        (status,) = engine.status()
        assert (status.needs_full, status.reason) == (True, "released"), status
        req = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        assert server.post("/generate", req).status_code == 503  # its weights are gone (on a GPU): nothing served
        results = sender.update(segments(states[1]))  # a delta: refused, nothing written; the sender goes full
        assert "the weights' memory was released without a host copy" in results[0][1], results
        for k, state in enumerate(states[1:3]):
            results = sender.update(segments(state))
            assert all(ok for ok, _ in results.values()), results
            assert sender.pop_metrics()["perf/update_weights_full_sync_engines"] == (k == 0)
            assert_engine_has(server, state)
        assert server.post("/generate", req).status_code == 200
    finally:
        transport.close()


def test_a_staged_sync_serves_the_old_version_until_its_commit(world):
    """Stage, then commit, over HTTP: the server fetches each publish's files (``/weights_checker`` ``delta_stage``
    with the files in its ``delta`` field) while it serves a request. When the sender pauses it, the version is
    staged, the server still holds the old weights and generates the old tokens; after the commit it holds the new
    version bit-identically, having read no byte inside the pause. A server with no request in flight is not staged
    for: it says it is idle, and the sender pauses it at once and announces each publish as written."""
    from cpu_harness import StreamedRequest, segments
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine

    server, states = world["server"], world["states"]
    req = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0},
           "return_logprob": True}
    seen = []

    def tokens():  # from an empty cache: the request in flight and an earlier one leave nothing to reuse
        assert server.post("/flush_cache", {}).status_code == 200
        return server.post("/generate", req).json()["meta_info"]["output_token_logprobs"]

    class Watching(HttpEngine):
        def pause_generation(self):  # the gate: every publish fetched, nothing written yet
            (st,) = self.status()
            super().pause_generation()  # aborts the request in flight: the tokens below are computed alone
            super().continue_generation()
            seen.append((st.version, st.staged, engine_mismatch(server, held), tokens()))
            super().pause_generation()

    engine = Watching(server.url)
    transport = DiskTransport(str(world["root"] / "staged"), [engine], zstd=1, stage_timeout=60)
    sender = DeltaSender(transport, [engine], encoding="xor_zstd")
    try:
        held = states[2]  # where the last test left the server
        (world["root"] / "slow").touch()  # each request stays in flight through its sync, however fast this machine
        for state in states[:3]:
            old = tokens()
            busy = StreamedRequest(server, [9, 10, 11], 240)  # running until the gate aborts it
            busy.start()
            assert busy.started.wait(120) and busy.meta is not None
            assert engine.status()[0].idle is False
            results = sender.update(segments(state))
            busy.join(120)
            assert all(ok for ok, _ in results.values()), results
            version, staged, mismatch, new_tokens = seen[-1]
            assert staged == version + 1 and mismatch is None and new_tokens == old, seen[-1][:3]
            assert_engine_has(server, state)
            (st,) = engine.status()
            assert st.timing["in_pause_bytes"] == 0 and st.timing["staged_bytes"] > 0, st
            metrics = sender.pop_metrics()
            assert metrics["perf/update_weights_staged"] == 1 and metrics["perf/update_weights_stage_ready_engines"] == 1
            held = state
        (world["root"] / "slow").unlink()
        deadline = time.time() + 120
        while engine.status()[0].idle is not True and time.time() < deadline:  # the last request drains
            time.sleep(0.05)
        assert engine.status()[0].idle is True
        results = sender.update(segments(states[3]))
        assert all(ok for ok, _ in results.values()), results
        version, staged, mismatch, _ = seen[-1]
        assert staged is None and mismatch is None and version == st.version, seen[-1][:3]  # paused before a fetch
        assert_engine_has(server, states[3])
        metrics = sender.pop_metrics()
        assert metrics["perf/update_weights_staged"] == 0 and "perf/update_weights_stage_s" not in metrics
    finally:
        transport.close()
