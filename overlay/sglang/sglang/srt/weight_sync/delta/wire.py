"""The wire contract of delta weight sync: the spec, the engine's status and refusal codes, and the checksum.

One flush is three things: ``__positions__`` (uint8 blob, little-endian position ints of all
params concatenated), ``__values__`` (1-D tensor of the flush's single values dtype) and a
:class:`DeltaSpec` (encoding, per-param offsets, ``mix64`` checksum, versions). Over NCCL the
spec travels as JSON in the request's ``delta`` field; on disk it is the safetensors
``__metadata__`` (string values) of a file holding the two tensors, optionally zstd-compressed
as a whole (detected by magic, not by name).

Position encodings (``pos_width`` is per param):

* ``indices``: uint32 absolute flat positions into ``param.view(-1)``;
* ``deltas``/``deltas_zstd``: uint16 gaps ``idx[k] - idx[k-1] - 1`` (``idx[-1] = -1``), or uint32
  for a param whose largest gap exceeds 65535; decode is ``cumsum(gap + 1) - 1``;
* dense (``pos_width = 0``): no positions, values hold all ``numel`` elements (full syncs,
  integer params).

Disk-only file layouts (the spec's offsets, and the checksum, always describe the *logical* blobs):

* ``planes_zstd``: positions as ``deltas``; in the file each param's segment of each blob is stored
  plane-major (byte k of every element together, k = 0..width-1), the whole file zstd-compressed;
* ``xor_zstd``: as ``planes_zstd``, but the file's values are ``new XOR base`` (the committed bytes of
  ``base_version``; zero for a param the engine never stores, e.g. a tied ``lm_head``: its status
  lists them as ``xor_raw``). Only an engine at exactly ``base_version`` can rebuild the new values,
  and it verifies them against the checksum before the first write.

Both sides import this module; the codecs live in :mod:`positions` (position ints) and :mod:`files` (safetensors,
zstd, planes, xor), the checks an engine runs before its first write in :mod:`validate`, the sender's diff and
encode in :mod:`diff`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import json
import math
import operator
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta.mix64 import M64, NAN_BITS, blob_sum
from sglang.srt.weight_sync.delta.ops import any_nan, gc_paused, host_values

POSITIONS, VALUES = "__positions__", "__values__"



CHECKSUM_ALGO = "mix64"


# The spec's layout: 2 = params as parallel columns, one JSON list per DeltaParam field (1: a list of per-param
# objects, costly to parse and serialize per param). Engines report the one they read.
WIRE_FORMAT = 2


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


# A flush's header holds one small JSON entry per param; 64 MiB is far above any real one
# and keeps a forged length from allocating the host away.
HEADER_CAP = 64 << 20


_DTYPES: Dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


_SENTINEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


_BYTE_SPARSE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class Refusal(str, enum.Enum):
    """Why an engine refused a request: machine-readable, beside the human message."""

    CHECKSUM = "checksum"  # blobs or spec corrupted
    MALFORMED = "malformed"  # structure: offsets, positions, NaN, file layout, framing
    MANIFEST = "manifest"  # a name, shape or dtype the first full sync did not have
    NEEDS_FULL = "needs_full"  # fresh, dirty or loaded outside the chain: only a full sync helps
    OFF_CHAIN = "off_chain"  # versions do not fit the engine's committed version (replay, out of order, engine ahead)
    UNSUPPORTED = "unsupported"  # an engine or param this product does not serve
    NOT_RECEIVED = "not_received"  # a broadcast refused before (or failing while) receiving it
    APPLY_FAILED = "apply_failed"  # a write failed after others landed: the engine is dirty
    PEER = "peer_refused"  # this rank was fine, another TP rank of the engine refused or failed
    NO_BASE = "no_base"  # xor_zstd: this engine cannot read the base bytes of every named param (send it planes_zstd)
    NEEDS_DENSE = "needs_dense"  # a sparse param without NaN sentinel that no recorded view writes (status' dense)
    VERIFY = "verify"  # a written element read back other bits than were written: the engine is dirty
    UNVERIFIED = "unverified"  # a store's object, manifest or HEAD fails its digest or MAC: not what the trainer wrote
    STORE_UNAVAILABLE = "store_unavailable"  # the store cannot give what a catch-up needs (unreachable, deleted)
    STAGE_BOUND = "stage_bound"  # a stage request this engine's --update-weight-delta-stage-bytes cannot hold
    REPLICATING = "replicating"  # an object the store's verified records name is not there yet (a replica behind)


class DeltaError(ValueError):
    """A request that must be refused; the message names the param and the cause, ``code`` classifies it."""

    def __init__(self, message: str, code: Refusal = Refusal.MALFORMED):
        super().__init__(message)
        self.code = Refusal(code)


@dataclasses.dataclass
class DeltaStatus:
    """One engine rank's delta state, as ``/weights_checker`` action ``delta_status`` reports it.

    The sender decides on these fields alone: a full sync when ``needs_full`` or when ``version`` is
    outside what its next delta serves; ``version`` above its own continues the chain there.
    """

    version: Optional[int] = None  # committed version; None before the first full sync
    needs_full: bool = True  # every delta is refused until a full sync
    reason: Optional[str] = "fresh"  # "fresh" | "dirty" | "released" | "outside_load"; None when not needed
    pending: Optional[int] = None  # a version whose flushes are being applied
    request: Optional[List[int]] = None  # [version, flush] of the last delta request seen
    code: Optional[str] = None  # that request's Refusal code; None when it was applied
    received: Optional[bool] = None  # broadcasts: whether that request's blobs were received in full
    max_request_bytes: int = 0  # the most bytes one request may declare (the sender never declares more)
    xor: bool = False  # can rebuild xor_zstd values: every param this rank loaded is readable through recorded views
    xor_raw: List[str] = dataclasses.field(default_factory=list)  # names its loader never stored: xor_zstd sends them raw
    ctx: bool = False  # can decode xor_ctx (as ``xor``; an engine that predates xor_ctx says nothing: False)
    dense: List[str] = dataclasses.field(default_factory=list)  # names that must travel dense (see nan_sentinel)
    applied: Dict[str, int] = dataclasses.field(default_factory=dict)  # versions committed by kind: {"full", "delta"}
    wire_format: int = 1  # the spec layout this rank reads (:data:`WIRE_FORMAT`; an engine that does not say reads 1)
    staged: Optional[int] = None  # a version fetched (store: and digest-checked) while serving, not committed
    staging: Optional[int] = None  # the version being fetched now (None: no stage under way)
    stage_code: Optional[str] = None  # the last stage request's Refusal code (None: taken)
    idle: Optional[bool] = None  # no request running or waiting when it answered (None: the engine does not say)
    timing: Dict[str, float] = dataclasses.field(default_factory=dict)  # stage_s, commit_s, staged/in_pause_bytes
    draft_unwritten: int = 0  # a speculative draft's own params its last full sync wrote nothing into
    draft: List[str] = dataclasses.field(default_factory=list)  # names only its speculative draft holds

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> "DeltaStatus":
        if not isinstance(d, dict) or set(d) - {f.name for f in dataclasses.fields(cls)}:
            raise DeltaError(f"malformed delta status {d!r}")
        return cls(**d)

    def checker_rank(self, parallelism_info=None) -> dict:
        """One rank's ``/weights_checker`` reply: SGLang relays only its ``ChecksumInfo`` shape (name -> string)."""
        return {"checksums": {STATUS_KEY: json.dumps(self.to_dict())}, "per_gpu_checksum": "",
                "parallelism_info": parallelism_info}

    @classmethod
    def from_checker(cls, ranks: Sequence[dict]) -> List["DeltaStatus"]:
        """Every rank's status from a ``delta_status`` reply's ``ranks``."""
        try:
            return [cls.from_dict(json.loads(r["checksums"][STATUS_KEY])) for r in ranks]
        except (KeyError, TypeError, ValueError) as e:
            raise DeltaError(f"malformed delta_status reply: {e!r}") from None


STATUS_KEY = "__delta_status__"


RECEIVE_ONLY = json.dumps({"receive_only": True})
"""The ``delta`` field of a broadcast request to an engine the flush is not for: every member of a group must join
each broadcast, so it receives the blobs and applies nothing (another engine's full sync passes it by)."""


def _unique_keys(pairs) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError(f"duplicate keys {sorted({k for k, _ in pairs if sum(k == j for j, _ in pairs) > 1})}")
    return d


def _spec_loads(text: str):
    """A spec's JSON with every key once: the checksum hashes the params' text as it arrived
    (:func:`received_params`), so the parse must read that text and no second ``params`` beside it (a spec holds
    two objects, so the hook costs nothing per param)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def parse_request(delta: str) -> Optional[DeltaSpec]:
    """A broadcast request's ``delta`` field: its spec, or None for :data:`RECEIVE_ONLY` (one JSON parse)."""
    try:
        d = _spec_loads(delta)
    except (TypeError, ValueError) as e:
        raise DeltaError(f"delta spec is not valid JSON: {e}") from None
    if d == {"receive_only": True}:
        return None
    return DeltaSpec.from_dict(d)


class DeltaEncoding(str, enum.Enum):
    INDICES = "indices"
    DELTAS = "deltas"
    DELTAS_ZSTD = "deltas_zstd"
    PLANES_ZSTD = "planes_zstd"
    XOR_ZSTD = "xor_zstd"
    XOR_CTX = "xor_ctx"

    @property
    def disk_only(self) -> bool:
        """Compressed file layouts: a broadcast carries raw blobs."""
        return self in (DeltaEncoding.DELTAS_ZSTD, DeltaEncoding.PLANES_ZSTD, DeltaEncoding.XOR_ZSTD,
                        DeltaEncoding.XOR_CTX)

    @property
    def plane_major(self) -> bool:
        return self in (DeltaEncoding.PLANES_ZSTD, DeltaEncoding.XOR_ZSTD)


# Level 1: on real AdamW steps higher levels save next to nothing (the planes' bytes sit at their order-0 entropy:
# random gaps, random low mantissa bytes) at several times level 1's time.
ZSTD_LEVELS = {DeltaEncoding.DELTAS_ZSTD: 1, DeltaEncoding.PLANES_ZSTD: 1, DeltaEncoding.XOR_ZSTD: 1,
               DeltaEncoding.XOR_CTX: 1}


def zstd_level(encoding: str, level: Optional[int] = None) -> Optional[int]:
    """The zstd level of an encoding's files: ``level`` if given, else the measured default; None: uncompressed."""
    enc = DeltaEncoding(encoding)
    if not enc.disk_only:
        return None
    return ZSTD_LEVELS[enc] if level is None else level


def dtype_from_str(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> dtype; unknown names are refused, not guessed."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise DeltaError(f"unknown dtype {name!r}")
    return _DTYPES[key]


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sparse_allowed(dtype: torch.dtype) -> bool:
    """Float dtypes travel sparse; integer params always travel dense."""
    return dtype in _SENTINEL_DTYPES or dtype in _BYTE_SPARSE_DTYPES


def broadcastable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a collective moves it: fp8 as its bytes (gloo has no fp8 type, NCCL's depends on its version)."""
    return t.view(torch.uint8) if t.dtype in _BYTE_SPARSE_DTYPES else t


def nan_sentinel(dtype: torch.dtype) -> bool:
    """Whether NaN can mean 'unchanged' in a source tensor fed to a model's loader. fp8 cannot: loaders cast and
    copy fp8 bytes through paths that do not keep NaN apart, so sparse fp8 params are written only through the
    views recorded in the full sync (an engine lists the others in its status' ``dense``)."""
    return dtype in _SENTINEL_DTYPES


@dataclasses.dataclass
class DeltaParam:
    """Address book entry of one param in a flush (no data).

    ``pos_start``/``pos_end`` are byte offsets into ``__positions__``; ``val_start``/``val_end``
    element offsets into ``__values__``; the k-th decoded position pairs with the k-th value.
    """

    name: str
    dtype: str
    shape: List[int]
    pos_start: int
    pos_end: int
    pos_width: int
    val_start: int
    val_end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        return self.val_end - self.val_start

    @property
    def dense(self) -> bool:
        return self.pos_width == 0


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(DeltaParam))


_PARAM_FIELD_SET = set(_PARAM_FIELDS)


_INT_COLUMNS = ("pos_start", "pos_end", "pos_width", "val_start", "val_end")


@dataclasses.dataclass
class DeltaSpec:
    """Metadata of one flush: how to read the blobs, how to check them, where they sit in time.

    ``base_version``..``version``: the request is correct for an engine whose committed version
    lies in that range (overwrite semantics); ``flush`` is the request's index within the sync,
    ``final`` marks its last request (the engine commits ``version`` then); ``full`` marks a
    full sync (every param dense), the only thing a dirty or fresh engine accepts.

    A sync comes from ``sources`` senders (a trainer's pipeline stages), this flush from ``source``; the engine
    commits once every source's final request arrived. A source's files in one disk request are numbered by
    ``part``, ``last_part`` on its last: a file left out of a request, or a stage left out of a disk request, is
    refused, never mistaken for "nothing changed there".
    """

    encoding: str
    params: List[DeltaParam]
    checksum: str = ""
    checksum_algo: str = CHECKSUM_ALGO
    full: bool = False
    base_version: int = 0
    version: int = 0
    flush: int = 0
    final: bool = True
    source: int = 0
    sources: int = 1
    part: int = 0
    last_part: bool = True

    _INT_FIELDS = ("base_version", "version", "flush", "source", "sources", "part")
    _BOOL_FIELDS = ("full", "final", "last_part")

    def to_dict(self) -> dict:
        return {**self.scalars(), "params": self.columns()}

    def to_json(self) -> str:
        """Canonical JSON (:func:`canonical_spec`'s layout) with the checksum: an engine hashes the params' text as
        it arrives (:func:`received_params`) instead of serializing what it parsed again."""
        return json.dumps(self.to_dict(), **_CANONICAL)

    def to_metadata(self, params_text: Optional[str] = None) -> Dict[str, str]:
        """safetensors ``__metadata__`` is ``dict[str, str]``: scalars as text, params as canonical JSON
        (``params_text``: that text, already written)."""
        d = self.scalars()
        md = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in d.items()}
        md["params"] = params_json(self) if params_text is None else params_text
        return md

    def scalars(self) -> dict:
        """Every field but ``params``, as :meth:`to_dict` has them."""
        d = {f: getattr(self, f) for f in _SPEC_FIELDS if f != "params"}
        d["encoding"] = DeltaEncoding(self.encoding).value
        return d

    def columns(self) -> dict:
        """The params as the wire's parallel columns (wire format 2)."""
        return {f: list(map(operator.attrgetter(f), self.params)) for f in _PARAM_FIELDS}

    @classmethod
    def from_json(cls, text: str) -> "DeltaSpec":
        try:
            d = _spec_loads(text)
        except (TypeError, ValueError) as e:
            raise DeltaError(f"delta spec is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_metadata(cls, md: Dict[str, str]) -> "DeltaSpec":
        if not isinstance(md, dict) or "params" not in md or "encoding" not in md:
            raise DeltaError("file metadata lacks a delta spec (need 'encoding' and 'params')")
        d = dict(md)
        try:
            d["params"] = _spec_loads(md["params"])
        except ValueError as e:
            raise DeltaError(f"metadata 'params' is not valid JSON: {e}") from None
        for k in cls._INT_FIELDS:
            if k in d:
                d[k] = _parse_int(k, d[k])
        for k in cls._BOOL_FIELDS:
            if k in d:
                if d[k] not in ("true", "false"):
                    raise DeltaError(f"metadata {k!r} must be 'true' or 'false', got {d[k]!r}")
                d[k] = d[k] == "true"
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d) -> "DeltaSpec":
        if not isinstance(d, dict):
            raise DeltaError("delta spec must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise DeltaError(f"delta spec has unknown fields {sorted(unknown)}")
        try:
            DeltaEncoding(d.get("encoding"))
        except ValueError:
            raise DeltaError(f"unknown encoding {d.get('encoding')!r} (have: {[e.value for e in DeltaEncoding]})") from None
        with gc_paused():  # an object per param: collections they trigger would scan an engine's whole heap
            out = cls(**{**d, "params": _params_from_columns(d.get("params"))})
        for k in cls._INT_FIELDS:
            if type(getattr(out, k)) is not int or getattr(out, k) < 0:
                raise DeltaError(f"delta spec {k!r} must be a non-negative integer")
        for k in cls._BOOL_FIELDS:
            if type(getattr(out, k)) is not bool:
                raise DeltaError(f"delta spec {k!r} must be a boolean")
        if out.checksum_algo != CHECKSUM_ALGO:
            raise DeltaError(f"unsupported checksum_algo {out.checksum_algo!r} (have: {CHECKSUM_ALGO})",
                             Refusal.UNSUPPORTED)
        if out.base_version > out.version:
            raise DeltaError(f"base_version {out.base_version} is above version {out.version}")
        if not out.source < out.sources:
            raise DeltaError(f"source {out.source} is not below sources {out.sources}")
        return out


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(DeltaSpec))


def _parse_int(key, text) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise DeltaError(f"metadata {key!r} must be an integer, got {text!r}") from None


def _params_from_columns(cols) -> List[DeltaParam]:
    """The params of a spec from its columns (wire format 2), each column checked whole by builtins that loop in C:
    a type set, a min, a set difference — the per-param Python work is building the entry."""
    if isinstance(cols, list):
        raise DeltaError(f"delta spec 'params' is a list of per-param objects (wire format 1); this engine reads wire "
                         f"format {WIRE_FORMAT}, parallel columns: run one patch set on the trainer and the engines",
                         Refusal.UNSUPPORTED)
    if not isinstance(cols, dict) or cols.keys() != _PARAM_FIELD_SET:
        raise DeltaError(f"delta spec 'params' must be an object of exactly the columns {list(_PARAM_FIELDS)}")
    if any(type(c) is not list for c in cols.values()):
        raise DeltaError("every column of delta spec 'params' must be a list")
    names = cols["name"]
    if len({len(c) for c in cols.values()}) > 1:
        raise DeltaError(f"the columns of delta spec 'params' differ in length: "
                         f"{ {f: len(c) for f, c in cols.items()} }")

    def named(field: str, bad) -> str:
        """The first param whose ``field`` is ``bad`` (a refusal names it)."""
        return repr(names[next(k for k, x in enumerate(cols[field]) if bad(x))])

    if not set(map(type, names)) <= {str} or not all(names):
        raise DeltaError("param name must be a non-empty string")
    for f in _INT_COLUMNS:
        col = cols[f]
        if col and (not set(map(type, col)) <= {int} or min(col) < 0):
            raise DeltaError(f"param {named(f, lambda x: type(x) is not int or x < 0)}: {f} must be a non-negative "
                             "integer")
    shapes = cols["shape"]
    dims = list(itertools.chain.from_iterable(s for s in shapes if type(s) is list))
    if not set(map(type, shapes)) <= {list} or not set(map(type, dims)) <= {int} or (dims and min(dims) < 0):
        bad = named("shape", lambda s: type(s) is not list or any(type(x) is not int or x < 0 for x in s))
        raise DeltaError(f"param {bad}: shape must be a list of non-negative integers")
    dtypes = cols["dtype"]
    if not set(map(type, dtypes)) <= {str}:
        raise DeltaError(f"param {named('dtype', lambda x: type(x) is not str)}: dtype must be a string")
    for name in set(dtypes) - _DTYPES.keys():
        dtype_from_str(name)  # refuses an unknown name (a "torch."-prefixed one is the same dtype)
    widths = cols["pos_width"]
    if not set(widths) <= {0, 2, 4}:
        k = next(k for k, x in enumerate(widths) if x not in (0, 2, 4))
        raise DeltaError(f"param {names[k]!r}: pos_width must be 0, 2 or 4, got {widths[k]}")
    return list(itertools.starmap(DeltaParam, zip(*(cols[f] for f in _PARAM_FIELDS))))


@dataclasses.dataclass
class DeltaPayload:
    """One flush as it arrived: its spec and the two blobs (any device)."""

    spec: DeltaSpec
    positions: torch.Tensor
    values: torch.Tensor
    source: str = ""  # a file name or "broadcast", for error messages
    sums: Optional[Tuple[int, int]] = None  # blob_sums of the two blobs, once computed
    base: Optional[torch.Tensor] = None  # sender, xor_zstd: base_version's bytes beside ``values`` (the file XORs them)
    xored: bool = False  # receiver, xor_zstd: ``values`` still hold new XOR base (see :func:`unxor`)
    params_text: Optional[str] = None  # receiver: the spec's params as the JSON text that arrived (received_params)
    sealed_params: Optional[str] = None  # sender: the params' canonical JSON the last seal hashed (for the transports)
    decoded: Optional[tuple] = None  # (manifest, Positions, fault flags): unxor's structure check and decode
    wholes: Optional[list] = None  # sender, xor_ctx: every param's whole base (flat), in spec order
    idx: Optional[torch.Tensor] = None  # sender, xor_ctx: the sparse params' positions, joined in spec order
    seg_log2: Optional[int] = None  # sender, xor_ctx: its segments' size, from the flush buffer (ctx.seg_log2_for)
    facts: Optional[tuple] = None  # sender, xor_ctx found elsewhere: (class ranks and sizes, base values), joined
    coded: bool = False  # receiver, xor_ctx: ``positions`` hold the coded streams, ``values`` the dense XOR base

    def seal(self, spec_only: bool = False) -> "DeltaPayload":
        """Set the spec's checksum; ``spec_only``: only spec fields changed since the last seal (reuses the blob sums).
        The params' JSON text it hashes is kept for the transports (:func:`spec_json`, :func:`flush_file`): a spec
        of ~19k params is serialized once per flush, not twice (a spec changed after its seal is sealed again)."""
        if self.sums is None or not spec_only:
            self.sums = blob_sums(self.positions, self.values)
        self.sealed_params = params_json(self.spec)
        self.spec.checksum = flush_checksum(self.spec, self.positions, self.values, self.sums, self.sealed_params)
        return self


_DOMAIN = {POSITIONS: 0x5A17E5C0FFEE0001, VALUES: 0x5A17E5C0FFEE0002}  # the two blobs hash apart


_TAG = b"delta-mix64\0"


def _read_sums(positions: torch.Tensor, values: torch.Tensor, nan_dtype: Optional[torch.dtype] = None):
    p, _ = blob_sum(positions.contiguous(), _DOMAIN[POSITIONS])
    v, nan = blob_sum(values.contiguous(), _DOMAIN[VALUES], nan_dtype)
    sums = host_values(torch.stack([p, v]))  # the only synchronization of a checksum
    return (sums[0] & M64, sums[1] & M64), nan


def blob_sums(positions: torch.Tensor, values: torch.Tensor) -> Tuple[int, int]:
    """The two blob sums of a flush, read to the host together (the only synchronization of a checksum)."""
    return _read_sums(positions, values)[0]


def checked_sums(positions: torch.Tensor, values: torch.Tensor) -> Tuple[Tuple[int, int], Optional[torch.Tensor]]:
    """The engine's pass: :func:`blob_sums`, and whether the values hold a NaN (a 0-d bool tensor, None for
    non-float values, read later with the flush's other flags) — from the checksum's own pass where the dtype's
    NaN bits are known."""
    if not values.is_floating_point() or not values.numel():
        return _read_sums(positions, values)[0], None
    if values.dtype in NAN_BITS:
        return _read_sums(positions, values, values.dtype)
    return _read_sums(positions, values)[0], any_nan(values)


_CANONICAL = dict(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def canonical_spec(spec: "DeltaSpec", params_text: Optional[str] = None) -> bytes:
    """Every spec field except ``checksum`` as sorted-key, whitespace-free, ASCII JSON: what the checksum covers.
    ``params_text``: the params' columns as JSON text that arrived, put in place as is — equal to serializing the
    parsed columns again wherever the sender wrote them canonically (what :meth:`DeltaSpec.to_json` and
    ``to_metadata`` write), at a fraction of the cost."""
    if params_text is None:
        d = spec.to_dict()
        del d["checksum"]
        return json.dumps(d, **_CANONICAL).encode()
    d = spec.scalars()
    del d["checksum"]
    return _spliced(d, params_text).encode("utf-8", "surrogatepass")  # ASCII where canonical


def params_json(spec: "DeltaSpec") -> str:
    """The params' columns as canonical JSON."""
    return json.dumps(spec.columns(), **_CANONICAL)


def spec_json(payload: "DeltaPayload") -> str:
    """``payload``'s spec as :meth:`DeltaSpec.to_json` writes it, from the params' text the payload holds (as it
    arrived, or as sealed) where it holds one."""
    text = payload.params_text if payload.params_text is not None else payload.sealed_params
    return payload.spec.to_json() if text is None else _spliced(payload.spec.scalars(), text)


def _spliced(scalars: dict, params_text: str) -> str:
    """Canonical JSON of ``scalars`` with ``params`` set to ``params_text`` (JSON already written), in its sorted
    place: the other values are numbers, bools and checked enums, so the marker is found there only."""
    head, tail = json.dumps({**scalars, "params": 0}, **_CANONICAL).split('"params":0', 1)
    return f'{head}"params":{params_text}{tail}'


def received_params(text: str) -> Optional[str]:
    """The params' columns in a spec's JSON text as :meth:`DeltaSpec.to_json` writes it (sorted keys: ``part``
    follows ``params``), for the checksum to hash as they arrived; where the text has another layout, whatever
    this finds makes the fast check fail and the parsed spec decide (:func:`validate_payload`)."""
    a = text.find('"params":')
    b = text.find(',"part":', a)
    return text[a + 9:b] if 0 <= a < b else None


def flush_checksum(spec: "DeltaSpec", positions: torch.Tensor, values: torch.Tensor,
                   sums: Optional[Tuple[int, int]] = None, params_text: Optional[str] = None) -> str:
    """``mix64`` checksum of one flush: the canonical spec, both blob lengths and both blob sums, hashed together.

    Per word, a bijective non-linear mix of (word ^ position key): no pair of bit flips, swap or
    shift cancels the way it can in a linear sum, and two different words at one index never
    hash alike. The spec is covered too, so swapped names, shifted offsets or a changed version
    are checksum mismatches. ``sums`` reuses :func:`blob_sums` computed earlier for the same blobs.
    """
    p, v = sums if sums is not None else blob_sums(positions, values)
    n_pos = positions.numel() * positions.element_size()
    n_val = values.numel() * values.element_size()
    h = hashlib.blake2b(_TAG, digest_size=8)
    h.update(canonical_spec(spec, params_text))
    h.update(struct.pack("<QQQQ", n_pos, n_val, p, v))
    return h.hexdigest()
