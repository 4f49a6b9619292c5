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
* An engine a sync left with wrong weights (a write failed after others landed: dirty; or its fingerprint differs)
  gets its full sync at once, before the engines resume generation (``repair_dirty``), so no request is served by a
  half-written model; a caller whose segments run collectives on other ranks (slime) repairs in step with them.
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
from sglang.srt.weight_sync.delta.ctx import codes as ctx_codes
from sglang.srt.weight_sync.delta.engine_api import DeltaEngine
from sglang.srt.weight_sync.delta.ops import gc_paused
from sglang.srt.weight_sync.delta.snapshot import Chunk, DeltaState
from sglang.srt.weight_sync.delta.stage_first import Pauses
from sglang.srt.weight_sync.delta.store.objects import HeadMoved
from sglang.srt.weight_sync.delta.sync_run import SyncRun
from sglang.srt.weight_sync.delta.wire import (
    WIRE_FORMAT,
    DeltaEncoding,
    DeltaError,
    DeltaStatus,
    Refusal,
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
    ctx: bool = False  # every rank can decode xor_ctx (and none refused it for want of a base)
    dense: frozenset = frozenset()  # names some rank can take only dense (fp8 without recorded views)
    wire_formats: frozenset = frozenset()  # the spec layouts its ranks read (empty: not known yet)
    unsupported: bool = False  # a rank refused its last request as code 'unsupported': no sync can help
    dirty: bool = False  # its weights are known wrong: a write failed after others landed, or its fingerprint differs
    draft_unwritten: int = 0  # its speculative draft's own params its last full sync wrote nothing into
    draft: frozenset = frozenset()  # names only its speculative draft holds (the draft's own layer)


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

    def __init__(self, transport, engines: Sequence[DeltaEngine], encoding: str = "deltas",
                 buffer_bytes: int = 512 << 20, device: Optional[torch.device] = None, fingerprint_every: int = 0,
                 stages: Optional[StageGroup] = None, repair_dirty: bool = True, anchor_every: int = 0,
                 draft_trained: bool = False):
        self.encoding = DeltaEncoding(encoding).value
        self.draft_trained = draft_trained  # the trainer trains the engines' draft layers (--enable-mtp-training)
        self.buffer_bytes = buffer_bytes
        self.state = DeltaState(device)
        self.version = 0  # last sync attempted
        self._metrics: Dict[str, float] = {}
        self._counters = dict.fromkeys(("failures", "resyncs", "repairs", "fingerprint_mismatches",
                                        "snapshot_fold_failures", "catch_ups"), 0)
        self.repair_dirty = repair_dirty
        self.left_dirty: List[int] = []  # engines the last sync left with wrong weights (dirty, or a fingerprint)
        self.run: Optional[SyncRun] = None  # the sync in progress (its segments may read what it sends whom)
        self.fingerprint_every = fingerprint_every  # check engines' weight fingerprints every K syncs (0: never)
        self.anchor_every = anchor_every  # a version store: the trainer also writes an anchor every K versions
        self.said_over = 0  # the largest param above the flush bound a warning named (SyncRun._say_over)
        # a caller that pauses the engines itself (slime) resumes those pushed to through this once they took the
        # version, before a store's commit and the catch-ups: ``release(engine indices)`` (None: the sender's own)
        self.release: Optional[Callable[[Sequence[int]], None]] = None
        self.attach(transport, engines, stages)

    def attach(self, transport, engines: Sequence[DeltaEngine], stages: Optional[StageGroup] = None) -> None:
        """Send through ``transport`` to ``engines`` from now on, keeping the snapshot and the version chain (slime
        re-connects its engines after one restarted, and around an offload): every engine's status is asked again,
        so only an engine that needs one gets a full sync."""
        if getattr(transport, "shared_group", False) and DeltaEncoding(self.encoding).disk_only:
            raise DeltaError(f"{self.encoding} compresses files: it is disk-only (use 'indices' or 'deltas' over nccl)")
        # pipeline stages: stage 0 decides, every stage sends its own layers (a DiskTransport's stages by default)
        stages = stages if stages is not None else getattr(transport, "stages", None)
        if getattr(transport, "stages", stages) is not stages:
            raise DeltaError("the sender and its disk transport must share one StageGroup")
        old = getattr(self, "transport", None)
        if old is not None and old is not transport and hasattr(old, "close"):
            old.close()  # its threads (a store's HEAD refresh among them) end with it
        self.transport, self.engines, self.stages = transport, list(engines), stages
        # without a snapshot every engine starts with a full sync; with one, each engine's own status decides
        kept = self.state.snapshot or (self.state.elsewhere and self.state.version)
        self.status: Dict[int, EngineStatus] = {i: EngineStatus(needs_full=not kept)
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
            st.ctx = st.xor and all(r.ctx for r in ranks)
            st.dense = frozenset().union(*(r.dense for r in ranks))
            st.unsupported = any(r.code == Refusal.UNSUPPORTED.value for r in ranks)
            st.dirty = any(r.reason == "dirty" for r in ranks)
            st.draft_unwritten = max(r.draft_unwritten for r in ranks)
            st.draft = frozenset().union(*(r.draft for r in ranks))

    def update(self, segments: Sequence[Callable[[], Iterable[Chunk]]]) -> Dict[int, Tuple[bool, str]]:
        """One sync over ``segments`` (callables yielding chunks of HF ``(name, tensor)``); publishes after each.
        Engines with ``pause_generation`` are paused around it; one that a failed write left dirty gets its full sync
        before they resume (``repair_dirty``: the segments are called again), so no request is served by a
        half-written model. With a version store the engines pushed to resume once every one of them took the
        version: the manifest, ``HEAD`` and the catch-ups of the others (an anchor's download, say) run while they
        serve, and each engine that catches up resumes after it."""
        with gc_paused():
            pauses = Pauses(len(self.engines), self._pause, self._resume)  # no forward pass sees a sync half-applied
            stages_first = getattr(self.transport, "stage_timeout", 0) > 0
            staged = stages_first and self.transport.gate is None  # a caller's own gate pauses by itself (slime)
            own = self.release is None
            if staged:  # the engines fetch while they serve; the transport pauses them before its announcements
                self.transport.gate = pauses.gate
            elif not stages_first:
                pauses.gate()
            if own:
                self.release = pauses.release
            try:
                results = self._update(segments)
                if self.repair_dirty:  # every pipeline stage repairs, or none: stage 0 knows the engines
                    dirty = self.left_dirty if self.stages is None else \
                        self.stages.share(self.left_dirty if self.stages.first else None)
                    if dirty:  # paused again if a store's commit resumed them: a full sync is several requests
                        (getattr(self.transport, "gate", None) or pauses.gate)()
                        results = self.repair(segments, len(dirty))
            finally:
                if staged:
                    self.transport.gate = None
                if own:
                    self.release = None
                pauses.release()
                if pauses.seconds:  # how long generation stood still, as the trainer saw it
                    self._metrics["perf/update_weights_pause_s"] = sum(pauses.seconds)
            return results

    def _pause(self, engines: List[int]) -> List[int]:
        """Those of ``engines`` that pause themselves (``pause_generation``), paused; the ones that were."""
        paused = []
        for i in engines:
            if hasattr(self.engines[i], "pause_generation"):
                try:
                    self.engines[i].pause_generation()
                    paused.append(i)
                except Exception:  # an unreachable engine fails its own requests below
                    logger.exception("pause_generation failed")
        return paused

    def _resume(self, engines: List[int]) -> None:
        for i in engines:
            try:
                self.engines[i].continue_generation()
            except Exception:  # the engine's own failure shows in its result; keep the others going
                logger.exception("continue_generation failed")

    def repair(self, segments: Sequence[Callable[[], Iterable[Chunk]]], engines: int) -> Dict[int, Tuple[bool, str]]:
        """The full sync of the ``engines`` the last sync left with wrong weights (``left_dirty``), as a sync of its
        own (the others get its delta), before any metrics are popped: they keep the failures and mismatches of
        the sync it repairs and count the repair. Once: an engine it leaves dirty again waits for the next sync."""
        logger.warning("delta sync v%d left %d engine(s) with wrong weights: full sync now, before generation "
                       "resumes", self.version, engines)
        first = {name: self._metrics.get(f"perf/update_weights_{name}", 0.0) for name in self._counters}
        results = self._update(segments)
        for name, n in first.items():  # this sync's counts: both passes (the run's totals counted each already)
            self._metrics[f"perf/update_weights_{name}"] = self._metrics.get(f"perf/update_weights_{name}", 0.0) + n
        self._count("repairs", engines)
        return results

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
        store = getattr(self.transport, "versioned", False)  # a version store: every sync is published there
        if store and (self.stages is None or self.stages.first):
            self.version = max(self.version, self.transport.head_version)  # versions continue above its HEAD
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
        catch_up = []
        based = bool(self.state.snapshot or self.state.elsewhere) and bool(self.state.version)
        if store and based:
            catch_up, full_targets = full_targets, []  # they catch up from the store: no full sync of the trainer's
        delta_targets = [i for i in self.status if i not in full_targets and i not in catch_up]
        if store:
            self.transport.catch_up = catch_up
        resyncs = sum(self.status[i].version is not None for i in full_targets)  # engines synced before
        t0 = time.perf_counter()
        run = self.run = SyncRun(self, v, delta_targets, full_targets, self._encodings(delta_targets),
                                 fingerprint_on=bool(self.fingerprint_every) and v % self.fingerprint_every == 0,
                                 stored=self._stored(store, based, v))
        try:
            self.transport.begin(v)
            for k, segment in enumerate(segments):
                run.final_segment = k == len(segments) - 1
                run.pipeline_pass(segment())
                run.flush_and_publish()
            t_encode = time.perf_counter() - t0 - run.fingerprint_s
            if run.fingerprints is not None:  # read once: the store publishes them, the engines are checked on them
                t1 = time.perf_counter()
                run.shares = fingerprint.read_shares(run.fingerprints)
                run.shares.update(run.found_shares or {})
                run.fingerprint_s += time.perf_counter() - t1
                if store:
                    self.transport.fingerprint = {n: f"{s.total:016x}" for n, s in run.shares.items()}
            results = run.finish()
        except Exception as e:  # what reached which engine is unknown: every engine gets a full sync next
            logger.exception("delta sync v%d aborted", v)
            t_encode = time.perf_counter() - t0 - run.fingerprint_s
            results = {i: (False, f"transport: sync aborted: {e!r}") for i in self.status}
        finally:
            self.run = None
            if self.stages is not None:  # every stage's part is done before any engine serves again
                results = self._combine(results)
            if store:
                if self.release is not None and delta_targets and all(results.get(i, (False,))[0]
                                                                      for i in delta_targets):
                    self.release(delta_targets)  # they took it: the store's commit and the catch-ups need no pause
                results = self._commit_store(results)
        t_finalize = time.perf_counter() - t0 - t_encode - run.fingerprint_s
        acked = [i for i, (ok, _) in results.items() if ok]
        failed = [i for i in results if i not in acked]
        for i in acked:
            st = self.status[i]
            st.version, st.needs_full, st.last_error, st.dirty = v, False, "", False
        if len(acked) == len(self.engines):
            self.state.commit(v)
        else:
            self.state.stage()
        # what a full sync let an engine write directly (xor bases, byte-sparse params) only its status says
        relearn = [i for i in acked if i in full_targets or i in catch_up]
        if self.stages is None or self.stages.first:  # the other stages adopt stage 0's view at the next sync
            self._learn(failed + relearn)
        for i in failed:
            st = self.status[i]
            st.last_error = results[i][1]
            logger.error("delta sync v%d failed on engine %d (%s): %s", v, i,
                         "full sync next" if st.needs_full else "next delta covers it", results[i][1])
        self._metrics = run.metrics(t_encode, t_finalize)
        self._metrics["perf/update_weights_xor"] = float(run.encodings.get("delta") in (
            DeltaEncoding.XOR_ZSTD.value, DeltaEncoding.XOR_CTX.value))
        self._metrics["perf/update_weights_ctx"] = float(run.encodings.get("delta") == DeltaEncoding.XOR_CTX.value)
        self._count("failures", len(failed))
        self._count("snapshot_fold_failures", fold_failed)
        self._count("resyncs", resyncs)
        self._count("catch_ups", len(catch_up))
        self._count("fingerprint_mismatches", 0)
        timings = getattr(self.transport, "timings", None)
        if timings is not None:
            self._metrics.update({f"perf/update_weights_{k}": v for k, v in timings().items()})
        if run.shares is not None and len(acked) == len(self.engines):
            self._check_fingerprints(run.shares, results, run.fingerprint_s, run.found_shares)
        self.left_dirty = [i for i, (ok, _) in results.items() if not ok and self.status[i].dirty]
        fatal = getattr(self.transport, "fatal", None)
        if fatal is not None:  # another trainer moved the store's HEAD: this one must not publish again
            raise fatal
        stale = {i: self.status[i].draft_unwritten for i in relearn if self.status[i].draft_unwritten}
        if stale and self.draft_trained:  # the draft would run on its startup weights while the trainer trains it
            raise DeltaError(f"engine(s) {sorted(stale)}: the full sync wrote nothing into {max(stale.values())} of "
                             "the speculative draft's own params while the trainer trains them: its names for the "
                             "draft's layers do not reach the draft's loader", Refusal.UNSUPPORTED)
        return results

    def _stored(self, store: bool, based: bool, v: int) -> set:
        """What a version store takes of sync ``v`` whichever engines are pushed to: its deltas, an anchor when
        there is no base to diff against, and both every ``anchor_every`` versions."""
        if not store:
            return set()
        if not based:
            return {"full"}
        return {"delta", "full"} if self.anchor_every and v % self.anchor_every == 0 else {"delta"}

    def _plan(self) -> dict:
        """What every stage must agree on before a sync: the version chain, each engine's status, a store's HEAD."""
        return {"version": self.version, "head": getattr(self.transport, "head_version", None),
                "status": {str(i): {k: sorted(v) if isinstance(v, frozenset) else v
                                    for k, v in dataclasses.asdict(st).items()} for i, st in self.status.items()}}

    def _adopt(self, plan: dict) -> None:
        self.version = plan["version"]
        if plan["head"] is not None:
            self.transport.head_version = plan["head"]
        for i, fields in plan["status"].items():
            self.status[int(i)] = EngineStatus(**{k: frozenset(v) if isinstance(v, list) else v
                                                  for k, v in fields.items()})

    def _commit_store(self, results: Dict[int, Tuple[bool, str]]) -> Dict[int, Tuple[bool, str]]:
        """A version store's commit once every stage's part is in: stage 0 writes the manifest and ``HEAD`` and has
        the engines that need it catch up; every stage then goes on with the same results (and stops alike if
        another trainer moved ``HEAD``)."""
        record = self.transport.stage_record()
        records = self.stages.exchange(record) if self.stages is not None else [record]
        if self.stages is None or self.stages.first:
            results = self.transport.commit(results, records)
        if self.stages is not None:
            fatal = self.transport.fatal
            shared = self.stages.share({"results": {str(i): list(r) for i, r in results.items()},
                                        "fatal": str(fatal) if fatal else None} if self.stages.first else None)
            results = {int(i): (bool(r[0]), r[1]) for i, r in shared["results"].items()}
            if shared["fatal"] and self.transport.fatal is None:
                self.transport.fatal = HeadMoved(shared["fatal"])
        return results

    def _combine(self, results: Dict[int, Tuple[bool, str]]) -> Dict[int, Tuple[bool, str]]:
        """An engine took a sync only if every stage's part of it was taken."""
        shared = self.stages.exchange({str(i): list(r) for i, r in results.items()})
        out = {}
        for i in results:
            failed = [(k, r.get(str(i), [False, "no result"])[1]) for k, r in enumerate(shared)
                      if not r.get(str(i), [False])[0]]
            out[i] = (True, results[i][1]) if not failed else (False, f"pipeline stage {failed[0][0]}: {failed[0][1]}")
        return out

    def _encodings(self, delta_targets: List[int]) -> Dict[str, str]:
        """Per sync kind. ``xor_zstd`` only when every delta target is committed at the snapshot's version, can
        rebuild from its views and names the same raw params; otherwise that sync's deltas are ``planes_zstd``
        (overwrite semantics: right for any engine in range). ``xor_ctx`` where, beyond that, every delta target
        decodes it (its status' ``ctx``) and every sparse dtype of the snapshot is one it codes (not float64; the
        sharded sender's ranks find their changes' classes themselves, ``delta_shard_facts``); else ``xor_zstd``.
        Full syncs have no base: ``planes_zstd``."""
        if self.encoding not in (DeltaEncoding.XOR_ZSTD.value, DeltaEncoding.XOR_CTX.value):
            return {"delta": self.encoding, "full": self.encoding}
        sts = [self.status[i] for i in delta_targets]
        xor = bool(sts) and all(st.xor and st.version == self.state.version and st.xor_raw == sts[0].xor_raw
                                for st in sts)
        if getattr(self.transport, "versioned", False):  # in a store, each version applies from its parent
            xor = xor and self.transport.head_version == self.state.version
        planes = DeltaEncoding.PLANES_ZSTD.value
        ctx = xor and self.encoding == DeltaEncoding.XOR_CTX.value and all(st.ctx for st in sts) \
            and all(map(ctx_codes, {t.dtype for t in self.state.snapshot.values()}))
        return {"delta": DeltaEncoding.XOR_CTX.value if ctx else DeltaEncoding.XOR_ZSTD.value if xor else planes,
                "full": planes}

    def _check_fingerprints(self, mine: Dict[str, "fingerprint.NameSum"], results, hashing_s: float,
                            found: Optional[Dict[str, "fingerprint.NameSum"]]) -> None:
        """Every engine's fingerprint of this version against the trainer's; a mismatch means a full sync next.
        ``found``: the shares of names whose changes were found elsewhere (None: none were). Those must cover every
        name kept elsewhere, each whole: a name they miss, or cover in part where the engine shows it whole, counts as a
        mismatch, not as a name the engine cannot show."""
        t0, uncovered, mismatch = time.perf_counter(), set(), {}
        mine = dict(mine)  # the trainer's hashes (with the shares of names found elsewhere)
        lost = sorted(self.state.elsewhere - found.keys()) if found is not None else []
        for i, engine in enumerate(self.engines):
            try:
                theirs = fingerprint.merge_ranks(fingerprint.check_version(engine.fingerprint(), self.version))
                differ, missing = fingerprint.compare_shares(mine, theirs, self.state.snapshot)
                short = [n for n in missing if n in found and n in theirs] if found is not None else []
                differ, missing = differ + short + lost, [n for n in missing if n not in short]
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
            self.status[i].needs_full = self.status[i].dirty = True
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
