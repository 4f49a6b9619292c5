"""Requests in flight during syncs under each pause mode (``abort``, ``retract``, ``in_place``), against a real server.

Every version is a different random model with a sharp output layer, so a token's log-prob tells which weights (and
whose KV) computed it. Each in-flight request's log-probs are scored against a second, plain server holding the old and
then the new version (SGLang's own full load): the tokens before the sync must come from the old weights; after it,
``retract``'s come from the new weights (recomputed from scratch), ``in_place``'s from the new weights on the request's
own old KV (kept by design, so they match neither). Requests sent after a sync — with the same prompts, whose prefixes
the in-flight requests still hold in the radix tree — must match the plain server exactly: no later request reads KV of
the old weights. v0.5.15's scheduler used to exit on the flush a ``retract``/``in_place`` sync asks for.
"""
import pytest

from cpu_harness import (Server, StreamedRequest, bf16_state, engine_mismatch, hf_config, hf_model, segments,
                         write_hf_checkpoint)
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine

PROMPTS = [[7 + 13 * i + 5 * j for j in range(10)] for i in range(4)]
TOKENS = 120  # in flight when the sync starts (the test model has 256 positions)
TOL = 0.25  # nats; the same weights in another batch shape agree to <0.1 (bf16), other weights differ by whole nats


def sharp_state(cfg, seed):
    model = hf_model(cfg, seed=seed)
    model.lm_head.weight.data *= 40  # peaked distributions: log-probs differ by nats between versions
    return bf16_state(model)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("pause")
    cfg = hf_config("llama", vocab=300)
    boot = write_hf_checkpoint(str(root / "v0"), cfg, sharp_state(cfg, 100))
    room = ["--max-total-tokens", "16384"]  # after a retract SGLang reserves more per request before admitting one
    faults = {"SGLANG_DELTA_TEST_BAD_WRITE_FILE": str(root / "bad-write")}  # tests/cpu_shims: a wrong write on demand
    engine_srv = Server(boot, str(root / "engine.log"), extra=room, env=faults)
    plain = Server(boot, str(root / "plain.log"), extra=room)
    engine_srv.wait_healthy(), plain.wait_healthy()
    engine = HttpEngine(engine_srv.url)
    transport = DiskTransport(str(root / "shared"), [engine])
    sender = DeltaSender(transport, [engine], encoding="deltas", buffer_bytes=64 << 10)
    state = sharp_state(cfg, 101)
    ok, msg = sender.update(segments(state))[0]  # the first sync is a full one
    assert ok, msg
    plain_load(plain, write_hf_checkpoint(str(root / "v1"), cfg, state))
    yield dict(root=root, cfg=cfg, engine_srv=engine_srv, plain=plain, engine=engine, sender=sender, state=state)
    transport.close()
    engine_srv.stop()
    plain.stop()


def plain_load(server, model_dir):
    r = server.post("/update_weights_from_disk", {"model_path": model_dir})
    assert r.status_code == 200 and r.json()["success"], r.text


def generate(server, input_ids, tokens, **extra):
    r = server.post("/generate", {"input_ids": input_ids, "return_logprob": True, **extra, "sampling_params": {
        "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def scored(server, prompt, output_ids):
    """Log-probs the server assigns to ``output_ids`` after ``prompt`` (teacher forcing, one prefill)."""
    meta = generate(server, prompt + output_ids, 1, logprob_start_len=len(prompt) - 1)  # the range's first has none
    return [lp for lp, _, _ in meta["input_token_logprobs"][1:len(output_ids) + 1]]


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_requests_in_flight_through_two_syncs(world, mode):
    engine_srv, plain, sender = world["engine_srv"], world["plain"], world["sender"]
    world["engine"].pause_mode = mode
    synced = attempts = 0
    while synced < 2:  # syncs with every request in flight; one that finished first (a slow machine) is a retry
        attempts += 1
        assert attempts <= 8, "the requests kept finishing before the sync reached the engine"
        k = synced
        old_dir = str(world["root"] / f"{mode}-{attempts}-old")
        write_hf_checkpoint(old_dir, world["cfg"], world["state"])
        new = sharp_state(world["cfg"], 1000 * attempts + len(mode))
        flights = [StreamedRequest(engine_srv, p, TOKENS) for p in PROMPTS]
        for f in flights:
            f.start()
        for f in flights:
            assert f.started.wait(300) and f.meta is not None
        ok, msg = sender.update(segments(new))[0]
        assert ok, msg
        for f in flights:
            f.join(600)
            assert f.meta is not None and f.meta["finish_reason"] is not None, f.meta
        assert engine_mismatch(engine_srv, new) is None
        world["state"] = new
        if not all(f.meta["finish_reason"]["type"] == "abort" if mode == "abort"
                   else f.meta["weight_version"] == str(sender.version) for f in flights):
            continue  # a request finished before the pause
        new_dir = write_hf_checkpoint(str(world["root"] / f"{mode}-{attempts}-new"), world["cfg"], new)

        plain_load(plain, old_dir)
        runs = [(f.input_ids, f.meta) for f in flights]
        old = [scored(plain, p, [t for _, t, _ in m["output_token_logprobs"]]) for p, m in runs]
        plain_load(plain, new_dir)
        for (prompt, meta), lp_old in zip(runs, old):
            out = meta["output_token_logprobs"]
            lp_new = scored(plain, prompt, [t for _, t, _ in out])
            before = next((j for j, (lp, _, _) in enumerate(out) if abs(lp - lp_old[j]) > TOL), len(out))
            after = [abs(lp - lp_new[j]) for j, (lp, _, _) in enumerate(out) if j >= before]
            if mode == "abort":  # returned at the pause, every token from the old weights
                assert before == len(out) < TOKENS, (meta, before)
                continue
            assert meta["finish_reason"]["type"] == "length" and len(out) == TOKENS, meta  # none lost
            assert 5 <= before < TOKENS, (mode, k, before)  # in flight across the sync
            if mode == "retract":  # recomputed on the new weights
                assert max(after) < TOL, (k, before, after[:8])
            else:  # the new weights on the request's own old KV: not what a recomputation gives
                assert max(after[:8]) > 1.0, (k, before, after[:8])

        for prompt in PROMPTS:  # later requests, same prefixes: the new weights only, never cached old KV
            got = generate(engine_srv, prompt, 4)["output_token_logprobs"]
            want = scored(plain, prompt, [t for _, t, _ in got])  # teacher-forced: a near tie cannot fork the two
            assert max(abs(lp - w) for (lp, _, _), w in zip(got, want)) < TOL, (got, want)
        synced += 1
    assert sender.status[0].version == sender.version


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_requests_held_through_a_sync_that_leaves_the_engine_dirty_are_aborted_not_resumed(world, mode):
    """A sync whose write goes wrong (read back other bits) leaves the engine dirty; without a repair before the
    resume (the sender's ``repair_dirty`` off, as when the repair fails too), the requests the pause held would go on
    with a partly written version: each is aborted at the resume instead, a new one is refused (503), and the next
    sync's full sync makes the engine serve again."""
    engine_srv, sender = world["engine_srv"], world["sender"]
    world["engine"].pause_mode = mode
    new = sharp_state(world["cfg"], 7000 + len(mode))
    flights = [StreamedRequest(engine_srv, p, TOKENS) for p in PROMPTS]
    for f in flights:
        f.start()
    for f in flights:
        assert f.started.wait(300) and f.meta is not None
    (world["root"] / "bad-write").touch()
    sender.repair_dirty = False
    try:
        ok, msg = sender.update(segments(new))[0]
    finally:
        sender.repair_dirty = True
    assert not ok and "read-back" in msg, msg
    (st,) = world["engine"].status()
    assert st.reason == "dirty", st
    for f in flights:
        f.join(600)
        assert f.meta is not None, f.input_ids
    reasons = [f.meta["finish_reason"]["type"] for f in flights]
    assert "abort" in reasons and set(reasons) <= {"abort", "length"}, reasons
    for f in flights:  # one that finished first did so before the pause, on the old weights
        assert f.meta["finish_reason"]["type"] == "abort" or f.meta["weight_version"] != str(sender.version), f.meta
    r = engine_srv.post("/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503, r.text
    ok, msg = sender.update(segments(new))[0]  # its full sync
    assert ok, msg
    assert engine_mismatch(engine_srv, new) is None
    world["state"] = new
    assert generate(engine_srv, PROMPTS[0], 2)["finish_reason"]["type"] == "length"
