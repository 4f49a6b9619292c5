"""``xor_ctx``: the change coded with contexts from the base. Real AdamW steps through the CLI (bytes and bit-identity
against ``xor_zstd`` on the same states), the coder's corners (escapes, complement classes, every dtype it codes),
and every lie in a file refused before a weight is touched."""
import dataclasses
import json
import os
import struct

import numpy as np
import pytest
import torch

from cpu_harness import hf_config, rl_states, write_hf_checkpoint
from sglang.srt.weight_sync.delta import ctx
from sglang.srt.weight_sync.delta.diff import encode_flush
from sglang.srt.weight_sync.delta.files import flush_file, maybe_zstd_decompress, read_safetensors
from sglang.srt.weight_sync.delta.validate import uncode, validate_payload
from sglang.srt.weight_sync.delta.wire import DeltaError
from test_tools import tensors, tool


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctx")
    cfg = hf_config("qwen3", vocab=4096, hidden=256)  # 3.3M elements: the table's share is what a model's would be
    states = rl_states(cfg, 2, seed=0, lr=1e-6)
    return root, [write_hf_checkpoint(str(root / f"step{i}"), cfg, s) for i, s in enumerate(states)], states


def _size(out) -> tuple:
    m = json.loads((out / "delta.json").read_text())
    return sum(os.path.getsize(out / f) for f in m["files"]), m["changed"], m["elements"]


@pytest.mark.parametrize("step", [0, 1])
def test_cli_rebuilds_real_adamw_steps_at_under_0_85_bytes_and_0_7x_xor_zstd(steps, step):
    root, ckpts, _ = steps
    old, new = ckpts[step], ckpts[step + 1]
    sizes = {}
    for enc in ("xor_zstd", "xor_ctx"):
        out = root / f"{enc}-{step}"
        r = tool("diff", old, new, "--out", out, "--encoding", enc)
        assert r.returncode == 0, r.stderr
        sizes[enc] = _size(out)
    (ctx_bytes, changed, elements), (xor_bytes, _, _) = sizes["xor_ctx"], sizes["xor_zstd"]
    assert 0.01 < changed / elements < 0.05
    print(f"step {step}: xor_ctx {ctx_bytes / changed:.3f} B/changed, xor_zstd {xor_bytes / changed:.3f}, "
          f"ratio {ctx_bytes / xor_bytes:.3f}")
    assert ctx_bytes / changed <= 0.85 and ctx_bytes <= 0.7 * xor_bytes
    r = tool("apply", old, root / f"xor_ctx-{step}", "--out", root / f"rebuilt-{step}")
    assert r.returncode == 0, r.stderr
    want, got = tensors(new), tensors(root / f"rebuilt-{step}")
    assert want.keys() == got.keys()
    for n in want:
        assert torch.equal(want[n].view(torch.int16), got[n].view(torch.int16)), n


def _roundtrip(olds, news, seg_log2=ctx.SEG_LOG2):
    """Flush -> file -> rebuilt against ``olds``: the new tensors' bits at the changed positions, checked."""
    names = list(news)
    entries = []
    for n in names:
        a, b = olds[n].reshape(-1), news[n].reshape(-1)
        iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        entries.append((n, news[n], torch.nonzero(a.view(iv) != b.view(iv))[:, 0]))
    pl = encode_flush(entries, "xor_ctx", bases=[olds[n] for n in names], version=1, base_version=0)
    pl.seg_log2 = seg_log2
    data = flush_file(pl, 1)
    got = read_safetensors(maybe_zstd_decompress(data, 1 << 30))
    return pl, got, _reader(olds, got)


def _reader(olds, pl):
    names = [p.name for p in pl.spec.params]
    return lambda pieces: torch.cat([olds[names[k]].reshape(-1)[a:a + n] for k, a, n in pieces])


def _rebuild(pl, read):
    out = uncode(pl, None, read)
    validate_payload(out, None)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_escapes_complements_and_every_coded_dtype_round_trip(dtype):
    g = torch.Generator().manual_seed(3)
    olds, news = {}, {}
    base = (torch.randn(300_000, generator=g) * 0.02).to(dtype)  # 5 segments of 2**16
    new = base.clone()
    # a class where every element changes (complement), steps of thousands of ULPs (escapes), one far change,
    # sign crossings, and zeros of both signs
    small = base.to(torch.float32).abs() < 1e-3
    new[small] = (base[small].to(torch.float32) * -3.0).to(dtype)
    pick = torch.randperm(300_000, generator=g)[:6000]
    new[pick] = (base[pick].to(torch.float32) + 1e-4 * torch.randn(6000, generator=g)).to(dtype)
    new[299_999] = torch.tensor(-1.0).to(dtype)
    olds["a.weight"], news["a.weight"] = base.reshape(600, 500), new.reshape(600, 500)
    z = torch.zeros(1000)
    z[::2] = -0.0
    olds["b.weight"], news["b.weight"] = z.to(dtype), torch.where(torch.arange(1000) % 3 == 0, -z, z).to(dtype)
    olds["c.weight"] = news["c.weight"] = torch.ones(10, dtype=dtype)  # unchanged: no entry
    for seg_log2 in (ctx.SEG_LOG2, ctx.SEG_LOG2_MIN):  # one segment, and many (a large param split, small ones joined)
        sent, got, read = _roundtrip(olds, news, seg_log2)
        out = _rebuild(got, read)
        assert out.spec.checksum == sent.spec.checksum
        assert torch.equal(out.positions, sent.positions)
        assert torch.equal(out.values.view(torch.uint8), sent.values.view(torch.uint8))


def _state(steps):
    _, _, states = steps
    names = [n for n in states[0] if states[0][n].dtype == torch.bfloat16][:6]
    return {n: states[0][n] for n in names}, {n: states[1][n] for n in names}, {n: states[2][n] for n in names}


class _Blob:
    """An xor_ctx positions blob cut into its parts, to lie about one and put it back together."""

    def __init__(self, blob: torch.Tensor):
        raw = bytes(blob.numpy())
        self.head = list(ctx._HEADER.unpack(raw[:ctx._HEADER.size]))
        n, at = self.head[4], ctx._HEADER.size
        self.cols = {}
        for name, t in ctx._COLUMNS:
            size = np.dtype(t).itemsize * n
            self.cols[name] = np.frombuffer(raw[at:at + size], dtype=t).copy()
            at += size
        self.streams = []
        for length in self.head[5:]:
            self.streams.append(raw[at:at + length])
            at += length

    def bytes(self, fix_lengths=True) -> torch.Tensor:
        if fix_lengths:
            self.head[5:] = [len(s) for s in self.streams]
        raw = ctx._HEADER.pack(*self.head) + b"".join(self.cols[n].tobytes() for n, _ in ctx._COLUMNS) \
            + b"".join(self.streams)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _lie(edit):
    def apply(pl):
        b = _Blob(pl.positions)
        out = edit(b)
        return dataclasses.replace(pl, positions=out if out is not None else b.bytes())
    return apply


def _set(col, k, value):
    def edit(b):
        b.cols[col][k] = value
    return edit


LIES = {
    "a class count off the spec": (lambda b: [b.cols[c].__setitem__(0, b.cols[c][0] + 1) for c in ("count", "coded")]
                                   and None, "changes in its classes, the spec's sparse params hold"),
    "a context past the dtype's": (_set("ctx", 0, 300), "has a context above 255"),
    "entries out of order": (lambda b: b.cols["ctx"].__setitem__(slice(0, 2), b.cols["ctx"][[1, 0]]),
                             "is out of order or repeated"),
    "a Rice parameter past 31": (_set("kp", 0, 40), "has a Rice parameter above 31"),
    "segments past the bound": (lambda b: b.head.__setitem__(2, 23), "segments of 2**23 elements"),
    "a segment past the elements": (_set("seg", 0, 99), "has a segment past the flush's sparse elements"),
    "unknown flags": (_set("flags", 0, 8), "has unknown flags"),
    "a complement class larger than a segment": (lambda b: [b.cols["flags"].__setitem__(0, 1),
                                                            b.cols["coded"].__setitem__(0, 1 << 31)] and None,
                                                 "has more members than a segment holds"),
    "complement classes that outnumber their segment": (
        lambda b: [b.cols["flags"].__setitem__(slice(0, 2), 1), b.cols["seg"].__setitem__(1, b.cols["seg"][0]),
                   b.cols["coded"].__setitem__(slice(0, 2), (1 << b.head[2]) - b.cols["count"][:2])] and None,
        "has classes with more members than its segment holds"),
    "a unary stream too short for the table's codes": (
        lambda b: b.streams.__setitem__(0, b.streams[0][:len(b.streams[0]) // 64]), "cannot hold the table's"),
    "a unary stream that ends early": (lambda b: b.streams.__setitem__(0, b.streams[0][:-1]),
                                       "the unary stream does not match"),
    "a remainder stream that runs on": (lambda b: b.streams.__setitem__(1, b.streams[1] + b"\x00"),
                                        "the remainder stream does not match"),
    "a sign stream that runs on": (lambda b: b.streams.__setitem__(2, b.streams[2] + b"\x01"),
                                   "the signs stream does not match"),
    "a header whose lengths lie": (lambda b: b.bytes(fix_lengths=False)[:-1], "a stream ends early or runs on"),
    "unknown header flags": (lambda b: b.head.__setitem__(3, 2), "not an xor_ctx version 1 header"),
    "another magic": (lambda b: torch.frombuffer(bytearray(b"NOPE" + bytes(b.bytes().numpy())[4:]),
                                                 dtype=torch.uint8), "not an xor_ctx version 1 header"),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_every_lie_is_refused_by_name_before_a_write(steps, lie):
    old, new, _ = _state(steps)
    _, got, read = _roundtrip(old, new)
    edit, words = LIES[lie]
    bad = _lie(edit)(got)
    with pytest.raises(DeltaError) as e:
        _rebuild(bad, read)
    assert words in str(e.value), str(e.value)
    if "param" in words or "entr" in lie or "class" in lie:
        assert "param '" in str(e.value) or "table entry" in str(e.value), str(e.value)


def test_a_base_that_is_not_the_one_coded_against_is_refused(steps):
    """The next step's state as the base: classes and values differ; the decoder's checks or the checksum refuse it,
    never a wrong weight."""
    old, new, later = _state(steps)
    _, got, _ = _roundtrip(old, new)
    with pytest.raises(DeltaError) as e:
        _rebuild(got, _reader(later, got))
    assert "checksum mismatch" in str(e.value) or "xor_ctx streams" in str(e.value), str(e.value)


def test_apply_of_a_corrupted_xor_ctx_file_writes_nothing(steps, tmp_path):
    root, ckpts, _ = steps
    out = tmp_path / "d"
    assert tool("diff", ckpts[0], ckpts[1], "--out", out, "--encoding", "xor_ctx").returncode == 0
    f = out / json.loads((out / "delta.json").read_text())["files"][0]
    pl = read_safetensors(maybe_zstd_decompress(f.read_bytes(), 1 << 30))
    b = _Blob(pl.positions)
    b.streams[1] = bytes([b.streams[1][0] ^ 0x10]) + b.streams[1][1:]  # one remainder bit
    import safetensors.torch

    meta = struct.unpack("<Q", maybe_zstd_decompress(f.read_bytes(), 1 << 30)[:8])[0]
    header = json.loads(maybe_zstd_decompress(f.read_bytes(), 1 << 30)[8:8 + meta])
    f.write_bytes(safetensors.torch.save({"__positions__": b.bytes(), "__values__": pl.values},
                                         metadata=header["__metadata__"]))
    r = tool("apply", ckpts[0], out, "--out", tmp_path / "never")
    assert r.returncode == 2 and ("checksum mismatch" in r.stderr or "xor_ctx streams" in r.stderr), r.stderr
    assert not (tmp_path / "never").exists()
    r = tool("inspect", f)
    assert r.returncode == 0 and "unverified (xor_ctx" in r.stdout, r.stdout


def _reference_decode(blob: bytes, params, bases):
    """docs/wire-format.md's `xor_ctx` section, followed line by line in plain Python (no code of ctx.py): per sparse
    param (in spec order), its changed positions (ascending) and their new bits. ``params``: (numel, bits, mantissa
    bits) per sparse param; ``bases``: each one's base bits as Python ints."""
    import struct as st

    magic, version, seg_log2, flags, n, lu, lr, ls = st.unpack("<4sBBHIQQQ", blob[:36])
    assert magic == b"XCTX" and version == 1 and flags in (0, 1)
    at, cols = 36, {}
    for name, fmt, size in (("seg", "I", 4), ("ctx", "H", 2), ("count", "I", 4), ("coded", "I", 4), ("nz", "I", 4),
                            ("flags", "B", 1), ("kp", "B", 1), ("k1", "B", 1), ("k2", "B", 1)):
        cols[name] = list(st.unpack(f"<{n}{fmt}", blob[at:at + n * size]))
        at += n * size
    u, r, s = blob[at:at + lu], blob[at + lu:at + lu + lr], blob[at + lu + lr:at + lu + lr + ls]
    assert at + lu + lr + ls == len(blob)
    bit = lambda buf, i: (buf[i >> 3] >> (i & 7)) & 1  # noqa: E731
    state = {"u": 0, "r": 0}

    def rice(k):
        q = 0
        while not bit(u, state["u"]):
            q, state["u"] = q + 1, state["u"] + 1
        state["u"] += 1
        width = 32 if q == 32 else k
        rem = sum(bit(r, state["r"] + i) << i for i in range(width))
        state["r"] += width
        return rem if q == 32 else (q << k) | rem

    def runs(values):  # gaps -> increasing ints
        out, prev = [], -1
        for g in values:
            prev += g + 1
            out.append(prev)
        return out

    # the joined space: every sparse param's elements, in spec order, with its bits and layout; aligned (flag 1):
    # each param starts a segment, the rest of its last segment holds no element
    space = []
    for p in range(len(params)):
        space += [(p, i, bases[p][i]) for i in range(params[p][0])]
        if flags & 1:
            space += [None] * (-len(space) % (1 << seg_log2))
    _, bits, mant = params[0]
    half = 1 << (bits - 1)
    entries = list(range(n))
    coded = {e: runs([rice(cols["kp"][e]) for _ in range(cols["coded"][e])]) for e in entries}
    steps = {}
    for e in entries:
        if not cols["flags"][e] & 2:
            steps[e] = [rice(cols["k1"][e]) + 1 for _ in range(cols["count"][e])]
    big = {e: runs([rice(cols["k1"][e]) for _ in range(cols["nz"][e])]) for e in entries if cols["flags"][e] & 2}
    for e in entries:
        if cols["flags"][e] & 2:
            steps[e] = [1] * cols["count"][e]
            for i in big[e]:
                steps[e][i] = rice(cols["k2"][e]) + 2
    sign_at, out = 0, {}
    for e in entries:
        lo = cols["seg"][e] << seg_log2
        members = [x for x in range(lo, min(len(space), lo + (1 << seg_log2)))
                   if space[x] is not None and (space[x][2] & (half - 1)) >> mant == cols["ctx"][e]]
        if cols["flags"][e] & 1:
            changed = [m for k, m in enumerate(members) if k not in set(coded[e])]
        else:
            changed = [members[k] for k in coded[e]]
        key = lambda v: v if v < half else -(v & (half - 1)) - 1  # noqa: E731
        for i, x in enumerate(changed):
            step = steps[e][i] * (-1 if bit(s, sign_at) else 1)
            sign_at += 1
            p, pos, base = space[x]
            k = key(base) + step
            out.setdefault(p, {})[pos] = k if k >= 0 else half | (-k - 1)
    return {p: sorted(v.items()) for p, v in out.items()}


def _contract_states():
    g = torch.Generator().manual_seed(5)
    olds, news = {}, {}
    for k, n in enumerate((70_000, 3_000, 500)):  # two segments of 2**16; the small params share the second
        base = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        new = base.clone()
        small = base.float().abs() < 2e-3
        new[small] = (base[small].float() * -5).to(torch.bfloat16)  # complement classes, large steps
        pick = torch.randperm(n, generator=g)[:n // 30]
        new[pick] = (base[pick].float() * 1.004).to(torch.bfloat16)
        olds[f"p{k}.weight"], news[f"p{k}.weight"] = base, new
    return olds, news


def _holders_facts(olds, news, seg_log2, holders=3):
    """The flush of ``news`` against ``olds`` coded in an aligned space from the facts that ``holders`` ranks, each
    holding a random part of every base, find with :func:`ctx.held_counts` and add up: the payload, its blob."""
    names = list(news)
    pl = encode_flush([(n, news[n], torch.nonzero(olds[n].view(torch.int16) != news[n].view(torch.int16))[:, 0])
                       for n in names], "xor_ctx", bases=[olds[n] for n in names], version=1, base_version=0)
    space = ctx._Space([olds[n].numel() for n in names], seg_log2, aligned=True)
    x = torch.cat([torch.arange(olds[n].numel()) + int(space.offs[k]) for k, n in enumerate(names)])
    base = torch.cat([olds[n].reshape(-1) for n in names])
    qx = torch.cat([pl.idx[p.val_start:p.val_end] + int(space.offs[k]) for k, p in enumerate(pl.spec.params)])
    qbase = torch.cat([olds[n].reshape(-1)[pl.idx[p.val_start:p.val_end]] for n, p in zip(names, pl.spec.params)])
    owner = torch.randint(0, holders, (x.numel(),), generator=torch.Generator().manual_seed(1))
    rows = sum(ctx.held_counts(x[owner == h], base[owner == h], qx, qbase, seg_log2) for h in range(holders))
    seg_len = torch.clamp(torch.tensor([olds[n].numel() for n in names])[
        torch.searchsorted(torch.from_numpy(space.offs[1:]), qx, right=True)] - (qx - torch.from_numpy(
            space.offs)[torch.searchsorted(torch.from_numpy(space.offs[1:]), qx, right=True)]) // (1 << seg_log2)
        * (1 << seg_log2), max=1 << seg_log2)
    assert torch.equal(rows[2], seg_len)  # the holders cover every element of each change's segment once
    counts = [p.nnz for p in pl.spec.params]
    by_facts = ctx.encode([None] * len(names), counts, pl.idx, pl.values, seg_log2, [olds[n].numel() for n in names],
                          (rows[0], rows[1], qbase))
    by_bases = ctx.encode([olds[n].reshape(-1) for n in names], counts, pl.idx, pl.values, seg_log2,
                          [olds[n].numel() for n in names], (rows[0], rows[1], qbase))
    return pl, by_facts, by_bases


def test_ranks_holding_parts_of_the_base_code_what_the_whole_bases_do():
    """An aligned space lets ranks that each hold part of every base find each change's class rank and size (one
    sort of what each holds, summed): the blob they code is byte for byte the one the whole bases code, and the
    engine's decoder (which reads the whole base) rebuilds the flush from it bit for bit."""
    olds, news = _contract_states()
    pl, by_facts, by_bases = _holders_facts(olds, news, ctx.SEG_LOG2_MIN)
    assert by_facts == by_bases and ctx._HEADER.unpack(by_facts[:36])[3] == ctx.ALIGNED
    names = list(news)
    read = lambda pieces: torch.cat([olds[names[k]].reshape(-1)[a:a + n] for k, a, n in pieces])  # noqa: E731
    pos, vals = ctx.decode(torch.frombuffer(bytearray(by_facts), dtype=torch.uint8), pl.spec.params, torch.bfloat16,
                           read)
    assert torch.equal(pos, pl.idx) and torch.equal(vals.view(torch.int16), pl.values.view(torch.int16))


@pytest.mark.parametrize("aligned", [False, True])
def test_the_documented_contract_decodes_what_the_coder_writes(aligned):
    """A decoder written from docs/wire-format.md alone agrees with ctx.py on a flush with every kind of class, in
    a joined space and in an aligned one."""
    olds, news = _contract_states()
    sent, got, _ = _roundtrip(olds, news, ctx.SEG_LOG2_MIN)
    if aligned:
        _, blob, _ = _holders_facts(olds, news, ctx.SEG_LOG2_MIN)
        got = dataclasses.replace(got, positions=torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    names = [p.name for p in got.spec.params]
    as_ints = {k: (olds[n].view(torch.int16).to(torch.int32) & 0xFFFF).tolist() for k, n in enumerate(names)}
    ref = _reference_decode(bytes(got.positions.numpy()), [(olds[n].numel(), 16, 7) for n in names], as_ints)
    for k, n in enumerate(names):
        idx = torch.nonzero(olds[n].view(torch.int16) != news[n].view(torch.int16))[:, 0].tolist()
        want = (news[n].view(torch.int16).to(torch.int32) & 0xFFFF)[idx].tolist()
        assert ref[k] == list(zip(idx, want)), n


def test_a_flush_without_sparse_params_carries_an_empty_table_and_nothing_else():
    """Every param dense (integer params travel dense, their values XOR their base): ``__positions__`` are still an
    xor_ctx header with no table entry and empty streams, and the engine reads them so: no other bytes pass unchecked
    there (the checksum covers the logical blobs, not these)."""
    olds = {"steps": torch.arange(64, dtype=torch.int32), "ids": torch.arange(8, dtype=torch.int32) * 3}
    news = {"steps": olds["steps"] + 1, "ids": olds["ids"].flip(0)}
    sent = encode_flush([(n, news[n], None) for n in news], "xor_ctx", bases=list(olds.values()), version=1,
                        base_version=0)
    got = read_safetensors(maybe_zstd_decompress(flush_file(sent, 1), 1 << 30))
    read = _reader(olds, got)
    assert all(p.dense for p in got.spec.params) and got.positions.numel() == ctx._HEADER.size
    out = _rebuild(got, read)
    assert torch.equal(out.values, sent.values)
    head = bytes(got.positions.numpy())
    for junk, words in ((b"x" * 35, "shorter than their header"), (bytes(36), "not an xor_ctx version 1 header"),
                        (head + b"\0", "the header declares 36")):
        bad = dataclasses.replace(got, positions=torch.frombuffer(bytearray(junk), dtype=torch.uint8))
        with pytest.raises(DeltaError, match=words):
            _rebuild(bad, read)
