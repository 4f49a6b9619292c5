"""Each trainer rank diffs the part of its Megatron shard it owns and sends its stage's source rank only what
changed, already as HF names and positions (``delta_shard_map`` says where each element lands).

Ranks that hold the same shard (data-parallel replicas; every TP rank, for a param TP does not split) own equal
slices of its flat range, so the snapshot and the diff spread over them: a rank's host snapshot is its own slice
only. What travels to the source is, per HF tensor, the changed positions (int32 where the tensor allows) and the
values: bytes follow the changed elements, and no rank gathers a full param.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import mpu

from sglang.srt.weight_sync.delta.diff import changes_many
from sglang.srt.weight_sync.delta.ops import host_values, repeat_counts, to_device
from slime.backends.megatron_utils.update_weight.delta_shard_map import ParamMap, locate

_I32 = (1 << 31) - 1


@dataclasses.dataclass
class Changes:
    """What one rank found changed: blocks of one value dtype, each its HF targets' ``names`` with ``counts``, and
    their HF flat positions and values, grouped by target in that order and sorted within each."""

    blocks: List[Tuple[List[str], List[int], torch.Tensor, torch.Tensor]]


def owned_range(m: ParamMap, numel: int) -> Tuple[int, int]:
    """The slice of the shard's flat range this rank owns among the ranks holding the same shard."""
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    if m.replicated:
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        replicas, me = dp * tp, tp_rank * dp + dp_rank
    else:
        replicas, me = dp, dp_rank
    per = -(-numel // replicas)
    return min(numel, me * per), min(numel, (me + 1) * per)


class ShardDiffer:
    """The host snapshot of this rank's owned slices (pinned on CUDA) and the diff of the live params against it.

    Every param's map joins one table (its runs shifted into one position space, its targets into one list), so a
    diff run of many params is mapped with one search, grouped by target with one sort and counted with one host
    read, whatever the params' count."""

    def __init__(self, maps: Dict[str, ParamMap]):
        self.maps = {n: m for n, m in maps.items() if m.pure}
        self.ranges: Dict[str, Tuple[int, int]] = {}
        self.snapshot: Dict[str, torch.Tensor] = {}  # views of ``flat``
        self.flat: Dict[torch.dtype, torch.Tensor] = {}
        self.at: Dict[str, int] = {}  # each param's slice's start in its dtype's buffer
        self._found: List[Tuple[List[str], torch.Tensor, torch.Tensor, List[int]]] = []  # the last diff, per run
        self.base, self.targets, runs, at, t = {}, [], [], 0, 0
        for name, m in self.maps.items():
            numel = math.prod(m.shape)
            shifted = m.runs.clone()
            shifted[:, 0] += at
            shifted[:, 1] += t
            runs.append(shifted)
            self.base[name] = at
            self.targets += [hf for hf, _ in m.targets]
            at, t = at + numel, t + len(m.targets)
        self.runs = torch.cat(runs) if runs else torch.zeros(0, 4, dtype=torch.int64)

    @property
    def snapshot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.snapshot.values())

    def seed(self, params: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """Take this rank's slices of ``params`` (after a full sync: what every engine holds), into one host buffer
        per dtype (pinned on CUDA): ``snapshot`` holds a view of it per param."""
        self.snapshot.clear()
        owned = []
        for name, p in params:
            if name in self.maps:
                lo, hi = self.ranges[name] = owned_range(self.maps[name], p.numel())
                owned.append((name, p.detach().reshape(-1)[lo:hi]))
        self.flat, self.at = {}, {}
        for dtype in {part.dtype for _, part in owned}:
            mine = [(n, part) for n, part in owned if part.dtype == dtype]
            buf = torch.empty(sum(part.numel() for _, part in mine), dtype=dtype,
                              pin_memory=any(part.is_cuda for _, part in mine))
            at = 0
            for name, part in mine:
                self.snapshot[name] = buf[at:at + part.numel()].copy_(part)
                self.at[name] = at
                at += part.numel()
            self.flat[dtype] = buf

    def changes(self, params: Sequence[Tuple[str, torch.Tensor]]) -> Changes:
        """The owned elements whose bytes differ from the snapshot, as HF targets' positions and values: one joined
        diff over all params (:func:`changes_many`), then per run of it one search over the joined map, one sort
        and one host read."""
        named = [(n, p) for n, p in params if n in self.snapshot]
        pairs = []
        for name, p in named:
            lo, hi = self.ranges[name]
            live = p.detach().reshape(-1)[lo:hi]
            pairs.append((self.snapshot[name].to(live.device, non_blocking=True), live))
        blocks, self._found = [], []
        for run in changes_many(pairs):
            if not run.idx.numel():
                continue
            names = [named[k][0] for k in run.ks]
            device = run.idx.device
            shift = to_device([self.base[n] + self.ranges[n][0] for n in names], device)
            flat = run.idx + repeat_counts(shift, run.counts)  # positions in the joined map's space
            tgt, hpos, mapped = locate(self.runs.to(device), flat)  # vocab padding maps nowhere
            tgt, hpos = tgt[mapped], hpos[mapped]
            order = torch.argsort(tgt * (1 << 40) + hpos)
            counts = host_values(torch.bincount(tgt, minlength=len(self.targets)))
            live = [j for j, c in enumerate(counts) if c]
            blocks.append(([self.targets[j] for j in live], [counts[j] for j in live], hpos[order],
                           run.values[mapped][order]))
            self._found.append((names, run.idx, run.values, run.counts))
        return Changes(blocks)

    def commit(self) -> None:
        """Every engine took the sync: the last diff's elements take their new values in the snapshot, one
        ``index_copy_`` per run of the diff."""
        for names, idx, values, counts in self._found:
            buf = self.flat[values.dtype]
            at = repeat_counts(to_device([self.at[n] for n in names], idx.device), counts)
            buf.index_copy_(0, (idx + at).to(buf.device), values.to(buf.device))
        self._found = []


def send_changes(changes: Changes, dst: int, group=None) -> Tuple[Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]], int]:
    """Every rank's changes to ``dst`` (a global rank), which gets per HF name its positions (sorted) and values
    (the others get None), and the tensor bytes this rank sent. One small object gather (names, counts, dtypes),
    then the positions and values bytes point to point: bytes follow the changed elements. The source merges all
    blocks of one dtype with one sort."""
    me = dist.get_rank()
    meta, blobs = [], []
    for names, counts, pos, val in changes.blocks:
        wide = bool(pos.numel()) and int(pos.max()) > _I32
        meta.append((names, counts, str(val.dtype).removeprefix("torch."), wide))
        blobs.append(pos.to(torch.int64 if wide else torch.int32).view(torch.uint8))
        blobs.append(val.reshape(-1).view(torch.uint8))
    payload = torch.cat(blobs) if blobs else torch.zeros(0, dtype=torch.uint8)
    metas: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, (me, pickle.dumps(meta), payload.numel()), group=group)
    if me != dst:
        if payload.numel():
            dist.send(payload.cpu(), dst, group=group)
        return None, payload.numel()
    ids: Dict[str, int] = {}
    by_dtype: Dict[str, List] = {}  # dtype -> [(name ids per element counts, positions, values)]
    for rank, blob_meta, size in metas:
        data = payload if rank == me else torch.empty(size, dtype=torch.uint8)
        if rank != me and size:
            dist.recv(data, rank, group=group)
        at = 0
        for names, counts, dtype, wide in pickle.loads(blob_meta):
            n, w, dt = sum(counts), 8 if wide else 4, getattr(torch, dtype)
            pos = data[at:at + n * w].clone().view(torch.int64 if wide else torch.int32).to(torch.int64)
            at += n * w
            vs = torch.empty((), dtype=dt).element_size()
            val = data[at:at + n * vs].clone().view(dt)
            at += n * vs
            nid = [ids.setdefault(name, len(ids)) for name in names]
            by_dtype.setdefault(dtype, []).append((nid, counts, pos, val))
    out = {}
    for parts in by_dtype.values():
        nid = torch.cat([repeat_counts(torch.tensor(i, dtype=torch.int64), c) for i, c, _, _ in parts])
        pos = torch.cat([p for _, _, p, _ in parts])
        val = torch.cat([v for _, _, _, v in parts])
        order = torch.argsort(nid * (1 << 40) + pos)
        pos, val = pos[order], val[order]
        totals: Dict[int, int] = {}
        for i, c, _, _ in parts:
            for j, n in zip(i, c):
                totals[j] = totals.get(j, 0) + n
        names = {j: name for name, j in ids.items()}
        at = 0
        for j in sorted(totals):
            out[names[j]] = (pos[at:at + totals[j]], val[at:at + totals[j]])
            at += totals[j]
    return out, 0
