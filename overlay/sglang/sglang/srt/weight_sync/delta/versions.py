"""The version chain: which request an engine may apply, given what it has committed."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from sglang.srt.weight_sync.delta.engine_state import ReceiverState
from sglang.srt.weight_sync.delta.wire import DeltaError, DeltaSpec, Refusal


def check_version(state: ReceiverState, specs: Sequence[DeltaSpec], weight_version: Optional[str],
                  files: bool = False) -> Tuple[DeltaSpec, bool]:
    """One request = one (version, flush) of one or more sources; refuse anything the version chain does not
    allow. Returns the head spec and whether the request opens its version (the engine starts a new pending one).
    ``files``: a disk request, which must hold every source's files (one transaction across pipeline stages)."""
    head = specs[0]
    for s in specs[1:]:
        if _request_key(s) != _request_key(head):
            raise DeltaError("files of one request disagree on (version, base_version, flush, full, encoding, sources, "
                             f"final): {_request_key(head)} vs {_request_key(s)}")
    sources = _check_parts(specs, files)
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
                          "dirty": "engine is dirty (a sync failed after part of it was written)",
                          "released": f"the weights' memory was released without a host copy since version "
                                      f"{committed}"}[reason]
                         + ": the engine needs a full sync", Refusal.NEEDS_FULL)
    if state.pending == v and state.pending_key == pending_key(head) and \
            all(state.next_flush.get(s, 0) == head.flush and s not in state.finals for s in sources):
        return head, False  # the next flush of each source named (a source's first flush may join late)
    done = sorted(set(sources) & state.finals) if state.pending == v else []
    if done:
        raise DeltaError(f"flush {head.flush} of version {v} from source(s) {done}, which already sent their final "
                         "request", Refusal.OFF_CHAIN)
    if head.flush != 0:
        expected = ", ".join(f"{state.next_flush.get(s, 0)}" + (f" from source {s}" if head.sources > 1 else "")
                             for s in sources) if state.pending == v else ""
        raise DeltaError(f"flush {head.flush} of version {v} is out of order (expected flush {expected})"
                         if expected else f"flush {head.flush} of version {v} arrived without flush 0 "
                         f"(engine at version {committed})", Refusal.OFF_CHAIN)
    if not head.full and not (head.base_version <= committed < v):
        raise DeltaError(f"delta for versions [{head.base_version}, {v}] cannot apply to an engine at committed "
                         f"version {committed} (duplicate, replayed or out-of-order): the engine needs a full sync",
                         Refusal.OFF_CHAIN)
    return head, True


def pending_key(head: DeltaSpec) -> tuple:
    """What every request of one pending version shares, whichever source sent it."""
    return head.base_version, head.full, head.encoding, head.sources


def _request_key(s: DeltaSpec) -> tuple:
    """What every file of one request shares."""
    return s.version, s.base_version, s.flush, s.full, s.encoding, s.sources, s.final


def _check_parts(specs: Sequence[DeltaSpec], files: bool) -> List[int]:
    """Each source's files in one request are its parts 0..n-1, ``last_part`` on the last only; a disk request
    holds every source. Returns the sources present."""
    by_source: Dict[int, List[DeltaSpec]] = {}
    for s in specs:
        by_source.setdefault(s.source, []).append(s)
    for source, group in by_source.items():
        group = sorted(group, key=lambda s: s.part)
        parts = [s.part for s in group]
        if parts != list(range(len(group))):
            raise DeltaError(f"source {source}'s files of this request are parts {parts}: one is missing or repeated")
        if [s.last_part for s in group] != [False] * (len(group) - 1) + [True]:
            raise DeltaError(f"source {source}'s files of this request do not end at its last part "
                             f"(parts 0..{len(group) - 1}; a file after the last one, or the last one missing)")
    missing = sorted(set(range(specs[0].sources)) - set(by_source))
    if files and missing:
        raise DeltaError(f"a disk request holds every source's files, and sources {missing} of "
                         f"{specs[0].sources} are missing (a pipeline stage's files were not published)")
    return sorted(by_source)


def check_xor_base(state: ReceiverState, head: DeltaSpec) -> None:
    """xor_zstd and xor_ctx values are relative to ``base_version``'s bytes: only an engine committed exactly there can
    use them."""
    enc = head.encoding
    if head.full:
        raise DeltaError(f"a full sync cannot be {enc} (it has no base)")
    if state.version != head.base_version:
        raise DeltaError(f"{enc} values are relative to version {head.base_version}; this engine is at version "
                         f"{state.version}", Refusal.OFF_CHAIN)
    if not state.xor_ready:
        raise DeltaError(f"{enc} values need the committed bytes of every param, and this engine cannot read them "
                         "all through recorded views (send it planes_zstd)", Refusal.NO_BASE)


def full_reason(state: ReceiverState) -> Optional[str]:
    """Why every delta is refused until a full sync (None: deltas are welcome)."""
    if state.manifest is None:
        return "fresh"
    if state.dirty:
        return "dirty"
    if state.released:
        return "released"
    if state.outside_load:
        return "outside_load"
    return None
