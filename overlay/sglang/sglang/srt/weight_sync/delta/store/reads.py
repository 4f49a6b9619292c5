"""A version's objects read from the store, each checked against the digest its MAC'd record (or the trainer's
announcement) names before anything parses it: one reader for catch-ups, pushed requests and the fetch that runs
while an engine serves."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import List, Optional, Tuple

from sglang.srt.weight_sync.delta import fetch
from sglang.srt.weight_sync.delta.collectives import broadcast_json, tp_group
from sglang.srt.weight_sync.delta.engine_state import host_model, server_arg
from sglang.srt.weight_sync.delta.files import maybe_zstd_decompress, read_safetensors
from sglang.srt.weight_sync.delta.ingest import DEFAULT_READ_WORKERS, max_request_bytes
from sglang.srt.weight_sync.delta.store import staging
from sglang.srt.weight_sync.delta.store.manifest import digest
from sglang.srt.weight_sync.delta.store.objects import ObjectStore, StoreUnavailable, open_store
from sglang.srt.weight_sync.delta.wire import DeltaError, DeltaPayload, Refusal

__all__ = ["OpenedOnRead", "check_objects", "read_flushes", "read_object", "split_url"]


def split_url(url: str) -> Tuple["OpenedOnRead", str]:
    """A version directory's URL as (the store, opened at its first read, and its key prefix)."""
    root, _, leaf = url.rstrip("/").rpartition("/")
    return OpenedOnRead(root), leaf


class OpenedOnRead:
    """A store opened at its first read: a pushed request whose files were all fetched while the engine served reads
    nothing, and an S3 client costs a session of its own."""

    def __init__(self, root: str):
        self.root, self._store, self._lock = root, None, threading.Lock()

    def get(self, key: str, max_bytes: int) -> bytes:
        with self._lock:
            if self._store is None:
                self._store = open_store(self.root)
        return self._store.get(key, max_bytes)


def read_object(store: "ObjectStore | OpenedOnRead", key: str, sha: str, max_bytes: int) -> bytes:
    """An object whose bytes must hash to ``sha``: anything else (swapped, truncated, bit-flipped) is refused."""
    data = store.get(key, max_bytes)
    if not isinstance(sha, str) or digest(data) != sha:
        raise DeltaError(f"store object {key!r}: its bytes do not match the digest the trainer recorded "
                         "(swapped, truncated or corrupted)", Refusal.UNVERIFIED)
    return data


def read_flushes(host, store: "ObjectStore | OpenedOnRead", prefix: str, entries: List[list]) -> List[DeltaPayload]:
    """One request's flush files from the store, in parallel, each checked against its digest first."""
    if not entries:
        raise DeltaError("a store request names no files")
    max_bytes = max_request_bytes(host_model(host))
    workers = int(server_arg(host, "update_weight_delta_read_workers", DEFAULT_READ_WORKERS))

    def one(entry):
        name, _, sha = entry
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise DeltaError(f"file {name!r}: must be a plain file name inside the version")
        model = host_model(host)  # fetched or staged while the engine served: taken under the same digest
        fetched = fetch.take(model, f"{prefix}/{name}", sha)
        if fetched is not None:
            return fetched
        data = staging.take(model, f"{prefix}/{name}", sha)
        if data is None:
            data = read_object(store, f"{prefix}/{name}", sha, max_bytes)
            staging.count_read(model, len(data))
            fetch.count_read(model, len(data))
        return read_safetensors(maybe_zstd_decompress(data, max_bytes, name), name)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, entries))


def check_objects(host, store: "ObjectStore | OpenedOnRead | None",
                  objects: List[Tuple[str, str]]) -> Optional[DeltaError]:
    """Every object present and matching its digest, before a version's first write: the first TP rank reads (into
    the host stage where it fits), every rank gets the verdict."""
    group = tp_group()
    error = None
    if group is None or group.rank_in_group == 0:
        model = host_model(host)
        try:
            for key, sha in objects:
                if not staging.holds(model, key, sha) and not fetch.holds(model, key, sha):
                    data = read_object(store, key, sha, max_request_bytes(model))
                    staging.count_read(model, len(data))
                    staging.keep(model, key, sha, data)
        except DeltaError as e:
            error = e
        except Exception as e:  # a store that cannot answer is an availability fault
            error = StoreUnavailable(f"store: {e!r}")
        if group is not None:
            broadcast_json(group, {"error": [str(error), error.code.value]} if error else {})
    else:
        shared = broadcast_json(group)
        if "error" in shared:
            error = DeltaError(shared["error"][0], Refusal(shared["error"][1]))
    return error
