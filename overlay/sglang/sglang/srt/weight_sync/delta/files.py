"""A flush as a disk file: safetensors with the spec as ``__metadata__``, zstd-compressed for the disk-only
encodings, each param's segments plane-major for ``planes_zstd``/``xor_zstd`` (values XOR the base for the latter);
``xor_ctx`` files hold the coded streams of :mod:`ctx`.

Reading checks the header's cap and layout before any byte is trusted and hands out views of the file's bytes; the
spec and blobs are then checked whole by :mod:`validate`. Files are made and read on the host (numpy).
"""

from __future__ import annotations

import json
import struct
import warnings
from typing import List, Optional, Sequence

import numpy as np
import safetensors.torch
import torch

from sglang.srt.weight_sync.delta import ctx
from sglang.srt.weight_sync.delta.ops import INT_VIEW
from sglang.srt.weight_sync.delta.wire import (
    HEADER_CAP,
    POSITIONS,
    VALUES,
    ZSTD_MAGIC,
    DeltaEncoding,
    DeltaError,
    DeltaPayload,
    DeltaSpec,
)

_ST_NAMES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8",
    torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
}


_ST_DTYPES = {v: k for k, v in _ST_NAMES.items()}


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
    elements are rebuilt by shifts and ors on whole planes, faster than a strided byte copy."""
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
    if DeltaEncoding(payload.spec.encoding) is DeltaEncoding.XOR_CTX:
        return _zstd(_ctx_file(payload), zstd_level)
    if DeltaEncoding(payload.spec.encoding) is DeltaEncoding.XOR_ZSTD:
        if payload.base is None or payload.base.shape != values.shape or payload.base.dtype != values.dtype:
            raise DeltaError("an xor_zstd flush needs its base values, one per value")
        iv = INT_VIEW[values.element_size()]
        values = torch.bitwise_xor(values.view(iv), payload.base.to(values.device).view(iv)).view(values.dtype)
    return _zstd(write_safetensors(payload.spec, payload.positions, values, payload.sealed_params), zstd_level)


def _zstd(data: bytes, zstd_level: Optional[int]) -> bytes:
    if zstd_level is None:
        return data
    import zstandard

    return zstandard.ZstdCompressor(level=zstd_level).compress(data)


def _ctx_file(payload: DeltaPayload) -> bytes:
    """An ``xor_ctx`` flush: the sparse params' coded streams as ``__positions__``, the dense params' values XOR their
    base as ``__values__``; the spec, as always, describes (and its checksum covers) the logical blobs."""
    spec, values, wholes = payload.spec, payload.values, payload.wholes
    sparse = [k for k, p in enumerate(spec.params) if not p.dense]
    dense = [k for k, p in enumerate(spec.params) if p.dense]
    if wholes is None or len(wholes) != len(spec.params) or payload.idx is None or \
            any(wholes[k] is None for k in dense) or (payload.facts is None and None in wholes):
        raise DeltaError("an xor_ctx flush needs the whole base of every param (or its changes' facts) and its "
                         "joined positions")
    if dense:
        iv = INT_VIEW[values.element_size()]
        spans = [spec.params[k] for k in sparse]
        sparse_values = torch.cat([values[p.val_start:p.val_end] for p in spans]) if spans else values[:0]
        news = torch.cat([values[spec.params[k].val_start:spec.params[k].val_end] for k in dense])
        bases = torch.cat([wholes[k] for k in dense]).to(values.device)  # one XOR for every dense param
        dense_values = torch.bitwise_xor(news.view(iv), bases.view(iv)).view(values.dtype)
    else:
        sparse_values, dense_values = values, values[:0]
    facts = None
    if payload.facts is not None:
        rows, base = payload.facts
        facts = (rows[0], rows[1], base)
    coded = ctx.encode([wholes[k] for k in sparse], [spec.params[k].nnz for k in sparse], payload.idx, sparse_values,
                       payload.seg_log2 or ctx.SEG_LOG2, [spec.params[k].numel for k in sparse], facts)
    blob = torch.frombuffer(bytearray(coded), dtype=torch.uint8)
    return safetensors.torch.save({POSITIONS: blob, VALUES: dense_values.detach().to("cpu").contiguous()},
                                  metadata=payload.spec.to_metadata(payload.sealed_params))


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
    library's reader copies each tensor into fresh memory, most of it page faults)."""
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
    if enc is DeltaEncoding.XOR_CTX:
        return DeltaPayload(spec, pos, val.view(val_dtype) if val_dtype != torch.uint8 else val, source=name,
                            coded=True, params_text=header["__metadata__"]["params"])
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
