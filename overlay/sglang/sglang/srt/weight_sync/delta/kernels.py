"""Kernels compiled ahead of time (``torch.export`` + AOTInductor: Triton on CUDA; on CPU a C twin from :mod:`native`
where a kernel has one, else C++) for hashes that eager torch ops run in many passes: built once per machine, tested
in every process before use, used only once ready.

A call into an AOTInductor package has no guards to re-check and never recompiles, whatever the caller's grad mode,
dispatch modes or thread. A process switches to a kernel only

* after it has done :data:`AUTO_WORDS` elements of that kernel's work eagerly (``SGLANG_DELTA_MIX64_KERNEL=auto``,
  the default): the kernel is built (or loaded from inductor's cache dir, built once per machine under a file lock)
  on a background thread while the eager path goes on serving, so a small model or a short run never pays for
  compiling; and
* after the kernel reproduced the eager results bit for bit on that device (its ``self_test``); a kernel that does
  not, or that fails at run time, is never used again in that process.

``compiled`` builds at first use and raises if it cannot (tests, bench, gpu-check); ``eager`` never builds.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import os
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

MODE_ENV = "SGLANG_DELTA_MIX64_KERNEL"
MODES = ("auto", "compiled", "eager")
AUTO_WORDS = 1 << 26  # 512 MiB hashed eagerly (~0.5 s on a CPU core pair) before a process builds the kernel


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    module: type
    example: Tuple[torch.Tensor, ...]  # CPU tensors of the argument dtypes and ranks
    self_test: Callable
    # per argument, a name for each dynamic dim (None: static); dims of one name are one size. Default: the first
    # argument's dims
    dynamic: Optional[Tuple[Optional[Tuple[str, ...]], ...]] = None
    # the same kernel on CPU from :mod:`native` (called as the package would be), used there instead of the package
    cpu: Optional[Callable] = None

    def dynamic_shapes(self) -> tuple:
        """``torch.export``'s ``dynamic_shapes`` for :attr:`dynamic`."""
        spec = self.dynamic or (tuple(f"n{d}" for d in range(self.example[0].dim())),)
        dims: Dict[str, object] = {}
        return tuple({d: dims.setdefault(n, torch.export.Dim(n, min=1, max=1 << 40)) for d, n in enumerate(names)}
                     if names else None for names in spec + (None,) * (len(self.example) - len(spec)))


def _device_key(device: torch.device) -> str:
    """The kind of device a package runs on. On CPU the vector ISA it was compiled for is part of it: a cache dir
    shared by machines of two ISAs must not hand one an AVX-512 package it cannot execute."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    return f"{device.type}-{_cpu_isa() or 'scalar'}"


def _cpu_isa() -> str:
    """Inductor's vector ISA for this CPU, when its 64-bit integer lanes multiply natively (AVX-512); '' otherwise.
    Below AVX-512, ATen's vector classes multiply int64 lanes one at a time through memory, and the hashes are
    64-bit multiplies: scalar code is faster (measured on the checksum: 7.1-7.6 GB/s scalar against 4.4-4.6 GB/s
    AVX2 vectors on the same two cores; AVX-512 vectors 12-13 GB/s)."""
    from torch._inductor.cpu_vec_isa import VecAVX512, pick_vec_isa

    isa = pick_vec_isa()
    return str(isa).split()[0] if isinstance(isa, VecAVX512) else ""


def _options(device: torch.device) -> dict:
    """Inductor options the kernels are compiled with (part of a package's cache key).

    CPU: every sum reduces over all threads of the calling process, however many it has at run time. Inductor's
    default decides from the example's 64 elements that one thread will do, and where it does parallelize, sizes its
    per-thread partial sums by the compiling process's thread count while the parallel region takes the running
    one's. Scalar code where vectors would emulate the multiplies (:func:`_cpu_isa`)."""
    if device.type != "cpu":
        return {}
    return {"cpp.dynamic_threads": True, **({} if _cpu_isa() else {"cpp.simdlen": 1})}


_BUILD_LOCK = threading.Lock()  # one export at a time in a process: tracing is not safe to run in two threads


def _build(kernel: Kernel, device: torch.device):
    """``kernel``'s runner for ``device``: on CPU its :mod:`native` twin (the library built first if this machine
    has none), elsewhere its package (:func:`package`)."""
    if device.type == "cpu" and kernel.cpu is not None:
        from sglang.srt.weight_sync.delta import native

        native.library()
        return kernel.cpu
    return package(kernel, device)


def package(kernel: Kernel, device: torch.device):
    """Load ``kernel``'s package for ``device``, compiling it first if this machine has none (one process at a
    time). One package per kernel module source and argument dtypes, torch build and device kind, in inductor's
    cache dir. On CPU the packages are what tests build to check the path CUDA runs."""
    with _BUILD_LOCK:
        return _build_locked(kernel, device)


def _build_locked(kernel: Kernel, device: torch.device):
    import filelock
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    # the whole module's source: a kernel's expression may call helpers beside its class
    src = (inspect.getsource(inspect.getmodule(kernel.module)) + repr([t.dtype for t in kernel.example])
           + torch.__version__ + repr(_options(device)))
    key = hashlib.blake2b((src + _device_key(device)).encode(), digest_size=8).hexdigest()
    path = os.path.join(cache_dir(), "delta-mix64", f"{kernel.name}-{_device_key(device)}-{key}.pt2")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with filelock.FileLock(path + ".lock"):
        if not os.path.exists(path):
            args = tuple(t.to(device) for t in kernel.example)
            program = torch.export.export(kernel.module(), args, dynamic_shapes=kernel.dynamic_shapes())
            tmp = f"{path[:-4]}-{os.getpid()}.tmp.pt2"  # a package name must end in .pt2
            with torch._inductor.config.patch(_options(device)):
                torch._inductor.aoti_compile_and_package(program, package_path=tmp)
            os.replace(tmp, path)
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else -1)
    quiet = device.type == "cpu" and not _cpu_isa()
    loader_log = logging.getLogger("torch.export.pt2_archive._package")
    level = loader_log.level
    if quiet:  # it warns that the package's ISA (scalar, as asked for) is not the machine's
        loader_log.setLevel(logging.ERROR)
    try:
        return _direct(torch._inductor.aoti_load_package(path, device_index=index))
    finally:
        loader_log.setLevel(level)


def _direct(package):
    """The package's runner called with a flat list of tensors where this torch exposes it: its public call re-parses
    the call spec and flattens/unflattens the arguments on every call (~40 us, against ~7 for the run itself; a
    fingerprint calls once per tensor). The self-test checks this very callable before it is used."""
    loader = getattr(package, "loader", None)
    if not callable(getattr(loader, "boxed_run", None)):
        return package

    def run(*tensors):
        out = loader.boxed_run(list(tensors))
        return out[0] if len(out) == 1 else tuple(out)

    return run


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
            self.failed(kernel, device, e)

    def failed(self, kernel: Kernel, device: torch.device, e: Exception) -> None:
        """``kernel`` could not be built, or failed at run time: this process hashes eagerly from now on."""
        key = (kernel.name, str(device))
        self.runner.pop(key, None)
        self.state[key] = f"failed: {type(e).__name__}: {e}"[:500]
        logger.warning("delta %s: compiled kernel unavailable on %s, hashing eagerly: %s", kernel.name, device, e)


KERNELS = _Kernels()


def warm(device, kernel: Kernel) -> float:
    """Build ``kernel`` for ``device`` now (bench, gpu-check); seconds it took, 0 if it was ready."""
    key = (kernel.name, str(torch.device(device)))
    had = key in KERNELS.runner
    KERNELS.warm(kernel, torch.device(device))
    return 0.0 if had else KERNELS.seconds[key]


def kernel_state(device, kernel: Kernel) -> str:
    """``compiled``, ``building``, ``failed: ...`` or ``eager`` (not built yet) for ``device``."""
    return KERNELS.state.get((kernel.name, str(torch.device(device))), "eager")
