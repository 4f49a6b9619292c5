"""Receiver of delta weight sync: sparse positions+values -> bit-exact overwrite of model weights.

Contract (see the wire module for the format):

* Both transports end in :func:`apply_request`: a request (one NCCL flush, or the files of one disk publish) is
  staged (``stage``: checked *whole*, agreed on across TP ranks, rebuilt and decoded, nothing written), then
  committed (``commit``: written, read back, post-processed). A request refused while staged leaves every weight
  untouched; the store's catch-up stages every request of a version before it commits the first.
* The model's **own** ``load_weights`` defines where each HF element lives (name mapping, QKV/gate-up
  fusion, TP/EP sharding). Every full sync runs it and records each view copy it makes
  (:class:`fingerprint.FingerprintRecorder`). If the loader did nothing else — no transformed copy,
  no in-place arithmetic, no index-assignment, no post-processing (``write_guard.FullSyncWatch``) — deltas
  are written straight through those views (``views.write_run``, O(changed)), and names the loader took without
  writing anything (on this rank: another rank's experts, a tied head) cost nothing.
* Every other sparse param is densified into a full-shape NaN tensor and fed, in chunks capped by
  ``--update-weight-delta-chunk-bytes``, to ``load_weights`` inside ``write_guard.delta_apply_context``,
  where ``Tensor.copy_`` into model storage keeps the old value wherever the source is NaN and
  ``Tensor.fill_(nan)`` into model storage is ignored.
* Versions: an engine accepts a request iff its committed version lies in
  ``[base_version, version)`` (or it is mid-way through this same version and this is the next
  flush), and commits ``version`` on the ``final`` request. Full syncs (every param dense) are
  the only thing a fresh or dirty engine accepts. An engine that wrote part of a sync and then
  failed is *dirty* until a full sync (``versions``).
* Requests arrive as files or broadcasts (``ingest``); ``xor_zstd`` values are rebuilt from the
  committed bytes before validation (``views.rebuild_xor``).
* Every request leaves a structured :class:`~wire.DeltaStatus` (``/weights_checker`` ``delta_status``):
  committed version, whether only a full sync helps and why, the last request's refusal code. The
  sender decides on those fields, never on the message.

Quantized engines: FP8 checkpoints with block scales are served as any other (fp8 values are bytes; they travel
sparse only to names written through recorded views, the others are in the status' ``dense``); an engine whose
after-loading step transforms its weights is refused (``quant``). A block scale never changes without its weight.
Speculative decoding: a draft bound to its target (``draft``) takes every request with it, as one model; an
engine with a draft that is not bound is refused loudly (the draft would keep old weights).
How the loader is watched (per thread, aten-level bypasses, foreign threads): see ``write_guard``.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

import torch

from sglang.srt.weight_sync.delta import draft, fetch, fingerprint, whole
from sglang.srt.weight_sync.delta.collectives import tp_agree
from sglang.srt.weight_sync.delta.commit import apply_request, refused
from sglang.srt.weight_sync.delta.engine_state import host_model, receiver_state, server_arg
from sglang.srt.weight_sync.delta.ingest import (
    max_request_bytes,
    read_files_once,
    receive_broadcast,
    update_group_timeout,
)
from sglang.srt.weight_sync.delta.ops import gc_paused
from sglang.srt.weight_sync.delta.store import catch_up, staging
from sglang.srt.weight_sync.delta.versions import full_reason
from sglang.srt.weight_sync.delta.wire import (
    POSITIONS,
    VALUES,
    WIRE_FORMAT,
    DeltaError,
    DeltaPayload,
    DeltaStatus,
    Refusal,
    parse_request,
    received_params,
)

logger = logging.getLogger(__name__)

# What the patched SGLang calls (model runner, weight updater, weights checker) and the tests read.
__all__ = ["_apply_delta", "_apply_delta_from_distributed", "_apply_delta_payload", "_apply_received_delta",
           "apply_request", "checker_action", "delta_status", "fingerprint_payload", "note_checker_request",
           "note_outside_load", "note_released", "receive_broadcast", "receiver_state", "refused",
           "update_group_timeout"]


# ---------------------------------------------------------------- the shared apply path


def delta_status(model: torch.nn.Module, idle: Optional[bool] = None) -> DeltaStatus:
    """This rank's structured status (what the sender decides on); ``idle``: what its scheduler says."""
    model = draft.resolve(model)
    state = receiver_state(model)
    reason = full_reason(state)
    request, code, received = state.last
    pushed = fetch.report(model)  # a pushed version's files, else a store follower's stage
    stage = pushed if pushed["staged"] is not None or pushed["fetching"] is not None else \
        dict(staging.report(model), code=pushed["code"])
    return DeltaStatus(version=state.version, needs_full=reason is not None, reason=reason, pending=state.pending,
                       request=request, code=code, received=received, max_request_bytes=max_request_bytes(model),
                       xor=state.xor_ready and reason is None, xor_raw=list(state.xor_raw), dense=list(state.dense),
                       ctx=state.xor_ready and reason is None,
                       applied=dict(state.applied), wire_format=WIRE_FORMAT,
                       staged=stage["staged"], staging=stage["fetching"], stage_code=stage["code"], idle=idle,
                       timing=dict(state.timing),
                       draft_unwritten=state.draft_unwritten, draft=list(state.draft_names))


def checker_action(action: str, model: torch.nn.Module, parallelism_info=None) -> dict:
    """``/weights_checker`` actions of delta weight sync, one rank's reply in the shape SGLang's checker relays."""
    model = draft.resolve(model)
    if action == "delta_fingerprint":
        return fingerprint_payload(model, parallelism_info)
    if action == "delta_status":
        return delta_status(model, _CHECKER_REQUEST.get("idle")).checker_rank(parallelism_info)
    if action == "delta_stage":  # a pushed version's files (fetch), or a store follower's next version (staging)
        pushed = _CHECKER_REQUEST.get("delta")
        fetch.request(model, pushed) if pushed is not None else staging.start(model)
        return delta_status(model, _CHECKER_REQUEST.get("idle")).checker_rank(parallelism_info)
    raise DeltaError(f"unknown weights_checker action {action!r} (have: delta_fingerprint, delta_status, delta_stage)")


_apply_delta_payload = apply_request  # the name the patches bind on the runner (and the tests call)

_CHECKER_REQUEST: dict = {}  # the ``/weights_checker`` request this scheduler is answering (its ``delta`` field)


def note_checker_request(recv_req, idle: Optional[bool] = None) -> None:
    """Hooked where the scheduler takes a ``/weights_checker`` request: the fields an action reads beyond its name
    (``delta_stage``'s files), and whether the scheduler has a request running or waiting (a sender stages a sync
    only for engines that serve), for the checker calls of this one request."""
    _CHECKER_REQUEST.clear()
    _CHECKER_REQUEST["delta"] = getattr(recv_req, "delta", None)
    _CHECKER_REQUEST["idle"] = idle


def fingerprint_payload(model: torch.nn.Module, parallelism_info=None) -> dict:
    """This rank's share of the weight fingerprint (``/weights_checker`` action ``delta_fingerprint``),
    shaped as SGLang's ``ChecksumInfo`` so the checker's TP gather and HTTP reply carry it unchanged. No garbage
    collection meanwhile: a collection its per-view objects trigger scans the engine's whole heap."""
    state = receiver_state(draft.resolve(model))
    if state.copies is None:
        raise DeltaError("no full sync has been applied yet: there is nothing to fingerprint")
    if state.pending is not None:
        raise DeltaError(f"version {state.pending} is being applied: fingerprint it after its final flush")
    with torch.no_grad(), gc_paused():
        shares = fingerprint.engine_shares(state.copies)
    return fingerprint.rank_payload(shares, state.version, parallelism_info)


def note_outside_load(host, entry_point: str) -> None:
    """Hooked at the top of the plain weight-load paths: their writes are not part of any delta
    version, so a delta built on the committed version would land on other weights. Until the next
    full sync every delta is refused (loudly), which makes the sender fall back to a full sync."""
    state = receiver_state(host_model(host))
    if state.manifest is not None:
        state.outside_load = entry_point


def note_released(host) -> None:
    """Hooked where the scheduler releases the weights' memory (slime's ``--offload-rollout``): unless every model's
    weights are kept on the host meanwhile (``--enable-weights-cpu-backup``, and for a draft
    ``--enable-draft-weights-cpu-backup``), their bytes are gone on resume: the engine serves nothing, and takes no
    delta, until a full sync."""
    backed = server_arg(host, "enable_weights_cpu_backup", False) and (
        not isinstance(host_model(host), draft.TargetAndDraft) or server_arg(host, "enable_draft_weights_cpu_backup",
                                                                             False))
    state = receiver_state(host_model(host))
    if not backed and state.manifest is not None:
        state.released = True


# ---------------------------------------------------------------- transports


def _apply_delta(self, model_path: str, files: Optional[List[str]], weight_version: Optional[str] = None,
                 store: Optional[dict] = None) -> Tuple[bool, str]:
    """Disk transport: read the announced files of one publish (once per engine, in parallel), then apply them as
    one request. No garbage collection while the files are parsed either (:func:`ops.gc_paused`). ``store``: how
    the files are taken beyond that: a version store's ``digests`` of pushed files, a ``catch_up``
    (``store.catch_up``), or ``requests``: every publish of a version the engine fetched while it served, taken whole
    (``whole``)."""
    with gc_paused():
        if store and store.get("catch_up"):
            return catch_up.catch_up(self, model_path, weight_version)
        t0 = time.perf_counter()
        try:
            if store and store.get("requests") is not None:  # a staged version's every publish, taken whole
                return whole.commit_pushed(self, store["requests"], weight_version)
            if store:
                return whole.apply_pushed(self, model_path, files, weight_version, store.get("digests") or {})
            try:
                payloads = read_files_once(self, model_path, files)
            except DeltaError as e:  # every rank refuses alike (the TP ranks still agree before any write)
                return _apply_delta_payload(self, [], weight_version, failure=e)
            return _apply_delta_payload(self, payloads, weight_version)
        finally:
            fetch.settle(self, t0)  # what was fetched for it is taken, or dropped with its version


def _apply_delta_from_distributed(self, delta: Optional[str], names, dtypes, shapes, group_name: str,
                                  weight_version: Optional[str] = None) -> Tuple[bool, str]:
    """NCCL transport: receive both broadcasts first (see :func:`receive_broadcast`), then validate and apply."""
    with gc_paused():
        try:
            received = receive_broadcast(self, names, dtypes, shapes, group_name)
        except DeltaError as e:
            return refused(receiver_state(host_model(self)), e, received=False)
        return _apply_received_delta(self, delta, received, weight_version)


def _apply_received_delta(self, delta: Optional[str], named_tensors, weight_version: Optional[str] = None,
                          selector: Optional[str] = None) -> Tuple[bool, str]:
    """Apply the two received blobs of one flush (v0.5.23 receives them through :func:`receive_broadcast` too), with
    no garbage collection from the spec's parse on: a collection the parse's objects trigger scans the engine's
    whole heap. ``selector``: v0.5.23's runners of the request (``draft.selector_refusal``)."""
    with gc_paused():
        return _apply_received(self, delta, named_tensors, weight_version, selector)


def _apply_received(self, delta: Optional[str], named_tensors, weight_version: Optional[str],
                    selector: Optional[str]) -> Tuple[bool, str]:
    try:
        why = draft.selector_refusal(selector, server_arg(self, "speculative_algorithm", None))
        if why is not None:
            raise DeltaError(why, Refusal.UNSUPPORTED)
        tensors = dict(named_tensors)
        if list(tensors) != [POSITIONS, VALUES]:
            raise DeltaError(f"names must be {[POSITIONS, VALUES]}, got {list(tensors)}")
        if not delta:
            raise DeltaError("load_format 'delta' needs the 'delta' field (a DeltaSpec as JSON)")
        spec = parse_request(delta)
    except DeltaError as e:
        return _apply_delta_payload(self, [], weight_version, failure=e)
    if spec is None:  # a flush for other engines of the group: received, nothing applied, status untouched
        if not tp_agree(True):  # pairs with a rank whose receive failed
            return False, "another tensor-parallel rank of this engine did not receive the broadcast"
        return True, "Received a broadcast for other engines of the group (not applied)."
    payload = DeltaPayload(spec, tensors[POSITIONS].reshape(-1), tensors[VALUES].reshape(-1), source="broadcast",
                           params_text=received_params(delta))
    return _apply_delta_payload(self, [payload], weight_version)


