"""Stage, then commit, for pushed syncs: the engines fetch a version's files while they serve, and the pause covers
only the commit (``fetch`` on the engine, ``stage_first`` on the trainer), with real SGLang model classes in-process."""
import os
import shutil
import time

import pytest
import torch

from cpu_harness import (
    Host,
    InProcessEngine,
    flip_a_value_bit,
    full_flushes,
    delta_flushes,
    hf_config,
    nan_filled,
    publish_request,
    rl_states,
    segments,
    sglang_model,
)
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta import fetch
from sglang.srt.weight_sync.delta.files import maybe_zstd_decompress, read_safetensors
from sglang.srt.weight_sync.delta.ingest import request_bytes
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.store.publish import StoreTransport
from sglang.srt.weight_sync.delta.transport import DiskTransport

CFG = hf_config("qwen2")
STATES = rl_states(CFG, 4)


def reference(state):
    ref = nan_filled(sglang_model(CFG))
    ref.load_weights(list(state.items()))
    return ref


def engine(stage_bytes=None):
    host = Host(nan_filled(sglang_model(CFG)))
    if stage_bytes is not None:
        host.server_args.update_weight_delta_stage_bytes = stage_bytes
    return InProcessEngine(host)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def unchanged(model, before):
    return all(torch.equal(p.detach().view(torch.uint8), before[n].view(torch.uint8))
               for n, p in model.named_parameters())


def parsed_bytes(vdir, name):
    """What a stage holds of one file: its positions and values, decompressed."""
    with open(os.path.join(vdir, name), "rb") as f:
        pl = read_safetensors(maybe_zstd_decompress(f.read(), 1 << 30, name), name)
    return request_bytes([pl])


def staged(e, version, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        (st,) = e.status()
        if st.staged == version or st.stage_code is not None:
            return st
        time.sleep(0.01)
    raise AssertionError(f"version {version} was not staged")


@pytest.mark.parametrize("where", ["directory", "store"])
def test_a_sync_is_fetched_while_the_engine_serves_and_committed_under_the_gate(tmp_path, where):
    """Every publish of a sync is fetched before the gate (the caller's pause) and nothing is written until it: at
    the gate the engine holds the old version's weights and says which version it has staged; after it, the new
    version bit-identical, its files all taken from the stage (no byte read inside the pause). In a version store
    the files are fetched under the digests the trainer recorded."""
    e = engine()
    (tmp_path / "store").mkdir()
    transport = DiskTransport(str(tmp_path), [e], zstd=1, stage_timeout=60) if where == "directory" else \
        StoreTransport(str(tmp_path / "store"), [e], zstd=1, stage_timeout=60)
    sender = DeltaSender(transport, [e], encoding="xor_zstd", buffer_bytes=16 << 10)  # several flushes, 5 publishes
    seen = []

    def gate():
        (st,) = e.status()
        seen.append((st.version, st.staged, unchanged(e.host.model, before)))

    transport.gate = gate  # the caller's own pause
    try:
        for v, state in enumerate(STATES[:4], start=1):
            before = params(e.host.model)
            results = sender.update(segments(state))
            assert results[0][0], results
            # the first, a full sync, goes to an engine that has taken none yet: it reads its files at the commit
            assert seen[-1] == ((v - 1, v, True) if v > 1 else (None, None, True)), seen
            assert_params_equal(e.host.model, reference(state))
            (st,) = e.status()
            assert st.version == v and st.staged is None and st.timing["commit_s"] > 0, st
            assert (st.timing["in_pause_bytes"] == 0 and st.timing["staged_bytes"] > 0) == (v > 1), st
            m = sender.pop_metrics()
            assert m["perf/update_weights_stage_ready_engines"] == 1 and m["perf/update_weights_commit_s"] > 0, m
            assert "perf/update_weights_pause_s" not in m  # the caller's gate: the caller times its own pause
            assert fetch.fetched(e.host.model).held_bytes == 0  # taken, or dropped with the version
    finally:
        transport.close()


def test_without_a_gate_the_sender_pauses_only_for_the_commit(tmp_path):
    """``DeltaSender.update`` over a staging transport pauses the engines itself, at the gate: after the fetch."""
    class Pausing(InProcessEngine):
        def pause_generation(self):
            (st,) = self.status()
            calls.append(("pause", st.staged))

        def continue_generation(self):
            calls.append(("continue", None))

    calls = []
    e = Pausing(engine().host)
    transport = DiskTransport(str(tmp_path), [e], zstd=1, stage_timeout=60)
    sender = DeltaSender(transport, [e], encoding="planes_zstd")
    try:
        for v, state in enumerate(STATES[:2], start=1):
            assert sender.update(segments(state))[0][0]
            assert calls[-2:] == [("pause", v if v > 1 else None), ("continue", None)], calls
            assert sender.pop_metrics()["perf/update_weights_pause_s"] > 0
        assert transport.gate is None
    finally:
        transport.close()


def test_an_engine_that_cannot_stage_is_not_waited_for(tmp_path):
    """An engine whose stage request fails (an older patch set, or one the call did not reach) is not waited for
    until the deadline: the gate comes at once, and it reads its files inside the pause, bit-identical."""
    class Unable(InProcessEngine):
        def stage(self, request):
            raise RuntimeError("HTTP 400: Unsupported action='delta_stage'")

    e = Unable(engine().host)
    transport = DiskTransport(str(tmp_path), [e], zstd=1, stage_timeout=3600)  # waited for, it would hang the test
    sender = DeltaSender(transport, [e], encoding="planes_zstd")
    try:
        for state in STATES[:2]:
            assert sender.update(segments(state))[0][0]
            assert sender.pop_metrics()["perf/update_weights_stage_ready_engines"] == 0
            assert_params_equal(e.host.model, reference(state))
            (st,) = e.status()
            assert st.timing["in_pause_bytes"] > 0 and st.timing["staged_bytes"] == 0, st
    finally:
        transport.close()


def _at_version_1(tmp_path):
    e = engine()
    vdir = publish_request(str(tmp_path), 1, full_flushes(STATES[0], version=1), zstd=False)
    ok, msg = e.update_weights_from_disk(vdir, sorted(os.listdir(vdir)), "1")
    assert ok, msg
    return e


def _delta(tmp_path, version, name="weight"):
    vdir = publish_request(str(tmp_path), version, delta_flushes(STATES[version - 2], STATES[version - 1], "deltas",
                                                                  version=version, base_version=version - 1),
                           zstd=False, name=name)
    return vdir, sorted(os.listdir(vdir))


def test_a_file_replaced_after_its_fetch_is_read_again_and_refused_by_the_commit(tmp_path):
    """The commit takes a fetched file only if it is still the file that was fetched: one corrupted after the fetch
    is read again, refused by its checksum, and nothing is written; the same files fetched untouched are taken."""
    e = _at_version_1(tmp_path)
    vdir, files = _delta(tmp_path, 2)
    e.stage({"version": 2, "model_path": vdir, "files": files, "final": True})
    assert staged(e, 2).stage_code is None
    path = flip_a_value_bit(vdir, "rank0000_flush000000")
    shutil.copy(path, path + ".tmp")  # written anew, as a writer lands a file: another inode at the same name
    os.replace(path + ".tmp", path)
    before = params(e.host.model)
    ok, msg = e.update_weights_from_disk(vdir, files, "2")
    assert not ok and "checksum" in msg, msg
    assert unchanged(e.host.model, before)
    (st,) = e.status()
    assert st.version == 1 and not st.needs_full and st.code == "checksum", st
    vdir, files = _delta(tmp_path, 2, name="again")
    e.stage({"version": 2, "model_path": vdir, "files": files, "final": True})
    staged(e, 2)
    ok, msg = e.update_weights_from_disk(vdir, files, "2")
    assert ok, msg
    (st,) = e.status()
    assert st.timing["in_pause_bytes"] == 0 and st.timing["staged_bytes"] > 0, st
    assert_params_equal(e.host.model, reference(STATES[1]))


@pytest.mark.parametrize("case", ["behind", "older_than_held", "no_sync_yet", "bound_zero", "malformed"])
def test_a_stage_request_that_cannot_be_taken_gets_a_code_and_writes_nothing(tmp_path, case):
    e = engine() if case == "no_sync_yet" else _at_version_1(tmp_path)
    if case == "bound_zero":
        e.host.server_args.update_weight_delta_stage_bytes = 0
        e.update_weights_from_disk(str(tmp_path), ["absent"], "2")  # refused; a request takes the server's settings
    vdir, files = _delta(tmp_path, 2)
    if case == "older_than_held":
        vdir3, files3 = _delta(tmp_path, 3)
        e.stage({"version": 3, "model_path": vdir3, "files": files3, "final": True})
        staged(e, 3)
    before = params(e.host.model)
    request = {"version": 1 if case == "behind" else "2" if case == "malformed" else 2, "model_path": vdir,
               "files": files}
    (st,) = e.stage(request)
    assert st.stage_code == {"behind": "off_chain", "older_than_held": "off_chain", "no_sync_yet": "needs_full",
                             "bound_zero": "stage_bound", "malformed": "malformed"}[case], st
    assert unchanged(e.host.model, before)
    if case == "older_than_held":
        assert st.staged == 3  # the newer one is kept


def test_a_newer_version_supersedes_a_fetched_one_and_past_the_bound_the_commit_reads(tmp_path):
    """A stage for a newer version drops the older one's files (the trainer abandoned it); a version's files wait
    for their own commit; a bound below a version's files leaves the rest to the commit, which reads it inside the
    pause (counted), bit-identical all the same."""
    e = _at_version_1(tmp_path)
    vdir2, files2 = _delta(tmp_path, 2)
    e.stage({"version": 2, "model_path": vdir2, "files": files2, "final": True})
    staged(e, 2)
    assert fetch.fetched(e.host.model).held_bytes == sum(parsed_bytes(vdir2, f) for f in files2)  # parsed, held
    vdir3, files3 = _delta(tmp_path, 3)
    e.stage({"version": 3, "model_path": vdir3, "files": files3, "final": True})
    staged(e, 3)
    f = fetch.fetched(e.host.model)
    assert {k[0] for k in f.objects} == {os.path.realpath(os.path.join(vdir3, n)) for n in files3}
    ok, msg = e.update_weights_from_disk(vdir2, files2, "2")  # its files are no longer held: read in the pause
    assert ok, msg
    (st,) = e.status()
    assert st.timing["staged_bytes"] == 0 and st.timing["in_pause_bytes"] > 0, st
    assert fetch.fetched(e.host.model).held_bytes > 0  # 3's files wait for its commit
    ok, msg = e.update_weights_from_disk(vdir3, files3, "3")
    assert ok, msg
    (st,) = e.status()
    assert st.timing["staged_bytes"] > 0 and st.timing["in_pause_bytes"] == 0, st
    assert fetch.fetched(e.host.model).held_bytes == 0
    vdir4, files4 = _delta(tmp_path, 4)
    e.host.server_args.update_weight_delta_stage_bytes = parsed_bytes(vdir4, files4[0]) - 1
    e.update_weights_from_disk(vdir4, ["absent"], "4")  # refused; a request takes the server's settings
    e.stage({"version": 4, "model_path": vdir4, "files": files4, "final": True})
    assert staged(e, 4).stage_code is None
    ok, msg = e.update_weights_from_disk(vdir4, files4, "4")
    assert ok, msg
    (st,) = e.status()
    assert st.timing["staged_bytes"] == 0 and st.timing["in_pause_bytes"] > 0, st
    assert_params_equal(e.host.model, reference(STATES[3]))
    assert fetch.fetched(e.host.model).held_bytes == 0


def test_with_a_store_the_engines_pushed_to_resume_before_the_commit_and_the_catch_ups(tmp_path):
    """With a version store, the engines a sync pushed to resume as soon as each of them took the version: the
    manifest and ``HEAD`` are written and a newcomer catches up (its anchor's download) while they serve. The
    newcomer stays paused until its catch-up is done. Both end bit-identical."""
    events = []

    class Recording(InProcessEngine):
        def pause_generation(self):
            events.append(("pause", self.name))

        def continue_generation(self):
            events.append(("continue", self.name, transport.head_version))

        def catch_up(self, store_url, weight_version=None):
            events.append(("catch_up", self.name, transport.head_version))
            return super().catch_up(store_url, weight_version)

    a, b = Recording(engine().host), Recording(engine().host)
    a.name, b.name = "a", "b"
    (tmp_path / "store").mkdir()
    transport = StoreTransport(str(tmp_path / "store"), [a], zstd=1, stage_timeout=60)
    sender = DeltaSender(transport, [a], encoding="xor_zstd")
    try:
        assert sender.update(segments(STATES[0]))[0][0]  # the first version is an anchor a loads after the commit
        assert events == [("pause", "a"), ("catch_up", "a", 1), ("continue", "a", 1)], events
        transport.close()
        transport = StoreTransport(str(tmp_path / "store"), [a, b], zstd=1, stage_timeout=60)
        sender.attach(transport, [a, b])  # b is new: it catches up from the store, a takes the delta
        events.clear()
        results = sender.update(segments(STATES[1]))
        assert all(ok for ok, _ in results.values()), results
        assert events == [("pause", "a"), ("pause", "b"), ("continue", "a", 1), ("catch_up", "b", 2),
                          ("continue", "b", 2)], events
        m = sender.pop_metrics()
        assert m["perf/update_weights_catch_ups"] == 1 and m["perf/update_weights_pause_s"] > 0, m
        for e in (a, b):
            assert_params_equal(e.host.model, reference(STATES[1]))
    finally:
        transport.close()


def test_a_stage_whose_trainer_stopped_is_dropped_after_its_hold_time(tmp_path):
    """A trainer that stops between stage and commit: what the engine fetched is dropped once no request of that
    sync came for ``hold_s`` (the sender sends twice its stage timeout). A commit of the same files later still
    applies, reading them itself, bit-identical; a malformed ``hold_s`` is refused."""
    e = _at_version_1(tmp_path)
    vdir, files = _delta(tmp_path, 2)
    (st,) = e.stage({"version": 2, "model_path": vdir, "files": files, "final": True, "hold_s": "soon"})
    assert st.stage_code == "malformed" and st.staged is None, st
    e.stage({"version": 2, "model_path": vdir, "files": files, "final": True, "hold_s": 0.5})
    assert staged(e, 2).stage_code is None
    deadline = time.time() + 60
    while fetch.fetched(e.host.model).held_bytes and time.time() < deadline:
        time.sleep(0.05)
    (st,) = e.status()
    assert st.staged is None and st.staging is None and fetch.fetched(e.host.model).held_bytes == 0, st
    ok, msg = e.update_weights_from_disk(vdir, files, "2")
    assert ok, msg
    (st,) = e.status()
    assert st.version == 2 and st.timing["staged_bytes"] == 0 and st.timing["in_pause_bytes"] > 0, st
    assert_params_equal(e.host.model, reference(STATES[1]))


@pytest.mark.parametrize("where", ["directory", "store"])
def test_a_pushed_version_broken_in_its_last_publish_is_taken_whole_or_not_at_all(tmp_path, where):
    """A staged sync commits every publish of its version in one request, staged whole before the first write: its
    last publish's file corrupted after it was written (a directory file bit-flipped, a store object that no longer
    matches its digest) leaves the engine serving its old version, untouched and not dirty, with the refusal's code;
    the next sync takes the version it missed as a delta, bit-identical."""
    class Unable(InProcessEngine):  # fetches nothing: the commit reads every file itself, the broken one included
        def stage(self, request):
            raise RuntimeError("HTTP 400: Unsupported action='delta_stage'")

    e = Unable(engine().host)
    (tmp_path / "store").mkdir()
    transport = DiskTransport(str(tmp_path), [e], zstd=1, stage_timeout=60, keep_files=True) \
        if where == "directory" else StoreTransport(str(tmp_path / "store"), [e], zstd=1, stage_timeout=60)
    sender = DeltaSender(transport, [e], encoding="xor_zstd")
    held = {}

    def two_publishes(state):  # two segments: the version is two requests, the second one broken
        names = list(state)
        return [lambda part=part: [[(n, state[n]) for n in part]] for part in (names[:len(names) // 2],
                                                                              names[len(names) // 2:])]

    def corrupt_the_last_publish():
        held["before"] = params(e.host.model)
        if where == "directory":
            last = sorted(f for f in os.listdir(transport.vdir) if f.endswith(".safetensors"))[-1]
            flip_a_value_bit(transport.vdir, last[:-len(".safetensors")])
        else:
            vdir = tmp_path / "store" / transport.vkey
            last = sorted(vdir.iterdir())[-1]
            data = bytearray(last.read_bytes())
            data[len(data) // 2] ^= 0x01
            last.write_bytes(bytes(data))

    try:
        assert sender.update(two_publishes(STATES[0]))[0][0]
        transport.gate = corrupt_the_last_publish
        (ok, msg), = sender.update(two_publishes(STATES[1])).values()
        assert not ok, msg
        assert len(transport.staged.publishes[0]) == 2
        assert unchanged(e.host.model, held["before"])
        (st,) = e.status()
        assert (st.version, st.needs_full, st.pending) == (1, False, None), st
        assert st.code == ("checksum" if where == "directory" else "unverified"), st
        transport.gate = lambda: None
        assert sender.update(two_publishes(STATES[2]))[0][0]
        assert_params_equal(e.host.model, reference(STATES[2]))
        (st,) = e.status()
        assert st.version == 3 and not st.needs_full, st
    finally:
        transport.close()
