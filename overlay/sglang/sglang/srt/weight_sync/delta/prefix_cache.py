"""What requests see across a weight update: no later request reuses KV the old weights computed, none is admitted
(or resumed after a pause) while the engine holds a partly written version, and no pause mode stops the engine.

SGLang flushes its radix cache after an update only when the scheduler is fully idle; v0.5.15 then exits on a refused
flush (``assert``), which is what a ``retract`` pause (requests back in the waiting queue) or an ``in_place`` pause
(running requests keep their KV) meets. Here:

- nothing holds KV (idle, or a ``retract`` pause: queued requests hold none) → the cache is flushed;
- requests hold KV (an ``in_place`` pause) → it cannot be flushed under them, so it is partitioned: every request
  admitted later, and every queued one without KV, gets a new ``extra_key`` namespace, which ``RadixKey`` never
  matches across. Only the requests in flight at the update continue on their own old KV (what ``in_place`` is for);
  what they leave in the tree is never matched again and ages out by LRU.

A delta version makes the cache safe once, when it commits, whatever ``flush_cache`` its requests carried (a flush of
a half-written version would only be undone by the next one); other updates keep SGLang's ``flush_cache`` rule.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

from sglang.srt.weight_sync.delta.engine_state import receiver_state

logger = logging.getLogger(__name__)

_BASE = "_delta_cache_base_key"  # a request's own extra_key, kept when it is namespaced


@dataclasses.dataclass
class _CacheEpoch:
    epoch: int = 0  # updates that found requests holding KV: the namespace requests are admitted under now
    commits: int = 0  # delta versions the engine had committed when the cache was last made safe


_EPOCHS: "weakref.WeakKeyDictionary[object, _CacheEpoch]" = weakref.WeakKeyDictionary()


def admit(scheduler, req) -> None:
    """Where a request enters the scheduler. Refused (503) while the engine holds weights no version explains: a
    sync failed after part of it was written (``dirty``), or their memory was released without a host copy
    (``released``), until a full sync or a store catch-up replaces them. Else
    namespaced by the current epoch (requests keep their key until an update meets held KV)."""
    state = receiver_state(scheduler.tp_worker.model_runner.model)
    if state.dirty or state.released:
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        msg = _unserved(state)
        req.set_finish_with_abort(msg)
        req.to_finish = FINISH_ABORT(msg, HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError")
        return
    st = _EPOCHS.get(scheduler)
    if st is not None and st.epoch:
        _tag(req, st.epoch)


def before_resume(scheduler) -> None:
    """Where a paused scheduler resumes: requests it held through the pause (``retract``, ``in_place``, and any that
    arrived meanwhile) would go on with weights no version explains if the sync left the engine dirty (or its memory
    released): every one is aborted, as a new one is refused (:func:`admit`)."""
    state = receiver_state(scheduler.tp_worker.model_runner.model)
    if not (state.dirty or state.released):
        return
    from sglang.srt.managers.io_struct import AbortReq

    msg = _unserved(state)
    logger.error("resuming generation: %s; every request in flight is aborted", msg)
    scheduler.abort_request(AbortReq(abort_all=True, abort_message=msg))


def _unserved(state) -> str:
    return (f"this engine holds a partly written weight version (a sync over version {state.version} failed after its "
            "first write)" if state.dirty else "this engine's weight memory was released without a host copy "
            f"(version {state.version} is gone)") + ": it serves again after a full sync or a store catch-up"


def after_weight_update(scheduler, recv_req) -> None:
    """Make the cache safe for the weights the update just wrote (SGLang's ``flush_cache_after_weight_update``)."""
    st = _EPOCHS.setdefault(scheduler, _CacheEpoch())
    if getattr(recv_req, "load_format", None) == "delta":
        commits = sum(receiver_state(scheduler.tp_worker.model_runner.model).applied.values())
        if commits == st.commits:  # no version committed by this request (a flush before the final, receive-only)
            return
        st.commits = commits
    elif not recv_req.flush_cache:
        return
    if not _holds_kv(scheduler):
        waiting, scheduler.waiting_queue = scheduler.waiting_queue, []  # queued requests hold no KV: not in the way
        try:
            if scheduler.flush_cache(empty_cache=recv_req.torch_empty_cache):
                return
        finally:
            scheduler.waiting_queue = waiting + scheduler.waiting_queue
    st.epoch += 1
    queued = [r for r in scheduler.waiting_queue if not _req_holds_kv(r)]
    for r in queued:
        _tag(r, st.epoch)
    logger.info("prefix cache partitioned after a weight update (epoch %d): requests in flight keep their KV, "
                "%d queued and every later request start from the new weights", st.epoch, len(queued))


def _tag(req, epoch: int) -> None:
    if not hasattr(req, _BASE):
        setattr(req, _BASE, req.extra_key)
    base = getattr(req, _BASE)
    req.extra_key = f"{base}|weights-{epoch}" if base else f"weights-{epoch}"


def _req_holds_kv(req) -> bool:
    return getattr(req, "req_pool_idx", None) is not None


def _holds_kv(scheduler) -> bool:
    """Whether a request holds KV: running, mid-prefill, in the last batch, or queued with its KV (PD decode)."""
    last = getattr(scheduler, "last_batch", None)
    return (not scheduler.running_batch.is_empty() or scheduler.chunked_req is not None
            or (last is not None and not last.is_empty())
            or any(_req_holds_kv(r) for r in scheduler.waiting_queue))
