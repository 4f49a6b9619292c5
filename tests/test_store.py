"""The version store against a real S3 server (SeaweedFS) and a POSIX directory: the trainer publishes every sync,
engines that start late, restart or fall behind catch up by themselves, and nothing unverified touches a weight."""
import os

import pytest
import torch

from cpu_harness import Host, InProcessEngine, bf16_state, hf_config, hf_model, nan_filled, rl_steps, sglang_model
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta.receiver import delta_status
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.store.manifest import StoreKey
from sglang.srt.weight_sync.delta.store.publish import StoreTransport


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from store_server import SeaweedS3

    server = SeaweedS3(str(tmp_path_factory.mktemp("seaweed")))
    yield server
    server.stop()


@pytest.fixture(params=["posix", "s3"])
def store_url(request, tmp_path):
    if request.param == "posix":
        os.makedirs(tmp_path / "store")
        return str(tmp_path / "store")
    server = request.getfixturevalue("s3")
    return f"s3://{server.bucket()}/run1"


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
    """The first sync writes an anchor every engine loads from the store; later syncs are deltas. An engine that
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
            else:
                with open(store._path(key), "wb") as f:
                    f.write(data)

        def keys(self, prefix=""):
            return [k for k, _ in store.list(prefix)]

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
