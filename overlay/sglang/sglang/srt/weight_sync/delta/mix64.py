"""The ``mix64`` sums: the flush checksum's blob sums and the weight fingerprint's element hashes — eager torch ops,
and the same expressions as :mod:`kernels` compiled ahead of time (on CPU their C twins in :mod:`native`), with the
tests a kernel passes before use.

Both are sums of splitmix64's finalizer (a bijection) over keyed 64-bit terms. Eager, the checksum is ~14 passes over
the words per block (on CPU ~8x a full ``load_weights`` of the same bytes), the fingerprint ~20 per element; each
kernel is one pass on all threads that makes its keys in registers. On CPU the 64-bit multiplies bound it, not
memory (measured on two AVX2 cores: checksum ~12 GB/s, the bf16 fingerprint ~2 G elements/s).
"""
from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Tuple

import torch

from sglang.srt.weight_sync.delta import kernels, native
from sglang.srt.weight_sync.delta.kernels import Kernel


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


# ---------------------------------------------------------------- eager


def _words_per_block(device: torch.device) -> int:
    """CPU: 256 KiB operands stay in cache across the ~14 in-place passes (2x faster than big blocks);
    CUDA: big blocks keep the kernel launches per flush few."""
    return 1 << 22 if device.type == "cuda" else 1 << 15


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


def _eager_sum(words: torch.Tensor, domain: int, lanes: Tuple[int, int, int], first: int = 0):
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


def eager_fingerprint(bits: torch.Tensor, shape, key_strides, key0: int, mask: int) -> torch.Tensor:
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


# ---------------------------------------------------------------- compiled


def _mix(z, k):
    """:func:`mix64_` as one expression for the compiled kernels (``k[1]``, ``k[2]``: C2, C3 as a tensor)."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * k[1]
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * k[2]
    return z ^ ((z >> 31) & ((1 << 33) - 1))


class _Mix64Sum(torch.nn.Module):
    """The eager sum and NaN test as one expression: what inductor fuses into one pass. Every constant comes in as a
    tensor (``k`` = C1, C2, C3, domain, NaN lanes): a constant factor would be folded into index arithmetic, where
    inductor's C++ lets int64 products overflow (undefined behaviour; gcc then miscompiles the keys)."""

    def forward(self, words, k):
        z = (torch.arange(words.shape[0], dtype=torch.int64, device=words.device) * k[0] + k[3]) ^ words
        return _mix(z, k).sum(), (((words & k[4]) + k[5]) & k[6]).ne(0).any()


class _FingerprintRows(torch.nn.Module):
    """:func:`eager_rows` of a 2-D block of raw value bits (any int width, widened in registers): one sum per row, the
    keys made in the kernel (``rk``: each row's first key; ``g`` = key per column, mask) instead of read from memory;
    constants as tensors, as in :class:`_Mix64Sum`. A key per row lets one call hash the rows of many tensors (the
    caller sums each one's rows), and summing along rows only keeps inductor to one pass (one sum over both dims made
    it store every element's pre-mix word, an int64 buffer 4x a bf16 block, and hash it in a second pass: 5x slower)."""

    def forward(self, bits, k, rk, g):
        cols = torch.arange(bits.shape[1], dtype=torch.int64, device=bits.device)
        z = (rk[:, None] + cols[None, :] * g[0]) ^ ((bits.to(torch.int64) & g[1]) * k[1])
        return _mix(z, k).sum(1)


class _FingerprintRowsPairs(torch.nn.Module):
    """:class:`_FingerprintRows` of a 2-D block of 16-bit value bits given as int32 words of two elements each (rows of
    an even length): the same sums, element by element. Inductor vectorizes int32 loads, not int16 ones (measured on
    the bf16 fingerprint: ~3x the throughput). An element's bits are its half of the word, sign-extended as the
    widening of an int16 is: the low half by shifting it to the top and back, the high half by an arithmetic shift."""

    def forward(self, words, k, rk, g):
        cols = torch.arange(words.shape[1], dtype=torch.int64, device=words.device)
        key = rk[:, None] + cols[None, :] * (g[0] * 2)  # the key of the word's first element
        w = words.to(torch.int64)
        return (_mix(key ^ ((((w << 48) >> 48) & g[1]) * k[1]), k)
                + _mix((key + g[0]) ^ (((w >> 16) & g[1]) * k[1]), k)).sum(1)


def eager_rows(bits: torch.Tensor, row_keys: torch.Tensor, col_key: int, mask: int) -> torch.Tensor:
    """``sum_c mix((row_keys[r] + c * col_key) ^ ((bits[r, c] & mask) * C2))`` per row ``r`` of a 2-D block of raw
    value bits, as an int64 tensor of the rows: :func:`eager_fingerprint` with a key per row."""
    cols = torch.arange(bits.shape[1], dtype=torch.int64, device=bits.device) * col_key
    z = row_keys[:, None] + cols[None, :]
    t = bits.to(torch.int64) & mask
    t *= i64(C2)
    z ^= t
    return mix64_(z, t).sum(1)


def as_pairs(bits: torch.Tensor) -> Optional[torch.Tensor]:
    """A 2-D block of 16-bit value bits as int32 words of two elements (:class:`_FingerprintPairs`), where its rows
    have an even length and its memory starts on a 4-byte boundary; else None."""
    if bits.dtype != torch.int16 or bits.dim() != 2 or bits.shape[1] % 2:
        return None
    bits = bits.contiguous()
    return bits.view(torch.int32) if bits.data_ptr() % 4 == 0 else None


_EDGE_WORDS = [0, -1, 1, -(1 << 63), (1 << 63) - 1, i64(0x8000000080008000), i64(0x7FFF7FFF7FFF7FFF),
               i64(0x7F807F807F807F80), i64(0x7FC17C017E7F7F81), i64(C1), i64(C2), i64(C3)]
_TEST_LENGTHS = (*range(1, 70), 127, 1000, 4099, 65537, (1 << 20) + 3, (3 << 20) + 5)


def _test_words(n: int, g: torch.Generator, device) -> torch.Tensor:
    """Random words with the edge words at both ends."""
    edge = torch.tensor(_EDGE_WORDS, dtype=torch.int64)
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (n,), generator=g, dtype=torch.int64)
    words[:min(n, edge.numel())] = edge[:n]
    words[-min(n, edge.numel()):] = edge[:n].flip(0)
    return words.to(device)


def _test_sum(runner, device: torch.device) -> None:
    """Raise unless ``runner`` matches the eager sums and NaN flags bit for bit on ``device``."""
    g = torch.Generator().manual_seed(0x5A17)
    for n in _TEST_LENGTHS:
        words = _test_words(n, g, device)
        for dtype in (None, *NAN_BITS):
            lanes = nan_lanes(dtype)
            for domain in (0, i64(0x5A17E5C0FFEE0002)):
                want = [int(x) for x in _eager_sum(words, domain, lanes)]
                got = [int(x) for x in _run_sum(runner, words, domain, lanes)]
                if got != want:
                    raise RuntimeError(f"compiled mix64 differs from eager on {device} at {n} words, lanes of "
                                       f"{dtype}: {got} vs {want}")


def _test_fingerprint(runner, device: torch.device, dtype: torch.dtype, pairs: bool = False) -> None:
    """Raise unless ``runner`` matches :func:`eager_rows` on ``device`` for ``dtype`` bits: one row, one column and
    2-D blocks, row keys that step alike (one tensor's rows) and that jump (rows of several tensors), column keys of
    either sign, every mask kind, edge words. ``pairs``: a :class:`_FingerprintRowsPairs` kernel, given the blocks
    :func:`as_pairs` takes (the others skipped)."""
    g = torch.Generator().manual_seed(0xF1)
    per_word = 8 // dtype.itemsize
    for n in _TEST_LENGTHS[::3]:
        bits = _test_words(n, g, device).view(dtype)  # n words: n * per_word elements
        m = n * per_word
        for rows in sorted({1, m, per_word, n}):
            block = bits.reshape(rows, m // rows)
            arg = as_pairs(block) if pairs else block
            if arg is None:
                continue
            for seed, mask, s0, s1 in ((0, -1, 0, 1), (i64(0xA5A5A5A5DEADBEEF), 0xFFFF, 7, 3),
                                       (1, 0xFF, 1 << 20, 1), (-1, 0xFFFFFFFF, 5, -1 << 33)):
                (ka, kb), key0 = fingerprint_keys((s0, s1), 11, seed)
                row_keys = torch.arange(rows, dtype=torch.int64, device=device) * ka + key0
                if rows > 2:  # rows of different tensors: keys that jump
                    row_keys[rows // 2:] ^= _test_words(rows - rows // 2, g, device)
                want = eager_rows(block, row_keys, kb, mask)
                got = run_rows(runner, arg, row_keys, torch.tensor([kb, mask], device=device))
                if not torch.equal(got, want):
                    raise RuntimeError(f"compiled fingerprint differs from eager on {device} at {tuple(block.shape)} "
                                       f"{dtype}, geometry {(s0, s1)}, mask {mask:#x}")


_CONSTS: Dict[Tuple, torch.Tensor] = {}


def _consts(device: torch.device, *extra: int) -> torch.Tensor:
    """C1, C2, C3 and ``extra`` on ``device``, made once (no copy to the device per call)."""
    key = (str(device), extra)
    if key not in _CONSTS:
        _CONSTS[key] = torch.tensor([i64(C1), i64(C2), i64(C3), *extra], dtype=torch.int64, device=device)
    return _CONSTS[key]


def _run_sum(runner, words: torch.Tensor, domain: int, lanes: Tuple[int, int, int]):
    return runner(words.contiguous(), _consts(words.device, domain, *lanes))


def run_rows(runner, bits: torch.Tensor, row_keys: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A fingerprint kernel's row sums of the 2-D block ``bits`` (``g``: key per column, mask; on the device)."""
    return runner(bits.contiguous(), _consts(bits.device), row_keys, g)


SUM = Kernel("mix64", _Mix64Sum, (torch.zeros(64, dtype=torch.int64), torch.zeros(7, dtype=torch.int64)), _test_sum,
             cpu=native.sum_runner)
# one fingerprint kernel per width of raw bits (fp8, bf16/fp16, fp32, 64-bit), each built when first needed, and
# one for 16-bit bits in pairs (PAIRS: the rows as_pairs takes)
PAIRS = "int16-pairs"
_ROWS = (("rows", "cols"), None, ("rows",), None)


def _fingerprint_kernel(name: str, module: type, dtype: torch.dtype, test) -> Kernel:
    example = (torch.zeros(8, 16, dtype=dtype), torch.zeros(3, dtype=torch.int64), torch.zeros(8, dtype=torch.int64),
               torch.zeros(2, dtype=torch.int64))
    return Kernel(f"fingerprint-{name}", module, example, test, _ROWS,
                  native.rows_runner(dtype, pairs=module is _FingerprintRowsPairs))


FINGERPRINT = {dt: _fingerprint_kernel(str(dt)[6:], _FingerprintRows, dt, functools.partial(_test_fingerprint, dtype=dt))
               for dt in (torch.uint8, torch.int16, torch.int32, torch.int64)}
FINGERPRINT[PAIRS] = _fingerprint_kernel(PAIRS, _FingerprintRowsPairs, torch.int32,
                                         functools.partial(_test_fingerprint, dtype=torch.int16, pairs=True))


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
    runner = kernels.KERNELS.ready(SUM, words.device, words.numel()) if words.numel() else None
    total = found = None
    if runner is not None:
        try:
            total, found = _run_sum(runner, words.detach(), domain, lanes)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run leaves the eager path, never a wrong sum
            kernels.KERNELS.failed(SUM, words.device, e)
    if total is None:
        total, found = _eager_sum(words, domain, lanes)
    if tail is not None:
        t, f = _eager_sum(tail, domain, lanes, first=words.numel())
        total, found = total + t, found | f
    return total, (found if nan_dtype is not None else None)
