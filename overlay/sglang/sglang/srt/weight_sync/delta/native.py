"""The mix64 kernels and the sparse kernels (the sender's diff, positions and scatter; the engine's decode and
writes) on CPU: :data:`SOURCE` (C++) built into a shared library once per machine and called through ctypes on all of
torch's threads, each on a share of the words, rows or elements.

Why not the AOTInductor packages CUDA runs: below AVX-512 torch's CPU vector classes multiply 64-bit lanes one at a
time through memory, so inductor's kernels for these 64-bit multiply hashes run scalar. A compiler vectorizes the
same loops written in C++ with 32-bit multiplies (measured on one AVX2 machine, two threads: the bf16 checksum 20
against 5.1 GB/s, the bf16 fingerprint 2.0 against 0.76 G elements/s). The runners take and return what the packages
do, so :mod:`kernels` tests them the same way before any use. The source is a string here, not a file beside this
one: a wheel built from a patched tree packs only Python files.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import operator
import os
import platform
import subprocess
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch

SOURCE = r"""/* mix64.py's blob sums and fingerprint row sums as loops a compiler vectorizes; the sparse kernels. */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define CLONES
#endif

#define API extern "C"
/* C1, C2, C3: mix64.py's constants, given on the compiler's command line */

static inline uint64_t mix(uint64_t z) { /* splitmix64's finalizer */
  z ^= z >> 30;
  z *= C2;
  z ^= z >> 27;
  z *= C3;
  return z ^ (z >> 31);
}

/* out[0] = sum of mix(w[i] ^ (i * C1 + key0)); out[1] = OR over words of ((w & mask) + add) & top (non-zero: a NaN
 * lane). A constant `nan` lets the compiler drop the NaN test where the blob has no float lanes. The key grows by
 * addition: without AVX-512 a 64-bit multiply is three 32-bit ones, and one less per word is 1.4x (AVX2, measured). */
static inline void sum_body(const uint64_t *w, int64_t n, uint64_t key0, uint64_t mask, uint64_t add, uint64_t top,
                            uint64_t *out, const int nan) {
  uint64_t s = 0, f = 0, key = key0;
  for (int64_t i = 0; i < n; i++, key += C1) {
    uint64_t x = w[i];
    if (nan) f |= ((x & mask) + add) & top;
    s += mix(x ^ key);
  }
  out[0] = s;
  out[1] = f;
}

API CLONES void mix64_sum(const uint64_t *w, int64_t n, uint64_t key0, uint64_t mask, uint64_t add, uint64_t top,
                          uint64_t *out) {
  if (top)
    sum_body(w, n, key0, mask, add, top, out, 1);
  else
    sum_body(w, n, key0, 0, 0, 0, out, 0);
}

/* out[r] = sum over c of mix((rk[r] + c * g0) ^ ((bits[r][c] widened & mask) * C2)), rows contiguous: an element
 * widens to 64 bits as torch's .to(int64) does (uint8 zero-extended, signed widths sign-extended). */
#define ROWS(NAME, T)                                                                                               \
  API CLONES void NAME(const T *bits, int64_t rows, int64_t cols, const uint64_t *rk, uint64_t g0, uint64_t mask,  \
                       uint64_t *out) {                                                                             \
    for (int64_t r = 0; r < rows; r++) {                                                                            \
      const T *b = bits + r * cols;                                                                                 \
      uint64_t key = rk[r], s = 0;                                                                                  \
      for (int64_t c = 0; c < cols; c++, key += g0) /* the key by addition: a multiply less per element */          \
        s += mix(key ^ (((uint64_t)(int64_t)b[c] & mask) * C2));                                                    \
      out[r] = s;                                                                                                   \
    }                                                                                                               \
  }

ROWS(mix64_rows_uint8, uint8_t)
ROWS(mix64_rows_int16, int16_t)
ROWS(mix64_rows_int32, int32_t)
ROWS(mix64_rows_int64, int64_t)

/* The diff: where two tensors' elements differ bitwise, each such position (from the tensor's start) with b's element
 * there (and a's, `olds`), in one pass over both. A 64-bit word of lanes is compared at once; in a word that differs,
 * ((d & ~HI) + ~HI | d) & HI sets the top bit of each lane that differs, and its set bits are visited in order. */
template <typename T, int OLDS>
static int64_t diff_range(const T *a, const T *b, int64_t i, int64_t e, int64_t *idx, T *vals, T *olds, int64_t w) {
  const int L = 8 / sizeof(T), SHIFT = sizeof(T) == 1 ? 3 : sizeof(T) == 2 ? 4 : sizeof(T) == 4 ? 5 : 6;
  const uint64_t HI = sizeof(T) == 1 ? 0x8080808080808080ULL : sizeof(T) == 2 ? 0x8000800080008000ULL
                    : sizeof(T) == 4 ? 0x8000000080000000ULL : 0x8000000000000000ULL;
  for (; i + L <= e; i += L) {
    uint64_t x, y;
    memcpy(&x, a + i, 8);
    memcpy(&y, b + i, 8);
    uint64_t d = x ^ y;
    if (!d) continue;
    for (uint64_t nz = (((d & ~HI) + ~HI) | d) & HI; nz; nz &= nz - 1) {
      int64_t j = i + (__builtin_ctzll(nz) >> SHIFT);
      idx[w] = j;
      vals[w] = b[j];
      if (OLDS) olds[w] = a[j];
      w++;
    }
  }
  for (; i < e; i++)
    if (a[i] != b[i]) {
      idx[w] = i;
      vals[w] = b[i];
      if (OLDS) olds[w] = a[i];
      w++;
    }
  return w;
}

/* Tensors k of pa/pb (addresses), ns[k] elements each, from at = (k, i) up to (k_end, i_end): hits appended to idx/vals
 * (/olds) while at least a step's worth of the `cap` slots is free, counts[k] += each tensor's hits. Returns the hits
 * written; at is where it stopped (at == (k_end, i_end): done; else the caller continues into new slots). */
#define DIFF_STEP 65536
template <typename T, int OLDS>
static int64_t diff_many(const int64_t *pa, const int64_t *pb, const int64_t *ns, int64_t *at, int64_t k_end,
                         int64_t i_end, int64_t *idx, T *vals, T *olds, int64_t cap, int64_t *counts) {
  int64_t k = at[0], i = at[1], w = 0;
  while (k < k_end || (k == k_end && i < i_end)) {
    const int64_t e = k < k_end ? ns[k] : i_end, w0 = w;
    const T *a = (const T *)pa[k], *b = (const T *)pb[k];
    while (i < e) {
      const int64_t s = e - i < DIFF_STEP ? e - i : DIFF_STEP;
      if (cap - w < s) break;
      w = diff_range<T, OLDS>(a, b, i, i + s, idx, vals, olds, w);
      i += s;
    }
    counts[k] += w - w0;
    if (i < e || k == k_end) break;
    k++;
    i = 0;
  }
  at[0] = k;
  at[1] = i;
  return w;
}

#define DIFF(NAME, T)                                                                                               \
  API CLONES int64_t NAME(const int64_t *pa, const int64_t *pb, const int64_t *ns, int64_t *at, int64_t k_end,    \
                          int64_t i_end, int64_t *idx, T *vals, T *olds, int64_t cap, int64_t *counts) {          \
    return olds ? diff_many<T, 1>(pa, pb, ns, at, k_end, i_end, idx, vals, olds, cap, counts)                     \
                : diff_many<T, 0>(pa, pb, ns, at, k_end, i_end, idx, vals, olds, cap, counts);                    \
  }

DIFF(diff_uint8, uint8_t)
DIFF(diff_int16, uint16_t)
DIFF(diff_int32, uint32_t)
DIFF(diff_int64, uint64_t)

/* Positions to the wire, per param k (cnt[k] sorted positions at pos[k]): gaps (pos[i] - pos[i-1] - 1, from -1) or,
 * `gaps` 0, the positions. pos_top: the largest and the smallest int each param writes (0 if none; a negative one
 * means positions out of order or repeated, which no width encodes). pos_write: each param's ints at
 * out + at[k], wid[k] (2 or 4) bytes each, little-endian (the low bytes: each fits, by its top); stored through
 * memcpy, as a u32 param after an odd count of u16 ones starts 2 bytes off a 4-byte boundary. */
API void pos_top(const int64_t *pos, const int64_t *cnt, int64_t n, int64_t gaps, int64_t *top, int64_t *low) {
  for (int64_t k = 0; k < n; k++) {
    const int64_t *p = (const int64_t *)pos[k];
    int64_t t = 0, l = 0, prev = -1;
    for (int64_t i = 0; i < cnt[k]; i++) {
      const int64_t v = gaps ? p[i] - prev - 1 : p[i];
      t = v > t ? v : t;
      l = v < l ? v : l;
      prev = p[i];
    }
    top[k] = t;
    low[k] = l;
  }
}

API void pos_write(const int64_t *pos, const int64_t *cnt, int64_t n, int64_t gaps, const int64_t *at,
                   const int64_t *wid, uint8_t *out) {
  for (int64_t k = 0; k < n; k++) {
    const int64_t *p = (const int64_t *)pos[k];
    int64_t prev = -1;
    uint8_t *o = out + at[k];
    if (wid[k] == 2) {
      for (int64_t i = 0; i < cnt[k]; i++) {
        const uint16_t v = (uint16_t)(gaps ? p[i] - prev - 1 : p[i]);
        memcpy(o + 2 * i, &v, 2);
        prev = p[i];
      }
    } else {
      for (int64_t i = 0; i < cnt[k]; i++) {
        const uint32_t v = (uint32_t)(gaps ? p[i] - prev - 1 : p[i]);
        memcpy(o + 4 * i, &v, 4);
        prev = p[i];
      }
    }
  }
}

/* Position i of a param off the wire: its int of U at b, read through memcpy (any alignment: a file's blob sits
 * wherever its writer put it); `GAPS`: the position before (`prev`, -1 for the first) plus the int plus 1; else the
 * int itself. The one decode rule of the engine's native check and writes. */
template <typename U, int GAPS>
static inline int64_t wire_position(const uint8_t *b, int64_t i, int64_t prev) {
  U v;
  memcpy(&v, b + i * sizeof(U), sizeof(U));
  return GAPS ? prev + (int64_t)v + 1 : (int64_t)v;
}

/* Positions off the wire (the engine's check and decode), per param k: cnt[k] ints of U at blob + at[k].
 * top[k] = the last position. Returns 1 where a param has a position at or past numel[k] or, not `GAPS`, one not
 * above the one before (the engine then checks the flush param by param), else 0. `OUT`: the positions to
 * out + o[k]. */
template <typename U, int GAPS, int OUT>
static int64_t decode_one(const uint8_t *b, int64_t n, int64_t numel, int64_t *out, int64_t *top) {
  int64_t prev = -1, bad = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t x = wire_position<U, GAPS>(b, i, prev);
    if (!GAPS) bad |= x <= prev;
    if (OUT) out[i] = x;
    prev = x;
  }
  *top = prev;
  return bad | (n > 0 && prev >= numel);
}

template <int GAPS, int OUT>
static int64_t decode_many(const uint8_t *blob, const int64_t *at, const int64_t *wid, const int64_t *cnt,
                           const int64_t *numel, int64_t n, int64_t *out, const int64_t *o, int64_t *top) {
  int64_t bad = 0;
  for (int64_t k = 0; k < n; k++)
    bad |= wid[k] == 2 ? decode_one<uint16_t, GAPS, OUT>(blob + at[k], cnt[k], numel[k], OUT ? out + o[k] : 0, top + k)
                       : decode_one<uint32_t, GAPS, OUT>(blob + at[k], cnt[k], numel[k], OUT ? out + o[k] : 0, top + k);
  return bad;
}

API int64_t pos_decode(const uint8_t *blob, const int64_t *at, const int64_t *wid, const int64_t *cnt,
                       const int64_t *numel, int64_t n, int64_t gaps, int64_t *out, const int64_t *o, int64_t *top) {
  if (gaps)
    return out ? decode_many<1, 1>(blob, at, wid, cnt, numel, n, out, o, top)
               : decode_many<1, 0>(blob, at, wid, cnt, numel, n, out, o, top);
  return out ? decode_many<0, 1>(blob, at, wid, cnt, numel, n, out, o, top)
             : decode_many<0, 0>(blob, at, wid, cnt, numel, n, out, o, top);
}

/* The engine's direct writes of whole-block params straight off the wire, per param k: its cnt[k] positions
 * (wire_position), ((T *)dst[k])[position] = ((T *)val[k])[i] (values read through memcpy). Returns -1, or the
 * first k with a position outside [0, numel[k]), its earlier writes done (the flush was checked before any write:
 * that is a broken invariant, and the engine goes dirty). */
template <typename T, typename U, int GAPS>
static int64_t write_one(T *d, const uint8_t *b, const uint8_t *v, int64_t n, int64_t numel) {
  int64_t prev = -1;
  for (int64_t i = 0; i < n; i++) {
    const int64_t x = wire_position<U, GAPS>(b, i, prev);
    if ((uint64_t)x >= (uint64_t)numel) return 1;
    memcpy(d + x, v + i * sizeof(T), sizeof(T));
    prev = x;
  }
  return 0;
}

#define WRITE(NAME, T)                                                                                              \
  API int64_t NAME(const int64_t *dst, const uint8_t *blob, const int64_t *at, const int64_t *wid,                 \
                   const int64_t *cnt, const int64_t *val, const int64_t *numel, int64_t n, int64_t gaps) {          \
    for (int64_t k = 0; k < n; k++) {                                                                               \
      T *d = (T *)dst[k];                                                                                           \
      const uint8_t *b = blob + at[k], *v = (const uint8_t *)val[k];                                                \
      const int64_t bad = gaps ? (wid[k] == 2 ? write_one<T, uint16_t, 1>(d, b, v, cnt[k], numel[k])               \
                                              : write_one<T, uint32_t, 1>(d, b, v, cnt[k], numel[k]))              \
                               : (wid[k] == 2 ? write_one<T, uint16_t, 0>(d, b, v, cnt[k], numel[k])               \
                                              : write_one<T, uint32_t, 0>(d, b, v, cnt[k], numel[k]));             \
      if (bad) return k;                                                                                            \
    }                                                                                                               \
    return -1;                                                                                                      \
  }

WRITE(write_uint8, uint8_t)
WRITE(write_int16, uint16_t)
WRITE(write_int32, uint32_t)
WRITE(write_int64, uint64_t)

/* The scatter (the sender's snapshot fold), per tensor k: ((T *)dst[k])[pos[k][i]] =
 * ((T *)val[k])[i] for cnt[k] positions. `check`: write nothing, return the first k with a position outside
 * [0, numel[k]) (-1: none), so a caller checks all first. */
#define SCATTER(NAME, T)                                                                                               \
  API int64_t NAME(const int64_t *dst, const int64_t *pos, const int64_t *val, const int64_t *cnt,                \
                   const int64_t *numel, int64_t n, int64_t check) {                                                \
    for (int64_t k = 0; k < n; k++) {                                                                               \
      const int64_t *p = (const int64_t *)pos[k];                                                                   \
      if (check) {                                                                                                  \
        int64_t bad = 0;                                                                                            \
        for (int64_t i = 0; i < cnt[k]; i++) bad |= (p[i] < 0) | (p[i] >= numel[k]);                               \
        if (bad) return k;                                                                                          \
        continue;                                                                                                   \
      }                                                                                                             \
      const T *v = (const T *)val[k];                                                                               \
      T *d = (T *)dst[k];                                                                                           \
      for (int64_t i = 0; i < cnt[k]; i++) d[p[i]] = v[i];                                                          \
    }                                                                                                               \
    return -1;                                                                                                      \
  }

SCATTER(scatter_uint8, uint8_t)
SCATTER(scatter_int16, uint16_t)
SCATTER(scatter_int32, uint32_t)
SCATTER(scatter_int64, uint64_t)
"""

_SHARE = 1 << 18  # words or elements per thread at least: below that a thread's start costs more than it hashes
_U64, _I64, _PTR = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
_ROWS = {torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64"}


def _compiler() -> str:
    """The C++ compiler inductor uses: a machine that runs compiled torch kernels has it."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The library, built into inductor's cache dir unless this machine has it (one process at a time, under a file
    lock; keyed by the source, the constants, the compiler's version and the machine's architecture)."""
    import filelock
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from sglang.srt.weight_sync.delta import mix64

    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    defines = [f"-DC{i}={c:#x}ULL" for i, c in enumerate((mix64.C1, mix64.C2, mix64.C3), 1)]
    key = hashlib.blake2b("\n".join([SOURCE, version, platform.machine(), *defines]).encode(),
                          digest_size=8).hexdigest()
    path = os.path.join(cache_dir(), "delta-mix64", f"mix64-cpu-{platform.machine()}-{key}.so")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with filelock.FileLock(path + ".lock"):
        if not os.path.exists(path):
            tmp = f"{path[:-3]}-{os.getpid()}.tmp"
            with open(tmp + ".cpp", "w") as f:
                f.write(SOURCE)
            try:
                subprocess.run([cxx, "-O3", "-shared", "-fPIC", *defines, "-o", tmp + ".so", tmp + ".cpp"],
                               check=True, capture_output=True, text=True)
            except subprocess.CalledProcessError as e:
                raise RuntimeError(f"{cxx} could not build the mix64 CPU kernels: {e.stderr[-2000:]}") from None
            finally:
                os.remove(tmp + ".cpp")
            os.replace(tmp + ".so", path)
    lib = ctypes.CDLL(path)  # a CDLL call releases the GIL: the shares run in parallel
    lib.mix64_sum.argtypes = [_PTR, _I64, _U64, _U64, _U64, _U64, _PTR]
    for name in _ROWS.values():
        getattr(lib, f"mix64_rows_{name}").argtypes = [_PTR, _I64, _I64, _PTR, _U64, _U64, _PTR]
        fn = getattr(lib, f"diff_{name}")
        fn.argtypes, fn.restype = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR], _I64
        fn = getattr(lib, f"scatter_{name}")
        fn.argtypes, fn.restype = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64], _I64
        fn = getattr(lib, f"write_{name}")
        fn.argtypes, fn.restype = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64], _I64
    lib.pos_top.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR]
    lib.pos_write.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR]
    lib.pos_decode.argtypes, lib.pos_decode.restype = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR], _I64
    return lib


_POOL: Tuple[int, Optional[ThreadPoolExecutor]] = (0, None)
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """Workers for as many threads as torch uses now (a process may change that between calls)."""
    global _POOL
    threads = torch.get_num_threads()
    with _POOL_LOCK:
        if _POOL[0] != threads:
            if _POOL[1] is not None:
                _POOL[1].shutdown(wait=False)
            _POOL = (threads, ThreadPoolExecutor(threads, thread_name_prefix="delta-mix64"))
        return _POOL[1]


def _shares(n: int, unit: int) -> list:
    """``[start, end)`` of up to one share per thread over ``n`` items of ``unit`` elements each."""
    parts = max(1, min(torch.get_num_threads(), n, n * unit // _SHARE))
    bounds = [n * k // parts for k in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


def _run(fn: Callable, shares: list) -> None:
    if len(shares) == 1:
        fn(*shares[0])
    else:
        list(_pool().map(lambda s: fn(*s), shares))


def _u64(x: int) -> int:
    return x & 0xFFFFFFFFFFFFFFFF


def sum_runner(words: torch.Tensor, k: torch.Tensor):
    """:class:`mix64._Mix64Sum`'s result for contiguous int64 ``words``: (sum, NaN flag) as 0-d tensors."""
    lib = library()
    c1, _, _, domain, mask, add, top = k.tolist()
    shares = _shares(words.numel(), 1)
    out = torch.zeros((len(shares), 2), dtype=torch.int64)  # per share: its sum, its NaN lanes
    w0, o0 = words.data_ptr(), out.data_ptr()

    def share(row: int, a: int, b: int) -> None:  # word a's key is a * C1 + domain
        lib.mix64_sum(w0 + 8 * a, b - a, _u64(a * c1 + domain), _u64(mask), _u64(add), _u64(top), o0 + 16 * row)

    _run(share, [(row, a, b) for row, (a, b) in enumerate(shares)])
    return out[:, 0].sum(), out[:, 1].ne(0).any()


def rows_runner(dtype: torch.dtype, pairs: bool = False):
    """A :class:`mix64._FingerprintRows` runner for contiguous 2-D blocks of ``dtype`` bits (``pairs``: int32 words of
    two 16-bit elements, :class:`mix64._FingerprintRowsPairs`): each row's sum as an int64 tensor (``k``'s constants
    are compiled into the library)."""
    name = f"mix64_rows_{_ROWS[torch.int16 if pairs else dtype]}"

    def run(bits: torch.Tensor, k: torch.Tensor, rk: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        fn = getattr(library(), name)
        if pairs:
            bits = bits.view(torch.int16)
        rows, cols = bits.shape
        col_key, mask = g.tolist()
        rk = rk.contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        b0, k0, o0, size = bits.data_ptr(), rk.data_ptr(), out.data_ptr(), bits.element_size()

        def share(a: int, b: int) -> None:
            fn(b0 + a * cols * size, b - a, cols, k0 + 8 * a, _u64(col_key), _u64(mask), o0 + 8 * a)

        _run(share, _shares(rows, cols))
        return out

    return run


_HUGE = 1 << 21  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)


@functools.lru_cache(maxsize=None)
def _madvise() -> Optional[Callable]:
    """libc's madvise on Linux, else None."""
    if platform.system() != "Linux":
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(n, dtype)`` on the CPU, its whole 2 MiB pages advised as transparent huge pages (Linux's
    ``madvise`` mode): a fresh buffer of the sender's is written once and freed after the sync, and its first
    touch costs a page fault per 4 KiB page otherwise (measured: filling a fresh 113 MB buffer took 38 ms against
    10 ms advised, the same as memory written before). Where the kernel has no such pages the advice is ignored."""
    t = torch.empty(n, dtype=dtype)
    advise = _madvise() if t.nbytes >= 2 * _HUGE else None
    if advise is not None:
        lo = -(-t.data_ptr() // _HUGE) * _HUGE
        advise(lo, (t.data_ptr() + t.nbytes - lo) // _HUGE * _HUGE, 14)  # MADV_HUGEPAGE
    return t


_WIDTHS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
_DIFF_STEP = 1 << 16  # DIFF_STEP: elements the library diffs between checks of the free slots


def diff_runner(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], want_olds: bool = False,
                first_slots: Optional[int] = None):
    """Where each ``(olds[k], news[k])`` differs bitwise, for contiguous tensors of one dtype (read as raw bits): (the
    positions joined in ``k`` order, each from its tensor's start, int64; ``news``' elements there; ``olds``' with
    ``want_olds``, else None; the count per tensor as a list). One pass over both sides, no per-tensor call: each
    thread takes an equal share of all the elements, across tensor bounds, into slots sized for 1/16 of its share
    (more as it fills them; ``first_slots`` sets that size, for the self-test)."""
    dtype, n = news[0].dtype, len(news)
    fn = getattr(library(), f"diff_{_WIDTHS[dtype.itemsize]}")
    _contiguous(olds, dtype.itemsize)
    _contiguous(news, dtype.itemsize)
    pa = np.fromiter(map(torch.Tensor.data_ptr, olds), dtype=np.int64, count=n)
    pb = np.fromiter(map(torch.Tensor.data_ptr, news), dtype=np.int64, count=n)
    ns = np.fromiter(map(torch.Tensor.numel, news), dtype=np.int64, count=n)
    if len(olds) != n or not np.array_equal(np.fromiter(map(torch.Tensor.numel, olds), dtype=np.int64, count=n), ns):
        raise ValueError("native diff: the old and new tensors do not pair")
    ends = np.cumsum(ns)
    total = int(ends[-1]) if n else 0
    bounds = [a for a, _ in _shares(total, 1)] + [total] if total else [0, 0]
    starts = [int(x) for x in np.searchsorted(ends, bounds, side="right")]  # the tensor each bound falls in
    at = [(k, b - (int(ends[k - 1]) if k else 0)) if k < n else (n, 0) for k, b in zip(starts, bounds)]

    def share(s: int):
        where, counts = np.array(at[s], dtype=np.int64), np.zeros(n, dtype=np.int64)
        (k_end, i_end), left, parts = at[s + 1], bounds[s + 1] - bounds[s], []
        slots = first_slots or min(max(left // 16, 2 * _DIFF_STEP), left)  # `left` slots always suffice
        while True:
            idx, vals = empty(slots, torch.int64), empty(slots, dtype)
            old = empty(slots, dtype) if want_olds else None
            w = fn(pa.ctypes.data, pb.ctypes.data, ns.ctypes.data, where.ctypes.data, k_end, i_end, idx.data_ptr(),
                   vals.data_ptr(), None if old is None else old.data_ptr(), slots, counts.ctypes.data)
            parts.append((idx[:w], vals[:w], None if old is None else old[:w]))
            if (int(where[0]), int(where[1])) == (k_end, i_end):
                return parts, counts
            slots = min(max(2 * slots, 2 * _DIFF_STEP), left)

    results = [share(0)] if len(bounds) == 2 else list(_pool().map(share, range(len(bounds) - 1)))
    parts = [p for ps, _ in results for p in ps]
    counts = sum(c for _, c in results)

    def joined(j: int) -> torch.Tensor:  # a copy of exactly the hits: the slots are sized for more
        ps = [p[j] for p in parts]
        return torch.cat(ps, out=empty(sum(map(len, ps)), ps[0].dtype))

    return joined(0), joined(1), joined(2) if want_olds else None, counts.tolist()


_IS_CPU = operator.attrgetter("is_cpu")


def _contiguous(ts: Sequence[torch.Tensor], width: int) -> None:
    """The kernels read and write tensors by address: each must be a contiguous CPU tensor of ``width``-byte
    elements (checked in C loops: the sender hands ~19k tensors per sync on a MoE model)."""
    if not (all(map(torch.Tensor.is_contiguous, ts)) and all(map(_IS_CPU, ts))
            and set(map(torch.Tensor.element_size, ts)) <= {width}):
        raise ValueError(f"native kernels take contiguous CPU tensors of {width}-byte elements")


def _addresses(base: torch.Tensor, counts: np.ndarray) -> np.ndarray:
    """The address of each of ``counts``' consecutive runs in the flat contiguous ``base``."""
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return base.data_ptr() + starts * base.element_size()


def _param_shares(counts: np.ndarray) -> list:
    """``[start, end)`` ranges of params for the threads, about equal in their elements."""
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    cuts = [int(x) for x in np.searchsorted(ends, [a for a, _ in _shares(total, 1)][1:], side="left")] if total else []
    bounds = sorted({0, *cuts, len(counts)})
    return list(zip(bounds, bounds[1:]))


def positions_runner(pieces: Sequence[torch.Tensor], counts: Sequence[Sequence[int]], gaps: bool, widths):
    """Params' sorted int64 positions (``pieces``: contiguous, each the joined positions of ``counts[i]`` params) to
    the wire: ``widths(tops, lows)`` turns each param's largest and smallest int (gaps, or with ``gaps`` False
    positions; int64 arrays) into its width in bytes, 2 or 4, refusing what no width encodes; returns (the uint8 blob, each param's (byte start,
    byte end, width)). Two passes over the positions (the tops, then the ints written at their widths) into one fresh
    blob."""
    lib = library()
    _contiguous(pieces, 8)
    if len(pieces) != len(counts) or any(p.dtype != torch.int64 or p.numel() != sum(cs)
                                         for p, cs in zip(pieces, counts)):
        raise ValueError("native positions: the pieces are not int64 or do not pair with their counts")
    cnt = np.fromiter((c for cs in counts for c in cs), dtype=np.int64)
    pos = np.concatenate([_addresses(p, np.asarray(cs, dtype=np.int64)) for p, cs in zip(pieces, counts)]) \
        if len(cnt) else np.zeros(0, dtype=np.int64)
    top, low = np.zeros(len(cnt), dtype=np.int64), np.zeros(len(cnt), dtype=np.int64)
    shares = _param_shares(cnt)
    _run(lambda a, b: lib.pos_top(pos.ctypes.data + 8 * a, cnt.ctypes.data + 8 * a, b - a, int(gaps),
                                  top.ctypes.data + 8 * a, low.ctypes.data + 8 * a), shares)
    wid = np.asarray(widths(top, low), dtype=np.int64)
    ends = np.cumsum(cnt * wid)
    at = ends - cnt * wid
    blob = empty(int(ends[-1]) if len(ends) else 0, torch.uint8)
    _run(lambda a, b: lib.pos_write(pos.ctypes.data + 8 * a, cnt.ctypes.data + 8 * a, b - a, int(gaps),
                                    at.ctypes.data + 8 * a, wid.ctypes.data + 8 * a, blob.data_ptr()), shares)
    return blob, list(zip(at.tolist(), ends.tolist(), wid.tolist()))


def scatter_runner(dsts: Sequence[torch.Tensor], counts: Sequence[int], idx: torch.Tensor,
                   values: torch.Tensor) -> None:
    """``dsts[k].view(-1)[positions] = values`` as bits, for each tensor's share of the joined int64 ``idx`` and
    ``values`` (``counts`` each; all contiguous, the tensors of the values' width): the sender's snapshot fold of a
    recorded run in one call, with no joined and shifted copy of its positions as one ``index_copy_`` per storage
    needs. Raises, before any write, where a position is outside its tensor."""
    fn = getattr(library(), f"scatter_{_WIDTHS[values.element_size()]}")
    _contiguous(dsts, values.element_size())
    _contiguous([values], values.element_size())
    cnt = np.asarray(counts, dtype=np.int64)
    if idx.dtype != torch.int64 or not idx.is_contiguous() or len(cnt) != len(dsts) or \
            not int(cnt.sum()) == idx.numel() == values.numel():
        raise ValueError("native scatter: positions, values and counts do not pair")
    dst = np.fromiter(map(torch.Tensor.data_ptr, dsts), dtype=np.int64, count=len(dsts))
    numel = np.fromiter(map(torch.Tensor.numel, dsts), dtype=np.int64, count=len(dsts))
    pos, val = _addresses(idx, cnt), _addresses(values, cnt)
    shares = _param_shares(cnt)
    bad = []

    def share(check: int, a: int, b: int) -> None:
        k = fn(dst.ctypes.data + 8 * a, pos.ctypes.data + 8 * a, val.ctypes.data + 8 * a, cnt.ctypes.data + 8 * a,
               numel.ctypes.data + 8 * a, b - a, check)
        if k >= 0:
            bad.append(a + k)

    _run(functools.partial(share, 1), shares)  # every position checked before any is written
    if bad:
        k = min(bad)
        raise ValueError(f"native scatter: a position of tensor {k} is outside its {int(numel[k])} elements")
    _run(functools.partial(share, 0), shares)


def _fits_blob(blob: torch.Tensor, at: np.ndarray, wid: np.ndarray, cnt: np.ndarray) -> bool:
    """Whether params' wire ints (byte start, width 2 or 4, count each) lie inside the contiguous CPU uint8 ``blob``:
    what the engine's kernels read by address."""
    return blob.dtype == torch.uint8 and blob.is_contiguous() and blob.is_cpu and len(at) == len(wid) == len(cnt) \
        and bool(np.isin(wid, (2, 4)).all()) and (not len(at) or (
            at.min() >= 0 and cnt.min() >= 0 and (at + cnt * wid).max() <= blob.numel()))


def decode_runner(blob: torch.Tensor, at: Sequence[int], wid: Sequence[int], cnt: Sequence[int],
                  numel: Sequence[int], gaps: bool, out: Optional[torch.Tensor]):
    """Params' positions off the wire (the uint8 ``blob``; per param its byte start, width 2 or 4, count and element
    count): (each param's last position as an int64 tensor, whether any param has a position out of range or, not
    ``gaps``, out of order: a 0-d bool tensor); with ``out`` (int64) the positions there, joined. One pass."""
    lib = library()
    at, wid, cnt, numel = (np.asarray(x, dtype=np.int64) for x in (at, wid, cnt, numel))
    if not _fits_blob(blob, at, wid, cnt) or len(numel) != len(cnt) or \
            (out is not None and (out.dtype != torch.int64 or not out.is_contiguous() or not out.is_cpu
                                  or out.numel() < int(cnt.sum()))):
        raise ValueError("native decode: the params do not fit the blob or the output")
    o = np.zeros(len(cnt), dtype=np.int64)
    np.cumsum(cnt[:-1], out=o[1:])
    top = np.zeros(len(cnt), dtype=np.int64)
    bad = []

    def share(a: int, b: int) -> None:
        bad.append(lib.pos_decode(blob.data_ptr(), at.ctypes.data + 8 * a, wid.ctypes.data + 8 * a,
                                  cnt.ctypes.data + 8 * a, numel.ctypes.data + 8 * a, b - a, int(gaps),
                                  None if out is None else out.data_ptr(), o.ctypes.data + 8 * a,
                                  top.ctypes.data + 8 * a))

    _run(share, _param_shares(cnt))
    return torch.from_numpy(top), torch.tensor(any(bad))


def write_runner(flats: Sequence[torch.Tensor], sid, doff, numel, blob: torch.Tensor, at, wid, cnt,
                 values: torch.Tensor, val_start, gaps: bool) -> None:
    """Params written straight off the wire into whole blocks of their storages: per param its storage's flat
    tensor ``flats[sid]``, its block's start there and element count, its ints' byte start in ``blob``, width (2 or
    4) and count, its values' start in ``values`` (of those flats' width); ``gaps`` as the encoding. No int64
    positions made, no index op: one pass over the wire ints and values. Everything is checked to fit before the
    library is called (ValueError: nothing written); a position out of its block, which the engine's checks
    exclude, raises RuntimeError with the writes before it done."""
    sid, doff, numel, at, wid, cnt, val_start = (np.asarray(x, dtype=np.int64)
                                                 for x in (sid, doff, numel, at, wid, cnt, val_start))
    size = values.element_size()
    fn = getattr(library(), f"write_{_WIDTHS[size]}")
    if len(sid) and (sid.min() < 0 or sid.max() >= len(flats)):
        raise ValueError("native write: a storage index is out of range")
    _contiguous([flats[s] for s in np.unique(sid).tolist()], size)
    _contiguous([values], size)
    lens = np.fromiter(map(torch.Tensor.numel, flats), dtype=np.int64, count=len(flats))
    if not _fits_blob(blob, at, wid, cnt) or not len(sid) == len(doff) == len(numel) == len(cnt) == len(val_start) \
            or len(sid) and (doff.min() < 0 or (doff + numel > lens[sid]).any() or val_start.min() < 0
                             or (val_start + cnt).max() > values.numel()):
        raise ValueError("native write: the params do not fit their storages, the blob or the values")
    ptrs = np.fromiter(map(torch.Tensor.data_ptr, flats), dtype=np.int64, count=len(flats))
    dst, val = ptrs[sid] + doff * size, values.data_ptr() + val_start * size
    bad = []

    def share(a: int, b: int) -> None:
        k = fn(dst.ctypes.data + 8 * a, blob.data_ptr(), at.ctypes.data + 8 * a, wid.ctypes.data + 8 * a,
               cnt.ctypes.data + 8 * a, val.ctypes.data + 8 * a, numel.ctypes.data + 8 * a, b - a, int(gaps))
        if k >= 0:
            bad.append(a + k)

    _run(share, _param_shares(cnt))
    if bad:
        raise RuntimeError(f"native write: a position of param {min(bad)} is outside its {int(numel[min(bad)])} "
                           "elements")


SPARSE = types.SimpleNamespace(diff=diff_runner, positions=positions_runner, scatter=scatter_runner,
                               decode=decode_runner, write=write_runner)
