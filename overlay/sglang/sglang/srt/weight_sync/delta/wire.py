"""Wire format of delta weight sync — the one module both sender and receiver import.

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

Everything here is integer tensor ops that run unchanged on CPU and CUDA; decoding and
validation never write model weights, so a request is checked whole before any write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import gc
import hashlib
import itertools
import json
import math
import operator
import struct
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import safetensors.torch
import torch
from torch._utils import _flatten_dense_tensors

from sglang.srt.weight_sync.delta import kernels, native
from sglang.srt.weight_sync.delta.mix64 import M64, NAN_BITS, blob_sum

__all__ = [
    "DeltaEncoding",
    "DeltaParam",
    "DeltaSpec",
    "DeltaPayload",
    "DeltaError",
    "DeltaStatus",
    "Refusal",
    "blob_sums",
    "canonical_spec",
    "flush_checksum",
    "encode_positions",
    "decode_positions",
    "validate_payload",
    "unxor",
    "check_structure",
    "plane_segments",
    "write_safetensors",
    "flush_file",
    "read_safetensors",
    "maybe_zstd_decompress",
    "changed_positions",
    "encode_flush",
    "HEADER_CAP",
    "WIRE_FORMAT",
    "zstd_level",
]

POSITIONS, VALUES = "__positions__", "__values__"
CHECKSUM_ALGO = "mix64"
# The spec's layout: 2 = params as parallel columns, one JSON list per DeltaParam field (1: a list of per-param
# objects, whose parse and serialization cost tens of µs per param). Engines report the one they read.
WIRE_FORMAT = 2
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# A flush's header holds one small JSON entry per param; 64 MiB is far above any real one
# and keeps a forged length from allocating the host away.
HEADER_CAP = 64 << 20
_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFFFFFF

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
_ST_NAMES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8",
    torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
}
_ST_DTYPES = {v: k for k, v in _ST_NAMES.items()}
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
    reason: Optional[str] = "fresh"  # why: "fresh" | "dirty" | "outside_load"; None when not needed
    pending: Optional[int] = None  # a version whose flushes are being applied
    request: Optional[List[int]] = None  # [version, flush] of the last delta request seen
    code: Optional[str] = None  # that request's Refusal code; None when it was applied
    received: Optional[bool] = None  # broadcasts: whether that request's blobs were received in full
    max_request_bytes: int = 0  # the most bytes one request may declare (the sender never declares more)
    xor: bool = False  # can rebuild xor_zstd values: every param this rank loaded is readable through recorded views
    xor_raw: List[str] = dataclasses.field(default_factory=list)  # names its loader never stored: xor_zstd sends them raw
    dense: List[str] = dataclasses.field(default_factory=list)  # names that must travel dense (see nan_sentinel)
    applied: Dict[str, int] = dataclasses.field(default_factory=dict)  # versions committed by kind: {"full", "delta"}
    wire_format: int = 1  # the spec layout this rank reads (:data:`WIRE_FORMAT`; an engine that does not say reads 1)

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

    @property
    def disk_only(self) -> bool:
        """Compressed file layouts: a broadcast carries raw blobs."""
        return self in (DeltaEncoding.DELTAS_ZSTD, DeltaEncoding.PLANES_ZSTD, DeltaEncoding.XOR_ZSTD)

    @property
    def plane_major(self) -> bool:
        return self in (DeltaEncoding.PLANES_ZSTD, DeltaEncoding.XOR_ZSTD)


# Measured on real AdamW steps (bench states, 2.9% density): levels 2-7 save at most 1.7% (deltas_zstd) and
# nothing for the planes (their bytes sit at the order-0 entropy: random gaps, random low mantissa bytes),
# at 1.2-4x level 1's time.
ZSTD_LEVELS = {DeltaEncoding.DELTAS_ZSTD: 1, DeltaEncoding.PLANES_ZSTD: 1, DeltaEncoding.XOR_ZSTD: 1}


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

    def seal(self, spec_only: bool = False) -> "DeltaPayload":
        """Set the spec's checksum; ``spec_only``: only spec fields changed since the last seal (reuses the blob sums).
        The params' JSON text it hashes is kept for the transports (:func:`spec_json`, :func:`flush_file`): a spec
        of ~19k params is serialized once per flush, not twice (a spec changed after its seal is sealed again)."""
        if self.sums is None or not spec_only:
            self.sums = blob_sums(self.positions, self.values)
        self.sealed_params = params_json(self.spec)
        self.spec.checksum = flush_checksum(self.spec, self.positions, self.values, self.sums, self.sealed_params)
        return self


# ---------------------------------------------------------------- checksum

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
    ``to_metadata`` write), at a fraction of the cost (~19k params: ~2.5 µs each)."""
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


# ---------------------------------------------------------------- positions


def encode_positions(idx: torch.Tensor, encoding: str) -> Tuple[torch.Tensor, int]:
    """Sorted int64 flat positions -> (uint8 little-endian bytes, pos_width)."""
    blob, ranges = encode_positions_many([idx], encoding)
    return blob, ranges[0][2]


def to_device(values: Sequence, device: torch.device) -> torch.Tensor:
    """Host ints (or rows of them) as an int64 tensor on ``device``, in a copy that does not wait for the device
    (pinned on CUDA). Through numpy: ``torch.tensor`` of a list costs 3x as much per call (the decode and the
    writes make a few per run of params)."""
    t = torch.from_numpy(np.array(list(values), dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def repeat_counts(values: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``torch.repeat_interleave(values, counts)`` for int64 ``values`` and host-known ``counts``: each value's step
    from the one before added where its run starts, then one cumsum — a third of the time of torch's CPU kernel
    (measured), and like it without a host read."""
    total = sum(counts)
    if not counts:
        return values.new_empty(0)
    out = torch.zeros(total + 1, dtype=torch.int64, device=values.device)  # empty runs at the end land past it
    starts = to_device(itertools.accumulate(counts[:-1], initial=0), values.device)
    out.index_add_(0, starts, torch.diff(values, prepend=values.new_zeros(1)))  # an empty run's step adds to the next
    return out[:total].cumsum_(0)


CPU_BATCH_BELOW = 1 << 14  # changed elements; measured on the 0.5B bench shape (2 cores)


def alone(count: int, device: torch.device) -> bool:
    """Whether a tensor's ``count`` positions are scattered or gathered on their own rather than batched per
    storage. On a GPU never (a launch costs more than the extra pass over positions); on CPU only large ones — a
    call there costs ~10 µs, while batching a large entry costs extra passes over fresh memory (join, shift)."""
    return device.type == "cpu" and count >= CPU_BATCH_BELOW


def batched(entries: list, device: torch.device) -> Tuple[list, list]:
    """(entries to batch per storage, entries to handle :func:`alone`); an entry's positions are its second item."""
    if device.type != "cpu":
        return entries, []
    return ([e for e in entries if not alone(e[1].numel(), device)], [e for e in entries if alone(e[1].numel(), device)])


def shifted_cat(idxs: Sequence[torch.Tensor], shifts: Sequence[int], device: torch.device,
                counts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``cat([idx + shift ...])`` for host-known shifts, with no host read: how both sides turn many tensors' offsets
    into one storage's, for one scatter or gather per storage instead of one per tensor. ``counts``: how many of the
    joined positions each shift applies to, in order (a run of several params' positions per tensor); default one
    shift per tensor."""
    counts = [i.numel() for i in idxs] if counts is None else counts
    return torch.cat(list(idxs)).add_(repeat_counts(to_device(shifts, device), counts))


def encode_positions_many(idxs: Sequence[torch.Tensor], encoding: str, device: Optional[torch.device] = None,
                          counts: Optional[Sequence[Sequence[int]]] = None
                          ) -> Tuple[torch.Tensor, List[Tuple[int, int, int]]]:
    """Several params' sorted positions -> (one uint8 blob, their bytes in order; per param (byte start, byte end,
    pos_width)). ``idxs`` are pieces: each the positions of one param, or with ``counts`` the joined positions of
    ``counts[i]`` params one after the other (a diff's run: joined once, not cut per param). A constant number of
    tensor ops and one host read (the widths) for all of them, whatever their count: gaps over the joined positions,
    each param's first one from -1, each param's largest in one reduction."""
    enc = DeltaEncoding(encoding)
    if counts is None:
        counts = [[i.numel()] for i in idxs]
    lengths = list(itertools.chain.from_iterable(counts))
    device = idxs[0].device if idxs else (device or torch.device("cpu"))
    runner = kernels.KERNELS.ready(SPARSE, device, sum(lengths)) if device.type == "cpu" and idxs else None
    if runner is not None:  # on CPU the native kernel, once ready: two passes, no temporaries
        pieces = [i.reshape(-1) for i in idxs]
        if all(p.dtype == torch.int64 and p.is_contiguous() for p in pieces):
            try:
                return runner.positions(pieces, counts, enc is not DeltaEncoding.INDICES,
                                        functools.partial(_pos_widths, enc))
            except DeltaError:
                raise
            except Exception as e:  # noqa: BLE001 - the torch ops encode them instead
                kernels.KERNELS.failed(SPARSE, device, e)
    return _encode_positions_torch(idxs, enc, device, lengths)


def _encode_positions_torch(idxs: Sequence[torch.Tensor], enc: DeltaEncoding, device: torch.device,
                            lengths: List[int]) -> Tuple[torch.Tensor, List[Tuple[int, int, int]]]:
    """:func:`encode_positions_many` in torch ops (any device)."""
    pieces = [i.reshape(-1) for i in idxs if i.numel()]
    live = [k for k, n in enumerate(lengths) if n]
    tops, lows = np.zeros(len(lengths), dtype=np.int64), np.zeros(len(lengths), dtype=np.int64)
    if live:
        flat = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(torch.int64)
        firsts = list(itertools.accumulate([lengths[k] for k in live], initial=0))
        if enc is DeltaEncoding.INDICES:
            ints = flat
        else:  # gap - 1 to the position before, in one new tensor (torch.diff would join and subtract into two)
            ints = torch.empty_like(flat)
            torch.sub(flat[1:], flat[:-1], out=ints[1:])
            ints[:1] = flat[:1] + 1
            ints.sub_(1)
            at = to_device(firsts[:-1], device)
            ints[at] = flat[at]  # a param's first gap counts from -1, not from the previous param's last position
        lows[live], tops[live] = _segment_range(ints, firsts)
    widths = _pos_widths(enc, tops, lows).tolist()
    # Narrowing keeps the low bytes (values fit unsigned width), and tensors are little-endian on every platform torch
    # runs on: the int16/int32 bytes are the wire's u16/u32. One conversion per run of params of one width.
    parts, ranges, at, elem = [], [], 0, 0
    for width, run in itertools.groupby(range(len(lengths)), key=lambda k: widths[k]):
        run = list(run)
        n = sum(lengths[k] for k in run)
        if n:
            parts.append(ints[elem:elem + n].to(torch.int16 if width == 2 else torch.int32).view(torch.uint8))
        for k in run:
            ranges.append((at, at + lengths[k] * width, width))
            at += lengths[k] * width
        elem += n
    blob = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return blob, ranges


def _pos_widths(enc: DeltaEncoding, tops: np.ndarray, lows: np.ndarray) -> np.ndarray:
    """Bytes per position int of each param, from its largest and smallest int (position, or gap to the one before):
    4 for ``indices``, else 2 where the gaps fit 16 bits and 4 where they fit 32. Refuses a negative one (positions
    out of order or repeated: a narrowed negative gap would decode to another, increasing, position) and one that
    fits no width."""
    if len(lows) and int(lows.min()) < 0:
        k = int(np.argmin(lows))
        if enc is DeltaEncoding.INDICES:
            raise DeltaError(f"param {k} of the flush: negative position {int(lows[k])}")
        raise DeltaError(f"param {k} of the flush: its positions are not increasing and unique (gap {int(lows[k])})")
    biggest = int(tops.max()) if len(tops) else 0
    if enc is DeltaEncoding.INDICES:
        if biggest > _U32_MAX:
            raise DeltaError(f"position {biggest} does not fit the 4-byte 'indices' encoding")
        return np.full(len(tops), 4, dtype=np.int64)
    if biggest > _U32_MAX:
        raise DeltaError(f"gap {biggest} does not fit 4 bytes")
    return np.where(tops <= _U16_MAX, 2, 4).astype(np.int64)


def _segment_range(ints: torch.Tensor, firsts: List[int]) -> Tuple[np.ndarray, np.ndarray]:
    """The smallest and the largest of each run ``ints[firsts[k]:firsts[k + 1]]`` (none empty), read to the host
    together: the one host read of :func:`encode_positions_many`. CPU: numpy's ``reduceat``, passes with no scratch;
    elsewhere a ``scatter_reduce`` each over the runs' ids."""
    if ints.device.type == "cpu":
        x = ints.numpy()
        return np.minimum.reduceat(x, firsts[:-1]), np.maximum.reduceat(x, firsts[:-1])
    seg = repeat_counts(torch.arange(len(firsts) - 1, device=ints.device), list(map(operator.sub, firsts[1:], firsts)))
    out = torch.zeros((2, len(firsts) - 1), dtype=torch.int64, device=ints.device)
    out[0].scatter_reduce_(0, seg, ints, "amin", include_self=False)
    out[1].scatter_reduce_(0, seg, ints, "amax", include_self=False)
    low, top = host_values(out)
    return np.asarray(low, dtype=np.int64), np.asarray(top, dtype=np.int64)


def decode_positions(blob: torch.Tensor, width: int, encoding: str) -> torch.Tensor:
    """uint8 little-endian bytes -> int64 flat positions (gaps decode strictly increasing)."""
    if blob.storage_offset() % width:  # a dtype view needs an aligned offset; a param's slice may not have one
        blob = blob.clone()
    ints = blob.view(torch.uint16 if width == 2 else torch.uint32).to(torch.int64)  # little-endian, as encoded
    if DeltaEncoding(encoding) is DeltaEncoding.INDICES:
        return ints
    return ints.add_(1).cumsum_(0).sub_(1)  # in place: torch's CPU cumsum into a new tensor is 2-6x slower


# ---------------------------------------------------------------- validation


def validate_payload(payload: DeltaPayload, manifest: Optional[Dict[str, Tuple[List[int], str]]]) -> List[Optional[torch.Tensor]]:
    """Check a whole flush before any write; return each param's decoded positions (None = dense).

    Checks: checksum, offsets tiling both blobs exactly, one values dtype, dense/sparse rules,
    positions in range and unique, no NaN among values, names/shapes/dtypes against the
    ``manifest`` of the first full sync (skipped when ``manifest`` is None).
    """
    spec, pos, val = payload.spec, payload.positions, payload.values
    where = f" in {payload.source}" if payload.source else ""
    if payload.xored:
        raise DeltaError(f"xor_zstd values{where} must be rebuilt from the base (unxor) before they are validated")
    _check_blobs(payload, where)
    sums, nan = checked_sums(pos, val)
    actual = flush_checksum(spec, pos, val, sums, payload.params_text)
    if actual != spec.checksum and payload.params_text is not None:  # text in another layout: the parsed spec decides
        actual = flush_checksum(spec, pos, val, sums)
    if actual != spec.checksum:
        raise DeltaError(f"checksum mismatch{where}: expected {spec.checksum or '<none>'}, got {actual} "
                         f"(positions, values or the spec corrupted)", Refusal.CHECKSUM)
    if payload.decoded is not None and payload.decoded[0] is manifest:  # unxor checked it against this manifest
        positions, flags = payload.decoded[1:]
    else:
        positions, flags = _decode_all(payload, _check_structure(payload, manifest, where))
    flags = list(flags)  # one bool per check, read together: the flush's one synchronization after the checksum
    if nan is not None:
        flags.append(nan)
    if flags and any(host_values(torch.stack(flags))):
        _check_one_by_one(payload, where)
    return positions


def check_structure(payload: DeltaPayload, manifest=None) -> List[DeltaParam]:
    """The checks that need no checksum: blob shapes, the spec's own rules and its fit to the blobs, names, shapes
    and dtypes against ``manifest``; returns the sparse params in spec order."""
    where = f" in {payload.source}" if payload.source else ""
    _check_blobs(payload, where)
    return _check_structure(payload, manifest, where)


def _check_blobs(payload: DeltaPayload, where: str) -> None:
    pos, val = payload.positions, payload.values
    if pos.dtype != torch.uint8 or pos.dim() != 1:
        raise DeltaError(f"{POSITIONS}{where} must be a 1-D uint8 tensor, got {pos.dtype} {list(pos.shape)}")
    if val.dim() != 1:
        raise DeltaError(f"{VALUES}{where} must be 1-D, got shape {list(val.shape)}")


def _check_structure(payload: DeltaPayload, manifest, where: str) -> List[DeltaParam]:
    """The spec's own rules and its fit to the blobs; returns the sparse params in spec order. A flush the
    column-wise check accepts is done; any other goes through the loop, which names what is wrong (or accepts what
    the column check could not tell, e.g. a manifest shape held as a tuple)."""
    sparse = _structure_by_columns(payload, manifest)
    return sparse if sparse is not None else _structure_one_by_one(payload, manifest, where)


_OFFSETS = operator.attrgetter("pos_start", "pos_end", "pos_width", "val_start", "val_end")


def _structure_by_columns(payload: DeltaPayload, manifest) -> Optional[List[DeltaParam]]:
    """:func:`_structure_one_by_one`'s rules on whole columns (numpy over the offsets, C-level maps over names and
    shapes): the sparse params in spec order, or None where any rule may fail. Never accepts what the loop refuses."""
    spec, val = payload.spec, payload.values
    params = spec.params
    names = list(map(operator.attrgetter("name"), params))
    if len(set(names)) != len(names):
        return None
    try:
        if any(dtype_from_str(d) != val.dtype for d in set(map(operator.attrgetter("dtype"), params))):
            return None
        numel = np.array(list(map(math.prod, map(operator.attrgetter("shape"), params))), dtype=np.int64)
        cols = np.array(list(map(_OFFSETS, params)), dtype=np.int64).reshape(-1, 5)
    except (DeltaError, OverflowError, ValueError, TypeError):
        return None
    ps, pe, w, vs, ve = cols.T
    nnz = ve - vs
    ends = (0, 0) if not len(params) else (int(pe[-1]), int(ve[-1]))
    sparse, dense = w != 0, w == 0
    widths = (4,) if DeltaEncoding(spec.encoding) is DeltaEncoding.INDICES else (2, 4)
    if (ends != (payload.positions.numel(), val.numel()) or (len(params) and (ps[0] or vs[0]))
            or (ps[1:] != pe[:-1]).any() or (vs[1:] != ve[:-1]).any() or (pe < ps).any() or (nnz < 0).any()
            or (sparse.any() and (spec.full or not sparse_allowed(val.dtype)))
            or (dense & ((pe != ps) | (nnz != numel))).any()
            or (sparse & ~np.isin(w, widths)).any() or (sparse & ((pe - ps != nnz * w) | (nnz > numel))).any()):
        return None
    if manifest is not None:
        entries = list(map(manifest.get, names))
        if None in entries or {e[1] for e in entries} - {dtype_to_str(val.dtype)}:
            return None
        if not all(map(operator.eq, map(operator.itemgetter(0), entries), map(operator.attrgetter("shape"), params))):
            return None
    return [params[k] for k in np.flatnonzero(sparse).tolist()]


def _structure_one_by_one(payload: DeltaPayload, manifest, where: str) -> List[DeltaParam]:
    """The spec's own rules and its fit to the blobs, param by param: the first param at fault is named."""
    spec, pos, val = payload.spec, payload.positions, payload.values
    pos_at = val_at = 0
    pos_n, val_n = pos.numel(), val.numel()
    seen = set()
    sparse: List[DeltaParam] = []
    widths = (4,) if DeltaEncoding(spec.encoding) is DeltaEncoding.INDICES else (2, 4)  # gaps: 2, or 4 as fallback
    dtypes: Dict[str, torch.dtype] = {}  # per-param work is host arithmetic only: each dtype name is parsed once
    for p in spec.params:
        name, width = p.name, p.pos_width
        if name in seen:
            raise DeltaError(f"param {name!r}{where}: named twice in one flush")
        seen.add(name)
        dtype = dtypes.get(p.dtype)
        if dtype is None:
            dtype = dtypes[p.dtype] = dtype_from_str(p.dtype)
            if dtype != val.dtype:
                raise DeltaError(f"param {name!r}{where}: dtype {p.dtype} differs from the flush's values dtype "
                                 f"{dtype_to_str(val.dtype)}")
        if p.pos_start != pos_at or p.val_start != val_at or p.pos_end < p.pos_start or p.val_end < p.val_start:
            raise DeltaError(f"param {name!r}{where}: offsets pos [{p.pos_start},{p.pos_end}) val [{p.val_start},"
                             f"{p.val_end}) do not tile the blobs (expected to start at pos {pos_at}, val {val_at})")
        pos_at, val_at = p.pos_end, p.val_end
        if width and not sparse_allowed(dtype):
            raise DeltaError(f"param {name!r}{where}: {p.dtype} params cannot travel sparse (no NaN sentinel); send "
                             "them dense")
        if manifest is not None:
            if name not in manifest:
                raise DeltaError(f"param {name!r}{where}: unknown parameter name (not in the manifest of the first "
                                 "full sync)", Refusal.MANIFEST)
            shape, mdtype = manifest[name]
            if (shape != p.shape and list(shape) != list(p.shape)) or mdtype != dtype_to_str(dtype):
                raise DeltaError(f"param {name!r}{where}: shape/dtype {p.shape} {dtype_to_str(dtype)} differ from the "
                                 f"manifest's {list(shape)} {mdtype}", Refusal.MANIFEST)
        if pos_at > pos_n or val_at > val_n:
            raise DeltaError(f"param {name!r}{where}: offsets run past the blobs ({pos_n} position bytes, {val_n} "
                             "values)")
        numel, nnz = math.prod(p.shape), p.val_end - p.val_start
        if not width:
            if p.pos_end != p.pos_start or nnz != numel:
                raise DeltaError(f"param {name!r}{where}: dense param needs no positions and exactly {numel} values, "
                                 f"got {p.pos_end - p.pos_start} position bytes and {nnz} values")
        else:
            if spec.full:
                raise DeltaError(f"param {name!r}{where}: a full sync must send every param dense")
            if width not in widths:
                raise DeltaError(f"param {name!r}{where}: pos_width {width} is not valid for encoding {spec.encoding}")
            if p.pos_end - p.pos_start != nnz * width:
                raise DeltaError(f"param {name!r}{where}: {p.pos_end - p.pos_start} position bytes for {nnz} values "
                                 f"of width {width}")
            if nnz > numel:
                raise DeltaError(f"param {name!r}{where}: {nnz} positions for {numel} elements")
            sparse.append(p)
    if (pos_at, val_at) != (pos.numel(), val.numel()):
        raise DeltaError(f"offsets{where} cover {pos_at} of {pos.numel()} position bytes and {val_at} of "
                         f"{val.numel()} values: blobs must be tiled exactly")
    return sparse


def unxor(payload: DeltaPayload, manifest, read_base) -> DeltaPayload:
    """An ``xor_zstd`` flush with its new values rebuilt: ``values ^ base``, before anything is trusted.

    The structure is checked first and positions are decoded clamped into each param's range (they are
    not verified yet); ``read_base(params, positions)`` returns the committed bytes at those positions,
    one tensor aligned with ``values`` (``positions[k]`` is None for a dense param: all of it). The
    checksum over the rebuilt values, in :func:`validate_payload`, then decides: a wrong base, a
    corrupted blob or a lying spec is a mismatch, never a wrong weight.
    """
    spec, val = payload.spec, payload.values
    where = f" in {payload.source}" if payload.source else ""
    if DeltaEncoding(spec.encoding) is not DeltaEncoding.XOR_ZSTD or not payload.xored:
        raise DeltaError(f"unxor needs xor_zstd values{where}, got a {spec.encoding} flush")
    positions, flags = _decode_all(payload, check_structure(payload, manifest), clamp=True)  # validate reuses it
    base = read_base(spec.params, [positions.of(p) for p in spec.params])
    if base.dtype != val.dtype or base.shape != val.shape:
        raise DeltaError(f"base values{where}: {base.dtype} {list(base.shape)} do not match the flush's "
                         f"{val.dtype} {list(val.shape)}", Refusal.NO_BASE)
    iv = INT_VIEW[val.element_size()]
    rebuilt = torch.bitwise_xor(val.view(iv), base.to(val.device).view(iv)).view(val.dtype)
    return dataclasses.replace(payload, values=rebuilt, xored=False, sums=None, decoded=(manifest, positions, flags))


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection while a sync runs: a sync makes a few Python objects per param (no cycles), and
    in a process holding a model's worth of objects each collection they trigger scans that whole heap (measured
    on the 30B-A3B topology: an engine's delta apply 0.9-1.3 s with collections, 0.75 s without)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def host_values(t: torch.Tensor) -> list:
    """How flush code reads tensor values on the host: a device-to-host copy (the synchronization on CUDA), made
    explicit on CPU too so that a dispatch mode can count it."""
    return t.to("cpu", copy=True).tolist()


_DECODE_RUN = 1 << 20  # positions per decode pass: bounds the int64 buffer a run decodes into, and keeps it in cache


@dataclasses.dataclass
class Run:
    """Sparse params of a flush (spec order) and their positions joined in one int64 tensor: ``params[k]``'s are
    ``positions[starts[k]:starts[k] + params[k].nnz]``. Writes take a run whole, with no tensor per param."""

    params: List[DeltaParam]
    positions: torch.Tensor
    starts: List[int]


class Positions:
    """A checked flush's int64 positions, per sparse param.

    Kept from the checking pass where a flush is one run, on a GPU (whose caching allocator reuses memory at no
    cost) and for ``xor_zstd`` (the base is read at them); otherwise decoded again, a run at a time into one reused
    buffer, as the writes take them: int64 positions are 4x the bytes of bf16 values, and on CPU faulting fresh
    pages in costs more than the decode itself (measured, 14M positions: 56 ms into new memory, 14 ms run by run).
    """

    def __init__(self, payload: DeltaPayload, kept: Optional[List[Run]], tops: Optional[torch.Tensor],
                 order: Dict[str, int], buffer: Optional["_RunBuffer"]):
        self._pos, self._gaps = payload.positions, _gaps(payload.spec.encoding)
        self._kept, self._tops, self._order, self._buffer = kept, tops, order, buffer
        self._where = None if kept is None else {  # name -> (its run, its start there)
            p.name: (r, a) for r, run in enumerate(kept) for p, a in zip(run.params, run.starts)}

    def wire(self) -> Tuple[torch.Tensor, bool]:
        """The flush's positions as they arrived (checked) and whether they are gaps: for a writer that decodes them
        as it writes."""
        return self._pos, self._gaps

    @property
    def kept(self) -> bool:
        """Whether every param's positions are held (else a run's tensors hold only until the next run)."""
        return self._kept is not None

    def of(self, p: DeltaParam) -> Optional[torch.Tensor]:
        """``p``'s positions in a tensor of their own (None: a dense param)."""
        if p.dense:
            return None
        if not p.nnz:
            return self._pos.new_empty(0, dtype=torch.int64)
        if self._kept is not None:
            r, a = self._where[p.name]
            return self._kept[r].positions[a:a + p.nnz]
        k = self._order[p.name]
        out = torch.empty(p.nnz, dtype=torch.int64, device=self._pos.device)
        return _decode_run(self._pos, [p], [p.nnz], self._gaps, out, self._tops[k:k + 1], self._buffer)

    def runs(self, params: Sequence[DeltaParam]) -> Iterator[Run]:
        """``params`` (sparse, none empty, in spec order) with their positions, about ``_DECODE_RUN`` positions at a
        time; a run's tensor holds until the next run is asked for."""
        if self._kept is not None:
            where = self._where
            for r, part in itertools.groupby(params, key=lambda p: where[p.name][0]):
                part = list(part)
                yield Run(part, self._kept[r].positions, [where[p.name][1] for p in part])
            return
        for run, counts in _runs(params):
            tops = self._tops[to_device([self._order[p.name] for p in run], self._pos.device)] if self._gaps else None
            x = _decode_run(self._pos, run, counts, self._gaps, self._buffer.take(sum(counts)), tops, self._buffer)
            yield Run(run, x, list(itertools.accumulate(counts[:-1], initial=0)))


class _RunBuffer:
    """The memory every run of a flush decodes in, grown to the largest run (its pages are touched once, not per
    run): the int64 positions, and aligned room for wire ints that sit off their alignment (a blob read from a
    file is a view of its bytes, wherever its writer put it; a u32 param may follow an odd number of u16 ones)."""

    def __init__(self, device: torch.device):
        self._ints = torch.empty(0, dtype=torch.int64, device=device)
        self._bytes = torch.empty(0, dtype=torch.uint8, device=device)

    def take(self, n: int) -> torch.Tensor:
        if self._ints.numel() < n:
            self._ints = torch.empty(n, dtype=torch.int64, device=self._ints.device)
        return self._ints[:n]

    def aligned(self, raw: torch.Tensor) -> torch.Tensor:
        if self._bytes.numel() < raw.numel():
            self._bytes = torch.empty(raw.numel(), dtype=torch.uint8, device=self._bytes.device)
        return self._bytes[:raw.numel()].copy_(raw)


def _gaps(encoding: str) -> bool:
    return DeltaEncoding(encoding) is not DeltaEncoding.INDICES


def _runs(params: Sequence[DeltaParam]) -> Iterator[Tuple[List[DeltaParam], List[int]]]:
    """Consecutive params in runs of about ``_DECODE_RUN`` positions (a run ends with the param that reaches it),
    each with its params' counts."""
    run: List[DeltaParam] = []
    counts: List[int] = []
    size = 0
    for p in params:
        n = p.val_end - p.val_start
        run.append(p)
        counts.append(n)
        size += n
        if size >= _DECODE_RUN:
            yield run, counts
            run, counts, size = [], [], 0
    if run:
        yield run, counts


def _decode_all(payload: DeltaPayload, sparse: List[DeltaParam], clamp: bool = False) -> Tuple[Positions, list]:
    """Check every sparse param's positions: a :class:`Positions`, and the fault flags (unread).

    Per run of about ``_DECODE_RUN`` positions the tensor ops have no host synchronization and do not grow with
    its params (a copy per stretch of one width, a cumsum, small gathers); the per-param work is host arithmetic.
    Each param's positions must come out strictly increasing (gaps do by construction; ``indices`` are flagged
    when not — unsorted but valid positions are then checked one param at a time, see :func:`_check_one_by_one`).
    ``clamp``: kept positions past a param's end are clamped to its last element after the flags saw them (safe
    to gather with; equal to the decoded positions whenever the flags pass)."""
    pos = payload.positions
    gaps = _gaps(payload.spec.encoding)
    live = [p for p in sparse if p.val_end > p.val_start]
    runs = list(_runs(live))
    sizes = [sum(c) for _, c in runs]
    keep = clamp or pos.device.type != "cpu" or sum(sizes) <= _DECODE_RUN
    buffer = _RunBuffer(pos.device)
    buffer.take(max(sizes, default=0))  # once: runs differ in size, and each growth is fresh pages
    flags, tops, kept = [], [], [] if keep else None
    for run, counts in runs:
        x = torch.empty(sum(counts), dtype=torch.int64, device=pos.device) if keep else None
        native = _native_decode(pos, run, counts, gaps, x)  # checked (and kept: decoded) in one pass
        if native is not None:
            top = native[0]
            flags.append(native[1])
        else:
            top = _scan_run(pos, run, counts, gaps, buffer, flags)
            if keep:
                x = _decode_run(pos, run, counts, gaps, x, top, buffer)
        tops.append(top)
        if keep:
            if clamp:  # one op for the run, not one per param
                x = torch.minimum(x, repeat_counts(to_device([p.numel - 1 for p in run], pos.device), counts))
            kept.append(Run(run, x, list(itertools.accumulate(counts[:-1], initial=0))))
    order = {} if keep else {p.name: k for k, p in enumerate(live)}
    top = None if keep or not tops else tops[0] if len(tops) == 1 else torch.cat(tops)
    return Positions(payload, kept, top, order, None if keep else buffer), flags


def _load_run(pos: torch.Tensor, run: Sequence[DeltaParam], counts: List[int], out: torch.Tensor,
              buffer: _RunBuffer) -> torch.Tensor:
    """A run's wire ints (u16 or u32, in any mix) as int64 in ``out``: one copy per stretch of one width."""
    at, k = 0, 0
    for width, part in itertools.groupby(run, key=operator.attrgetter("pos_width")):
        part = list(part)
        a, b, n = part[0].pos_start, part[-1].pos_end, sum(counts[k:k + len(part)])
        k += len(part)
        raw = pos[a:b] if b - a == n * width else torch.cat([pos[p.pos_start:p.pos_end] for p in part])
        if raw.storage_offset() % width:  # a dtype view needs an aligned offset
            raw = buffer.aligned(raw)
        out[at:at + n].copy_(raw.view(torch.uint16 if width == 2 else torch.uint32))  # little-endian, as encoded
        at += n
    return out[:at]


def _native_decode(pos: torch.Tensor, run: Sequence[DeltaParam], counts: List[int], gaps: bool,
                   out: Optional[torch.Tensor]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """:data:`SPARSE`'s decode of a run on CPU, once ready: (each param's last position, the run's fault flag), the
    positions into ``out`` unless None. One pass over the wire ints, no int64 copy of them to widen, sum or check.
    None where it does not run (a device; not ready; failed): the torch ops then do it."""
    runner = kernels.KERNELS.ready(SPARSE, pos.device, sum(counts)) if pos.device.type == "cpu" else None
    if runner is None:
        return None
    try:
        return runner.decode(pos, list(map(_POS_START, run)), list(map(_POS_WIDTH, run)), counts,
                             [p.numel for p in run], gaps, out)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run leaves the torch ops, never a wrong decode
        kernels.KERNELS.failed(SPARSE, pos.device, e)
        return None


_POS_START, _POS_WIDTH = operator.attrgetter("pos_start"), operator.attrgetter("pos_width")


def _scan_run(pos: torch.Tensor, run: Sequence[DeltaParam], counts: List[int], gaps: bool, buffer: _RunBuffer,
              flags: list) -> torch.Tensor:
    """Check one run's positions (loaded into ``buffer``), appending its fault flags; return each param's largest
    position (its last: positions increase), which :func:`_decode_run` needs to decode the run in one pass."""
    device = pos.device
    ends = list(itertools.accumulate(counts, initial=0))
    x = _load_run(pos, run, counts, buffer.take(ends[-1]), buffer)
    if gaps:  # a param's last position: the sum of its (gap + 1), less 1
        top = _segment_sums(x, ends).add_(to_device(counts, device)).sub_(1)
    else:  # absolute: strictly increasing within each param (a param's start may be below the last one's end)
        rising = x[1:] > x[:-1]
        if len(run) > 1:
            rising[to_device(ends[1:-1], device) - 1] = True
        flags.append(~rising.all())
        top = x[to_device([e - 1 for e in ends[1:]], device)]
    flags.append((top >= to_device([p.numel for p in run], device)).any())
    return top


def _segment_sums(x: torch.Tensor, ends: List[int]) -> torch.Tensor:
    """The sum of each run ``x[ends[k]:ends[k + 1]]`` (none empty); ``x`` may be overwritten. CPU: numpy's
    ``add.reduceat``, one pass (torch's cumsum runs on one thread, ~4x slower); elsewhere a cumsum in place and
    two gathers."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.add.reduceat(x.numpy(), ends[:-1]))
    first, last = to_device(ends[:-1], x.device), to_device([e - 1 for e in ends[1:]], x.device)
    before = x[first]
    x.cumsum_(0)
    return x[last] - x[first] + before


def _decode_run(pos: torch.Tensor, run: Sequence[DeltaParam], counts: List[int], gaps: bool, out: torch.Tensor,
                top: Optional[torch.Tensor], buffer: _RunBuffer) -> torch.Tensor:
    """One run's positions, in ``out``. Gaps: each param's first (gap + 1) less the last position of the param
    before it in the run, plus 1 (from :func:`_scan_run`'s ``top``), so that one running sum over the whole run
    restarts at every param's start: no per-param pass, no repeat."""
    if _native_decode(pos, run, counts, gaps, out) is not None:
        return out[:sum(counts)]
    x = _load_run(pos, run, counts, out, buffer)
    if gaps:
        x += 1
        first = to_device(itertools.accumulate(counts[:-1], initial=0), pos.device)
        x.index_add_(0, first, torch.cat([top.new_zeros(1), top[:-1]]).add_(1).neg_())
        x.cumsum_(0)
    return x


def _check_one_by_one(payload: DeltaPayload, where: str) -> None:
    """A flush failed a batched check: find the param at fault, one by one; return if there is none (``indices``
    positions that are unique and in range but not in increasing order are valid)."""
    spec, pos, val = payload.spec, payload.positions, payload.values
    for p in spec.params:
        tag = f"param {p.name!r}{where}"
        if not p.dense and p.nnz:
            idx = decode_positions(pos[p.pos_start:p.pos_end], p.pos_width, spec.encoding)
            if int(idx.max()) >= p.numel:
                raise DeltaError(f"{tag}: position {int(idx.max())} out of range for {p.numel} elements")
            s = torch.sort(idx).values
            dup = (s[1:] == s[:-1]).nonzero()
            if dup.numel():
                raise DeltaError(f"{tag}: duplicate position {int(s[int(dup[0])])}")
        if val.is_floating_point() and bool(nan_mask(val[p.val_start:p.val_end]).any()):
            raise DeltaError(f"{tag}: NaN among values (no weight is NaN, and NaN means 'unchanged' to a "
                             "loader)")


# ---------------------------------------------------------------- safetensors + zstd


def write_safetensors(payload_spec: DeltaSpec, positions: torch.Tensor, values: torch.Tensor,
                      params_text: Optional[str] = None) -> bytes:
    """Serialize one flush as a safetensors file (two tensors + the spec as ``__metadata__``; ``params_text``: its
    params as JSON, already written); plane-major encodings store each param's segments byte-plane by byte-plane
    (see :func:`plane_segments`)."""
    pos = positions.detach().reshape(-1).to("cpu").contiguous()
    val = values.detach().reshape(-1).to("cpu").contiguous()
    if DeltaEncoding(payload_spec.encoding).plane_major:
        pos_seg, val_seg = plane_segments(payload_spec, pos.numel(), val.numel(), val.element_size())
        if pos_seg:
            pos = torch.from_numpy(_to_planes(pos.numpy(), pos_seg))
        if val_seg:
            val = torch.from_numpy(_to_planes(val.view(torch.uint8).numpy(), val_seg)).view(val.dtype)
    return safetensors.torch.save({POSITIONS: pos, VALUES: val}, metadata=payload_spec.to_metadata(params_text))


def plane_segments(spec: DeltaSpec, pos_bytes: int, n_values: int, value_size: int):
    """Byte segments ``(start, elements, width)`` that plane-major layouts transpose, for positions and values.

    Checked against the blob sizes before any byte moves (a file's planes must agree with its spec):
    the spec is not trusted yet, and a transposition of a wrong length would read past a segment.
    """
    pos_seg, val_seg = [], []
    pos_at = val_at = 0
    for p in spec.params:
        nnz, width = p.val_end - p.val_start, p.pos_width
        if (p.pos_start, p.val_start) != (pos_at, val_at) or nnz < 0 or p.pos_end - p.pos_start != nnz * width:
            raise DeltaError(f"param {p.name!r}: its planes disagree with the spec (position bytes "
                             f"[{p.pos_start},{p.pos_end}) for {nnz} values of width {width}, expected to start at "
                             f"pos {pos_at}, val {val_at})")
        if width > 1 and nnz:
            pos_seg.append((p.pos_start, nnz, width))
        if value_size > 1 and nnz:
            val_seg.append((p.val_start * value_size, nnz, value_size))
        pos_at, val_at = p.pos_end, p.val_end
    if (pos_at, val_at) != (pos_bytes, n_values):
        raise DeltaError(f"planes of {pos_bytes} position bytes and {n_values} values disagree with the spec "
                         f"({pos_at} and {val_at}): a truncated or padded plane")
    return pos_seg, val_seg


_PLANE_BATCH_BELOW = 1 << 12  # elements: a segment this small is transposed with its neighbours, not alone
_PLANE_BATCH_ELEMENTS = 1 << 20  # elements per batch (bounds its two int64 index arrays)


def _plane_runs(segments):
    """The segments in order as ``(start, n, w)`` alone, or as batches ``[(start, n, w), ...]`` of adjacent small
    segments of one width 2 or 4: a model with many small params has a few numpy calls per batch, not per param."""
    out, batch, size = [], [], 0
    for seg in segments:
        start, n, w = seg
        joins = batch and w == batch[-1][2] and start == batch[-1][0] + batch[-1][1] * w
        if batch and (not joins or size >= _PLANE_BATCH_ELEMENTS or n >= _PLANE_BATCH_BELOW):
            out.append(batch if len(batch) > 1 else batch[0])
            batch, size = [], 0
        if n < _PLANE_BATCH_BELOW and w in (2, 4):
            batch.append(seg)
            size += n
        else:
            out.append(seg)
    if batch:
        out.append(batch if len(batch) > 1 else batch[0])
    return out


def _plane_index(batch):
    """(first byte, bytes, width, per element: its byte in plane 0 of its segment, relative to the first byte; the
    step from one plane to the next, i.e. its segment's element count) for a batch of adjacent segments."""
    starts, ns = (np.array(c, dtype=np.int64) for c in zip(*[(a, n) for a, n, _ in batch]))
    w, first = batch[0][2], batch[0][0]
    ends = np.cumsum(ns)
    at = np.arange(ends[-1], dtype=np.int64)
    at += np.repeat(starts - first - (ends - ns), ns)  # element i of a segment: its start + i
    return first, int(ends[-1]) * w, w, at, np.repeat(ns, ns)


def _to_planes(blob, segments):
    """Element-major -> plane-major per segment (numpy uint8, on the host: files are written there)."""
    if not segments:
        return blob
    out = np.empty_like(blob)  # the segments tile the blob
    for run in _plane_runs(segments):
        if isinstance(run, list):
            first, size, w, at, step = _plane_index(run)
            elems = blob[first:first + size].view(np.uint16 if w == 2 else np.uint32)
            dst = out[first:first + size]
            for k in range(w):
                dst[at + k * step] = (elems >> (8 * k)).astype(np.uint8)
            continue
        start, n, w = run
        out[start:start + n * w].reshape(w, n)[:] = blob[start:start + n * w].reshape(n, w).T
    return out


def _from_planes(blob, segments):
    """Plane-major -> element-major. The segments tile the blob (``plane_segments`` checked it); 2- and 4-byte
    elements are rebuilt by shifts and ors on whole planes, ~3x a strided byte copy."""
    if not segments:
        return blob
    out = np.empty_like(blob)
    for run in _plane_runs(segments):
        if isinstance(run, list):
            first, size, w, at, step = _plane_index(run)
            it = np.uint16 if w == 2 else np.uint32
            src, acc = blob[first:first + size], out[first:first + size].view(it)
            acc[:] = src[at]
            for k in range(1, w):
                acc |= np.left_shift(src[at + k * step], 8 * k, dtype=it)
            continue
        start, n, w = run
        src, dst = blob[start:start + n * w], out[start:start + n * w]
        if w in (2, 4):
            it = np.uint16 if w == 2 else np.uint32
            acc = dst.view(it)
            np.copyto(acc, src[:n])
            for k in range(1, w):
                np.bitwise_or(acc, np.left_shift(src[k * n:(k + 1) * n], 8 * k, dtype=it), out=acc)
        else:
            dst.reshape(n, w)[:] = src.reshape(w, n).T
    return out


def as_parts(payloads: Sequence[DeltaPayload]) -> List[DeltaPayload]:
    """Number the files of one request from one source (``part``, ``last_part`` on the last) and re-seal their specs."""
    for k, p in enumerate(payloads):
        p.spec.part, p.spec.last_part = k, k == len(payloads) - 1
        p.seal(spec_only=True)
    return list(payloads)


def flush_file(payload: DeltaPayload, zstd_level: Optional[int] = None) -> bytes:
    """One flush as a disk file: safetensors, zstd-compressed when ``zstd_level`` is given (every disk-only
    encoding); ``xor_zstd`` files hold ``values XOR base``."""
    values = payload.values
    if DeltaEncoding(payload.spec.encoding) is DeltaEncoding.XOR_ZSTD:
        if payload.base is None or payload.base.shape != values.shape or payload.base.dtype != values.dtype:
            raise DeltaError("an xor_zstd flush needs its base values, one per value")
        iv = INT_VIEW[values.element_size()]
        values = torch.bitwise_xor(values.view(iv), payload.base.to(values.device).view(iv)).view(values.dtype)
    data = write_safetensors(payload.spec, payload.positions, values, payload.sealed_params)
    if zstd_level is None:
        return data
    import zstandard

    return zstandard.ZstdCompressor(level=zstd_level).compress(data)


def maybe_zstd_decompress(data: bytes, max_bytes: int, name: str = "") -> bytes:
    """Decompress if the bytes start with the zstd magic; refuse output above ``max_bytes``."""
    if data[:4] != ZSTD_MAGIC:
        return data
    import zstandard

    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise DeltaError(f"file {name!r}: bad zstd frame ({e})") from None
    if size > max_bytes:
        raise DeltaError(f"file {name!r}: zstd output exceeds the {max_bytes}-byte bound")
    if size >= 0:  # the frame declares its size (our writer's do): one exact allocation, no streaming copies
        try:
            return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
        except zstandard.ZstdError as e:
            raise DeltaError(f"file {name!r}: bad zstd frame ({e})") from None
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(data)
        while len(out) <= max_bytes:
            chunk = reader.read(min(max_bytes + 1 - len(out), 64 << 20))
            if not chunk:
                break
            out += chunk
    except zstandard.ZstdError as e:
        raise DeltaError(f"file {name!r}: bad zstd frame ({e})") from None
    if len(out) > max_bytes:
        raise DeltaError(f"file {name!r}: zstd output exceeds the {max_bytes}-byte bound")
    return bytes(out)


def _raw_bytes(data: bytes) -> torch.Tensor:
    """A uint8 tensor over the library's bytes, without another copy (read-only: nothing writes into a
    received blob; decoding, rebuilding and writing to the model make new tensors)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8)


def read_safetensors(data: bytes, name: str = "") -> DeltaPayload:
    """Parse one (already decompressed) flush file: header cap, exactly the two tensors, and their bytes tiling the
    body (what the ``safetensors`` library checks too); the two blobs are views of ``data``, not copies (the
    library's reader copies each tensor into fresh memory: ~40% of a read on CPU, most of it page faults)."""
    tag = f"file {name!r}"
    if len(data) < 8:
        raise DeltaError(f"{tag}: truncated ({len(data)} bytes, no safetensors header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > HEADER_CAP or n > len(data) - 8:
        raise DeltaError(f"{tag}: safetensors header length {n} exceeds "
                         f"{'the file' if n <= HEADER_CAP else f'the {HEADER_CAP}-byte cap'}")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise DeltaError(f"{tag}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or set(header) != {"__metadata__", POSITIONS, VALUES}:
        raise DeltaError(f"{tag}: must hold exactly {POSITIONS}, {VALUES} and __metadata__")
    spec = DeltaSpec.from_metadata(header["__metadata__"])
    body_len = len(data) - 8 - n
    tensors = {}
    for key in (POSITIONS, VALUES):
        t = header[key]
        try:
            dtype = _ST_DTYPES[t["dtype"]]
            (start, end), shape = t["data_offsets"], t["shape"]
        except (KeyError, TypeError, ValueError):
            raise DeltaError(f"{tag}: malformed entry for {key}") from None
        if (not isinstance(shape, list) or len(shape) != 1 or type(shape[0]) is not int
                or not (0 <= start <= end <= body_len) or (end - start) != shape[0] * torch.empty((), dtype=dtype).element_size()):
            raise DeltaError(f"{tag}: {key} offsets [{start},{end}) / shape {shape} do not fit the "
                             f"{body_len}-byte body (truncated file?)")
        tensors[key] = (dtype, start, end)
    (a, b), (c, d) = sorted(v[1:] for v in tensors.values())
    if a != 0 or b != c or d != body_len:
        raise DeltaError(f"{tag}: not a valid safetensors file (its tensors leave a hole, overlap or do not end "
                         f"the {body_len}-byte body)")
    raw = _raw_bytes(data)
    pos, val = (raw[8 + n + tensors[k][1]:8 + n + tensors[k][2]] for k in (POSITIONS, VALUES))
    val_dtype = tensors[VALUES][0]
    size = torch.empty((), dtype=val_dtype).element_size()
    if val.storage_offset() % size:  # a dtype view needs an aligned offset (the library's writer aligns it)
        val = val.clone()
    enc = DeltaEncoding(spec.encoding)
    if enc.plane_major:
        try:
            pos_seg, val_seg = plane_segments(spec, pos.numel(), val.numel() // size, size)
        except DeltaError as e:
            raise DeltaError(f"{tag}: {e}") from None
        if pos_seg:
            pos = torch.from_numpy(_from_planes(pos.numpy(), pos_seg))
        if val_seg:
            val = torch.from_numpy(_from_planes(val.numpy(), val_seg))
    return DeltaPayload(spec, pos, val.view(val_dtype) if val_dtype != torch.uint8 else val, source=name,
                        xored=enc is DeltaEncoding.XOR_ZSTD, params_text=header["__metadata__"]["params"])


# ---------------------------------------------------------------- encoding a flush

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def nan_mask(t: torch.Tensor) -> torch.Tensor:
    """``isnan`` from the raw bits (|bits| above the largest finite/inf pattern): integer ops, ~1.5x faster on
    CPU, and defined for fp8 on every device."""
    if t.dtype not in NAN_BITS:
        return torch.isnan(t)
    int_dtype, abs_mask, inf_bits = NAN_BITS[t.dtype]
    return (t.view(int_dtype) & abs_mask) > inf_bits


def any_nan(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds a NaN, as a 0-d bool tensor (read with the flush's other flags: no synchronization here)."""
    return nan_mask(t).any()


def _cat(ts: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.cat`` of flat tensors that takes no tensor too; always new memory (a flush's blobs never alias what the
    sender keeps or the caller's tensors), on CPU advised as huge pages (:func:`native.empty`)."""
    if not ts:
        return torch.empty(0, dtype=dtype, device=device)
    if device.type == "cpu" and all(t.dtype == dtype for t in ts):  # (an out= of another dtype would convert)
        return torch.cat(list(ts), out=native.empty(sum(t.numel() for t in ts), dtype))
    return torch.cat(list(ts))


def gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``flat[idx]`` through an integer view: the same bits, and index kernels that lack fp8 on some devices."""
    return flat.view(INT_VIEW[flat.element_size()])[idx].view(flat.dtype)


_DIFF_BLOCK = 1 << 20  # elements per block of the CPU diff: a block's operands stay in cache
_DIFF_POOL = None


def _diff_pool():
    global _DIFF_POOL
    if _DIFF_POOL is None:
        import concurrent.futures
        import os

        _DIFF_POOL = concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1), thread_name_prefix="delta-diff")
    return _DIFF_POOL


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    """A diff compares like with like: the same shape and dtype on both sides, else a clear refusal."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise DeltaError(f"cannot diff {old.dtype} {list(old.shape)} against {new.dtype} {list(new.shape)}")


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions whose bytes differ (dtype-agnostic, no arithmetic: -0.0 vs 0.0 and NaN payloads count)."""
    _check_pair(old, new)
    iv = INT_VIEW[new.element_size()]
    a, b = old.detach().reshape(-1).view(iv), new.detach().reshape(-1).view(iv)
    if new.device.type != "cpu":
        return torch.nonzero(a != b).reshape(-1)
    return _cpu_changes(a, b, False, False)[0]


def _cpu_changes(a: torch.Tensor, b: torch.Tensor, values: bool, olds: bool) -> Tuple[torch.Tensor, ...]:
    """CPU diff of two flat integer views: positions whose bits differ, and with ``values``/``olds`` ``b``'s/``a``'s
    bits there. numpy's flatnonzero is ~2x torch.nonzero and releases the GIL, so blocks run on all cores; each
    block's values are gathered while its operands are in cache (a gather afterwards is another pass, on one core)."""
    na, nb = a.numpy(), b.numpy()

    def block(s: int):
        x, y = na[s:s + _DIFF_BLOCK], nb[s:s + _DIFF_BLOCK]
        hits = np.flatnonzero(x != y)
        return hits + s, y[hits] if values else None, x[hits] if olds else None

    parts = [block(0)] if na.size <= _DIFF_BLOCK else list(_diff_pool().map(block, range(0, na.size, _DIFF_BLOCK)))
    return tuple(torch.from_numpy(np.concatenate([p[k] for p in parts])) if wanted else None
                 for k, wanted in enumerate((True, values, olds)))


_NUMPY_DIFF = True  # CPU: numpy's multi-threaded flatnonzero per param (a CPU has no synchronization to batch away)
_SMALL_DIFF = 1 << 16  # CPU: params up to this many elements are diffed joined (per-param calls cost more than a copy)


@dataclasses.dataclass
class Found:
    """What one diff found for params it compared together (``ks``: their indices among the pairs): each param's
    changed positions (from 0) and ``new``'s values there, joined in ``ks`` order, ``counts`` per param; ``olds``:
    ``old``'s values at the same positions (``xor_zstd``'s bases), when asked for. The sender keeps a run joined from
    diff to flush (:class:`Gathered`): cutting it per param costs a view each, and joining again a copy each."""

    ks: List[int]
    counts: List[int]
    idx: torch.Tensor
    values: torch.Tensor
    olds: Optional[torch.Tensor] = None

    @functools.cached_property
    def starts(self) -> List[int]:
        """Where each param's share begins in ``idx``/``values`` (one past the last at the end)."""
        return list(itertools.accumulate(self.counts, initial=0))

    def share(self, j: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The ``j``-th param's (positions, values, olds): views."""
        a, b = self.starts[j], self.starts[j + 1]
        return self.idx[a:b], self.values[a:b], None if self.olds is None else self.olds[a:b]


def _small_cpu_diffs(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], extra: Sequence[Optional[torch.Tensor]],
                     want_olds: bool) -> List[Found]:
    """The small CPU params among ``pairs`` without staged positions, per dtype: their old and new bytes joined, one
    compare, one flatnonzero, one gather of the new values (and the old ones): one :class:`Found` per dtype."""
    out: List[Found] = []
    groups: Dict[torch.dtype, List[int]] = {}
    for k, ((old, new), more) in enumerate(zip(pairs, extra)):
        if new.numel() <= _SMALL_DIFF and old.shape == new.shape and old.dtype == new.dtype and \
                (more is None or not more.numel()):
            groups.setdefault(new.dtype, []).append(k)
    for dtype, ks in groups.items():
        if len(ks) < 2:
            continue
        iv = INT_VIEW[dtype.itemsize]
        a, b = _joined([pairs[k][0] for k in ks], iv).numpy(), _joined([pairs[k][1] for k in ks], iv).numpy()
        hits = np.flatnonzero(a != b)
        starts = np.cumsum([0] + [pairs[k][1].numel() for k in ks])
        counts = np.diff(np.searchsorted(hits, starts))
        local = torch.from_numpy(hits - np.repeat(starts[:-1], counts))
        olds = torch.from_numpy(a[hits]).view(dtype) if want_olds else None
        out.append(Found(ks, counts.tolist(), local, torch.from_numpy(b[hits]).view(dtype), olds))
    return out


_SHAPE, _DTYPE, _IS_CPU = operator.attrgetter("shape"), operator.attrgetter("dtype"), operator.attrgetter("is_cpu")


def like_pairs(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> bool:
    """Whether each ``olds[k]`` has ``news[k]``'s shape and dtype, in C-level maps (a chunk of a MoE model holds
    thousands of tensors: a Python call per pair costs more than the diff of a small one)."""
    return list(map(_SHAPE, olds)) == list(map(_SHAPE, news)) and list(map(_DTYPE, olds)) == list(map(_DTYPE, news))


def _native_diffs(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], extra: Sequence[Optional[torch.Tensor]],
                  want_olds: bool, alike: bool) -> Optional[List[Found]]:
    """The CPU pairs without staged positions diffed by the native kernel (:data:`SPARSE`), one call per dtype for
    all of them, large or small: one :class:`Found` per dtype. None while the kernels are not ready in this process
    (or once they failed): then numpy diffs them."""
    cpu = torch.device("cpu")
    olds, news = zip(*pairs)
    runner = kernels.KERNELS.ready(SPARSE, cpu, sum(map(torch.Tensor.numel, news)))
    if runner is None:
        return None
    if not alike and not like_pairs(olds, news):
        for old, new in pairs:  # the first that differs, refused by name
            _check_pair(old, new)
    dtypes = list(map(_DTYPE, news))
    groups: Dict[torch.dtype, List[int]] = {}
    if extra.count(None) == len(extra) and dtypes.count(dtypes[0]) == len(dtypes):  # the usual chunk: one call
        groups[dtypes[0]] = list(range(len(dtypes)))
    else:
        for k, (dtype, more) in enumerate(zip(dtypes, extra)):
            if more is None or not more.numel():
                groups.setdefault(dtype, []).append(k)
    out = []
    try:
        for dtype, ks in groups.items():
            sides = [olds, news] if len(ks) == len(pairs) else [[pairs[k][j] for k in ks] for j in (0, 1)]
            # read by address: a view's order needs a copy
            sides = [ts if all(map(torch.Tensor.is_contiguous, ts)) else
                     [t if t.is_contiguous() else t.detach().contiguous() for t in ts] for ts in sides]
            idx, values, at_old, counts = runner.diff(*sides, want_olds)
            out.append(Found(ks, counts, idx, values, at_old))
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run leaves numpy's diff, never a wrong one
        kernels.KERNELS.failed(SPARSE, cpu, e)
        return None
    return out


def _test_sparse(runner, device: torch.device) -> None:
    """The native sparse kernels against the numpy and torch ops they replace, bit for bit; raises on any
    difference. The diff for every width: tensors of odd lengths (empty, shorter than a word, longer than a step),
    hits in every lane, a whole word and a whole tensor changed, shares that cut tensors and slots that fill up
    mid-tensor (more parts). Its positions encoded both ways (gaps of both widths, a param without positions) and
    decoded again from an unaligned copy (a position past its tensor and ``indices`` out of order flagged) and
    written from there with the values into blocks of one storage holding the old tensors, which must then equal the
    new ones (a position past its block refused); the diff scattered with its values into copies of the old tensors,
    which must equal the new ones too."""
    g = torch.Generator().manual_seed(11)
    for width, iv in INT_VIEW.items():
        sizes = [0, 1, 3, 8, 9, 4097, 70001, 300000, 1 << 20, 5]
        olds = [torch.randint(-(1 << 62), 1 << 62, (n,), generator=g).view(torch.uint8)[:n * width].view(iv)
                if n else torch.zeros(0, dtype=iv) for n in sizes]
        news = [t.clone() for t in olds]
        for k, t in enumerate(news):
            if t.numel():
                hit = torch.randint(0, t.numel(), (t.numel() // (k + 2) + 1,), generator=g)
                t.view(torch.uint8).view(-1, width)[hit, torch.randint(0, width, hit.shape, generator=g)] ^= 0x81
                t[:8 // width] += 1  # a whole word
        news[6].add_(1)  # every element of a tensor
        want = [np.flatnonzero(a.numpy() != b.numpy()) for a, b in zip(olds, news)]
        for want_olds, first in ((False, None), (True, None), (True, 2 * width + 1)):
            idx, values, at_old, counts = runner.diff(olds, news, want_olds, first)
            if counts != [w.size for w in want] or not np.array_equal(idx.numpy(), np.concatenate(want)):
                raise RuntimeError(f"native diff: positions of {width}-byte elements differ from numpy's")
            for got, side in ((values, news), (at_old, olds if want_olds else None)):
                if side is not None and not np.array_equal(
                        got.numpy(), np.concatenate([t.numpy()[w] for t, w in zip(side, want)])):
                    raise RuntimeError(f"native diff: elements of {width}-byte tensors differ from numpy's")
        for encoding in ("deltas", "indices"):
            enc = DeltaEncoding(encoding)
            got = runner.positions([idx[:counts[0] + counts[1] + counts[2]], idx[sum(counts[:3]):]],
                                   [counts[:3], counts[3:]], enc is not DeltaEncoding.INDICES,
                                   functools.partial(_pos_widths, enc))
            want_blob = _encode_positions_torch([idx], enc, device, counts)
            if not torch.equal(got[0], want_blob[0]) or got[1] != want_blob[1]:
                raise RuntimeError(f"native positions: the {encoding} blob differs from torch's")
            shifted = torch.empty(got[0].numel() + 1, dtype=torch.uint8)[1:].copy_(got[0])  # off any alignment
            out = torch.full((idx.numel(),), -7, dtype=torch.int64)
            numel = [t.numel() for t in olds]
            tops, bad = runner.decode(shifted, [a for a, _, _ in got[1]], [w for _, _, w in got[1]], counts, numel,
                                      enc is not DeltaEncoding.INDICES, out)
            lasts = [int(w[-1]) if w.size else -1 for w in want]
            if not torch.equal(out, idx) or tops.tolist() != lasts or bool(bad):
                raise RuntimeError(f"native decode: the {encoding} positions differ from the encoded ones")
            k = next(k for k, n in enumerate(counts) if n)  # its last position one past a tensor that short
            if not bool(runner.decode(shifted, [a for a, _, _ in got[1]], [w for _, _, w in got[1]], counts,
                                      numel[:k] + [lasts[k]] + numel[k + 1:], enc is not DeltaEncoding.INDICES,
                                      None)[1]):
                raise RuntimeError(f"native decode: a {encoding} position out of range is not flagged")
            flat, firsts = torch.cat(olds), list(itertools.accumulate(numel, initial=0))[:-1]  # blocks of a storage
            args = ([0] * len(olds), firsts, numel, shifted, [a for a, _, _ in got[1]], [w for _, _, w in got[1]],
                    counts, values, list(itertools.accumulate(counts, initial=0))[:-1], enc is not DeltaEncoding.INDICES)
            runner.write([flat], *args)
            if not torch.equal(flat, torch.cat(news)):
                raise RuntimeError(f"native write: the {encoding} positions wrote other elements than the diff's")
            try:
                runner.write([flat.clone()], *args[:2], numel[:k] + [lasts[k]] + numel[k + 1:], *args[3:])
            except RuntimeError:
                pass
            else:
                raise RuntimeError(f"native write: a {encoding} position out of its block is written")
        tiny = torch.tensor([5, 3], dtype=torch.int32).view(torch.uint8)  # indices out of order; gaps to 5, 9
        if not bool(runner.decode(tiny, [0], [4], [2], [10], False, None)[1]) or \
                bool(runner.decode(tiny, [0], [4], [2], [10], True, None)[1]) or \
                runner.decode(tiny, [0], [4], [2], [10], True, None)[0].tolist() != [9]:
            raise RuntimeError("native decode: positions out of order are not flagged, or gaps decode wrong")
        folded = [t.clone() for t in olds]
        runner.scatter(folded, counts, idx, values)
        if not all(torch.equal(a, b) for a, b in zip(folded, news)):
            raise RuntimeError(f"native scatter: {width}-byte tensors differ from the diffed ones")


# The native CPU sparse kernels (the sender's diff, the positions' encoding, the scatter of its snapshot fold): built
# and tested like the mix64 kernels (:mod:`kernels`), CPU only (a device runs torch's ops). The engine's direct writes
# stay ``index_copy_``: at a few percent density they touch most cache lines of a tensor, so memory decides their
# time, and this scatter measured no faster there.
SPARSE = kernels.Kernel("sparse", None, (), _test_sparse, cpu=native.SPARSE)


_JOIN_BYTES = 64 << 20  # device diff: params are compared joined in batches of about this many bytes per side


def changes_many(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                 extra: Optional[Sequence[Optional[torch.Tensor]]] = None, want_olds: bool = False,
                 alike: bool = False) -> List[Found]:
    """What changed in each ``(old, new)`` pair: the positions whose bytes differ, united with its ``extra``
    positions (sorted, unique), ``new``'s values there, and with ``want_olds`` ``old``'s (for ``xor_zstd``) — as
    :class:`Found` runs that cover every pair once, in no particular order. On a device, per batch of params
    (:func:`_joined_diff`): a constant number of ops and two host reads, whatever the params' count — a per-param
    op is a kernel launch each, a per-param ``nonzero`` a host synchronization each. On CPU small params are
    joined per dtype, large ones diffed alone (numpy, on all cores). ``alike``: the caller found every pair alike in
    shape and dtype (:func:`like_pairs`), which the native diff then does not check again."""
    extra = list(extra) if extra is not None else [None] * len(pairs)
    if not pairs:
        return []
    if _NUMPY_DIFF and all(map(_IS_CPU, map(operator.itemgetter(1), pairs))):
        out = _native_diffs(pairs, extra, want_olds, alike)
        if out is None:
            out = _small_cpu_diffs(pairs, extra, want_olds)
        joined = set(itertools.chain.from_iterable(f.ks for f in out))
        for k, ((old, new), more) in enumerate(zip(pairs, extra) if len(joined) < len(pairs) else ()):
            if k in joined:
                continue
            _check_pair(old, new)
            iv = INT_VIEW[new.element_size()]
            a, b = old.detach().reshape(-1), new.detach().reshape(-1)
            if more is not None and more.numel():  # staged positions: the values are gathered at the union
                idx = torch.from_numpy(np.union1d(_cpu_changes(a.view(iv), b.view(iv), False, False)[0].numpy(),
                                                  more.cpu().numpy()))
                values, olds = gather(b, idx), gather(a, idx) if want_olds else None
            else:
                idx, values, olds = _cpu_changes(a.view(iv), b.view(iv), True, want_olds)
                values, olds = values.view(new.dtype), None if olds is None else olds.view(new.dtype)
            out.append(Found([k], [idx.numel()], idx, values, olds))
        return out
    out: List[Found] = []
    batch: List[int] = []
    size = 0
    for k, (old, new) in enumerate(pairs):  # batches bound the joined copies' memory (a large param goes alone)
        _check_pair(old, new)
        batch.append(k)
        size += new.nbytes
        if size >= _JOIN_BYTES or k == len(pairs) - 1:
            out += _joined_diff(pairs, batch, extra, want_olds)
            batch, size = [], 0
    return out


def _joined(ts: Sequence[torch.Tensor], iv: torch.dtype) -> torch.Tensor:
    """Tensors of one dtype flat and joined, as same-width integers: a view where they already lie end to end in one
    storage (:func:`_adjacent`), else one C++ call for all of them (the flatten that PyTorch's and Megatron's
    bucketing use) — a flat integer view per tensor from Python costs three dispatched ops each, ~19k tensors per
    side on a MoE model."""
    if len(ts) == 1:
        return ts[0].detach().reshape(-1).view(iv)
    run = _adjacent(ts)
    if run is not None:
        return run.view(iv)
    with torch.no_grad():
        return _flatten_dense_tensors(ts).view(iv)


def _adjacent(ts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """``ts`` (one dtype, none empty) as one flat view where each starts where the one before ends, inside the first
    one's storage: the sender's snapshot slabs hold a chunk's tensors so, and a loaded file or a bucketed param
    buffer often does. Joining them is then no copy (on the 30B-A3B topology the join was a quarter of the sender's
    per-tensor time). None otherwise."""
    first = ts[0]
    if ts[1].data_ptr() != first.data_ptr() + first.nbytes:  # separate allocations fail here, at no cost per tensor
        return None
    n = len(ts)
    ptrs = np.fromiter(map(torch.Tensor.data_ptr, ts), dtype=np.uint64, count=n)
    sizes = np.fromiter(map(torch.Tensor.numel, ts), dtype=np.int64, count=n)
    size = first.element_size()
    if not sizes.all() or not (np.diff(ptrs).astype(np.int64) == sizes[:-1] * size).all():
        return None
    if not all(map(torch.Tensor.is_contiguous, ts)):
        return None
    total, start = int(sizes.sum()), first.storage_offset()
    if (start + total) * size > first.untyped_storage().nbytes():
        return None
    return torch.as_strided(first.detach(), (total,), (1,), start)


def _joined_diff(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], batch: List[int],
                 extra: Sequence[Optional[torch.Tensor]], want_olds: bool) -> List[Found]:
    """The ``batch`` of :func:`changes_many` on a device. Per values dtype: the olds and the news joined, one compare,
    one gather of the new values at the hits (and of the old ones, ``want_olds``); for the batch: staged positions
    filled in with one scatter, one ``nonzero``, one host read of where each param's hits start. One :class:`Found`
    per dtype, cut from those, so no op runs per param."""
    device = pairs[batch[0]][1].device
    groups: Dict[torch.dtype, List[int]] = {}
    for k in batch:
        groups.setdefault(pairs[k][1].dtype, []).append(k)
    order = [k for ks in groups.values() for k in ks]  # params in the joined order
    masks, joined, starts = [], [], [0]
    for dtype, ks in groups.items():
        iv = INT_VIEW[dtype.itemsize]
        old, new = _joined([pairs[k][0] for k in ks], iv), _joined([pairs[k][1] for k in ks], iv)
        masks.append(old != new)
        joined.append((old, new))
        for k in ks:
            starts.append(starts[-1] + pairs[k][1].numel())
    mask = masks[0] if len(masks) == 1 else torch.cat(masks)
    staged = [(j, extra[k]) for j, k in enumerate(order) if extra[k] is not None and extra[k].numel()]
    if staged:  # positions an unacknowledged sync sent (kept on the host): carried again, whatever their bytes
        cpu = torch.device("cpu")
        at = shifted_cat([m.cpu() for _, m in staged], [starts[j] for j, _ in staged], cpu)
        mask.index_fill_(0, at.to(device, non_blocking=True), True)
    hits = mask.nonzero().reshape(-1)
    bounds = host_values(torch.searchsorted(hits, to_device(starts, device)))
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    local = hits - repeat_counts(to_device(starts[:-1], device), counts)
    out: List[Found] = []
    j = 0
    for (dtype, ks), (old, new) in zip(groups.items(), joined):
        lo, hi = bounds[j], bounds[j + len(ks)]
        at = hits[lo:hi] - starts[j]
        out.append(Found(ks, counts[j:j + len(ks)], local[lo:hi], new[at].view(dtype),
                         old[at].view(dtype) if want_olds else None))
        j += len(ks)
    return out


@dataclasses.dataclass
class Gathered:
    """Params of one dtype as a sender holds them until their flush: their changed positions and values only, joined
    (``idx`` None: dense, ``values`` the whole tensors) — never a reference to the whole tensor of a sparse param.
    A run of one diff's params stays one entry (views of its :class:`Found`), so a flush joins runs, not params."""

    names: List[str]
    shapes: List[List[int]]
    counts: List[int]  # values per param
    values: torch.Tensor  # flat, joined, in the params' dtype
    idx: Optional[torch.Tensor]  # joined, each param's own positions (from 0)
    base: Optional[torch.Tensor] = None  # xor_zstd: base_version's values beside ``values``

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, idx: Optional[torch.Tensor],
           values: Optional[torch.Tensor] = None, base: Optional[torch.Tensor] = None) -> "Gathered":
        """One param; ``values``: ``tensor`` at ``idx``, when the caller already gathered them."""
        if idx is None or values is None:
            flat = tensor.detach().reshape(-1)
            values = flat if idx is None else gather(flat, idx)
        return cls([name], [list(tensor.shape)], [values.numel()], values, idx,
                   None if base is None else base.reshape(-1))


def encode_flush(entries: Sequence[Tuple[str, torch.Tensor, Optional[torch.Tensor]]], encoding: str,
                 bases: Optional[Sequence[torch.Tensor]] = None, **spec_fields) -> DeltaPayload:
    """``[(hf_name, new_tensor, changed_positions or None for dense)]`` -> one flush (see :func:`encode_gathered`);
    ``bases``: per entry, for ``xor_zstd``."""
    if bases is not None and len(bases) != len(entries):
        raise DeltaError("xor_zstd needs base_version's values of every param (bases)")
    bases = bases if bases is not None else [None] * len(entries)
    return encode_gathered([Gathered.of(*e, base=b) for e, b in zip(entries, bases)], encoding, **spec_fields)


def encode_gathered(items: Sequence[Gathered], encoding: str, sealed: bool = True, **spec_fields) -> DeltaPayload:
    """Params gathered as :class:`Gathered` -> one flush.

    All values must share one dtype (the sender groups by dtype); they are the tensors' own bytes, raw, so the
    receiver writes the trainer's exact bytes. ``xor_zstd`` needs every item's ``base``: base_version's values at
    its positions (gathered like the values). ``sealed=False``: only the blob sums, for a caller that sets more
    spec fields and then seals (``seal(spec_only=True)``) — the spec is serialized for the checksum once, not twice.
    """
    xor = DeltaEncoding(encoding) is DeltaEncoding.XOR_ZSTD
    if xor and any(g.base is None for g in items):
        raise DeltaError("xor_zstd needs base_version's values of every param (bases)")
    for g in items:  # the spec is made from counts the checksum then signs: a count off its blobs is caught here
        n = g.values.numel()
        if not len(g.names) == len(g.shapes) == len(g.counts):
            raise DeltaError(f"params {g.names[:3]}: {len(g.names)} names, {len(g.shapes)} shapes and "
                             f"{len(g.counts)} counts do not pair")
        if sum(g.counts) != n or any(t is not None and t.numel() != n for t in (g.idx, g.base)):
            raise DeltaError(f"params {g.names[:3]}: counts {sum(g.counts)}, values {n}, positions "
                             f"{None if g.idx is None else g.idx.numel()} and bases "
                             f"{None if g.base is None else g.base.numel()} do not pair")
    dtypes = {g.values.dtype for g in items}
    if len(dtypes) > 1:
        raise DeltaError(f"one flush holds one values dtype, got {sorted(map(dtype_to_str, dtypes))}")
    dtype = dtypes.pop() if dtypes else torch.bfloat16
    device = items[0].values.device if items else torch.device("cpu")
    name = dtype_to_str(dtype)
    sparse = [g for g in items if g.idx is not None]
    if sparse and not sparse_allowed(dtype):
        raise DeltaError(f"param {sparse[0].names[0]!r}: {name} params travel dense")
    positions, ranges = encode_positions_many([g.idx for g in sparse], encoding, device, [g.counts for g in sparse])
    rows, at, pos_at = [], 0, 0  # (pos_start, pos_end, pos_width) per param: items are runs, not params
    for g in items:
        k = len(g.names)
        if g.idx is None:  # a dense param has no positions: an empty range where the last sparse one ended
            rows += [(pos_at, pos_at, 0)] * k
        elif k:
            rows += ranges[at:at + k]
            at, pos_at = at + k, ranges[at + k - 1][1]
    counts = list(itertools.chain.from_iterable(g.counts for g in items))
    val_ends = list(itertools.accumulate(counts))
    params = list(itertools.starmap(DeltaParam, zip(
        itertools.chain.from_iterable(g.names for g in items), [name] * len(counts),
        itertools.chain.from_iterable(g.shapes for g in items), *(zip(*rows) if rows else ((), (), ())),
        [0, *val_ends][:-1], val_ends, strict=True)))
    values = _cat([g.values for g in items], dtype, device)
    base = None
    if xor:
        base = _cat([g.base.to(device) for g in items], dtype, device)
        if base.dtype != values.dtype:
            raise DeltaError(f"xor_zstd bases: {base.dtype} do not pair with the values {values.dtype}")
    spec = DeltaSpec(encoding=DeltaEncoding(encoding).value, params=params, **spec_fields)
    payload = DeltaPayload(spec, positions, values, base=base)
    if not sealed:
        payload.sums = blob_sums(positions, values)
        return payload
    return payload.seal()
