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
