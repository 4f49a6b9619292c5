"""The engine's checks of a whole flush before its first write: checksum, structure, manifest, positions, NaN — and
the rebuild of ``xor_zstd`` values and ``xor_ctx`` blobs, whose result only the checksum can vouch for.

A batched pass decides for the whole flush with a constant number of host reads; only a flush that fails it is
walked param by param, so the refusal names the param at fault.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.weight_sync.delta import ctx
from sglang.srt.weight_sync.delta.ops import INT_VIEW, host_values, nan_mask
from sglang.srt.weight_sync.delta.positions import decode_all, decode_positions, encode_positions_many
from sglang.srt.weight_sync.delta.rice import slots
from sglang.srt.weight_sync.delta.wire import (
    POSITIONS,
    VALUES,
    DeltaEncoding,
    DeltaError,
    DeltaParam,
    DeltaPayload,
    Refusal,
    checked_sums,
    dtype_from_str,
    dtype_to_str,
    flush_checksum,
    sparse_allowed,
)

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
        positions, flags = decode_all(payload, _check_structure(payload, manifest, where))
    flags = list(flags)  # one bool per check, read together: the flush's one synchronization after the checksum
    if nan is not None:
        flags.append(nan)
    if flags and any(host_values(torch.stack(flags))):
        _check_one_by_one(payload, where)
    return positions


def _repeated(names: List[str]) -> set:
    if len(set(names)) == len(names):
        return set()
    seen, repeated = set(), set()
    for n in names:
        (repeated if n in seen else seen).add(n)
    return repeated


def check_pieces(payloads: Sequence[DeltaPayload], full: bool, direct, unheld) -> set:
    """A request may name a param in several of its files only as pieces of a sparse delta written through this
    rank's recorded views (``direct``), or that this rank does not hold (``unheld``: another rank's experts; it
    writes nothing of them): a sender splits a param with more changes than a round by position. A loader would take
    each piece as a whole tensor, and a full sync's file is the param. Returns the repeated names (host work for
    them only), for :func:`check_pieces_ascend`."""
    repeated = _repeated([q.name for p in payloads for q in p.spec.params])
    for p in payloads if repeated else ():
        for q in p.spec.params:
            if q.name in repeated and (full or not q.pos_width or (q.name not in (direct or {}) and
                                                                   q.name not in unheld)):
                raise DeltaError(f"param {q.name!r} appears in two files of one request, which only a sparse delta "
                                 "of a param written through recorded views, or not held here, may (in pieces)")
    return repeated


def check_pieces_ascend(payloads: Sequence[DeltaPayload], decoded, repeated: set) -> None:
    """The ``repeated`` names of a request's files (:func:`check_pieces`): each file's positions all past the last
    file's (pieces never overlap or come out of order). One host read; ``decoded``: each payload's checked positions
    (``validate_payload``)."""
    if not repeated:
        return
    seen: Dict[str, List[torch.Tensor]] = {}
    for p, positions in zip(payloads, decoded):
        for q in p.spec.params:
            at = positions.of(q) if q.name in repeated else None
            if at is not None and at.numel():
                seen.setdefault(q.name, []).append(torch.stack([at.min(), at.max()]))
    pieces = {n: e for n, e in seen.items() if len(e) > 1}
    if not pieces:
        return
    bounds = host_values(torch.cat([t for e in pieces.values() for t in e]))
    at = 0
    for name, e in pieces.items():
        b = bounds[at:at + 2 * len(e)]
        at += 2 * len(e)
        if any(b[2 * k + 2] <= b[2 * k + 1] for k in range(len(e) - 1)):
            raise DeltaError(f"param {name!r}: its pieces in the files of one request overlap or come out of order "
                             "(each file's positions must all follow the last file's)")


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

    The structure is checked first and positions are decoded a run at a time, clamped into each param's range
    (they are not verified yet); ``read_base(params, positions)`` returns the committed bytes at those positions
    for consecutive params, one tensor aligned with their values (``positions[k]`` is None for a dense param:
    all of it). The checksum over the rebuilt values, in :func:`validate_payload`, then decides: a wrong base, a
    corrupted blob or a lying spec is a mismatch, never a wrong weight.
    """
    spec, val = payload.spec, payload.values
    where = f" in {payload.source}" if payload.source else ""
    if DeltaEncoding(spec.encoding) is not DeltaEncoding.XOR_ZSTD or not payload.xored:
        raise DeltaError(f"unxor needs xor_zstd values{where}, got a {spec.encoding} flush")
    positions, flags = decode_all(payload, check_structure(payload, manifest))  # validate reuses it
    iv = INT_VIEW[val.element_size()]
    rebuilt, at = torch.empty_like(val.view(iv)), 0
    for params, idxs in positions.pieces(spec.params):  # a run's positions at a time: no int64 copy of the flush
        n = sum(p.val_end - p.val_start for p in params)
        base = read_base(params, idxs)
        if base.dtype != val.dtype or base.shape != (n,):
            raise DeltaError(f"base values{where}: {base.dtype} {list(base.shape)} do not match the flush's "
                             f"{val.dtype} [{n}] at value {at}", Refusal.NO_BASE)
        torch.bitwise_xor(val.view(iv)[at:at + n], base.to(val.device).view(iv), out=rebuilt[at:at + n])
        at += n
    if at != val.numel():  # check_structure tiles the values with the params: this is a bug, not bad input
        raise DeltaError(f"base values{where}: {at} rebuilt of {val.numel()}", Refusal.NO_BASE)
    return dataclasses.replace(payload, values=rebuilt.view(val.dtype), xored=False, sums=None,
                               decoded=(manifest, positions, flags))


def uncode(payload: DeltaPayload, manifest, read_base, split=None) -> DeltaPayload:
    """An ``xor_ctx`` flush with its logical blobs rebuilt from the coded streams and the base, before anything is
    trusted: the spec's own rules first (it names the params and their sizes), then :func:`ctx.decode`, whose every
    field is checked; the checksum over the rebuilt blobs, in :func:`validate_payload`, then decides.
    ``read_base``: see :data:`ctx.ReadBase` (spec numbers of params, element ranges); ``split``: :data:`ctx.Split`."""
    spec, val = payload.spec, payload.values
    where = f" in {payload.source}" if payload.source else ""
    if DeltaEncoding(spec.encoding) is not DeltaEncoding.XOR_CTX or not payload.coded:
        raise DeltaError(f"uncode needs coded xor_ctx streams{where}, got a {spec.encoding} flush")
    params = spec.params
    sparse = check_coded(payload, manifest)
    dense = [k for k, p in enumerate(params) if p.dense]
    nval = params[-1].val_end if params else 0
    dev = val.device
    iv = INT_VIEW[val.element_size()]
    out = torch.empty(nval, dtype=iv, device=dev)
    # without a sparse param the streams are still read: an empty table, nothing else (the checksum does not cover them)
    pos, new = ctx.decode(payload.positions.to(dev), params, val.dtype, read_base, where, split)
    if sparse:
        out[_value_slots(sparse, dev)] = new.view(iv)
        blob, ranges = encode_positions_many([pos], DeltaEncoding.DELTAS.value, dev, [[p.nnz for p in sparse]])
        for p, got in zip(sparse, ranges):
            if (p.pos_start, p.pos_end, p.pos_width) != tuple(got):
                raise DeltaError(f"param {p.name!r}{where}: its decoded positions take bytes {list(got)}, the spec "
                                 f"says [{p.pos_start}, {p.pos_end}, {p.pos_width}]")
    else:
        blob = torch.zeros(0, dtype=torch.uint8, device=dev)
    if dense:
        base = read_base([(k, 0, params[k].numel) for k in dense])
        out[_value_slots([params[k] for k in dense], dev)] = torch.bitwise_xor(val.view(iv), base.to(dev).view(iv))
    return dataclasses.replace(payload, positions=blob, values=out.view(val.dtype), coded=False, sums=None)


def check_coded(payload: DeltaPayload, manifest=None) -> List[DeltaParam]:
    """An ``xor_ctx`` flush's checks before its blobs are rebuilt: the spec's rules on the logical blobs it declares
    (names, shapes, offsets), and the dense params' values; returns the sparse params in spec order."""
    params, val = payload.spec.params, payload.values
    where = f" in {payload.source}" if payload.source else ""
    npos, nval = (params[-1].pos_end, params[-1].val_end) if params else (0, 0)
    shell = dataclasses.replace(payload, positions=torch.empty(npos, dtype=torch.uint8, device="meta"),
                                values=torch.empty(nval, dtype=val.dtype, device="meta"))
    sparse = check_structure(shell, manifest)
    want = sum(p.nnz for p in params if p.dense)
    if val.numel() != want:
        raise DeltaError(f"xor_ctx values{where}: {val.numel()} in the file, its dense params hold {want}")
    return sparse


def _value_slots(params: Sequence[DeltaParam], dev) -> torch.Tensor:
    """The logical value indices of ``params`` (in spec order), joined."""
    return slots([p.val_start for p in params], [p.nnz for p in params], dev)


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
