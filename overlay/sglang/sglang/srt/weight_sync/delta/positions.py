"""Position codecs: a flush's sorted flat positions as little-endian u16/u32 ints (gaps or absolute), and back.

Encoding is a constant number of tensor ops and one host read per flush. Decoding checks every position (in range,
strictly increasing per param) run by run, about ``_DECODE_RUN`` positions at a time, so an engine holds at most one
run's int64 positions beside the flush; the writes take the positions in the same runs (:class:`Positions`).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.weight_sync.delta.ops import host_values, repeat_counts, take, to_device
from sglang.srt.weight_sync.delta.wire import DeltaEncoding, DeltaError, DeltaParam, DeltaPayload

_U16_MAX = 0xFFFF


_U32_MAX = 0xFFFFFFFF


def encode_positions(idx: torch.Tensor, encoding: str) -> Tuple[torch.Tensor, int]:
    """Sorted int64 flat positions -> (uint8 little-endian bytes, pos_width)."""
    blob, ranges = encode_positions_many([idx], encoding)
    return blob, ranges[0][2]


def encode_positions_many(idxs: Sequence[torch.Tensor], encoding: str, device: Optional[torch.device] = None,
                          counts: Optional[Sequence[Sequence[int]]] = None
                          ) -> Tuple[torch.Tensor, List[Tuple[int, int, int]]]:
    """Several params' sorted positions -> (one uint8 blob, their bytes in order; per param (byte start, byte end,
    pos_width)). ``idxs`` are pieces: each the positions of one param, or with ``counts`` the joined positions of
    ``counts[i]`` params one after the other (a diff's run: joined once, not cut per param). A constant number of
    tensor ops and one host read (the widths) for all of them, whatever their count: gaps over the joined positions,
    each param's first one from -1, each param's largest in one reduction."""
    enc = DeltaEncoding(encoding)
    if counts is None:
        counts = [[i.numel()] for i in idxs]
    lengths = list(itertools.chain.from_iterable(counts))
    device = idxs[0].device if idxs else (device or torch.device("cpu"))
    pieces = [i.reshape(-1) for i in idxs if i.numel()]
    live = [k for k, n in enumerate(lengths) if n]
    tops, lows = np.zeros(len(lengths), dtype=np.int64), np.zeros(len(lengths), dtype=np.int64)
    if live:
        flat = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(torch.int64)
        firsts = list(itertools.accumulate([lengths[k] for k in live], initial=0))
        if enc is DeltaEncoding.INDICES:
            ints = flat
        else:  # gap - 1 to the position before, in one new tensor (torch.diff would join and subtract into two)
            ints = torch.empty_like(flat)
            torch.sub(flat[1:], flat[:-1], out=ints[1:])
            ints[:1] = flat[:1] + 1
            ints.sub_(1)
            at = to_device(firsts[:-1], device)
            ints[at] = flat[at]  # a param's first gap counts from -1, not from the previous param's last position
        lows[live], tops[live] = _segment_range(ints, firsts)
    widths = _pos_widths(enc, tops, lows).tolist()
    # Narrowing keeps the low bytes (values fit unsigned width), and tensors are little-endian on every platform torch
    # runs on: the int16/int32 bytes are the wire's u16/u32. One conversion per run of params of one width.
    parts, ranges, at, elem = [], [], 0, 0
    for width, run in itertools.groupby(range(len(lengths)), key=lambda k: widths[k]):
        run = list(run)
        n = sum(lengths[k] for k in run)
        if n:
            parts.append(ints[elem:elem + n].to(torch.int16 if width == 2 else torch.int32).view(torch.uint8))
        for k in run:
            ranges.append((at, at + lengths[k] * width, width))
            at += lengths[k] * width
        elem += n
    blob = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return blob, ranges


def _pos_widths(enc: DeltaEncoding, tops: np.ndarray, lows: np.ndarray) -> np.ndarray:
    """Bytes per position int of each param, from its largest and smallest int (position, or gap to the one before):
    4 for ``indices``, else 2 where the gaps fit 16 bits and 4 where they fit 32. Refuses a negative one (positions
    out of order or repeated: a narrowed negative gap would decode to another, increasing, position) and one that
    fits no width."""
    if len(lows) and int(lows.min()) < 0:
        k = int(np.argmin(lows))
        if enc is DeltaEncoding.INDICES:
            raise DeltaError(f"param {k} of the flush: negative position {int(lows[k])}")
        raise DeltaError(f"param {k} of the flush: its positions are not increasing and unique (gap {int(lows[k])})")
    biggest = int(tops.max()) if len(tops) else 0
    if enc is DeltaEncoding.INDICES:
        if biggest > _U32_MAX:
            raise DeltaError(f"position {biggest} does not fit the 4-byte 'indices' encoding")
        return np.full(len(tops), 4, dtype=np.int64)
    if biggest > _U32_MAX:
        raise DeltaError(f"gap {biggest} does not fit 4 bytes")
    return np.where(tops <= _U16_MAX, 2, 4).astype(np.int64)


def _segment_range(ints: torch.Tensor, firsts: List[int]) -> Tuple[np.ndarray, np.ndarray]:
    """The smallest and the largest of each run ``ints[firsts[k]:firsts[k + 1]]`` (none empty), read to the host
    together: the one host read of :func:`encode_positions_many` (a ``scatter_reduce`` each over the runs' ids)."""
    seg = repeat_counts(torch.arange(len(firsts) - 1, device=ints.device), list(map(operator.sub, firsts[1:], firsts)))
    out = torch.zeros((2, len(firsts) - 1), dtype=torch.int64, device=ints.device)
    out[0].scatter_reduce_(0, seg, ints, "amin", include_self=False)
    out[1].scatter_reduce_(0, seg, ints, "amax", include_self=False)
    low, top = host_values(out)
    return np.asarray(low, dtype=np.int64), np.asarray(top, dtype=np.int64)


def decode_positions(blob: torch.Tensor, width: int, encoding: str) -> torch.Tensor:
    """uint8 little-endian bytes -> int64 flat positions (gaps decode strictly increasing)."""
    if blob.storage_offset() % width:  # a dtype view needs an aligned offset; a param's slice may not have one
        blob = blob.clone()
    ints = blob.view(torch.uint16 if width == 2 else torch.uint32).to(torch.int64)  # little-endian, as encoded
    if DeltaEncoding(encoding) is DeltaEncoding.INDICES:
        return ints
    return ints.add_(1).cumsum_(0).sub_(1)  # in place: no second int64 tensor


_DECODE_RUN = 1 << 20  # positions per decode pass: bounds the int64 buffer a run decodes into, and keeps it in cache


@dataclasses.dataclass
class Run:
    """Sparse params of a flush (spec order) and their positions joined in one int64 tensor: ``params[k]``'s are
    ``positions[starts[k]:starts[k] + params[k].nnz]``. Writes take a run whole, with no tensor per param."""

    params: List[DeltaParam]
    positions: torch.Tensor
    starts: List[int]


class Positions:
    """A checked flush's int64 positions, per sparse param.

    Kept from the checking pass where a flush is one run; otherwise decoded again, a run at a time into one reused buffer, as the writes take them: int64 positions are
    4x the bytes of bf16 values, so an engine's memory per apply stays the flush plus one run's positions.
    """

    def __init__(self, payload: DeltaPayload, kept: Optional[List[Run]], tops: Optional[torch.Tensor],
                 order: Dict[str, int], buffer: Optional["_RunBuffer"]):
        self._pos, self._gaps = payload.positions, _gaps(payload.spec.encoding)
        self._kept, self._tops, self._order, self._buffer = kept, tops, order, buffer
        self._where = None if kept is None else {  # name -> (its run, its start there)
            p.name: (r, a) for r, run in enumerate(kept) for p, a in zip(run.params, run.starts)}

    @property
    def kept(self) -> bool:
        """Whether every param's positions are held (else a run's tensors hold only until the next run)."""
        return self._kept is not None

    def of(self, p: DeltaParam) -> Optional[torch.Tensor]:
        """``p``'s positions in a tensor of their own (None: a dense param)."""
        if p.dense:
            return None
        if not p.nnz:
            return self._pos.new_empty(0, dtype=torch.int64)
        if self._kept is not None:
            r, a = self._where[p.name]
            return self._kept[r].positions[a:a + p.nnz]
        k = self._order[p.name]
        out = torch.empty(p.nnz, dtype=torch.int64, device=self._pos.device)
        return _decode_run(self._pos, [p], [p.nnz], self._gaps, out, self._tops[k:k + 1], self._buffer)

    def runs(self, params: Sequence[DeltaParam]) -> Iterator[Run]:
        """``params`` (sparse, none empty, in spec order) with their positions, about ``_DECODE_RUN`` positions at a
        time; a run's tensor holds until the next run is asked for."""
        if self._kept is not None:
            where = self._where
            for r, part in itertools.groupby(params, key=lambda p: where[p.name][0]):
                part = list(part)
                yield Run(part, self._kept[r].positions, [where[p.name][1] for p in part])
            return
        for run, counts in _runs(params):
            tops = take(self._tops, to_device([self._order[p.name] for p in run], self._pos.device)) if self._gaps \
                else None
            x = _decode_run(self._pos, run, counts, self._gaps, self._buffer.take(sum(counts)), tops, self._buffer)
            yield Run(run, x, list(itertools.accumulate(counts[:-1], initial=0)))


    def pieces(self, params: Sequence[DeltaParam]) -> Iterator[Tuple[List[DeltaParam], List[Optional[torch.Tensor]]]]:
        """``params`` (a flush's, in spec order) in groups of consecutive params of about ``_DECODE_RUN`` values,
        each param with its positions clamped into its range (None for a dense param: all of it; unverified until
        the flags are read): what an ``xor_zstd`` base is read at, a run at a time. A group's tensors hold until
        the next group is asked for; params without values are left out (their values are empty)."""
        for dense, stretch in itertools.groupby((p for p in params if p.val_end > p.val_start), key=lambda p: p.dense):
            stretch = list(stretch)
            if dense:
                for run, _ in _runs(stretch):
                    yield run, [None] * len(run)
                continue
            for run in self.runs(stretch):  # kept: the stretch is a contiguous part of a kept run
                counts = [p.nnz for p in run.params]
                lo, hi = run.starts[0], run.starts[-1] + counts[-1]
                x = torch.minimum(run.positions[lo:hi],
                                  repeat_counts(to_device([p.numel - 1 for p in run.params], self._pos.device), counts))
                yield run.params, [x[a - lo:a - lo + n] for a, n in zip(run.starts, counts)]


class _RunBuffer:
    """The memory every run of a flush decodes in, grown to the largest run (its pages are touched once, not per
    run): the int64 positions, and aligned room for wire ints that sit off their alignment (a blob read from a
    file is a view of its bytes, wherever its writer put it; a u32 param may follow an odd number of u16 ones)."""

    def __init__(self, device: torch.device):
        self._ints = torch.empty(0, dtype=torch.int64, device=device)
        self._bytes = torch.empty(0, dtype=torch.uint8, device=device)

    def take(self, n: int) -> torch.Tensor:
        if self._ints.numel() < n:
            self._ints = torch.empty(n, dtype=torch.int64, device=self._ints.device)
        return self._ints[:n]

    def aligned(self, raw: torch.Tensor) -> torch.Tensor:
        if self._bytes.numel() < raw.numel():
            self._bytes = torch.empty(raw.numel(), dtype=torch.uint8, device=self._bytes.device)
        return self._bytes[:raw.numel()].copy_(raw)


def _gaps(encoding: str) -> bool:
    return DeltaEncoding(encoding) is not DeltaEncoding.INDICES


def _runs(params: Sequence[DeltaParam]) -> Iterator[Tuple[List[DeltaParam], List[int]]]:
    """Consecutive params in runs of about ``_DECODE_RUN`` positions (a run ends with the param that reaches it),
    each with its params' counts."""
    run: List[DeltaParam] = []
    counts: List[int] = []
    size = 0
    for p in params:
        n = p.val_end - p.val_start
        run.append(p)
        counts.append(n)
        size += n
        if size >= _DECODE_RUN:
            yield run, counts
            run, counts, size = [], [], 0
    if run:
        yield run, counts


def decode_all(payload: DeltaPayload, sparse: List[DeltaParam]) -> Tuple[Positions, list]:
    """Check every sparse param's positions: a :class:`Positions`, and the fault flags (unread).

    Per run of about ``_DECODE_RUN`` positions the tensor ops have no host synchronization and do not grow with
    its params (a copy per stretch of one width, a cumsum, small gathers); the per-param work is host arithmetic.
    Each param's positions must come out strictly increasing (gaps do by construction; ``indices`` are flagged
    when not — unsorted but valid positions are then checked one param at a time, see :func:`_check_one_by_one`)."""
    pos = payload.positions
    gaps = _gaps(payload.spec.encoding)
    live = [p for p in sparse if p.val_end > p.val_start]
    runs = list(_runs(live))
    sizes = [sum(c) for _, c in runs]
    keep = sum(sizes) <= _DECODE_RUN
    buffer = _RunBuffer(pos.device)
    buffer.take(max(sizes, default=0))  # once: runs differ in size, and each growth is fresh pages
    flags, tops, kept = [], [], [] if keep else None
    for run, counts in runs:
        x = torch.empty(sum(counts), dtype=torch.int64, device=pos.device) if keep else None
        top = _scan_run(pos, run, counts, gaps, buffer, flags)
        if keep:
            x = _decode_run(pos, run, counts, gaps, x, top, buffer)
        tops.append(top)
        if keep:
            kept.append(Run(run, x, list(itertools.accumulate(counts[:-1], initial=0))))
    order = {} if keep else {p.name: k for k, p in enumerate(live)}
    top = None if keep or not tops else tops[0] if len(tops) == 1 else torch.cat(tops)
    return Positions(payload, kept, top, order, None if keep else buffer), flags


def _load_run(pos: torch.Tensor, run: Sequence[DeltaParam], counts: List[int], out: torch.Tensor,
              buffer: _RunBuffer) -> torch.Tensor:
    """A run's wire ints (u16 or u32, in any mix) as int64 in ``out``: one copy per stretch of one width."""
    at, k = 0, 0
    for width, part in itertools.groupby(run, key=operator.attrgetter("pos_width")):
        part = list(part)
        a, b, n = part[0].pos_start, part[-1].pos_end, sum(counts[k:k + len(part)])
        k += len(part)
        raw = pos[a:b] if b - a == n * width else torch.cat([pos[p.pos_start:p.pos_end] for p in part])
        if raw.storage_offset() % width:  # a dtype view needs an aligned offset
            raw = buffer.aligned(raw)
        out[at:at + n].copy_(raw.view(torch.uint16 if width == 2 else torch.uint32))  # little-endian, as encoded
        at += n
    return out[:at]


def _scan_run(pos: torch.Tensor, run: Sequence[DeltaParam], counts: List[int], gaps: bool, buffer: _RunBuffer,
              flags: list) -> torch.Tensor:
    """Check one run's positions (loaded into ``buffer``), appending its fault flags; return each param's largest
    position (its last: positions increase), which :func:`_decode_run` needs to decode the run in one pass."""
    device = pos.device
    ends = list(itertools.accumulate(counts, initial=0))
    x = _load_run(pos, run, counts, buffer.take(ends[-1]), buffer)
    if gaps:  # a param's last position: the sum of its (gap + 1), less 1
        top = _segment_sums(x, ends).add_(to_device(counts, device)).sub_(1)
    else:  # absolute: strictly increasing within each param (a param's start may be below the last one's end)
        rising = x[1:] > x[:-1]
        if len(run) > 1:
            rising[to_device(ends[1:-1], device) - 1] = True
        flags.append(~rising.all())
        top = take(x, to_device([e - 1 for e in ends[1:]], device))
    flags.append((top >= to_device([p.numel for p in run], device)).any())
    return top


def _segment_sums(x: torch.Tensor, ends: List[int]) -> torch.Tensor:
    """The sum of each run ``x[ends[k]:ends[k + 1]]`` (none empty); ``x`` is overwritten: a cumsum in place and
    two gathers."""
    first, last = to_device(ends[:-1], x.device), to_device([e - 1 for e in ends[1:]], x.device)
    before = take(x, first)
    x.cumsum_(0)
    return take(x, last) - take(x, first) + before


def _decode_run(pos: torch.Tensor, run: Sequence[DeltaParam], counts: List[int], gaps: bool, out: torch.Tensor,
                top: Optional[torch.Tensor], buffer: _RunBuffer) -> torch.Tensor:
    """One run's positions, in ``out``. Gaps: each param's first (gap + 1) less the last position of the param
    before it in the run, plus 1 (from :func:`_scan_run`'s ``top``), so that one running sum over the whole run
    restarts at every param's start: no per-param pass, no repeat."""
    x = _load_run(pos, run, counts, out, buffer)
    if gaps:
        x += 1
        first = to_device(itertools.accumulate(counts[:-1], initial=0), pos.device)
        x.index_add_(0, first, torch.cat([top.new_zeros(1), top[:-1]]).add_(1).neg_())
        x.cumsum_(0)
    return x
