"""Each trainer rank diffs the part of its Megatron shard it owns and sends its stage's source rank only what
changed, already as HF names and positions (``delta_shard_map`` says where each element lands).

Ranks that hold the same shard (data-parallel replicas; every TP rank, for a param TP does not split) own equal
slices of its flat range, so the snapshot and the diff spread over them: a rank's host snapshot is its own slice
only. What travels to the source is, per HF tensor, the changed positions (int32 where the tensor allows) and the
values: bytes follow the changed elements, and no rank gathers a full param.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core import mpu
from torch._utils import _flatten_dense_tensors

from sglang.srt.weight_sync.delta import ctx, mix64
from sglang.srt.weight_sync.delta.diff import changes_many
from sglang.srt.weight_sync.delta.fingerprint import NameSum, name_seed
from sglang.srt.weight_sync.delta.ops import INT_VIEW, host_values, repeat_counts, to_device
from sglang.srt.weight_sync.delta.snapshot import HostLink
from sglang.srt.weight_sync.delta.wire import dtype_to_str
from slime.backends.megatron_utils.update_weight.delta_shard_map import ParamMap, locate


@dataclasses.dataclass
class Changes:
    """What one rank found changed: blocks of one value dtype, each its HF targets' ``names`` with ``counts``, and
    their HF flat positions and values (and base values, ``xor_zstd``), grouped by target in that order and sorted
    within each; ``shapes``: every target's HF shape."""

    blocks: List[Tuple[List[str], List[int], torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]
    shapes: Dict[str, Tuple[int, ...]]


def owned_range(m: ParamMap, numel: int) -> Tuple[int, int]:
    """The slice of the shard's flat range this rank owns among the ranks holding the same shard: data- and
    context-parallel replicas (expert-data-parallel ones for experts), and the TP ranks for a param TP does not
    split."""
    expert = ".experts." in m.name
    if expert:
        dp, dp_rank = mpu.get_expert_data_parallel_world_size(), mpu.get_expert_data_parallel_rank()
        tp, tp_rank = mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank()
    else:
        # context-parallel ranks hold the same weights as data-parallel ones (the expert mesh folds them in already)
        dp = mpu.get_data_parallel_world_size(with_context_parallel=True)
        dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    replicas, me = (dp * tp, tp_rank * dp + dp_rank) if m.replicated else (dp, dp_rank)
    per = -(-numel // replicas)
    return min(numel, me * per), min(numel, (me + 1) * per)


class StaleShardMap(RuntimeError):
    """A param's shape or dtype is not the one its shard map was built from: its slices would land elsewhere."""


class ShardDiffer:
    """The host snapshot of this rank's owned slices (pinned on CUDA), the diff of the live params against it in
    chunks of at most ``chunk_bytes`` on the device (the flush buffer), and the positions an unacknowledged sync
    sent (staged: local int32, carried again by the next diff).

    Every param's map joins one table (its runs shifted into one position space, its targets into one list), so a
    diff run of many params is mapped with one search, grouped by target with one sort and counted with one host
    read, whatever the params' count."""

    def __init__(self, maps: Dict[str, ParamMap], chunk_bytes: int = 512 << 20):
        self.maps = {n: m for n, m in maps.items() if m.pure}
        self.chunk_bytes = chunk_bytes  # the snapshot on the device at once, at most (twice: one chunk ahead)
        self.link: Optional[HostLink] = None
        self.ranges: Dict[str, Tuple[int, int]] = {}
        self.snapshot: Dict[str, torch.Tensor] = {}  # views of ``flat``
        self.flat: Dict[torch.dtype, torch.Tensor] = {}
        self.at: Dict[str, int] = {}  # each param's slice's start in its dtype's buffer
        self.staged: Dict[str, torch.Tensor] = {}  # positions in the owned slice (int32, host)
        self._found: List[Tuple[List[str], torch.Tensor, torch.Tensor, List[int]]] = []  # the last diff, per run
        self.base, self.targets, self.shapes, runs, at, t = {}, [], {}, [], 0, 0
        for name, m in self.maps.items():
            numel = math.prod(m.shape)
            shifted = m.runs.clone()
            shifted[:, 0] += at
            shifted[:, 1] += t
            runs.append(shifted)
            self.base[name] = at
            self.targets += [hf for hf, _ in m.targets]
            self.shapes.update(m.targets)
            at, t = at + numel, t + len(m.targets)
        self.runs = torch.cat(runs) if runs else torch.zeros(0, 4, dtype=torch.int64)
        self._on: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}  # the joined map, per device, once
        self._seeds = torch.tensor([name_seed(n) for n in self.targets], dtype=torch.int64)

    def _locate(self, positions: torch.Tensor):
        """:func:`locate` through the joined map, kept on ``positions``' device (moved there once)."""
        if positions.device not in self._on:
            runs = self.runs.to(positions.device)
            self._on[positions.device] = (runs, runs[:, 0].contiguous())
        runs, starts = self._on[positions.device]
        return locate(runs, positions, starts)

    @property
    def snapshot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.snapshot.values())

    def seed(self, params: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """Take this rank's slices of ``params`` (after a full sync: what every engine holds), into one host buffer
        per dtype (pinned on CUDA): ``snapshot`` holds a view of it per param. Nothing stays staged."""
        self.snapshot.clear()
        self.staged.clear()
        self._found = []
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

    def _owned(self, params: Sequence[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor]]:
        out = []
        for name, p in params:
            if name in self.snapshot:
                if tuple(p.shape) != tuple(self.maps[name].shape) or p.dtype != self.snapshot[name].dtype:
                    raise StaleShardMap(f"{name} is {tuple(p.shape)} {p.dtype}; its shard map and snapshot slice "
                                        f"were built from {tuple(self.maps[name].shape)} {self.snapshot[name].dtype}")
                lo, hi = self.ranges[name]
                out.append((name, p.detach().reshape(-1)[lo:hi]))
        return out

    def _chunks(self, named: List[Tuple[str, torch.Tensor]], chunk_bytes: Optional[int] = None):
        """The owned slices as chunks of at most ``chunk_bytes`` (default: the differ's): lists of ``(name, offset
        in its slice, piece)``; a slice larger than a chunk is cut into pieces. Consecutive pieces of one dtype lie
        side by side in its snapshot buffer, so a chunk's snapshot moves to the device as one copy."""
        chunk, size, dtype = [], 0, None
        chunk_bytes = chunk_bytes or self.chunk_bytes
        for name, live in named:
            per = self._piece(live, chunk_bytes)
            for off in range(0, max(1, live.numel()), per):
                piece = live[off:off + per]
                if chunk and (size + piece.nbytes > chunk_bytes or piece.dtype != dtype):
                    yield chunk
                    chunk, size = [], 0
                chunk.append((name, off, piece))
                size, dtype = size + piece.nbytes, piece.dtype
        if chunk:
            yield chunk

    def _piece(self, live: torch.Tensor, chunk_bytes: Optional[int] = None) -> int:
        """Elements of ``live``'s dtype in one chunk: the most of a slice one piece holds."""
        return max(1, (chunk_bytes or self.chunk_bytes) // live.element_size())

    def _prefetch(self, chunk):
        hosts = [self.flat[p.dtype][self.at[n] + off:self.at[n] + off + p.numel()] for n, off, p in chunk]
        return self.link.prefetch(hosts, [p.device for _, _, p in chunk])

    def changes(self, params: Sequence[Tuple[str, torch.Tensor]], olds: bool = False) -> Changes:
        """The owned elements whose bytes differ from the snapshot, or that an unacknowledged sync sent, as HF
        targets' positions and values (with ``olds`` the snapshot's there: ``xor_zstd``'s base). Per chunk of at
        most ``chunk_bytes`` (its snapshot on the device while the next one's is on its way): one joined diff
        (:func:`changes_many`), then per run of it one search over the joined map, one sort and one host read. What
        it finds moves to host memory as it is found (pinned, off the default stream, on CUDA): the device holds one
        chunk's changes, the rounds of ``delta_shard_rounds.send_changes`` bring them back a round at a time."""
        named = self._owned(params)
        if named and (self.link is None or self.link.device != named[0][1].device):
            self.link = HostLink(named[0][1].device)
        staged = self._staged_pieces(named) if self.staged else None
        blocks, self._found = [], []
        chunks = list(self._chunks(named))
        handle = self._prefetch(chunks[0]) if chunks else None
        for k, chunk in enumerate(chunks):
            bases = self.link.ready(handle)
            if k + 1 < len(chunks):  # the next chunk's snapshot moves while this one is diffed
                handle = self._prefetch(chunks[k + 1])
            extra = [staged.get((n, off)) for n, off, _ in chunk] if staged else None
            for run in changes_many([(b, p) for b, (_, _, p) in zip(bases, chunk)], extra, olds):
                if not run.idx.numel():
                    continue
                names = [chunk[i][0] for i in run.ks]
                offs = [chunk[i][1] for i in run.ks]
                device = run.idx.device
                shift = to_device([self.base[n] + self.ranges[n][0] + o for n, o in zip(names, offs)], device)
                flat = run.idx + repeat_counts(shift, run.counts)  # positions in the joined map's space
                tgt, hpos, mapped = self._locate(flat)  # vocab padding maps nowhere
                tgt, hpos = tgt[mapped], hpos[mapped]
                order = torch.argsort(tgt * (1 << 40) + hpos)
                counts = host_values(torch.bincount(tgt, minlength=len(self.targets)))
                live = [j for j, c in enumerate(counts) if c]
                # what the sync keeps of this run leaves the device (pinned host, off the default stream): the
                # device holds a chunk's changes at a time, never the rank's
                pos_h, val_h, idx_h, cur_h, *old_h = self.link.to_host_many(
                    [hpos[order], run.values[mapped][order], run.idx, run.values]
                    + ([run.olds[mapped][order]] if olds else []))
                blocks.append(([self.targets[j] for j in live], [counts[j] for j in live], pos_h, val_h,
                               old_h[0] if olds else None))
                self._found.append((names, offs, idx_h, cur_h, run.counts))
        if self.link is not None:
            self.link.synchronize()  # the host copies are read from here on: once per sync
        return Changes(blocks, self.shapes)

    def held_counts(self, where: Dict[str, int], qx: torch.Tensor, qbase: torch.Tensor, seg_log2: int) -> torch.Tensor:
        """This rank's share of the ``xor_ctx`` facts of changes ``qx`` (ascending) of HF params in an aligned space
        (``where``: each one's start there), ``qbase`` their base values: :func:`ctx.held_counts` over the owned
        elements that land in those params, read from the snapshot in chunks of a 64th of ``chunk_bytes`` (what
        the sort and searches hold per element), each against the changes of the segments it reaches only; the next
        piece's snapshot moves to the device (off the default stream) while one is counted, as in the diff."""
        dev = qx.device
        out = torch.zeros(3, qx.numel(), dtype=torch.int32, device=dev)  # counts within a segment (2**22)
        starts = torch.tensor([where.get(hf, -1) for hf in self.targets], dtype=torch.int64, device=dev)
        named = [(n, self.snapshot[n]) for n, m in self.maps.items() if n in self.snapshot and
                 self.snapshot[n].dtype == qbase.dtype and any(hf in where for hf, _ in m.targets)]
        chunks = list(self._chunks(named, max(1, self.chunk_bytes // 64)))
        if self.link is None or self.link.device != dev:
            self.link = HostLink(dev)
        handle = self.link.prefetch([p for _, _, p in chunks[0]], [dev] * len(chunks[0])) if chunks else None
        for k, chunk in enumerate(chunks):
            pieces = self.link.ready(handle)
            if k + 1 < len(chunks):
                handle = self.link.prefetch([p for _, _, p in chunks[k + 1]], [dev] * len(chunks[k + 1]))
            base = torch.cat(pieces)
            sizes = [p.numel() for _, _, p in chunk]
            at = list(itertools.accumulate(sizes, initial=0))[:-1]
            shift = [self.base[n] + self.ranges[n][0] + off - a for (n, off, _), a in zip(chunk, at)]
            flat = torch.arange(base.numel(), device=qx.device) + repeat_counts(to_device(shift, qx.device), sizes)
            tgt, hpos, mapped = self._locate(flat)  # vocab padding maps nowhere
            start = starts[tgt]
            keep = mapped & (start >= 0)
            x, base = (start + hpos)[keep], base[keep]
            if not x.numel():
                continue
            ends = torch.stack([(x.min() >> seg_log2) << seg_log2, ((x.max() >> seg_log2) + 1) << seg_log2])
            a, b = host_values(torch.searchsorted(qx, ends))
            if b > a:
                out[:, a:b] += ctx.held_counts(x, base, qx[a:b], qbase[a:b], seg_log2).to(torch.int32)
        return out

    def _staged_pieces(self, named) -> Dict[Tuple[str, int], torch.Tensor]:
        """The staged positions per piece, relative to it: widened in one op, and cut with one search per param
        that a chunk splits (one whole chunk's params take theirs as they are)."""
        held = [n for n, _ in named if n in self.staged]
        parts = dict(zip(held, torch.cat([self.staged[n] for n in held]).to(torch.int64).split(
            [self.staged[n].numel() for n in held])))
        out = {}
        for name, live in named:
            if name not in parts:
                continue
            per = self._piece(live)
            if live.numel() <= per:
                out[(name, 0)] = parts[name]
                continue
            offs = list(range(0, live.numel(), per))
            cuts = torch.searchsorted(parts[name], torch.tensor(offs[1:], dtype=torch.int64)).tolist()
            for off, part in zip(offs, parts[name].tensor_split(cuts)):
                out[(name, off)] = part - off
        return out
    def shares(self, params: Sequence[Tuple[str, torch.Tensor]]) -> Dict[str, NameSum]:
        """This rank's weight-fingerprint shares of every HF name its owned slices reach (the source adds the
        ranks' shares up: the fingerprint is a sum over elements). Per dtype, in joined blocks: one search over the
        joined map and one hash call per block, one host read at the end."""
        named = self._owned(params)
        totals = torch.zeros(len(self.targets), dtype=torch.int64)
        counts = torch.zeros(len(self.targets), dtype=torch.int64)
        dtypes: Dict[str, str] = {}
        for dtype in {t.dtype for _, t in named}:
            mine = [(n, t) for n, t in named if t.dtype == dtype and t.numel()]
            for batch in _blocks(mine):
                device = batch[0][1].device
                bits = _flatten_dense_tensors([t for _, t in batch]).view(INT_VIEW[dtype.itemsize])
                sizes = [t.numel() for _, t in batch]
                starts = [0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]]
                shift = [self.base[n] + self.ranges[n][0] - s for (n, _), s in zip(batch, starts)]
                flat = torch.arange(bits.numel(), device=device) + repeat_counts(to_device(shift, device), sizes)
                tgt, hpos, mapped = self._locate(flat)
                tgt = tgt[mapped]
                tot, cnt = totals.to(device), counts.to(device)
                mix64.point_sums(bits[mapped], hpos[mapped], self._seeds.to(device)[tgt], tgt, tot,
                                 mix64.i64((1 << (8 * dtype.itemsize)) - 1))
                cnt.index_add_(0, tgt, torch.ones_like(tgt))
                totals, counts = tot, cnt
                for n, _ in batch:
                    for hf, _ in self.maps[n].targets:
                        dtypes[hf] = dtype_to_str(dtype)
        out = {}
        for j, (total, count) in enumerate(zip(host_values(totals), host_values(counts))):
            if count:
                out[self.targets[j]] = NameSum(total=total & mix64.M64, count=count, dtype=dtypes[self.targets[j]])
        return out

    def commit(self) -> None:
        """Every engine took the sync: the last diff's elements take their new values in the snapshot, one
        ``index_copy_`` per run of the diff; nothing stays staged."""
        for names, offs, idx, values, counts in self._found:
            buf = self.flat[values.dtype]
            at = repeat_counts(to_device([self.at[n] + o for n, o in zip(names, offs)], idx.device), counts)
            buf.index_copy_(0, (idx + at).to(buf.device), values.to(buf.device))
        self._found = []
        self.staged.clear()

    def stage(self) -> None:
        """Some engine did not take the sync: the positions it carried (the staged ones among them) are carried
        again by the next diff, with the values of then."""
        parts: Dict[str, List[torch.Tensor]] = {}
        for names, offs, idx, _, counts in self._found:
            for name, off, part in zip(names, offs, idx.to(torch.int32).cpu().split(counts)):
                parts.setdefault(name, []).append(part + off)
        self.staged.update((n, torch.cat(ps) if len(ps) > 1 else ps[0]) for n, ps in parts.items())
        self._found = []


_BLOCK = 1 << 22  # elements hashed at once


def _blocks(items: List[Tuple[str, torch.Tensor]]):
    """``items`` in order, as batches of about :data:`_BLOCK` elements (a larger one alone)."""
    batch, size = [], 0
    for item in items:
        if batch and size + item[1].numel() > _BLOCK:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item[1].numel()
    if batch:
        yield batch
