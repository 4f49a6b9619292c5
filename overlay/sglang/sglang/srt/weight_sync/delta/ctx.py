"""``xor_ctx``: a flush's changes coded with contexts both sides compute from the base (the committed bytes).

An element of a float param changes when its master weight crosses a rounding boundary of the stored dtype, so its
chance to change falls with its exponent, and its new value is nearly always a few ULPs from its base. The change
mask is coded per class (a segment of the flush's sparse params joined, a base exponent) as rank gaps within the
class, the values as ULP steps.

Every code is a Rice code (unary quotient in one bit stream, remainder in another) whose parameter the encoder picks
per class from exact costs and writes in the file's table: no adaptive coder state, so decoding is a fixed number of
tensor ops per flush plus one pass over the base of the segments that changed. Contract: docs/wire-format.md.
"""

from __future__ import annotations

import struct
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.weight_sync.delta.ops import INT_VIEW, host_values, take, to_device
from sglang.srt.weight_sync.delta.rice import (
    ESC,
    K_MAX,
    RAW,
    best_k,
    bits_of,
    gaps,
    pack,
    pack_bits,
    rep,
    rice_fields,
    slots,
    ungaps,
    unpack,
)
from sglang.srt.weight_sync.delta.wire import DeltaError, DeltaParam, sparse_allowed

MAGIC = b"XCTX"
VERSION = 1
SEG_LOG2 = 22  # elements per segment at most (2**22): the unit of the base pass, which bounds its transient memory
SEG_LOG2_MIN = 16  # below, the class table outweighs what the contexts save
SEG_LOG2_MAX = SEG_LOG2  # a file may not ask a decoder for larger segments
COMPLEMENT, SPARSE_STEPS = 1, 2  # flag bits of a table entry
# what the coder holds per change beyond the flush's own bytes, counted against the sender's buffer so that a flush's
# coding and decoding stay within a few buffers (make bench measures both sides per change)
CODER_BYTES = 32
_HEADER = struct.Struct("<4sBBHIQQQ")  # magic, version, seg_log2, flags, entries, U bytes, R bytes, S bytes
ALIGNED = 1  # header flag: every sparse param starts a segment (a sender whose ranks each hold part of a base)
_COLUMNS = (("seg", np.uint32), ("ctx", np.uint16), ("count", np.uint32),
            ("coded", np.uint32), ("nz", np.uint32), ("flags", np.uint8), ("kp", np.uint8), ("k1", np.uint8),
            ("k2", np.uint8))

# dtype -> (bits, mantissa bits): the element's exponent field is its context; sign-magnitude order gives the step
_LAYOUT = {torch.bfloat16: (16, 7), torch.float16: (16, 10), torch.float32: (32, 23),
           torch.float8_e4m3fn: (8, 3), torch.float8_e5m2: (8, 2)}


def codes(dtype: torch.dtype) -> bool:
    """Whether a flush of ``dtype`` can be ``xor_ctx``: the float dtypes it codes, and those that always travel dense
    (integers: their values are XOR the base, no coded streams)."""
    return dtype in _LAYOUT or not sparse_allowed(dtype)


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


# ---------------------------------------------------------------- the base pass


class _Space:
    """The flush's sparse params joined in spec order: one element space, cut into segments of ``2**seg_log2``.
    Small params share a segment (and its classes), so their table costs what one large param's does. ``aligned``:
    each param starts a segment (its last one ends with it), so a param's classes do not depend on its
    neighbours: what lets ranks that each hold part of a base find a change's class rank before the flush exists."""

    def __init__(self, numels: Sequence[int], seg_log2: int, aligned: bool = False):
        self.numels = np.array(list(numels), np.int64)
        unit = (1 << seg_log2) if aligned else 1
        self.offs = np.concatenate([[0], np.cumsum(-(-self.numels // unit) * unit)]).astype(np.int64)
        self.total = int(self.offs[-2] + self.numels[-1]) if len(self.numels) else 0
        self.seg_log2 = seg_log2
        self.segments = -(-self.total >> seg_log2) if self.total else 0

    def span(self, seg: int) -> Tuple[int, int]:
        lo = seg << self.seg_log2
        return lo, min(self.total, lo + (1 << self.seg_log2))

    def pieces(self, seg: int) -> List[Tuple[int, int, int]]:
        """``(param index in the space, first element, elements)`` of the params a segment covers."""
        lo, hi = self.span(seg)
        j = int(np.searchsorted(self.offs, lo, side="right")) - 1
        out = []
        while j < len(self.numels) and self.offs[j] < hi:
            a, b = max(lo, self.offs[j]), min(hi, self.offs[j] + self.numels[j])
            if b > a:
                out.append((j, int(a - self.offs[j]), int(b - a)))
            j += 1
        return out


class _Segment:
    """A segment's base elements, their contexts and the elements in context order (stable: by position within):
    one sort of a byte per element, the pass's only O(segment log) step; everything else reads the segment once."""

    def __init__(self, base: torch.Tensor, bits: int, mant: int, nctx: int):
        self.bits = bits
        self.base = base.view(INT_VIEW[bits // 8])
        self.keys = ((self.base >> mant) & (nctx - 1)).to(torch.uint8)  # the sign bit shifts out of the mask
        self.order = torch.argsort(self.keys, stable=True)
        self.sizes = torch.bincount(self.keys, minlength=nctx)
        self.starts = torch.cumsum(self.sizes, 0) - self.sizes

    def ranks(self, local: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Each element's rank among its class (``k``), from where it sits in context order: one scatter of the
        order's inverse, in int32 (a segment holds at most 2**22 elements)."""
        n = self.order.numel()
        inv = torch.empty(n, dtype=torch.int32, device=self.order.device)
        inv.scatter_(0, self.order, torch.arange(n, dtype=torch.int32, device=inv.device))
        return take(inv, local).long() - self.starts[k]

    def members(self, classes: torch.Tensor, sizes: np.ndarray) -> torch.Tensor:
        """A mask of the elements of ``classes``, whose sizes the table claims (a claim past the class marks its
        neighbours' elements: the caller's size check refuses that flush): gathers from the order, not a pass."""
        n = self.order.numel()
        mask = torch.zeros(n, dtype=torch.bool, device=self.order.device)
        if not len(sizes):
            return mask
        firsts = to_device(np.concatenate([[0], np.cumsum(sizes)[:-1]]), mask.device)
        at = torch.arange(int(sizes.sum()), device=mask.device) + rep(self.starts[classes] - firsts, sizes)
        mask[self.order[torch.clamp(at, 0, n - 1)]] = True
        return mask

    def key_at(self, local: torch.Tensor) -> torch.Tensor:
        """The base's step keys at segment-local elements."""
        return _key(_bits(self.base[local], self.bits), self.bits)


def aligned_starts(numels: Sequence[int], seg_log2: int) -> np.ndarray:
    """Where each param starts in an aligned space of ``numels`` (and, last, where its padded end is): the space the
    coder's aligned flushes and the ranks that find their facts share."""
    return _Space(numels, seg_log2, aligned=True).offs


def held_counts(held: torch.Tensor, base: torch.Tensor, qx: torch.Tensor, qbase: torch.Tensor,
                seg_log2: int) -> torch.Tensor:
    """One holder's share of the facts of changes in an aligned space: ``held`` the elements it holds there (each
    held by one holder only) and ``base`` their base; ``qx``/``qbase`` the changes and their base values. Per change
    (rows): the held elements of its class before it, of its class, and of its segment; summed over the holders,
    the first two are the change's :data:`Facts` and the third its segment's length (a check that the holders
    cover every element once). One sort of the held elements' class keys, then searches."""
    bits, mant, nctx = _layout(base.dtype)
    low = (1 << seg_log2) - 1

    def cls(x, b):
        return (x >> seg_log2) * nctx + ((_bits(b, bits) & ((1 << (bits - 1)) - 1)) >> mant)

    keys = torch.sort((cls(held, base) << seg_log2) | (held & low)).values
    c = cls(qx, qbase)
    s0 = ((qx >> seg_log2) * nctx) << seg_log2
    edges = torch.stack([c << seg_log2, (c << seg_log2) | (qx & low), (c + 1) << seg_log2, s0,
                         s0 + (nctx << seg_log2)])
    at = torch.searchsorted(keys, edges)
    return torch.stack([at[1] - at[0], at[2] - at[0], at[4] - at[3]])


# ---------------------------------------------------------------- encode


Facts = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Per changed element, joined like the flush's positions: its rank in its class, its class's size and its base
value: what the ranks that hold a param's base in parts found for it together (``aligned`` spaces only)."""


def encode(wholes: Sequence[Optional[torch.Tensor]], counts: Sequence[int], idx: torch.Tensor, new: torch.Tensor,
           seg_log2: int = SEG_LOG2, numels: Optional[Sequence[int]] = None, facts: Optional[Facts] = None) -> bytes:
    """The coded streams of a flush's sparse params (one values dtype), as the file's positions blob.

    ``wholes``: every sparse param's whole base in spec order (flat; zeros for a base the engine does not store),
    ``counts`` their changes; ``idx`` and ``new``: their positions (ascending per param) and new values, joined in
    that order. ``facts``: an aligned space (``numels`` gives every param's size), whose params without a whole
    (None) take their classes from the facts instead of a pass over their base."""
    aligned = facts is not None
    head_flags = ALIGNED if aligned else 0
    if not idx.numel():
        return _HEADER.pack(MAGIC, VERSION, seg_log2, head_flags, 0, 0, 0, 0)
    bits, mant, nctx = _layout(new.dtype)
    dev = new.device
    space = _Space([w.numel() for w in wholes] if numels is None else numels, seg_log2, aligned)
    x = idx + rep(to_device(space.offs[:-1], dev), counts)  # positions in the joined space
    segs = host_values(torch.unique_consecutive(x >> seg_log2))
    bounds = host_values(torch.searchsorted(x, to_device([g << seg_log2 for g in segs] + [space.total], dev)))
    ent_keys, ranks, sizes, steps = [], [], [], []
    for i, (g, lo, hi) in enumerate(zip(segs, bounds, bounds[1:])):
        pieces = space.pieces(g)
        if aligned and wholes[pieces[0][0]] is None:  # the ranks' facts: no base pass here
            rank, size, base = (f[lo:hi] for f in facts)
            b = _bits(base, bits)
            k = (b & ((1 << (bits - 1)) - 1)) >> mant
            perm = torch.argsort(k, stable=True)
            ent_keys.append(k[perm] + i * nctx)
            ranks.append(rank[perm].long())
            sizes.append(size[perm].long())
            steps.append(_key(_bits(new[lo:hi][perm], bits), bits) - _key(b[perm], bits))
            continue
        seg = _Segment(torch.cat([wholes[j][a:a + n] for j, a, n in pieces]).to(dev), bits, mant, nctx)
        local = x[lo:hi] - (g << seg_log2)
        k = seg.keys[local].long()
        perm = torch.argsort(k, stable=True)  # class order; within a class, rank (position) order
        k, local = k[perm], local[perm]
        ent_keys.append(k + i * nctx)
        ranks.append(seg.ranks(local, k))
        sizes.append(seg.sizes[k])
        steps.append(_key(_bits(new[lo:hi][perm], bits), bits) - seg.key_at(local))
    ek, rank, size, step = torch.cat(ent_keys), torch.cat(ranks), torch.cat(sizes), torch.cat(steps)
    del ent_keys, ranks, sizes, steps  # the flush's O(changed) transients: each freed once read
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
        member[rank[slots(cstart[cidx], counts[cidx], dev)] + rep(to_device(moff, dev), counts[cidx])] = False
        unchanged = torch.nonzero_static(member, size=int(coded[cidx].sum()))[:, 0]
        unchanged -= rep(to_device(moff, dev), coded[cidx])
        pos_codes[slots(dst[cidx], coded[cidx], dev)] = unchanged
    p_gaps = gaps(pos_codes, coded, dev)
    kp, _ = best_k(p_gaps, coded)
    neg = step < 0
    m = step.abs() - 1
    k1a, cost_a = best_k(m, counts)
    nzmask = m > 0
    nz_counts = torch.zeros(len(counts), dtype=torch.int64, device=dev).index_add_(
        0, rep(torch.arange(len(counts), device=dev), counts), nzmask.long())
    nz = np.array(host_values(nz_counts), np.int64)
    nzpos = torch.nonzero_static(nzmask, size=int(nz.sum()))[:, 0]
    nzpos_in = nzpos - rep(to_device(cstart, dev), nz)
    g_gaps = gaps(nzpos_in, nz, dev)
    kg, cost_g = best_k(g_gaps, nz)
    kb, cost_b = best_k(m[nzpos] - 1, nz)
    sparse = cost_g + cost_b < cost_a
    flags = comp * COMPLEMENT + sparse * SPARSE_STEPS
    # sections: P (rank gaps), A (steps of dense-step entries), G and M (sparse-step entries: gaps, then steps - 1)
    dense_e = np.flatnonzero(~sparse)
    sp_e = np.flatnonzero(sparse)
    nz_start = np.concatenate([[0], np.cumsum(nz)[:-1]])
    v = torch.cat([p_gaps, m[slots(cstart[dense_e], counts[dense_e], dev)],
                   g_gaps[slots(nz_start[sp_e], nz[sp_e], dev)], (m[nzpos] - 1)[slots(nz_start[sp_e], nz[sp_e], dev)]])
    kk = np.concatenate([np.repeat(kp, coded), np.repeat(k1a[dense_e], counts[dense_e]),
                         np.repeat(kg[sp_e], nz[sp_e]), np.repeat(kb[sp_e], nz[sp_e])])
    del rank, size, ek, pos_codes, p_gaps, g_gaps, m, nzpos, nzpos_in, nzmask, step
    (uv, uw), (rv, rw) = rice_fields(v, torch.from_numpy(kk).to(dev))
    del v
    u = pack(uv, uw)
    del uv, uw
    r = pack(rv, rw)
    del rv, rw
    s = pack_bits(neg)
    table = dict(seg=np.array(segs, np.int64)[ukeys // nctx], ctx=ukeys % nctx,
                 count=counts, coded=coded, nz=np.where(sparse, nz, 0), flags=flags, kp=kp,
                 k1=np.where(sparse, kg, k1a), k2=np.where(sparse, kb, 0))
    head = _HEADER.pack(MAGIC, VERSION, seg_log2, head_flags, len(counts), u.numel(), r.numel(), s.numel())
    cols = b"".join(np.ascontiguousarray(table[name], dtype=t).astype(np.dtype(t).newbyteorder("<")).tobytes()
                    for name, t in _COLUMNS)
    return head + cols + b"".join(x.cpu().numpy().tobytes() for x in (u, r, s))


# ---------------------------------------------------------------- decode


ReadBase = Callable[[List[Tuple[int, int, int]]], torch.Tensor]
"""``[(param no in the spec, first element, elements)]`` -> the base of those ranges, joined (one flat tensor)."""
Split = Tuple[int, int, Callable[[List[torch.Tensor]], List[torch.Tensor]]]
"""Decoders sharing a flush (tensor-parallel ranks): ``(rank, world, merge)``. Segment ``i`` of the table is decoded
by rank ``i % world``; every rank still reads every segment's base, as ``read_base(pieces, i % world)`` (the reads
may be collectives that give the base to that rank only); ``merge`` sums the ranks' outputs, each zero where another
rank decoded, so every rank ends with the whole flush."""


class _Table:
    """A file's header and class table, parsed and checked on the host against the spec before any stream is read."""

    def __init__(self, blob: torch.Tensor, params: Sequence[DeltaParam], dtype: torch.dtype, where: str):
        self.where = where
        if blob.numel() < _HEADER.size:
            raise DeltaError(f"xor_ctx streams{where}: {blob.numel()} bytes, shorter than their header")
        head = bytes(blob[:_HEADER.size].cpu().numpy())
        magic, version, self.seg_log2, flags, n, *lens = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or flags & ~ALIGNED:
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
        self.bits, self.mant, self.nctx = _layout(dtype) if n else (0, 0, 0)  # no entry: no dtype is coded
        self.sparse = [k for k, q in enumerate(params) if not q.dense]
        self.space = _Space([params[k].numel for k in self.sparse], self.seg_log2, bool(flags & ALIGNED))
        self.params = params
        self._check()

    def param_of(self, e: int) -> str:
        """The params entry ``e``'s segment covers, for a message."""
        seg = int(self.cols["seg"][e])
        names = [self.params[self.sparse[j]].name for j, _, _ in self.space.pieces(seg)] \
            if seg < self.space.segments else []
        return f"param {names[0]!r}" + (f" (segment {seg}, with {len(names) - 1} more)" if len(names) > 1 else "") \
            if names else f"table entry {e} (segment {seg})"

    def _check(self) -> None:
        c, n = self.cols, self.n
        bad = np.zeros(n, bool)
        why = np.full(n, "", object)

        def fail(mask, text):
            new = mask & ~bad
            why[new] = text
            bad[:] |= mask

        fail(c["seg"] >= self.space.segments, "has a segment past the flush's sparse elements")
        fail(c["ctx"] >= self.nctx, f"has a context above {self.nctx - 1}")
        fail(c["count"] < 1, "has a class with no change")
        fail(c["flags"] > COMPLEMENT + SPARSE_STEPS, "has unknown flags")
        fail((c["kp"] > K_MAX) | (c["k1"] > K_MAX) | (c["k2"] > K_MAX), f"has a Rice parameter above {K_MAX}")
        comp, sparse = (c["flags"] & COMPLEMENT) > 0, (c["flags"] & SPARSE_STEPS) > 0
        fail(~comp & (c["coded"] != c["count"]), "codes another number of ranks than it changes")
        # a class lies within one segment: no count may ask for more (every allocation below follows these)
        fail((c["count"] + c["coded"] * comp) > (1 << self.seg_log2), "has more members than a segment holds")
        # a segment's classes partition it: their members together (a complement entry's every member, another's
        # changes) cannot outnumber its elements
        lo = c["seg"] << self.seg_log2
        inv = np.unique(c["seg"], return_inverse=True)[1].reshape(-1)
        held = np.bincount(inv, weights=c["count"] + c["coded"] * comp)[inv]
        fail(held > np.minimum(self.space.total, lo + (1 << self.seg_log2)) - lo,
             "has classes with more members than its segment holds")
        fail(sparse & (c["nz"] > c["count"]), "has more large steps than changes")
        fail(~sparse & ((c["nz"] != 0) | (c["k2"] != 0)), "has large-step fields without sparse steps")
        key = (c["seg"] << 16) + c["ctx"]
        fail(np.concatenate([[False], key[1:] <= key[:-1]]), "is out of order or repeated")
        if bad.any():
            e = int(np.argmax(bad))
            raise DeltaError(f"xor_ctx table{self.where}: entry {e} of {self.param_of(e)} {why[e]}")
        want = sum(self.params[k].nnz for k in self.sparse)  # bounds every allocation that follows
        if int(c["count"].sum()) != want:
            first = self.params[self.sparse[0]].name if self.sparse else None
            raise DeltaError(f"xor_ctx table{self.where}: {int(c['count'].sum())} changes in its classes, the spec's "
                             f"sparse params hold {want} (param {first!r} and the flush's other sparse params)")
        codes = int(c["coded"].sum() + c["count"][~sparse].sum() + 2 * c["nz"].sum())
        if codes > 8 * self.streams[0].numel():  # each code is at least one bit of U: bounds the decode's allocations
            raise DeltaError(f"xor_ctx streams{self.where}: the unary stream's {self.streams[0].numel()} bytes cannot "
                             f"hold the table's {codes} codes (a stream ends early, or the table lies)")


def decode(blob: torch.Tensor, params: Sequence[DeltaParam], dtype: torch.dtype, read_base: ReadBase,
           where: str = "", split: Optional[Split] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A flush's coded streams -> (positions of its sparse params, their new values), both joined in spec order,
    positions ascending per param. Every field is checked against the spec, the table and the base; the caller's
    checksum over the rebuilt blobs then decides. One host read for the segments' bounds, one for all checks.
    ``split``: this rank's share of the base pass (see :data:`Split`)."""
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
    ubits = bits_of(u)
    ones = torch.nonzero_static(ubits, size=total, fill_value=-1)[:, 0]
    q = torch.diff(ones, prepend=ones.new_full((1,), -1)) - 1
    used = ones[-1] // 8 + 1 if total else torch.zeros((), dtype=torch.int64, device=dev)
    checks = {"unary": (ubits.sum() != total) | (used != u.numel()) | (q > ESC).any() | (q < 0).any()}
    del ubits, ones  # the flush's O(changed) transients: each freed once read
    q = torch.clamp(q, 0, ESC)
    widths = torch.where(q == ESC, RAW, kk)
    rem, exact = unpack(r, widths)
    checks["remainder"] = ~exact
    v = torch.where(q < ESC, (q << kk) | rem, rem)
    del q, widths, rem, kk
    gaps_p, a_codes, gaps_g, m_codes = torch.split(v, sec)
    ranks, last_rank = ungaps(gaps_p, coded, dev)
    nzin, last_nz = ungaps(gaps_g, nz, dev)
    checks["large steps"] = (last_nz >= torch.from_numpy(count).to(dev)).any()
    changed = int(count.sum())
    cstart = np.concatenate([[0], np.cumsum(count)])
    m = torch.zeros(changed, dtype=torch.int64, device=dev)
    m[slots(cstart[dense_e], count[dense_e], dev)] = a_codes
    nzabs = torch.clamp(nzin, 0, None) + rep(to_device(cstart[:-1], dev), nz)
    m[torch.clamp(nzabs, 0, max(changed - 1, 0))] = m_codes + 1
    sbits = bits_of(s)
    checks["signs"] = torch.tensor(s.numel() != (changed + 7) // 8, device=dev) | (sbits[changed:] != 0).any()
    step = torch.where(sbits[:changed] != 0, -(m + 1), m + 1)
    del v, gaps_p, a_codes, gaps_g, m_codes, nzin, nzabs, m, sbits
    # the base pass: the segments the table names, in order, one at a time
    segs = c["seg"]
    firsts = np.flatnonzero(np.concatenate([[True], segs[1:] != segs[:-1]])).tolist() + [t.n]
    kstart = np.concatenate([[0], np.cumsum(coded)])
    bad_rank, bad_size, bad_step = [], [], []
    pos_out, val_out = [], []
    half = 1 << (t.bits - 1)
    for i, (lo_e, hi_e) in enumerate(zip(firsts, firsts[1:])):
        ents = np.arange(lo_e, hi_e)
        g = int(segs[lo_e])
        c0, c1 = int(cstart[lo_e]), int(cstart[hi_e])
        pieces = [(t.sparse[j], a, n) for j, a, n in t.space.pieces(g)]
        base = read_base(pieces) if split is None else read_base(pieces, i % split[1])
        if split is not None and i % split[1] != split[0]:  # another rank's: zeros here, its output in the merge
            for out in (bad_rank, bad_size, bad_step):
                out.append(torch.zeros(len(ents), dtype=torch.bool, device=dev))
            pos_out.append(torch.zeros(c1 - c0, dtype=torch.int64, device=dev))
            val_out.append(torch.zeros(c1 - c0, dtype=torch.int64, device=dev))
            continue
        seg = _Segment(base.to(dev), t.bits, t.mant, t.nctx)
        kcls = to_device(c["ctx"][ents], dev)
        size = seg.sizes[kcls]
        bad_rank.append((last_rank[lo_e:hi_e] >= size) & torch.from_numpy(coded[ents] > 0).to(dev))
        comp_t = torch.from_numpy(comp[ents]).to(dev)
        bad_size.append(comp_t & (size != to_device(coded[ents] + count[ents], dev)))
        ce = np.flatnonzero(comp[ents])  # a complement class: every member changed but the coded ones
        member = seg.members(to_device(c["ctx"][ents][ce], dev), (coded + count)[ents][ce])
        rk = torch.clamp(ranks[int(kstart[lo_e]):int(kstart[hi_e])], 0, None)
        at = seg.order[torch.clamp(seg.starts[rep(kcls, coded[ents])] + rk, 0, seg.order.numel() - 1)]
        member[at] = ~rep(comp_t.long(), coded[ents]).bool()
        local = torch.nonzero_static(member, size=c1 - c0, fill_value=0)[:, 0]
        perm = torch.argsort(seg.keys[local], stable=True)  # position order -> table (class) order
        st = torch.empty_like(step[c0:c1])
        st[perm] = step[c0:c1]
        newk = seg.key_at(local) + st
        out = (newk < -half) | (newk >= half)
        bad_step.append(torch.zeros(len(ents), dtype=torch.int64, device=dev).index_add_(
            0, rep(torch.arange(len(ents), device=dev), count[ents]), out[perm].long()) > 0)
        pos_out.append(local + (g << t.seg_log2))
        val_out.append(_unkey(torch.clamp(newk, -half, half - 1), t.bits))
    x, vals = torch.cat(pos_out), torch.cat(val_out)  # in the joined space, ascending
    per_entry = torch.stack([torch.cat(bad_rank), torch.cat(bad_size), torch.cat(bad_step)])
    if split is not None:
        x, vals, per_entry = split[2]([x, vals, per_entry])
    offs = to_device(t.space.offs, dev)
    j = torch.searchsorted(offs[1:], x, right=True)
    nnz = [params[k].nnz for k in t.sparse]
    per_param = torch.bincount(j, minlength=len(nnz)) != to_device(nnz, dev)
    flat = torch.cat([torch.stack(list(checks.values())).reshape(-1), per_entry.reshape(-1), per_param])
    if any(host_values(flat.any().reshape(1))):
        _refuse(t, list(checks), host_values(flat), where)
    iv = INT_VIEW[t.bits // 8]
    vals = torch.where(vals >= half, vals - (1 << t.bits), vals).to(iv).view(dtype)
    return x - offs[j], vals


def _refuse(t: _Table, names: List[str], flags: list, where: str) -> None:
    """Name the first check that failed: a stream's, an entry's (and so its param), or a param's count."""
    for name, bad in zip(names, flags):
        if bad:
            raise DeltaError(f"xor_ctx streams{where}: the {name} stream does not match the table (ends early, runs "
                             f"on, or holds an escape out of range)")
    per = np.array(flags[len(names):len(names) + 3 * t.n], bool).reshape(3, t.n)
    what = ("a rank past its class (the base is not the one the table was coded against, or a stream lies)",
            "a class size that differs from the base's", "a step out of the dtype's range")
    for row, text in zip(per, what):
        if row.any():
            e = int(np.argmax(row))
            raise DeltaError(f"xor_ctx streams{where}: {t.param_of(e)}: {text}")
    counts = flags[len(names) + 3 * t.n:]
    if any(counts):
        q = t.params[t.sparse[counts.index(True)]]
        raise DeltaError(f"xor_ctx streams{where}: param {q.name!r}: its decoded changes differ from the spec's "
                         f"{q.nnz}")
    raise DeltaError(f"xor_ctx streams{where}: inconsistent")
