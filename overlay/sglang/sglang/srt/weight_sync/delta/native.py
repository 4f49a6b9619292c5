"""The mix64 kernels on CPU: :data:`SOURCE` (C++) built into a shared library once per machine and called through ctypes
on all of torch's threads, each on a share of the words or rows.

Why not the AOTInductor packages CUDA runs: below AVX-512 torch's CPU vector classes multiply 64-bit lanes one at a
time through memory, so inductor's kernels for these 64-bit multiply hashes run scalar. A compiler vectorizes the
same loops written in C++ with 32-bit multiplies (measured on one AVX2 machine, two threads: the bf16 checksum 12.4
against 5.1 GB/s, the bf16 fingerprint 2.0 against 0.76 G elements/s). The runners take and return what the packages
do, so :mod:`kernels` tests them the same way before any use. The source is a string here, not a file beside this
one: a wheel built from a patched tree packs only Python files.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Tuple

import torch

SOURCE = r"""/* mix64.py's blob sums and fingerprint row sums as loops a compiler vectorizes. */
#include <stdint.h>

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
 * lane). A constant `nan` lets the compiler drop the NaN test where the blob has no float lanes. */
static inline void sum_body(const uint64_t *w, int64_t n, uint64_t key0, uint64_t mask, uint64_t add, uint64_t top,
                            uint64_t *out, const int nan) {
  uint64_t s = 0, f = 0;
  for (int64_t i = 0; i < n; i++) {
    uint64_t x = w[i];
    if (nan) f |= ((x & mask) + add) & top;
    s += mix(x ^ ((uint64_t)i * C1 + key0));
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
