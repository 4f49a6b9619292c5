"""Fetch: a pushed version's files read into host memory while the engine still serves, so the commit under the
trainer's pause reads nothing.

The trainer asks for it as soon as a publish's files are written, before it pauses generation: ``/weights_checker``
action ``delta_stage`` with a ``delta`` field, ``{"version", "model_path", "files", "digests"?, "final"?,
"hold_s"?}`` (a shared directory, or a version store's version URL with each file's digest). A thread on the engine's
first TP rank (the rank that reads a request's files) reads, decompresses and parses them, in order, bounded by
``--update-weight-delta-stage-bytes`` (what they hold decompressed); past it, the rest is read at the commit. Nothing
here touches a weight, the engine's state or the TP group.

The commit's own announcement still decides what is read: it takes a fetched file only under the identity it was
read under, a store object's digest (the one the commit names) or a directory file's (device, inode, size, mtime) as
the commit finds it, so a file replaced since (written anew and renamed into place, as every writer of ours does) is
read again, and every request is checked whole as before. A fetch
for a version at or below the engine's, or below the one held, is refused (``off_chain``); a newer version's drops
the older; the request that completes a version, or a refusal, drops it; so does ``hold_s`` seconds without a request
of its sync (a trainer that stopped between stage and commit). The status says which version is ``staged`` (every file
of its final request read) and why a fetch was refused (``stage_code``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from typing import Dict, Optional, Tuple

import torch

from sglang.srt.weight_sync.delta.collectives import tp_group
from sglang.srt.weight_sync.delta.files import maybe_zstd_decompress, read_safetensors
from sglang.srt.weight_sync.delta.engine_state import host_model, receiver_state
from sglang.srt.weight_sync.delta.ingest import max_request_bytes, request_bytes, resolve_file
from sglang.srt.weight_sync.delta.store import staging
from sglang.srt.weight_sync.delta.wire import DeltaError, DeltaPayload, Refusal

logger = logging.getLogger(__name__)

__all__ = ["Fetched", "count_read", "fetched", "file_tag", "holds", "remember", "report", "request", "settle", "take"]


@dataclasses.dataclass
class Fetched:
    """One engine's fetched files of one version: bytes by (key, identity), and how the fetch went."""

    version: Optional[int] = None  # the version whose files are being fetched or held
    staged: Optional[int] = None  # ``version`` once its final request's files are all read (or past the bound)
    objects: Dict[Tuple[str, str], Tuple[DeltaPayload, int]] = dataclasses.field(default_factory=dict)  # (parsed, size)
    held_bytes: int = 0  # their positions and values now (the bound's measure)
    bounded: bool = False  # the bound was reached: the rest of this version is read at the commit
    asked: set = dataclasses.field(default_factory=set)  # requests taken (a repeated one is not fetched twice)
    fetched_bytes: int = 0  # this version's bytes fetched while serving
    taken_bytes: int = 0  # the commit under way: file bytes it took from the stage
    read_bytes: int = 0  # and bytes it read itself (not fetched, replaced, or past the bound)
    stage_s: float = 0.0  # first request to the last file read
    t0: float = 0.0
    commit_t0: Optional[float] = None  # the version's first commit request
    expires: Optional[float] = None  # monotonic time past which a version no request touched is dropped (hold_s)
    code: Optional[str] = None  # the last fetch request's refusal (a Refusal value), None when taken
    settings: Optional[tuple] = None  # (stage bytes, max object bytes) of the engine's last request
    jobs: "queue.Queue" = dataclasses.field(default_factory=queue.Queue)
    thread: Optional[threading.Thread] = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def drop(self) -> None:
        with self.lock:
            self.version = self.staged = self.expires = None
            self.objects, self.asked, self.held_bytes, self.bounded = {}, set(), 0, False


_FETCHED: "weakref.WeakKeyDictionary[torch.nn.Module, Fetched]" = weakref.WeakKeyDictionary()


def fetched(model: torch.nn.Module) -> Fetched:
    return _FETCHED.setdefault(model, Fetched())


def remember(host) -> None:
    """The engine's settings a later fetch runs under (the checker's request reaches the model, not the runner)."""
    model = host_model(host)
    fetched(model).settings = (staging.stage_bytes(host), max_request_bytes(model))


def report(model: torch.nn.Module) -> dict:
    f = _FETCHED.get(model) or Fetched()
    return {"staged": f.staged, "fetching": f.version if f.staged is None else None, "code": f.code}


def request(model: torch.nn.Module, req) -> None:
    """Queue one publish's files for the fetch thread; a refusal is kept as the status' ``stage_code``."""
    f = fetched(model)
    try:
        version, job = _parse(req)
        state = receiver_state(model)
        if f.settings is None or state.version is None:
            raise DeltaError("delta_stage: this engine has taken no sync yet (its first is a full sync, applied when "
                             "it arrives)", Refusal.NEEDS_FULL)
        if version <= state.version or (f.version is not None and version < f.version):
            raise DeltaError(f"delta_stage of version {version}: the engine is at version {state.version} and holds "
                             f"{f.version}'s files (never backwards)", Refusal.OFF_CHAIN)
        if f.settings[0] < 1:
            raise DeltaError("--update-weight-delta-stage-bytes is 0: nothing can be staged", Refusal.STAGE_BOUND)
    except DeltaError as e:
        f.code = e.code.value
        logger.warning("%s", e)
        return
    f.code = None
    group = tp_group()
    if group is not None and group.rank_in_group != 0:
        return  # the first rank reads a request's files for every rank
    f.jobs.put((version, job, None if job["hold_s"] is None else time.monotonic() + job["hold_s"]))
    if f.thread is None or not f.thread.is_alive():
        f.thread = threading.Thread(target=_run, args=(f,), name="delta-fetch", daemon=True)
        f.thread.start()


def take(model: torch.nn.Module, key: str, tag: str) -> Optional[DeltaPayload]:
    """The fetched file ``key``, parsed, if it was read under identity ``tag`` (else None: the caller reads it and
    counts it); it leaves the stage as it is taken."""
    f = _FETCHED.get(model)
    if f is None:
        return None
    with f.lock:
        f.expires = None  # its commit is under way: settle drops what it leaves
        held = f.objects.pop((key, tag), None)
        if held is None:
            return None
        f.held_bytes -= request_bytes([held[0]])
        f.taken_bytes += held[1]
    return held[0]


def holds(model: torch.nn.Module, key: str, tag: str) -> bool:
    f = _FETCHED.get(model)
    return f is not None and (key, tag) in f.objects


def count_read(model: torch.nn.Module, nbytes: int) -> None:
    """Bytes a commit read itself (an engine's first full sync included)."""
    f = fetched(model)
    with f.lock:
        f.read_bytes += nbytes


def file_tag(path: str) -> str:
    """A directory file's identity as the commit finds it: a file rewritten or replaced since it was read differs."""
    return _tag(os.stat(path))


def _tag(st: os.stat_result) -> str:
    return f"file:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def settle(host, t0: float) -> None:
    """After a pushed request: its version's first request starts the commit's clock; the request that completes the
    version records its timing (bytes taken from the stage, bytes read inside the pause); a version completed, refused
    or left dirty drops what was fetched for it (a newer version's files wait for their own commit, unless the engine
    is dirty)."""
    model = host_model(host)
    f, state = fetched(model), receiver_state(model)
    if f.commit_t0 is None:
        f.commit_t0 = t0
    ok = state.last[1] is None and not state.dirty
    if state.pending is not None and ok:
        return  # mid-version: the next request takes more of it
    if ok:
        state.timing = {"stage_s": round(f.stage_s, 6) if f.version == state.version else 0.0,
                        "commit_s": round(time.perf_counter() - f.commit_t0, 6), "staged_bytes": f.taken_bytes,
                        "in_pause_bytes": f.read_bytes}
    f.commit_t0, f.taken_bytes, f.read_bytes = None, 0, 0
    refused = not ok and bool(state.last[0]) and state.last[0][0] == f.version  # fetched anew by its next stage
    if f.version is None or state.version is None or f.version <= state.version or state.dirty or refused:
        f.drop()


def _parse(req) -> Tuple[int, dict]:
    if not isinstance(req, dict):
        raise DeltaError(f"delta_stage: 'delta' must be an object, got {type(req).__name__}")
    version, path, files = req.get("version"), req.get("model_path"), req.get("files")
    digests = req.get("digests")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise DeltaError(f"delta_stage: 'version' must be a positive integer, got {version!r}")
    if files and (not isinstance(path, str) or not path):  # the last request of a version may name no file
        raise DeltaError(f"delta_stage: 'model_path' must name a directory or a store's version, got {path!r}")
    if not isinstance(files, list) or not all(isinstance(n, str) for n in files):
        raise DeltaError("delta_stage: 'files' must be a list of file names")
    if digests is not None and (not isinstance(digests, dict) or set(files) - set(digests)):
        raise DeltaError("delta_stage: 'digests' must name a digest for every file")
    hold = req.get("hold_s")
    if hold is not None and (isinstance(hold, bool) or not isinstance(hold, (int, float)) or not hold > 0):
        raise DeltaError(f"delta_stage: 'hold_s' must be a positive number of seconds, got {hold!r}")
    return version, {"model_path": path, "files": files, "digests": digests, "final": bool(req.get("final")),
                     "hold_s": hold}


def _run(f: Fetched) -> None:
    while True:  # one thread per engine for its life: it waits on its queue, or until what it holds expires
        wait = None if f.expires is None else max(0.0, f.expires - time.monotonic())
        try:
            version, job, expires = f.jobs.get(timeout=wait)
        except queue.Empty:
            _expire(f)
            continue
        try:
            _fetch(f, version, job)
        except Exception as e:  # the commit reads the same file and refuses it with its own code, if it must
            logger.warning("delta fetch of version %d: %s (its commit reads the rest)", version, e)
            with f.lock:
                f.bounded, f.staged = True, version  # nothing more is fetched: the commit need not wait
                f.code = e.code.value if isinstance(e, DeltaError) else Refusal.STORE_UNAVAILABLE.value
        with f.lock:
            if f.version == version and f.commit_t0 is None:  # held from this request on, until its commit
                f.expires = expires


def _expire(f: Fetched) -> None:
    with f.lock:  # a request or a commit since the wait began moved or cleared the deadline: nothing is due
        due = f.expires is not None and time.monotonic() >= f.expires
        version, f.expires = (f.version, None) if due else (None, f.expires)
    if version is not None:
        logger.warning("delta fetch: version %d dropped: no request of its sync came for its hold time (the trainer "
                       "stopped?); a later commit of it reads its files itself", version)
        f.drop()


def _fetch(f: Fetched, version: int, job: dict) -> None:
    if f.version != version:
        f.drop()
        with f.lock:
            f.version, f.t0, f.fetched_bytes = version, time.perf_counter(), 0
    key = (job["model_path"], tuple(job["files"]))
    if key in f.asked:
        return
    f.asked.add(key)
    bound, max_bytes = f.settings
    for name in job["files"] if not f.bounded else ():
        okey, tag, read = _source(job, name, max_bytes)
        if f.version != version:
            return  # superseded, or committed, meanwhile
        data = read()
        payload = read_safetensors(maybe_zstd_decompress(data, max_bytes, name), name)
        size = request_bytes([payload])
        with f.lock:
            if f.version != version:
                return
            if f.held_bytes + size > bound:
                f.bounded = True
                break
            f.objects[(okey, tag)] = (payload, len(data))
            f.held_bytes += size
            f.fetched_bytes += len(data)
    if job["final"] and f.version == version:
        f.stage_s, f.staged = time.perf_counter() - f.t0, version
        logger.info("delta fetch: version %d, %d bytes in %.3f s%s", version, f.fetched_bytes, f.stage_s,
                    " (the rest past --update-weight-delta-stage-bytes is read at the commit)" if f.bounded else "")


def _source(job: dict, name: str, max_bytes: int):
    """(the key and identity the commit looks the file up under, and how to read it)."""
    if job["digests"] is not None:  # a version store's object: its digest is its identity
        from sglang.srt.weight_sync.delta.store.reads import read_object, split_url

        store, prefix = split_url(job["model_path"])
        okey, sha = f"{prefix}/{name}", job["digests"][name]
        return okey, sha, lambda: read_object(store, okey, sha, max_bytes)
    path = resolve_file(job["model_path"], name)
    tag = file_tag(path)

    def read():
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
            if _tag(os.fstat(fh.fileno())) != tag:  # replaced or rewritten while read: its commit reads it
                raise DeltaError(f"file {name!r} changed while it was fetched")
        return data

    return path, tag, read
