"""Transports of delta weight sync: flushes to engines over a shared filesystem or a torch.distributed group.

* :class:`DiskTransport`: every flush becomes ``weight_v{N:06d}/rank{S:04d}_flush{F:06d}.safetensors`` (S: the
  pipeline stage; dense full-sync files for engines that need one go to ``weight_v{N:06d}/full/``), written by an
  :class:`AsyncSafetensorsWriter` so encoding never waits on the disk. A publish (end of a segment)
  announces the segment's files from a one-thread executor, after the files are durable and after an
  optional post-write hook's future (e.g. "the remote side of the shared FS sees them").
* :class:`NcclTransport`: one request per flush — the engine's HTTP/RPC call goes out first, then the
  two blobs are broadcast on the existing weight-update group (gloo on CPU, NCCL on GPU). One
  broadcast reaches every engine of the group; an engine a flush is not for receives it and applies nothing, so
  one engine's full sync does not make the others load one. Every broadcast
  has a deadline: one that does not complete in time, or is still pending after every engine
  answered (an engine refused it unreceived, or died), aborts the group; the next sync re-creates it.

Engines are duck-typed clients with ``update_weights_from_disk(model_path, files, weight_version)`` and
``update_weights_from_distributed(names, dtypes, shapes, group_name, delta, weight_version)``, each
returning ``(ok, message)``; :class:`HttpEngine` is the one for a plain SGLang server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import shutil
import threading
import time
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta.collectives import StageGroup, abort_group, await_collectives, group_named
from sglang.srt.weight_sync.delta.engine_api import DeltaEngine
from sglang.srt.weight_sync.delta.files import flush_file
from sglang.srt.weight_sync.delta.stage_first import StagedPublishes
from sglang.srt.weight_sync.delta.wire import (
    POSITIONS,
    RECEIVE_ONLY,
    VALUES,
    DeltaError,
    DeltaPayload,
    DeltaStatus,
    broadcastable,
    dtype_to_str,
    spec_json,
)

logger = logging.getLogger(__name__)

Results = Dict[int, Tuple[bool, str]]


class AsyncSafetensorsWriter:
    """One background thread: serialize, optionally zstd, write ``*.tmp``, fsync, ``os.replace``.

    Readers never see half files; the caller gets a future of the bytes written. At most ``max_queued`` flushes
    wait or are being written: a sender faster than its disk blocks in :meth:`submit` instead of holding every
    flush of a sync in host memory.
    """

    def __init__(self, zstd_level: Optional[int] = None, max_queued: int = 2):
        self.zstd_level = zstd_level
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="delta-writer")
        self.slots = threading.BoundedSemaphore(max_queued)
        self.busy_s = 0.0  # time spent serializing, compressing and writing (one thread)

    def submit(self, path: str, payload: DeltaPayload) -> concurrent.futures.Future:
        return self.submit_bytes(path, lambda: flush_file(payload, self.zstd_level))

    def submit_bytes(self, path: str, make: Callable[[], bytes],
                     land: Optional[Callable[[str, bytes], None]] = None) -> concurrent.futures.Future:
        """``make()``'s bytes to ``path``: a file, or wherever ``land(path, data)`` puts them (a store's object)."""
        self.slots.acquire()
        try:
            return self.pool.submit(self._write, path, make, land or _land_file)
        except BaseException:
            self.slots.release()
            raise

    def _write(self, path: str, make: Callable[[], bytes], land: Callable[[str, bytes], None]) -> int:
        try:
            t0 = time.perf_counter()
            data = make()
            land(path, data)
            self.busy_s += time.perf_counter() - t0
            return len(data)
        finally:
            self.slots.release()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _land_file(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class DiskTransport:
    """Flush files in a shared directory, announced per publish.

    With pipeline stages (``stages``) every stage writes its own files (``rank{stage}_…``) and stage 0 announces
    each publish once, listing every stage's files: an engine applies a segment of all stages as one request, or
    none of it. Each publish numbers a stage's files (``part``, ``last_part`` on the last), so a file that is not
    announced is a refusal, not a param that "did not change". All stages publish the same number of times
    (``lockstep``; a store beside a shared group records each stage's requests on its own instead).
    """

    shared_group = False
    lockstep = True

    def __init__(self, root: str, engines: Sequence, *, zstd: Optional[int] = None, keep_files: bool = False,
                 post_write_hook: Optional[Callable[[str], Optional[concurrent.futures.Future]]] = None,
                 stages: Optional[StageGroup] = None, stage_timeout: float = 0.0):
        self.root, self.engines, self.stages = root, list(engines), stages
        # stage, then commit: with a gate set for the sync, the engines fetch each publish while they serve and the
        # gate (the caller's pause) comes before the announcements (``stage_first``); 0: announce as written
        self.stage_timeout = stage_timeout
        self.gate: Optional[Callable[[], None]] = None
        self.rank = stages.rank if stages is not None else 0
        self.keep_files, self.hook = keep_files, post_write_hook
        self.writer = AsyncSafetensorsWriter(zstd)  # a zstd level (``wire.zstd_level``); None: uncompressed
        self.announcer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="delta-publish")
        self.calls = concurrent.futures.ThreadPoolExecutor(max(1, len(self.engines)), thread_name_prefix="delta-rpc")
        self.staged = StagedPublishes(self.engines, self.calls, stage_timeout, self._commit_version)
        self.vdir = ""
        self._file_no = 0
        self._pending: Dict[str, List[Tuple[str, concurrent.futures.Future]]] = {}
        self._held: Dict[str, DeltaPayload] = {}  # each kind's latest flush: its part is the last until another comes
        self._publishes: List[concurrent.futures.Future] = []
        self._results: Results = {}
        self.wire_bytes = 0
        self._apply_s: Dict[int, float] = {}

    def _dir(self, kind: str) -> str:
        return self.vdir if kind == "delta" else os.path.join(self.vdir, "full")

    def begin(self, version: int) -> None:
        self.version = version
        self.vdir = os.path.join(self.root, f"weight_v{version:06d}")
        self._file_no, self._pending, self._held, self._publishes, self._results = 0, {}, {}, [], {}
        self.wire_bytes, self.writer.busy_s, self._apply_s = 0, 0.0, {}
        self.staged.begin(version)
        if self.stage_timeout > 0 and self.gate is not None and (self.stages is None or self.stages.first):
            self.staged.decide(self.gate)  # the announcer decides now whether this sync stages

    def pending(self, kind: str) -> int:
        return len(self._pending.get(kind, [])) + (kind in self._held)

    def write(self, payload: DeltaPayload, kind: str) -> None:
        held = self._held.pop(kind, None)
        payload.spec.part, payload.spec.last_part = (held.spec.part + 1 if held is not None else 0), False
        if held is not None:
            self._submit(held, kind)
        self._held[kind] = payload

    def _submit(self, payload: DeltaPayload, kind: str) -> None:
        payload.seal(spec_only=True)  # part numbers are set here, after encoding
        os.makedirs(self._dir(kind), exist_ok=True)
        name = f"rank{self.rank:04d}_flush{self._file_no:06d}.safetensors"
        self._file_no += 1
        self._pending.setdefault(kind, []).append((name, self.writer.submit(os.path.join(self._dir(kind), name), payload)))

    def publish(self, targets: Dict[str, List[int]]) -> None:
        for kind, payload in self._held.items():
            payload.spec.last_part = True
            self._submit(payload, kind)
        self._held = {}
        batch, self._pending = self._pending, {}
        self._publishes.append(self.announcer.submit(self._announce, batch, targets))

    def _announce(self, batch, targets: Dict[str, List[int]]) -> None:
        error = None
        try:
            for kind, files in batch.items():
                for _, fut in files:
                    self.wire_bytes += fut.result()  # a failed write raises here and fails the publish
        except Exception as e:
            error = e
        names = {kind: [self._entry(kind, n) for n, _ in files] for kind, files in batch.items()}
        if self.stages is not None and self.lockstep:  # every stage's files of this publish, failed writes or not
            shared = self.stages.exchange({"ok": error is None, "files": names})
            if error is None and not all(s["ok"] for s in shared):
                error = DeltaError(f"pipeline stage(s) {[k for k, s in enumerate(shared) if not s['ok']]} failed "
                                   "to write their files of this publish")
            kinds = {kind for s in shared for kind in s["files"]}
            names = {kind: [n for s in shared for n in s["files"].get(kind, [])] for kind in kinds}
            if error is None and not self.stages.first:  # stage 0 announces; this stage's part is done
                for i in (i for engines in targets.values() for i in engines):
                    self._results.setdefault(i, (True, ""))
                return
        if error is not None:
            raise error
        self._announced(names)
        if self.hook is not None:
            fut = self.hook(self.vdir)
            if fut is not None:
                fut.result()
        calls = {}  # every engine at once: finalize does not grow with the engine count
        for kind, engines in targets.items():
            for i in engines:
                if self._staging():  # fetched now, committed whole under the gate
                    self.staged.add(i, self._stage_body(kind, names.get(kind, [])))
                    continue
                if i in self._results and not self._results[i][0]:
                    continue  # this engine already failed this sync; its later flushes would be refused
                calls[i] = self.calls.submit(self._call, i, kind, names.get(kind, []))
        for i, fut in calls.items():
            ok, msg, seconds = fut.result()
            self._apply_s[i] = self._apply_s.get(i, 0.0) + seconds
            if i not in self._results or not ok:
                self._results[i] = (bool(ok), msg)

    def _staging(self) -> bool:
        """Whether this sync's publishes are fetched first and announced under the gate (``stage_first``)."""
        return self.stage_timeout > 0 and self.gate is not None and self.staged.staging

    def _stage_body(self, kind: str, names: list) -> Optional[dict]:
        """One publish as an engine fetches it before the gate and commits it under it (None: nothing to take)."""
        return {"model_path": self._dir(kind), "files": list(names)}

    def _commit_version(self, i: int, publishes: List[dict]) -> Tuple[bool, str, float]:
        """Every publish of a staged sync to engine ``i`` as one request, taken whole or not at all (``whole``)."""
        return self._timed(i, lambda e: e.update_weights_from_disk(publishes[0]["model_path"], [], str(self.version),
                                                                   store={"requests": publishes}))

    def _entry(self, kind: str, name: str):
        """What an announcement says of one written file (here its name; a store adds its size and digest)."""
        return name

    def _call(self, i: int, kind: str, names: List[str]):
        return self._timed(i, lambda e: e.update_weights_from_disk(self._dir(kind), names, str(self.version)))

    def _timed(self, i: int, call) -> Tuple[bool, str, float]:
        t0 = time.perf_counter()
        try:
            ok, msg = call(self.engines[i])
        except Exception as e:  # unreachable engine
            ok, msg = False, f"transport: {e!r}"
        return ok, msg, time.perf_counter() - t0

    def _announced(self, entries: Dict[str, list]) -> None:
        """Every stage's files of one publish, written (a store records them for its manifest)."""

    def collect(self) -> Results:
        failed = None
        for fut in self._publishes:
            try:
                fut.result()
            except Exception as e:  # the writer or the hook failed: nothing of this publish reached an engine
                failed = f"transport: publish failed: {e!r}"
                logger.exception("delta publish failed")
        if self._staging() and (self.stages is None or self.stages.first):
            for i, (ok, msg, seconds) in self.staged.commit(self.gate, failed).items():
                self._apply_s[i] = seconds
                self._results[i] = (ok, msg)
        if failed:
            for i in range(len(self.engines)):
                if self._results.get(i, (True, ""))[0]:
                    self._results[i] = (False, failed)
        if not self.keep_files and self.vdir and (self.stages is None or self.stages.first):  # after the announcer
            shutil.rmtree(self.vdir, ignore_errors=True)
        return self._results

    def timings(self) -> Dict[str, float]:
        """This sync's seconds: writing files (transfer), the slowest engine's read + apply, and where the engines
        fetched first, the fetch (``stage_s``, up to the gate) and the announcements under it (``commit_s``)."""
        return {"transfer_s": self.writer.busy_s, "apply_s": max(self._apply_s.values(), default=0.0),
                **self.staged.figures}

    def close(self) -> None:
        self.writer.close()
        self.announcer.shutdown(wait=True)
        self.calls.shutdown(wait=True)


class NcclTransport:
    shared_group = True

    def __init__(self, group, group_name: str, engines: Sequence, device: Optional[torch.device] = None,
                 reconnect: Optional[Callable[[], object]] = None,
                 guard: Optional[Callable[[], ContextManager]] = None, timeout_s: float = 120.0):
        self.group, self.group_name, self.engines = group, group_name, list(engines)
        self.device = torch.device(device or "cpu")
        self.reconnect, self.broken = reconnect, False  # reconnect() re-creates the group, on both sides
        self.timeout_s = timeout_s  # per broadcast; match the engines' --update-weight-group-timeout
        self.reconnects = 0
        self.guard = guard or contextlib.nullcontext  # e.g. slime's engine lock around each transfer
        self.calls = concurrent.futures.ThreadPoolExecutor(max(1, len(self.engines)), thread_name_prefix="delta-rpc")
        self._transfer_s = self._apply_s = 0.0

    def begin(self, version: int) -> None:
        self.version, self._transfer_s, self._apply_s = version, 0.0, 0.0
        if self.broken and self.reconnect is not None:
            logger.warning("re-creating weight-update group %s after a failed broadcast", self.group_name)
            self.group, self.broken = self.reconnect(), False
            self.reconnects += 1

    def send(self, payload: DeltaPayload, targets: List[int], kind: str = "delta") -> Results:
        """One request of ``kind`` (delta, full): engines are called first (they block in their receive), then both
        blobs are broadcast. Every engine of the group joins the broadcast; those not in ``targets`` are asked to
        receive only (``wire.RECEIVE_ONLY``): one engine's full sync is applied by that engine alone."""
        with self.guard():
            return self._send(payload, targets)

    def _send(self, payload: DeltaPayload, targets: List[int]) -> Results:
        if self.broken:  # given up on earlier in this sync: no engine is asked to join a dead group
            return {i: (False, f"transport: group {self.group_name} was aborted earlier in this sync") for i in targets}
        pos = payload.positions.to(self.device)
        vals = payload.values.to(self.device)
        args = ([POSITIONS, VALUES], ["uint8", dtype_to_str(vals.dtype)], [[pos.numel()], [vals.numel()]],
                self.group_name)
        spec = spec_json(payload)
        futs = {i: self.calls.submit(self.engines[i].update_weights_from_distributed, *args,
                                     spec if i in targets else RECEIVE_ONLY, str(self.version))
                for i in range(len(self.engines))}
        broadcast_error = None
        t0 = time.perf_counter()
        try:
            works = [torch.distributed.broadcast(broadcastable(t), src=0, group=self.group, async_op=True)
                     for t in (pos, vals)]
            await_collectives(works, self.timeout_s, peers_gone=lambda: all(f.done() for f in futs.values()))
        except Exception as e:
            abort_group(self.group)
            self.broken, broadcast_error = True, f"transport: broadcast on {self.group_name} failed: {e}"
            logger.error("delta broadcast on %s failed: %r", self.group_name, e)
        t1 = time.perf_counter()
        self._transfer_s += t1 - t0
        results = {}
        for i, fut in futs.items():
            try:
                ok, msg = fut.result()
            except Exception as e:
                ok, msg = False, f"transport: {e!r}"
            if i in targets:
                results[i] = (bool(ok) and broadcast_error is None, broadcast_error or msg)
        self._apply_s += time.perf_counter() - t1
        return results

    def timings(self) -> Dict[str, float]:
        """This sync's seconds: broadcasting (transfer) and waiting for the engines' applies after it."""
        return {"transfer_s": self._transfer_s, "apply_s": self._apply_s}

    def close(self) -> None:
        self.calls.shutdown(wait=True)


def http_update_group(engines: Sequence["HttpEngine"], group_name: str, *, backend: str = "nccl",
                      master_address: str = "127.0.0.1", master_port: Optional[int] = None,
                      ranks_per_engine: int = 1, timeout_s: float = 120.0):
    """(Re-)create a weight-update group with plain SGLang servers: this process is rank 0, engine ``k``'s ranks
    follow from ``1 + k * ranks_per_engine``. Any old group of that name is destroyed on the engines first, so
    ``NcclTransport(reconnect=lambda: http_update_group(...))`` recovers a group a broadcast was given up on."""
    import datetime
    import socket

    from sglang.srt.utils.common import init_custom_process_group

    abort_group(group_named(group_name))
    for e in engines:
        e.session.post(e.url + "/destroy_weights_update_group", json={"group_name": group_name}, timeout=e.timeout)
    if master_port is None:
        with socket.socket() as s:
            s.bind((master_address, 0))
            master_port = s.getsockname()[1]
    world = 1 + len(engines) * ranks_per_engine
    calls = concurrent.futures.ThreadPoolExecutor(max(1, len(engines)))
    futs = [calls.submit(e.session.post, e.url + "/init_weights_update_group", timeout=e.timeout, json={
        "master_address": master_address, "master_port": master_port, "rank_offset": 1 + k * ranks_per_engine,
        "world_size": world, "group_name": group_name, "backend": backend}) for k, e in enumerate(engines)]
    try:
        group = init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                          world_size=world, rank=0, group_name=group_name,
                                          timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        replies = [f.result() for f in futs]
        calls.shutdown()
    bad = [r.text[:300] for r in replies if r.status_code != 200]
    if bad:
        raise RuntimeError(f"init_weights_update_group {group_name!r} failed on an engine: {bad[0]}")
    return group


PAUSE_MODES = ("abort", "retract", "in_place")


class HttpEngine(DeltaEngine):
    """A patched SGLang server over HTTP (v0.5.23's distributed updates are wrapped in its session).

    ``pause_mode``: what a sync does to requests in flight — ``abort`` returns them (slime's default), ``retract``
    re-queues them to be recomputed on the new weights, ``in_place`` keeps them and their KV (see ``prefix_cache``).
    """

    def __init__(self, url: str, api_key: Optional[str] = None, timeout: float = 600.0, pause_mode: str = "abort"):
        import requests

        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r}: expected one of {PAUSE_MODES}")
        self.url, self.timeout, self.pause_mode = url.rstrip("/"), timeout, pause_mode
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self._sessions: Optional[bool] = None

    def _post(self, path: str, body: dict) -> Tuple[bool, str]:
        r = self.session.post(self.url + path, json=body, timeout=self.timeout)
        try:
            data = r.json()
        except ValueError:
            return False, f"HTTP {r.status_code}: {r.text[:500]}"
        msg = data.get("message", r.text[:500]) if isinstance(data, dict) else r.text[:500]
        if r.status_code != 200:
            return False, f"HTTP {r.status_code}: {msg}"
        return bool(data.get("success", True)), msg

    def update_weights_from_disk(self, model_path: str, files: List[str], weight_version: str,
                                 store: Optional[dict] = None) -> Tuple[bool, str]:
        body = {"model_path": model_path, "load_format": "delta", "files": files, "weight_version": weight_version}
        return self._post("/update_weights_from_disk", dict(body, store=store) if store else body)

    def pause_generation(self) -> None:
        """Pause in ``pause_mode``; with ``abort`` (as slime does) the KV of the old weights is dropped right away,
        otherwise the engine makes its cache safe when the version commits (``prefix_cache``)."""
        calls = [("/pause_generation", {"mode": self.pause_mode})]
        if self.pause_mode == "abort":
            calls.append(("/flush_cache", {}))
        for path, body in calls:
            r = self.session.post(self.url + path, json=body, timeout=self.timeout)
            if r.status_code != 200:
                raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")

    def continue_generation(self) -> None:
        r = self.session.post(self.url + "/continue_generation", json={}, timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"/continue_generation: HTTP {r.status_code}: {r.text[:500]}")

    def _checker(self, action: str, **fields) -> List[dict]:
        r = self.session.post(self.url + "/weights_checker", json={"action": action, **fields}, timeout=self.timeout)
        data = r.json()
        if r.status_code != 200 or not data.get("success"):
            raise RuntimeError(f"HTTP {r.status_code}: {data.get('message', r.text[:500])}")
        return data["ranks"]

    def fingerprint(self) -> List[dict]:
        """Every rank's share of the weight fingerprint (``/weights_checker``, action ``delta_fingerprint``)."""
        return self._checker("delta_fingerprint")

    def stage(self, request: dict) -> List[DeltaStatus]:
        """Have the engine fetch one publish's files while it serves (``/weights_checker`` ``delta_stage``)."""
        return DeltaStatus.from_checker(self._checker("delta_stage", delta=request))

    def status(self) -> List[DeltaStatus]:
        """Every rank's structured delta status (``/weights_checker``, action ``delta_status``)."""
        return DeltaStatus.from_checker(self._checker("delta_status"))

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, delta, weight_version):
        if self._sessions is None:
            self._sessions = self.session.post(self.url + "/begin_weight_update", json={},
                                               timeout=self.timeout).status_code != 404
        elif self._sessions:
            self.session.post(self.url + "/begin_weight_update", json={}, timeout=self.timeout)
        try:
            return self._post("/update_weights_from_distributed", {
                "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "load_format": "delta", "delta": delta, "weight_version": weight_version})
        finally:
            if self._sessions:
                self.session.post(self.url + "/end_weight_update", json={}, timeout=self.timeout)
