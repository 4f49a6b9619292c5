"""The ``mix64`` sums: the flush checksum's blob sums and the weight fingerprint's element hashes, in torch integer
ops that give the same numbers on CPU and CUDA.

Both are sums of splitmix64's finalizer (a bijection) over keyed 64-bit terms, computed block by block in place so
that the temporaries stay a few blocks whatever the blob's size, with no host synchronization.
"""
from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Tuple

import torch

from sglang.srt.weight_sync.delta.device import device_path

M64 = 0xFFFFFFFFFFFFFFFF
C1, C2, C3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# |bits| above the largest finite/inf pattern is a NaN: (int view, abs mask, inf bits) per float dtype.
NAN_BITS = {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float16: (torch.int16, 0x7FFF, 0x7C00),
            torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000), torch.float8_e4m3fn: (torch.uint8, 0x7F, 0x7E),
            torch.float8_e5m2: (torch.uint8, 0x7F, 0x7C)}


def i64(c: int) -> int:
    """A 64-bit constant as the signed value torch's int64 holds (int64 arithmetic wraps mod 2**64)."""
    c &= M64
    return c - (1 << 64) if c >= 1 << 63 else c


def _words_per_block(device: torch.device) -> int:
    """Off the device path 256 KiB operands stay in the CPU's cache across the ~14 in-place passes; on it big blocks
    keep the kernel launches per flush few."""
    return 1 << 22 if device_path(device) else 1 << 15


_KEYS: Dict[Tuple[str, int], torch.Tensor] = {}


def _keys(device: torch.device, n: int) -> torch.Tensor:
    """``i * C1`` for i < n (wrapped), built once per device: a block's key is this plus one constant."""
    k = (str(device), n)
    if k not in _KEYS:
        _KEYS[k] = torch.arange(n, dtype=torch.int64, device=device).mul_(i64(C1))
    return _KEYS[k]


def _xorshift_(z: torch.Tensor, s: int, tmp: torch.Tensor) -> None:
    """z ^= z >>> s (logical shift on int64: torch's ``>>`` is arithmetic, so mask the sign copies off)."""
    torch.bitwise_right_shift(z, s, out=tmp)
    tmp &= (1 << (64 - s)) - 1
    z ^= tmp


def mix64_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in place: a bijection of 64-bit words with full avalanche."""
    _xorshift_(z, 30, tmp)
    z *= i64(C2)
    _xorshift_(z, 27, tmp)
    z *= i64(C3)
    _xorshift_(z, 31, tmp)
    return z


def nan_lanes(dtype: Optional[torch.dtype]) -> Tuple[int, int, int]:
    """(abs mask, add, top bit) per 64-bit word of ``dtype`` values: ``((w & mask) + add) & top`` is non-zero iff
    a lane's |bits| exceed the largest finite/inf pattern (a NaN). Lanes cannot carry into each other: a lane's
    |bits| + add stays below twice its top bit. ``None``: all zero (never a NaN)."""
    if dtype is None:
        return 0, 0, 0
    _, abs_mask, inf_bits = NAN_BITS[dtype]
    lane = 8 * dtype.itemsize
    top = 1 << (lane - 1)
    rep = lambda x: sum(x << (lane * k) for k in range(64 // lane))  # noqa: E731
    return i64(rep(abs_mask)), i64(rep(top - 1 - inf_bits)), i64(rep(top))


def _sum_words(words: torch.Tensor, domain: int, lanes: Tuple[int, int, int], first: int = 0):
    """The sum and NaN flag of ``words`` standing at word index ``first`` of their blob."""
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    found = torch.zeros((), dtype=torch.bool, device=words.device)
    step = _words_per_block(words.device)
    keys = _keys(words.device, min(step, max(1, words.numel())))
    z = torch.empty(keys.numel(), dtype=torch.int64, device=words.device)
    tmp = torch.empty_like(z)
    for start in range(0, words.numel(), step):
        w = words[start:start + step]
        m = w.numel()
        zz, tt = z[:m], tmp[:m]
        if lanes[2]:
            torch.bitwise_and(w, lanes[0], out=tt)
            tt += lanes[1]
            tt &= lanes[2]
            found |= tt.any()
        torch.add(keys[:m], i64((first + start) * C1 + domain), out=zz)
        zz ^= w
        total += mix64_(zz, tt).sum()
    return total, found


def fingerprint_keys(strides, offset: int, seed: int) -> Tuple[Tuple[int, ...], int]:
    """The element keys ``idx * C1 + seed`` of a strided view are affine in its coordinates: (key per step of each
    dim, key of the first element), wrapped to int64."""
    return tuple(i64(st * C1) for st in strides), i64(offset * C1 + seed)


def view_sum(bits: torch.Tensor, shape, key_strides, key0: int, mask: int) -> torch.Tensor:
    """``sum mix(key ^ ((bits & mask) * C2))`` over a view as a 0-d int64 tensor: the fingerprint's element hashes
    (``bits``: the view's value bits as int64 in element order; keys from :func:`fingerprint_keys`)."""
    z = flat_index(shape, key_strides, key0, bits.device)
    t = bits & mask
    t *= i64(C2)
    z ^= t
    return mix64_(z, t).sum()


def coverage(shape, strides, offset: int) -> int:
    """``sum idx * (idx + C3) mod 2**64`` over a view's flat indices ``idx = offset + sum_d r_d * strides[d]``, in
    closed form on the host (sums of powers of each coordinate): no pass over memory."""
    return _coverage(tuple(shape), tuple(strides), offset)


@functools.lru_cache(maxsize=1 << 16)  # a model's tensors share a few geometries (every expert's, every layer's)
def _coverage(shape: Tuple[int, ...], strides: Tuple[int, ...], offset: int) -> int:
    n = math.prod(shape)
    if not n:
        return 0
    e = [st * k * (k - 1) // 2 for k, st in zip(shape, strides)]  # sum over one dim of r * stride
    q = [st * st * (k - 1) * k * (2 * k - 1) // 6 for k, st in zip(shape, strides)]  # of (r * stride) ** 2
    s1 = n * offset + sum(ed * (n // k) for ed, k in zip(e, shape))
    s2 = n * offset * offset + 2 * offset * (s1 - n * offset) + sum(qd * (n // k) for qd, k in zip(q, shape))
    for d in range(len(shape)):
        for f in range(len(shape)):
            if d != f:
                s2 += e[d] * e[f] * (n // (shape[d] * shape[f]))
    return (s2 + C3 * s1) & M64


def flat_index(sizes, strides, offset: int, device) -> torch.Tensor:
    """The flat indices of a strided view, in the view's element order."""
    idx = torch.full((), offset, dtype=torch.int64, device=device)
    for d, (n, st) in enumerate(zip(sizes, strides)):
        shape = [1] * len(sizes)
        shape[d] = n
        idx = idx + (torch.arange(n, dtype=torch.int64, device=device) * st).view(shape)
    return idx.reshape(-1)


def as_2d(sizes, strides, offset: int) -> Optional[Tuple[Tuple[int, int], int, int, int]]:
    """((rows, columns), row stride, column stride, offset): a view's flat indices as a 2-D block in the view's element
    order, merging dims where the strides allow; None when that needs more than two dims."""
    dims = [(n, st) for n, st in zip(sizes, strides) if n != 1]
    merged: list = []
    for n, st in dims:
        if merged and merged[-1][1] == st * n:  # the outer dim steps over exactly this one
            merged[-1] = (merged[-1][0] * n, st)
        else:
            merged.append((n, st))
    if len(merged) > 2:
        return None
    (rows, s0), (cols, s1) = ([(1, 0)] * (2 - len(merged)) + merged) if merged else [(1, 0), (1, 1)]
    return (rows, cols), s0, s1, offset


def row_sums(bits: torch.Tensor, row_keys: torch.Tensor, col_key: int, mask: int) -> torch.Tensor:
    """``sum_c mix((row_keys[r] + c * col_key) ^ ((bits[r, c] & mask) * C2))`` per row ``r`` of a 2-D block of raw
    value bits, as an int64 tensor of the rows: :func:`view_sum` with a key per row."""
    cols = torch.arange(bits.shape[1], dtype=torch.int64, device=bits.device) * col_key
    z = row_keys[:, None] + cols[None, :]
    t = bits.to(torch.int64) & mask
    t *= i64(C2)
    z ^= t
    return mix64_(z, t).sum(1)


def point_sums(bits: torch.Tensor, positions: torch.Tensor, seeds: torch.Tensor, ids: torch.Tensor,
               totals: torch.Tensor, mask: int) -> None:
    """``totals[ids[i]] += mix((positions[i] * C1 + seeds[i]) ^ ((bits[i] & mask) * C2))``: :func:`row_sums`'
    element hashes for values at scattered HF indices (a trainer rank's share of many names), summed per name in
    place."""
    z = positions * i64(C1)
    z += seeds
    t = bits.to(torch.int64) & mask
    t *= i64(C2)
    z ^= t
    totals.index_add_(0, ids, mix64_(z, t))


def words_of(blob: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The blob's bytes as little-endian int64 words: the whole words (a view; a copy only when unaligned) and the
    zero-padded last one, if any (one word: the body is never copied to append it)."""
    b = blob.reshape(-1).view(torch.uint8) if blob.dtype != torch.uint8 else blob.reshape(-1)
    n = b.numel() // 8
    body = b[:8 * n]
    if body.storage_offset() % 8:  # an int64 view needs an aligned offset
        body = body.clone()
    tail = None
    if b.numel() % 8:  # padded on the device
        tail = torch.zeros(8, dtype=torch.uint8, device=b.device)
        tail[:b.numel() % 8] = b[8 * n:]
        tail = tail.view(torch.int64)
    return body.view(torch.int64), tail


def blob_sum(blob: torch.Tensor, domain: int, nan_dtype: Optional[torch.dtype] = None):
    """``sum_i mix64(w_i ^ (i * C1 + domain)) mod 2**64`` over the blob's words as a 0-d int64 tensor on the blob's
    device (no host synchronization), and with ``nan_dtype`` whether the blob (values of that dtype) holds a NaN as a
    0-d bool tensor, else None — from the same pass over the words."""
    words, tail = words_of(blob)
    lanes = nan_lanes(nan_dtype)
    total, found = _sum_words(words, domain, lanes)
    if tail is not None:
        t, f = _sum_words(tail, domain, lanes, first=words.numel())
        total, found = total + t, found | f
    return total, (found if nan_dtype is not None else None)
