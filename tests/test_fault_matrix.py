"""Fault matrix: a real patched SGLang server on CPU, the real sender core, one fault per test.

Every test injects one fault on the real path (bytes corrupted after the writer's rename, a
tampered announcement, a process killed, a disk that fills up, a peer that never broadcasts, a write that sets a
wrong value; the process, disk, broadcast and write faults while the engine serves generation requests) and
proves: the error names the cause (and the parameter, where one is at fault), the engine's weights
are untouched (its fingerprint still equals the last acknowledged version), the sender recovers by
itself on the next sync, and trainer and engine are bit-identical afterwards (read back over HTTP).
"""
import glob
import json
import os
import struct
import time

import pytest
import torch
import zstandard

from cpu_harness import free_port, join_update_group, segments
from fault_world import World, blob_range, fault, first_file, flip_bit, positions_of, resigned, sparse_param
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import HttpEngine, NcclTransport
from sglang.srt.weight_sync.delta.files import read_safetensors, write_safetensors
from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES, dtype_to_str
from traffic import Traffic


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("faults"))
    yield w
    w.transport.close()
    w.server.stop()


@pytest.fixture
def traffic(world):
    """Three streams of generation requests against the world's server for the whole test: none may fail, except
    while the test has its server down (``traffic.outage``: (start, end) of ``time.perf_counter``)."""
    with Traffic(lambda: world.server.url) as t:
        t.outage = None
        first = t.mark()
        yield t
        t.stop()
        failed = [r for r in t.failures(first)
                  if t.outage is None or not (t.outage[0] <= r.end and r.start <= t.outage[1])]
        assert not failed, [r.detail for r in failed[:3]]
        assert sum(r.outcome == "completed" for r in t.since(first)) > 0, t.summary(first)


# ---------------------------------------------------------------- file faults (after the rename)


def test_truncated_file(world):
    def hook(vdir):
        path = first_file(vdir)
        os.truncate(path, os.path.getsize(path) // 2)
    fault(world, "do not fit the", hook=hook)


def test_missing_file(world):
    fault(world, "No such file", hook=lambda vdir: os.remove(first_file(vdir)))


def test_flipped_bit_in_positions(world):
    fault(world, "checksum mismatch", hook=flip_bit(POSITIONS))


def test_flipped_bit_in_values(world, traffic):
    """A published file changed after its rename, while the engine serves."""
    fault(world, "checksum mismatch", hook=flip_bit(VALUES))


def test_two_values_swapped(world):
    def hook(vdir):
        path = first_file(vdir)
        start, end = blob_range(path, VALUES)
        data = bytearray(open(path, "rb").read())
        j = next(j for j in range(start + 2, end - 1, 2) if data[j:j + 2] != data[start:start + 2])
        data[start:start + 2], data[j:j + 2] = data[j:j + 2], data[start:start + 2]
        open(path, "wb").write(bytes(data))
    fault(world, "checksum mismatch", hook=hook)


def test_two_sign_bits_flipped(world):
    """Sign bits at bit 63 of two u64 words: a linear checksum (2 * 2**63 = 0 mod 2**64) accepted this."""
    def hook(vdir):
        path = first_file(vdir)
        start, end = blob_range(path, VALUES)
        data = bytearray(open(path, "rb").read())
        assert start + 16 <= end
        data[start + 7] ^= 0x80  # bit 63 of the values blob's words 0 and 1
        data[start + 15] ^= 0x80
        open(path, "wb").write(bytes(data))
    fault(world, "checksum mismatch", hook=hook)


def test_two_names_swapped_in_the_spec(world):
    """Same shape and dtype, blobs and checksum untouched: every byte checks out, the values would land swapped."""
    def hook(vdir):
        path = first_file(vdir)
        pl = read_safetensors(open(path, "rb").read(), os.path.basename(path))
        by_kind = {}
        for p in pl.spec.params:
            by_kind.setdefault((tuple(p.shape), p.dtype, p.pos_width > 0), []).append(p)
        a, b = next(ps for ps in by_kind.values() if len(ps) >= 2)[:2]
        a.name, b.name = b.name, a.name
        open(path, "wb").write(write_safetensors(pl.spec, pl.positions, pl.values))
    fault(world, "checksum mismatch", hook=hook)


def test_header_length_overflow(world):
    def hook(vdir):
        path = first_file(vdir)
        data = bytearray(open(path, "rb").read())
        data[:8] = struct.pack("<Q", 1 << 40)
        open(path, "wb").write(bytes(data))
    fault(world, "safetensors header length 1099511627776 exceeds the", hook=hook)


def test_bad_zstd_frame(world):
    def hook(vdir):
        path = first_file(vdir)
        data = zstandard.ZstdCompressor(level=1).compress(open(path, "rb").read())
        open(path, "wb").write(data[:len(data) // 2] + bytes(64) + data[len(data) // 2:])
    fault(world, "bad zstd frame", hook=hook)


def test_zstd_bomb(world):
    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(256 << 20))
    fault(world, "zstd output exceeds the", hook=lambda vdir: open(first_file(vdir), "wb").write(bomb))


# ---------------------------------------------------------------- tampered announcements


def test_path_traversal_in_files(world):
    fault(world, "must be a plain file name inside model_path", rewrite=lambda path, files, v: (path, ["../" + files[0]] + files[1:], v))


def test_symlink_escape_in_files(world):
    outside = world.root / "outside.safetensors"
    outside.write_bytes(b"\0" * 16)

    def rewrite(path, files, v):
        os.symlink(outside, os.path.join(path, "escape.safetensors"))
        return path, ["escape.safetensors"], v
    fault(world, "resolves outside model_path (symlink escape)", rewrite=rewrite)


@pytest.mark.parametrize("tamper, expect", [
    (lambda files: files[:1] + files[2:], "parts [0, 2"),  # one file of a publish left out
    (lambda files: files[:-1], "do not end at its last part"),  # its last file left out
    (lambda files: files + files[-1:], "one is missing or repeated"),  # a file announced twice
])
def test_an_announcement_that_leaves_out_or_repeats_a_file(world, tamper, expect):
    """Every file of a publish is numbered in its checksummed spec: a file missing from the announcement is
    refused, never read as "those params did not change"."""
    def rewrite(path, files, v):
        assert len(files) >= 3, files
        return path, tamper(sorted(files)), v
    buffer, world.sender.buffer_bytes = world.sender.buffer_bytes, 2 << 10  # several files per publish
    try:
        fault(world, expect, rewrite=rewrite)
    finally:
        world.sender.buffer_bytes = buffer


def test_replayed_version(world):
    """A copy of an already applied version announced again (duplicate): refused by the version chain."""
    world.transport.keep_files = True
    try:
        world.recovers()
    finally:
        world.transport.keep_files = False
    v = world.sender.version
    old = os.path.join(world.transport.root, f"weight_v{v:06d}")
    fault(world, f"cannot apply to an engine at committed version {v} (duplicate, replayed or out-of-order)",
          rewrite=lambda path, files, _: (old, sorted(f for f in os.listdir(old) if f.endswith(".safetensors")), str(v)))


def test_out_of_order_flush(world):
    def edit(pl):
        pl.spec.flush = 1
    fault(world, "arrived without flush 0", hook=resigned(edit))


# ---------------------------------------------------------------- well-formed files with bad content


def test_out_of_range_position(world):
    def edit(pl):
        p = sparse_param(pl)
        positions_of(pl, p)[0] = min(p.numel, (1 << (8 * p.pos_width - 1)) - 1)
    fault(world, "out of range", hook=resigned(edit))


def test_duplicate_position(world):
    def edit(pl):
        p = sparse_param(pl)
        pos = positions_of(pl, p)
        pos[1] = pos[0]
    fault(world, "duplicate", hook=resigned(edit))


def test_nan_among_values(world):
    def edit(pl):
        pl.values[sparse_param(pl).val_start] = float("nan")
    fault(world, "NaN", hook=resigned(edit))


def test_unknown_parameter_name(world):
    def edit(pl):
        pl.spec.params[0].name = "model.layers.7.mlp.not_a_weight"
    fault(world, "'model.layers.7.mlp.not_a_weight'", hook=resigned(edit))


def test_shape_mismatch(world):
    def edit(pl):
        p = sparse_param(pl)
        p.shape = [p.shape[0] * 2] + list(p.shape[1:])
    msg = fault(world, "shape", hook=resigned(edit))
    assert "param '" in msg


def test_dtype_mismatch(world):
    def edit(pl):
        sparse_param(pl).dtype = "float16"
    msg = fault(world, "dtype", hook=resigned(edit))
    assert "param '" in msg


# ---------------------------------------------------------------- processes, disks, networks


def test_engine_killed_mid_apply(world, traffic):
    """The engine process dies between two loader calls while it serves: a new engine (same boot checkpoint) gets a
    full sync; requests fail only while no engine runs."""
    world.kill_file.write_text("")
    t0 = time.perf_counter()
    ok, msg, _ = world.sync()
    assert not ok and msg.startswith("transport:"), msg
    world.server.stop()
    world.start_server()
    world.engine.http = HttpEngine(world.server.url, timeout=120)
    traffic.outage = (t0, time.perf_counter())
    world.recovers()
    assert world.sender.pop_metrics()["perf/update_weights_full_sync_engines"] == 1
    traffic.wait_completed()  # the new engine serves


def test_disk_fills_up_mid_publish(world, traffic):
    """The disk fills up under the writer (a real ENOSPC from the kernel: the publish's temporary file is
    ``/dev/full``): the sync fails cleanly, nothing is announced, the engine serves on untouched, the next sync is
    correct."""
    vdir = os.path.join(world.transport.root, f"weight_v{world.sender.version + 1:06d}")
    os.makedirs(vdir)
    os.symlink("/dev/full", os.path.join(vdir, "rank0000_flush000000.safetensors.tmp"))
    seen = world.engine.status()[0].request
    ok, msg, _ = world.sync()
    assert not ok and "transport: publish failed" in msg and "No space left on device" in msg, msg
    assert world.engine.status()[0].request == seen  # no request reached the engine
    world.engine_holds(world.state, world.sender.state.version)
    world.recovers()


def test_a_write_that_sets_a_wrong_value(world, traffic, caplog):
    """The engine's element write sets one wrong bit (a buggy kernel) while it serves: the read-back refuses the
    apply (code ``verify``), the engine is dirty, and the sender repairs it with a full sync before generation
    resumes: the same ``update`` returns with the engine bit-identical, the failure and the repair counted."""
    fulls = world.engine.status()[0].applied.get("full", 0)
    world.bad_write_file.write_text("")
    ok, msg, state = world.sync()
    assert ok, msg
    assert not world.bad_write_file.exists()  # the fault fired
    failure = next(r.getMessage() for r in caplog.records if "failed on engine 0" in r.getMessage())
    assert "read-back after write" in failure and "param '" in failure, failure
    metrics = world.sender.pop_metrics()
    assert (metrics["perf/update_weights_failures"], metrics["perf/update_weights_repairs"],
            metrics["perf/update_weights_full_sync_engines"]) == (1, 1, 1), metrics
    world.engine_holds(state, world.sender.version)
    world.state = state
    status = world.engine.status()[0]
    assert status.version == world.sender.version and status.applied["full"] == fulls + 1, status


def test_a_dirty_engine_answers_no_generation_until_a_full_sync(world):
    """A write that sets a wrong value, and the sender's repair kept from the engine: the engine holds part of a
    version (dirty), and every generation request is refused with 503 while it does (never an answer from a mix of
    versions); the next sync's full sync repairs it, and it serves again."""
    world.engine.drop_full = True
    world.bad_write_file.write_text("")
    try:
        ok, msg, _ = world.sync()
    finally:
        world.engine.drop_full = False
    assert not ok and not world.bad_write_file.exists(), msg
    status = world.engine.status()[0]
    assert status.needs_full and status.reason == "dirty", status
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    r = world.server.post("/generate", body)
    assert r.status_code == 503 and "partly written weight version" in r.text, (r.status_code, r.text)
    world.sender.pop_metrics()
    world.recovers()
    r = world.server.post("/generate", body)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text


def test_engine_unreachable_for_one_sync(world):
    world.engine.http.url = f"http://127.0.0.1:{free_port()}"
    try:
        ok, msg, _ = world.sync()
    finally:
        world.engine.http.url = world.server.url
    assert not ok and msg.startswith("transport:") and "Connection" in msg, msg
    world.engine_holds(world.state, world.sender.state.version)
    world.recovers()
    assert world.sender.pop_metrics()["perf/update_weights_full_sync_engines"] == 1


def test_non_contiguous_tensors_handed_to_the_encoder(world):
    state = next(world.steps)
    strided = {n: (t.t().contiguous().t() if t.dim() == 2 else t[::1]) for n, t in state.items()}
    assert any(not t.is_contiguous() for t in strided.values())
    ok, msg, _ = world.sync(strided)
    assert ok, msg
    world.engine_holds(state, world.sender.version)
    world.state = state


def test_broadcast_peer_that_never_arrives(world, traffic):
    """The engine waits on a broadcast nobody sends while it serves: it gives up after --update-weight-group-timeout,
    untouched, and its requests complete."""
    pg = join_update_group(world.server, "silent")
    state = next(world.steps)
    t0 = time.time()
    ok, msg = world.engine.update_weights_from_distributed(
        [POSITIONS, VALUES], ["uint8", dtype_to_str(torch.bfloat16)], [[16], [8]], "silent", "{}",
        str(world.sender.version + 1))
    # refused within the group's 5 s timeout (gloo: "Timed out waiting 5000ms"), never a hang
    assert time.time() - t0 < 60 and not ok and any(k in msg for k in ("Timed out", "broadcast", "receive")), msg
    world.engine_holds(world.state, world.sender.state.version)
    del pg
    # the same trainer over a fresh group then syncs normally, as slime's re-created group would
    pg2 = join_update_group(world.server, "fresh")
    nccl = NcclTransport(pg2, "fresh", [world.engine])
    sender = DeltaSender(nccl, [world.engine], encoding="indices")
    sender.version = world.sender.version
    results = sender.update(segments(state))
    assert results[0][0], results
    world.engine_holds(state, sender.version)
    nccl.close()
    world.sender.version = sender.version  # the disk sender continues after it, with a full sync
    world.sender.status[0].needs_full = True
    world.recovers()



# ---------------------------------------------------------------- byte planes and XOR values (disk)


@pytest.fixture
def xor_world(world):
    """The same world sending xor_zstd (zstd level 3) while the test runs."""
    sender, writer = world.sender, world.transport.writer
    sender.encoding, writer.zstd_level = "xor_zstd", 3
    sender._learn([0])  # a sender started with xor_zstd reads this after the full sync; this one switched mid-run
    ok, msg, world.state = world.sync()  # the engine is at the snapshot's version: xor_zstd
    assert ok and sender.pop_metrics()["perf/update_weights_xor"] == 1, msg
    yield world
    sender.encoding, writer.zstd_level = "indices", None


def _rewrite(path, edit):
    """Decompress a published file, ``edit(header, body) -> (header, body)``, write it back compressed."""
    data = zstandard.ZstdDecompressor().stream_reader(open(path, "rb").read()).read()
    (n,) = struct.unpack("<Q", data[:8])
    header, body = edit(json.loads(data[8:8 + n]), data[8 + n:])
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    open(path, "wb").write(zstandard.ZstdCompressor(level=3).compress(struct.pack("<Q", len(h)) + h + body))


def _edit_params(edit):
    def change(header, body):
        params = json.loads(header["__metadata__"]["params"])
        edit(params)
        header["__metadata__"]["params"] = json.dumps(params)
        return header, body
    return change


def test_xor_for_the_wrong_base(xor_world):
    """xor_zstd values relative to an older version than the engine's: refused before any rebuild."""
    def hook(vdir):
        def change(header, body):
            md = header["__metadata__"]
            md["base_version"] = str(int(md["version"]) - 2)
            return header, body
        for path in sorted(glob.glob(os.path.join(vdir, "*.safetensors"))):
            _rewrite(path, change)
    fault(xor_world, f"xor_zstd values are relative to version {xor_world.sender.version - 1}; this engine is at "
                     f"version {xor_world.sender.version}", hook=hook)


def test_xor_values_against_a_corrupted_base(xor_world):
    """One value's XOR flipped (as if the sender's base were wrong there): the rebuilt value fails the checksum."""
    def hook(vdir):
        def change(header, body):
            start, end = header[VALUES]["data_offsets"]
            body = bytearray(body)
            body[(start + end) // 2] ^= 0x04
            return header, bytes(body)
        _rewrite(first_file(vdir), change)
    fault(xor_world, "checksum mismatch", hook=hook)


def test_a_truncated_plane(xor_world):
    """The values tensor declared and stored one element short: the planes no longer fit the spec."""
    def hook(vdir):
        def change(header, body):
            start, end = header[VALUES]["data_offsets"]
            header[VALUES]["shape"] = [header[VALUES]["shape"][0] - 1]
            header[VALUES]["data_offsets"] = [start, end - 2]
            other = header[POSITIONS]["data_offsets"]
            if other[0] >= end:  # the library may store the positions after the values
                header[POSITIONS]["data_offsets"] = [other[0] - 2, other[1] - 2]
            return header, body[:end - 2] + body[end:]
        _rewrite(first_file(vdir), change)
    fault(xor_world, "disagree with the spec", hook=hook)


def test_planes_whose_lengths_disagree_with_the_spec(xor_world):
    """A param's position width claimed 4 where its plane holds 2-byte gaps."""
    def lie(params):
        k = next(k for k, (w, a, b) in enumerate(zip(params["pos_width"], params["val_start"], params["val_end"]))
                 if w == 2 and b > a)
        params["pos_width"][k] = 4
    hook = lambda vdir: _rewrite(first_file(vdir), _edit_params(lie))
    fault(xor_world, "its planes disagree with the spec", hook=hook)


def test_a_request_mixing_planes_and_flat_layouts(xor_world):
    """One file of a publish relabelled as the flat deltas_zstd layout: the request's files must share one encoding."""
    def hook(vdir):
        files = sorted(glob.glob(os.path.join(vdir, "*.safetensors")))
        assert len(files) >= 2

        def change(header, body):
            header["__metadata__"]["encoding"] = "deltas_zstd"
            return header, body
        _rewrite(files[0], change)
    buffer, xor_world.sender.buffer_bytes = xor_world.sender.buffer_bytes, 2 << 10  # several files per publish
    try:
        fault(xor_world, "disagree on (version, base_version, flush, full, encoding, sources, final)", hook=hook)
    finally:
        xor_world.sender.buffer_bytes = buffer


def test_a_plane_major_file_labelled_flat(xor_world):
    """Every file of the publish relabelled flat: the bytes are read in the wrong layout and fail the checksum."""
    def hook(vdir):
        def change(header, body):
            header["__metadata__"]["encoding"] = "deltas_zstd"
            return header, body
        for path in sorted(glob.glob(os.path.join(vdir, "*.safetensors"))):
            _rewrite(path, change)
    fault(xor_world, "checksum mismatch", hook=hook)
