"""What a model's own ``load_weights`` may write during a delta apply or a full sync, thread by thread.

Two layers watch the loader:

* Python level: ``Tensor.copy_`` / ``Tensor.fill_`` are routed through a **per-thread stack of scopes**
  (:func:`scoped`). Only the thread that opened a scope — and the threads it starts while the scope
  is open (the DeepSeek-V2/V3 loader loads host tensors on a thread pool it creates) — see that
  scope's replacements; every other thread keeps the native ops. Scopes nest (the delta apply opens a
  native scope around ``post_load_weights``) and pop in order; nothing is saved and restored. The
  replacements are installed while any scope is open, under a lock, and removed with the last one.
* aten level: a watch per thread of the scope (:class:`WriteGuard` for deltas, :class:`FullSyncWatch` for full
  syncs) sees writes that bypass ``copy_``/``fill_``. It is handed only the ops that can write (:func:`_watching`):
  a dispatch mode would run Python on every view op and ``.data`` of a loader, more than the load itself.

A ``copy_``/``fill_`` into the model's storage from a thread outside the scope while it is open is
recorded in :attr:`Scope.foreign`; the delta apply then fails closed (the engine is dirty and gets a
full sync). Writes of other ops from foreign threads are invisible to both layers.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import threading
from typing import Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.weight_sync.delta import draft
from sglang.srt.weight_sync.delta.ops import nan_mask
from sglang.srt.weight_sync.delta.wire import DeltaError

__all__ = ["Scope", "scoped", "storage_index", "model_tensors", "delta_apply_context", "FullSyncWatch", "nan_mask"]

logger = logging.getLogger(__name__)
_NATIVE_COPY, _NATIVE_FILL, _NATIVE_START = torch.Tensor.copy_, torch.Tensor.fill_, threading.Thread.start
_tls = threading.local()
_lock = threading.Lock()
_open: List["Scope"] = []  # scopes open in any thread, for telling foreign writes apart


# ---------------------------------------------------------------- the model's storage


def model_tensors(model: torch.nn.Module) -> List[torch.Tensor]:
    return [t for _, t in model.named_parameters(remove_duplicate=False)] + \
        [t for _, t in model.named_buffers(remove_duplicate=False)]


class RangeIndex:
    """Byte ranges ``[start, end)`` with an item each; :meth:`find` bisects to the range that holds an address.

    ``merge``: a range that starts inside an earlier one is folded into it (aliases, nested views: the
    enclosing item stands); otherwise every range is kept and, of equal starts, the last sorted wins.
    """

    def __init__(self, rows, merge: bool = False):
        rows = sorted((r for r in rows if r[1] > r[0]), key=lambda r: (r[0], r[1]))
        self.starts, self.ends, self.items = [], [], []
        for start, end, item in rows:
            if merge and self.ends and start < self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], end)
                continue
            self.starts.append(start)
            self.ends.append(end)
            self.items.append(item)

    def find(self, ptr: int):
        i = bisect.bisect_right(self.starts, ptr) - 1
        return self.items[i] if i >= 0 and ptr < self.ends[i] else None


def storage_index(model: torch.nn.Module) -> Callable[[torch.Tensor], Optional[str]]:
    """Map a tensor to the name of the param/buffer whose storage holds it (views included), else None:
    a ``narrow``ed shard of a fused QKV weight lands inside its owner, a loader's scratch tensor in a gap."""
    index = RangeIndex(((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in
                        list(model.named_parameters(remove_duplicate=False))
                        + list(model.named_buffers(remove_duplicate=False)) if t.numel()), merge=True)

    def owner(t: torch.Tensor) -> Optional[str]:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return None
        return index.find(t.data_ptr())

    return owner


def _storages(model: torch.nn.Module) -> set:
    return {t.untyped_storage().data_ptr() for t in model_tensors(model) if t.numel()}


_WRITES: Dict[object, tuple] = {}  # aten op -> its written arguments: (position, name, keyword-only)


def _writes(func) -> tuple:
    """The arguments an aten op writes, by its schema's write annotations (read once per op): most ops a loader
    runs (views, casts) write none."""
    writes = _WRITES.get(func)
    if writes is None:
        writes = _WRITES[func] = tuple((i, a.name, a.kwarg_only) for i, a in _written(func._schema))
    return writes


def _written(schema) -> list:
    """(position, argument) of each argument a schema annotates as written."""
    return [(i, a) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _model_write(func, args, kwargs, storages: set) -> Optional[torch.Tensor]:
    """The model tensor an aten op writes, else None."""
    for i, name, kwarg_only in _writes(func):
        v = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() in storages:
                return t
    return None


def _is_nan_scalar(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point() and bool(torch.isnan(value))
    return isinstance(value, float) and math.isnan(value)


# ---------------------------------------------------------------- thread-scoped copy_/fill_


class Scope:
    """What ``copy_``/``fill_`` do for one apply, in its thread and the threads it starts.

    ``copy_``/``fill_``: the replacements (None: the native op); ``owner``: the model's storage index
    (None: this scope does not watch for foreign writes); ``thread_modes``: a factory of the watches
    (:class:`_Watch`) each thread of the scope runs under.
    """

    def __init__(self, copy_=None, fill_=None, owner=None, thread_modes: Callable[[], list] = lambda: []):
        self.copy_, self.fill_, self.owner, self.thread_modes = copy_, fill_, owner, thread_modes
        self.open = False
        self.foreign: List[str] = []  # "thread name: op into param" of writes from outside the scope

    def note_foreign(self, op: str, dst: torch.Tensor) -> None:
        name = self.owner(dst) if self.owner is not None else None
        if name is not None:
            self.foreign.append(f"{threading.current_thread().name}: {op} into {name!r}")


def _current() -> Optional[Scope]:
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack and stack[-1].open else None


def _copy_(dst, src, non_blocking=False):
    s = _current()
    if s is not None:
        return (s.copy_ or _NATIVE_COPY)(dst, src, non_blocking)
    for other in list(_open):
        other.note_foreign("copy_", dst)
    return _NATIVE_COPY(dst, src, non_blocking)


def _fill_(dst, value):
    s = _current()
    if s is not None:
        return (s.fill_ or _NATIVE_FILL)(dst, value)
    for other in list(_open):
        other.note_foreign("fill_", dst)
    return _NATIVE_FILL(dst, value)


def _start(thread):
    """A thread started inside a scope runs inside it too (its own dispatch modes, the starter's grad mode)."""
    inherited = list(getattr(_tls, "stack", None) or [])
    if inherited:
        run, grad = thread.run, torch.is_grad_enabled()

        def run_in_scope():
            _tls.stack = inherited
            with contextlib.ExitStack() as modes:
                modes.enter_context(torch.set_grad_enabled(grad))
                for s in inherited:
                    for m in s.thread_modes():
                        modes.enter_context(_watching(m))
                run()

        thread.run = run_in_scope
    return _NATIVE_START(thread)


@contextlib.contextmanager
def scoped(scope: Scope):
    """Open ``scope`` for this thread (and the threads it starts) until the block ends; re-entrant."""
    with _lock:
        if not _open:
            torch.Tensor.copy_, torch.Tensor.fill_, threading.Thread.start = _copy_, _fill_, _start
        _open.append(scope)
    stack = _tls.__dict__.setdefault("stack", [])
    stack.append(scope)
    scope.open = True
    try:
        watches = scope.thread_modes()
        if watches:
            _FILTER.sync()
        with contextlib.ExitStack() as modes:
            for m in watches:
                modes.enter_context(_watching(m))
            yield scope
        late = _FILTER.sync() if watches else []
        for m in watches if late else ():
            m.missed(late)
    finally:
        scope.open = False
        stack.pop()
        with _lock:
            _open.remove(scope)
            if not _open:
                torch.Tensor.copy_, torch.Tensor.fill_, threading.Thread.start = _NATIVE_COPY, _NATIVE_FILL, _NATIVE_START


# ---------------------------------------------------------------- delta apply


_aten = torch.ops.aten
_COPY, _ZERO, _FILL, _CAT = _aten.copy_, _aten.zero_, _aten.fill_.Scalar, _aten.cat.default  # bound once, not per op
_FILLS, _INDEX_PUT, _INDEX = _aten.fill_, _aten.index_put_, _aten.index.Tensor


class _Watch(TorchDispatchMode):
    """Sees a thread's aten ops that can write (:class:`_OpFilter`). As a dispatch mode (where the filter key is
    taken) it runs on every op: kept out of torch's per-call dynamo guard, which would cost more than its body
    (this body calls nothing torch.compile traces)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def missed(self, ops: List[str]) -> None:
        """``ops`` (that can write) were registered while this watch was open: it did not see them run."""
        raise NotImplementedError


class _OpFilter:
    """Which of a watching thread's ops reach its watch: those whose schema writes, and ``cat`` (the recorder's).

    A dispatch mode runs Python on every op of its thread, and a MoE loader's views and ``.data`` detaches (several
    ops per HF tensor) then cost more than the load. Instead a watching thread includes a dispatch key that
    nothing in an inference process uses (torchdistx's ``DeferredInit``): there every op falls through in C++ except
    those, whose Python kernel hands the op to the thread's watch. A thread that does not include the key never meets
    these registrations (fake tensors and ``torch.compile`` elsewhere in the process are unaffected). An op registered
    later gets its kernel when the next watching scope opens; one registered while a watch was open was not watched,
    and the watch is told (``missed``). Where another library holds the key, watches run as dispatch modes.
    """

    NAME = "DeferredInit"

    def __init__(self):
        self.key = None
        self.taken = False
        self.libs: Dict[str, torch.library.Library] = {}
        self.seen: set = set()  # op names given their registration
        self.lock = threading.Lock()

    def sync(self) -> List[str]:
        """Claim the key (once) and register every op the dispatcher gained since the last call; returns the new
        ones that can write."""
        with self.lock:
            try:
                return [] if self.taken or (self.key is None and not self._claim()) else self._register()
            except Exception as e:  # a torch without this key or these APIs: an op left unwatched is no option
                logger.warning("delta: write watch as a dispatch mode (no op filter: %r)", e)
                self.taken, self.key = True, None
                return []

    def _register(self) -> List[str]:
        new = [n for n in torch._C._dispatch_get_all_op_names() if n not in self.seen]
        writers = []
        for qualified in new:
            ns, _, name = qualified.partition("::")
            base, _, overload = name.partition(".")
            try:
                schema = torch._C._get_schema(f"{ns}::{base}", overload)
            except RuntimeError:
                continue  # no schema: nothing to dispatch
            if _written(schema):
                writers.append(qualified)
            elif qualified != "aten::cat":
                continue
            if ns not in self.libs:
                self.libs[ns] = torch.library.Library(ns, "IMPL")
            self.libs[ns].impl(name, _kernel(ns, base, overload or "default"), self.NAME)
        self.seen.update(new)
        return writers

    def _claim(self) -> bool:
        key = torch._C._parse_dispatch_key(self.NAME)
        if key is None or torch._C._dispatch_has_backend_fallback(key):
            self.taken = True
            return False
        self.libs["_"] = torch.library.Library("_", "IMPL")
        self.libs["_"].fallback(torch.library.fallthrough_kernel, self.NAME)
        self.key = key
        return True


_FILTER = _OpFilter()
_EXCLUDED, _EXCLUDE = torch._C._dispatch_tls_is_dispatch_key_excluded, torch._C._dispatch_tls_set_dispatch_key_excluded


def _kernel(ns: str, base: str, overload: str):
    """The filter key's kernel of one op: the op, run by this thread's watch below the key. (A per-op kernel, not a
    Python fallback: torch routes those through a registry that lacks fallbacks while a dispatch mode is active.)"""
    op = []

    def kernel(*args, **kwargs):
        if not op:
            op.append(getattr(getattr(getattr(torch.ops, ns), base), overload))
        watch = getattr(_tls, "watch", None)
        if watch is None:
            return _below_key(_FILTER.key, op[0], *args, **kwargs)
        return _below_key(_FILTER.key, watch.__torch_dispatch__, op[0], (), args, kwargs)

    return kernel


@contextlib.contextmanager
def _watching(watch: _Watch):
    """``watch`` sees this thread's ops that can write until the block ends (its scope synced the filter). A nested
    watch replaces the outer one for its block (scopes nest; at most one of them watches)."""
    outer = getattr(_tls, "watch", None)
    _tls.watch = watch
    try:
        with (watch if _FILTER.key is None else torch._C._IncludeDispatchKeyGuard(_FILTER.key)):
            yield
    finally:
        _tls.watch = outer


def _below_key(key, op, *args, **kwargs):
    """``op(*args)`` with the filter key excluded in this thread: two flips of the thread's key state, cheaper than an
    ``_ExcludeDispatchKeyGuard`` (this runs once per copy of a full sync, once per watched op of a delta apply)."""
    if _EXCLUDED(key):
        return op(*args, **kwargs)
    _EXCLUDE(key, True)
    try:
        return op(*args, **kwargs)
    finally:
        _EXCLUDE(key, False)


def _explained_copy(dst, src, non_blocking):
    """A copy this thread's watch need not judge (the recorder explains it): run below the filter key, or, where
    the watch is a mode, with the watch told."""
    if _FILTER.key is not None:
        return _below_key(_FILTER.key, _NATIVE_COPY, dst, src, non_blocking)
    watch = _tls.watch
    watch.explained = True
    try:
        return _NATIVE_COPY(dst, src, non_blocking)
    finally:
        watch.explained = False


class WriteGuard(_Watch):
    """Sees every aten op of a delta apply (in one thread); masks or refuses writes into model storage that
    bypass ``copy_``.

    Loaders that index-assign (``FusedMoE._load_per_tensor_weight_scale``, ``_load_single_value``) or
    ``fill_`` reach the model as aten ``copy_`` / ``index_put_`` / ``fill_``: those get the same NaN
    mask here. ``zero_`` cannot leak a NaN. Any other write (in-place arithmetic, an accumulating
    ``index_put_``, a kernel with a write schema) is refused before it runs.
    """

    def __init__(self, shared: "_ApplyState"):
        super().__init__()
        self.shared = shared

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _writes(func):
            return func(*args, **kwargs)
        sh = self.shared
        dst = None if sh.masked() or _current() is not sh.scope else _model_write(func, args, kwargs, sh.storages)
        if dst is None:
            return func(*args, **kwargs)
        op = func.overloadpacket
        if op is _ZERO:
            return func(*args, **kwargs)
        name = sh.owner(dst) or "a model buffer"
        with _lock:
            sh.caught[str(op)] = sh.caught.get(str(op), 0) + 1
        if op is _FILLS and dst is args[0]:
            return dst if _is_nan_scalar(args[1]) else func(*args, **kwargs)
        if op is _COPY and dst is args[0] and dst.is_floating_point():
            src = args[1].to(device=dst.device, dtype=dst.dtype)
            return func(dst, torch.where(nan_mask(src), dst, src), *args[2:], **kwargs)
        if op is _INDEX_PUT and dst is args[0] and dst.is_floating_point() and not (args[3:4] and args[3]):
            values = args[2].to(device=dst.device, dtype=dst.dtype)
            values = torch.where(nan_mask(values), _INDEX(dst, args[1]), values)
            return func(dst, args[1], values, *args[3:], **kwargs)
        raise DeltaError(f"param {name!r}: the model's loader writes it with {func} outside the NaN-masked "
                         "copy_; refused before that write")

    def missed(self, ops: List[str]) -> None:
        raise DeltaError(f"{ops[0]} can write and was registered while the loader ran, unwatched: a NaN sentinel "
                         "may have reached the model")


class _ApplyState:
    """One delta apply's shared state: the storage index, the scope, and per-thread 'inside a masked op' depth."""

    def __init__(self, model: torch.nn.Module):
        self.owner, self.storages = storage_index(model), _storages(model)
        self.caught: Dict[str, int] = {}  # aten op -> bypassing writes masked
        self._depth = threading.local()
        self.scope: Optional[Scope] = None

    def masked(self) -> int:
        return getattr(self._depth, "n", 0)

    @contextlib.contextmanager
    def native(self):
        self._depth.n = self.masked() + 1
        try:
            yield
        finally:
            self._depth.n -= 1


@contextlib.contextmanager
def delta_apply_context(model: torch.nn.Module):
    """Within (this thread and the threads it starts): ``copy_`` into model storage writes only where the source
    is not NaN; ``fill_(nan)`` into it is a no-op; other writes go through :class:`WriteGuard`.

    The masked write is ``torch.where(isnan(src), dst, src)`` — no host sync, no boolean indexing.
    A param whose tensor a loader replaced (``param.data = …``) is scanned for NaN at the end, and a
    ``copy_``/``fill_`` into the model from another thread fails the apply. ``post_load_weights``
    (arithmetic post-processing) runs with the native ops.
    """
    sh = _ApplyState(model)
    ptrs = {n: t.data_ptr() for n, t in model.named_parameters()}

    def copy_(dst, src, non_blocking=False):
        if sh.owner(dst) is None:
            return _NATIVE_COPY(dst, src, non_blocking)
        with sh.native():
            if isinstance(src, torch.Tensor) and src.is_floating_point() and dst.is_floating_point():
                src = src.to(device=dst.device, dtype=dst.dtype, non_blocking=non_blocking)
                keep = nan_mask(src)
                if src.shape == dst.shape:  # one pass, written in place
                    return torch.where(keep, dst, src, out=dst)
                src = torch.where(keep, dst, src)
            return _NATIVE_COPY(dst, src, non_blocking)

    def fill_(dst, value):
        if sh.owner(dst) is None:
            return _NATIVE_FILL(dst, value)
        if _is_nan_scalar(value):
            return dst
        with sh.native():
            return _NATIVE_FILL(dst, value)

    posts = [m for m in {id(m): m for m in [model, *draft.members(model)]}.values()
             if getattr(m, "post_load_weights", None) is not None]  # a pair's, and each of its loaders' own
    for m in posts:
        m.post_load_weights = _native_post(m.post_load_weights, sh)
    sh.scope = Scope(copy_, fill_, owner=sh.owner, thread_modes=lambda: [WriteGuard(sh)])
    try:
        with scoped(sh.scope):
            yield sh
    finally:
        for m in posts:
            del m.post_load_weights
    if sh.scope.foreign:
        raise DeltaError(f"another thread wrote into the model during the apply ({sh.scope.foreign[0]}"
                         f"{f' and {len(sh.scope.foreign) - 1} more' if len(sh.scope.foreign) > 1 else ''})")
    for n, t in model.named_parameters():
        if t.data_ptr() != ptrs.get(n) and t.is_floating_point() and bool(nan_mask(t).any()):
            raise DeltaError(f"param {n!r}: the loader replaced its tensor (param.data = ...) with unmasked NaN "
                             "sentinels")


def _native_post(post, sh: "_ApplyState"):
    def post_with_native_ops(*a, **kw):
        with scoped(Scope()), sh.native():
            return post(*a, **kw)

    return post_with_native_ops


# ---------------------------------------------------------------- full sync


class FullSyncWatch(_Watch):
    """During a full sync (one per thread of its scope): any write into model storage that a recorded view
    copy does not explain (a transformed or deferred copy, in-place arithmetic, an index-assignment, a fill
    with a value) keeps the whole model off the direct path — which name it derives from is unknowable here.
    Zero fills (vocab padding) derive from no weight and pass."""

    def __init__(self, storages: set, recorder, scope: Scope):
        super().__init__()
        self.storages, self.recorder, self.scope = storages, recorder, scope
        self.explained = False  # inside a copy the recorder explains (:func:`_explained_copy`)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _CAT:
            out = func(*args, **kwargs)
            if _current() is self.scope:
                self.recorder.joined(out, args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0))
            return out
        if _writes(func) and self.recorder.unexplained is None and _current() is self.scope:
            op = func.overloadpacket
            explained = (op is _COPY and self.explained) or op is _ZERO or (func is _FILL and args[1] == 0)
            dst = None if explained else _model_write(func, args, kwargs, self.storages)
            if dst is not None:
                self.recorder.unexplained = f"{func} into {tuple(dst.shape)}"
        return func(*args, **kwargs)

    def missed(self, ops: List[str]) -> None:
        if self.recorder.unexplained is None:
            self.recorder.unexplained = f"{ops[0]} (registered while the loader ran, unwatched)"


@contextlib.contextmanager
def full_sync_context(model: torch.nn.Module, recorder):
    """Within (this thread and the threads it starts): every ``copy_`` reports to ``recorder`` and every other
    write into the model is noted (:class:`FullSyncWatch`)."""
    storages = _storages(model)

    observe = recorder.observe

    def copy_(dst, src, non_blocking=False):
        return (_explained_copy if observe(dst, src) else _NATIVE_COPY)(dst, src, non_blocking)

    scope = Scope(copy_)
    scope.thread_modes = lambda: [FullSyncWatch(storages, recorder, scope)]
    with scoped(scope):
        yield
