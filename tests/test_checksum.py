"""The ``mix64`` checksum: an independent reference from docs/wire-format.md, and the corruptions it must catch.

The checksum is ``blake2b(tag, canonical spec, blob lengths, S_pos, S_val)``: a corruption is caught
exactly when it changes the canonical spec, a length, or a blob sum. The bulk cases below (> 10**5)
therefore check the real blob sum (``mix64.blob_sum``) of every corrupted blob; the end-to-end cases
in ``test_receiver_refusals`` run the same corruptions through a real engine and check that the
weights stay untouched.
"""
import hashlib
import json
import random
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sglang.srt.weight_sync.delta import mix64
from sglang.srt.weight_sync.delta.diff import changed_positions, encode_flush
from sglang.srt.weight_sync.delta.validate import validate_payload
from sglang.srt.weight_sync.delta.wire import (
    POSITIONS,
    VALUES,
    DeltaError,
    DeltaPayload,
    DeltaSpec,
    canonical_spec,
    flush_checksum,
    received_params,
)

M = 2**64 - 1
C1, C2, C3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
DOMAIN = {POSITIONS: 0x5A17E5C0FFEE0001, VALUES: 0x5A17E5C0FFEE0002}


# ---------------------------------------------------------------- the reference, from the doc alone


def ref_mix(x: int) -> int:
    x ^= x >> 30
    x = (x * C2) & M
    x ^= x >> 27
    x = (x * C3) & M
    return x ^ (x >> 31)


def ref_blob_sum(blob: bytes, domain: int) -> int:
    blob += b"\0" * (-len(blob) % 8)
    return sum(ref_mix(int.from_bytes(blob[8 * i:8 * i + 8], "little") ^ ((i * C1 + domain) & M))
               for i in range(len(blob) // 8)) & M


def ref_checksum(spec_json: str, pos: bytes, val: bytes) -> str:
    d = json.loads(spec_json)
    d.pop("checksum")
    canon = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    sums = struct.pack("<QQQQ", len(pos), len(val), ref_blob_sum(pos, DOMAIN[POSITIONS]), ref_blob_sum(val, DOMAIN[VALUES]))
    return hashlib.blake2b(b"delta-mix64\0" + canon + sums, digest_size=8).hexdigest()


def _flush(seed=0, n=3000, dtype=torch.bfloat16, names=("w",), **fields):
    g = torch.Generator().manual_seed(seed)
    entries = []
    for name in names:
        old = torch.randn(n, generator=g).to(dtype)
        new = old.clone()
        idx = torch.randperm(n, generator=g)[:200].sort().values
        new[idx] = (new[idx].float() * 1.5 + 0.25).to(dtype)
        entries.append((name, new, changed_positions(old, new)))
    return encode_flush(entries, "deltas", **fields)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=300), st.binary(min_size=0, max_size=300), st.integers(0, 2**40))
def test_matches_the_documented_reference(pos, val, version):
    p = torch.frombuffer(bytearray(pos), dtype=torch.uint8) if pos else torch.empty(0, dtype=torch.uint8)
    v = torch.frombuffer(bytearray(val), dtype=torch.uint8) if val else torch.empty(0, dtype=torch.uint8)
    spec = DeltaSpec(encoding="indices", params=[], version=version, base_version=version // 2)
    assert flush_checksum(spec, p, v) == ref_checksum(spec.to_json(), pos, val)


def test_a_real_flush_matches_the_reference():
    pl = _flush(names=("a", "b"), version=4, base_version=2, flush=1, final=False)
    assert pl.spec.checksum == ref_checksum(pl.spec.to_json(), _bytes(pl.positions), _bytes(pl.values))
    assert pl.spec.checksum_algo == "mix64"


# ---------------------------------------------------------------- bulk corruption classes


class _Sums:
    """The real blob sum of a fixed random blob and of corrupted copies of it (counts the cases)."""

    def __init__(self, words: int, seed: int):
        self.data = random.Random(seed).randbytes(8 * words)
        self.base = self._sum(self.data)
        self.cases = 0

    @staticmethod
    def _sum(data) -> int:
        return int(mix64.blob_sum(torch.frombuffer(bytearray(data), dtype=torch.uint8), DOMAIN[VALUES])[0])

    def differs(self, corrupt) -> bool:
        b = bytearray(self.data)
        corrupt(memoryview(b))
        self.cases += 1
        return b == self.data or self._sum(b) != self.base


def _flip(bits):
    def corrupt(b):
        for bit in bits:
            b[bit // 8] ^= 1 << (bit % 8)
    return corrupt


def test_every_pair_of_bit_flips_in_a_window_and_at_power_of_two_distances():
    s = _Sums(words=16, seed=1)
    nbits = 8 * len(s.data)
    pairs = {(a, a + d) for a in range(nbits) for d in range(1, 65) if a + d < nbits}
    pairs |= {(a, a + (1 << k)) for a in range(nbits) for k in range(11) if a + (1 << k) < nbits}
    missed = [p for p in sorted(pairs) if not s.differs(_flip(p))]
    assert missed == [] and s.cases == len(pairs) > 65000


def test_sign_bit_pairs():
    """Both sign bits of any two bf16 values (the linear wsum64 missed those at bit 63 of two words)."""
    s = _Sums(words=32, seed=2)
    signs = [16 * k + 15 for k in range(len(s.data) // 2)]
    pairs = [(a, b) for i, a in enumerate(signs) for b in signs[i + 1:]]
    missed = [p for p in pairs if not s.differs(_flip(p))]
    assert missed == [] and s.cases == len(pairs) == 8128


def test_swaps_at_power_of_two_distances():
    s = _Sums(words=64, seed=3)

    def swap(width, i, j):
        def corrupt(b):
            v = b.cast({2: "H", 8: "Q"}[width])
            v[i], v[j] = v[j], v[i]
        return corrupt

    missed = []
    for width in (2, 8):
        n = len(s.data) // width
        for i in range(n):
            for k in range(12):
                j = i + (1 << k)
                if j < n and not s.differs(swap(width, i, j)):
                    missed.append((width, i, j))
    assert missed == [] and s.cases > 2000


def test_random_multi_word_corruptions():
    s = _Sums(words=32, seed=4)
    rng = random.Random(5)
    missed = 0
    for _ in range(100_000):
        words = rng.sample(range(32), rng.randint(2, 6))
        kind, mask = rng.random(), rng.choice([1 << 63, 1 << 62, 1 << 48, 3])

        def corrupt(b, words=words, kind=kind, mask=mask):
            w = b.cast("Q")
            for i in words:
                if kind < 0.4:  # one random bit flipped per word
                    w[i] ^= 1 << rng.randrange(64)
                elif kind < 0.7:  # the same xor mask in every word (what cancels in a linear sum)
                    w[i] ^= mask
                else:
                    w[i] = rng.randrange(2**64)
        missed += not s.differs(corrupt)
    assert missed == 0 and s.cases == 100_000


# ---------------------------------------------------------------- the spec is covered


def _spec_mutations(spec: DeltaSpec):
    """Every single-field change of a spec, and the lies that keep the blobs valid."""
    for field, new in (("encoding", "indices"), ("full", not spec.full), ("base_version", spec.base_version + 1),
                       ("version", spec.version + 1), ("flush", spec.flush + 1), ("final", not spec.final)):
        yield f"spec.{field}", lambda s, f=field, v=new: setattr(s, f, v)
    for i in range(len(spec.params)):
        for field in ("name", "dtype", "shape", "pos_start", "pos_end", "pos_width", "val_start", "val_end"):
            def mutate(s, i=i, field=field):
                p, changed = s.params[i], {"name": "x", "dtype": "float16", "shape": [7], "pos_width": 0}
                setattr(p, field, changed[field] if field in changed else getattr(p, field) + 1)
            yield f"params[{i}].{field}", mutate

    def swap_names(s):
        s.params[0].name, s.params[1].name = s.params[1].name, s.params[0].name

    def shift_offsets(s):  # every param takes the next one's blob ranges (same sizes: still tiles)
        ranges = [(p.pos_start, p.pos_end, p.val_start, p.val_end) for p in s.params]
        for p, r in zip(s.params, ranges[1:] + ranges[:1]):
            p.pos_start, p.pos_end, p.val_start, p.val_end = r

    yield "two names swapped", swap_names
    yield "offsets shifted by one param", shift_offsets


def test_every_spec_field_and_name_order_is_covered():
    pl = _flush(names=("model.a.weight", "model.b.weight", "model.c.weight"), version=3, base_version=2, final=True)
    seen = 0
    for what, mutate in _spec_mutations(pl.spec):
        spec = DeltaSpec.from_json(pl.spec.to_json())
        mutate(spec)
        assert flush_checksum(spec, pl.positions, pl.values) != pl.spec.checksum, what
        seen += 1
    assert seen == 6 + 8 * 3 + 2


def test_old_algorithm_refused():
    d = _flush().spec.to_dict()
    d["checksum_algo"] = "wsum64"
    with pytest.raises(DeltaError, match="unsupported checksum_algo 'wsum64' \\(have: mix64\\)"):
        DeltaSpec.from_dict(d)


def test_a_valid_flush_with_swapped_names_is_refused():
    pl = _flush(names=("model.a.weight", "model.b.weight"))
    pl.spec.params[0].name, pl.spec.params[1].name = "model.b.weight", "model.a.weight"
    with pytest.raises(DeltaError, match="checksum mismatch"):
        validate_payload(pl, None)


ODD_NAMES = ("model.a.weight", 'model.\u00e9."q",\\"part\\":1', ',"part":0}', "model.b.weight")


def test_the_params_text_that_arrived_hashes_as_the_parsed_spec():
    """The engine hashes the params' JSON text as it arrived (broadcast: inside the spec's text; disk: the metadata
    entry) instead of serializing the parsed columns again: the same bytes, for any name (non-ASCII, quotes,
    backslashes, the text that ends the params in a spec's JSON)."""
    pl = _flush(names=ODD_NAMES, version=5, base_version=4, flush=2, final=False)
    text = pl.spec.to_json()
    assert DeltaSpec.from_json(text) == pl.spec
    for arrived in (received_params(text), pl.spec.to_metadata()["params"]):
        assert canonical_spec(pl.spec, arrived) == canonical_spec(pl.spec)
        validate_payload(DeltaPayload(DeltaSpec.from_json(text), pl.positions, pl.values, params_text=arrived), None)


def test_a_sealed_flush_serializes_its_params_once_for_the_checksum_and_both_transports(monkeypatch):
    """The seal hashes the params' canonical JSON and keeps it: the broadcast's spec text and the file's metadata are
    written from it, equal to serializing the spec again; a file read back hands that text to the checksum."""
    from sglang.srt.weight_sync.delta import files, wire

    calls, real = [], wire.params_json
    monkeypatch.setattr(wire, "params_json", lambda spec: calls.append(spec) or real(spec))
    pl = _flush(names=ODD_NAMES, version=2, base_version=1)
    text, data = wire.spec_json(pl), files.flush_file(pl)
    assert len(calls) == 1
    assert text == pl.spec.to_json()
    back = files.read_safetensors(data)
    assert back.spec == pl.spec and back.params_text == real(pl.spec)
    validate_payload(back, None)


def test_a_spec_text_in_another_layout_is_judged_by_what_it_parses_to():
    """A sender that writes the spec in another layout (columns in field order, spaces) is accepted on what its text
    parses to; a text whose names were swapped under the same checksum is refused either way, and one with a second
    ``params`` after the hashed one is no spec."""
    pl = _flush(names=ODD_NAMES)
    d = pl.spec.to_dict()
    texts = {"field order": json.dumps(d, separators=(",", ":")), "spaces": json.dumps(d, indent=1)}
    for what, text in texts.items():
        assert received_params(text) != received_params(pl.spec.to_json()), what
        validate_payload(DeltaPayload(DeltaSpec.from_json(text), pl.positions, pl.values,
                                      params_text=received_params(text)), None)
    md = pl.spec.to_metadata()
    md["params"] = json.dumps(d["params"], indent=2)
    validate_payload(DeltaPayload(DeltaSpec.from_metadata(md), pl.positions, pl.values, params_text=md["params"]),
                     None)
    swapped = pl.spec.to_json().replace("model.a.weight", "@").replace("model.b.weight", "model.a.weight")
    swapped = swapped.replace("@", "model.b.weight")
    lie = _flush(names=("model.x.weight",) * 1 + ODD_NAMES[1:]).spec.to_json()
    second = pl.spec.to_json()[:-1] + ',"params":' + received_params(lie) + "}"  # the first one is what is hashed
    with pytest.raises(DeltaError, match="not valid JSON: duplicate keys \\['params'\\]"):
        DeltaSpec.from_json(second)
    for text in (swapped, texts["field order"].replace("model.a.weight", "model.A.weight")):
        with pytest.raises(DeltaError, match="checksum mismatch"):
            validate_payload(DeltaPayload(DeltaSpec.from_json(text), pl.positions, pl.values,
                                          params_text=received_params(text)), None)


# ---------------------------------------------------------------- the blob sum at its edges


def _words(n: int, seed: int) -> bytes:
    """Random bytes with the edge words (sign bit, all ones, wrap-around constants) at both ends."""
    data = bytearray(random.Random(seed).randbytes(n))
    edge = b"".join(w.to_bytes(8, "little") for w in (2**63, M, 2**63 - 1, C1, C2, C3, 0, 1))
    data[:len(edge)] = edge[:n]
    data[-min(n, len(edge)):] = edge[:min(n, len(edge))]
    return bytes(data)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 33 * 8, 40 * 8 + 5, 4099 * 8 + 1, 3000, (1 << 15) * 8 + 8])
def test_the_blob_sum_matches_the_reference(n):
    """Across the padded tail word and the edge of a block of the in-place passes."""
    data = _words(n, n)
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for domain in DOMAIN.values():
        assert int(mix64.blob_sum(blob, domain)[0]) & M == ref_blob_sum(data, domain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_the_blob_sum_flags_a_nan_anywhere_and_keeps_its_sum(dtype):
    n = (1 << 18) + 5
    t = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(dtype)
    bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize])
    for at in (None, 0, 3, (1 << 15) * 8 // dtype.itemsize - 1, n - 1):
        old = None if at is None else bits[at].clone()
        if at is not None:
            bits[at] = -1  # all ones: a negative NaN
        data = t.view(torch.uint8).numpy().tobytes()
        total, found = mix64.blob_sum(t, DOMAIN[VALUES], dtype)
        assert int(total) & M == ref_blob_sum(data, DOMAIN[VALUES])
        assert bool(found) == bool(torch.isnan(t.float()).any()) == (at is not None)
        if at is not None:
            bits[at] = old


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_the_blob_sum_is_one_sum_whatever_the_thread_count(threads):
    data = _words((1 << 18) * 8 + 3, threads)
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = int(mix64.blob_sum(blob, DOMAIN[VALUES], torch.bfloat16)[0]) & M
    finally:
        torch.set_num_threads(was)
    assert got == ref_blob_sum(data, DOMAIN[VALUES])
