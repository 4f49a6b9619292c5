"""A version taken whole or not at all: every request of it staged (read, checked, agreed on, rebuilt, decoded)
before the first is written, so a version broken in any one object leaves the engine serving the version it held.

Two callers: a store catch-up (each version of its walk, each anchor) and a pushed version the engines fetched while
they served (``store: {"requests": [...]}`` on ``/update_weights_from_disk``: every publish of one sync, committed as
one request under the trainer's pause). Staged requests wait on the engine's device, so they are bounded by
``--update-weight-delta-chunk-bytes``; past it the rest of the version is checked before that first write where its
objects carry digests (a store's), then staged and committed one request at a time: a failure there leaves the engine
dirty (it refuses generation until a full sync or a catch-up repairs it).
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Tuple

from sglang.srt.weight_sync.delta.commit import apply_request, chunk_bytes, commit_request, refused
from sglang.srt.weight_sync.delta.engine_state import host_model, receiver_state
from sglang.srt.weight_sync.delta.ingest import read_files_once, request_bytes
from sglang.srt.weight_sync.delta.stage import Progress, StageRefused, stage_request
from sglang.srt.weight_sync.delta.store.reads import check_objects, read_flushes, split_url
from sglang.srt.weight_sync.delta.wire import DeltaError, Refusal

__all__ = ["apply_pushed", "commit_pushed", "take_version"]

Requests = Callable[[int], Iterator[dict]]  # skip -> each request from the skip-th on: {"payloads"[, "error"]}


def take_version(host, what: str, version: int, requests: Requests,
                 check_rest: Callable[[int], Optional[DeltaError]], replaces: bool = False) -> Tuple[bool, str]:
    """Stage every request ``requests(0)`` yields, then commit them in order; ``what`` names the version in a
    refusal. ``check_rest(k)``: the objects of the requests from the ``k``-th on verified (None) before the first
    write, when the staged ones reach the bound. ``replaces``: a full version (an anchor) that replaces whatever the
    engine holds."""
    state = receiver_state(host_model(host))
    progress = Progress.replacing() if replaces else Progress.of(state)
    staged, held, rest, bound = [], 0, None, chunk_bytes(host)
    for k, request in enumerate(requests(0)):
        failure, size = request.get("error"), request_bytes(request["payloads"])
        if failure is None and staged and held + size > bound:
            rest = k  # past the bound: the rest's objects are only checked, then taken request by request
            break
        try:
            one = stage_request(host, request["payloads"], str(version), failure, progress)
        except StageRefused as e:
            return refused(state, e, e.request, e.received)
        progress.advance(one)
        staged.append(one)
        held += size
    error = None if rest is None else check_rest(rest)
    if error is not None:
        return refused(state, error)
    if not staged or (rest is None and not staged[-1].complete):  # no final request: nothing of it is written
        return refused(state, DeltaError(f"{what} did not complete (no final request): the engine holds no version "
                                         "of it", Refusal.UNVERIFIED))
    if replaces:  # the chain starts again from it
        state.version = None
    for one in staged:
        ok, msg = commit_request(host, one)
        if not ok:
            return False, msg
    for request in () if rest is None else requests(rest):
        ok, msg = apply_request(host, request["payloads"], str(version), failure=request.get("error"))
        if not ok:
            return False, msg
    if state.version != version:  # its requests never committed it (a final request missing)
        state.dirty, state.pending = True, None
        return refused(state, DeltaError(f"{what} did not complete (no final request): the engine is dirty",
                                         Refusal.UNVERIFIED))
    return True, f"version {version}"


def commit_pushed(host, requests, weight_version: Optional[str]) -> Tuple[bool, str]:
    """Every publish of one pushed version (``[{"model_path", "files", "digests"?}, ...]``, in order), taken whole."""
    state = receiver_state(host_model(host))
    try:
        parsed = _parse(requests)
        version = int(weight_version)
    except (DeltaError, TypeError, ValueError) as e:
        error = e if isinstance(e, DeltaError) else DeltaError(f"a version's requests need an integer "
                                                               f"weight_version, got {weight_version!r}")
        return refused(state, error)

    def each(skip: int):
        for path, files, digests in parsed[skip:]:
            try:
                yield {"payloads": _read(host, path, files, digests)}
            except DeltaError as e:
                yield {"payloads": [], "error": e}
                return

    def check_rest(first: int) -> Optional[DeltaError]:
        objects = [(f"{split_url(path)[1]}/{name}", digests[name]) for path, files, digests in parsed[first:]
                   if digests is not None for name in files]
        store = split_url(parsed[first][0])[0] if objects else None
        return check_objects(host, store, objects) if objects else None

    return take_version(host, f"version {version}", version, each, check_rest)


def apply_pushed(host, url: str, files: List[str], weight_version: Optional[str], digests: dict):
    """One request the trainer pushed, its files in a version store: the announcement's digests cover them."""
    try:
        payloads = _read(host, url, files, digests)
    except DeltaError as e:
        return apply_request(host, [], weight_version, failure=e)
    return apply_request(host, payloads, weight_version)


def _read(host, path: str, files: List[str], digests: Optional[dict]):
    """One request's payloads, read once per engine: from a store under the digests announced, else a directory."""
    if digests is None:
        return read_files_once(host, path, files)
    missing = [f for f in files or [] if f not in digests]
    if missing or not files:
        raise DeltaError(f"files {missing[:3]} come without a digest" if missing else "load_format 'delta' needs "
                         "'files'", Refusal.UNVERIFIED)
    store, prefix = split_url(path)
    return read_files_once(host, path, files, reader=lambda: read_flushes(
        host, store, prefix, [[f, 0, digests[f]] for f in files]))


def _parse(requests) -> List[tuple]:
    if not isinstance(requests, list) or not requests:
        raise DeltaError("store 'requests' must be a non-empty list of a version's requests")
    out = []
    for k, r in enumerate(requests):
        path, files, digests = (r.get("model_path"), r.get("files"), r.get("digests")) if isinstance(r, dict) else \
            (None, None, None)
        if not isinstance(path, str) or not path or not isinstance(files, list) or not files or \
                not all(isinstance(f, str) for f in files):
            raise DeltaError(f"request {k} of the version must name a 'model_path' and its 'files'")
        if digests is not None and not isinstance(digests, dict):
            raise DeltaError(f"request {k} of the version: 'digests' must map each file to its digest")
        out.append((path, files, digests))
    return out
