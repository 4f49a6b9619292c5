"""One sync's working set on the sender: the diff per chunk, buckets, the one-step lookahead, flushes handed to
the transport, and the engines' results (:class:`~sender.DeltaSender` decides what a sync is; this runs it)."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta import fingerprint
from sglang.srt.weight_sync.delta.bucket import DeltaBucket
from sglang.srt.weight_sync.delta.ctx import codes as ctx_codes
from sglang.srt.weight_sync.delta.diff import ChangeRun, Prediffed, encode_flush
from sglang.srt.weight_sync.delta.snapshot import Chunk
from sglang.srt.weight_sync.delta.wire import (
    DeltaEncoding,
    DeltaError,
    DeltaPayload,
    nan_sentinel,
    sparse_allowed,
)

if TYPE_CHECKING:
    from sglang.srt.weight_sync.delta.sender import DeltaSender

logger = logging.getLogger(__name__)


class SyncRun:
    """The working set of one sync: buckets, the 1-step lookahead, flush counters, engine results."""

    def __init__(self, sender: "DeltaSender", version: int, delta_targets: List[int], full_targets: List[int],
                 encodings: Dict[str, str], fingerprint_on: bool = False, stored: frozenset = frozenset()):
        self.s, self.v, self.encodings = sender, version, encodings
        self.xor_raw = sender.status[delta_targets[0]].xor_raw if delta_targets else frozenset()
        self.dense = frozenset().union(*(sender.status[i].dense for i in delta_targets))
        self.fingerprints: Optional[Dict[str, "fingerprint.Pending"]] = {} if fingerprint_on else None
        self.found_shares: Optional[Dict[str, "fingerprint.NameSum"]] = None  # shares that came with Prediffed
        self.found_names: set = set()  # names whose changes came as Prediffed
        self.found_upto: Dict[str, int] = {}  # a name split in pieces: the end of the last piece's positions
        self.found_elsewhere: frozenset = frozenset()  # the names kept elsewhere when they came: the ranks' diff's
        self.fingerprint_s = 0.0  # trainer-side hashing, reported apart from encode
        self.shares: Optional[Dict[str, "fingerprint.NameSum"]] = None  # the fingerprint's per-name sums, once read
        self.targets = {"delta": delta_targets, "full": full_targets}
        bounds = [sender.status[i].max_request_bytes for i in delta_targets + full_targets]
        self.max_request = min([b for b in bounds if b], default=0)  # the engines' bound on one request
        cap = min(sender.buffer_bytes, self.max_request or sender.buffer_bytes)
        # stored: the kinds a version store takes whichever engines are pushed to (deltas, or an anchor)
        self.buckets = {k: DeltaBucket(encodings[k], cap) for k, t in self.targets.items() if t or k in stored}
        if encodings.get("delta") == DeltaEncoding.XOR_CTX.value and "delta" in self.buckets:
            self.buckets["delta"].base_of = self._whole_base
        self.flush = 0  # request index within the sync (shared by all files of one disk publish)
        self.final_segment = False
        self.held: Dict[str, DeltaPayload] = {}  # NCCL: each kind's last flush waits to learn whether it is final
        self.requests = {"delta": 0, "full": 0}  # NCCL: request index per kind (an engine gets one kind's requests)
        self.results: Dict[int, Tuple[bool, str]] = {}
        self.elements = self.nnz = self.wire_bytes = self.raw_bytes = self.flushes = 0
        # names only a speculative draft holds, on some engine (its status): their share of the values is a metric
        self.draft_names = frozenset().union(*(sender.status[i].draft for i in delta_targets + full_targets))
        self.draft_nnz = 0

    @property
    def gathers(self) -> bool:
        """Whether this sync needs params whole (some engine gets a full sync). A :class:`Prediffed` may still come
        for the delta targets: then its names' whole tensors go to the full targets only."""
        return "full" in self.buckets

    def pipeline_pass(self, chunks: Iterable[Chunk]) -> None:
        """Process chunk k while chunk k+1's snapshot is already on its way (CUDA); plain loop on CPU. An item that is
        a :class:`Prediffed` (changes found elsewhere) goes to the delta bucket as it is."""
        link, prev = self.s.state.link, None
        for chunk in chunks:
            if isinstance(chunk, Prediffed):  # in order: the chunk before it first
                if prev is not None:
                    self._process(*prev)
                    prev = None
                self.found_pass(chunk)
                continue
            chunk = list(chunk)
            handles = link.prefetch([self.s.state.snapshot.get(n) for n, _ in chunk], [t.device for _, t in chunk])
            if prev is not None:
                self._process(*prev)
            prev = (chunk, handles)
        if prev is not None:
            self._process(*prev)

    def _process(self, chunk: Chunk, handles) -> None:
        """One chunk: one diff, then per param only host bookkeeping (which bucket entry it extends, flush
        boundaries); tensors are cut per diff run, not per param."""
        state = self.s.state
        chunk = list(chunk)
        bases = state.link.ready(handles)
        xor = self.encodings.get("delta") == DeltaEncoding.XOR_ZSTD.value
        delta, full = self.buckets.get("delta"), self.buckets.get("full")
        if full is None and self.found_elsewhere and any(n in self.found_elsewhere for n, _ in chunk):
            raise DeltaError("a param kept elsewhere came whole in a sync without full targets")
        # xor_ctx codes a step from the base, never 0: re-sent positions back at the base (or a zero-based param
        # at zero) leave the flush, not the record
        still = delta is not None and self.encodings.get("delta") == DeltaEncoding.XOR_CTX.value and \
            bool(state.staged or not self.xor_raw.isdisjoint(n for n, _ in chunk))
        recorded = state.changes(chunk, bases, olds=xor or still)
        found = [f.moved([chunk[k][0] in self.xor_raw for k in f.ks]) for f in recorded] if still else recorded
        if full is None and delta is not None and self._whole(chunk, found, xor) and delta.add_chunk(chunk, found):
            self.elements += sum(t.numel() for _, t in chunk)  # the usual chunk of a delta sync: no call per param
            self.nnz += found[0].idx.numel()
            if self.draft_names:
                draft = self.draft_names
                self.draft_nnz += sum(c for k, c in zip(found[0].ks, found[0].counts) if chunk[k][0] in draft)
        else:
            self._params(chunk, found, bases, xor)
        state.record(chunk, recorded)
        if self.fingerprints is not None:  # hashed where the tensors live (on the GPU during training), per chunk
            t0 = time.perf_counter()
            self.fingerprints.update(fingerprint.tensor_shares(chunk))
            self.fingerprint_s += time.perf_counter() - t0

    def found_pass(self, found: Prediffed) -> None:
        """Changes found outside the sender into the delta bucket: per param only host bookkeeping (flush boundaries,
        spans of the run), no tensor op; nothing recorded, since their snapshot is kept where they were found. A
        param may come in pieces (``found.ranges``), each past the last; a piece never shares a flush with another
        piece of its param."""
        if "delta" not in self.buckets:
            raise DeltaError("every engine of this sync gets a full sync: changes found elsewhere have no target")
        ranges = found.ranges or {}
        for name, (lo, hi) in ranges.items():
            j = found.names.index(name) if name in found.names else -1
            if j < 0 or not 0 <= lo < hi <= math.prod(found.shapes[j]):
                raise DeltaError(f"changes of {name}: a piece of positions [{lo}, {hi}) it does not hold")
        again = self.found_names & set(found.names)
        for name in sorted(again):  # a later piece of a split name: past the last one, never over it
            if name not in ranges or ranges[name][0] < self.found_upto.get(name, 1 << 62):
                raise DeltaError(f"changes of {name} came twice in one sync")
        if not self.found_names:  # what the ranks diffed: a gathering sync re-maps them later, for the next sync
            self.found_elsewhere = self.s.state.elsewhere
        stray = [n for n in found.names if n not in self.found_elsewhere]
        if stray:  # its base is this sender's snapshot, which these changes would bypass
            raise DeltaError(f"changes of {stray[:3]} came as found elsewhere, but this sender keeps their base itself")
        self.found_names.update(found.names)
        self.found_upto.update((name, hi) for name, (_, hi) in ranges.items())
        delta, f = self.buckets.get("delta"), found.run
        xor = self.encodings.get("delta") == DeltaEncoding.XOR_ZSTD.value
        dtype = f.values.dtype
        if not sparse_allowed(dtype) or not (nan_sentinel(dtype) or self.dense.isdisjoint(found.names)):
            raise DeltaError(f"params {found.names[:3]}: {dtype} changes found elsewhere cannot travel sparse to "
                             "these engines")
        if xor and f.olds is None:
            raise DeltaError("xor_zstd needs base_version's values of changes found elsewhere (olds)")
        ctx = self.encodings.get("delta") == DeltaEncoding.XOR_CTX.value
        if ctx and f.idx.numel() and (f.facts is None or f.olds is None or not ctx_codes(dtype)):
            raise DeltaError(f"params {found.names[:3]}: xor_ctx changes found elsewhere need their classes' facts "
                             f"and base values, and a dtype it codes ({dtype})")
        if self.fingerprints is not None:
            if found.shares is None:
                raise DeltaError("this sync checks fingerprints: changes found elsewhere need their shares")
            self.found_shares = {**(self.found_shares or {}), **found.shares}
        for j, (name, shape) in enumerate(zip(found.names, found.shapes)):
            n = f.counts[j]
            self.elements += 0 if name in again else math.prod(shape)
            self.nnz += n
            self.draft_nnz += n if name in self.draft_names else 0
            if delta is None:
                continue
            if delta.should_flush(name) or (name in again and delta.holds(name)):  # a flush names a param once
                self._flush("delta")
            if not n:
                continue
            if (xor or ctx) and name in self.xor_raw:  # no engine rank stores it: XOR (or steps) against zero
                idx, values, _ = f.share(j)
                delta.add(name, torch.empty(shape, dtype=dtype, device="meta"), idx,
                          torch.zeros_like(values) if xor else None, values)
            else:
                delta.add_found(f, j, name, list(shape))

    def _params(self, chunk: Chunk, found: Sequence[ChangeRun], bases, xor: bool) -> None:
        """A chunk's params into the buckets one by one: flush boundaries, dense params, ``xor_raw`` ones."""
        delta, full = self.buckets.get("delta"), self.buckets.get("full")
        member: Dict[int, Tuple[ChangeRun, int]] = {k: (f, j) for f in found for j, k in enumerate(f.ks)}
        sparse_dtypes: Dict[torch.dtype, Tuple[bool, bool]] = {}
        for k, (name, tensor) in enumerate(chunk):
            if name in self.found_elsewhere:  # the delta targets had its changes (or none) from elsewhere
                if full.should_flush(name):
                    self._flush("full")
                full.add(name, tensor, None)
                continue
            f, j = member.get(k, (None, 0))
            n = tensor.numel() if f is None else f.counts[j]
            self.elements += tensor.numel()
            self.nnz += n
            self.draft_nnz += n if name in self.draft_names else 0
            for kind, bucket in self.buckets.items():
                if bucket.should_flush(name):
                    self._flush(kind)
            if delta is not None and n:  # an unchanged param is left out of the spec
                dtype = tensor.dtype
                if dtype not in sparse_dtypes:
                    sparse_dtypes[dtype] = (sparse_allowed(dtype), nan_sentinel(dtype))
                allowed, sentinel = sparse_dtypes[dtype]
                sparse = f is not None and allowed and (sentinel or name not in self.dense)
                if sparse and not (xor and name in self.xor_raw):
                    delta.add_found(f, j, name, list(tensor.shape))
                else:
                    idx, values, old = f.share(j) if sparse else (None, None, None)
                    delta.add(name, tensor, idx, self._xor_base(name, tensor, bases[k], idx, old), values)
            if full is not None:
                full.add(name, tensor, None)

    def _whole(self, chunk: Chunk, found: Sequence[ChangeRun], xor: bool) -> bool:
        """Whether every param of a one-run chunk goes sparse into the delta bucket, as the loop in :meth:`_process`
        would decide param by param: its dtype travels sparse, no engine keeps one of its names dense, and none is
        ``xor_raw`` when the encoding is ``xor_zstd``."""
        if len(found) != 1:
            return False
        dtype = found[0].values.dtype
        names = [n for n, _ in chunk]
        return sparse_allowed(dtype) and (nan_sentinel(dtype) or self.dense.isdisjoint(names)) and \
            not (xor and not self.xor_raw.isdisjoint(names))

    def _whole_base(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """xor_ctx: base_version's whole tensor of a param, flat: the snapshot's (folded only at commit, after every
        flush of the sync), or zero for a name no engine rank stores (``xor_raw``), as the engines read it."""
        base = None if name in self.xor_raw else self.s.state.snapshot.get(name)
        if base is None or base.numel() != numel or base.dtype != dtype:
            return torch.zeros((), dtype=dtype).expand(numel)
        return base.reshape(-1)

    def _xor_base(self, name: str, tensor: torch.Tensor, base: Optional[torch.Tensor],
                  idx: Optional[torch.Tensor], at_idx: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """xor_zstd: base_version's values where this delta sends values (zero for a name the engines never store
        or one without a snapshot, which the engines' manifest refuses anyway); ``at_idx``: the snapshot's values
        at ``idx``, as the diff gathered them."""
        if self.encodings.get("delta") != DeltaEncoding.XOR_ZSTD.value:
            return None
        if base is None or name in self.xor_raw:
            return torch.zeros(tensor.numel() if idx is None else idx.numel(), dtype=tensor.dtype, device=tensor.device)
        return base.reshape(-1) if idx is None else at_idx

    def _spec_fields(self, kind: str, final: bool) -> dict:
        full = kind == "full"
        base = self.v if full else self.s.state.version
        stages = self.s.stages
        return dict(full=full, base_version=base, version=self.v, flush=self.flush, final=final,
                    source=stages.rank if stages else 0, sources=stages.size if stages else 1)

    def _flush(self, kind: str) -> None:
        bucket = self.buckets[kind]
        if not len(bucket):
            return
        t = self.s.transport
        for payload in bucket.take(**self._spec_fields(kind, self.final_segment)):
            self.flushes += 1
            self.raw_bytes += payload.positions.numel() + payload.values.numel() * payload.values.element_size()
            if getattr(t, "shared_group", False):
                if kind in self.held:
                    self._release(kind, final=False)
                self.held[kind] = payload
            else:
                t.write(payload, kind)  # bytes are counted by the transport once written

    def _release(self, kind: str, final: bool) -> None:
        payload = self.held.pop(kind)
        payload.spec.flush, payload.spec.final = self.requests[kind], final
        payload.spec.part, payload.spec.last_part = 0, True  # one file per broadcast request
        payload.seal(spec_only=True)
        nbytes = payload.positions.numel() + payload.values.numel() * payload.values.element_size()
        if self.max_request and nbytes > self.max_request:  # declaring it would be refused unreceived
            raise DeltaError(f"a flush of {nbytes} bytes exceeds the engines' max_request_bytes "
                             f"{self.max_request} (one param larger than an engine rank's bound)")
        self.wire_bytes += nbytes
        self._collect(self.s.transport.send(payload, self.targets[kind], kind))
        self.requests[kind] += 1

    def flush_and_publish(self) -> None:
        """End of a segment: flush the buckets and tell the engines (disk) — every target kind gets a request,
        empty if nothing changed, so flush indices stay aligned and the final request always arrives."""
        final = self.final_segment
        for kind in list(self.buckets):
            self._flush(kind)
        t = self.s.transport
        if getattr(t, "shared_group", False):
            for kind in self.buckets if final else ():  # every kind's final request, empty if nothing is held
                if kind not in self.held:
                    self.held[kind] = encode_flush([], self.encodings[kind], bases=[], **self._spec_fields(kind, True))
                self._release(kind, final=True)
            return
        for kind in self.buckets:
            if not t.pending(kind):
                t.write(encode_flush([], self.encodings[kind], bases=[], **self._spec_fields(kind, final)), kind)
        t.publish({k: v for k, v in self.targets.items() if v})
        self.flush += 1

    def _collect(self, results: Dict[int, Tuple[bool, str]]) -> None:
        for i, (ok, msg) in results.items():
            if i not in self.results or (self.results[i][0] and not ok):
                self.results[i] = (ok, msg)

    def finish(self) -> Dict[int, Tuple[bool, str]]:
        self._say_over()
        t = self.s.transport
        if not getattr(t, "shared_group", False):
            self._collect(t.collect())
            self.wire_bytes += t.wire_bytes
        for i in self.targets["delta"] + self.targets["full"]:
            self.results.setdefault(i, (False, "transport: no request reached this engine"))
        return self.results

    def _say_over(self) -> None:
        """Params larger than the flush bound by themselves travelled as flushes of their own: a warning, when the
        largest is larger than any said before (the engines hold a flush at once, so it is their memory too)."""
        overs = [b.over for b in self.buckets.values() if b.over[0]]
        if not overs:
            return
        count, (_, largest, name) = sum(o[0] for o in overs), max(overs, key=lambda o: o[1])
        if largest > self.s.said_over:
            self.s.said_over = largest
            bound = next(iter(self.buckets.values())).max_bytes
            logger.warning("delta sync v%d: %d param(s) larger than the flush bound (%d B: --update-weight-buffer-size "
                           "or the engines' bound on a request) travelled as flushes of their own, up to %d B (%s); "
                           "a flush is raised to hold one param, never split", self.v, count, bound, largest, name)

    def metrics(self, t_encode: float, t_finalize: float) -> Dict[str, float]:
        p = "perf/update_weights_"
        m = {p + "version": float(self.v), p + "density": self.nnz / max(1, self.elements),
             p + "wire_bytes": float(self.wire_bytes), p + "flushes": float(self.flushes),
             p + "encode_s": t_encode, p + "finalize_s": t_finalize,
             p + "full_sync_engines": float(len(self.targets["full"]))}
        if self.draft_names:  # a speculative draft's own layer: its share of the values sent
            m[p + "draft_share"] = self.draft_nnz / max(1, self.nnz)
        if self.wire_bytes:
            m[p + "compression_ratio"] = self.raw_bytes / self.wire_bytes
        link = self.s.state.link
        m[p + "h2d_bytes"], m[p + "d2h_bytes"] = float(link.h2d_bytes), float(link.d2h_bytes)
        return m
