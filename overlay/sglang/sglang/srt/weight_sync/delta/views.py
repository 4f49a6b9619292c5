"""Direct writes: a delta written straight through the views the model's own loader used in the full sync.

The full sync records every view copy the loader makes (``fingerprint.FingerprintRecorder``); where the
loader did nothing else, a param's changed elements map through those views into model storage by
index arithmetic alone (:class:`Direct`). The same geometry reads the committed bytes an ``xor_zstd``
flush is relative to (:func:`read_base`, :func:`rebuild_xor`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.weight_sync.delta import fingerprint
from sglang.srt.weight_sync.delta.collectives import tp_agree, tp_group
from sglang.srt.weight_sync.delta.ops import INT_VIEW, gather, host_values, repeat_counts, shifted_cat, take, to_device
from sglang.srt.weight_sync.delta.positions import Run
from sglang.srt.weight_sync.delta.validate import unxor
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

    def targets(self, idx: torch.Tensor, whole: bool) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """(a mask of the entries of ``idx`` this view holds, or None for all; every entry's offset in ``flat``,
        meaningful where the mask holds). No host synchronization: the caller selects for a whole flush at once."""
        if not self.dims:
            offsets = idx + (self.doff - self.soff)
            return (None, offsets) if whole else ((idx >= self.soff) & (idx < self.soff + self.numel), offsets)
        rem = idx - self.soff
        ok = rem >= 0
        out = torch.full_like(idx, self.doff)
        for size, sstride, dstride in self.dims:
            i = torch.div(rem, sstride, rounding_mode="floor")
            ok &= (i >= 0) & (i < size)
            rem -= i * sstride
            out += i * dstride
        return ok & (rem == 0), out


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
    after direct writes (``receiver._post_process``)."""
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
class Blocks:
    """The params of a direct plan whose one view holds their whole HF tensor as one contiguous block (every
    expert of a fused MoE weight, most dense weights): name -> (storage id, block start), and each storage's flat
    tensor. Their writes are batched per storage without a tensor op per param (:func:`write_run`). Storages where
    two blocks overlap are left out: their writes keep their order (:func:`_write_blocks`)."""

    at: Dict[str, Tuple[int, int]]
    flats: List[torch.Tensor]


def block_plan(direct: Dict[str, List[Direct]], manifest: Dict[str, Tuple[List[int], str]]) -> Blocks:
    """:class:`Blocks` of a direct plan; every flush is checked against ``manifest`` (its shapes), so a block that
    spans its param's whole tensor there does in every flush."""
    ids: Dict[Tuple[int, torch.dtype], int] = {}
    sids: Dict[int, int] = {}  # id(flat) -> storage id: a param's views share one flat tensor (Direct.of)
    at, flats, spans = {}, [], []
    for name, targets in direct.items():
        t, entry = targets[0] if len(targets) == 1 else None, manifest.get(name)
        if t is None or entry is None or t.dims or t.soff or t.numel != math.prod(entry[0]):
            continue
        sid = sids.get(id(t.flat))
        if sid is None:
            key = (t.flat.data_ptr(), t.flat.dtype)  # flats of one storage (tied params) share an id
            sid = sids[id(t.flat)] = ids.get(key, len(flats))
            if sid == len(flats):
                ids[key] = sid
                flats.append(t.flat)
                spans.append([])
        at[name] = (sid, t.doff)
        spans[sid].append((t.doff, t.doff + t.numel, name))
    for s in spans:
        s.sort()
        if any(b[0] < a[1] for a, b in zip(s, s[1:])):
            for _, _, name in s:
                del at[name]
    return Blocks(at, flats)


def write_run(blocks: Blocks, direct: Dict[str, List[Direct]], run: Run, values: torch.Tensor, rest: list,
              check: "ReadBack") -> None:
    """Write one run of a flush's params (``values``: the flush's) through their recorded views. Whole-block params
    take one gather of their positions and values and one ``index_copy_`` per destination storage, whatever their
    count; params with other views are appended to ``rest`` as :func:`write_direct`'s items (the caller writes those
    before the run's tensor is reused). Every write is read back into ``check``."""
    at, x, device = blocks.at, run.positions, run.positions.device
    picked, names = [], []  # (storage, block start, start in x, start in values, count) per batched param
    for p, a in zip(run.params, run.starts):
        b, n = at.get(p.name), p.val_end - p.val_start
        if b is None:
            rest.append((p.name, direct[p.name], x[a:a + n], values[p.val_start:p.val_end], p.numel))
        else:
            picked.append((*b, a, p.val_start, n))
            names.append(p.name)
    if not picked:
        return
    cols = np.array(picked, dtype=np.int64).reshape(-1, 5)
    by_storage = np.argsort(cols[:, 0], kind="stable")  # grouped by storage, in spec order within one
    cols, names = cols[by_storage], [names[k] for k in by_storage.tolist()]
    sid, doff, xa, va, n = cols.T
    counts = n.tolist()
    firsts = np.cumsum(n) - n
    total = sum(counts)
    shift = va - xa  # a run's values pair with its positions at one shift, unless a dense param lies between
    if (xa == firsts).all():  # in run order and back to back (a dense model): slices, no gather
        offsets = x[:total] + repeat_counts(to_device(doff.tolist(), device), counts)
        vals = values[int(va[0]):int(va[0]) + total] if (shift == shift[0]).all() else None
    else:  # one gather from the run's order into storage order, shared by positions and values where it can be
        order = torch.arange(total, device=device).add_(repeat_counts(to_device((xa - firsts).tolist(), device),
                                                                        counts))
        offsets = take(x, order).add_(repeat_counts(to_device(doff.tolist(), device), counts))
        vals = gather(values, order.add_(int(shift[0]))) if (shift == shift[0]).all() else None
    if vals is None:
        vals = gather(values, torch.arange(total, device=device).add_(
            repeat_counts(to_device((va - firsts).tolist(), device), counts)))
    cuts = np.r_[0, np.flatnonzero(np.diff(sid)) + 1, len(sid)]
    for s, i, j in zip(sid[cuts[:-1]].tolist(), cuts[:-1].tolist(), cuts[1:].tolist()):
        a, b = int(firsts[i]), int(firsts[j - 1] + n[j - 1])
        _scatter(blocks.flats[s], offsets[a:b], vals[a:b], check, list(zip(names[i:j], counts[i:j])))


def write_direct(items, check: "ReadBack") -> None:
    """Overwrite the changed elements of a flush's params in place, through every view their loader used.

    ``items``: ``(name, targets, positions, values, numel)`` per param. Views that hold a whole HF tensor as one
    contiguous block (every expert of a fused MoE weight, most dense weights) are written with one
    ``index_copy_`` per destination storage for the whole flush; the views that hold part of one (TP shards)
    are selected together, with one ``nonzero`` and one host read for the flush, not one per param. Every write is
    read back into ``check``."""
    blocks: Dict[Tuple[int, torch.dtype], list] = {}  # destination storage -> [(view, positions, values, name)]
    partial = []  # (view, mask, offsets, values, name)
    for name, targets, idx, values, numel in items:
        device = targets[0].flat.device
        if idx.device != device or values.device != device:  # the receiver hands the flush over on the device
            idx, values = idx.to(device, non_blocking=True), values.to(device, non_blocking=True)
        for t in targets:
            if not t.dims and t.soff == 0 and t.numel == numel:
                blocks.setdefault((t.flat.data_ptr(), t.flat.dtype), []).append((t, idx, values, name))
                continue
            mask, offsets = t.targets(idx, whole=t.soff == 0 and t.numel == numel)
            if mask is None:
                _scatter(t.flat, offsets, values, check, [(name, idx.numel())])
            else:
                partial.append((t, mask, offsets, values, name))
    for entries in blocks.values():
        _write_blocks(entries, check)
    if not partial:
        return
    starts = [0]
    for _, mask, _, _, _ in partial:
        starts.append(starts[-1] + mask.numel())
    hits = torch.cat([m for _, m, _, _, _ in partial]).nonzero().squeeze(1)
    bounds = host_values(torch.searchsorted(hits, torch.tensor(starts, device=hits.device)))
    for (t, _, offsets, values, name), a, b, start in zip(partial, bounds, bounds[1:], starts):
        if b > a:
            sel = hits[a:b] - start
            _scatter(t.flat, take(offsets, sel), gather(values, sel), check, [(name, b - a)])


def _write_bits(flat: torch.Tensor, offsets: torch.Tensor, bits: torch.Tensor) -> None:
    """The write itself: ``flat[offsets] = bits`` (integer views of one width)."""
    flat.index_copy_(0, offsets, bits)


def _scatter(flat: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, check: "ReadBack",
             params: List[Tuple[str, int]]) -> None:
    """``flat[offsets] = values`` as bits (the values cast to the param's dtype first, as the loader's copy does),
    then read back: integer views, because index ops lack fp8 kernels (CPU) and a bit copy is what a delta means
    anyway. ``params``: the (name, count) of each param the values hold, in order."""
    iv = INT_VIEW[flat.element_size()]
    bits = values.to(flat.dtype).view(iv)
    _write_bits(flat.view(iv), offsets, bits)
    check.add(flat.view(iv), offsets, bits, params)


class ReadBack:
    """Every write of an apply read back through the offsets it wrote and compared with the bits it meant to write,
    right after it (stream order), so a later write over the same elements cannot hide it: per write, the index of
    its first wrong element or -1, on the device, and on the host the params it covered. One host read for the
    apply decides (:meth:`verdict`): the checksum proved the request intact, this proves it landed where meant."""

    def __init__(self):
        self._firsts: List[torch.Tensor] = []
        self._params: List[List[Tuple[str, int]]] = []

    def add(self, flat: torch.Tensor, offsets: torch.Tensor, bits: torch.Tensor, params) -> None:
        if not offsets.numel():
            return
        wrong = flat.index_select(0, offsets) != bits
        self._firsts.append(torch.where(wrong.any(), wrong.to(torch.uint8).argmax(), -1))
        self._params.append(params)

    def verdict(self) -> Optional[str]:
        """None when every written element reads back as written; else which param's did not."""
        if not self._firsts:
            return None
        for first, params in zip(host_values(torch.stack(self._firsts)), self._params):
            if first >= 0:
                for name, count in params:
                    if first < count:
                        return f"param {name!r}: element {first} of its written ones reads back other bits than written"
                    first -= count
        return None


def _bits(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``flat[offsets]`` as integers of the same width (see :func:`_scatter`)."""
    return take(flat.view(INT_VIEW[flat.element_size()]), offsets)


def _write_blocks(entries, check: ReadBack) -> None:
    """One storage's whole-block writes of a flush as one ``index_copy_`` (offsets shifted per block by a
    repeat of host-known counts: no synchronization). Blocks whose destinations overlap (a loader
    that writes two HF tensors over the same elements) keep their order, one write each: a batched scatter with
    duplicate offsets has no defined winner on a GPU."""
    flat = entries[0][0].flat
    spans = sorted((t.doff, t.doff + t.numel) for t, _, _, _ in entries)
    overlap = any(b[0] < a[1] for a, b in zip(spans, spans[1:]))
    entries, alone = (entries, []) if not overlap and len(entries) > 1 else ([], entries)
    for t, idx, values, name in alone:  # the block's start moves the view, not every position (no pass over them)
        _scatter(flat[t.doff:], idx, values, check, [(name, idx.numel())])
    if not entries:
        return
    offsets = shifted_cat([idx for _, idx, _, _ in entries], [t.doff for t, _, _, _ in entries], flat.device)
    _scatter(flat, offsets, torch.cat([v for _, _, v, _ in entries]), check,
             [(name, idx.numel()) for _, idx, _, name in entries])


def read_base(direct: Dict[str, List[Direct]], params, idxs, dtype, device, held_parts: list) -> torch.Tensor:
    """The committed values at ``idxs`` through each param's recorded views, aligned with the flush's values;
    appends, per param, the mask of the entries this rank holds (None: all of them) to ``held_parts``.

    A param with a whole-block view is read with the others of its storage in one gather per storage; the
    rest per param. Entries no view holds read as zero (a param no rank stores travels raw) or as anything
    (the caller refuses a param that is held only in part)."""
    counts = [p.nnz for p in params]
    out = torch.zeros(sum(counts), dtype=INT_VIEW[dtype.itemsize], device=device)
    blocks: Dict[Tuple[int, torch.dtype], list] = {}  # storage -> [(view, positions, start in out)]
    at = 0
    for p, idx, n in zip(params, idxs, counts):
        numel = p.numel
        idx = torch.arange(numel, device=device) if idx is None else idx if idx.device == device else idx.to(device)
        targets = direct.get(p.name, ())
        if len(targets) == 1 and targets[0].flat.dtype == dtype:  # one view of the whole tensor, as most params have
            block = targets[0] if not targets[0].dims and targets[0].soff == 0 and targets[0].numel == numel else None
        else:
            targets = [t for t in targets if t.flat.dtype == dtype]  # other bytes than the trainer's: no base
            block = next((t for t in targets if not t.dims and t.soff == 0 and t.numel == numel), None)
        if block is not None:
            blocks.setdefault((block.flat.data_ptr(), dtype), []).append((block, idx, at))
            held_parts.append(None)
        else:
            v, h = None, torch.zeros(n, dtype=torch.bool, device=device)
            for t in targets:
                mask, offsets = t.targets(idx, whole=t.soff == 0 and t.numel == numel)
                got = _bits(t.flat, offsets.clamp(0, max(t.flat.numel() - 1, 0)))  # outside this view: masked off
                if mask is None:
                    v, h = got, None
                    break
                v = got if v is None else torch.where(mask, got, v)
                h |= mask
            if v is not None and n:
                out[at:at + n] = v
            held_parts.append(h)
        at += n
    for entries in blocks.values():  # idx is clamped into each param: every offset lies inside its block
        if len(entries) == 1:  # gathered straight into place, from the block's start
            t, idx, start = entries[0]
            torch.index_select(t.flat[t.doff:].view(out.dtype), 0, idx, out=out[start:start + idx.numel()])
            continue
        flat, sizes = entries[0][0].flat, [idx.numel() for _, idx, _ in entries]
        src = shifted_cat([idx for _, idx, _ in entries], [t.doff for t, _, _ in entries], device)
        firsts = itertools.accumulate(sizes, initial=0)
        dst = torch.arange(sum(sizes), device=device).add_(repeat_counts(
            to_device([start - first for (_, _, start), first in zip(entries, firsts)], device), sizes))
        out.index_copy_(0, dst, _bits(flat, src))
    return out.view(dtype)


def rebuild_xor(direct: Dict[str, List[Direct]], manifest, payloads: Sequence[DeltaPayload], device) -> List[DeltaPayload]:
    """``xor_zstd``: rebuild every flush's new values from this rank's committed bytes (see ``validate.unxor``).

    With tensor parallelism a rank holds only its shard of some params; the ranks rebuild together with
    two collectives over the flush's values (O(changed)): the lowest rank holding an element owns it,
    owners contribute its rebuilt bytes, every rank gets them all. The checksum then judges the whole
    flush on every rank. Called on every rank after the ranks agreed to rebuild, so the collectives match.
    """
    held_masks: list = []  # per param: None (all held) or a mask
    group, error = tp_group(), None
    try:
        rebuilt = [unxor(pl, manifest, lambda ps, ix, pl=pl: read_base(direct, ps, ix, pl.values.dtype, device, held_masks))
                   for pl in payloads]
    except DeltaError as e:
        error = e
    if group is not None and not tp_agree(error is None):  # never enter the collectives alone
        raise error or DeltaError("another tensor-parallel rank could not rebuild the xor_zstd values", Refusal.PEER)
    if error is not None:
        raise error
    params = [p for pl in rebuilt for p in pl.spec.params]
    if group is not None and params:
        world, rank = group.world_size, group.rank_in_group
        held = torch.cat([torch.ones(p.nnz, dtype=torch.bool, device=device) if h is None else h
                          for p, h in zip(params, held_masks)])
        owner = torch.where(held, rank, world).to(torch.int32)
        torch.distributed.all_reduce(owner, op=torch.distributed.ReduceOp.MIN, group=group.device_group)
        # an element no rank holds is a raw param's (XOR zero): every rank has the same bytes, rank 0 gives them
        mine = (owner == rank) | ((owner == world) & (rank == 0))
        parts = [pl.values.view(torch.uint8).view(pl.values.numel(), pl.values.element_size()) for pl in rebuilt]
        raw = torch.cat([torch.where(m[:, None], b, 0) for m, b in zip(mine.split([p.shape[0] for p in parts]), parts)])
        torch.distributed.all_reduce(raw, op=torch.distributed.ReduceOp.SUM, group=group.device_group)  # disjoint bytes
        out, at = [], 0
        for pl, part in zip(rebuilt, parts):
            n = part.shape[0]
            out.append(dataclasses.replace(pl, values=raw[at:at + n].reshape(-1).view(pl.values.dtype)))
            at += n
        rebuilt = out
        held_masks = list((owner < world).split([p.nnz for p in params]))
    # A param no rank holds any of (the loader ignores it, e.g. a tied lm_head) travels raw: XOR zero. A param
    # held only in part cannot be rebuilt. One host read for the flush.
    partial = [(k, h) for k, h in enumerate(held_masks) if h is not None and h.numel()]
    if partial:
        some = torch.stack([h.any() & ~h.all() for _, h in partial])
        bad = host_values(some)
        if any(bad):
            name = params[partial[bad.index(True)][0]].name
            raise DeltaError(f"param {name!r}: xor_zstd values need its committed bytes, which this engine cannot read "
                             "all of through recorded views (send it planes_zstd)", Refusal.NO_BASE)
    return rebuilt
