"""Commit: a staged request's writes, read-back and post-processing, and the version it completes.

Everything here writes weights, so it is the part a pause must cover. A write that fails after others landed (or
reads back other bits) leaves the engine *dirty* on every tensor-parallel rank: it refuses generation and every
delta until a full sync or a store catch-up replaces its weights. A version commits on the request that brings
every source's final flush.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta import device as dev, draft, fingerprint
from sglang.srt.weight_sync.delta.collectives import tp_agree
from sglang.srt.weight_sync.delta.engine_state import ReceiverState, host_device, host_model, receiver_state, server_arg
from sglang.srt.weight_sync.delta.positions import Positions
from sglang.srt.weight_sync.delta.ops import gc_paused
from sglang.srt.weight_sync.delta.stage import Progress, StagedRequest, StageRefused, stage_request
from sglang.srt.weight_sync.delta.views import ReadBack, contiguous_strides, direct_plan, write_plan, write_run
from sglang.srt.weight_sync.delta.wire import (
    DeltaError,
    DeltaParam,
    DeltaPayload,
    Refusal,
    dtype_from_str,
    nan_sentinel,
    sparse_allowed,
)
from sglang.srt.weight_sync.delta.write_guard import delta_apply_context, full_sync_context, model_tensors

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHUNK_BYTES", "apply_request", "chunk_bytes", "commit_request", "refused"]

DEFAULT_CHUNK_BYTES = 512 << 20


def refused(state: ReceiverState, e: DeltaError, request=None, received=None, note: str = "") -> Tuple[bool, str]:
    """Record a refusal in the engine's status and phrase it for the reply."""
    state.last = (request, e.code.value, received)
    msg = f"delta refused: {e}{note}"
    logger.error(msg)
    return False, msg


def apply_request(host, payloads: Sequence[DeltaPayload], weight_version: Optional[str] = None,
                  failure: Optional[DeltaError] = None) -> Tuple[bool, str]:
    """Stage a whole request, agree on it across TP ranks, then commit it; ``(False, message)`` before the commit
    leaves weights untouched. ``failure``: the request already failed on this rank (e.g. a file it could not read).
    A refusal while an earlier request of a version is written leaves the engine dirty (it holds a mix)."""
    state = receiver_state(host_model(host))
    with gc_paused():
        try:
            staged = stage_request(host, payloads, weight_version, failure, Progress.of(state))
        except StageRefused as e:
            return refused(state, e, e.request, e.received, _mark_mid_version_dirty(state, payloads))
        return commit_request(host, staged)


def _mark_mid_version_dirty(state: ReceiverState, payloads: Sequence[DeltaPayload]) -> str:
    """A refused request of a version whose earlier requests are written (or one that cannot say which version it
    is, while one is): the engine holds a mix and is marked dirty; returns what the refusal adds to its message."""
    head = payloads[0].spec if payloads else None
    if state.pending is None or (head is not None and head.version != state.pending):
        return ""
    state.dirty = True
    return f"; engine is dirty (part of version {state.pending} was written): it needs a full sync"


def chunk_bytes(host) -> int:
    """The engine's bound on dense bytes handed to the loader at once, and on the decoded requests a catch-up holds
    before its first write (``--update-weight-delta-chunk-bytes``)."""
    return int(server_arg(host, "update_weight_delta_chunk_bytes", DEFAULT_CHUNK_BYTES))


def commit_request(host, staged: StagedRequest) -> Tuple[bool, str]:
    """Write one staged request; commit its version if it completes it. ``(False, message)``: the engine is dirty."""
    model = host_model(host)
    state = receiver_state(model)
    device = host_device(host)
    head = staged.head
    # A full sync's sources are views of the received blobs (nothing densified): the whole request goes to the
    # loader in one call, so pairs a loader fuses (DeepSeek's q_a/kv_a, cached per call) stay together.
    chunk_cap = float("inf") if head.full else chunk_bytes(host)
    if staged.starts:
        _await_forward(device)
        state.pending_manifest = {}
        state.recorder = fingerprint.FingerprintRecorder(model_tensors(model)) if head.full else None
    progress = Progress.of(state)
    progress.advance(staged)
    state.pending, state.pending_key, state.next_flush = progress.pending, progress.pending_key, progress.next_flush
    state.finals, state.changed = progress.finals, progress.changed
    if head.full:
        for payload in staged.payloads:
            state.pending_manifest.update((p.name, (list(p.shape), p.dtype)) for p in payload.spec.params)

    def load(chunk):
        if head.full:
            state.recorder.sources(chunk)
        model.load_weights(chunk)
        kill_point()

    try:
        with torch.no_grad():
            check = ReadBack()
            for positions, values, viewed in staged.via_views:
                for run in positions.runs(viewed):
                    write_run(state.plan, run, values, check)
            if staged.via_views:
                wrong = check.verdict()  # the apply's one host read after its writes
                if wrong is not None:
                    raise DeltaError(f"read-back after write: {wrong}", Refusal.VERIFY)
                kill_point()
            _post_process(model, state, [p.name for _, _, viewed in staged.via_views for p in viewed],
                          staged.complete)
        if staged.via_loader:
            # a full sync's sources are views of the received blobs: made before the watch, which sees every op
            ready = _dense_sources(staged.via_loader) if head.full else None
            with torch.no_grad(), (full_sync_context(model, state.recorder) if head.full else
                                   delta_apply_context(model)):
                chunk, held = ready or [], 0
                for p, positions, values in [] if head.full else staged.via_loader:
                    size = p.numel * values.element_size()
                    if chunk and held + size > chunk_cap:
                        load(chunk)
                        chunk, held = [], 0
                    chunk.append((p.name, _decode_delta_one_param(p, positions, values, device)))
                    held += size
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
        state.last = (staged.request, code.value, staged.received)
        cause = repr(write_error) if write_error is not None else "another tensor-parallel rank's write failed"
        return False, f"delta apply failed after a partial write, engine is dirty and needs a full sync: {cause}"

    state.last = (staged.request, None, staged.received)
    nnz = sum(pl.values.numel() for pl in staged.payloads)  # the params' values tile them (checked)
    if staged.complete:
        _commit_version(model, state, head)
    kind = "full sync" if head.full else "delta"
    params = sum(len(p.spec.params) for p in staged.payloads)
    return True, (f"Succeeded to apply {kind} version {head.version} flush {head.flush} "
                  f"({params} params, {nnz} values){' (final)' if state.pending is None else ''}.")


def _commit_version(model: torch.nn.Module, state: ReceiverState, head) -> None:
    """The version's last request is written: it is the engine's; a full sync's recorded views become the plan."""
    state.version, state.pending, state.next_flush, state.finals = head.version, None, {}, set()
    kind = "full" if head.full else "delta"
    state.applied[kind] = state.applied.get(kind, 0) + 1
    if head.full:
        state.manifest, state.dirty, state.outside_load, state.released = state.pending_manifest, False, None, False
        state.direct = direct_plan(model, state.recorder)
        state.plan = write_plan(state.direct, state.manifest)
        wrote_only = state.recorder.wrote_only_copies(model_tensors(model))
        state.unheld = frozenset(state.manifest).difference(state.recorder.copies) if wrote_only else frozenset()
        state.draft_names, missing = draft.draft_facts(model, state.recorder.copies, wrote_only)
        state.draft_unwritten = len(missing)
        if missing:  # right for a draft the trainer does not train; a trainer that does stops on the status' count
            logger.warning("delta: the full sync wrote nothing into %d of the draft's own params (%r, ...): the draft "
                           "keeps its startup weights there (right if the trainer does not train its MTP layers; if "
                           "it does, its names for them do not reach the draft's loader)", len(missing), missing[0])
        state.xor_raw, state.xor_ready, state.dense = _paths(state.manifest, state.recorder.copies, state.direct,
                                                             state.unheld)
        state.copies, state.recorder, state.pending_manifest = state.recorder.copies, None, {}


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


def kill_point() -> None:
    """Fault injection for tests: when ``$SGLANG_DELTA_TEST_KILL_FILE`` names an existing file, the
    engine process dies here, between two writes of an apply (the file is consumed)."""
    path = os.environ.get("SGLANG_DELTA_TEST_KILL_FILE")
    if path and os.path.exists(path):
        os.remove(path)
        logger.error("SGLANG_DELTA_TEST_KILL_FILE: exiting mid-apply")
        os._exit(137)
