"""``xor_ctx``: a flush's changes coded with contexts both sides compute from the base (the committed bytes).

An element of a float param changes when its master weight crosses a rounding boundary of the stored dtype, so its
chance to change falls with its exponent, and its new value is nearly always a few ULPs from its base. The change
mask is coded per class (param, segment, base exponent) as rank gaps within the class, the values as ULP steps.

Every code is a Rice code (unary quotient in one bit stream, remainder in another) whose parameter the encoder picks
per class from exact costs and writes in the file's table: no adaptive coder state, so decoding is a fixed number of
tensor ops per flush plus one pass over the base of the segments that changed. Contract: docs/wire-format.md.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Callable, List, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.weight_sync.delta.ops import INT_VIEW, host_values, repeat_counts, to_device
from sglang.srt.weight_sync.delta.wire import DeltaError, DeltaParam

MAGIC = b"XCTX"
VERSION = 1
SEG_LOG2 = 22  # elements per segment at most (2**22): the unit of the base pass, which bounds its transient memory
SEG_LOG2_MIN = 16  # below, the class table outweighs what the contexts save
SEG_LOG2_MAX = SEG_LOG2  # a file may not ask a decoder for larger segments
ESC = 32  # a unary quotient of ESC means: the value follows raw in RAW bits
RAW = 32
K_MAX = 31
COMPLEMENT, SPARSE_STEPS = 1, 2  # flag bits of a table entry
_HEADER = struct.Struct("<4sBBHIQQQ")  # magic, version, seg_log2, 0, entries, U bytes, R bytes, S bytes
_COLUMNS = (("param", np.uint32), ("seg", np.uint32), ("ctx", np.uint16), ("count", np.uint32),
            ("coded", np.uint32), ("nz", np.uint32), ("flags", np.uint8), ("kp", np.uint8), ("k1", np.uint8),
            ("k2", np.uint8))

# dtype -> (bits, mantissa bits): the element's exponent field is its context; sign-magnitude order gives the step
_LAYOUT = {torch.bfloat16: (16, 7), torch.float16: (16, 10), torch.float32: (32, 23),
           torch.float8_e4m3fn: (8, 3), torch.float8_e5m2: (8, 2)}


def supports(dtype: torch.dtype) -> bool:
    return dtype in _LAYOUT


def seg_log2_for(buffer_bytes: int) -> int:
    """Segments for a sender's flush buffer: the base pass holds about 32 bytes per element of a segment (its sort
    and ranks), so a segment is at most a 32nd of the buffer, within [2**16, 2**22] elements."""
    return max(SEG_LOG2_MIN, min(SEG_LOG2, max(1, buffer_bytes // 32).bit_length() - 1))


def _layout(dtype: torch.dtype) -> Tuple[int, int, int]:
    """(bits, mantissa bits, contexts) of a dtype ``xor_ctx`` codes."""
    if dtype not in _LAYOUT:
        raise DeltaError(f"xor_ctx codes bfloat16, float16, float32 and fp8 params, not {dtype}")
    bits, mant = _LAYOUT[dtype]
    return bits, mant, 1 << (bits - 1 - mant)


def _bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    return t.view(INT_VIEW[bits // 8]).to(torch.int64) & ((1 << bits) - 1)


def _key(b: torch.Tensor, bits: int) -> torch.Tensor:
    """Sign-magnitude bits -> an int whose order is the float order (+0 -> 0, -0 -> -1): one ULP is one step."""
    mag = b & ((1 << (bits - 1)) - 1)
    return torch.where(b >> (bits - 1) != 0, -mag - 1, mag)


def _unkey(k: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.where(k < 0, (1 << (bits - 1)) | (-k - 1), k)


# ---------------------------------------------------------------- bit streams


def _pack(vals: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Fields (value, width <= 33) -> LSB-first bytes, in one scatter per byte of a field (fields never overlap)."""
    if not vals.numel():
        return torch.zeros(0, dtype=torch.uint8, device=vals.device)
    ends = torch.cumsum(widths, 0)
    total = host_values(ends[-1:])[0]
    off = ends - widths
    word = vals << (off & 7)
    at = off >> 3
    out = torch.zeros((total + 7) // 8 + 6, dtype=torch.int64, device=vals.device)
    for j in range(6):
        out.index_add_(0, at + j, (word >> (8 * j)) & 0xFF)
    return out[:(total + 7) // 8].to(torch.uint8)


def _unpack(buf: torch.Tensor, widths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """LSB-first fields of ``widths`` (<= 32) -> (values, whether the fields use exactly ``buf``'s bytes and its
    padding bits are zero: a 0-d bool, read with the flush's other checks)."""
    ends = torch.cumsum(widths, 0)
    total = ends[-1] if widths.numel() else torch.zeros((), dtype=torch.int64, device=buf.device)
    exact = (total + 7) // 8 == buf.numel()
    padded = torch.cat([buf.to(torch.int64), buf.new_zeros(8, dtype=torch.int64)])
    if buf.numel():
        last = padded[torch.clamp((total - 1) // 8, 0, buf.numel() - 1)]
        exact &= (last >> (((total - 1) & 7) + 1)) == 0
    if not widths.numel():
        return widths.clone(), exact
    off = ends - widths
    at = torch.clamp(off >> 3, 0, buf.numel())
    word = padded[at]
    for j in range(1, 5):
        word |= padded[at + j] << (8 * j)
    return (word >> (off & 7)) & ((1 << widths) - 1), exact


def _rice_fields(v: torch.Tensor, k: torch.Tensor):
    """Rice codes of ``v`` with per-code ``k``: (unary fields, remainder fields), each as (values, widths)."""
    q = torch.clamp(v >> k, max=ESC)
    esc = q == ESC
    rem = torch.where(esc, v, v & ((1 << k) - 1))
    return (torch.ones_like(q) << q, q + 1), (rem, torch.where(esc, RAW, k))


def _rice_cost(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    q = v >> k
    return torch.where(q < ESC, q + 1 + k, ESC + 1 + RAW)


def _best_k(v: torch.Tensor, counts: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Per run of ``counts`` codes: the Rice parameter of least total bits among four around its mean's, and those
    bits (exact, summed per run in one scatter per candidate)."""
    n = len(counts)
    if not n:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    run = _rep(torch.arange(n, device=v.device), counts)
    sums = torch.zeros(n, dtype=torch.float64, device=v.device).index_add_(0, run, v.double())
    mean = sums / torch.tensor(np.maximum(counts, 1), device=v.device)
    k0 = torch.floor(torch.log2(mean + 1)).long() - 1
    costs = []
    for d in range(4):
        k = torch.clamp(k0 + d, 0, K_MAX)
        costs.append(torch.zeros(n, dtype=torch.int64, device=v.device).index_add_(0, run, _rice_cost(v, k[run])))
    costs = torch.stack(costs)
    best = torch.argmin(costs, 0)
    k, c = host_values(torch.stack([torch.clamp(k0 + best, 0, K_MAX), costs.gather(0, best[None])[0]]))
    return np.array(k, np.int64), np.array(c, np.int64)


# ---------------------------------------------------------------- the base pass


@dataclasses.dataclass
class _Group:
    """Consecutive segments whose base is read and sorted by context together (at most one segment's elements)."""

    segs: List[Tuple[int, int, int, int]]  # (param no, segment no, first element, elements)

    @property
    def size(self) -> int:
        return sum(s[3] for s in self.segs)


def _groups(segs: Sequence[Tuple[int, int, int, int]], budget: int) -> List[_Group]:
    out: List[_Group] = []
    for s in segs:
        if not out or out[-1].size + s[3] > budget:
            out.append(_Group([]))
        out[-1].segs.append(s)
    return out


class _Sorted:
    """A group's base elements, their classes (segment in group x context) and the elements in class order."""

    def __init__(self, g: _Group, base: torch.Tensor, bits: int, mant: int, nctx: int):
        self.bits, self.nctx, dev = bits, nctx, base.device
        self.base = base.view(INT_VIEW[bits // 8])
        lens = [s[3] for s in g.segs]
        self.goff = np.cumsum([0, *lens[:-1]]).astype(np.int64)
        ctx = (self.base >> mant) & (nctx - 1)  # in the base's own width: the sign bit shifts out of the mask
        if len(lens) == 1 and nctx <= 256:  # one segment: the context alone is the class, sorted as bytes
            self.keys = ctx.to(torch.uint8)
        else:
            self.keys = ctx.to(torch.int32) + _rep(to_device([j * nctx for j in range(len(lens))], dev), lens).to(
                torch.int32)
        self.order = torch.argsort(self.keys, stable=True)
        self.sizes = torch.bincount(self.keys, minlength=len(lens) * nctx)
        self.starts = torch.cumsum(self.sizes, 0) - self.sizes

    def key_at(self, local: torch.Tensor) -> torch.Tensor:
        """The base's step keys at group-local elements."""
        return _key(_bits(self.base[local], self.bits), self.bits)


# ---------------------------------------------------------------- encode


def encode(params: Sequence[int], wholes: Sequence[torch.Tensor], counts: Sequence[int], idx: torch.Tensor,
           new: torch.Tensor, seg_log2: int = SEG_LOG2) -> bytes:
    """The coded streams of a flush's sparse params (one values dtype), as the file's positions blob.

    ``params``: the spec numbers of the params with changes, ``wholes`` their whole bases (flat; zeros for a base
    the engine does not store), ``counts`` their changes; ``idx`` and ``new``: their positions (ascending per param)
    and new values, joined in that order."""
    if not idx.numel():
        return _HEADER.pack(MAGIC, VERSION, seg_log2, 0, 0, 0, 0, 0)
    keep = [j for j, n in enumerate(counts) if n]
    params, wholes, counts = [params[j] for j in keep], [wholes[j] for j in keep], [counts[j] for j in keep]
    bits, mant, nctx = _layout(new.dtype)
    dev = new.device
    segkeys = (idx >> seg_log2) + _rep(to_device([j << 32 for j in range(len(counts))], dev), counts)
    live = host_values(torch.unique_consecutive(segkeys))
    segs = []
    for key in live:
        j, s = key >> 32, key & 0xFFFFFFFF
        n = wholes[j].numel()
        segs.append((j, s, s << seg_log2, min(n - (s << seg_log2), 1 << seg_log2)))
    groups = _groups(segs, 1 << seg_log2)
    seg_index = {(s[0], s[1]): i for i, s in enumerate(segs)}
    segkeys_t = to_device(live, dev)
    elem_seg = torch.searchsorted(segkeys_t, segkeys)  # each changed element's segment number
    bounds = host_values(torch.searchsorted(elem_seg, to_device([seg_index[(g.segs[0][0], g.segs[0][1])]
                                                                 for g in groups] + [len(segs)], dev)))
    ent_keys, ranks, sizes, steps = [], [], [], []
    first_seg = 0
    for g, lo, hi in zip(groups, bounds, bounds[1:]):
        base = torch.cat([wholes[j][a:a + n] for j, _, a, n in g.segs]).to(dev)
        srt = _Sorted(g, base, bits, mant, nctx)
        j_in = elem_seg[lo:hi] - first_seg
        local = idx[lo:hi] - to_device([a for _, _, a, _ in g.segs], dev)[j_in] + to_device(srt.goff, dev)[j_in]
        rank_of = torch.empty_like(srt.order)
        rank_of[srt.order] = torch.arange(srt.order.numel(), device=dev) - srt.starts[srt.keys[srt.order].long()]
        k = srt.keys[local].long()
        perm = torch.argsort(k, stable=True)  # class order; within a class, rank (position) order
        k = k[perm]
        ent_keys.append(k + first_seg * nctx)
        ranks.append(rank_of[local[perm]])
        sizes.append(srt.sizes[k])
        steps.append(_key(_bits(new[lo:hi][perm], bits), bits) - srt.key_at(local[perm]))
        first_seg += len(g.segs)
    ek, rank, size, step = (torch.cat(t) for t in (ent_keys, ranks, sizes, steps))
    ukeys, counts = torch.unique_consecutive(ek, return_counts=True)
    firsts = torch.cumsum(counts, 0) - counts
    ukeys, counts, esize = (np.array(host_values(t), np.int64) for t in (ukeys, counts, size[firsts]))
    comp = counts * 2 > esize
    coded = np.where(comp, esize - counts, counts)
    # coded ranks: the changed ones, or for a complement entry its unchanged members
    cstart = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pos_codes = torch.empty(int(coded.sum()), dtype=torch.int64, device=dev)
    dst = np.concatenate([[0], np.cumsum(coded)[:-1]])
    plain = np.flatnonzero(~comp)
    if plain.size:
        pos_codes[slots(dst[plain], counts[plain], dev)] = rank[slots(cstart[plain], counts[plain], dev)]
    cidx = np.flatnonzero(comp)
    if cidx.size:
        member = torch.ones(int(esize[cidx].sum()), dtype=torch.bool, device=dev)
        moff = np.concatenate([[0], np.cumsum(esize[cidx])[:-1]])
        member[rank[slots(cstart[cidx], counts[cidx], dev)] + _rep(to_device(moff, dev), counts[cidx])] = False
        unchanged = torch.nonzero_static(member, size=int(coded[cidx].sum()))[:, 0]
        unchanged -= _rep(to_device(moff, dev), coded[cidx])
        pos_codes[slots(dst[cidx], coded[cidx], dev)] = unchanged
    gaps = _gaps(pos_codes, coded, dev)
    kp, _ = _best_k(gaps, coded)
    neg = step < 0
    m = step.abs() - 1
    k1a, cost_a = _best_k(m, counts)
    nzmask = m > 0
    nz_counts = torch.zeros(len(counts), dtype=torch.int64, device=dev).index_add_(
        0, _rep(torch.arange(len(counts), device=dev), counts), nzmask.long())
    nz = np.array(host_values(nz_counts), np.int64)
    nzpos = torch.nonzero_static(nzmask, size=int(nz.sum()))[:, 0]
    nzpos_in = nzpos - _rep(to_device(cstart, dev), nz)
    g_gaps = _gaps(nzpos_in, nz, dev)
    kg, cost_g = _best_k(g_gaps, nz)
    kb, cost_b = _best_k(m[nzpos] - 1, nz)
    sparse = cost_g + cost_b < cost_a
    flags = comp * COMPLEMENT + sparse * SPARSE_STEPS
    # sections: P (rank gaps), A (steps of dense-step entries), G and M (sparse-step entries: gaps, then steps - 1)
    dense_e = np.flatnonzero(~sparse)
    sp_e = np.flatnonzero(sparse)
    nz_start = np.concatenate([[0], np.cumsum(nz)[:-1]])
    v = torch.cat([gaps, m[slots(cstart[dense_e], counts[dense_e], dev)],
                   g_gaps[slots(nz_start[sp_e], nz[sp_e], dev)], (m[nzpos] - 1)[slots(nz_start[sp_e], nz[sp_e], dev)]])
    kk = np.concatenate([np.repeat(kp, coded), np.repeat(k1a[dense_e], counts[dense_e]),
                         np.repeat(kg[sp_e], nz[sp_e]), np.repeat(kb[sp_e], nz[sp_e])])
    (uv, uw), (rv, rw) = _rice_fields(v, torch.from_numpy(kk).to(dev))
    u, r = _pack(uv, uw), _pack(rv, rw)
    s = _pack(neg.long(), torch.ones_like(step))
    seg_of = np.array([segs[e // nctx] for e in ukeys], np.int64).reshape(-1, 4)
    table = dict(param=np.array(params, np.int64)[seg_of[:, 0]], seg=seg_of[:, 1], ctx=ukeys % nctx,
                 count=counts, coded=coded, nz=np.where(sparse, nz, 0), flags=flags, kp=kp,
                 k1=np.where(sparse, kg, k1a), k2=np.where(sparse, kb, 0))
    head = _HEADER.pack(MAGIC, VERSION, seg_log2, 0, len(counts), u.numel(), r.numel(), s.numel())
    cols = b"".join(np.ascontiguousarray(table[name], dtype=t).astype(np.dtype(t).newbyteorder("<")).tobytes()
                    for name, t in _COLUMNS)
    return head + cols + b"".join(x.cpu().numpy().tobytes() for x in (u, r, s))


def _rep(values: torch.Tensor, counts) -> torch.Tensor:
    """:func:`repeat_counts` for host counts held in numpy (one per table entry)."""
    return repeat_counts(values, np.asarray(counts, np.int64).tolist())


def slots(starts, counts, dev) -> torch.Tensor:
    """The indices ``starts[i] + 0..counts[i]-1`` of every run, in order (host-known runs, no host read)."""
    counts = np.asarray(counts, np.int64)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return torch.arange(int(counts.sum()), device=dev) + _rep(
        to_device(np.asarray(starts, np.int64) - firsts, dev), counts)


def _gaps(r: torch.Tensor, counts, dev) -> torch.Tensor:
    """Increasing ints per run -> gaps ``r[i] - r[i-1] - 1``, each run's first from -1."""
    prev = torch.cat([r.new_full((1,), -1), r[:-1]])
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])[np.asarray(counts) > 0]
    prev[to_device(firsts, dev)] = -1
    return r - prev - 1


def _ungaps(g: torch.Tensor, counts, dev) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gaps per run -> the increasing ints, and each run's last (its largest) or -1 for an empty run."""
    c = torch.cumsum(g + 1, 0)
    counts = np.asarray(counts, np.int64)
    ends = np.cumsum(counts)
    before = torch.cat([c.new_zeros(1), c])[to_device(ends - counts, dev)]
    r = c - 1 - _rep(before, counts)
    last = torch.cat([c.new_zeros(1), c])[to_device(ends, dev)] - before - 1
    return r, last


# ---------------------------------------------------------------- decode


ReadBase = Callable[[List[Tuple[int, int, int]]], torch.Tensor]
"""``[(param no in the spec, first element, elements)]`` -> the base of those ranges, joined (one flat tensor)."""


class _Table:
    """A file's header and class table, parsed and checked on the host against the spec before any stream is read."""

    def __init__(self, blob: torch.Tensor, params: Sequence[DeltaParam], dtype: torch.dtype, where: str):
        self.where = where
        if blob.numel() < _HEADER.size:
            raise DeltaError(f"xor_ctx streams{where}: {blob.numel()} bytes, shorter than their header")
        head = bytes(blob[:_HEADER.size].cpu().numpy())
        magic, version, self.seg_log2, zero, n, *lens = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or zero:
            raise DeltaError(f"xor_ctx streams{where}: not an xor_ctx version {VERSION} header")
        if not SEG_LOG2_MIN <= self.seg_log2 <= SEG_LOG2_MAX:
            raise DeltaError(f"xor_ctx streams{where}: segments of 2**{self.seg_log2} elements (allowed "
                             f"2**{SEG_LOG2_MIN} to 2**{SEG_LOG2_MAX})")
        row = sum(np.dtype(t).itemsize for _, t in _COLUMNS)
        if _HEADER.size + n * row + sum(lens) != blob.numel():
            raise DeltaError(f"xor_ctx streams{where}: {blob.numel()} bytes, the header declares "
                             f"{_HEADER.size + n * row + sum(lens)} (a stream ends early or runs on)")
        raw, at = bytes(blob[_HEADER.size:_HEADER.size + n * row].cpu().numpy()), 0
        self.cols = {}
        for name, t in _COLUMNS:
            size = np.dtype(t).itemsize * n
            self.cols[name] = np.frombuffer(raw[at:at + size], dtype=np.dtype(t).newbyteorder("<")).astype(np.int64)
            at += size
        off = _HEADER.size + n * row
        self.streams = []
        for length in lens:
            self.streams.append(blob[off:off + length])
            off += length
        self.n = n
        self.bits, self.mant, self.nctx = _layout(dtype)
        self._check(params)

    def param_of(self, e: int, params) -> str:
        p = int(self.cols["param"][e])
        return f"param {params[p].name!r}" if p < len(params) else f"table entry {e} (param number {p})"

    def _check(self, params: Sequence[DeltaParam]) -> None:
        c, n = self.cols, self.n
        bad = np.zeros(n, bool)
        why = np.full(n, "", object)

        def fail(mask, text):
            new = mask & ~bad
            why[new] = text
            bad[:] |= mask

        np_ = len(params)
        fail(c["param"] >= np_, "names no param of the flush")
        p = np.minimum(c["param"], max(np_ - 1, 0))
        numel = np.array([q.numel for q in params], np.int64)[p] if np_ else np.zeros(n, np.int64)
        dense = np.array([q.dense for q in params], bool)[p] if np_ else np.ones(n, bool)
        fail(dense, "is dense (no changes to code)")
        fail(c["seg"] >= -(-numel // (1 << self.seg_log2)), "has a segment past its elements")
        fail(c["ctx"] >= self.nctx, f"has a context above {self.nctx - 1}")
        fail(c["count"] < 1, "has a class with no change")
        fail(c["flags"] > COMPLEMENT + SPARSE_STEPS, "has unknown flags")
        fail((c["kp"] > K_MAX) | (c["k1"] > K_MAX) | (c["k2"] > K_MAX), f"has a Rice parameter above {K_MAX}")
        comp, sparse = (c["flags"] & COMPLEMENT) > 0, (c["flags"] & SPARSE_STEPS) > 0
        fail(~comp & (c["coded"] != c["count"]), "codes another number of ranks than it changes")
        fail(sparse & (c["nz"] > c["count"]), "has more large steps than changes")
        fail(~sparse & ((c["nz"] != 0) | (c["k2"] != 0)), "has large-step fields without sparse steps")
        key = (c["param"] << 40) + (np.minimum(c["seg"], (1 << 24) - 1) << 16) + c["ctx"]
        fail(np.concatenate([[False], key[1:] <= key[:-1]]), "is out of order or repeated")
        if bad.any():
            e = int(np.argmax(bad))
            raise DeltaError(f"xor_ctx table{self.where}: entry {e} of {self.param_of(e, params)} {why[e]}")
        sums = np.zeros(np_, np.int64)
        np.add.at(sums, c["param"], c["count"])
        for q, s in zip(params, sums):
            if not q.dense and s != q.nnz:
                raise DeltaError(f"xor_ctx table{self.where}: param {q.name!r} has {s} changes in its classes, "
                                 f"the spec says {q.nnz}")


def _bits_of(buf: torch.Tensor) -> torch.Tensor:
    return ((buf.to(torch.int64)[:, None] >> torch.arange(8, device=buf.device)) & 1).reshape(-1)


def decode(blob: torch.Tensor, params: Sequence[DeltaParam], dtype: torch.dtype, read_base: ReadBase,
           where: str = "") -> Tuple[torch.Tensor, torch.Tensor]:
    """A flush's coded streams -> (positions of its sparse params, their new values), both joined in spec order,
    positions ascending per param. Every field is checked against the spec, the table and the base; the caller's
    checksum over the rebuilt blobs then decides. One host read for the segments' bounds, one for all checks."""
    t = _Table(blob, params, dtype, where)
    c, dev = t.cols, blob.device
    if not t.n:
        return torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, dtype=dtype, device=dev)
    u, r, s = t.streams
    count, coded, nz = c["count"], c["coded"], c["nz"]
    comp, sparse = (c["flags"] & COMPLEMENT) > 0, (c["flags"] & SPARSE_STEPS) > 0
    dense_e, sp_e = np.flatnonzero(~sparse), np.flatnonzero(sparse)
    sec = [int(coded.sum()), int(count[dense_e].sum()), int(nz.sum()), int(nz.sum())]
    kk = torch.from_numpy(np.concatenate([np.repeat(c["kp"], coded), np.repeat(c["k1"][dense_e], count[dense_e]),
                                          np.repeat(c["k1"][sp_e], nz[sp_e]), np.repeat(c["k2"][sp_e], nz[sp_e])]))
    kk = kk.to(dev)
    total = sum(sec)
    ubits = _bits_of(u)
    ones = torch.nonzero_static(ubits, size=total, fill_value=-1)[:, 0]
    q = torch.diff(ones, prepend=ones.new_full((1,), -1)) - 1
    used = ones[-1] // 8 + 1 if total else torch.zeros((), dtype=torch.int64, device=dev)
    checks = {"unary": (ubits.sum() != total) | (used != u.numel()) | (q > ESC).any() | (q < 0).any()}
    q = torch.clamp(q, 0, ESC)
    widths = torch.where(q == ESC, RAW, kk)
    rem, exact = _unpack(r, widths)
    checks["remainder"] = ~exact
    v = torch.where(q < ESC, (q << kk) | rem, rem)
    gaps_p, a_codes, gaps_g, m_codes = torch.split(v, sec)
    ranks, last_rank = _ungaps(gaps_p, coded, dev)
    nzin, last_nz = _ungaps(gaps_g, nz, dev)
    checks["large steps"] = (last_nz >= torch.from_numpy(count).to(dev)).any()
    changed = int(count.sum())
    cstart = np.concatenate([[0], np.cumsum(count)])
    m = torch.zeros(changed, dtype=torch.int64, device=dev)
    m[slots(cstart[dense_e], count[dense_e], dev)] = a_codes
    nzabs = torch.clamp(nzin, 0, None) + _rep(to_device(cstart[:-1], dev), nz)
    m[torch.clamp(nzabs, 0, max(changed - 1, 0))] = m_codes + 1
    sbits = _bits_of(s)
    checks["signs"] = torch.tensor(s.numel() != (changed + 7) // 8, device=dev) | (sbits[changed:] != 0).any()
    step = torch.where(sbits[:changed] != 0, -(m + 1), m + 1)
    # the base pass: segments in order, a group of them at a time
    segs_key = c["param"] * (1 << 32) + c["seg"]
    ent_seg = np.concatenate([[0], np.cumsum(segs_key[1:] != segs_key[:-1])])
    firsts = np.flatnonzero(np.concatenate([[True], segs_key[1:] != segs_key[:-1]]))
    seg_list = []
    for e in firsts:
        p, sg = int(c["param"][e]), int(c["seg"][e])
        start = sg << t.seg_log2
        seg_list.append((p, sg, start, min(params[p].numel - start, 1 << t.seg_log2)))
    kstart = np.concatenate([[0], np.cumsum(coded)])
    bad_rank, bad_size, bad_step = [], [], []
    pos_out, val_out, seg_at = [], [], 0
    lo_e = 0
    for g in _groups(seg_list, 1 << t.seg_log2):
        hi_seg = seg_at + len(g.segs)
        hi_e = int(np.searchsorted(ent_seg, hi_seg))
        ents = np.arange(lo_e, hi_e)
        base = read_base([(p, a, n) for p, _, a, n in g.segs])
        srt = _Sorted(g, base, t.bits, t.mant, t.nctx)
        kcls = to_device((ent_seg[ents] - seg_at) * t.nctx + c["ctx"][ents], dev)
        size = srt.sizes[kcls]
        lr = last_rank[lo_e:hi_e]
        bad_rank.append((lr >= size) & torch.from_numpy(coded[ents] > 0).to(dev))
        bad_size.append(torch.from_numpy(comp[ents]).to(dev) & (size != to_device(coded[ents] + count[ents], dev)))
        lut = torch.zeros(len(g.segs) * t.nctx, dtype=torch.bool, device=dev)
        lut[kcls] = torch.from_numpy(comp[ents]).to(dev)
        member = lut[srt.keys.long()]
        rk = ranks[int(kstart[lo_e]):int(kstart[hi_e])]
        kcl = _rep(kcls, coded[ents])
        at = srt.order[torch.clamp(srt.starts[kcl] + torch.clamp(rk, 0, None), 0, srt.order.numel() - 1)]
        member[at] = ~_rep(to_device(comp[ents], dev).long(), coded[ents]).bool()
        c0, c1 = int(cstart[lo_e]), int(cstart[hi_e])
        local = torch.nonzero_static(member, size=c1 - c0, fill_value=0)[:, 0]
        perm = torch.argsort(srt.keys[local], stable=True)
        st = torch.empty_like(step[c0:c1])
        st[perm] = step[c0:c1]
        newk = srt.key_at(local) + st
        out = (newk < -(1 << (t.bits - 1))) | (newk >= (1 << (t.bits - 1)))
        bad_step.append(torch.zeros(len(ents), dtype=torch.int64, device=dev).index_add_(
            0, _rep(torch.arange(len(ents), device=dev), count[ents]), out[perm].long()) > 0)
        j = srt.keys[local].long() // t.nctx
        pos_out.append(local - to_device(srt.goff, dev)[j] + to_device([a for _, _, a, _ in g.segs], dev)[j])
        val_out.append(_unkey(torch.clamp(newk, -(1 << (t.bits - 1)), (1 << (t.bits - 1)) - 1), t.bits))
        seg_at, lo_e = hi_seg, hi_e
    per_entry = torch.stack([torch.cat(bad_rank), torch.cat(bad_size), torch.cat(bad_step)])
    flat = torch.cat([torch.stack(list(checks.values())).reshape(-1), per_entry.reshape(-1)])
    if any(host_values(flat.any().reshape(1))):
        _refuse(t, params, list(checks), host_values(flat), where)
    iv = INT_VIEW[t.bits // 8]
    vals = torch.cat(val_out)
    vals = torch.where(vals >= (1 << (t.bits - 1)), vals - (1 << t.bits), vals).to(iv).view(dtype)
    return torch.cat(pos_out), vals


def _refuse(t: _Table, params, names: List[str], flags: list, where: str) -> None:
    """Name the first check that failed: a stream's, or an entry's and so its param."""
    for name, bad in zip(names, flags):
        if bad:
            raise DeltaError(f"xor_ctx streams{where}: the {name} stream does not match the table (ends early, runs "
                             f"on, or holds an escape out of range)")
    per = np.array(flags[len(names):], bool).reshape(3, t.n)
    what = ("a rank past its class (the base is not the one the table was coded against, or a stream lies)",
            "a class size that differs from the base's", "a step out of the dtype's range")
    for row, text in zip(per, what):
        if row.any():
            e = int(np.argmax(row))
            raise DeltaError(f"xor_ctx streams{where}: {t.param_of(e, params)}: {text}")
    raise DeltaError(f"xor_ctx streams{where}: inconsistent")
