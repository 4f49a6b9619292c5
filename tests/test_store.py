"""The version store against a real S3 server (SeaweedFS) and a POSIX directory: the trainer publishes every sync,
engines that start late, restart or fall behind catch up by themselves, and nothing unverified touches a weight."""
import json
import os

import pytest
import torch

from cpu_harness import Host, InProcessEngine, bf16_state, hf_config, hf_model, nan_filled, rl_steps, sglang_model
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta.receiver import delta_status
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.store.manifest import StoreKey
from sglang.srt.weight_sync.delta.store.publish import StoreTransport


class Engine(InProcessEngine):
    """An in-process engine on a real SGLang model class (NaN-filled: a weight no sync wrote shows)."""

    def __init__(self, cfg, key_file=None):
        super().__init__(Host(nan_filled(sglang_model(cfg)), chunk_bytes=64 << 10))
        if key_file:
            self.host.server_args.update_weight_store_key_file = key_file


def reference(cfg, state):
    ref = nan_filled(sglang_model(cfg))
    ref.load_weights(list(state.items()))
    return ref


def one_segment(state):
    return [lambda: [list(state.items())]]


def test_late_joiners_and_restarts_catch_up_from_the_store(store_url):
    """The first sync writes an anchor every engine loads from the store (and a server started from it follows that
    store); later syncs are deltas. An engine that
    joins late catches up by itself (anchor, then the chain), one the sender meets late is told to catch up instead
    of a full sync, a restarted engine too; every engine bit-identical at every version."""
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    a = Engine(cfg)
    transport = StoreTransport(store_url, [a], zstd=3)
    sender = DeltaSender(transport, [a], encoding="xor_zstd", buffer_bytes=16 << 10)
    state = bf16_state(trainer)
    assert sender.update(one_segment(state))[0][0]
    m = sender.pop_metrics()
    assert m["perf/update_weights_full_sync_engines"] == 1 and delta_status(a.host.model).version == 1
    assert_params_equal(a.host.model, reference(cfg, state))
    from sglang.srt.weight_sync.delta.store.watch import anchor_store

    anchor = transport.store.url(transport.akey)  # a server started from this anchor follows the store it is in
    assert anchor_store(anchor, StoreKey(None)) == transport.store.url_root
    assert anchor_store(transport.vdir, StoreKey(None)) is None  # a version's directory is no anchor
    assert anchor_store(anchor, StoreKey(b"k" * 32)) is None  # nor one that does not verify under the engine's key
    steps = rl_steps(trainer, 6)
    for _ in range(2):
        state = next(steps)
        assert sender.update(one_segment(state))[0][0]
        m = sender.pop_metrics()
        assert m["perf/update_weights_xor"] == 1 and m["perf/update_weights_full_sync_engines"] == 0
    assert_params_equal(a.host.model, reference(cfg, state))

    b = Engine(cfg)  # started late: catches up by itself (the anchor of version 1, then versions 2 and 3)
    ok, msg = b.catch_up(store_url)
    assert ok and "anchor 1" in msg, msg
    assert delta_status(b.host.model).version == 3
    assert_params_equal(b.host.model, reference(cfg, state))

    c = Engine(cfg)  # the sender meets it fresh: told to catch up from the store, no full sync of the trainer's
    transport.close()
    transport = StoreTransport(store_url, [a, b, c], zstd=3)  # as slime re-connects its engines
    sender.attach(transport, [a, b, c])
    state = next(steps)
    results = sender.update(one_segment(state))
    assert all(ok for ok, _ in results.values()), results
    m = sender.pop_metrics()
    assert m["perf/update_weights_full_sync_engines"] == 0 and m["perf/update_weights_catch_ups"] == 1
    for e in (a, b, c):
        assert_params_equal(e.host.model, reference(cfg, state))

    b = Engine(cfg)  # b restarts: the sender's status read says fresh, the store brings it back
    transport.close()
    transport = StoreTransport(store_url, [a, b, c], zstd=3)
    sender.attach(transport, [a, b, c])
    state = next(steps)
    results = sender.update(one_segment(state))
    assert all(ok for ok, _ in results.values()), results
    assert sender.pop_metrics()["perf/update_weights_catch_ups"] == 1
    for e in (a, b, c):
        assert_params_equal(e.host.model, reference(cfg, state))
        assert delta_status(e.host.model).version == 5
    transport.close()


# ---------------------------------------------------------------- an adversary with write access to the store


def raw_store(url):
    """The store as an adversary sees it: unconditional writes, reads and listings, no verification."""
    from sglang.srt.weight_sync.delta.store.objects import S3Store, open_store

    store = open_store(url)

    class Raw:
        def get(self, key):
            return store.get(key, 1 << 30)

        def put(self, key, data):
            if isinstance(store, S3Store):
                store.client.put_object(Bucket=store.bucket, Key=store._key(key), Body=data)
                return
            path = store._path(key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)

        def keys(self, prefix=""):
            return [k for k, _ in store.list(prefix)]

        def delete(self, key):
            store.delete([key])

    return Raw()


def head_record(raw):
    import json

    return json.loads(raw.get("HEAD"))


def test_every_attack_on_the_store_is_refused_with_a_code_and_weights_untouched(store_url, tmp_path):
    """With a key on both sides, an adversary who can write the bucket cannot make an engine apply anything: flipped,
    truncated or swapped objects, forged manifests, a rolled-back or foreign HEAD, an unsigned one, another key, a
    catch-up to an older version. Each is refused with its status code before any write; afterwards the honest
    store still brings the engine to HEAD bit-identically."""
    import json

    key_file = tmp_path / "store.key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    a = Engine(cfg, key_file=str(key_file))
    transport = StoreTransport(store_url, [a], zstd=3, key=StoreKey.from_file(str(key_file)))
    sender = DeltaSender(transport, [a], encoding="xor_zstd", buffer_bytes=16 << 10)
    states = [bf16_state(trainer)]
    steps = rl_steps(trainer, 3)
    raw = raw_store(store_url)
    heads = []
    for k in range(4):
        if k:
            states.append(next(steps))
        assert sender.update(one_segment(states[-1]))[0][0]
        heads.append(raw.get("HEAD"))
    b = Engine(cfg, key_file=str(key_file))
    assert b.catch_up(store_url, "2")[0]  # b holds version 2; HEAD is at 4
    assert_params_equal(b.host.model, reference(cfg, states[1]))

    def version_prefix(v):
        return next(k.rsplit("/", 1)[0] for k in raw.keys(f"weight_v{v:06d}") if k.endswith("manifest.json"))

    v3, v4 = version_prefix(3), version_prefix(4)
    flush3 = [k for k in raw.keys(v3) if k.endswith(".safetensors")]
    flush4 = [k for k in raw.keys(v4) if k.endswith(".safetensors")]
    refused = {}

    def attack(name, code, target=None, undo=None):
        ok, msg = b.catch_up(store_url, target)
        status = delta_status(b.host.model)
        assert not ok and status.code == code, (name, msg, status)
        assert status.version == 2 and not status.needs_full, name
        assert_params_equal(b.host.model, reference(cfg, states[1]))
        refused[name] = code
        if undo:
            undo()

    def rewrite(key, data):
        old = raw.get(key)
        raw.put(key, data)
        return lambda: raw.put(key, old)

    blob = raw.get(flush3[0])
    flipped = bytearray(blob)
    flipped[len(flipped) // 2] ^= 0x10
    attack("bit flip", "unverified", undo=rewrite(flush3[0], bytes(flipped)))
    attack("truncated", "unverified", undo=rewrite(flush3[0], blob[:len(blob) // 2]))
    attack("swapped objects", "unverified", undo=rewrite(flush3[0], raw.get(flush4[0])))
    manifest = json.loads(raw.get(f"{v3}/manifest.json"))
    manifest["base_version"] = 1
    attack("forged manifest", "unverified", undo=rewrite(f"{v3}/manifest.json", json.dumps(manifest).encode()))
    forged = head_record(raw)
    forged["version"] = 3
    attack("forged HEAD", "unverified", undo=rewrite("HEAD", json.dumps(forged).encode()))
    attack("rolled-back HEAD", "off_chain", undo=rewrite("HEAD", heads[0]))
    unsigned = {k: v for k, v in head_record(raw).items() if k not in ("mac", "key_id")}
    attack("unsigned HEAD", "unverified", undo=rewrite("HEAD", json.dumps(unsigned).encode()))
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32).hex().encode())
    from sglang.srt.weight_sync.delta.store.manifest import seal

    resigned = {k: v for k, v in head_record(raw).items() if k not in ("mac", "key_id", "format")}
    attack("another key", "unverified",
           undo=rewrite("HEAD", seal(resigned, StoreKey.from_file(str(other)))))
    assert b.catch_up(store_url, "3")[0]
    refused.pop("rolled-back HEAD")  # b is at 3 now; the checks below start from there

    def at3():
        status = delta_status(b.host.model)
        assert status.version == 3
        assert_params_equal(b.host.model, reference(cfg, states[2]))

    ok, msg = b.catch_up(store_url, "2")  # a replay of an older version: never backwards
    assert not ok and delta_status(b.host.model).code == "off_chain", msg
    at3()
    refused["older version replayed"] = "off_chain"
    undo = rewrite("HEAD", heads[1])  # HEAD rolled back below the engine
    ok, msg = b.catch_up(store_url)
    assert not ok and delta_status(b.host.model).code == "off_chain", msg
    undo()
    at3()
    refused["rolled-back HEAD"] = "off_chain"

    foreign_url = store_url.rstrip("/") + "-foreign"  # the same key, another run: a chain grafted in
    if not foreign_url.startswith("s3://"):
        os.makedirs(foreign_url)
    c = Engine(cfg, key_file=str(key_file))
    foreign = StoreTransport(foreign_url, [c], zstd=3, key=StoreKey.from_file(str(key_file)))
    other_sender = DeltaSender(foreign, [c], encoding="xor_zstd")
    for _ in range(5):
        assert other_sender.update(one_segment(states[-1]))[0][0]
    foreign_raw = raw_store(foreign_url)
    undo = rewrite("HEAD", foreign_raw.get("HEAD"))
    ok, msg = b.catch_up(store_url)
    assert not ok and delta_status(b.host.model).code == "off_chain", msg
    undo()
    at3()
    refused["grafted chain"] = "off_chain"
    assert len(refused) >= 10

    ok, msg = b.catch_up(store_url)  # the honest store: to HEAD, bit-identical
    assert ok, msg
    assert_params_equal(b.host.model, reference(cfg, states[3]))
    transport.close()
    foreign.close()


# ---------------------------------------------------------------- a version is taken whole or not at all


def segments_of(state, n):
    """The state as ``n`` segments: a version of ``n`` requests (each segment is one publish)."""
    items = list(state.items())
    k = -(-len(items) // n)
    return [lambda part=items[i:i + k]: [part] for i in range(0, len(items), k)]


def untouched_nan(model):
    """Every weight still as the engine started (NaN-filled): nothing of a refused version was written."""
    return all(torch.isnan(p).all() for n, p in model.named_parameters()
               if p.is_floating_point() and not n.endswith((".k_scale", ".v_scale")))


def publishing(store_url):
    """A trainer publishing ``xor_zstd`` versions of a small Qwen2 into the store, pushing to engine ``a``."""
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    a = Engine(cfg)
    transport = StoreTransport(store_url, [a], zstd=3)
    return cfg, trainer, a, transport, DeltaSender(transport, [a], encoding="xor_zstd", buffer_bytes=16 << 10)


@pytest.mark.parametrize("bound", [None, 4 << 10], ids=["staged-whole", "past-the-bound"])
def test_a_version_broken_in_its_last_object_is_taken_whole_or_not_at_all(store_url, bound):
    """A version of several requests whose last flush file is bit-flipped, then deleted: the catch-up stops at the
    last whole version, nothing of the broken one written (weights, version and status as before, not dirty). An
    anchor of several shards broken in its last one leaves a fresh engine as it started. Past the bound on decoded
    requests (``--update-weight-delta-chunk-bytes``) the rest of a version is digest-checked before the first write
    too; the honest store then brings every engine to HEAD bit-identically."""
    cfg, trainer, a, transport, sender = publishing(store_url)
    states, steps = [bf16_state(trainer)], rl_steps(trainer, 3)
    for k in range(3):
        if k:
            states.append(next(steps))
        assert sender.update(segments_of(states[-1], 3))[0][0]
    raw = raw_store(store_url)

    def objects(prefix):
        d = next(k.rsplit("/", 1)[0] for k in raw.keys(prefix) if k.endswith("manifest.json"))
        return sorted(k for k in raw.keys(d) if k.endswith(".safetensors"))

    last = objects("weight_v000003")[-1]  # the last request's last file
    shards = objects("anchor_v000001")
    assert len(json.loads(raw.get(f"{last.rsplit('/', 1)[0]}/manifest.json"))["requests"]) == 3
    assert len(shards) > 2
    blob = raw.get(last)
    flipped = bytearray(blob)
    flipped[len(flipped) // 2] ^= 0x10

    def engine():  # the decoded requests a catch-up holds before its first write: every one, or a few KiB
        e = Engine(cfg)
        e.host.server_args.update_weight_delta_chunk_bytes = bound or 64 << 20
        return e

    b = engine()
    assert b.catch_up(store_url, "1")[0]
    for name, code, fault in [("bit flip", "unverified", lambda: raw.put(last, bytes(flipped))),
                              ("deleted (or not there yet)", "replicating", lambda: raw.delete(last))]:
        fault()
        ok, msg = b.catch_up(store_url)
        status = delta_status(b.host.model)
        assert not ok and status.code == code, (name, msg, status)
        assert "stopped at version 3" in msg, msg
        assert status.version == 2 and status.pending is None and not status.needs_full, (name, status)
        assert_params_equal(b.host.model, reference(cfg, states[1]))
        raw.put(last, blob)

    shard = shards[-1]  # an anchor broken in its last shard: a fresh engine stays as it started
    data = raw.get(shard)
    raw.put(shard, data[:len(data) // 2])
    c = engine()
    ok, msg = c.catch_up(store_url)
    status = delta_status(c.host.model)
    assert not ok and status.code == "unverified" and status.reason == "fresh", (msg, status)
    assert untouched_nan(c.host.model)
    raw.put(shard, data)

    for e in (b, c):  # the honest store: to HEAD, bit-identical
        ok, msg = e.catch_up(store_url)
        assert ok, msg
        assert_params_equal(e.host.model, reference(cfg, states[2]))
    transport.close()


def test_a_follower_stages_the_next_version_while_it_serves_and_its_commit_reads_nothing(store_url):
    """``delta_stage`` fetches and digest-checks the next versions on a thread, touching no weight; the catch-up that
    commits them takes them from the stage (reading nothing from the store: it would now read a broken object) and
    is bit-identical. A stage of an object that no longer matches its manifest stages nothing, and the commit's own
    read refuses it with its code, untouched; a stage under a bound holds only what fits."""
    from sglang.srt.weight_sync.delta.receiver import checker_action
    from sglang.srt.weight_sync.delta.store import staging
    from sglang.srt.weight_sync.delta.wire import DeltaStatus

    cfg, trainer, a, transport, sender = publishing(store_url)
    states, steps = [bf16_state(trainer)], rl_steps(trainer, 4)
    assert sender.update(segments_of(states[-1], 2))[0][0]
    b = Engine(cfg)
    assert b.catch_up(store_url)[0]
    for _ in range(2):
        states.append(next(steps))
        assert sender.update(segments_of(states[-1], 2))[0][0]
    raw = raw_store(store_url)

    def stage(engine):
        at = delta_status(engine.host.model).version
        reply = checker_action("delta_stage", engine.host.model)
        asked = DeltaStatus.from_checker([reply])[0]
        ended = staging.stage_of(engine.host.model).error is not None  # a broken version's stage may end at once
        assert (asked.staging or 0) > at or (asked.staged or 0) > at or ended, asked  # under way once asked, or done
        staging.stage_of(engine.host.model).thread.join(60)
        return delta_status(engine.host.model)

    status = stage(b)
    assert status.staged == 3 and status.staging is None and status.version == 1, status
    assert_params_equal(b.host.model, reference(cfg, states[0]))  # staging wrote nothing
    flushes = [k for k in raw.keys("weight_v") if k.endswith(".safetensors")]
    kept = {k: raw.get(k) for k in flushes}
    for k, data in kept.items():  # the store breaks after the stage: the commit reads none of it
        raw.put(k, data[:-1] + bytes([data[-1] ^ 1]))
    ok, msg = b.catch_up(store_url)
    assert ok, msg
    timing = delta_status(b.host.model).timing
    assert timing["staged_bytes"] == sum(map(len, kept.values())) and timing["in_pause_bytes"] == 0, timing
    assert_params_equal(b.host.model, reference(cfg, states[2]))
    assert delta_status(b.host.model).staged is None  # a stage serves one commit

    states.append(next(steps))
    assert sender.update(segments_of(states[-1], 2))[0][0]  # written over the broken store: version 4 is whole
    for k, data in kept.items():
        raw.put(k, data)
    v4 = [k for k in raw.keys("weight_v000004") if k.endswith(".safetensors")]
    good = raw.get(v4[-1])
    raw.put(v4[-1], good[:-1] + bytes([good[-1] ^ 1]))
    status = stage(b)
    assert status.staged is None and status.version == 3, status  # nothing staged of a broken version
    ok, msg = b.catch_up(store_url)
    assert not ok and delta_status(b.host.model).code == "unverified", msg
    assert_params_equal(b.host.model, reference(cfg, states[2]))
    raw.put(v4[-1], good)
    first = len(raw.get(sorted(v4)[0]))
    b.host.server_args.update_weight_delta_stage_bytes = first  # the first object's worth: the rest at the commit
    assert b.catch_up(store_url, "3")[0]  # records the bound for the next stage
    status = stage(b)
    assert status.staged is None, status
    ok, msg = b.catch_up(store_url)
    assert ok, msg
    timing = delta_status(b.host.model).timing
    assert timing["staged_bytes"] == first and timing["in_pause_bytes"] > 0, timing
    assert_params_equal(b.host.model, reference(cfg, states[3]))
    transport.close()


# ---------------------------------------------------------------- faults: racing, dying and slow publishers


def nudged(state, seed, density=0.02):
    """The next version of a state: about ``density`` of each tensor's elements one bf16 step up (cheap steps for
    long chains; the real AdamW steps are the other tests')."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        bits = t.view(torch.int16)
        bits[torch.rand(t.shape, generator=g) < density] += 1
        out[name] = t
    return out


def test_an_engine_fifty_versions_behind_walks_the_chain(store_url):
    """An engine that left at version 2 and comes back 50 versions later applies the chain from where it is (no
    anchor), bit-identical; a catch-up to the same version again is a no-op."""
    cfg = hf_config("qwen2")
    a = Engine(cfg)
    transport = StoreTransport(store_url, [a], zstd=3)
    sender = DeltaSender(transport, [a], encoding="xor_zstd", buffer_bytes=64 << 10)
    state = bf16_state(hf_model(cfg))
    b = Engine(cfg)
    for v in range(1, 53):
        if v > 1:
            state = nudged(state, v)
        assert sender.update(one_segment(state))[0][0]
        if v == 2:
            assert b.catch_up(store_url)[0]
    ok, msg = b.catch_up(store_url)
    assert ok and "deltas, 50 step(s)" in msg, msg
    assert delta_status(b.host.model).version == 52 and delta_status(b.host.model).applied == {"full": 1, "delta": 51}
    assert_params_equal(b.host.model, reference(cfg, state))
    assert b.catch_up(store_url)[0]
    transport.close()


def test_two_trainers_racing_for_head_one_wins_the_other_stops(store_url):
    """Two trainers publish to one store: both start from the same HEAD, the first to commit moves it, the other's
    compare-and-swap fails and its sender stops with that error (code ``off_chain``); HEAD names the winner's chain,
    which a late joiner follows."""
    from sglang.srt.weight_sync.delta.store.objects import HeadMoved

    cfg = hf_config("qwen2")
    state = bf16_state(hf_model(cfg))
    a, b = Engine(cfg), Engine(cfg)
    first = DeltaSender(StoreTransport(store_url, [a], zstd=3), [a], encoding="xor_zstd")
    assert first.update(one_segment(state))[0][0]
    second = DeltaSender(StoreTransport(store_url, [b], zstd=3), [b], encoding="xor_zstd")  # both see HEAD 1
    winner = nudged(state, 7)
    assert first.update(one_segment(winner))[0][0]
    with pytest.raises(HeadMoved) as e:
        second.update(one_segment(nudged(state, 8)))
    assert e.value.code.value == "off_chain" and "another trainer" in str(e.value)
    late = Engine(cfg)
    assert late.catch_up(store_url)[0]
    assert_params_equal(late.host.model, reference(cfg, winner))


TRAINER = r"""
import os, sys, torch
sys.path[:0] = [os.environ["HARNESS"], os.environ["TESTS"]]
from cpu_harness import bf16_state, hf_config, hf_model
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.store.publish import StoreTransport
from test_store import Engine, nudged, one_segment

cfg = hf_config("qwen2")
state = bf16_state(hf_model(cfg))
transport = StoreTransport(sys.argv[1], [], zstd=3)
sender = DeltaSender(transport, [], encoding="planes_zstd")
for v in (1, 2):
    state = nudged(state, v) if v > 1 else state
    sender.update(one_segment(state))
commit = transport._commit
transport._commit = lambda: os._exit(137)  # killed after its files of version 3 are written, before its manifest
sender.update(one_segment(nudged(state, 3)))
"""


def test_a_trainer_killed_mid_publish_leaves_head_and_a_restarted_one_goes_on(store_url, tmp_path):
    """A trainer process dies after writing version 3's files, before its manifest: HEAD stays at 2, a late joiner
    gets version 2; a restarted trainer (no snapshot) publishes an anchor above HEAD that engines load, then deltas."""
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    env = dict(os.environ, HARNESS=os.path.join(here, "..", "scripts"), TESTS=here)
    proc = subprocess.run([sys.executable, "-c", TRAINER, store_url], env=env, capture_output=True, timeout=300)
    assert proc.returncode == 137, proc.stderr.decode()[-2000:]
    raw = raw_store(store_url)
    assert head_record(raw)["version"] == 2
    assert any(k.startswith("weight_v000003") for k in raw.keys("weight_v"))  # its orphans
    cfg = hf_config("qwen2")
    state = nudged(bf16_state(hf_model(cfg)), 2)
    late = Engine(cfg)
    assert late.catch_up(store_url)[0]
    assert delta_status(late.host.model).version == 2
    assert_params_equal(late.host.model, reference(cfg, state))
    restarted = DeltaSender(StoreTransport(store_url, [late], zstd=3), [late], encoding="xor_zstd")
    state = nudged(state, 30)
    assert restarted.update(one_segment(state))[0][0]
    m = restarted.pop_metrics()
    assert m["perf/update_weights_version"] == 3 and m["perf/update_weights_full_sync_engines"] == 1  # an anchor
    assert_params_equal(late.host.model, reference(cfg, state))
    state = nudged(state, 31)
    assert restarted.update(one_segment(state))[0][0]
    assert restarted.pop_metrics()["perf/update_weights_xor"] == 1
    assert_params_equal(late.host.model, reference(cfg, state))


# ---------------------------------------------------------------- compaction and retention


def test_compaction_makes_an_hf_anchor_that_engines_and_transformers_load(store_url, tmp_path):
    """``store compact`` applies the chain onto the last anchor on a CPU, checks it against the fingerprint the
    trainer published, and writes an HF checkpoint that transformers loads as it is; a fresh engine then starts
    from it. A published fingerprint the chain does not reach commits nothing."""
    from cpu_harness import write_hf_checkpoint
    from sglang.srt.weight_sync.delta.tools import main

    cfg = hf_config("qwen2")
    state = bf16_state(hf_model(cfg))
    hf_dir = write_hf_checkpoint(str(tmp_path / "hf"), cfg, state)
    a = Engine(cfg)
    transport = StoreTransport(store_url, [a], zstd=3, hf_dir=hf_dir)
    sender = DeltaSender(transport, [a], encoding="xor_zstd", fingerprint_every=3)
    states = {}
    for v in range(1, 8):
        state = nudged(state, v) if v > 1 else state
        states[v] = state
        assert sender.update(one_segment(state))[0][0]
    assert main(["store", "compact", store_url]) == 0  # the newest fingerprinted version: 6
    fresh = Engine(cfg)
    ok, msg = fresh.catch_up(store_url)
    assert ok and "anchor 6" in msg, msg
    assert_params_equal(fresh.host.model, reference(cfg, states[7]))
    raw = raw_store(store_url)
    adir = next(k.rsplit("/", 1)[0] for k in raw.keys("anchor_v000006") if k.endswith("manifest.json"))
    local = tmp_path / "anchor6"
    local.mkdir()
    for k in raw.keys(adir):
        (local / k.rsplit("/", 1)[1]).write_bytes(raw.get(k))
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(local), dtype=torch.bfloat16)
    got = loaded.state_dict()
    for name, t in states[6].items():
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name

    class Lying(StoreTransport):  # a trainer whose published fingerprint the chain does not reach
        def _commit(self):
            if self.fingerprint:
                name = sorted(self.fingerprint)[0]
                self.fingerprint[name] = f"{int(self.fingerprint[name], 16) ^ 1:016x}"
            super()._commit()

    transport.close()
    sender.attach(Lying(store_url, [a], zstd=3), [a])
    for v in (8, 9):
        assert sender.update(one_segment(nudged(state, v)))[0][0]  # 9: fingerprinted (and a mismatch check passes)
    before = raw.keys("anchor_v")
    assert main(["store", "compact", store_url]) == 2
    assert raw.keys("anchor_v") == before  # nothing committed


def test_gc_keeps_what_head_needs_and_a_catch_up_it_races_falls_back_to_a_newer_anchor(store_url):
    """``store gc --keep-anchors 1`` after a compaction at 6 (HEAD 7): versions below 6, the first anchor and the
    orphans at or below HEAD go; a publish above HEAD stays. An engine whose chain gc deletes while it catches up
    plans again from the newer anchor and lands bit-identical; engines at and below the kept range still reach
    HEAD."""
    from sglang.srt.weight_sync.delta.store import reads
    from sglang.srt.weight_sync.delta.tools import main

    cfg = hf_config("qwen2")
    state = bf16_state(hf_model(cfg))
    a = Engine(cfg)
    sender = DeltaSender(StoreTransport(store_url, [a], zstd=3), [a], encoding="xor_zstd", fingerprint_every=3)
    racer = Engine(cfg)
    for v in range(1, 8):
        state = nudged(state, v) if v > 1 else state
        assert sender.update(one_segment(state))[0][0]
        if v == 2:
            assert racer.catch_up(store_url)[0]
    assert main(["store", "compact", store_url]) == 0
    raw = raw_store(store_url)
    raw.put("weight_v000004-deadbeef/rank0000_flush000000.safetensors", b"orphan")
    raw.put("weight_v000099-cafecafe/rank0000_flush000000.safetensors", b"in progress")
    native, calls = reads.read_object, []

    def racing(store, key, sha, max_bytes):
        calls.append(key)
        if len(calls) == 1:  # gc runs between the catch-up's first and second object
            assert main(["store", "gc", store_url, "--keep-anchors", "1"]) == 0
        return native(store, key, sha, max_bytes)

    reads.read_object = racing
    try:
        ok, msg = racer.catch_up(store_url)
    finally:
        reads.read_object = native
    assert ok and "anchor 6" in msg, msg
    assert_params_equal(racer.host.model, reference(cfg, state))
    keys = raw.keys()
    assert not any(k.startswith(("weight_v000001", "weight_v000005", "anchor_v000001", "weight_v000004-deadbeef"))
                   for k in keys)
    assert any(k.startswith("weight_v000099-cafecafe") for k in keys)
    assert any(k.startswith("anchor_v000006") for k in keys) and any(k.startswith("weight_v000007") for k in keys)
    assert sender.update(one_segment(nudged(state, 8)))[0][0]  # the trainer goes on; a fresh engine reaches HEAD
    fresh = Engine(cfg)
    assert fresh.catch_up(store_url)[0]
    assert_params_equal(fresh.host.model, reference(cfg, nudged(state, 8)))


def test_a_trainer_anchor_every_k_versions_beside_the_deltas(store_url):
    """``anchor_every=3``: versions 3 and 6 carry a trainer-written anchor beside their deltas (the pushed engine
    still takes deltas); a fresh engine at HEAD 7 starts from anchor 6."""
    cfg = hf_config("qwen2")
    a = Engine(cfg)
    sender = DeltaSender(StoreTransport(store_url, [a], zstd=3), [a], encoding="xor_zstd", anchor_every=3)
    state = bf16_state(hf_model(cfg))
    for v in range(1, 8):
        state = nudged(state, v) if v > 1 else state
        results = sender.update(one_segment(state))
        assert results[0][0], results
        m = sender.pop_metrics()
        assert m["perf/update_weights_full_sync_engines"] == (v == 1) and (v == 1 or m["perf/update_weights_xor"])
    raw = raw_store(store_url)
    assert sorted({k.split("-")[0] for k in raw.keys("anchor_v")}) == ["anchor_v000001", "anchor_v000003",
                                                                        "anchor_v000006"]
    fresh = Engine(cfg)
    ok, msg = fresh.catch_up(store_url)
    assert ok and "anchor 6" in msg, msg
    assert_params_equal(fresh.host.model, reference(cfg, state))


# ---------------------------------------------------------------- bad input: clear errors, nothing applied


def test_bad_store_settings_are_clear_errors_at_start(s3, tmp_path, monkeypatch):
    """A store that cannot be reached, a bucket that does not exist, wrong credentials, a key file that is missing or
    differs from the one the store was written with: each fails the trainer's transport at start, naming what is
    wrong; an engine asked to catch up from such a store refuses with a code, weights untouched."""
    from sglang.srt.weight_sync.delta.store.objects import StoreUnavailable
    from sglang.srt.weight_sync.delta.wire import DeltaError

    url = s3.url()
    with pytest.raises(StoreUnavailable, match="no-such-bucket-x.*no such bucket"):
        StoreTransport("s3://no-such-bucket-x/run", [])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StoreUnavailable, match="access denied"):
        StoreTransport(url, [])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env["AWS_SECRET_ACCESS_KEY"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(StoreUnavailable, match="Could not connect"):
        StoreTransport(url, [])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    with pytest.raises(DeltaError, match="cannot read"):
        StoreKey.from_file(str(tmp_path / "missing.key"))
    key_a, key_b = tmp_path / "a.key", tmp_path / "b.key"
    key_a.write_bytes(os.urandom(32).hex().encode())
    key_b.write_bytes(os.urandom(32).hex().encode())
    cfg = hf_config("qwen2")
    DeltaSender(StoreTransport(url, [], key=StoreKey.from_file(str(key_a))), [],
                encoding="xor_zstd").update(one_segment(bf16_state(hf_model(cfg))))
    with pytest.raises(DeltaError, match="signed with another key"):
        StoreTransport(url, [], key=StoreKey.from_file(str(key_b)))
    with pytest.raises(DeltaError, match="no store key"):
        StoreTransport(url, [])
    for key_file, code in ((None, "unverified"), (str(key_b), "unverified")):
        e = Engine(cfg, key_file=key_file)
        ok, msg = e.catch_up(url)
        assert not ok and delta_status(e.host.model).code == code and delta_status(e.host.model).version is None, msg
    e = Engine(cfg)
    ok, msg = e.catch_up(s3.url())
    assert not ok and delta_status(e.host.model).code == "store_unavailable" and "no version" in msg, msg


def test_a_manifest_of_another_format_is_refused_as_unsupported(store_url):
    """A store written by another patch set (its records' format differs): refused with code ``unsupported``."""
    import json

    cfg = hf_config("qwen2")
    DeltaSender(StoreTransport(store_url, []), [], encoding="xor_zstd").update(one_segment(bf16_state(hf_model(cfg))))
    raw = raw_store(store_url)
    head = head_record(raw)
    head["format"] = 99
    raw.put("HEAD", json.dumps(head).encode())
    e = Engine(cfg)
    ok, msg = e.catch_up(store_url)
    assert not ok and delta_status(e.host.model).code == "unsupported" and "format 99" in msg, msg


def test_a_slow_store_is_a_deadline_then_retries_then_a_refusal(tmp_path, monkeypatch):
    """An endpoint that accepts connections and never answers: every read gives up at the deadline, is retried a
    bounded number of times, and the catch-up is refused (``store_unavailable``) with the weights untouched."""
    import socket
    import time

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{hole.getsockname()[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("DELTA_STORE_TIMEOUT_S", "1")
    monkeypatch.setenv("DELTA_STORE_RETRIES", "2")
    e = Engine(hf_config("qwen2"))
    t0 = time.time()
    ok, msg = e.catch_up("s3://slow/run")
    took = time.time() - t0
    hole.close()
    assert not ok and delta_status(e.host.model).code == "store_unavailable", msg
    assert 1.5 < took < 20, took  # the deadline, its retries, and one more plan: bounded


def _stage(stage, init_method, url, states, out):
    import traceback

    try:
        from sglang.srt.weight_sync.delta.collectives import StageGroup
        from test_pipeline_stages import STAGES, stage_names

        torch.distributed.init_process_group("gloo", init_method=init_method, world_size=STAGES, rank=stage)
        stages = StageGroup(torch.distributed.group.WORLD, stage, STAGES)
        sender = DeltaSender(StoreTransport(url, [], zstd=3, stages=stages), [], encoding="xor_zstd",
                             fingerprint_every=2, stages=stages)
        for state in states:  # an empty segment after the params, as slime's pipeline stages pad theirs
            sender.update(one_segment({n: state[n] for n in stage_names(state, stage)}) + [lambda: iter(())])
            torch.distributed.barrier()
        out.put((stage, sender.version))
    except BaseException:
        out.put((stage, traceback.format_exc()))


def test_two_pipeline_stages_publish_one_version_each_sync(store_url):
    """Two trainer processes (pipeline stages, gloo) publish into one store with no engine pushed to: one version
    directory per sync holding both stages' files (two segments, the last empty), an anchor of both stages' shards
    (none for the empty segment) with one index, and the
    fingerprint of both stages' layers (compaction checks it). A late engine catches up bit-identically."""
    import multiprocessing as mp

    from cpu_harness import free_port
    from sglang.srt.weight_sync.delta.tools import main

    cfg = hf_config("qwen2")
    state = bf16_state(hf_model(cfg))
    states = [state] + [state := nudged(state, v) for v in (2, 3)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_stage, args=(k, init, store_url, states, out)) for k in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert got == {0: 3, 1: 3}, got
    raw = raw_store(store_url)
    for v in (1, 2, 3):
        dirs = {k.split("/")[0] for k in raw.keys(f"weight_v{v:06d}")}
        assert len(dirs) == 1, dirs
    shards = [k for k in raw.keys("anchor_v000001") if k.endswith(".safetensors")]
    assert {s.rsplit("/", 1)[1][:10] for s in shards} == {"model-0000", "model-0001"}, shards
    import json

    index = json.loads(raw.get(next(k for k in raw.keys("anchor_v000001") if k.endswith("index.json"))))
    assert set(index["weight_map"]) == set(state), sorted(set(state) - set(index["weight_map"]))
    late = Engine(cfg)
    ok, msg = late.catch_up(store_url)
    assert ok, msg
    assert_params_equal(late.host.model, reference(cfg, states[-1]))
    assert main(["store", "compact", store_url]) == 0  # version 2: both stages' fingerprints, merged
    assert any(k.startswith("anchor_v000002") for k in raw.keys("anchor_v"))


def test_an_xor_ctx_chain_is_walked_by_an_engine_that_comes_back(store_url):
    """Versions stored as xor_ctx (each coded against its parent): an engine that left at version 2 applies them one
    by one from its own committed bytes, bit-identical."""
    cfg = hf_config("qwen2")
    a = Engine(cfg)
    transport = StoreTransport(store_url, [a], zstd=1)
    sender = DeltaSender(transport, [a], encoding="xor_ctx", buffer_bytes=64 << 10)
    state = bf16_state(hf_model(cfg))
    b = Engine(cfg)
    for v in range(1, 7):
        if v > 1:
            state = nudged(state, v)
        assert sender.update(one_segment(state))[0][0]
        assert sender.pop_metrics()["perf/update_weights_ctx"] == (v > 1)
        if v == 2:
            assert b.catch_up(store_url)[0]
    ok, msg = b.catch_up(store_url)
    assert ok and "deltas, 4 step(s)" in msg, msg
    assert_params_equal(b.host.model, reference(cfg, state))
    transport.close()


def test_an_idle_trainer_signs_head_again_and_stops_when_another_trainer_moved_it(store_url, tmp_path):
    """``HEAD`` carries the time the trainer wrote it, under its MAC. While the trainer idles, ``head_refresh_s``
    writes it again (the same version and manifest, a later time) over the tag it holds; once another writer moved
    ``HEAD``, the refresh writes nothing and the trainer's next sync stops with ``HeadMoved``."""
    import time

    from sglang.srt.weight_sync.delta.store import manifest
    from sglang.srt.weight_sync.delta.store.manifest import read_head
    from sglang.srt.weight_sync.delta.store.objects import HeadMoved, open_store

    key_file = tmp_path / "store.key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    key = StoreKey.from_file(str(key_file))
    cfg = hf_config("qwen2")
    state = bf16_state(hf_model(cfg))
    transport = StoreTransport(store_url, [], zstd=3, key=key, head_refresh_s=0.2)
    sender = DeltaSender(transport, [], encoding="xor_zstd")
    try:
        t0 = time.time()
        sender.update(one_segment(state))
        store = open_store(store_url)
        first, _ = read_head(store, key)
        assert first.version == 1 and t0 <= first.time <= time.time()
        deadline = time.time() + 30
        while read_head(store, key)[0].time == first.time and time.time() < deadline:
            time.sleep(0.05)
        again, _ = read_head(store, key)  # verified under the key: the same commit, written later
        assert again[:4] == first[:4] and again.time > first.time
        raw = raw_store(store_url)
        other = manifest.seal(manifest.head_record(again._replace(time=again.time + 1)), key)
        raw.put("HEAD", other)  # another trainer holding the key wrote HEAD
        deadline = time.time() + 30
        while transport.fatal is None and time.time() < deadline:
            time.sleep(0.05)
        assert isinstance(transport.fatal, HeadMoved), transport.fatal
        with pytest.raises(HeadMoved):
            sender.update(one_segment(nudged(state, 2)))
    finally:
        transport.close()


@pytest.mark.parametrize("max_age, poll_s, skew_s, flag", [(5, 5, 1, "--update-weight-store-max-age=5"),
                                                           (2, 5, 1, "--update-weight-store-max-age=2"),
                                                           (60, 5, -1, "--update-weight-store-clock-skew-s=-1")])
def test_a_freshness_setting_that_cannot_hold_is_refused_at_start_naming_it(tmp_path, max_age, poll_s, skew_s, flag):
    """A max-age at or below the poll interval (stale between two reads of a live store) or a negative clock-skew
    allowance: the follower does not start, and the error names the setting."""
    from sglang.srt.weight_sync.delta.store.watch import StoreWatch

    os.makedirs(tmp_path / "store")
    with pytest.raises(ValueError, match=flag):
        StoreWatch(None, str(tmp_path / "store"), StoreKey(None), -1, poll_s, max_age=max_age, skew_s=skew_s)
    StoreWatch(None, str(tmp_path / "store"), StoreKey(None), -1, poll_s, max_age=-1, skew_s=1)  # no bound: fine


def test_objects_head_names_before_they_arrive_are_waited_for_not_refused(store_url):
    """A replica copies objects in no set order: ``HEAD`` may name a manifest, or a flush file, that is not there yet.
    The catch-up writes nothing and says ``replicating`` (not ``store_unavailable``, not ``unverified``): the engine
    keeps its version, untouched and not dirty, and takes the version whole once the object arrives."""
    cfg = hf_config("qwen2")
    state = bf16_state(hf_model(cfg))
    sender = DeltaSender(StoreTransport(store_url, [], zstd=3), [], encoding="xor_zstd", buffer_bytes=16 << 10)
    raw = raw_store(store_url)
    a = Engine(cfg)
    try:
        sender.update(one_segment(state))
        assert a.catch_up(store_url)[0]
        for v, late in ((2, ".safetensors"), (3, "manifest.json")):
            state = nudged(state, v)
            sender.update(one_segment(state))
            key = sorted(k for k in raw.keys(sender.transport.vkey) if k.endswith(late))[-1]  # its last flush file
            held = raw.get(key)
            raw.delete(key)  # HEAD is here, this object is not yet
            before = {n: p.detach().clone() for n, p in a.host.model.named_parameters()}
            ok, msg = a.catch_up(store_url)
            st = delta_status(a.host.model)
            assert not ok and st.code == "replicating" and (st.version, st.needs_full) == (v - 1, False), (msg, st)
            assert all(torch.equal(p.detach().view(torch.uint8), before[n].view(torch.uint8))
                       for n, p in a.host.model.named_parameters())
            raw.put(key, held)  # it arrives
            ok, msg = a.catch_up(store_url)
            assert ok, msg
            assert delta_status(a.host.model).version == v
            assert_params_equal(a.host.model, reference(cfg, state))
    finally:
        sender.transport.close()
