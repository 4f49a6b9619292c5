"""Direct writes: a delta written straight through the views the model's own loader used in the full sync.

The full sync records every view copy the loader makes (``fingerprint.FingerprintRecorder``); where the
loader did nothing else, a param's changed elements map through those views into model storage by
index arithmetic alone (:class:`Direct`). The same geometry reads the committed bytes an ``xor_zstd``
flush is relative to (:func:`read_base`, :func:`rebuild_xor`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.weight_sync.delta import fingerprint
from sglang.srt.weight_sync.delta.collectives import tp_agree, tp_group
from sglang.srt.weight_sync.delta.ops import INT_VIEW, gather, host_values, repeat_counts, take, to_device
from sglang.srt.weight_sync.delta.positions import Run
from sglang.srt.weight_sync.delta.validate import uncode, unxor
from sglang.srt.weight_sync.delta.wire import DeltaError, DeltaPayload, Refusal

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1 << 12)  # a model's tensors share a few shapes
def contiguous_strides(sizes: Tuple[int, ...]) -> Tuple[int, ...]:
    out, step = [], 1
    for n in reversed(sizes):
        out.append(step)
        step *= n
    return tuple(reversed(out))


@dataclasses.dataclass
class Direct:
    """Where one recorded copy puts HF flat positions: ``flat`` (the param's whole storage) at
    ``doff + sum(i_d * dst_stride_d)`` for the multi-index ``i`` with ``p = soff + sum(i_d * src_stride_d)``."""

    flat: torch.Tensor
    soff: int
    doff: int
    numel: int  # elements the view spans in the HF tensor
    dims: List[Tuple[int, int, int]]  # (size, src stride, dst stride), outer to inner; [] = one contiguous block

    @classmethod
    def of(cls, c, flats: Dict[int, Tuple[int, torch.Tensor]]) -> Optional["Direct"]:
        """None when the source view cannot be inverted by division (overlapping or interleaved strides), or the
        param's tensor was replaced after the copy (its recorded offsets are stale). ``flats``: each param's
        data_ptr now and its whole storage as one flat tensor, read once per param (a fused MoE weight holds
        every expert's copies)."""
        (_, dstr, doff), (ssz, sstr, soff) = c.dst, c.src
        ptr_flat = flats.get(id(c.param))
        if ptr_flat is None:
            storage = c.param.untyped_storage().nbytes() // c.param.element_size()
            ptr_flat = flats[id(c.param)] = (c.param.data_ptr(),
                                             torch.as_strided(c.param.detach(), (storage,), (1,), 0))
        geometry = _geometry(ssz, sstr, dstr)  # sizes may be a torch.Size: it hashes and compares as a tuple
        if ptr_flat[0] != c.ptr or geometry is None:
            return None
        return cls(ptr_flat[1], soff, doff, *geometry)


@functools.lru_cache(maxsize=1 << 12)  # a model's copies share a few geometries (every expert's, every layer's)
def _geometry(ssz: Tuple[int, ...], sstr: Tuple[int, ...], dstr: Tuple[int, ...]) -> Optional[Tuple[int, list]]:
    """(elements, dims) of a :class:`Direct` for a copy of these sizes and source/destination strides; None when the
    source view cannot be inverted by division. Its dims are shared by every Direct of that geometry (read only)."""
    keep = [d for d in range(len(ssz)) if ssz[d] > 1]
    dense = contiguous_strides(ssz)  # sizes are equal on both sides (the recorder checks)
    block = all(sstr[d] == dense[d] and dstr[d] == dense[d] for d in keep)
    dims = sorted(((ssz[d], sstr[d], dstr[d]) for d in keep), key=lambda x: -x[1])
    span = 1
    for size, stride, _ in reversed(dims):
        if stride < span:
            return None
        span += stride * (size - 1)
    return math.prod(ssz), [] if block else dims


def direct_plan(model: torch.nn.Module, recorder: fingerprint.FingerprintRecorder) -> Dict[str, List[Direct]]:
    """Names whose view copies can take deltas directly: all of them, if the full sync saw the loader write
    nothing else into the model; none otherwise (then every delta goes through the loader). A model's
    ``post_load_weights`` derives tensors that are no params (MLA's ``w_kc``/``w_vc``): the receiver re-runs it
    after direct writes (``commit._post_process``)."""
    if recorder.unexplained is not None:
        logger.info("delta: the loader wrote %s outside a view copy; deltas go through its loader",
                    recorder.unexplained)
        return {}
    plan, flats = {}, {}
    for name, copies in recorder.copies.items():
        targets = [Direct.of(c, flats) for c in copies]
        if all(t is not None for t in targets):
            plan[name] = targets
    return plan


@dataclasses.dataclass
class WritePlan:
    """Every recorded view of a direct plan as one row of integers, so a run of changed elements is mapped into model
    storage by the same few tensor ops whatever its params: ``rows[name]`` holds, per view, ``(storage id, kind,
    soff, doff)`` then ``dims`` triples ``(size, src stride, dst stride)``, outer to inner, padded with ``(1, 1, 0)``.
    ``kind``: the param's whole HF tensor as one block (every element lands at ``doff + position``), one run of it
    (a row shard: positions ``soff`` to ``soff + size``), or any other view (a column shard: the dims decide). A
    storage where two views' destinations may overlap (a loader writing two HF tensors over the same elements) is
    ``ordered``: its writes keep the flush's order, one view at a time (a batched scatter with duplicate offsets has
    no defined winner on a GPU)."""

    rows: Dict[str, List[Tuple[int, ...]]]
    flats: List[torch.Tensor]
    ordered: set
    dims: int


_SID, _KIND, _SOFF, _DOFF, _DIMS = 0, 1, 2, 3, 4
_STRIDED, _RUN, _WHOLE = 0, 1, 2  # view kinds, in the order a pass over part views takes them


def write_plan(direct: Dict[str, List[Direct]], manifest: Dict[str, Tuple[List[int], str]]) -> WritePlan:
    """:class:`WritePlan` of a direct plan; every flush is checked against ``manifest`` (its shapes), so a view that
    spans its param's whole tensor there does in every flush."""
    dims = max((len(t.dims) for targets in direct.values() for t in targets), default=0) or 1
    ids: Dict[Tuple[int, torch.dtype], int] = {}  # flats of one storage (tied params) share an id
    flats, spans, rows = [], [], {}
    for name, targets in direct.items():
        numel = math.prod(manifest[name][0]) if name in manifest else None
        out = []
        for t in targets:
            key = (t.flat.data_ptr(), t.flat.dtype)
            sid = ids.setdefault(key, len(flats))
            if sid == len(flats):
                flats.append(t.flat)
                spans.append([])
            geometry = t.dims or [(t.numel, 1, 1)]
            geometry = geometry + [(1, 1, 0)] * (dims - len(geometry))
            kind = _STRIDED if t.dims else _WHOLE if t.soff == 0 and t.numel == numel else _RUN
            out.append((sid, kind, t.soff, t.doff, *(v for d in geometry for v in d)))
            spans[sid].append((t.doff, t.doff + 1 + sum((size - 1) * dstride for size, _, dstride in geometry)))
        rows[name] = out
    ordered = set()
    for sid, s in enumerate(spans):
        s.sort()
        if any(b[0] < a[1] for a, b in zip(s, s[1:])):
            ordered.add(sid)
    return WritePlan(rows, flats, ordered, dims)


def write_run(plan: WritePlan, run: Run, values: torch.Tensor, check: "ReadBack") -> None:
    """Write one run of a flush's params (``values``: the flush's) through their recorded views: whole blocks and the
    views holding part of a param (TP shards, local experts, pieces of a fused loader copy) each in one pass per
    run, one ``index_copy_`` per destination storage, whatever the count of params; views into an ``ordered``
    storage one at a time. Every write is read back into ``check``."""
    groups: Tuple[list, list] = ([], [])  # (part views, whole blocks): (row, start in x, start in values, count)
    ordered = []
    for p, a in zip(run.params, run.starts):
        n = p.val_end - p.val_start
        for row in plan.rows[p.name]:
            (ordered if row[_SID] in plan.ordered else groups[row[_KIND] == _WHOLE]).append(
                (row, a, p.val_start, n, p.name))
    for items in groups:
        if items:
            _write_items(plan, run.positions, values, items, check)
    for item in ordered:
        _write_items(plan, run.positions, values, [item], check)


@dataclasses.dataclass
class _Located:
    """Where a pass's entries land: per entry (kept ones, unless uncompacted) its HF position, its item, its offset in
    its storage's flat tensor and its index in the positions (``src``; None: entry ``k`` is position ``k``);
    ``segments``: per destination storage, ``(storage id, first entry, end)``; per item (in the pass's order) its
    name and the shift from its positions to its values."""

    names: List[str]
    shifts: np.ndarray
    segments: List[Tuple[int, int, int]]
    idx: torch.Tensor
    item: torch.Tensor
    offsets: torch.Tensor
    src: Optional[torch.Tensor]
    held: Optional[torch.Tensor] = None  # uncompacted part views: the entries they hold


def _locate(plan: WritePlan, x: torch.Tensor, items: list, compact: bool = True) -> _Located:
    """One pass over ``items`` (``(row, start in x, start in values, count, name)``; all whole blocks, or all part
    views): positions gathered in storage order and mapped to storage offsets by index arithmetic on the rows (row
    shards by a range check, the other views through their dims), the entries a part view does not hold dropped (one
    host read: how many each storage keeps). The one way positions find their place in model storage, for writes and
    for the bases ``xor_zstd`` and ``xor_ctx`` are relative to. ``compact`` False (reads): nothing dropped and no host
    read; ``held`` marks the entries a part view holds, the others' offsets are clamped into their storage."""
    device = x.device
    # row shards first, then the rest; grouped by storage within each, flush order within one
    order = sorted(range(len(items)), key=lambda k: (-items[k][0][_KIND], items[k][0][_SID]))
    items = [items[k] for k in order]
    rows = np.array([it[0] for it in items], dtype=np.int64).reshape(len(items), -1)
    xa, va, n = (np.array([it[k] for it in items], dtype=np.int64) for k in (1, 2, 3))
    counts = n.tolist()
    firsts = np.cumsum(n) - n
    total = int(n.sum())
    if (xa == firsts).all():  # in run order and back to back (a dense model): a slice, no gather
        idx, src = x[:total], None
    else:
        src = torch.arange(total, device=device).add_(repeat_counts(to_device((xa - firsts).tolist(), device), counts))
        idx = take(x, src)
    item = repeat_counts(torch.arange(len(items), device=device), counts)  # each entry's item
    sids = rows[:, _SID]
    cuts = np.r_[0, np.flatnonzero(np.diff(sids) | np.diff(rows[:, _KIND])) + 1, len(items)]
    ends = np.cumsum([int(n[i:j].sum()) for i, j in zip(cuts[:-1], cuts[1:])]).tolist()
    held = None
    if rows[0, _KIND] == _WHOLE:
        offsets = idx + repeat_counts(to_device(rows[:, _DOFF].tolist(), device), counts)
    else:
        table = to_device(rows[:, _SOFF:].tolist(), device)  # (items, 2 + 3 * dims): one copy to the device
        rem = idx - take(table[:, 0], item)
        offsets = take(table[:, 1], item)
        held = rem >= 0
        runs = int(n[rows[:, _KIND] == _RUN].sum())  # entries of row shards: the first ones
        if runs:  # held where the position lies in the shard's run; its offset is the position's place there
            held[:runs] &= rem[:runs] < take(table[:, 2], item[:runs])
            offsets[:runs] += rem[:runs]
        if runs < total:
            rem, part = rem[runs:], item[runs:]
            for d in range(plan.dims):
                size, sstride, dstride = (take(table[:, 2 + 3 * d + k], part) for k in range(3))
                i = torch.div(rem, sstride, rounding_mode="floor")
                held[runs:] &= i < size
                rem -= i * sstride
                offsets[runs:] += i * dstride
            held[runs:] &= rem == 0
        if compact:
            ends = host_values(take(held.cumsum(0), to_device((np.cumsum(n)[cuts[1:] - 1] - 1).tolist(), device)))
            hits = torch.nonzero_static(held, size=ends[-1]).squeeze(1)
            src = hits if src is None else take(src, hits)
            offsets, idx, item, held = take(offsets, hits), take(idx, hits), take(item, hits), None
    segments = [(s, a, b) for s, a, b in zip(sids[cuts[:-1]].tolist(), [0] + ends[:-1], ends) if b > a]
    if held is not None:
        for s, a, b in segments:
            offsets[a:b].clamp_(0, plan.flats[s].numel() - 1)
    return _Located([it[4] for it in items], va - xa, segments, idx, item, offsets, src, held)


def _write_items(plan: WritePlan, x: torch.Tensor, values: torch.Tensor, items: list, check: "ReadBack") -> None:
    """:func:`_locate` the items, gather their values in the same order, then one write and one read-back per
    storage."""
    loc = _locate(plan, x, items)
    total, shifts = loc.offsets.numel(), loc.shifts
    if (shifts == shifts[0]).all():  # a run's values pair with its positions at one shift, unless a dense param lies
        k = int(shifts[0])          # between
        vals = values[k:k + total] if loc.src is None else gather(values, loc.src + k)
    else:
        at = torch.arange(total, device=x.device) if loc.src is None else loc.src
        vals = gather(values, at + take(to_device(shifts.tolist(), x.device), loc.item))
    wrong = [_scatter(plan.flats[s], loc.offsets[a:b], vals[a:b]) for s, a, b in loc.segments]
    check.add(wrong, loc.item, loc.idx, loc.names)


def _write_bits(flat: torch.Tensor, offsets: torch.Tensor, bits: torch.Tensor) -> None:
    """The write itself: ``flat[offsets] = bits`` (integer views of one width)."""
    flat.index_copy_(0, offsets, bits)


def _scatter(flat: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``flat[offsets] = values`` as bits (the values cast to the param's dtype first, as the loader's copy does), then
    read back right after it (stream order: a later write over the same elements cannot hide it); returns where the
    bits read back differ. Integer views: index ops lack fp8 kernels (CPU), and a bit copy is what a delta means."""
    iv = INT_VIEW[flat.element_size()]
    bits, flat = values.to(flat.dtype).view(iv), flat.view(iv)
    _write_bits(flat, offsets, bits)
    return flat.index_select(0, offsets) != bits


class ReadBack:
    """Every write of an apply compared with the bits it meant to write: per pass, on the device, the item and HF
    position of its first wrong element or -1, and on the host the names of its items. One host read for the apply
    decides (:meth:`verdict`): the checksum proved the request intact, this proves it landed where meant."""

    def __init__(self):
        self._firsts: List[torch.Tensor] = []
        self._names: List[List[str]] = []

    def add(self, wrong: List[torch.Tensor], item: torch.Tensor, idx: torch.Tensor, names: List[str]) -> None:
        """``wrong``: a pass's per-storage results, joined in its entries' order (``item``, ``idx``: each entry's)."""
        if not wrong:
            return
        wrong = torch.cat(wrong) if len(wrong) > 1 else wrong[0]
        first = wrong.to(torch.uint8).argmax()
        where = torch.stack([take(item, first.view(1))[0], take(idx, first.view(1))[0]])
        self._firsts.append(torch.where(wrong.any(), where, -1))
        self._names.append(names)

    def verdict(self) -> Optional[str]:
        """None when every written element reads back as written; else which param's did not."""
        if not self._firsts:
            return None
        for (k, position), names in zip(host_values(torch.stack(self._firsts)), self._names):
            if k >= 0:
                return f"param {names[k]!r}: its element {position} reads back other bits than written"
        return None


def _bits(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``flat[offsets]`` as integers of the same width (see :func:`_scatter`)."""
    return take(flat.view(INT_VIEW[flat.element_size()]), offsets)


def read_base(plan: Optional[WritePlan], params, idxs, dtype, device, helds: list) -> torch.Tensor:
    """The committed values at ``idxs`` through each param's recorded views of ``dtype`` (others hold other bytes than
    the trainer's: no base), aligned with these consecutive params' values (a run of the flush), located as writes
    are (:func:`_locate`: one pass for whole blocks, one for part views, one gather per storage; no host read: the
    entries a part view does not hold are read, then sent to a spare slot). Appends to ``helds`` the run's mask of the
    entries this rank holds, and whether any param is held through part views only. Entries no view holds read as zero
    (a param no rank stores travels raw) or as anything (the caller refuses a param that is held only in part)."""
    counts = [p.nnz if i is None else i.numel() for p, i in zip(params, idxs)]
    total = sum(counts)
    out = torch.zeros(total + 1, dtype=INT_VIEW[dtype.itemsize], device=device)  # [total]: the spare slot
    x = torch.cat([torch.arange(p.numel, device=device) if i is None else i.to(device) for p, i in zip(params, idxs)]) \
        if params else out.new_zeros(0, dtype=torch.int64)
    groups: Tuple[list, list] = ([], [])  # (part views, whole blocks)
    whole, at = [], 0
    for p, n in zip(params, counts):
        rows = [r for r in (plan.rows.get(p.name, ()) if plan is not None else ()) if plan.flats[r[_SID]].dtype == dtype]
        for r in rows:
            groups[r[_KIND] == _WHOLE].append((r, at, at, n, p.name))
        whole.append(any(r[_KIND] == _WHOLE for r in rows))
        at += n
    held = torch.cat([repeat_counts(to_device(whole, device), counts).bool() if total else
                      out.new_zeros(0, dtype=torch.bool), out.new_zeros(1, dtype=torch.bool)])
    for items in groups:
        if not items or not total:
            continue
        loc = _locate(plan, x, items, compact=False)
        for s, a, b in loc.segments:
            dst = torch.arange(a, b, device=device) if loc.src is None else loc.src[a:b]
            if loc.held is not None:  # a part view: what it does not hold goes to the spare slot
                dst = torch.where(loc.held[a:b], dst, total)
                held.index_fill_(0, dst, True)
            out.index_copy_(0, dst, _bits(plan.flats[s], loc.offsets[a:b]))
    helds.append((held[:total], bool(groups[0])))
    return out[:total].view(dtype)


def rebuild_xor(plan: Optional[WritePlan], manifest, payloads: Sequence[DeltaPayload], device) -> List[DeltaPayload]:
    """``xor_zstd``: rebuild every flush's new values from this rank's committed bytes (see ``validate.unxor``).

    With tensor parallelism a rank holds only its shard of some params; the ranks rebuild together with
    two collectives over the flush's values (O(changed)): the lowest rank holding an element owns it,
    owners contribute its rebuilt bytes, every rank gets them all. The checksum then judges the whole
    flush on every rank. Called on every rank after the ranks agreed to rebuild, so the collectives match.
    """
    helds: list = []  # per flush: (the entries this rank holds, whether some param is held in part views only)
    group, error = tp_group(), None
    try:
        rebuilt = [unxor(pl, manifest, lambda ps, ix, pl=pl: read_base(plan, ps, ix, pl.values.dtype, device, helds))
                   for pl in payloads]
    except DeltaError as e:
        error = e
    if group is not None and not tp_agree(error is None):  # never enter the collectives alone
        raise error or DeltaError("another tensor-parallel rank could not rebuild the xor_zstd values", Refusal.PEER)
    if error is not None:
        raise error
    params = [p for pl in rebuilt for p in pl.spec.params if p.val_end > p.val_start]
    if not params:  # no values at all (every rank sees the same flushes: none enters the collectives)
        return rebuilt
    held = torch.cat([h for h, _ in helds]) if len(helds) > 1 else helds[0][0]
    if group is not None:
        parts = [pl.values.view(INT_VIEW[pl.values.element_size()]) for pl in rebuilt]
        raws, held = _share_owned(group, held, parts)
        rebuilt = [dataclasses.replace(r, values=raw.view(r.values.dtype)) for r, raw in zip(rebuilt, raws)]
    elif not any(some for _, some in helds):
        return rebuilt  # every param held whole here, or not at all
    # A param no rank holds any of (the loader ignores it, e.g. a tied lm_head) travels raw: XOR zero. A param
    # held only in part cannot be rebuilt. Per param, how many of its entries are held: one host read.
    bad = _held_in_part(held, [p.nnz for p in params], device)
    if bad is not None:
        raise DeltaError(f"param {params[bad].name!r}: xor_zstd values need its committed bytes, which this "
                         "engine cannot read all of through recorded views (send it planes_zstd)", Refusal.NO_BASE)
    return rebuilt


def _share_owned(group, held: torch.Tensor, parts: List[torch.Tensor],
                 to: Optional[int] = None) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Each element's bytes from the lowest tensor-parallel rank that holds it, on every rank (or on rank ``to`` of
    the group only: the bytes are reduced to it, half an all-reduce's traffic), with two collectives: ``parts`` are
    flat integer views of values whose elements ``held`` marks, joined. An element no rank holds is a raw param's
    (read as zero): every rank has the same bytes, rank 0 gives them. Returns the parts (meaningful on ``to`` only,
    when given) and which elements some rank holds (on every rank)."""
    world, rank = group.world_size, group.rank_in_group
    owner = torch.where(held, rank, world).to(torch.uint8 if world < 255 else torch.int32)  # a byte per element
    torch.distributed.all_reduce(owner, op=torch.distributed.ReduceOp.MIN, group=group.device_group)
    mine = (owner == rank) | ((owner == world) & (rank == 0))
    masks = mine.split([p.numel() for p in parts])
    return _sum_bytes(group, [torch.where(m, p, 0) for m, p in zip(masks, parts)], to), owner < world


def _held_counts(held: torch.Tensor, counts) -> torch.Tensor:
    """How many entries of each consecutive run of ``counts`` entries ``held`` marks (on the device)."""
    ends = np.cumsum(np.asarray(counts, dtype=np.int64))
    sums = torch.cat([held.new_zeros(1, dtype=torch.int64), held.cumsum(0)])
    dev = held.device
    return take(sums, to_device(ends.tolist(), dev)) - take(sums, to_device((ends - counts).tolist(), dev))


def _held_in_part(held: torch.Tensor, counts, device) -> Optional[int]:
    """The first run of ``counts`` entries of which ``held`` marks some but not all (one host read), or None."""
    got = _held_counts(held, counts)
    bad = host_values(((got > 0) & (got < to_device(list(counts), device))).nonzero_static(size=1, fill_value=-1))
    return bad[0][0] if bad[0][0] >= 0 else None


def rebuild_ctx(plan: Optional[WritePlan], manifest, payloads: Sequence[DeltaPayload], device) -> List[DeltaPayload]:
    """``xor_ctx``: every flush's logical blobs rebuilt from its coded streams and the committed bytes (see
    ``validate.uncode``). Its contexts need every element of a changed segment's base: with tensor parallelism a
    rank holds only its shard, so the base pass, the costly part, is split: a rank decodes every ``world``-th
    segment, whose base the ranks give it as it is read (:func:`_share_owned`, two collectives per segment:
    engine-internal traffic of the changed segments' bytes), and one more collective per flush gives every rank the
    whole flush's positions and values (O(changed)). Called on every rank after the ranks agreed to rebuild;
    every rank reads the same file, so the collectives match. A param read in part is refused after the decode,
    with one host read."""
    group = tp_group()
    split = None if group is None else (group.rank_in_group, group.world_size, functools.partial(_sum_bytes, group))
    out, tallies = [], []
    for pl in payloads:
        tally: list = []
        out.append(uncode(pl, manifest, functools.partial(read_ranges, plan, pl.spec.params, pl.values.dtype, device,
                                                          tally), split))
        tallies.append((pl.spec.params, tally))
    flags, names = [], []
    for params, tally in tallies:
        if tally:  # per param: entries read, and how many some rank holds
            k = torch.cat([t[0] for t in tally])
            got = torch.zeros(len(params), dtype=torch.int64, device=device)
            got.index_add_(0, k, torch.cat([t[1] for t in tally]))
            read = torch.zeros_like(got).index_add_(0, k, torch.cat([t[2] for t in tally]))
            flags.append((got > 0) & (got < read))
            names += [p.name for p in params]
    if flags:
        bad = host_values(torch.cat(flags).nonzero_static(size=1, fill_value=-1))[0][0]
        if bad >= 0:
            raise DeltaError(f"param {names[bad]!r}: xor_ctx needs its committed bytes, which this engine holds only "
                             "in part (send it xor_zstd)", Refusal.NO_BASE)
    return out


def _sum_bytes(group, parts: List[torch.Tensor], to: Optional[int] = None) -> List[torch.Tensor]:
    """``parts`` summed over the group's ranks as bytes, in one collective (every byte has one contributor: the
    others hold zero), back in their dtypes and shapes; on every rank, or reduced to group rank ``to`` only. One
    run of bytes though the parts differ in width (bf16 weights, fp8 experts, fp32 scales, int64 positions): widest
    first, so each starts aligned for its dtype."""
    widest = sorted(range(len(parts)), key=lambda k: -parts[k].element_size())
    raw = torch.cat([parts[k].contiguous().view(torch.uint8).reshape(-1) for k in widest])
    if to is None:
        torch.distributed.all_reduce(raw, op=torch.distributed.ReduceOp.SUM, group=group.device_group)
    else:
        torch.distributed.reduce(raw, torch.distributed.get_global_rank(group.device_group, to),
                                 op=torch.distributed.ReduceOp.SUM, group=group.device_group)
    out, at = [None] * len(parts), 0
    for k in widest:
        n = parts[k].numel() * parts[k].element_size()
        out[k] = raw[at:at + n].view(parts[k].dtype).view(parts[k].shape)
        at += n
    return out


def read_ranges(plan: Optional[WritePlan], params, dtype, device, tally: list, pieces,
                decoder: Optional[int] = None) -> torch.Tensor:
    """The committed values of element ranges ``[(param number, first, count)]`` of ``params``, joined, through the
    recorded views (:func:`read_base`); with tensor parallelism, every rank's (:func:`_share_owned`), on every rank
    or only on the ``decoder`` rank of a split decode (the others get bytes they do not use). A param no view holds
    reads as zero (the sender codes it against zero: its ``xor_raw``). Where some param may be held in part, appends
    to ``tally`` (param numbers, entries held, entries read) per range, for the caller to judge."""
    counts = [n for _, _, n in pieces]
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    idx = torch.arange(sum(counts), device=device) + repeat_counts(
        to_device([a - f for (_, a, _), f in zip(pieces, firsts.tolist())], device), counts)
    helds: list = []
    out = read_base(plan, [params[k] for k, _, _ in pieces], list(idx.split(counts)), dtype, device, helds)
    held, part = helds[0]
    group = tp_group()
    if group is not None:
        (raw,), held = _share_owned(group, held, [out.view(INT_VIEW[out.element_size()])], decoder)
        out, part = raw.view(dtype), True
    if part and counts:
        tally.append((to_device([k for k, _, _ in pieces], device), _held_counts(held, counts),
                      to_device(counts, device)))
    return out
