"""The sender's bucket: what changed, gathered per values dtype until a flush, bounded by encoded bytes plus one
module (a flush never separates params a loader fuses).
"""

from __future__ import annotations

import math
import operator
from typing import Dict, List, Optional, Sequence

import torch

from sglang.srt.weight_sync.delta.ctx import CODER_BYTES, seg_log2_for
from sglang.srt.weight_sync.delta.diff import ChangeRun, FlushEntry, encode_gathered
from sglang.srt.weight_sync.delta.snapshot import Chunk
from sglang.srt.weight_sync.delta.wire import DeltaEncoding, DeltaPayload

_SHAPE = operator.attrgetter("shape")


class DeltaBucket:
    """Encoded params waiting for a flush, grouped by values dtype; bounded by encoded bytes plus one module.

    A sparse param's changed values are gathered before it is added (``diff.FlushEntry``): the bucket never pins the
    caller's whole tensors, so its memory is what it will send (plus one module, below). Consecutive params of one
    diff's run (:meth:`add_found`) stay one entry, views of the run. A flush never separates params of one module
    (``model.layers.1.self_attn.*``, one expert): loaders fuse siblings only when they arrive in one
    ``load_weights`` call (DeepSeek's ``q_a_proj`` + ``kv_a_proj_with_mqa`` are dropped otherwise, silently, on
    SGLang's own update path too).
    """

    def __init__(self, encoding: str, max_bytes: int):
        self.encoding, self.max_bytes = encoding, max_bytes
        self.last = ""  # the last param added (its module is read only when the bucket is full)
        self.entries: Dict[torch.dtype, List[FlushEntry]] = {}
        # bytes a change costs the bound: its position's, plus what xor_ctx's coder holds per change on either side
        self.per_change = 4 + (CODER_BYTES if encoding == DeltaEncoding.XOR_CTX.value else 0)  # the wire may pick 2
        self.base_of = None  # xor_ctx: (name, numel, dtype) -> the param's whole base, flat, read when flushed
        self._open: Dict[torch.dtype, _Span] = {}  # per dtype, the run being extended by add_found
        self.nbytes = 0
        self.over = (0, 0, "")  # params larger than the bound by themselves: (how many, the largest's bytes, its name)

    def add(self, name: str, tensor: torch.Tensor, idx: Optional[torch.Tensor],
            base: Optional[torch.Tensor] = None, values: Optional[torch.Tensor] = None,
            whole: Optional[torch.Tensor] = None) -> None:
        """One param; ``values``: ``tensor`` at ``idx`` when the caller already gathered them; ``base`` the base at
        ``idx`` (``xor_zstd``), ``whole`` the whole base (``xor_ctx``)."""
        self._close(tensor.dtype)
        g = FlushEntry.of(name, tensor, idx, values, base, whole)
        self.entries.setdefault(tensor.dtype, []).append(g)
        self._grow(name, g.counts[0] * ((0 if idx is None else self.per_change) + tensor.element_size()))

    def add_found(self, found: ChangeRun, j: int, name: str, shape: List[int]) -> None:
        """The ``j``-th param of ``found`` (changed: a non-zero count), sparse, ``xor_zstd`` bases from its olds.
        It extends the open span of ``found`` when no values lie between them (unchanged params are left out)."""
        dtype = found.values.dtype
        span = self._open.get(dtype)
        starts = found.starts
        if span is None or span.found is not found or starts[span.end] != starts[j]:
            self._close(dtype)
            span = self._open[dtype] = _Span(found, j)
        span.end = j + 1
        span.names.append(name)
        span.shapes.append(shape)
        n = found.counts[j]
        span.counts.append(n)
        self._grow(name, n * (self.per_change + dtype.itemsize))

    def _grow(self, name: str, cost: int) -> None:
        """One param's bytes in: a param above the bound by itself is a flush of its own (the flush is raised to
        hold it, never split), counted in ``over`` for the sender to say."""
        self.nbytes += cost
        self.last = name
        if cost > self.max_bytes:
            n, largest, who = self.over
            self.over = (n + 1, *max((largest, who), (cost, name)))

    def add_chunk(self, chunk: Chunk, found: Sequence[ChangeRun]) -> bool:
        """A chunk whose diff is one run over all of it, in order, added whole when the bucket holds it below its
        bound (no flush boundary falls inside): its changed params as one span, what :meth:`add_found` makes param by
        param, with no per-param call. False (nothing added) otherwise: the caller goes param by param."""
        if len(found) != 1 or found[0].ks != list(range(len(chunk))):
            return False
        f = found[0]
        dtype = f.values.dtype
        if self.nbytes + f.idx.numel() * (self.per_change + dtype.itemsize) >= self.max_bytes:
            return False
        live = [j for j, n in enumerate(f.counts) if n]
        if not live:
            return True
        self._close(dtype)
        span = self._open[dtype] = _Span(f, 0)
        span.end = len(chunk)
        live_params = chunk if len(live) == len(chunk) else [chunk[j] for j in live]
        span.names = list(map(operator.itemgetter(0), live_params))
        span.shapes = list(map(list, map(_SHAPE, map(operator.itemgetter(1), live_params))))
        span.counts = [f.counts[j] for j in live]
        self.nbytes += f.idx.numel() * (self.per_change + dtype.itemsize)
        self.last = span.names[-1]
        return True

    def _close(self, dtype: torch.dtype) -> None:
        span = self._open.pop(dtype, None)
        if span is not None:
            self.entries.setdefault(dtype, []).append(span.gathered())

    def holds(self, name: str) -> bool:
        """Whether ``name`` is in this flush already (a piece of a param split over rounds starts the next one)."""
        return any(name in s.names for s in self._open.values()) or \
            any(name in g.names for entries in self.entries.values() for g in entries)

    def should_flush(self, next_name: str) -> bool:
        """Before adding ``next_name``: full, and that param starts another module."""
        return self.nbytes >= self.max_bytes and _module(next_name) != _module(self.last)

    def take(self, **spec_fields) -> List[DeltaPayload]:
        """The bucket's flushes, one per dtype, not yet sealed: every caller numbers them first, then seals."""
        for dtype in list(self._open):
            self._close(dtype)
        if self.base_of is not None:
            for dt, entries in self.entries.items():
                for g in entries:  # changes found elsewhere come with their classes' facts instead
                    if g.facts is None:
                        g.wholes = [self.base_of(n, math.prod(s), dt) for n, s in zip(g.names, g.shapes)]
        out = [encode_gathered(self.entries[dt], self.encoding, sealed=False, **spec_fields)
               for dt in sorted(self.entries, key=str)]
        for p in out:
            p.seg_log2 = self.seg_log2
        self.entries, self.nbytes = {}, 0
        return out

    @property
    def seg_log2(self) -> int:
        """``xor_ctx``'s segments in this bucket's flushes: its base pass, bounded by the same bytes. Whoever finds
        the facts of changes found elsewhere must count them in these segments."""
        return seg_log2_for(self.max_bytes)

    def __len__(self) -> int:
        return sum(len(g.names) for v in self.entries.values() for g in v) + \
            sum(len(s.names) for s in self._open.values())


class _Span:
    """Consecutive params ``[start, end)`` of one :class:`ChangeRun` in a bucket (its changed ones named)."""

    def __init__(self, found: ChangeRun, start: int):
        self.found, self.start, self.end = found, start, start
        self.names: List[str] = []
        self.shapes: List[List[int]] = []
        self.counts: List[int] = []

    def gathered(self) -> FlushEntry:
        f = self.found
        a, b = f.starts[self.start], f.starts[self.end]
        return FlushEntry(self.names, self.shapes, self.counts, f.values[a:b], f.idx[a:b],
                          None if f.olds is None else f.olds[a:b], facts=None if f.facts is None else f.facts[:, a:b])


def _module(name: str) -> str:
    """``model.layers.1.self_attn.q_a_proj.weight`` -> ``model.layers.1.self_attn`` (siblings a loader may fuse)."""
    return name.rsplit(".", 2)[0]
