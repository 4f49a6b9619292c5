"""The trainer's side of the version store: every sync published as immutable objects, committed by ``HEAD``.

:class:`StoreTransport` is the ``disk`` transport writing into a store (a directory or ``s3://``): the same flush
files, written create-only under ``weight_v{N:06d}-{id}/`` (``id``: this publish's, so a crashed or racing publish
never collides with another), announced to the engines it pushes to with each file's digest. Once every publish of
the sync is written it adds the version's manifest and moves ``HEAD`` by compare-and-swap; only then are the
engines that need more than the next delta (new, restarted, behind) told to catch up from the store, so the
trainer's work per sync does not grow with them. A sync without a snapshot to diff against (the first, or after a
trainer restart) writes an anchor instead of full-sync files: the engines load it from the store like any anchor.

Beside a shared group (``nccl``), :class:`NcclStoreTransport` broadcasts each request to the engines it is for and
files it in the store as one flush file; the store is only read by engines that catch up.

If the store commit fails, every engine's result is a failure (the sender keeps the sync's positions staged and the
next delta covers them); if ``HEAD`` moved under this trainer, ``fatal`` says so and the sender stops.

``HEAD`` carries the time the trainer wrote it. With ``head_refresh_s`` a thread writes it again, unchanged but for
that time (compare-and-swap on the tag this trainer holds), whenever no commit wrote it for that long: a trainer that
evaluates or checkpoints for an hour still tells its followers the store is live, and a frozen or stalled ``HEAD``
makes them stale (``--update-weight-store-max-age``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

from sglang.srt.weight_sync.delta.files import flush_file
from sglang.srt.weight_sync.delta.store import anchor as anchors
from sglang.srt.weight_sync.delta.store.manifest import (
    Head,
    StoreKey,
    anchor_dir,
    digest,
    head_record,
    new_chain_id,
    read_head,
    seal,
    version_dir,
    warn_unkeyed,
)
from sglang.srt.weight_sync.delta.store.objects import HeadMoved, open_store
from sglang.srt.weight_sync.delta.transport import DiskTransport, NcclTransport
from sglang.srt.weight_sync.delta.wire import DeltaError, DeltaPayload

logger = logging.getLogger(__name__)

class StoreTransport(DiskTransport):
    """Flush files as a store's versions (see the module docstring); ``catch_up``: the engines the sender tells to
    catch up once this sync's version commits (set before each sync)."""

    versioned = True

    def __init__(self, url, engines, *, zstd: Optional[int] = None, key: Optional[StoreKey] = None, stages=None,
                 post_write_hook=None, hf_dir: Optional[str] = None, stage_timeout: float = 0.0,
                 head_refresh_s: float = 0.0):
        self.store = open_store(url) if isinstance(url, str) else url
        self.store.check()  # a missing bucket or directory, wrong credentials: an error at start
        self.key = key or StoreKey(None)
        if self.key.secret is None:
            warn_unkeyed()
        super().__init__(self.store.url_root, engines, zstd=zstd, keep_files=True, post_write_hook=post_write_hook,
                         stages=stages, stage_timeout=stage_timeout)
        self.hf_dir = hf_dir
        self.head, self._tag = read_head(self.store, self.key)  # a key that differs from the store's: error at start
        self.head_version = self.head[0] if self.head else 0  # pipeline stages: stage 0's, from the sync's plan
        self.catch_up: List[int] = []
        self.fatal: Optional[DeltaError] = None
        self.upload_bytes = 0  # bytes this trainer wrote to the store in the last sync
        self._head_lock = threading.Lock()  # HEAD's tag: a sync's check and commit, and the refresh between syncs
        self._head_written = time.monotonic()
        self._stop = threading.Event()
        self._refresher = None
        if head_refresh_s > 0 and (stages is None or stages.first):  # stage 0 commits, so it alone writes HEAD
            self._refresher = threading.Thread(target=self._refresh_loop, args=(head_refresh_s,), daemon=True,
                                               name="delta-store-head")
            self._refresher.start()

    def begin(self, version: int) -> None:
        super().begin(version)
        self._objects: Dict[str, Tuple[int, str]] = {}
        self._lock = threading.Lock()
        self._requests: List[list] = []
        self._anchor: List[list] = []  # [name, size, sha256] of this sync's anchor shards (a full version)
        self._weight_map: Dict[str, str] = {}
        self._spec: Optional[Tuple[int, str]] = None  # (base_version, encoding) of this sync's deltas
        self._anchor_targets: List[int] = []  # engines of a full sync: they load its anchor once it commits
        self._written = False  # every publish of this sync written (set when they are collected)
        self.upload_bytes = 0
        self.fingerprint: Optional[Dict[str, str]] = None  # the trainer's per-name fingerprint, on fingerprint syncs
        first = self.stages is None or self.stages.first
        if first:  # stage 0 commits: it alone checks that HEAD is still where this trainer left it
            with self._head_lock:
                head, tag = read_head(self.store, self.key)
                moved = tag != self._tag
            if moved:
                self.fatal = HeadMoved(f"store HEAD moved to version {head and head[0]} under this trainer (it last "
                                       f"saw {self.head_version}): another trainer publishes to {self.store.url_root}")
        pid = os.urandom(4).hex()
        if self.stages is not None:  # one version directory for every stage's files
            pid = self.stages.share(pid if self.fatal is None else None)
        if pid is None or self.fatal is not None:
            self.fatal = self.fatal or HeadMoved("stage 0 found the store's HEAD moved under this trainer")
            raise self.fatal
        if version <= self.head_version:
            raise DeltaError(f"sync version {version} is not above the store's HEAD version {self.head_version}")
        self.vkey, self.akey = f"{version_dir(version)}-{pid}", f"{anchor_dir(version)}-{pid}"
        self.vdir = self.store.url(self.vkey)

    def _dir(self, kind: str) -> str:
        return self.vdir if kind == "delta" else self.store.url(self.akey)

    def _submit(self, payload: DeltaPayload, kind: str) -> None:
        payload.seal(spec_only=True)
        if kind == "full" and not payload.spec.params:
            return  # a segment without params adds no shard to an anchor
        if kind == "full":  # no snapshot to diff against: the sync's params become an anchor's shards
            name = f"model-{self.rank:04d}-{self._file_no:06d}.safetensors"
            key, make = f"{self.akey}/{name}", lambda: anchors.hf_shard(payload)
        else:
            self._spec = (payload.spec.base_version, payload.spec.encoding)
            name = f"rank{self.rank:04d}_flush{self._file_no:06d}.safetensors"
            key, make = f"{self.vkey}/{name}", lambda: flush_file(payload, self.writer.zstd_level)
        self._file_no += 1
        self._pending.setdefault(kind, []).append((name, self.writer.submit_bytes(key, make, self._put)))

    def _put(self, key: str, data: bytes) -> None:
        self.store.put(key, data)
        with self._lock:
            self._objects[key] = (len(data), digest(data))
            self.upload_bytes += len(data)
            if key.startswith(self.akey + "/"):
                self._weight_map.update((n, key.rsplit("/", 1)[1]) for n in anchors.shard_names(data))

    def _entry(self, kind: str, name: str):
        size, sha = self._objects.get(f"{self.vkey if kind == 'delta' else self.akey}/{name}", (0, ""))  # "": failed
        return [name, size, sha]

    def _announced(self, entries: Dict[str, list]) -> None:
        if entries.get("delta"):
            self._requests.append(entries["delta"])
        self._anchor += entries.get("full", [])

    def _stage_body(self, kind: str, entries: List[list]) -> Optional[dict]:
        if kind == "full":  # an anchor: loaded once the version commits
            return None
        return {"model_path": self.vdir, "files": [n for n, _, _ in entries], "digests": {n: s for n, _, s in entries}}

    def _call(self, i: int, kind: str, entries: List[list]):
        if kind == "full":  # an anchor is being written: the engine loads it once the version commits
            return True, "", 0.0
        return self._timed(i, lambda e: e.update_weights_from_disk(self.vdir, [n for n, _, _ in entries],
                                                                   str(self.version),
                                                                   store={"digests": {n: s for n, _, s in entries}}))

    # -- the commit -------------------------------------------------------------

    def publish(self, targets: Dict[str, List[int]]) -> None:
        self._anchor_targets = sorted(set(self._anchor_targets) | set(targets.get("full", [])))
        super().publish(targets)

    def collect(self):
        results = super().collect()
        self._written = all(f.exception() is None for f in self._publishes)
        return results

    def stage_record(self) -> dict:
        """What the version's commit needs of this pipeline stage's part (stage 0 commits for all); a stage that did
        not publish in lockstep adds its own requests and anchor shards."""
        own = {} if self.lockstep else {"requests": self._requests, "anchor": self._anchor}
        return {"written": self._written, "fingerprint": self.fingerprint, "weight_map": self._weight_map, **own}

    def commit(self, results, records: List[dict]):
        """Once every stage's part is written (``records``: each stage's :meth:`stage_record`): the manifest, then
        ``HEAD``; then the engines that need more than a delta catch up, all at once. Returns the sync's results."""
        prints = [r["fingerprint"] for r in records]
        self.fingerprint = None if None in prints else {n: h for f in prints for n, h in f.items()}
        for r in records:
            self._weight_map.update(r["weight_map"])
        if not self.lockstep:  # each stage's requests in stage order: an engine takes each stage's in sequence
            self._requests = [q for r in records for q in r["requests"]]
            self._anchor = [a for r in records for a in r["anchor"]]
        targets = sorted(set(self.catch_up) | set(self._anchor_targets))
        if not all(r["written"] for r in records):  # no engine counts it taken: the next delta covers it from the
            # last committed base (engines that a shared group reached hold it anyway: it applies to them too)
            return {i: (False, "transport: the version was not written to the store") for i in range(len(self.engines))}
        try:
            self._commit()
        except DeltaError as e:
            if isinstance(e, HeadMoved):
                self.fatal = e
            logger.error("store commit of version %d failed: %s", self.version, e)
            return {i: (False, f"transport: store commit failed: {e}") for i in range(len(self.engines))}
        calls = {i: self.calls.submit(self._timed, i, lambda e: e.catch_up(self.store.url_root, str(self.version)))
                 for i in targets}  # every engine at once: the wait does not grow with their number
        for i, fut in calls.items():
            ok, msg, _ = fut.result()
            results[i] = (ok, msg)
        return results

    def _commit(self) -> None:
        parent = [self.head[0], self.head[1], self.head[2]] if self.head else None
        chain = self.head[3] if self.head else new_chain_id()
        anchor = None
        if self._anchor:
            anchor = self._write_anchor(chain)
        base, encoding = self._spec if self._spec else (self.version, None)
        record = {"kind": "version", "chain": chain, "version": self.version, "base_version": base,
                  "parent": parent, "encoding": encoding, "full": not self._requests, "anchor": anchor,
                  "requests": self._requests, "fingerprint": self.fingerprint}
        data = seal(record, self.key)
        mkey = f"{self.vkey}/manifest.json"
        self.store.put(mkey, data)
        head = Head(self.version, mkey, digest(data), chain, time.time())
        hdata = seal(head_record(head), self.key)
        with self._head_lock:
            self._tag = self.store.swap_head(hdata, self._tag)
            self._head_written = time.monotonic()
        self.upload_bytes += len(data) + len(hdata)
        self.head, self.head_version = head, head.version

    def refresh_head(self) -> None:
        """``HEAD`` written again with the time of now, nothing else changed: only over the tag this trainer wrote (a
        ``HEAD`` another trainer moved makes this one's next sync stop, as at a commit)."""
        with self._head_lock:
            if self.head is None or self.fatal is not None:
                return
            head = self.head._replace(time=time.time())
            try:
                self._tag = self.store.swap_head(seal(head_record(head), self.key), self._tag)
            except HeadMoved as e:
                self.fatal = e
                logger.error("store HEAD refresh: %s", e)
                return
            self.head, self._head_written = head, time.monotonic()

    def _refresh_loop(self, every: float) -> None:
        retry = None
        while True:
            due = retry if retry is not None else self._head_written + every
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            if retry is None and time.monotonic() - self._head_written < every:
                continue  # a commit wrote HEAD meanwhile
            try:
                self.refresh_head()
                retry = None
            except Exception as e:  # the store unreachable: try again soon, the followers' max-age counts on
                logger.warning("store HEAD refresh failed: %r", e)
                retry = time.monotonic() + min(every, 5.0)

    def _write_anchor(self, chain: str) -> list:
        """The anchor's index, its config files, then its manifest; returns ``[manifest key, digest]``."""
        objects = [[f"{self.akey}/{n}", s, d] for n, s, d in self._anchor]
        extra = {anchors.INDEX: anchors.index_json(self._weight_map, sum(s for _, s, _ in self._anchor))}
        if self.hf_dir:
            for f in anchors.config_files(self.hf_dir):
                with open(os.path.join(self.hf_dir, f), "rb") as fh:
                    extra[f] = fh.read()
        for name, data in extra.items():
            self.store.put(f"{self.akey}/{name}", data)
            objects.append([f"{self.akey}/{name}", len(data), digest(data)])
        record = {"kind": "anchor", "chain": chain, "version": self.version, "objects": objects,
                  "version_manifest": None, "fingerprint": self.fingerprint}
        data = seal(record, self.key)
        key = f"{self.akey}/manifest.json"
        self.store.put(key, data)
        self.upload_bytes += sum(len(d) for d in extra.values()) + len(data)
        return [key, digest(data)]

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
        super().close()


class NcclStoreTransport(NcclTransport):
    """``nccl`` with a version store beside the group: each request is broadcast to the engines it is for and
    filed in the store (``side``, a :class:`StoreTransport` announcing to no one), one flush file per request.
    Engines that need more than the next delta catch up from the store once the version commits: nothing crosses
    the group for them, and a kind no engine is pushed (an anchor every K versions) is not broadcast at all."""

    versioned = True

    def __init__(self, group, group_name: str, engines, side: StoreTransport, **kw):
        super().__init__(group, group_name, engines, **kw)
        self.side = side
        side.lockstep = False  # each stage files its own requests; stage 0 lists them in stage order at commit

    head_version = property(lambda self: self.side.head_version,
                            lambda self, v: setattr(self.side, "head_version", v))
    catch_up = property(lambda self: self.side.catch_up, lambda self, v: setattr(self.side, "catch_up", v))
    fingerprint = property(lambda self: self.side.fingerprint, lambda self, v: setattr(self.side, "fingerprint", v))
    fatal = property(lambda self: self.side.fatal, lambda self, v: setattr(self.side, "fatal", v))

    def begin(self, version: int) -> None:
        super().begin(version)
        self.side.begin(version)

    def send(self, payload: DeltaPayload, targets: List[int], kind: str = "delta"):
        results = super().send(payload, targets, kind) if targets else {}
        self.side.write(payload, kind)
        self.side.publish({})
        return results

    def stage_record(self) -> dict:
        self.side.collect()
        return self.side.stage_record()

    def commit(self, results, records: List[dict]):
        return self.side.commit(results, records)

    def close(self) -> None:
        super().close()
        self.side.close()
