"""Receiver of delta weight sync: sparse positions+values -> bit-exact overwrite of model weights.

Contract (see the wire module for the format):

* Both transports end in :func:`_apply_delta_payload`. A request (one NCCL flush, or the files of
  one disk publish) is validated *whole* before the first write: checksum, offsets, positions,
  NaN among values, names/shapes/dtypes against the manifest of the first full sync, and the
  version rules below. A refused request leaves every weight untouched.
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
Not supported, refused loudly: speculative decoding (the draft model would keep old weights).
How the loader is watched (per thread, aten-level bypasses, foreign threads): see ``write_guard``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
from typing import List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta import device as dev, fingerprint
from sglang.srt.weight_sync.delta.collectives import tp_agree
from sglang.srt.weight_sync.delta.engine_state import ReceiverState, host_device, host_model, receiver_state, server_arg
from sglang.srt.weight_sync.delta.ingest import (
    max_request_bytes,
    read_files_once,
    receive_broadcast,
    update_group_timeout,
)
from sglang.srt.weight_sync.delta.quant import check_names, check_quantization
from sglang.srt.weight_sync.delta.versions import check_version, check_xor_base, full_reason, pending_key
from sglang.srt.weight_sync.delta.views import (
    contiguous_strides,
    direct_plan,
    rebuild_ctx,
    rebuild_xor,
    ReadBack,
    write_plan,
    write_run,
)
from sglang.srt.weight_sync.delta.ops import gc_paused
from sglang.srt.weight_sync.delta.positions import Positions
from sglang.srt.weight_sync.delta.validate import check_pieces, check_pieces_ascend, validate_payload
from sglang.srt.weight_sync.delta.wire import (
    POSITIONS,
    VALUES,
    WIRE_FORMAT,
    DeltaError,
    DeltaParam,
    DeltaPayload,
    DeltaSpec,
    DeltaStatus,
    Refusal,
    dtype_from_str,
    nan_sentinel,
    parse_request,
    received_params,
    sparse_allowed,
)
from sglang.srt.weight_sync.delta.write_guard import delta_apply_context, full_sync_context, model_tensors

logger = logging.getLogger(__name__)

# What the patched SGLang calls (model runner, weight updater, weights checker) and the tests read.
__all__ = ["_apply_delta", "_apply_delta_from_distributed", "_apply_delta_payload", "_apply_received_delta",
           "checker_action", "delta_status", "fingerprint_payload", "note_outside_load", "receive_broadcast",
           "receiver_state", "update_group_timeout"]

DEFAULT_CHUNK_BYTES = 512 << 20


# ---------------------------------------------------------------- the shared apply path


def _decode_delta_one_param(p: DeltaParam, positions: Positions, values: torch.Tensor, device) -> torch.Tensor:
    """Full-shape source tensor for the loader: NaN where unchanged, the trainer's bytes elsewhere."""
    vals = values[p.val_start:p.val_end]
    idx = positions.of(p)
    if idx is None:
        return vals.to(device).view(p.shape)
    flat = torch.full((p.numel,), float("nan"), dtype=vals.dtype, device=device)
    flat.index_copy_(0, idx.to(device), vals.to(device))
    return flat.view(p.shape)


def _dense_sources(via_loader) -> List[Tuple[str, torch.Tensor]]:
    """A full sync's sources for the loader: each param's values in its shape, a view of its flush's values made by
    one ``as_strided`` (a full sync's params are all dense and tile the values: checked); a ``split`` and a ``view``
    per param cost about three times as much, at ~19k params."""
    out, runs = [], {}
    for p, _, values in via_loader:
        run = runs.get(id(values))
        if run is None:  # once per flush: its values as one run of memory, and where that starts in its storage
            flat = values.contiguous()
            run = runs[id(values)] = (flat, flat.storage_offset())
        flat, start = run
        out.append((p.name, flat.as_strided(p.shape, contiguous_strides(tuple(p.shape)), start + p.val_start)))
    return out


def delta_status(model: torch.nn.Module) -> DeltaStatus:
    """This rank's structured status (what the sender decides on)."""
    state = receiver_state(model)
    reason = full_reason(state)
    request, code, received = state.last
    return DeltaStatus(version=state.version, needs_full=reason is not None, reason=reason, pending=state.pending,
                       request=request, code=code, received=received, max_request_bytes=max_request_bytes(model),
                       xor=state.xor_ready and reason is None, xor_raw=list(state.xor_raw), dense=list(state.dense),
                       ctx=state.xor_ready and reason is None,
                       applied=dict(state.applied), wire_format=WIRE_FORMAT)


def checker_action(action: str, model: torch.nn.Module, parallelism_info=None) -> dict:
    """``/weights_checker`` actions of delta weight sync, one rank's reply in the shape SGLang's checker relays."""
    if action == "delta_fingerprint":
        return fingerprint_payload(model, parallelism_info)
    if action == "delta_status":
        return delta_status(model).checker_rank(parallelism_info)
    raise DeltaError(f"unknown weights_checker action {action!r} (have: delta_fingerprint, delta_status)")


def _refused(state: ReceiverState, e: DeltaError, request=None, received=None, note: str = "") -> Tuple[bool, str]:
    """Record a refusal in the engine's status and phrase it for the reply."""
    state.last = (request, e.code.value, received)
    msg = f"delta refused: {e}{note}"
    logger.error(msg)
    return False, msg


def _apply_delta_payload(self, payloads: Sequence[DeltaPayload], weight_version: Optional[str] = None,
                         failure: Optional[DeltaError] = None) -> Tuple[bool, str]:
    """Validate a whole request, agree on it across TP ranks, then write it; ``(False, message)`` leaves weights
    untouched. ``failure``: the request already failed on this rank (e.g. a file it could not read)."""
    with gc_paused():
        return _apply_request(self, payloads, weight_version, failure)


def _apply_request(self, payloads: Sequence[DeltaPayload], weight_version: Optional[str],
                   failure: Optional[DeltaError]) -> Tuple[bool, str]:
    model = host_model(self)
    state = receiver_state(model)
    device = host_device(self)
    # Each flush's blobs move to the engine's device once: positions decode and values are written there
    # (read from files, they arrive on the host; per-param copies would each wait for the device).
    payloads = [dataclasses.replace(p, positions=p.positions.to(device), values=p.values.to(device)) for p in payloads]
    head = payloads[0].spec if payloads else None
    request = [head.version, head.flush] if head is not None else None
    received = (payloads[0].source == "broadcast" or None) if payloads else None
    continuing = head is not None and state.pending == head.version  # part of this version is written
    xor = any(p.xored or p.coded for p in payloads)  # rebuilt from the committed bytes before any check
    error, pieces = failure, set()  # pieces: params this request names in several files (check_pieces)
    if error is None:
        try:
            if not payloads:
                raise DeltaError("delta request holds no payload")
            _refuse_unsupported(self)
            head, starts = check_version(state, [p.spec for p in payloads], weight_version, files=not received)
            manifest = state.manifest
            pieces = check_pieces(payloads, head.full, state.direct, state.unheld)
            if xor:
                check_xor_base(state, head)
            else:
                decoded = [validate_payload(p, manifest) for p in payloads]
                check_pieces_ascend(payloads, decoded, pieces)
            check_names(q.name for p in payloads for q in p.spec.params)
            finals = (set() if starts else state.finals) | {p.spec.source for p in payloads if p.spec.final}
            if not head.full:
                _check_writable(state, head, [q for p in payloads for q in p.spec.params], starts,
                                len(finals) == head.sources)
        except DeltaError as e:
            error = e
    peer = DeltaError("another tensor-parallel rank of this engine refused the request (its delta_status says why)",
                      Refusal.PEER)
    if not tp_agree(error is None, int(xor), sum(p.values.numel() for p in payloads) if xor else 0) and error is None:
        error = peer
    if xor and error is None:  # every rank agreed to rebuild: the rebuild's collectives match on all of them
        try:
            payloads = (rebuild_ctx if payloads[0].coded else rebuild_xor)(state.plan, manifest, payloads, device)
            decoded = [validate_payload(p, manifest) for p in payloads]
            check_pieces_ascend(payloads, decoded, pieces)
        except DeltaError as e:
            error = e
        if not tp_agree(error is None) and error is None:
            error = peer
    if error is not None:
        note = ""
        if continuing:  # earlier flushes of this version are written: the engine holds a mix
            state.dirty = True
            note = f"; engine is dirty (part of version {head.version} was written): it needs a full sync"
        return _refused(state, error, request, received, note)

    # A full sync's sources are views of the received blobs (nothing densified): the whole request goes to the
    # loader in one call, so pairs a loader fuses (DeepSeek's q_a/kv_a, cached per call) stay together.
    chunk_cap = float("inf") if head.full else int(server_arg(self, "update_weight_delta_chunk_bytes",
                                                               DEFAULT_CHUNK_BYTES))
    if starts:
        _await_forward(device)
        state.pending_manifest, state.next_flush = {}, {}
        state.recorder = fingerprint.FingerprintRecorder(model_tensors(model)) if head.full else None
    state.pending, state.pending_key, state.finals = head.version, pending_key(head), finals
    for p in payloads:
        state.next_flush[p.spec.source] = head.flush + 1
    complete = len(finals) == head.sources  # every source's final request arrived: commit

    def load(chunk):
        if head.full:
            state.recorder.sources(chunk)
        model.load_weights(chunk)
        _kill_point()

    direct = {} if head.full else (state.direct or {})
    unheld = frozenset() if head.full else state.unheld
    via_views, via_loader = [], []  # (the flush's positions, values, its params) / (param, positions, values)
    for payload, positions in zip(payloads, decoded):
        viewed = []
        if head.full:
            state.pending_manifest.update((p.name, (list(p.shape), p.dtype)) for p in payload.spec.params)
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
    try:
        with torch.no_grad():
            check = ReadBack()
            for positions, values, viewed in via_views:
                for run in positions.runs(viewed):
                    write_run(state.plan, run, values, check)
            if via_views:
                wrong = check.verdict()  # the apply's one host read after its writes
                if wrong is not None:
                    raise DeltaError(f"read-back after write: {wrong}", Refusal.VERIFY)
                _kill_point()
            _post_process(model, state, [p.name for _, _, viewed in via_views for p in viewed], complete)
        if via_loader:
            # a full sync's sources are views of the received blobs: made before the watch, which sees every op
            ready = _dense_sources(via_loader) if head.full else None
            with torch.no_grad(), (full_sync_context(model, state.recorder) if head.full else
                                   delta_apply_context(model)):
                chunk, chunk_bytes = ready or [], 0
                for p, positions, values in [] if head.full else via_loader:
                    size = p.numel * values.element_size()
                    if chunk and chunk_bytes + size > chunk_cap:
                        load(chunk)
                        chunk, chunk_bytes = [], 0
                    chunk.append((p.name, _decode_delta_one_param(p, positions, values, device)))
                    chunk_bytes += size
                if chunk:
                    load(chunk)
                    del chunk
        write_error = None
    except Exception as e:  # a write failed mid-way: some weights are written
        logger.exception("delta apply failed after writing")
        write_error = e
    if not tp_agree(write_error is None):  # any rank's failed write leaves the engine as a whole inconsistent
        state.dirty = True
        state.pending = None
        code = Refusal.PEER if write_error is None else Refusal.VERIFY if getattr(write_error, "code", None) is \
            Refusal.VERIFY else Refusal.APPLY_FAILED
        state.last = (request, code.value, received)
        cause = repr(write_error) if write_error is not None else "another tensor-parallel rank's write failed"
        return False, f"delta apply failed after a partial write, engine is dirty and needs a full sync: {cause}"

    state.last = (request, None, received)
    nnz = sum(pl.values.numel() for pl in payloads)  # the params' values tile them (checked)
    if complete:
        state.version, state.pending, state.next_flush, state.finals = head.version, None, {}, set()
        kind = "full" if head.full else "delta"
        state.applied[kind] = state.applied.get(kind, 0) + 1
        if head.full:
            state.manifest, state.dirty, state.outside_load = state.pending_manifest, False, None
            state.direct = direct_plan(model, state.recorder)
            state.plan = write_plan(state.direct, state.manifest)
            state.unheld = frozenset(state.manifest).difference(state.recorder.copies) \
                if state.recorder.wrote_only_copies(model_tensors(model)) else frozenset()
            state.xor_raw, state.xor_ready, state.dense = _paths(state.manifest, state.recorder.copies, state.direct,
                                                                 state.unheld)
            state.copies, state.recorder, state.pending_manifest = state.recorder.copies, None, {}
    kind = "full sync" if head.full else "delta"
    params = sum(len(p.spec.params) for p in payloads)
    return True, (f"Succeeded to apply {kind} version {head.version} flush {head.flush} "
                  f"({params} params, {nnz} values){' (final)' if state.pending is None else ''}.")


def _paths(manifest: dict, copies: dict, direct: dict, unheld: frozenset) -> Tuple[List[str], bool, List[str]]:
    """What a full sync's recorded views allow, per name (one pass; each dtype name parsed once):

    * ``xor_raw``: ``xor_zstd`` bases of names this rank never stored, or stores in another dtype than the
      trainer's (DeepSeek's fp32 ``e_score_correction_bias`` from a bf16 checkpoint), travel raw (XOR zero);
    * ``xor_ready``: every other name has direct views to read its base from;
    * ``dense``: names without direct views whose dtype could travel sparse: they must travel whole (their
      loader is handed whole tensors) — unless this rank does not hold them (``unheld``: it skips them)."""
    dtypes = {d: dtype_from_str(d) for d in {d for _, d in manifest.values()}}
    sparse = {d for d, t in dtypes.items() if sparse_allowed(t) and not nan_sentinel(t)}
    raw, dense, ready = [], [], True
    for n, (_, d) in manifest.items():
        targets = direct.get(n)
        if targets is None:
            if n in copies:
                ready = False
            else:
                raw.append(n)
            if d in sparse and n not in unheld:
                dense.append(n)
        else:
            dtype = dtypes[d]
            for t in targets:
                if t.flat.dtype != dtype:
                    raw.append(n)
                    break
    return sorted(raw), ready, sorted(dense)


def _await_forward(device: torch.device) -> None:
    """An ``in_place`` pause leaves the last launched forward running on its own stream (overlap scheduler): no
    weight may change under it. One wait per version, before its first write."""
    dev.synchronize(device)


def _post_process(model: torch.nn.Module, state: ReceiverState, written: List[str], final: bool) -> None:
    """Re-derive what a model's ``post_load_weights`` builds from loaded params (MLA's ``w_kc``/``w_vc`` from
    ``kv_b_proj``) after direct writes: for the names written, where it takes ``weight_names`` (the DeepSeek-V2/V3
    loader: only the touched layers); else once, at the version's last request. The loader path runs it itself."""
    post = getattr(model, "post_load_weights", None)
    if post is None:
        return
    state.post_pending.update(written)
    if "weight_names" in inspect.signature(post).parameters:
        if state.post_pending:
            post(weight_names=sorted(state.post_pending))
        state.post_pending.clear()
    elif final and state.post_pending:
        post()
        state.post_pending.clear()


def fingerprint_payload(model: torch.nn.Module, parallelism_info=None) -> dict:
    """This rank's share of the weight fingerprint (``/weights_checker`` action ``delta_fingerprint``),
    shaped as SGLang's ``ChecksumInfo`` so the checker's TP gather and HTTP reply carry it unchanged. No garbage
    collection meanwhile: a collection its per-view objects trigger scans the engine's whole heap."""
    state = receiver_state(model)
    if state.copies is None:
        raise DeltaError("no full sync has been applied yet: there is nothing to fingerprint")
    if state.pending is not None:
        raise DeltaError(f"version {state.pending} is being applied: fingerprint it after its final flush")
    with torch.no_grad(), gc_paused():
        shares = fingerprint.engine_shares(state.copies)
    return fingerprint.rank_payload(shares, state.version, parallelism_info)


def _kill_point() -> None:
    """Fault injection for tests: when ``$SGLANG_DELTA_TEST_KILL_FILE`` names an existing file, the
    engine process dies here, between two writes of an apply (the file is consumed)."""
    path = os.environ.get("SGLANG_DELTA_TEST_KILL_FILE")
    if path and os.path.exists(path):
        os.remove(path)
        logger.error("SGLANG_DELTA_TEST_KILL_FILE: exiting mid-apply")
        os._exit(137)


def note_outside_load(host, entry_point: str) -> None:
    """Hooked at the top of the plain weight-load paths: their writes are not part of any delta
    version, so a delta built on the committed version would land on other weights. Until the next
    full sync every delta is refused (loudly), which makes the sender fall back to a full sync."""
    state = receiver_state(host_model(host))
    if state.manifest is not None:
        state.outside_load = entry_point


def _check_writable(state: ReceiverState, head: DeltaSpec, params: Sequence[DeltaParam], starts: bool,
                    completes: bool) -> None:
    """Delta rules beyond the wire's: a sparse param without NaN sentinel (fp8) needs recorded views to be written
    through, and a changed block scale needs its weight's bytes in the same version (a scale applied to the old
    bytes would rescale them: a silently wrong layer). Checked before this request's first write; a version whose
    earlier flushes already landed is then left dirty by the caller."""
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
    check_quantization(host_model(host))
    _upstream_guards(host)
    spec = server_arg(host, "speculative_algorithm", None)
    if spec:
        raise DeltaError(f"speculative decoding ({spec}) is not supported by delta weight sync: the draft model would "
                         "keep its old weights while the target moves on", Refusal.UNSUPPORTED)


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


# ---------------------------------------------------------------- transports


def _apply_delta(self, model_path: str, files: Optional[List[str]], weight_version: Optional[str] = None,
                 store: Optional[dict] = None) -> Tuple[bool, str]:
    """Disk transport: read the announced files of one publish (once per engine, in parallel), then apply them as
    one request. No garbage collection while the files are parsed either (:func:`ops.gc_paused`). ``store``: the
    version store's request (``digests`` of pushed files, or ``catch_up``; see ``store.catch_up``)."""
    with gc_paused():
        if store:
            from sglang.srt.weight_sync.delta.store import catch_up

            if store.get("catch_up"):
                return catch_up.catch_up(self, model_path, weight_version)
            return catch_up.apply_pushed(self, model_path, files, weight_version, store.get("digests") or {})
        try:
            payloads = read_files_once(self, model_path, files)
        except DeltaError as e:  # every rank refuses alike (the TP ranks still agree before any write)
            return _apply_delta_payload(self, [], weight_version, failure=e)
        return _apply_delta_payload(self, payloads, weight_version)


def _apply_delta_from_distributed(self, delta: Optional[str], names, dtypes, shapes, group_name: str,
                                  weight_version: Optional[str] = None) -> Tuple[bool, str]:
    """NCCL transport: receive both broadcasts first (see :func:`receive_broadcast`), then validate and apply."""
    with gc_paused():
        try:
            received = receive_broadcast(self, names, dtypes, shapes, group_name)
        except DeltaError as e:
            return _refused(receiver_state(host_model(self)), e, received=False)
        return _apply_received_delta(self, delta, received, weight_version)


def _apply_received_delta(self, delta: Optional[str], named_tensors, weight_version: Optional[str] = None) -> Tuple[bool, str]:
    """Apply the two received blobs of one flush (v0.5.23 receives them through :func:`receive_broadcast` too), with
    no garbage collection from the spec's parse on: a collection the parse's objects trigger scans the engine's
    whole heap."""
    with gc_paused():
        return _apply_received(self, delta, named_tensors, weight_version)


def _apply_received(self, delta: Optional[str], named_tensors, weight_version: Optional[str]) -> Tuple[bool, str]:
    try:
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


