"""What the version store's records say, and how a reader knows they are the trainer's.

Three records, each canonical JSON (sorted keys, no spaces) with ``format``, ``kind`` and the store's ``chain`` id:

* ``HEAD`` (``kind: head``): the committed version, the digest (sha256) of its manifest's bytes and ``time``, when
  the trainer wrote it (seconds since the epoch, its clock): written last, and again while the trainer idles, so a
  follower tells a live store from a frozen one (``--update-weight-store-max-age``).
* a version manifest (``weight_v{N:06d}/manifest.json``, ``kind: version``): ``version``, ``base_version`` (the
  wire's: the deltas are right for an engine at any version in ``[base_version, version)``), ``parent`` (the version
  and manifest digest ``HEAD`` named before this one: the manifests chain like commits), ``encoding``, ``requests``
  (the flush files of each publish in order, each ``[name, size, sha256]``; an engine applies one publish as one
  request), ``full``, ``anchor`` (the key and digest of an anchor's manifest written for this version) and
  ``fingerprint``. docs/store.md states every field.
* an anchor manifest (``anchor_v{N:06d}/manifest.json``, ``kind: anchor``): the objects of an HF checkpoint of
  version N (``[key, size, sha256]``), the digest of version N's manifest where the anchor was made by compaction.

With a key (``--update-weight-store-key-file``) every record carries ``key_id`` (the first 16 hex digits of the key's
sha256) and ``mac``: HMAC-SHA256 of the canonical record without ``mac``. Every object is covered by a digest inside a
MAC'd record, so without the key nobody can make a reader accept anything. Without a key the digests still catch
corruption, and the store's writers are trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
from typing import NamedTuple, Optional

from sglang.srt.weight_sync.delta.wire import DeltaError, Refusal

logger = logging.getLogger(__name__)

STORE_FORMAT = 1
RECORD_CAP = 64 << 20  # a manifest lists every flush file of a version: far below this


def version_dir(v: int) -> str:
    return f"weight_v{v:06d}"


def anchor_dir(v: int) -> str:
    return f"anchor_v{v:06d}"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class StoreKey:
    """The shared secret of a store's writers and readers (None: no key, the writers are trusted)."""

    def __init__(self, secret: Optional[bytes]):
        self.secret = secret
        self.key_id = hashlib.sha256(secret).hexdigest()[:16] if secret else None

    @classmethod
    def from_file(cls, path: Optional[str]) -> "StoreKey":
        if not path:
            return cls(None)
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise DeltaError(f"store key file {path!r}: cannot read ({e.strerror})", Refusal.UNVERIFIED) from None
        if len(secret) < 16:
            raise DeltaError(f"store key file {path!r}: holds {len(secret)} bytes, a key needs at least 16",
                             Refusal.UNVERIFIED)
        return cls(secret)

    def mac(self, body: bytes) -> str:
        return hmac.new(self.secret, body, hashlib.sha256).hexdigest()


_warned_unkeyed = []


def warn_unkeyed() -> None:
    """Once per process: a store without a key trusts whoever can write it."""
    if not _warned_unkeyed:
        _warned_unkeyed.append(True)
        logger.warning("version store without a key: digests catch corruption, but whoever can write the store can "
                       "write the weights (set --update-weight-store-key-file on both sides)")


def canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def seal(record: dict, key: StoreKey) -> bytes:
    """A record's bytes as written: canonical JSON, with ``key_id`` and ``mac`` when there is a key."""
    record = dict(record, format=STORE_FORMAT)
    if key.secret is None:
        return canonical(record)
    record["key_id"] = key.key_id
    return canonical(dict(record, mac=key.mac(canonical(record))))


def _unique(pairs) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key appears twice")
    return out


def open_record(data: bytes, key: StoreKey, what: str, kind: str) -> dict:
    """Parse and verify one record; ``DeltaError`` (``unverified``, ``unsupported``, ``malformed``) names what is
    wrong with ``what``. The MAC is checked before any field is believed."""
    try:
        record = json.loads(data, object_pairs_hook=_unique)
        if not isinstance(record, dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise DeltaError(f"{what}: not a store record ({e})", Refusal.UNVERIFIED) from None
    mac = record.pop("mac", None)
    if key.secret is None:
        if mac is not None:
            raise DeltaError(f"{what} is signed (key id {record.get('key_id')}) and this side has no store key "
                             "(--update-weight-store-key-file)", Refusal.UNVERIFIED)
        warn_unkeyed()
    else:
        if mac is None:
            raise DeltaError(f"{what} is not signed and this side holds a store key: refused", Refusal.UNVERIFIED)
        if record.get("key_id") != key.key_id:
            raise DeltaError(f"{what} is signed with another key (key id {record.get('key_id')}, this side's "
                             f"{key.key_id})", Refusal.UNVERIFIED)
        if not isinstance(mac, str) or not hmac.compare_digest(mac, key.mac(canonical(record))):
            raise DeltaError(f"{what}: MAC mismatch (not written by a holder of the key)", Refusal.UNVERIFIED)
    if record.get("format") != STORE_FORMAT:
        raise DeltaError(f"{what} is of store format {record.get('format')!r}; this side reads format "
                         f"{STORE_FORMAT}: run one patch set on the trainer and the engines", Refusal.UNSUPPORTED)
    if record.get("kind") != kind:
        raise DeltaError(f"{what} is a {record.get('kind')!r} record, expected {kind!r}", Refusal.UNVERIFIED)
    return record


class Head(NamedTuple):
    """A verified ``HEAD``: what it commits, and when the trainer wrote it (None: a trainer that wrote no time)."""

    version: int
    manifest_key: str
    manifest: str  # the manifest's digest
    chain: str
    time: Optional[float] = None


def read_head(store, key: StoreKey):
    """``HEAD`` verified (MAC, format, kind) as a :class:`Head`, and the tag a compare-and-swap names;
    ``(None, None)`` before the first version."""
    data, tag = store.read_head()
    if data is None:
        return None, None
    r = open_record(data, key, "store HEAD", "head")
    try:
        t = r.get("time")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)):
            raise ValueError(t)
        return Head(int(r["version"]), str(r["manifest_key"]), str(r["manifest"]), str(r["chain"]),
                    None if t is None else float(t)), tag
    except (KeyError, TypeError, ValueError):
        raise DeltaError("store HEAD: malformed record", Refusal.UNVERIFIED) from None


def head_record(head: Head) -> dict:
    return {"kind": "head", "chain": head.chain, "version": head.version, "manifest": head.manifest,
            "manifest_key": head.manifest_key, "time": head.time}


def new_chain_id() -> str:
    return os.urandom(16).hex()
