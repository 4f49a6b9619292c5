"""The version chain: which request an engine may apply, given what it has committed."""

from __future__ import annotations

from typing import Optional, Sequence

from sglang.srt.weight_sync.delta.engine_state import ReceiverState
from sglang.srt.weight_sync.delta.wire import DeltaError, DeltaSpec, Refusal


def check_version(state: ReceiverState, specs: Sequence[DeltaSpec], weight_version: Optional[str]) -> DeltaSpec:
    """One request = one (version, flush); refuse anything the version chain does not allow."""
    head = specs[0]
    key = (head.version, head.base_version, head.flush, head.full, head.encoding)
    for s in specs[1:]:
        if (s.version, s.base_version, s.flush, s.full, s.encoding) != key:
            raise DeltaError(f"files of one request disagree on (version, base_version, flush, full, encoding): "
                             f"{key} vs {(s.version, s.base_version, s.flush, s.full, s.encoding)}")
    if weight_version is not None and str(weight_version) != str(head.version):
        raise DeltaError(f"weight_version {weight_version!r} differs from the delta's version {head.version}")
    v, committed, reason = head.version, state.version, full_reason(state)
    if head.full:
        if committed is not None and v <= committed:
            raise DeltaError(f"full sync version {v} is not newer than the committed version {committed} (replayed?)",
                             Refusal.OFF_CHAIN)
    elif reason is not None:
        raise DeltaError({"fresh": "no full sync has been applied yet: the first sync must be full",
                          "outside_load": f"weights were replaced by {state.outside_load} since version {committed}",
                          "dirty": "engine is dirty (a sync failed after part of it was written)"}[reason]
                         + ": the engine needs a full sync", Refusal.NEEDS_FULL)
    if state.pending == v and head.flush > 0:
        if head.flush != state.next_flush:
            raise DeltaError(f"flush {head.flush} of version {v} is out of order (expected flush {state.next_flush})",
                             Refusal.OFF_CHAIN)
    elif head.flush != 0:
        raise DeltaError(f"flush {head.flush} of version {v} arrived without flush 0 (engine at version {committed})",
                         Refusal.OFF_CHAIN)
    elif not head.full and not (head.base_version <= committed < v):
        raise DeltaError(f"delta for versions [{head.base_version}, {v}] cannot apply to an engine at committed "
                         f"version {committed} (duplicate, replayed or out-of-order): the engine needs a full sync",
                         Refusal.OFF_CHAIN)
    return head


def check_xor_base(state: ReceiverState, head: DeltaSpec) -> None:
    """xor_zstd values are relative to ``base_version``'s bytes: only an engine committed exactly there can use them."""
    if head.full:
        raise DeltaError("a full sync cannot be xor_zstd (it has no base)")
    if state.version != head.base_version:
        raise DeltaError(f"xor_zstd values are relative to version {head.base_version}; this engine is at version "
                         f"{state.version}", Refusal.OFF_CHAIN)
    if not state.xor_ready:
        raise DeltaError("xor_zstd values need the committed bytes of every param, and this engine cannot read them "
                         "all through recorded views (send it planes_zstd)", Refusal.NO_BASE)


def full_reason(state: ReceiverState) -> Optional[str]:
    """Why every delta is refused until a full sync (None: deltas are welcome)."""
    if state.manifest is None:
        return "fresh"
    if state.dirty:
        return "dirty"
    if state.outside_load:
        return "outside_load"
    return None
