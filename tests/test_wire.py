"""Codec properties of the wire module: encode -> decode is exact, and the checksum catches corruption."""
import random

import numpy as np
import pytest
import torch
from delta_helpers import per_param
from hypothesis import given, settings, strategies as st
from sglang.srt.weight_sync.delta.diff import changed_positions, encode_flush
from sglang.srt.weight_sync.delta.files import flush_file, maybe_zstd_decompress, read_safetensors, write_safetensors
from sglang.srt.weight_sync.delta.ops import any_nan, repeat_counts
from sglang.srt.weight_sync.delta.positions import decode_positions, encode_positions, encode_positions_many
from sglang.srt.weight_sync.delta.validate import validate_payload
from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES, DeltaError, DeltaPayload, DeltaSpec, Refusal

ENCODINGS = ["indices", "deltas", "deltas_zstd"]
FLOATS = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _roundtrip(payload: DeltaPayload, encoding: str) -> DeltaPayload:
    data = flush_file(payload, 1 if encoding == "deltas_zstd" else None)
    return read_safetensors(maybe_zstd_decompress(data, 1 << 30, "f"), "f")


def _rebuild(payload, decoded, olds):
    out = []
    for p, old in zip(payload.spec.params, olds):
        idx = decoded.of(p)
        vals = payload.values[p.val_start:p.val_end]
        flat = old.clone().reshape(-1)
        if idx is None:
            flat.copy_(vals)
        else:
            flat[idx] = vals
        out.append(flat.view(p.shape))
    return out


@st.composite
def updates(draw):
    dtype = draw(st.sampled_from(FLOATS))
    n = draw(st.integers(0, 4))
    shapes = [draw(st.sampled_from([(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (70000,)])) for _ in range(n)]
    pairs = []
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    for s in shapes:
        old = torch.randn(s, generator=g).to(dtype)
        new = old.clone()
        numel = new.numel()
        mode = draw(st.sampled_from(["none", "all", "some", "one"]))
        if numel and mode != "none":
            if mode == "all":
                idx = torch.arange(numel)
            elif mode == "one":
                idx = torch.tensor([draw(st.integers(0, numel - 1))])
            else:
                idx = torch.randperm(numel, generator=g)[: max(1, numel // 50)]
            new.view(-1)[idx] = (new.view(-1)[idx].float() + 1).to(dtype)
        pairs.append((old, new))
    return dtype, pairs


@settings(max_examples=60, deadline=None)
@given(updates(), st.sampled_from(ENCODINGS), st.booleans())
def test_encode_decode_exact(update, encoding, transposed):
    dtype, pairs = update
    entries, olds, news = [], [], []
    for i, (old, new) in enumerate(pairs):
        if transposed and new.dim() == 2:  # non-contiguous inputs encode like their contiguous copies
            old, new = old.t(), new.t()
        entries.append((f"p{i}", new, changed_positions(old, new)))
        olds.append(old)
        news.append(new)
    payload = _roundtrip(encode_flush(entries, encoding, version=1), encoding)
    decoded = validate_payload(payload, None)
    for got, want in zip(_rebuild(payload, decoded, olds), news):
        assert got.shape == want.shape and torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("gap", [65534, 65535, 65536, 70000])
def test_gap_boundaries(gap):
    idx = torch.tensor([0, 1 + gap, 2 + 2 * gap])
    blob, width = encode_positions(idx, "deltas")
    assert width == (2 if gap <= 65535 else 4)
    assert torch.equal(decode_positions(blob, width, "deltas"), idx)
    blob, width = encode_positions(idx, "indices")
    assert width == 4 and torch.equal(decode_positions(blob, width, "indices"), idx)


def test_indices_in_any_order_are_valid_and_duplicates_are_not():
    """Our encoder sends sorted positions; an independent one may not: unique and in range is what counts."""
    old = torch.zeros(1000, dtype=torch.bfloat16)
    new = old.clone()
    new[[5, 7, 900]] = 1
    payload = encode_flush([("a", new, changed_positions(old, new)), ("b", new, changed_positions(old, new))], "indices")
    ints = payload.positions.view(torch.int32)
    ints[[0, 2]] = ints[[2, 0]].clone()  # param a's positions now 900, 7, 5 (values swapped along)
    payload.values[[0, 2]] = payload.values[[2, 0]].clone()
    payload.seal()
    got = _rebuild(payload, validate_payload(payload, None), [old, old])
    assert torch.equal(got[0], new) and torch.equal(got[1], new)
    ints[1] = ints[0]
    payload.seal()
    with pytest.raises(DeltaError, match="param 'a': duplicate position 900"):
        validate_payload(payload, None)


def test_per_param_u32_fallback():
    old = torch.zeros(200000, dtype=torch.bfloat16)
    a, b = old.clone(), old.clone()
    a[[0, 1, 2]] = 1
    b[[0, 100000]] = 1  # gap 99999 > 65535
    payload = encode_flush([("a", a, changed_positions(old, a)), ("b", b, changed_positions(old, b))], "deltas")
    assert [p.pos_width for p in payload.spec.params] == [2, 4]
    got = _rebuild(payload, validate_payload(payload, None), [old, old])
    assert torch.equal(got[0], a) and torch.equal(got[1], b)


@pytest.mark.parametrize("encoding", ["indices", "deltas"])
def test_a_flush_encodes_each_params_positions_as_if_alone(encoding):
    """The joined encoder (one pass for a flush's params): every param's bytes and width equal its own encoding —
    widths that alternate, an empty param, a first gap above 65535, a param starting below the last one's end."""
    idxs = [torch.tensor([0, 1, 2]), torch.tensor([], dtype=torch.int64), torch.tensor([0, 100000]),
            torch.tensor([70000, 70001]), torch.tensor([3]), torch.tensor([5, 6, 65541])]
    blob, ranges = encode_positions_many(idxs, encoding)
    assert [r[1] for r in ranges[:-1]] == [r[0] for r in ranges[1:]] and ranges[-1][1] == blob.numel()
    for idx, (start, end, width) in zip(idxs, ranges):
        alone, alone_width = encode_positions(idx, encoding)
        assert width == alone_width and torch.equal(blob[start:end], alone)
        assert torch.equal(decode_positions(blob[start:end], width, encoding), idx)
    if encoding == "deltas":
        assert [r[2] for r in ranges] == [2, 2, 4, 4, 2, 2]
    with pytest.raises(DeltaError, match="does not fit"):
        encode_positions_many([torch.tensor([0, 1 << 33])], encoding)
    # what no width encodes: a narrowed negative gap would decode to another, still increasing, position
    bad = [torch.tensor([-1, 2])] + ([torch.tensor([5, 3]), torch.tensor([4, 4])] if encoding == "deltas" else [])
    for idx in bad:
        with pytest.raises(DeltaError, match="param 1 of the flush: (negative position|its positions are not "
                                             "increasing and unique)"):
            encode_positions_many([torch.tensor([1, 2]), idx], encoding)


def test_dense_int_params():
    t = torch.arange(12, dtype=torch.int64).view(3, 4)
    payload = _roundtrip(encode_flush([("steps", t, None)], "deltas_zstd", full=True), "deltas_zstd")
    assert payload.spec.params[0].pos_width == 0 and payload.spec.full
    assert torch.equal(_rebuild(payload, validate_payload(payload, None), [torch.zeros_like(t)])[0], t)
    with pytest.raises(DeltaError, match="travel dense"):
        encode_flush([("steps", t, torch.tensor([1]))], "indices")


def _flush(seed=0, n=3000, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g).to(dtype)
    new = old.clone()
    idx = torch.randperm(n, generator=g)[:200].sort().values
    new[idx] = (new[idx].float() * 1.5 + 0.25).to(dtype)
    return encode_flush([("w", new, changed_positions(old, new))], "deltas")


def test_checksum_catches_every_single_bit_flip():
    payload = _flush()
    for blob in (payload.positions, payload.values.view(torch.uint8)):
        for byte in range(0, blob.numel(), max(1, blob.numel() // 64)):
            for bit in range(8):
                blob[byte] ^= 1 << bit
                with pytest.raises(DeltaError, match="checksum mismatch"):
                    validate_payload(payload, None)
                blob[byte] ^= 1 << bit
    validate_payload(payload, None)


def test_checksum_catches_swaps():
    payload = _flush()
    vals = payload.values
    rng = random.Random(0)
    for _ in range(200):
        i, j = rng.sample(range(vals.numel()), 2)
        if vals[i].view(torch.int16) == vals[j].view(torch.int16):
            continue
        vals[[i, j]] = vals[[j, i]]
        with pytest.raises(DeltaError, match="checksum mismatch"):
            validate_payload(payload, None)
        vals[[i, j]] = vals[[j, i]]
    validate_payload(payload, None)


def test_spec_json_and_metadata_roundtrip():
    spec = _flush().spec
    spec.base_version, spec.version, spec.flush, spec.final = 3, 5, 2, False  # (the checksum is not re-sealed)
    assert DeltaSpec.from_json(spec.to_json()) == spec
    assert DeltaSpec.from_metadata(spec.to_metadata()) == spec


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(encoding="xor"), "unknown encoding 'xor'"),
    (lambda d: d.update(version=-1), "'version' must be a non-negative integer"),
    (lambda d: d.update(base_version=9, version=2), "base_version 9 is above version 2"),
    (lambda d: d.update(checksum_algo="xxh3"), "unsupported checksum_algo 'xxh3'"),
    (lambda d: d["params"]["pos_width"].__setitem__(0, 3), "param 'w': pos_width must be 0, 2 or 4, got 3"),
    (lambda d: d["params"]["dtype"].__setitem__(0, "complex32"), "unknown dtype 'complex32'"),
    (lambda d: d["params"]["val_end"].__setitem__(0, True), "param 'w': val_end must be a non-negative integer"),
    (lambda d: d["params"]["pos_start"].__setitem__(0, -1), "param 'w': pos_start must be a non-negative integer"),
    (lambda d: d["params"]["shape"].__setitem__(0, [4, 2.0]), "param 'w': shape must be a list of non-negative"),
    (lambda d: d["params"]["name"].append("v"), r"columns of delta spec 'params' differ in length: .*'name': 2"),
    (lambda d: d["params"].pop("val_end"), r"exactly the columns \['name', 'dtype'"),
    (lambda d: d["params"].update(name=("w",)), "every column of delta spec 'params' must be a list"),
    (lambda d: d["params"]["name"].__setitem__(0, ""), "param name must be a non-empty string"),
    (lambda d: d.update(extra=1), r"unknown fields \['extra'\]"),
])
def test_spec_refuses_malformed(mutate, message):
    d = _flush().spec.to_dict()
    mutate(d)
    with pytest.raises(DeltaError, match=message):
        DeltaSpec.from_dict(d)


def test_a_spec_of_per_param_objects_is_an_older_wire_format():
    """Wire format 1 (params as a list of objects) is refused as unsupported, by code, not as garbage."""
    d = _flush().spec.to_dict()
    d["params"] = [dict(zip(d["params"], row)) for row in zip(*d["params"].values())]
    with pytest.raises(DeltaError, match="per-param objects \\(wire format 1\\); this engine reads wire format 2") as e:
        DeltaSpec.from_dict(d)
    assert e.value.code is Refusal.UNSUPPORTED


def test_zstd_bomb_and_bad_frame():
    import zstandard

    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (8 << 20))
    with pytest.raises(DeltaError, match="zstd output exceeds the 1048576-byte bound"):
        maybe_zstd_decompress(bomb, 1 << 20, "bomb")
    with pytest.raises(DeltaError, match="bad zstd frame"):
        maybe_zstd_decompress(b"\x28\xb5\x2f\xfd" + b"\xff" * 32, 1 << 20, "bad")


def test_header_length_overflow_and_truncation():
    payload = _flush()
    data = write_safetensors(payload.spec, payload.positions, payload.values)
    forged = (2**62).to_bytes(8, "little") + data[8:]
    with pytest.raises(DeltaError, match="header length 4611686018427387904 exceeds the 67108864-byte cap"):
        read_safetensors(forged, "f")
    with pytest.raises(DeltaError, match="do not fit the .*truncated"):
        read_safetensors(data[:-10], "f")


def _forged_file(header: dict, body: bytes, pad: int = 0) -> bytes:
    """A safetensors file as another writer may lay it out: ``pad`` spaces after the header JSON move the body."""
    import json

    text = json.dumps(header).encode() + b" " * pad
    return len(text).to_bytes(8, "little") + text + body


def test_a_file_whose_tensors_do_not_tile_its_body_is_refused_and_any_tiling_reads_bit_exact():
    """The blobs are views of the file's bytes: a hole, an overlap or trailing bytes between them is refused as
    the safetensors library refuses it; tensors in either order, at any alignment, read back bit for bit."""
    payload = _flush()
    pos, val = payload.positions.numpy().tobytes(), payload.values.view(torch.uint8).numpy().tobytes()
    md = payload.spec.to_metadata()
    nv = payload.values.numel()

    def entry(dtype, start, n):
        return {"dtype": dtype, "shape": [n], "data_offsets": [start, start + n * (2 if dtype == "BF16" else 1)]}

    for values_first in (False, True):
        for pad in (0, 1, 3):
            header = {"__metadata__": md, POSITIONS: entry("U8", len(val) if values_first else 0, len(pos)),
                      VALUES: entry("BF16", 0 if values_first else len(pos), nv)}
            got = read_safetensors(_forged_file(header, val + pos if values_first else pos + val, pad), "f")
            assert torch.equal(got.positions, payload.positions)
            assert torch.equal(got.values.view(torch.int16), payload.values.view(torch.int16))
            validate_payload(got, None)
    for what, header, body in [
        ("a hole", {POSITIONS: entry("U8", 0, len(pos)), VALUES: entry("BF16", len(pos) + 2, nv)}, pos + b"xx" + val),
        ("an overlap", {POSITIONS: entry("U8", 0, len(pos)), VALUES: entry("BF16", len(pos) - 2, nv)}, pos + val[2:]),
        ("trailing bytes", {POSITIONS: entry("U8", 0, len(pos)), VALUES: entry("BF16", len(pos), nv)}, pos + val + b"zz"),
    ]:
        with pytest.raises(DeltaError, match="not a valid safetensors file .*hole, overlap or do not end"):
            read_safetensors(_forged_file({"__metadata__": md, **header}, body), "f")


def test_no_pickle_on_the_delta_path():
    """Files and broadcasts are parsed by hand (safetensors header, JSON spec): nothing on the path unpickles."""
    import pathlib

    import sglang.srt.weight_sync.delta as pkg

    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        src = path.read_text()
        for banned in ("pickle", "torch.load", "np.load", "numpy.load", "eval(", "exec("):
            assert banned not in src, f"{path.name} uses {banned}"


def test_changed_positions_of_many_params_unite_the_staged_positions():
    """The sender's diff of a chunk (one nonzero per batch), each param united with the positions an unacknowledged
    sync staged: sorted, unique, bytes compared (-0.0 vs 0.0 counts)."""
    from sglang.srt.weight_sync.delta import diff

    old = [torch.zeros(1000, dtype=torch.bfloat16) for _ in range(3)]
    new = [o.clone() for o in old]
    new[0][[5, 17]] = 1.0
    new[2][999] = -0.0
    found = diff.changes_many(list(zip(old, new)), [torch.tensor([3, 17]), None, torch.tensor([0])])
    got = [idx for idx, _, _ in per_param(found, 3)]
    assert [g.tolist() for g in got] == [[3, 5, 17], [], [0, 999]]


def test_tensors_lying_end_to_end_join_as_a_view_and_any_other_layout_as_a_copy():
    """The diff joins a chunk's small params per dtype: tensors laid end to end in one storage, in order (the
    snapshot's slabs, a loaded file), are that storage's memory as one view; a gap, another order, a transposed
    tensor, an empty one or the end of the first one's storage make it a copy of their elements. Each way the same
    bytes."""
    from sglang.srt.weight_sync.delta import diff

    slab = torch.arange(1000, dtype=torch.int16).view(torch.bfloat16)
    cases = {
        "end to end": ([slab[10:40], slab[40:41], slab[41:141].view(10, 10)], True),
        "a gap": ([slab[10:40], slab[41:50]], False),
        "another order": ([slab[40:50], slab[10:40]], False),
        "transposed": ([slab[0:100].view(10, 10).t(), slab[100:110]], False),
        "empty": ([slab[0:10], slab[10:10], slab[10:20]], False),
        "two storages": ([slab[990:1000], torch.zeros(5, dtype=torch.bfloat16)], False),
    }
    buf = bytearray(torch.arange(200, dtype=torch.int16).numpy().tobytes())
    a, b = (torch.frombuffer(buf, dtype=torch.bfloat16, offset=at, count=100) for at in (0, 200))
    assert b.data_ptr() == a.data_ptr() + 200  # two storages back to back in memory: never read through one
    for what, (ts, view) in cases.items():
        got = diff._joined(ts, torch.int16)
        assert torch.equal(got, torch.cat([t.reshape(-1) for t in ts]).view(torch.int16)), what
        assert (got.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()) == view, what
    assert diff._adjacent([a[90:], b[:10]]) is None
    assert torch.equal(diff._joined([a[90:], b[:10]], torch.int16), torch.arange(90, 110, dtype=torch.int16))


def test_the_joined_diff_hands_over_the_new_values_bit_for_bit(monkeypatch):
    """Params are diffed joined per dtype and batch (batches small enough here to split the params), and their new
    values come out of that pass: each param's positions, values and old values (``xor_zstd``'s bases) equal its own
    diff and gathers — across dtypes of one width (bf16 beside fp16), fp8, a transposed (non-contiguous) tensor, one
    that requires grad, NaN payloads, an unchanged param, a large one and one with staged positions."""
    from sglang.srt.weight_sync.delta import diff, ops

    monkeypatch.setattr(diff, "_JOIN_BYTES", 3 * 64 * 48 * 2)

    g = torch.Generator().manual_seed(3)
    olds = [torch.randn(64, 48, generator=g).to(d) for d in
            (torch.bfloat16, torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.bfloat16,
             torch.float16, torch.float8_e4m3fn)]
    olds.append(torch.randn(300, 300, generator=g).bfloat16())  # above the joined size
    news = [o.clone() for o in olds]
    for k, n in enumerate(news):
        if k == 2:
            continue  # unchanged
        flat = n.view(-1)
        hit = torch.randint(0, flat.numel(), (flat.numel() // 20,), generator=g)
        flat.view(ops.INT_VIEW[n.element_size()])[hit] ^= 1 + k
    news[0][3, 5] = float("nan")
    news[5] = news[5].t()  # a transposed view: its flat order is the view's
    olds[5] = olds[5].t().contiguous()
    news[1].requires_grad_(True)
    staged = [None] * len(olds)
    staged[3] = torch.tensor([0, 7])
    found = diff.changes_many(list(zip(olds, news)), staged, want_olds=True)
    got = per_param(found, len(olds))
    for k, (old, new, (idx, values, at_old)) in enumerate(zip(olds, news, got)):
        want = diff.changed_positions(old, new)
        if staged[k] is not None:
            want = torch.unique(torch.cat([want, staged[k]]))
        assert torch.equal(idx, want), k
        iv = ops.INT_VIEW[new.element_size()]
        for t, of in ((values, new), (at_old, old)):
            assert t.dtype == new.dtype and torch.equal(t.view(iv), ops.gather(of.detach().reshape(-1), idx).view(iv))
    assert got[2][0].numel() == 0


def test_no_garbage_collection_while_a_sync_runs():
    """A sync pauses the cyclic collector and gives back the caller's setting, also when it raises."""
    import gc

    from sglang.srt.weight_sync.delta.ops import gc_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("a sync failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
@pytest.mark.parametrize("at", [None, 0, "word_end", "block_edge", "last"])
@pytest.mark.parametrize("negative", [False, True])
def test_the_checksum_pass_finds_one_nan_anywhere(dtype, at, negative):
    """The engine's NaN check rides on the checksum's pass over 64-bit words, lane by lane: a NaN in the first lane,
    a word's last lane, at a checksum block's edge or in the zero-padded tail word is found, with either sign;
    infinities and the largest finite values are not NaN, and the sums are the checksum's own."""
    from sglang.srt.weight_sync.delta import wire

    size = dtype.itemsize
    lanes, block = 8 // size, 1 << 15  # CPU words per checksum block
    n = 2 * block * lanes + 3  # two blocks and a partial tail word
    t = torch.full((n,), 0.5).to(dtype)
    bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[size])
    specials = {torch.bfloat16: (0x7F80, 0x7F7F), torch.float16: (0x7C00, 0x7BFF), torch.float32: (0x7F800000, 0x7F7FFFFF),
                torch.float8_e4m3fn: (0x7E, 0x7E), torch.float8_e5m2: (0x7C, 0x7B)}[dtype]  # inf (or max) and max
    sign = {1: 0x80, 2: -0x8000, 4: -0x80000000}[size]
    for k, v in enumerate(specials):  # ±inf and ±max finite around the places a NaN goes
        bits[5 + k], bits[block * lanes - 2 - k] = v, v | sign
    nan_bits = specials[0] + 1 if dtype != torch.float8_e4m3fn else 0x7F  # the NaN closest to inf (or max)
    if at is not None:
        i = {0: 0, "word_end": lanes - 1, "block_edge": block * lanes, "last": n - 1}[at]
        bits[i] = (nan_bits | sign) if negative else nan_bits
    assert bool(torch.isnan(t.float()).any()) == (at is not None)  # the test's own premise
    pos = torch.arange(11, dtype=torch.uint8)
    sums, nan = wire.checked_sums(pos, t)
    assert bool(nan) == (at is not None) and sums == wire.blob_sums(pos, t)
    assert bool(any_nan(t)) == (at is not None)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 4], [2, 0, 0], [7], [0], []])
def test_repeat_counts_is_repeat_interleave(counts):
    """Runs of host-known lengths, empty ones first, between and last among them."""
    values = torch.tensor([(-1) ** k * (1 << 40) * k + 3 for k in range(len(counts))], dtype=torch.int64)
    want = torch.repeat_interleave(values, torch.tensor(counts, dtype=torch.int64))
    assert torch.equal(repeat_counts(values, counts), want)


def test_the_column_check_never_accepts_what_the_param_loop_refuses():
    """The fast structure check against the loop that names faults, over a thousand lying specs and manifests:
    it accepts only what the loop accepts (with the same result) and it accepts every honest flush."""
    from sglang.srt.weight_sync.delta import validate, wire

    g = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    names = [f"model.layers.{k}.w" for k in range(5)]
    taken = refused = 0
    for trial in range(1500):
        entries = []
        for k, name in enumerate(names[:rng.randint(0, 5)]):
            old = torch.randn(rng.randint(1, 300), generator=g).to(torch.bfloat16)
            new = old.clone()
            new[torch.randperm(old.numel(), generator=g)[:rng.randint(0, old.numel())]] += 1
            idx = changed_positions(old, new) if rng.random() < 0.8 else None
            entries.append((name, new.reshape(-1, 1) if k % 2 else new, idx))
        pl = encode_flush(entries, rng.choice(["indices", "deltas"]))
        manifest = {p.name: (list(p.shape), p.dtype) for p in pl.spec.params}
        lies = rng.choice([0, 1, 1, 2])
        for _ in range(lies):
            what = rng.randrange(12)
            ps = pl.spec.params
            if what < 8 and ps:
                p, field = rng.choice(ps), wire._PARAM_FIELDS[what]
                v = getattr(p, field)
                if field == "name":
                    p.name = rng.choice(names + ["x"])
                elif field == "dtype":
                    p.dtype = rng.choice(["float16", "int32", "bfloat16", "torch.bfloat16"])
                elif field == "shape":
                    p.shape = rng.choice([[], [v[0] + 1], list(reversed(v)), v + [1], [0], [1 << 70]])
                else:
                    p.__dict__[field] = rng.choice([v + 1, v - 1, 0, 2, 4, 3, 1 << 70, -5, v * 2])
            elif what == 8:
                pl.spec.full = not pl.spec.full
            elif what == 9:
                pl.spec.encoding = rng.choice(["indices", "deltas", "xor_zstd"])
            elif what == 10 and manifest:
                name = rng.choice(list(manifest))
                shape, dtype = manifest[name]
                manifest[name] = rng.choice([(tuple(shape), dtype), (shape + [2], dtype), (shape, "float16")])
            elif manifest:
                manifest.pop(rng.choice(list(manifest)))
        for m in (manifest, None):
            fast = validate._structure_by_columns(pl, m)
            try:
                slow = validate._structure_one_by_one(pl, m, "")
            except DeltaError:
                slow = "refused"
            assert fast is None or fast == slow, (trial, pl.spec, m)
            assert lies or fast is not None, (trial, pl.spec, m)
            taken += fast is not None
            refused += slow == "refused"
    assert taken > 1500 and refused > 800, (taken, refused)


@pytest.mark.parametrize("seed", range(6))
def test_plane_transposition_batches_small_segments_and_keeps_every_byte(seed):
    """Plane-major blobs: segments of mixed widths and sizes (many small ones batched together, large ones alone,
    batches cut at their size bound) against the per-segment definition, and back."""
    from sglang.srt.weight_sync.delta import files

    rng = random.Random(seed)
    segments, at = [], 0
    for _ in range(rng.randrange(1, 400)):
        w = rng.choice([1, 2, 2, 4, 4, 8])
        n = rng.choice([1, 2, 3, rng.randrange(1, 200), rng.randrange(4000, 4200), rng.randrange(1, 3000)])
        segments.append((at, n, w))
        at += n * w
    blob = np.frombuffer(rng.randbytes(at), dtype=np.uint8).copy()
    want = blob.copy()
    for start, n, w in segments:  # the definition: byte k of element i goes to plane k
        want[start:start + n * w] = blob[start:start + n * w].reshape(n, w).T.reshape(-1)
    was = files._PLANE_BATCH_ELEMENTS
    files._PLANE_BATCH_ELEMENTS = 500  # several batches per blob
    try:
        planes = files._to_planes(blob, segments)
        assert np.array_equal(planes, want)
        assert np.array_equal(files._from_planes(planes, segments), blob)
    finally:
        files._PLANE_BATCH_ELEMENTS = was
    assert any(isinstance(r, list) for r in files._plane_runs(segments)) or len(segments) < 3


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("encoding", ["indices", "deltas"])
@pytest.mark.parametrize("run", [1, 5, 300, 1 << 20])
def test_positions_checked_in_one_pass_and_decoded_again_run_by_run(monkeypatch, seed, encoding, run):
    """Runs of one param, of a few, of all (kept from the checking pass): widths that alternate within a run, empty
    and dense params between sparse ones, a blob at an odd offset; every param's positions equal its own decode,
    through the writes' runs (over any subset) and one by one. A position out of range in the last run is refused."""
    from sglang.srt.weight_sync.delta import positions

    monkeypatch.setattr(positions, "_DECODE_RUN", run)
    rng = random.Random(seed)
    entries = []
    for k in range(rng.randrange(2, 40)):
        numel = rng.choice([1, 7, 300, 70000, 200000])
        old = torch.zeros(numel, dtype=torch.bfloat16)
        new = old.clone()
        n = min(numel, rng.choice([0, 1, 2, numel // 3, numel]))
        idx = torch.tensor(sorted(rng.sample(range(numel), n)), dtype=torch.int64)
        new[idx] = 1
        entries.append((f"p{k}", new, None if rng.random() < 0.1 else idx))
    entries.append(("last", torch.ones(70000, dtype=torch.bfloat16), torch.tensor([5, 69999])))
    flat = encode_flush(entries, encoding, version=2, base_version=1)
    spec = flat.spec
    odd = torch.empty(flat.positions.numel() + 1, dtype=torch.uint8)[1:]  # a view off every alignment
    odd.copy_(flat.positions)
    payload = DeltaPayload(spec, odd, flat.values)
    positions = validate_payload(payload, None)
    sparse = [p for p in spec.params if not p.dense]
    for p in spec.params:
        got = positions.of(p)
        assert got is None if p.dense else torch.equal(got, decode_positions(
            flat.positions[p.pos_start:p.pos_end], p.pos_width, encoding))
    live = [p for p in sparse if p.nnz]
    for subset in (live, live[::2], live[1::3]):
        seen = []
        for run in positions.runs(subset):  # a run's tensor holds until the next run
            seen += [(p.name, run.positions[a:a + p.nnz].clone()) for p, a in zip(run.params, run.starts)]
        assert [n for n, _ in seen] == [p.name for p in subset]
        for (_, idx), p in zip(seen, subset):
            assert torch.equal(idx, positions.of(p))
    assert {2, 4} <= {p.pos_width for p in live} or encoding == "indices"
    last = spec.params[-1]
    bad = flat.positions.clone()
    assert last.pos_width == 4  # its gap is above 65535: 70000 as u32 is a position (or a gap) past its end
    bad[last.pos_end - 4:last.pos_end] = torch.tensor([70000], dtype=torch.int32).view(torch.uint8)
    broken = DeltaPayload(spec, bad, flat.values).seal()
    with pytest.raises(DeltaError, match=f"param 'last': position {70000 if encoding == 'indices' else 70006} out of "
                                         "range for 70000 elements"):
        validate_payload(broken, None)


@pytest.mark.parametrize("n_changed", [201, 202])
def test_positions_off_their_alignment_in_a_file_decode_through_an_aligned_buffer(n_changed):
    """Our writer puts bf16 values first: an odd count of them leaves the u32 positions 2 bytes off alignment."""
    old = torch.zeros(5000, dtype=torch.bfloat16)
    new = old.clone()
    idx = torch.arange(0, 5000, 5000 // n_changed)[:n_changed]
    new[idx] = 1
    payload = _roundtrip(encode_flush([("w", new, changed_positions(old, new))], "indices"), "indices")
    assert (payload.positions.storage_offset() % 4 != 0) == (n_changed % 2 == 1)
    got = validate_payload(payload, None).of(payload.spec.params[0])
    assert torch.equal(got, idx)


def test_a_flush_whose_counts_or_bases_do_not_pair_with_its_blobs_is_not_encoded():
    """The spec is made from each entry's names, shapes and counts and then signed by the checksum, so a count off
    its own positions, values or bases would be a consistent lie: refused per entry, also when two entries' errors
    cancel in total (one base a value long, the next one short)."""
    from sglang.srt.weight_sync.delta.diff import FlushEntry, encode_gathered

    v, i = torch.arange(6, dtype=torch.bfloat16), torch.arange(6)

    def entry(counts, values=v, idx=i, base=None):
        return FlushEntry(["a", "b"], [[4], [4]], counts, values, idx, base)

    good = encode_gathered([entry([3, 3])], "deltas")
    assert [p.nnz for p in good.spec.params] == [3, 3]
    with pytest.raises(DeltaError, match=r"params \['a', 'b'\]: counts 5, values 6, positions 6 and bases None do "
                                         r"not pair"):
        encode_gathered([entry([3, 2])], "deltas")
    with pytest.raises(DeltaError, match="counts 6, values 6, positions 5 and bases None"):
        encode_gathered([entry([3, 3], idx=i[:5])], "deltas")
    with pytest.raises(DeltaError, match="counts 6, values 6, positions 6 and bases 7"):
        encode_gathered([entry([3, 3], base=torch.zeros(7, dtype=torch.bfloat16)),
                         entry([3, 3], base=torch.zeros(5, dtype=torch.bfloat16))], "xor_zstd")
    # names, shapes and counts are joined across entries: one entry a name short would shift every later param
    with pytest.raises(DeltaError, match=r"params \['a'\]: 1 names, 2 shapes and 2 counts do not pair"):
        encode_gathered([entry([3, 3]), FlushEntry(["a"], [[4], [4]], [3, 3], v, i)], "deltas")
