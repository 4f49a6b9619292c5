"""Stage: everything a request needs before its first write, done without writing a weight.

A request is staged by checking it whole (versions, pieces, names, structure, checksums, the rules a delta's params
must meet), agreeing on the verdict across the engine's tensor-parallel ranks, rebuilding ``xor_zstd``/``xor_ctx``
values from the committed bytes (read, never written), decoding its positions and planning which params go through
recorded views and which through the model's loader. :mod:`commit` then writes it.

Staging never touches the engine's :class:`~engine_state.ReceiverState`: it advances a :class:`Progress`, a copy of
the pending version's fields, so every request of a version can be staged before the first of them is written (a
version from the store is taken whole or not at all, ``store.catch_up``). The base a rebuild reads is the committed
version's; the requests of one version name disjoint positions, so staging them all before writing any reads the
same bytes as staging each after the last one's writes.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import List, Optional, Sequence, Tuple


from sglang.srt.weight_sync.delta import draft, fetch
from sglang.srt.weight_sync.delta.collectives import tp_agree
from sglang.srt.weight_sync.delta.engine_state import (
    ReceiverState,
    host_device,
    host_model,
    receiver_state,
    server_arg,
)
from sglang.srt.weight_sync.delta.quant import check_names, check_quantization
from sglang.srt.weight_sync.delta.validate import check_pieces, check_pieces_ascend, validate_payload
from sglang.srt.weight_sync.delta.versions import check_version, check_xor_base, pending_key
from sglang.srt.weight_sync.delta.views import rebuild_ctx, rebuild_xor
from sglang.srt.weight_sync.delta.wire import (
    DeltaError,
    DeltaParam,
    DeltaPayload,
    DeltaSpec,
    Refusal,
    dtype_from_str,
    nan_sentinel,
    sparse_allowed,
)

__all__ = ["Progress", "StagedRequest", "StageRefused", "stage_request"]

@dataclasses.dataclass
class Progress:
    """How far the pending version has got: the fields of the engine's state a request advances. Staging works on a
    copy (:meth:`of`); :mod:`commit` moves a written request's into the state itself."""

    version: Optional[int]  # the committed version the version rules see (None: an anchor replaces every weight)
    pending: Optional[int]
    pending_key: tuple
    next_flush: dict
    finals: set
    changed: set

    @classmethod
    def of(cls, state: ReceiverState) -> "Progress":
        return cls(state.version, state.pending, state.pending_key, dict(state.next_flush), set(state.finals),
                   set(state.changed))

    @classmethod
    def replacing(cls) -> "Progress":
        """For a full version that replaces whatever the engine holds (a store's anchor)."""
        return cls(None, None, (), {}, set(), set())

    def advance(self, staged: "StagedRequest") -> None:
        if staged.starts:
            self.next_flush = {}
        self.pending, self.pending_key = staged.head.version, pending_key(staged.head)
        self.finals, self.changed = set(staged.finals), set(staged.changed)
        for p in staged.payloads:
            self.next_flush[p.spec.source] = staged.head.flush + 1


@dataclasses.dataclass
class StagedRequest:
    """One request, checked, agreed on, rebuilt and decoded: what its commit writes, and where."""

    head: DeltaSpec
    request: list  # [version, flush], as the status reports it
    received: Optional[bool]  # True: a broadcast; None: files
    starts: bool  # it opens its version
    complete: bool  # every source's final request is in: its commit commits the version
    finals: set  # sources whose final request is in, this one included
    changed: set  # names changed so far in the version, this request included
    payloads: List[DeltaPayload]
    via_views: list  # (a flush's positions, its values, its params written through recorded views)
    via_loader: list  # (param, its flush's positions, its values) for the model's loader


class StageRefused(DeltaError):
    """A request refused before its first write; ``request`` and ``received`` as the status reports them."""

    def __init__(self, cause: DeltaError, request, received):
        super().__init__(str(cause), cause.code)
        self.request, self.received = request, received


def stage_request(host, payloads: Sequence[DeltaPayload], weight_version: Optional[str],
                  failure: Optional[DeltaError], progress: Progress) -> StagedRequest:
    """Check, agree on, rebuild and decode one request against ``progress`` (not written; ``progress`` is not
    advanced). Raises :class:`StageRefused` on every rank alike. ``failure``: it already failed on this rank."""
    model = host_model(host)
    state = receiver_state(model)
    device = host_device(host)
    fetch.remember(host)  # the settings a later fetch of this engine runs under
    # Each flush's blobs move to the engine's device once: positions decode and values are written there
    payloads = [dataclasses.replace(p, positions=p.positions.to(device), values=p.values.to(device)) for p in payloads]
    head = payloads[0].spec if payloads else None
    request = [head.version, head.flush] if head is not None else None
    received = (payloads[0].source == "broadcast" or None) if payloads else None
    xor = any(p.xored or p.coded for p in payloads)  # rebuilt from the committed bytes before any check
    view = _view(state, progress)
    error, pieces, decoded, starts, finals = failure, set(), [], False, set()
    if error is None:
        try:
            if not payloads:
                raise DeltaError("delta request holds no payload")
            _refuse_unsupported(host)
            head, starts = check_version(view, [p.spec for p in payloads], weight_version, files=not received)
            pieces = check_pieces(payloads, head.full, state.direct, state.unheld)
            if xor:
                check_xor_base(view, head)
            else:
                decoded = [validate_payload(p, state.manifest) for p in payloads]
                check_pieces_ascend(payloads, decoded, pieces)
            check_names(q.name for p in payloads for q in p.spec.params)
            finals = (set() if starts else set(view.finals)) | {p.spec.source for p in payloads if p.spec.final}
            if not head.full:
                _check_writable(view, head, [q for p in payloads for q in p.spec.params], starts,
                                len(finals) == head.sources)
        except DeltaError as e:
            error = e
    peer = DeltaError("another tensor-parallel rank of this engine refused the request (its delta_status says why)",
                      Refusal.PEER)
    if not tp_agree(error is None, int(xor), sum(p.values.numel() for p in payloads) if xor else 0) and error is None:
        error = peer
    if xor and error is None:  # every rank agreed to rebuild: the rebuild's collectives match on all of them
        try:
            payloads = (rebuild_ctx if payloads[0].coded else rebuild_xor)(state.plan, state.manifest, payloads,
                                                                           device)
            decoded = [validate_payload(p, state.manifest) for p in payloads]
            check_pieces_ascend(payloads, decoded, pieces)
        except DeltaError as e:
            error = e
        if not tp_agree(error is None) and error is None:
            error = peer
    if error is not None:
        raise StageRefused(error, request, received)
    via_views, via_loader = _plan(state, head, payloads, decoded)
    return StagedRequest(head, request, received, starts, len(finals) == head.sources, finals, set(view.changed),
                         payloads, via_views, via_loader)


def _view(state: ReceiverState, progress: Progress) -> ReceiverState:
    """The state as the version rules see it once the staged requests before this one are written."""
    return dataclasses.replace(state, version=progress.version, pending=progress.pending,
                               pending_key=progress.pending_key, next_flush=dict(progress.next_flush),
                               finals=set(progress.finals), changed=set(progress.changed))


def _plan(state: ReceiverState, head: DeltaSpec, payloads: List[DeltaPayload], decoded) -> Tuple[list, list]:
    """Which params are written through recorded views (per flush) and which through the model's loader; a param
    nothing of which changed, or that this rank's loader took without writing (``unheld``), is neither."""
    direct = {} if head.full else (state.direct or {})
    unheld = frozenset() if head.full else state.unheld
    via_views, via_loader = [], []
    for payload, positions in zip(payloads, decoded):
        viewed = []
        for p in payload.spec.params:
            if p.pos_width:  # sparse
                if p.val_end == p.val_start:
                    continue  # nothing of this param changed: no write at all
                if p.name in direct:
                    viewed.append(p)
                    continue
            if p.name in unheld:
                continue  # the loader took it and wrote nothing here: it would again
            via_loader.append((p, positions, payload.values))
        if viewed:
            via_views.append((positions, payload.values, viewed))
    return via_views, via_loader


def _check_writable(state: ReceiverState, head: DeltaSpec, params: Sequence[DeltaParam], starts: bool,
                    completes: bool) -> None:
    """Delta rules beyond the wire's: a sparse param without NaN sentinel (fp8) needs recorded views to be written
    through, and a changed block scale needs its weight's bytes in the same version (a scale applied to the old
    bytes would rescale them: a silently wrong layer). ``state``: the staging view (its ``changed`` advances)."""
    direct = state.direct or {}
    changed = {p.name for p in params if p.pos_width == 0 or p.val_end > p.val_start}
    no_sentinel = {n for n in {p.dtype for p in params} if sparse_allowed(dtype_from_str(n))
                   and not nan_sentinel(dtype_from_str(n))}  # fp8: each dtype name is parsed once
    for p in params if no_sentinel else ():
        if p.pos_width and p.val_end > p.val_start and p.dtype in no_sentinel and p.name not in direct and \
                p.name not in state.unheld:
            raise DeltaError(f"param {p.name!r}: {p.dtype} values travel sparse only to params written through "
                             "recorded views, and this engine has none for it (its status lists it under 'dense')",
                             Refusal.NEEDS_DENSE)
    if starts:
        state.changed = set()
    state.changed |= changed
    if completes:
        for name in sorted(n for n in state.changed if n.endswith("_scale_inv")):
            weight = name.removesuffix("_scale_inv")
            if weight in (state.manifest or {}) and weight not in state.changed:
                raise DeltaError(f"param {name!r} changed in version {head.version} without {weight!r}: a block "
                                 "scale moves with its weight's bytes (a sender that dropped the weight?)")


def _refuse_unsupported(host) -> None:
    model = host_model(host)
    check_quantization(model)
    _upstream_guards(host)
    why = draft.refusal(model, server_arg(host, "speculative_algorithm", None))
    if why is not None:
        raise DeltaError(why, Refusal.UNSUPPORTED)


_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"


def _upstream_guards(host) -> None:
    """The checks upstream runs before every in-place weight update, where this SGLang has them (its
    ``WeightUpdater``): the CUDA-IPC weight cache (``param.data`` is a daemon's master copy shared with other engines)
    and derived-weight caches a write would leave stale. A delta writes in place too: refused before its first write,
    with upstream's own message. An SGLang without them (0.5.15) has neither cache."""
    try:
        updater = importlib.import_module(_UPDATER)
    except ImportError:
        return
    try:
        updater.WeightUpdater._assert_weight_cache_inactive(host, "a delta weight update")
    except RuntimeError as e:
        raise DeltaError(str(e), Refusal.UNSUPPORTED) from None
    error = updater._unsupported_derived_weight_cache_error(host_model(host))
    if error is not None:
        raise DeltaError(error, Refusal.UNSUPPORTED)
