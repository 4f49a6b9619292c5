"""What the ranks of a pipeline stage send its source rank, a round at a time: the source holds one round of the
stage's change, never all of it, whatever the density.

Every rank plans the same rounds from small object gathers: the stage's changed HF names in sorted order, each cut
into pieces of at most a round's changes (a name with more changes than a round is split by HF position, at bounds
every rank derives from the ranks' counts per position range), the pieces cut into rounds. A piece's bounds are
multiples of ``align`` (``xor_ctx``'s segment: a segment's changes never span two pieces). Only names every engine
writes through recorded views are split (an engine refuses pieces of any other): never a name an engine loads whole
or does not store, and none while some engine writes some param through its loader.
"""

from __future__ import annotations

import itertools
import math
import pickle
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from sglang.srt.weight_sync.delta import mix64
from sglang.srt.weight_sync.delta.diff import ChangeRun, Prediffed
from sglang.srt.weight_sync.delta.fingerprint import NameSum
from sglang.srt.weight_sync.delta.ops import repeat_counts, to_device
from slime.backends.megatron_utils.update_weight.delta_shard_diff import Changes

_I32 = (1 << 31) - 1
# the source's bytes per change of a round as it merges them (received bytes, joined, sorted): rounds of at most
# the chunk over this in changes keep its merge within about the chunk (make bench-memory measures it)
MERGE_BYTES = 64
RANGES = 4096  # a split name's changes are counted in at most this many position ranges: the finest cut
_HIST_BATCH = 1 << 20  # changes counted into those ranges at once


def data_device(data_group) -> torch.device:
    """Where a data group's tensors live: the host for gloo, this rank's GPU for NCCL."""
    return torch.device("cpu") if dist.get_backend(data_group) == "gloo" else \
        torch.device("cuda", torch.cuda.current_device())


def round_plan(pieces: List[Tuple[str, int, int, int]], limit: int) -> List[List[int]]:
    """``pieces`` ((name, lo, hi, changes), in name and position order) cut into rounds of at most ``limit``
    changes, as indices (a piece with more is a round alone)."""
    rounds, now, size = [], [], 0
    for k, (_, _, _, count) in enumerate(pieces):
        if now and size + count > limit:
            rounds.append(now)
            now, size = [], 0
        now.append(k)
        size += count
    return rounds + [now] if now else rounds


def _width(numel: int, align: int) -> int:
    """Elements of one position range of a split name: a multiple of ``align``, at most :data:`RANGES` of them."""
    return align * max(1, math.ceil(numel / (align * RANGES)))


def _cut(counts: np.ndarray, width: int, numel: int, limit: int) -> List[Tuple[int, int, int]]:
    """One name's pieces from its changes per position range: (lo, hi, changes), each range whole, as many ranges
    as stay within ``limit`` (a range with more is a piece alone)."""
    pieces, lo, size = [], 0, 0
    for k, c in enumerate(counts.tolist()):
        if size and size + c > limit:
            pieces.append((lo, k * width, size))
            lo, size = k * width, 0
        size += c
    return pieces + [(lo, numel, size)] if size else pieces


def send_changes(changes: Changes, dst: int, group=None, data_group=None, shares: Optional[Dict[str, NameSum]] = None,
                 round_changes: int = (512 << 20) // MERGE_BYTES, whole: Optional[FrozenSet[str]] = frozenset(),
                 align: int = 1, raised: Optional[Callable[[str, int, int], None]] = None
                 ) -> Iterator[Tuple[Optional[List[Prediffed]], int]]:
    """Every rank's changes to ``dst`` (a global rank), in rounds of at most ``round_changes`` changes of the stage:
    per round ``dst`` gets one :class:`Prediffed` per values dtype, HF names in sorted order (a module's params stay
    together; a split name's piece with its position range in ``ranges``), the others None; beside it the tensor
    bytes this rank sent in it. One small object gather over ``group`` first (gloo: names, counts, shapes, dtypes;
    fingerprint ``shares``, which ride with the first round), and where a name outnumbers a round and is not in
    ``whole`` (None: no name is split), one more (each rank's changes of it per position range); then per round the
    positions and values bytes point to point over ``data_group`` (NCCL: device to device).
    ``raised(name, changes, round_changes)`` hears of each piece that is a round alone because it has more (a name
    that is not split, or one position range)."""
    me = dist.get_rank()
    data_group = group if data_group is None else data_group
    device = data_device(data_group)
    meta, blocks = [], []
    for names, counts, pos, val, olds in changes.blocks:
        wide = bool(pos.numel()) and int(pos.max()) > _I32
        meta.append((names, counts, str(val.dtype).removeprefix("torch."), wide, olds is not None))
        blocks.append((pos, val, olds, wide))
    shapes = {n: changes.shapes[n] for names, *_ in changes.blocks for n in names}
    unpacked = [(rank, *pickle.loads(blob)) for rank, blob in _gather((me, pickle.dumps((meta, shapes, shares))),
                                                                       group)]
    totals: Dict[str, int] = {}
    for _, rank_meta, _, _ in unpacked:
        for names, counts, *_ in rank_meta:
            for name, c in zip(names, counts):
                totals[name] = totals.get(name, 0) + c
    all_shapes = {n: tuple(sh) for _, _, rank_shapes, _ in unpacked for n, sh in rank_shapes.items()}
    limit = max(1, round_changes)
    split = {n: _width(math.prod(all_shapes[n]), align) for n, c in totals.items()
             if c > limit and whole is not None and n not in whole}
    ranges = _ranges(changes, split, all_shapes, me, group) if split else {}
    summed: Dict[str, np.ndarray] = {}  # a split name's changes per position range, every rank's and block's
    for per_rank in ranges.values():
        for name, counts in per_rank.values():
            summed[name] = summed[name] + counts if name in summed else counts
    pieces: List[Tuple[str, int, int, int]] = []
    for name in sorted(totals):
        numel = math.prod(all_shapes[name])
        if name in split:
            pieces += [(name, lo, hi, c) for lo, hi, c in _cut(summed[name], split[name], numel, limit)]
        else:
            pieces.append((name, 0, numel, totals[name]))
    for name, _, _, c in pieces if raised is not None else ():
        if c > limit:
            raised(name, c, limit)
    rounds = round_plan(pieces, limit) or [[]]
    picks = {rank: _picks(rank_meta, ranges.get(rank, {}), pieces, rounds, split)
             for rank, rank_meta, _, _ in unpacked if rank == me or me == dst}
    if me == dst:
        every = sorted(totals)
        ids = {n: j for j, n in enumerate(every)}
        found_shares = _shares([s for *_, s in unpacked])
    for k, piece_ids in enumerate(rounds):
        mine = _round_payload(blocks, picks[me][k], device)
        if me != dst:
            if mine.numel():
                dist.send(mine, dst, group=data_group)
            yield None, mine.numel()
            continue
        by_dtype: Dict[str, List] = {}  # dtype -> [(name ids, counts, positions, values, olds)]
        for rank, blob_meta, _, _ in unpacked:
            sel = picks[rank][k]
            size = sum(sum(b - a for _, a, b in runs) * ((8 if m[3] else 4) + getattr(torch, m[2]).itemsize *
                                                        (1 + m[4])) for m, runs in zip(blob_meta, sel))
            data = mine if rank == me else torch.empty(size, dtype=torch.uint8, device=device)
            if rank != me and size:
                dist.recv(data, rank, group=data_group)
            at = 0
            for (names, _, dtype, wide, has_olds), runs in zip(blob_meta, sel):
                n, w, dt = sum(b - a for _, a, b in runs), 8 if wide else 4, getattr(torch, dtype)
                if not n:
                    continue
                pos = data[at:at + n * w].clone().view(torch.int64 if wide else torch.int32).to(torch.int64)
                at += n * w
                val = data[at:at + n * dt.itemsize].clone().view(dt)
                at += n * dt.itemsize
                olds = None
                if has_olds:
                    olds = data[at:at + n * dt.itemsize].clone().view(dt)
                    at += n * dt.itemsize
                by_dtype.setdefault(dtype, []).append(([ids[names[j]] for j, _, _ in runs],
                                                       [b - a for _, a, b in runs], pos, val, olds))
            del data
        out = [_merged(parts, every, all_shapes, device) for parts in by_dtype.values()]
        cut = {pieces[i][0]: pieces[i][1:3] for i in piece_ids if pieces[i][0] in split}
        for p in out:
            p.ranges = {n: cut[n] for n in p.names if n in cut} or None
        if found_shares is not None:  # every name's shares ride with the first round (a sync may find nothing
            if k == 0 and not out:  # changed); the others' blocks carry none
                out.append(Prediffed([], [], ChangeRun([], [], torch.zeros(0, dtype=torch.int64), torch.zeros(0))))
            for j, p in enumerate(out):
                p.shares = found_shares if k == j == 0 else {}
        yield out, 0


def _gather(obj, group) -> list:
    every: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def _ranges(changes: Changes, split: Dict[str, int], shapes, me: int, group) -> Dict[int, Dict]:
    """Every rank's changes of the names to split per position range, per (block, index in it): one bincount per
    run of such a name on this rank, one object gather."""
    mine = {}
    for b, (names, counts, pos, _, _) in enumerate(changes.blocks):
        ends = list(itertools.accumulate(counts))
        for j, name in enumerate(names):
            if name in split:
                width, got = split[name], np.zeros(-(-math.prod(shapes[name]) // split[name]), dtype=np.int64)
                for a in range(ends[j] - counts[j], ends[j], _HIST_BATCH):  # a bounded transient per batch
                    part = torch.bincount(pos[a:min(ends[j], a + _HIST_BATCH)] // width, minlength=got.size)
                    got += part.cpu().numpy()
                mine[(b, j)] = (name, got)
    return dict(_gather((me, mine), group))


def _picks(meta, ranges: Dict, pieces, rounds: List[List[int]], split) -> List[List[List[Tuple[int, int, int]]]]:
    """Per round, per block of one rank's ``meta``, the runs it takes: (index of the name in the block, first and
    end offset in the block's changes), from the rank's counts per position range where a name is split. Each
    block's names read once (the sender cuts its bytes by them, the source its reads)."""
    round_of = {i: k for k, ids in enumerate(rounds) for i in ids}
    at: Dict[str, List[int]] = {}
    for i, (name, *_) in enumerate(pieces):
        at.setdefault(name, []).append(i)
    picks = [[[] for _ in meta] for _ in rounds]
    for b, (names, counts, *_) in enumerate(meta):
        start = 0
        for j, name in enumerate(names):
            if name not in split:
                picks[round_of[at[name][0]]][b].append((j, start, start + counts[j]))
            else:
                cum = np.concatenate([[0], np.cumsum(ranges[(b, j)][1])])
                for i in at[name]:
                    lo, hi = pieces[i][1] // split[name], -(-pieces[i][2] // split[name])
                    a, e = start + int(cum[lo]), start + int(cum[min(hi, len(cum) - 1)])
                    if e > a:
                        picks[round_of[i]][b].append((j, a, e))
            start += counts[j]
    return picks


def _round_payload(blocks, picks: List[List[Tuple[int, int, int]]], device) -> torch.Tensor:
    """This rank's bytes of a round: per block the runs it picks (positions, int32 where the block allows; values;
    base values), as one byte tensor on the data device. What it converts or joins is this round's only."""
    parts = []
    for (pos, val, olds, wide), runs in zip(blocks, picks):
        if not runs:
            continue
        at = torch.cat([pos[a:e] for _, a, e in runs])
        parts.append((at if wide else at.to(torch.int32)).view(torch.uint8))
        for t in (val, olds):
            if t is not None:
                parts += [t[a:e].reshape(-1).view(torch.uint8) for _, a, e in runs]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)).to(device)  # one copy per round


def _shares(every: List[Optional[Dict[str, NameSum]]]) -> Optional[Dict[str, NameSum]]:
    """The ranks' fingerprint shares added up per name (None: this sync checks none)."""
    found: Optional[Dict[str, NameSum]] = None
    for rank_shares in every:
        if rank_shares is not None and found is None:
            found = {}
        for name, share in (rank_shares or {}).items():
            acc = found.setdefault(name, NameSum(dtype=share.dtype))
            acc.total, acc.count = (acc.total + share.total) & mix64.M64, acc.count + share.count
    return found


def _merged(parts, every, shapes, device) -> Prediffed:
    """One dtype's blocks of a round from every rank as one :class:`Prediffed`: one sort by (name, position)."""
    nid = torch.cat([repeat_counts(to_device(i, device), c) for i, c, *_ in parts])
    order = torch.argsort(nid * (1 << 40) + torch.cat([p[2] for p in parts]))
    pos, val = torch.cat([p[2] for p in parts])[order], torch.cat([p[3] for p in parts])[order]
    olds = torch.cat([p[4] for p in parts])[order] if parts[0][4] is not None else None
    totals: Dict[int, int] = {}
    for i, c, *_ in parts:
        for j, n in zip(i, c):
            totals[j] = totals.get(j, 0) + n
    names = [every[j] for j in sorted(totals)]
    counts = [totals[j] for j in sorted(totals)]
    return Prediffed(names, [list(shapes[n]) for n in names],
                     ChangeRun(list(range(len(names))), counts, pos, val, olds))
