"""The ``mix64`` sum of 64-bit words, the one hash behind every flush checksum: eager torch ops, and one compiled kernel.

``sum_i mix64(w_i ^ (i * C1 + domain)) mod 2**64`` (``mix64``: splitmix64's finalizer, a bijection). Eager, that is
~14 passes over the words per block; on CPU it cost ~8x a full ``load_weights`` of the same bytes. The same expression
compiled ahead of time by inductor (C++ on CPU, Triton on CUDA; ``torch.export`` + AOTInductor, so a call has no
guards to re-check and never recompiles) is one pass at memory speed. A process switches to the kernel only

* after it has hashed :data:`AUTO_WORDS` words eagerly (``SGLANG_DELTA_MIX64_KERNEL=auto``, the default): the kernel
  is built (or loaded from inductor's cache dir, built once per machine under a file lock) on a background thread
  while the eager path goes on serving, so a small model or a short run never pays for compiling; and
* after the kernel reproduced the eager sums and NaN flags bit for bit on edge words (sign bit, wrap-around,
  every lane, odd lengths) on that device; a kernel that does not is never used.

``compiled`` builds it at first use and raises if it cannot (tests, bench, gpu-check); ``eager`` never builds it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import math
import os
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

M64 = 0xFFFFFFFFFFFFFFFF
C1, C2, C3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# |bits| above the largest finite/inf pattern is a NaN: (int view, abs mask, inf bits) per float dtype.
NAN_BITS = {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float16: (torch.int16, 0x7FFF, 0x7C00),
            torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000), torch.float8_e4m3fn: (torch.uint8, 0x7F, 0x7E),
            torch.float8_e5m2: (torch.uint8, 0x7F, 0x7C)}
MODE_ENV = "SGLANG_DELTA_MIX64_KERNEL"
MODES = ("auto", "compiled", "eager")
AUTO_WORDS = 1 << 26  # 512 MiB hashed eagerly (~0.5 s on a CPU core pair) before a process builds the kernel


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


class _Mix64Sum(torch.nn.Module):
    """The eager sum and NaN test as one expression: what inductor fuses into one pass. Every constant comes in as a
    tensor (``k`` = C1, C2, C3, domain, NaN lanes): a constant factor would be folded into index arithmetic, where
    inductor's C++ lets int64 products overflow (undefined behaviour; gcc then miscompiles the keys)."""

    def forward(self, words, k):
        z = (torch.arange(words.shape[0], dtype=torch.int64, device=words.device) * k[0] + k[3]) ^ words
        z = z ^ ((z >> 30) & ((1 << 34) - 1))
        z = z * k[1]
        z = z ^ ((z >> 27) & ((1 << 37) - 1))
        z = z * k[2]
        z = z ^ ((z >> 31) & ((1 << 33) - 1))
        return z.sum(), (((words & k[4]) + k[5]) & k[6]).ne(0).any()


class _Fingerprint(torch.nn.Module):
    """:func:`eager_fingerprint` of a 2-D block of raw value bits (any int width, widened in registers), with the
    keys made in the kernel from the block's geometry (``g`` = key per row, key per column, first key, mask) instead
    of read from memory; constants as tensors, as in :class:`_Mix64Sum`."""

    def forward(self, bits, k, g):
        rows = torch.arange(bits.shape[0], dtype=torch.int64, device=bits.device)
        cols = torch.arange(bits.shape[1], dtype=torch.int64, device=bits.device)
        z = (g[2] + rows[:, None] * g[0] + cols[None, :] * g[1]) ^ ((bits.to(torch.int64) & g[3]) * k[1])
        z = z ^ ((z >> 30) & ((1 << 34) - 1))
        z = z * k[1]
        z = z ^ ((z >> 27) & ((1 << 37) - 1))
        z = z * k[2]
        z = z ^ ((z >> 31) & ((1 << 33) - 1))
        return z.sum()


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    return device.type


def _build(kernel: "Kernel", device: torch.device):
    """Load ``kernel``'s package for ``device``, compiling it first if this machine has none (one process at a
    time). One package per kernel source and argument dtypes, torch build and device kind, in inductor's cache dir."""
    import filelock
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    src = inspect.getsource(kernel.module) + repr([t.dtype for t in kernel.example]) + torch.__version__
    key = hashlib.blake2b((src + _device_key(device)).encode(), digest_size=8).hexdigest()
    path = os.path.join(cache_dir(), "delta-mix64", f"{kernel.name}-{_device_key(device)}-{key}.pt2")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with filelock.FileLock(path + ".lock"):
        if not os.path.exists(path):
            args = tuple(t.to(device) for t in kernel.example)
            dims = {d: torch.export.Dim(f"n{d}", min=1, max=1 << 40) for d in range(args[0].dim())}
            program = torch.export.export(kernel.module(), args, dynamic_shapes=(dims,) + (None,) * (len(args) - 1))
            tmp = f"{path[:-4]}-{os.getpid()}.tmp.pt2"  # a package name must end in .pt2
            torch._inductor.aoti_compile_and_package(program, package_path=tmp)
            os.replace(tmp, path)
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else -1)
    return torch._inductor.aoti_load_package(path, device_index=index)


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


def _test_fingerprint(runner, device: torch.device, dtype: torch.dtype) -> None:
    """Raise unless ``runner`` matches the eager fingerprint on ``device`` for ``dtype`` bits: one row, one column
    and 2-D blocks, row and column strides of either order, large offsets, every seed and mask kind, edge words."""
    g = torch.Generator().manual_seed(0xF1)
    per_word = 8 // dtype.itemsize
    for n in _TEST_LENGTHS[::3]:
        bits = _test_words(n, g, device).view(dtype)  # n words: n * per_word elements
        m = n * per_word
        for rows, s0, s1, off in ((1, 0, 1, 0), (1, 0, 3, 11), (m, 7, 0, 5), (per_word, 1, n, 2), (n, 1 << 20, 1, 1 << 33)):
            block = bits.reshape(rows, m // rows)
            for seed, mask in ((0, -1), (i64(0xA5A5A5A5DEADBEEF), 0xFFFF), (1, 0xFF), (-1, 0xFFFFFFFF)):
                (ka, kb), key0 = fingerprint_keys((s0, s1), off, seed)
                want = int(eager_fingerprint(block.to(torch.int64).reshape(-1), block.shape, (ka, kb), key0, mask))
                got = int(run_fingerprint(runner, block, torch.tensor([ka, kb, key0, mask], device=device)))
                if got != want:
                    raise RuntimeError(f"compiled fingerprint differs from eager on {device} at {tuple(block.shape)} "
                                       f"{dtype}, geometry {(s0, s1, off)}: {got} vs {want}")


_CONSTS: Dict[Tuple, torch.Tensor] = {}


def _consts(device: torch.device, *extra: int) -> torch.Tensor:
    """C1, C2, C3 and ``extra`` on ``device``, made once (no copy to the device per call)."""
    key = (str(device), extra)
    if key not in _CONSTS:
        _CONSTS[key] = torch.tensor([i64(C1), i64(C2), i64(C3), *extra], dtype=torch.int64, device=device)
    return _CONSTS[key]


def _run_sum(runner, words: torch.Tensor, domain: int, lanes: Tuple[int, int, int]):
    return runner(words.contiguous(), _consts(words.device, domain, *lanes))


def run_fingerprint(runner, bits: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """The element hashes of the 2-D block ``bits`` at the keys and mask of ``row`` (on the device: a row of a table
    copied there once per fingerprint)."""
    return runner(bits.contiguous(), _consts(bits.device), row)


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    module: type
    example: Tuple[torch.Tensor, ...]  # CPU tensors of the argument dtypes and ranks (the first one's dims are dynamic)
    self_test: Callable


SUM = Kernel("mix64", _Mix64Sum, (torch.zeros(64, dtype=torch.int64), torch.zeros(7, dtype=torch.int64)), _test_sum)
# one fingerprint kernel per width of raw bits (fp8, bf16/fp16, fp32, 64-bit), each built when first needed
FINGERPRINT = {dt: Kernel(f"fingerprint-{str(dt)[6:]}", _Fingerprint, (torch.zeros(8, 8, dtype=dt), torch.zeros(
    3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)), functools.partial(_test_fingerprint, dtype=dt))
    for dt in (torch.uint8, torch.int16, torch.int32, torch.int64)}


class _Kernels:
    """Per kernel and device: elements hashed eagerly so far, and the kernel once built and tested (or why not)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen: Dict[Tuple[str, str], int] = {}
        self.runner: Dict[Tuple[str, str], object] = {}
        self.state: Dict[Tuple[str, str], str] = {}
        self.seconds: Dict[Tuple[str, str], float] = {}

    def ready(self, kernel: Kernel, device: torch.device, n: int):
        """The tested kernel for ``device`` or None (then hash eagerly); may start building it."""
        key = (kernel.name, str(device))
        runner = self.runner.get(key)
        if runner is not None:
            return runner
        mode = os.environ.get(MODE_ENV, "auto")
        if mode not in MODES:
            raise ValueError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(MODES)}")
        if mode == "eager":
            return None
        if mode == "compiled":
            return self.warm(kernel, device)
        with self.lock:
            self.seen[key] = self.seen.get(key, 0) + n
            if key in self.state or self.seen[key] < AUTO_WORDS:
                return None
            self.state[key] = "building"
        threading.Thread(target=self._build_quietly, args=(kernel, device), name=f"delta-{kernel.name}-build",
                         daemon=True).start()
        return None

    def warm(self, kernel: Kernel, device: torch.device):
        """Build, test and install ``kernel`` for ``device`` now; raise if it cannot be used."""
        key = (kernel.name, str(device))
        if key not in self.runner:
            t0 = time.perf_counter()
            runner = _build(kernel, device)
            kernel.self_test(runner, device)
            self.seconds[key] = time.perf_counter() - t0
            self.runner[key], self.state[key] = runner, "compiled"
            logger.info("delta %s: compiled kernel on %s in use (ready after %.1f s)", kernel.name, device,
                        self.seconds[key])
        return self.runner[key]

    def _build_quietly(self, kernel: Kernel, device: torch.device) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # a new thread starts on device 0
            self.warm(kernel, device)
        except Exception as e:  # the eager path stays: correct, only slower
            self.state[(kernel.name, str(device))] = f"failed: {type(e).__name__}: {e}"[:500]
            logger.warning("delta %s: compiled kernel unavailable on %s, hashing eagerly: %s", kernel.name, device, e)

    def failed(self, kernel: Kernel, device: torch.device, e: Exception) -> None:
        key = (kernel.name, str(device))
        self.runner.pop(key, None)
        self.state[key] = f"failed: {type(e).__name__}: {e}"[:500]
        logger.warning("delta %s: compiled kernel failed on %s, hashing eagerly from now on: %s", kernel.name, device, e)


KERNELS = _Kernels()


def warm(device, kernel: Kernel = SUM) -> float:
    """Build ``kernel`` for ``device`` now (bench, gpu-check); seconds it took, 0 if it was ready."""
    key = (kernel.name, str(torch.device(device)))
    had = key in KERNELS.runner
    KERNELS.warm(kernel, torch.device(device))
    return 0.0 if had else KERNELS.seconds[key]


def kernel_state(device, kernel: Kernel = SUM) -> str:
    """``compiled``, ``building``, ``failed: ...`` or ``eager`` (not built yet) for ``device``."""
    return KERNELS.state.get((kernel.name, str(torch.device(device))), "eager")


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
    runner = KERNELS.ready(SUM, words.device, words.numel()) if words.numel() else None
    total = found = None
    if runner is not None:
        try:
            total, found = _run_sum(runner, words.detach(), domain, lanes)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run leaves the eager path, never a wrong sum
            KERNELS.failed(SUM, words.device, e)
    if total is None:
        total, found = _eager_sum(words, domain, lanes)
    if tail is not None:
        t, f = _eager_sum(tail, domain, lanes, first=words.numel())
        total, found = total + t, found | f
    return total, (found if nan_dtype is not None else None)
