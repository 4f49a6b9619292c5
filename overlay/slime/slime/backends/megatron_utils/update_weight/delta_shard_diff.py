"""Each trainer rank diffs the part of its Megatron shard it owns and sends its stage's source rank only what
changed, already as HF names and positions (``delta_shard_map`` says where each element lands).

Ranks that hold the same shard (data-parallel replicas; every TP rank, for a param TP does not split) own equal
slices of its flat range, so the snapshot and the diff spread over them: a rank's host snapshot is its own slice
only. What travels to the source is, per HF tensor, the changed positions (int32 where the tensor allows) and the
values: bytes follow the changed elements, and no rank gathers a full param.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import mpu

from sglang.srt.weight_sync.delta.diff import changes_many
from slime.backends.megatron_utils.update_weight.delta_shard_map import ParamMap

_I32 = (1 << 31) - 1


@dataclasses.dataclass
class Changes:
    """What one rank found changed, per HF target: ``(hf name, HF flat positions, values)`` (positions sorted per
    entry; entries of one HF tensor from several params or ranks are merged by the source)."""

    entries: List[Tuple[str, torch.Tensor, torch.Tensor]]


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
    """The host snapshot of this rank's owned slices (pinned on CUDA) and the diff of the live params against it."""

    def __init__(self, maps: Dict[str, ParamMap]):
        self.maps = {n: m for n, m in maps.items() if m.pure}
        self.ranges: Dict[str, Tuple[int, int]] = {}
        self.snapshot: Dict[str, torch.Tensor] = {}
        self._found: List[Tuple[str, torch.Tensor, torch.Tensor]] = []  # the last diff, in owned-slice positions

    @property
    def snapshot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.snapshot.values())

    def seed(self, params: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """Take this rank's slices of ``params`` (after a full sync: what every engine holds)."""
        self.snapshot.clear()
        for name, p in params:
            if name not in self.maps:
                continue
            lo, hi = self.ranges[name] = owned_range(self.maps[name], p.numel())
            part = p.detach().reshape(-1)[lo:hi]
            host = torch.empty(part.shape, dtype=part.dtype, pin_memory=part.is_cuda)
            self.snapshot[name] = host.copy_(part)

    def changes(self, params: Sequence[Tuple[str, torch.Tensor]]) -> Changes:
        """The owned elements whose bytes differ from the snapshot, as HF (name, positions, values); one joined
        diff over all params (:func:`changes_many`), one search per param over its map's runs."""
        named = [(n, p) for n, p in params if n in self.snapshot]
        pairs = []
        for name, p in named:
            lo, hi = self.ranges[name]
            live = p.detach().reshape(-1)[lo:hi]
            pairs.append((self.snapshot[name].to(live.device, non_blocking=True), live))
        entries, self._found = [], []
        for run in changes_many(pairs):
            for j, k in enumerate(run.ks):
                name = named[k][0]
                idx, values, _ = run.share(j)
                if not idx.numel():
                    continue
                self._found.append((name, idx, values))
                m = self.maps[name]
                tgt, hpos, mapped = m.locate(idx + self.ranges[name][0])
                for t, (hf_name, _) in enumerate(m.targets):
                    sel = mapped & (tgt == t)
                    entries.append((hf_name, hpos[sel], values[sel]))
        return Changes(entries)

    def commit(self) -> None:
        """Every engine took the sync: the last diff's elements take their new values in the snapshot slices."""
        for name, idx, values in self._found:
            snap = self.snapshot[name]
            snap[idx.to(snap.device)] = values.to(snap.device)
        self._found = []


def send_changes(changes: Changes, dst: int, group=None) -> Tuple[Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]], int]:
    """Every rank's changes to ``dst`` (a global rank), which gets per HF name its positions (sorted) and values
    (the others get None), and the tensor bytes this rank sent. One small object gather (names, dtypes, counts),
    then the positions and values bytes point to point: bytes follow the changed elements."""
    me = dist.get_rank()
    meta, blobs = [], []
    for hf_name, pos, val in changes.entries:
        wide = pos.numel() and int(pos.max()) > _I32
        meta.append((hf_name, str(val.dtype).removeprefix("torch."), pos.numel(), bool(wide)))
        blobs.append(pos.to(torch.int64 if wide else torch.int32).reshape(-1).view(torch.uint8))
        blobs.append(val.reshape(-1).view(torch.uint8))
    payload = torch.cat(blobs) if blobs else torch.zeros(0, dtype=torch.uint8)
    metas: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, (me, pickle.dumps(meta), payload.numel()), group=group)
    if me != dst:
        if payload.numel():
            dist.send(payload.cpu(), dst, group=group)
        return None, payload.numel()
    merged: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    for rank, blob_meta, size in metas:
        data = payload if rank == me else torch.empty(size, dtype=torch.uint8)
        if rank != me and size:
            dist.recv(data, rank, group=group)
        at = 0
        for hf_name, dtype, n, wide in pickle.loads(blob_meta):
            w = 8 if wide else 4
            pos = data[at:at + n * w].clone().view(torch.int64 if wide else torch.int32).to(torch.int64)
            at += n * w
            dt = getattr(torch, dtype)
            vs = torch.empty((), dtype=dt).element_size()
            val = data[at:at + n * vs].clone().view(dt)
            at += n * vs
            merged.setdefault(hf_name, []).append((pos, val))
    out = {}
    for hf_name, parts in merged.items():
        pos = torch.cat([p for p, _ in parts])
        val = torch.cat([v for _, v in parts])
        order = torch.argsort(pos)
        out[hf_name] = (pos[order], val[order])
    return out, 0
