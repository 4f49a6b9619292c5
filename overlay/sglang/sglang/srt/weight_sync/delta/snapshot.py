"""The sender's snapshot: the last version every engine acknowledged, in host memory (pinned on CUDA), its traffic
to and from the device, and this sync's staging until the engines acknowledge it.

CUDA: snapshot chunks are prefetched host->device on ``h2d_stream`` one chunk ahead (one copy per slab range),
changed positions and values go device->host on ``d2h_stream`` (one copy per chunk and dtype); events order them
(:class:`HostLink`). On CPU the same code runs synchronously.
"""

from __future__ import annotations

import itertools
import math
import operator
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta import device as dev
from sglang.srt.weight_sync.delta.diff import ChangeRun, changes_many, like_pairs
from sglang.srt.weight_sync.delta.ops import INT_VIEW, shifted_cat
from sglang.srt.weight_sync.delta.wire import DeltaError

_SLAB, _ALIGN = 64 << 20, 64  # snapshot slabs (bytes; a power of two) and the alignment of tensors in them

Chunk = Sequence[Tuple[str, torch.Tensor]]


class HostLink:
    """Snapshot traffic between pinned host memory and the device; a pass-through on CPU (off the device path)."""

    def __init__(self, device: torch.device):
        self.device, self.device_path, self.pin = device, dev.device_path(device), dev.pinned(device)
        if self.device_path:
            self.h2d_stream = dev.new_stream(device)
            self.d2h_stream = dev.new_stream(device)
        self.h2d_bytes = self.d2h_bytes = 0
        self._slab: Optional[torch.Tensor] = None
        self._slab_at = 0

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy that outlives ``t`` (pinned on CUDA so later H2D/D2H copies are async), cut from a slab."""
        out = self._host_empty(t.shape, t.dtype)
        out.copy_(t.detach())
        return out

    def _host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Snapshot memory: tensors up to a slab cut from shared slabs of a power-of-two size, 64-byte aligned
        (torch's pinned allocator rounds each allocation up to a power of two: one allocation per tensor pins up to
        2x the model; tensors that share a slab are folded into by one scatter, :meth:`DeltaState.commit`). A
        larger tensor gets its own allocation, as before."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > _SLAB:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        at = -(-self._slab_at // _ALIGN) * _ALIGN
        if self._slab is None or at + nbytes > _SLAB:
            self._slab, at = torch.empty(_SLAB, dtype=torch.uint8, pin_memory=self.pin), 0
        self._slab_at = at + nbytes
        return self._slab[at:at + nbytes].view(dtype).view(shape)

    def prefetch(self, hosts: Sequence[Optional[torch.Tensor]], devices: Sequence[torch.device]):
        """Start moving a chunk's snapshot tensors to their params' devices: one copy per slab range they lie in
        (:func:`_fetch`), not one per param; returns a handle for :meth:`ready`."""
        if not self.device_path:
            return hosts
        with dev.on_stream(self.h2d_stream):
            views, copies = _fetch(hosts, devices, lambda src, device: src.to(device, non_blocking=True))
            event = dev.new_event(self.device)
            event.record(self.h2d_stream)
        self.h2d_bytes += sum(c.numel() * c.element_size() for c in copies)
        return views, copies, event

    def ready(self, handle) -> List[Optional[torch.Tensor]]:
        """The chunk's snapshot tensors on the device, once the default stream may read them."""
        if not self.device_path:
            return handle
        views, copies, event = handle
        current = dev.current_stream(self.device)
        current.wait_event(event)
        for c in copies:
            dev.record_stream(c, current)
        return views

    def to_host(self, values: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        """Changed values back to host memory, off the default stream (``fresh``: the caller made ``values`` and
        hands them over, so on a CPU there is nothing to copy)."""
        if not self.device_path:
            if fresh and values.device.type == "cpu":
                return values.detach() if values.requires_grad else values
            return values.detach().clone() if values.device.type == "cpu" else values.detach().cpu()
        self.d2h_bytes += values.numel() * values.element_size()
        event = dev.new_event(self.device)
        event.record(dev.current_stream(self.device))
        out = torch.empty(values.shape, dtype=values.dtype, pin_memory=self.pin)
        with dev.on_stream(self.d2h_stream):
            self.d2h_stream.wait_event(event)
            out.copy_(values, non_blocking=True)
            dev.record_stream(values, self.d2h_stream)
        return out

    def to_host_many(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """:meth:`to_host` (``fresh``) for flat tensors: on CUDA joined per dtype, so a chunk takes one copy off the
        default stream per dtype instead of one per param, and handed back as views of that host copy."""
        if not self.device_path:  # a CPU sender keeps the caller's fresh tensors as they are (one check each, no call)
            return [t if t.device.type == "cpu" and not t.requires_grad else self.to_host(t, fresh=True)
                    for t in tensors]
        if any(t.device != self.device for t in tensors):
            return [self.to_host(t, fresh=True) for t in tensors]
        out: List[Optional[torch.Tensor]] = [None] * len(tensors)
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for k, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(k)
        for ks in by_dtype.values():
            host = self.to_host(torch.cat([tensors[k].reshape(-1) for k in ks]), fresh=True)
            for k, part in zip(ks, host.split([tensors[k].numel() for k in ks])):
                out[k] = part
        return out

    def synchronize(self) -> None:
        if self.device_path:
            self.h2d_stream.synchronize()
            self.d2h_stream.synchronize()


def _fetch(hosts: Sequence[Optional[torch.Tensor]], devices: Sequence[torch.device],
           copy: Callable[[torch.Tensor, torch.device], torch.Tensor]):
    """(``hosts`` as views of copies, the copies) with one ``copy`` to a device per range of a storage: a chunk's
    snapshot tensors lie side by side in a slab when the chunk was first synced in the same order, so a range that
    spans them costs one transfer. Where a span would move more than twice their bytes, each tensor goes alone.
    ``hosts`` are contiguous (:meth:`HostLink.host_copy` makes every snapshot tensor)."""
    views: List[Optional[torch.Tensor]] = [None] * len(hosts)
    by_storage: Dict[Tuple[int, torch.device], List[int]] = {}
    for k, (t, device) in enumerate(zip(hosts, devices)):
        if t is not None:
            if not t.is_contiguous():  # a span's bytes would not be its elements
                raise DeltaError(f"snapshot tensor {k} of the chunk is not contiguous")
            by_storage.setdefault((t.untyped_storage().data_ptr(), device), []).append(k)
    copies = []
    for (_, device), ks in by_storage.items():
        spans = [(hosts[k].storage_offset() * hosts[k].element_size(), hosts[k].nbytes) for k in ks]
        lo, hi = min(a for a, _ in spans), max(a + n for a, n in spans)
        ranges = [(lo, hi, ks)] if hi - lo <= 2 * sum(n for _, n in spans) else \
            [(a, a + n, [k]) for (a, n), k in zip(spans, ks)]
        for a, b, members in ranges:
            src = torch.empty(0, dtype=torch.uint8).set_(hosts[members[0]].untyped_storage(), a, (b - a,))
            copies.append(copy(src, device))
            for k in members:
                t, at = hosts[k], hosts[k].storage_offset() * hosts[k].element_size() - a
                views[k] = copies[-1][at:at + t.nbytes].view(t.dtype).view(t.shape)
    return views, copies


class DeltaState:
    """The sender's memory: the snapshot of the last version every engine acknowledged, and this sync's staging.

    A commit folds what the sync sent into the snapshot on a thread of its own (``fold_behind``), while the trainer
    goes on: on a GPU trainer the snapshot is host memory and the fold a host scatter of every changed element,
    seconds on a large model, which the sync's caller would otherwise wait for. Anything that reads the snapshot
    (:attr:`snapshot`) waits for that fold first."""

    def __init__(self, device: Optional[torch.device] = None, fold_behind: bool = True):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.link = HostLink(self.device)
        self.fold_behind = fold_behind
        self._snapshot: Dict[str, torch.Tensor] = {}
        self._folding: Optional[threading.Thread] = None
        self._fold_error: Optional[BaseException] = None
        self.version = 0  # committed: every engine acknowledged it (0 = nothing synced yet)
        self.staged: Dict[str, torch.Tensor] = {}  # positions sent by unacknowledged syncs (sorted int64)
        self._copies: Dict[str, torch.Tensor] = {}  # this sync's new params, whole
        self._sent: List[Tuple[List[str], List[int], torch.Tensor, torch.Tensor]] = []  # (names, counts, idx, values)
        self.elsewhere: frozenset = frozenset()  # names whose snapshot other processes keep (a trainer's shard ranks)

    @property
    def snapshot(self) -> Dict[str, torch.Tensor]:
        """The snapshot of :attr:`version`, its last commit folded in (waits for that)."""
        self.settle()
        return self._snapshot

    @snapshot.setter
    def snapshot(self, value: Dict[str, torch.Tensor]) -> None:
        self.settle()
        self._snapshot = value

    def settle(self) -> None:
        """Wait for the last commit's fold. If it failed, the snapshot is dropped (every param then has no base: a
        sender gives every engine a full sync) and this raises the failure, once."""
        folding, self._folding = self._folding, None
        if folding is not None:
            folding.join()
        error, self._fold_error = self._fold_error, None
        if error is not None:
            self._snapshot = {}
            raise DeltaError(f"folding version {self.version} into the snapshot failed: {error!r}")

    def host_bytes(self) -> int:
        """Host memory the snapshot holds (pinned on CUDA): each slab or own allocation once. Torch's pinned
        allocator rounds an allocation larger than a slab up to a power of two on top of this."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.snapshot.values()}
        return sum(storages.values())

    def changes(self, chunk: Chunk, bases: Sequence[Optional[torch.Tensor]], olds: bool = False) -> List[ChangeRun]:
        """What this sync must carry of a chunk's params (changed since the snapshot, plus positions staged by an
        unacknowledged sync) with the new values there, and with ``olds`` the snapshot's (``xor_zstd``), as
        ``diff.changes_many`` finds them: runs, ``ks`` indexing ``chunk``. A param without a snapshot (or one of
        another shape or dtype) is in none. One diff for the whole chunk."""
        news = list(map(operator.itemgetter(1), chunk))
        if not any(map(operator.is_, bases, itertools.repeat(None))) and like_pairs(bases, news):
            return changes_many(list(zip(bases, news)), [self.staged.get(name) for name, _ in chunk]
                                if self.staged else None, olds, alike=True)  # the usual chunk: all have their like
        diffable = [k for k, (t, b) in enumerate(zip(news, bases))
                    if b is not None and b.shape == t.shape and b.dtype == t.dtype]
        found = changes_many([(bases[k], news[k]) for k in diffable],
                             [self.staged.get(chunk[k][0]) for k in diffable] if self.staged else None, olds,
                             alike=True)
        for f in found:
            f.ks = [diffable[j] for j in f.ks]
        return found

    def record(self, chunk: Chunk, found: Sequence[ChangeRun]) -> None:
        """Keep what this sync sent of a chunk: the changed positions and values of each run in ``found`` (as
        :meth:`changes` returned it), and a full copy of every param in none (new). Positions and values go to the
        host off the default stream, one copy per dtype for the chunk: no synchronization and no copy per param.
        ``found``'s tensors are kept as they are (never changed)."""
        covered = set(itertools.chain.from_iterable(f.ks for f in found))
        for k, (name, tensor) in enumerate(chunk):
            if k not in covered and name not in self.elsewhere:
                self._copies[name] = self.link.host_copy(tensor)
        idxs = self.link.to_host_many([f.idx for f in found])
        kept = self.link.to_host_many([f.values for f in found])
        for f, idx, values in zip(found, idxs, kept):
            self._sent.append(([chunk[k][0] for k in f.ks], f.counts, idx, values))

    def commit(self, version: int) -> None:
        """Every engine acknowledged ``version``: fold what it sent into the snapshot (behind, see the class), one
        scatter per slab."""
        self.link.synchronize()
        self.snapshot.update(self._copies)
        sent, self._sent = self._sent, []
        self._copies.clear()
        self.staged.clear()
        self.version = version
        if not sent:
            return
        if not self.fold_behind:
            return self._fold(sent)
        self._folding = threading.Thread(target=self._fold_quietly, args=(sent,), name="delta-snapshot-fold",
                                         daemon=True)
        self._folding.start()

    def _fold_quietly(self, sent: list) -> None:
        try:
            self._fold(sent)
        except BaseException as e:  # noqa: BLE001 - raised by settle(), before the snapshot is read again
            self._fold_error = e

    def _fold(self, sent: list) -> None:
        folds: Dict[Tuple[int, torch.dtype], list] = {}
        snapshot = self._snapshot
        for names, counts, idx, values in sent:  # host memory on every device (pinned on CUDA)
            if not idx.numel():
                continue
            live = [k for k, n in enumerate(counts) if n]  # a run covers every param it compared, changed or not
            if len(live) < len(counts):
                names, counts = [names[k] for k in live], [counts[k] for k in live]
            snaps = [snapshot[n] for n in names]
            for run in _by_storage(snaps, counts, idx, values):
                folds.setdefault((run[0][0].untyped_storage().data_ptr(), values.dtype), []).append(run)
        for runs in folds.values():
            _fold(runs)

    def keep_elsewhere(self, names) -> None:
        """From now on other processes keep the snapshot of ``names`` (and re-send what an unacknowledged sync sent
        of them): they leave this one, which never copies them again."""
        self.settle()
        self.elsewhere = frozenset(names)
        for name in self.elsewhere:
            self._snapshot.pop(name, None)
            self.staged.pop(name, None)

    def stage(self) -> None:
        """Some engine did not acknowledge: the next sync re-sends these positions with current values."""
        self.link.synchronize()
        for names, counts, idx, _ in self._sent:
            for name, part in zip(names, idx.split(counts)):
                self.staged[name] = part
        self._copies.clear()
        self._sent.clear()


def _by_storage(snaps: List[torch.Tensor], counts: List[int], idx: torch.Tensor, values: torch.Tensor) -> list:
    """A recorded run cut where its snapshot tensors change storage (a slab boundary; usually none): runs of
    ``(snapshot tensors, counts, positions, values)`` whose tensors share one storage."""
    if len(snaps) == 1:
        return [(snaps, counts, idx, values)]
    ptrs = [s.untyped_storage().data_ptr() for s in snaps]
    out, at = [], 0
    for _, group in itertools.groupby(range(len(snaps)), key=ptrs.__getitem__):
        ks = list(group)
        n = sum(counts[k] for k in ks)
        out.append(([snaps[k] for k in ks], [counts[k] for k in ks], idx[at:at + n], values[at:at + n]))
        at += n
    return out


def _fold(runs) -> None:
    """``snap.view(-1)[idx] = values`` for the recorded runs of snapshot tensors of one storage and dtype, as one
    ``index_copy_`` into the storage (as integers of the same width: index kernels lack fp8 on some devices); a lone
    tensor's through its own view (its positions need no shift)."""
    snap = runs[0][0][0]
    iv = INT_VIEW[snap.element_size()]
    if all(s.is_contiguous() for r in runs for s in r[0]):
        groups = [list(runs)]
    else:  # a storage offset would not be an element's
        groups = [[([s], [n], i, v)] for snaps, counts, idx, values in runs
                  for s, n, i, v in zip(snaps, counts, idx.split(counts), values.split(counts))]
    storage = snap.untyped_storage()
    flat = torch.empty(0, dtype=iv).set_(storage, 0, (storage.nbytes() // snap.element_size(),))
    for group in groups:
        if len(group) == 1 and len(group[0][0]) == 1:
            (s,), _, idx, values = group[0]
            s.view(-1).view(iv).index_copy_(0, idx, values.view(iv))
            continue
        offsets = shifted_cat([r[2] for r in group], [s.storage_offset() for r in group for s in r[0]], flat.device,
                              [n for r in group for n in r[1]])
        flat.index_copy_(0, offsets, torch.cat([r[3].view(iv) for r in group]))
