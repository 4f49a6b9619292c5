"""Sender core of delta weight sync: one sync over segments of chunks, engines' status, and ack before advance.

Framework-agnostic (slime's updater subclass feeds it HF ``(name, tensor)`` chunks; tests feed it a
transformers model): :class:`DeltaSender` runs one sync over segments of chunks and a transport.

Contract:

* The snapshot (:class:`DeltaState`) holds the last version **every** engine acknowledged. A sync
  sends, per param, the positions whose bytes differ from it plus every position staged by
  still-unacknowledged syncs, with current values — so each request is correct for an engine at
  any version in ``[base_version, version)`` (overwrite semantics). The snapshot advances only
  after every engine acknowledged the whole sync; otherwise the positions stay staged.
* What an engine gets next is decided from its structured status (``engine.status()``: every TP
  rank's :class:`~wire.DeltaStatus`), read before the first sync and after any failed request, never
  from a message: a full sync (every param dense) when it is fresh, dirty or loaded outside the chain,
  when its ranks disagree, when its committed version is outside what the next delta serves, or when
  it cannot answer; otherwise the next delta. That engine alone gets the full sync: over disk as its own
  files, over a shared NCCL group as broadcasts the others receive without applying. An engine ahead of
  this sender (it outlived a trainer restart) moves the chain above its version.
* Failures are never swallowed: logged, counted in :meth:`DeltaSender.pop_metrics`, acted on.

The snapshot and its host<->device traffic live in :mod:`snapshot`, the bucket in :mod:`bucket`, the diff and a
flush's encode in :mod:`diff`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta import fingerprint
from sglang.srt.weight_sync.delta.collectives import StageGroup
from sglang.srt.weight_sync.delta.bucket import DeltaBucket
from sglang.srt.weight_sync.delta.diff import ChangeRun, encode_flush
from sglang.srt.weight_sync.delta.ops import gc_paused
from sglang.srt.weight_sync.delta.snapshot import Chunk, DeltaState
from sglang.srt.weight_sync.delta.wire import (
    WIRE_FORMAT,
    DeltaEncoding,
    DeltaError,
    DeltaPayload,
    DeltaStatus,
    Refusal,
    nan_sentinel,
    sparse_allowed,
)

logger = logging.getLogger(__name__)

_EXPERT_SUBPASSES = 4  # expert params are published in this many segments so apply overlaps encode



# ---------------------------------------------------------------- engines and results


@dataclasses.dataclass
class EngineStatus:
    """What the sender knows of one engine."""

    version: Optional[int] = None  # last version it acknowledged
    needs_full: bool = True
    last_error: str = ""
    max_request_bytes: int = 0  # from the engine's DeltaStatus (0: not known yet)
    xor: bool = False  # every rank can rebuild xor_zstd values (and did not refuse them for want of a base)
    xor_raw: frozenset = frozenset()  # names no rank stores: xor_zstd sends them raw (XOR zero)
    dense: frozenset = frozenset()  # names some rank can take only dense (fp8 without recorded views)
    wire_formats: frozenset = frozenset()  # the spec layouts its ranks read (empty: not known yet)
    unsupported: bool = False  # a rank refused its last request as code 'unsupported': no sync can help


def _engine_ranks(engine) -> List[DeltaStatus]:
    """Every rank's structured status of one engine (``engine.status()``: ``/weights_checker`` ``delta_status``)."""
    ranks = list(engine.status())
    if not ranks:
        raise DeltaError("the engine reported no ranks")
    return ranks


class DeltaSender:
    """Runs syncs: diff against the snapshot, encode, bucket, hand flushes to a transport, commit on full ack.

    ``transport`` implements ``begin(version)`` and either, with ``shared_group = True`` (one
    broadcast reaches every engine), ``send(payload, targets) -> results`` — one request per flush —
    or ``write(payload, kind)``, ``pending(kind)``, ``publish(targets_by_kind)``, ``collect() -> results``
    and ``wire_bytes`` (disk: files per segment, one announcement per publish). Chunk tensors must
    stay unchanged until :meth:`update` returns (slime hands over clones).
    """

    def __init__(self, transport, engines: Sequence, encoding: str = "deltas", buffer_bytes: int = 512 << 20,
                 device: Optional[torch.device] = None, fingerprint_every: int = 0,
                 stages: Optional[StageGroup] = None):
        self.encoding = DeltaEncoding(encoding).value
        self.buffer_bytes = buffer_bytes
        self.state = DeltaState(device)
        self.version = 0  # last sync attempted
        self._metrics: Dict[str, float] = {}
        self._counters = dict.fromkeys(("failures", "resyncs", "fingerprint_mismatches", "snapshot_fold_failures"), 0)
        self.fingerprint_every = fingerprint_every  # check engines' weight fingerprints every K syncs (0: never)
        self.attach(transport, engines, stages)

    def attach(self, transport, engines: Sequence, stages: Optional[StageGroup] = None) -> None:
        """Send through ``transport`` to ``engines`` from now on, keeping the snapshot and the version chain (slime
        re-connects its engines after one restarted, and around an offload): every engine's status is asked again,
        so only an engine that needs one gets a full sync."""
        if getattr(transport, "shared_group", False) and DeltaEncoding(self.encoding).disk_only:
            raise DeltaError(f"{self.encoding} compresses files: it is disk-only (use 'indices' or 'deltas' over nccl)")
        # pipeline stages: stage 0 decides, every stage sends its own layers (a DiskTransport's stages by default)
        stages = stages if stages is not None else getattr(transport, "stages", None)
        if getattr(transport, "stages", stages) is not stages:
            raise DeltaError("the sender and its disk transport must share one StageGroup")
        self.transport, self.engines, self.stages = transport, list(engines), stages
        # without a snapshot every engine starts with a full sync; with one, each engine's own status decides
        self.status: Dict[int, EngineStatus] = {i: EngineStatus(needs_full=not self.state.snapshot)
                                                for i in range(len(self.engines))}

    # -- one sync -------------------------------------------------------------

    def _learn(self, engines: Sequence[int]) -> None:
        """Ask engines for their structured status and decide on its fields alone: an engine that refuses deltas
        (fresh, dirty, loaded outside the chain), whose ranks disagree, or whose committed version the next
        delta cannot serve gets a full sync; an engine ahead of this sender (a restarted trainer) moves the
        chain above its version. An engine that cannot answer gets a full sync."""
        for i in engines:
            st = self.status[i]
            try:
                ranks = _engine_ranks(self.engines[i])
            except Exception as e:
                st.needs_full = True
                logger.warning("engine %d: no delta status (%r); full sync next", i, e)
                continue
            st.wire_formats = frozenset(r.wire_format for r in ranks)
            versions = {r.version for r in ranks}
            known = [v for v in versions if v is not None]
            st.max_request_bytes = min(r.max_request_bytes for r in ranks)
            if known and max(known) > self.version:
                self.version = max(known)  # the engine outlived a trainer restart: continue its chain
            st.version = known[0] if len(versions) == 1 and known else None
            st.needs_full = st.needs_full or any(r.needs_full for r in ranks) or st.version is None \
                or not (self.state.version <= st.version <= self.version)
            st.xor = all(r.xor for r in ranks) and not any(r.code == Refusal.NO_BASE.value for r in ranks)
            st.xor_raw = frozenset.intersection(*(frozenset(r.xor_raw) for r in ranks))
            st.dense = frozenset().union(*(r.dense for r in ranks))
            st.unsupported = any(r.code == Refusal.UNSUPPORTED.value for r in ranks)

    def update(self, segments: Sequence[Callable[[], Iterable[Chunk]]]) -> Dict[int, Tuple[bool, str]]:
        """One sync over ``segments`` (callables yielding chunks of HF ``(name, tensor)``); publishes after each."""
        with gc_paused():
            return self._update(segments)

    def _update(self, segments: Sequence[Callable[[], Iterable[Chunk]]]) -> Dict[int, Tuple[bool, str]]:
        try:
            self.state.settle()
            fold_failed = 0
        except DeltaError:  # the snapshot is gone: every engine gets a full sync, which makes it again
            logger.exception("the last sync's snapshot fold failed: full syncs now")
            fold_failed = 1
            for st in self.status.values():
                st.needs_full = True
        if self.stages is None or self.stages.first:
            unknown = [i for i, s in self.status.items() if not s.max_request_bytes]
            if unknown:
                self._learn(unknown)
        if self.stages is not None:
            self._adopt(self.stages.share(self._plan() if self.stages.first else None))
        odd = {i: sorted(s.wire_formats) for i, s in self.status.items() if s.wire_formats - {WIRE_FORMAT}}
        if odd:  # every stage sees it in the shared plan and stops here, before anything is sent
            for i in odd:
                self.status[i].max_request_bytes = 0  # ask again next time: the engine may have been upgraded
            raise DeltaError(f"engines read delta wire formats {odd} (engine: formats), this sender writes format "
                             f"{WIRE_FORMAT}: run one patch set on the trainer and the engines", Refusal.UNSUPPORTED)
        refused = {i: s.last_error for i, s in self.status.items() if s.unsupported}
        if refused:  # a condition of the engine's (its configuration, its model): retrying would refuse forever
            for i in refused:
                self.status[i].max_request_bytes = 0  # ask again next time: the engine may have been restarted
            raise DeltaError("; ".join(f"engine {i} cannot take delta weight updates: {why}"
                                       for i, why in refused.items()), Refusal.UNSUPPORTED)
        v = self.version + 1
        self.version = v
        full_targets = [i for i, s in self.status.items() if s.needs_full]
        delta_targets = [i for i in self.status if i not in full_targets]
        resyncs = sum(self.status[i].version is not None for i in full_targets)  # engines synced before
        t0 = time.perf_counter()
        run = _SyncRun(self, v, delta_targets, full_targets, self._encodings(delta_targets),
                       fingerprint_on=bool(self.fingerprint_every) and v % self.fingerprint_every == 0)
        paused = []
        try:
            try:
                for e in self.engines:  # no forward pass sees a sync half-applied (slime pauses on its own)
                    if hasattr(e, "pause_generation"):
                        try:
                            e.pause_generation()
                            paused.append(e)
                        except Exception:  # an unreachable engine fails its own requests below
                            logger.exception("pause_generation failed")
                self.transport.begin(v)
                for k, segment in enumerate(segments):
                    run.final_segment = k == len(segments) - 1
                    run.pipeline_pass(segment())
                    run.flush_and_publish()
                t_encode = time.perf_counter() - t0 - run.fingerprint_s
                results = run.finish()
            except Exception as e:  # what reached which engine is unknown: every engine gets a full sync next
                logger.exception("delta sync v%d aborted", v)
                t_encode = time.perf_counter() - t0 - run.fingerprint_s
                results = {i: (False, f"transport: sync aborted: {e!r}") for i in self.status}
            finally:
                if self.stages is not None:  # every stage's part is done before any engine serves again
                    results = self._combine(results)
            t_finalize = time.perf_counter() - t0 - t_encode - run.fingerprint_s
            acked = [i for i, (ok, _) in results.items() if ok]
            failed = [i for i in results if i not in acked]
            for i in acked:
                self.status[i].version, self.status[i].needs_full, self.status[i].last_error = v, False, ""
            if len(acked) == len(self.engines):
                self.state.commit(v)
            else:
                self.state.stage()
            # what a full sync let an engine write directly (xor bases, byte-sparse params) only its status says
            relearn = [i for i in acked if i in full_targets]
            if self.stages is None or self.stages.first:  # the other stages adopt stage 0's view at the next sync
                self._learn(failed + relearn)
            for i in failed:
                st = self.status[i]
                st.last_error = results[i][1]
                logger.error("delta sync v%d failed on engine %d (%s): %s", v, i,
                             "full sync next" if st.needs_full else "next delta covers it", results[i][1])
            self._metrics = run.metrics(t_encode, t_finalize)
            self._metrics["perf/update_weights_xor"] = float(run.encodings.get("delta") == DeltaEncoding.XOR_ZSTD.value)
            self._count("failures", len(failed))
            self._count("snapshot_fold_failures", fold_failed)
            self._count("resyncs", resyncs)
            self._count("fingerprint_mismatches", 0)
            timings = getattr(self.transport, "timings", None)
            if timings is not None:
                self._metrics.update({f"perf/update_weights_{k}": v for k, v in timings().items()})
            if run.fingerprints is not None and len(acked) == len(self.engines):
                self._check_fingerprints(run.fingerprints, results, run.fingerprint_s)
        finally:  # a fingerprint sync's check runs while paused: no request competes with it
            for e in paused:
                try:
                    e.continue_generation()
                except Exception:  # the engine's own failure shows in its result; keep the others going
                    logger.exception("continue_generation failed")
        return results

    def _plan(self) -> dict:
        """What every stage must agree on before a sync: the version chain and each engine's status."""
        return {"version": self.version, "status": {str(i): {k: sorted(v) if isinstance(v, frozenset) else v
                                                             for k, v in dataclasses.asdict(st).items()}
                                                    for i, st in self.status.items()}}

    def _adopt(self, plan: dict) -> None:
        self.version = plan["version"]
        for i, fields in plan["status"].items():
            self.status[int(i)] = EngineStatus(**{k: frozenset(v) if isinstance(v, list) else v
                                                  for k, v in fields.items()})

    def _combine(self, results: Dict[int, Tuple[bool, str]]) -> Dict[int, Tuple[bool, str]]:
        """An engine took a sync only if every stage's part of it was taken."""
        shared = self.stages.exchange({str(i): list(r) for i, r in results.items()})
        out = {}
        for i in results:
            failed = [(k, r[str(i)][1]) for k, r in enumerate(shared) if not r.get(str(i), [False])[0]]
            out[i] = (True, results[i][1]) if not failed else (False, f"pipeline stage {failed[0][0]}: {failed[0][1]}")
        return out

    def _encodings(self, delta_targets: List[int]) -> Dict[str, str]:
        """Per sync kind. ``xor_zstd`` only when every delta target is committed at the snapshot's version, can
        rebuild from its views and names the same raw params; otherwise that sync's deltas are ``planes_zstd``
        (overwrite semantics: right for any engine in range). Full syncs have no base: ``planes_zstd``."""
        if self.encoding != DeltaEncoding.XOR_ZSTD.value:
            return {"delta": self.encoding, "full": self.encoding}
        sts = [self.status[i] for i in delta_targets]
        xor = bool(sts) and all(st.xor and st.version == self.state.version and st.xor_raw == sts[0].xor_raw
                                for st in sts)
        planes = DeltaEncoding.PLANES_ZSTD.value
        return {"delta": self.encoding if xor else planes, "full": planes}

    def _check_fingerprints(self, pending: Dict[str, "fingerprint.Pending"], results, hashing_s: float) -> None:
        """Every engine's fingerprint of this version against the trainer's; a mismatch means a full sync next."""
        t0, uncovered, mismatch = time.perf_counter(), set(), {}
        mine = fingerprint.read_shares(pending)  # the trainer's hashes, read once for all params
        for i, engine in enumerate(self.engines):
            try:
                theirs = fingerprint.merge_ranks(fingerprint.check_version(engine.fingerprint(), self.version))
                differ, missing = fingerprint.compare_shares(mine, theirs, self.state.snapshot)
            except Exception as e:  # an engine that cannot show its weights is not trusted either
                differ, missing = [f"(no fingerprint: {e!r})"], []
            uncovered.update(missing)
            if differ:
                mismatch[i] = (f"fingerprint mismatch after version {self.version} on {len(differ)} "
                               f"param(s), e.g. {differ[:3]}: the engine needs a full sync")
        if self.stages is not None:  # a stage checks its own layers; a mismatch on any stage is the engine's
            for k, theirs in enumerate(self.stages.exchange({str(i): m for i, m in mismatch.items()})):
                for i, m in theirs.items():
                    mismatch.setdefault(int(i), f"pipeline stage {k}: {m}")
        for i, msg in sorted(mismatch.items()):
            self._count("fingerprint_mismatches", 1)
            self.status[i].needs_full = True
            results[i] = (False, msg)
            logger.error("delta sync v%d: engine %d %s", self.version, i, msg)
        p = "perf/update_weights_"
        self._metrics[p + "fingerprint_s"] = hashing_s + time.perf_counter() - t0
        self._metrics[p + "fingerprint_uncovered"] = float(len(uncovered))
        if uncovered:
            logger.warning("fingerprint cannot cover %d param(s) the engines' loaders transform, e.g. %s",
                           len(uncovered), sorted(uncovered)[:3])

    def _count(self, name: str, n: int) -> None:
        """This sync's count (``perf/update_weights_<name>``) and the run's (``..._<name>_total``)."""
        key = f"perf/update_weights_{name}"
        self._metrics[key] = self._metrics.get(key, 0.0) + n
        self._counters[name] += n

    def pop_metrics(self) -> Dict[str, float]:
        """The last sync's metrics (engines failed, re-synced, fingerprint mismatches: in that sync) and the
        running totals since this sender started (``…_total``)."""
        out = dict(self._metrics)
        for name, n in self._counters.items():
            out[f"perf/update_weights_{name}_total"] = float(n)
        self._metrics = {}
        return out


class _SyncRun:
    """The working set of one sync: buckets, the 1-step lookahead, flush counters, engine results."""

    def __init__(self, sender: DeltaSender, version: int, delta_targets: List[int], full_targets: List[int],
                 encodings: Dict[str, str], fingerprint_on: bool = False):
        self.s, self.v, self.encodings = sender, version, encodings
        self.xor_raw = sender.status[delta_targets[0]].xor_raw if delta_targets else frozenset()
        self.dense = frozenset().union(*(sender.status[i].dense for i in delta_targets))
        self.fingerprints: Optional[Dict[str, "fingerprint.Pending"]] = {} if fingerprint_on else None
        self.fingerprint_s = 0.0  # trainer-side hashing, reported apart from encode
        self.targets = {"delta": delta_targets, "full": full_targets}
        bounds = [sender.status[i].max_request_bytes for i in delta_targets + full_targets]
        self.max_request = min([b for b in bounds if b], default=0)  # the engines' bound on one request
        cap = min(sender.buffer_bytes, self.max_request or sender.buffer_bytes)
        self.buckets = {k: DeltaBucket(encodings[k], cap) for k, t in self.targets.items() if t}
        self.flush = 0  # request index within the sync (shared by all files of one disk publish)
        self.final_segment = False
        self.held: Dict[str, DeltaPayload] = {}  # NCCL: each kind's last flush waits to learn whether it is final
        self.requests = {"delta": 0, "full": 0}  # NCCL: request index per kind (an engine gets one kind's requests)
        self.results: Dict[int, Tuple[bool, str]] = {}
        self.elements = self.nnz = self.wire_bytes = self.raw_bytes = self.flushes = 0

    def pipeline_pass(self, chunks: Iterable[Chunk]) -> None:
        """Process chunk k while chunk k+1's snapshot is already on its way (CUDA); plain loop on CPU."""
        link, prev = self.s.state.link, None
        for chunk in chunks:
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
        found = state.changes(chunk, bases, olds=xor)
        delta, full = self.buckets.get("delta"), self.buckets.get("full")
        if full is None and delta is not None and self._whole(chunk, found, xor) and delta.add_chunk(chunk, found):
            self.elements += sum(t.numel() for _, t in chunk)  # the usual chunk of a delta sync: no call per param
            self.nnz += found[0].idx.numel()
        else:
            self._params(chunk, found, bases, xor)
        state.record(chunk, found)
        if self.fingerprints is not None:  # hashed where the tensors live (on the GPU during training), per chunk
            t0 = time.perf_counter()
            self.fingerprints.update(fingerprint.tensor_shares(chunk))
            self.fingerprint_s += time.perf_counter() - t0

    def _params(self, chunk: Chunk, found: Sequence[ChangeRun], bases, xor: bool) -> None:
        """A chunk's params into the buckets one by one: flush boundaries, dense params, ``xor_raw`` ones."""
        delta, full = self.buckets.get("delta"), self.buckets.get("full")
        member: Dict[int, Tuple[ChangeRun, int]] = {k: (f, j) for f in found for j, k in enumerate(f.ks)}
        sparse_dtypes: Dict[torch.dtype, Tuple[bool, bool]] = {}
        for k, (name, tensor) in enumerate(chunk):
            f, j = member.get(k, (None, 0))
            n = tensor.numel() if f is None else f.counts[j]
            self.elements += tensor.numel()
            self.nnz += n
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
        self._collect(self.s.transport.send(payload, self.targets[kind]))
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
        t = self.s.transport
        if not getattr(t, "shared_group", False):
            self._collect(t.collect())
            self.wire_bytes += t.wire_bytes
        for i in self.targets["delta"] + self.targets["full"]:
            self.results.setdefault(i, (False, "transport: no request reached this engine"))
        return self.results

    def metrics(self, t_encode: float, t_finalize: float) -> Dict[str, float]:
        p = "perf/update_weights_"
        m = {p + "version": float(self.v), p + "density": self.nnz / max(1, self.elements),
             p + "wire_bytes": float(self.wire_bytes), p + "flushes": float(self.flushes),
             p + "encode_s": t_encode, p + "finalize_s": t_finalize,
             p + "full_sync_engines": float(len(self.targets["full"]))}
        if self.wire_bytes:
            m[p + "compression_ratio"] = self.raw_bytes / self.wire_bytes
        link = self.s.state.link
        m[p + "h2d_bytes"], m[p + "d2h_bytes"] = float(link.h2d_bytes), float(link.d2h_bytes)
        return m
