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
  are written straight through those views (:func:`_write_direct`, O(changed)).
* Every other sparse param is densified into a full-shape NaN tensor and fed, in chunks capped by
  ``--update-weight-delta-chunk-bytes``, to ``load_weights`` inside ``write_guard.delta_apply_context``,
  where ``Tensor.copy_`` into model storage keeps the old value wherever the source is NaN and
  ``Tensor.fill_(nan)`` into model storage is ignored.
* Versions: an engine accepts a request iff its committed version lies in
  ``[base_version, version)`` (or it is mid-way through this same version and this is the next
  flush), and commits ``version`` on the ``final`` request. Full syncs (every param dense) are
  the only thing a fresh or dirty engine accepts. An engine that wrote part of a sync and then
  failed is *dirty* until a full sync.

* Every request leaves a structured :class:`~wire.DeltaStatus` (``/weights_checker`` ``delta_status``):
  committed version, whether only a full sync helps and why, the last request's refusal code. The
  sender decides on those fields, never on the message.

Not supported, refused loudly: quantized engines, sparse fp8/integer params (they travel dense).
How the loader is watched (per thread, aten-level bypasses, foreign threads): see ``write_guard``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta import fingerprint
from sglang.srt.weight_sync.delta.write_guard import delta_apply_context, full_sync_context, model_tensors
from sglang.srt.weight_sync.delta.collectives import CollectiveStuck, abort_group, await_collectives
from sglang.srt.weight_sync.delta.wire import (
    HEADER_CAP,
    POSITIONS,
    VALUES,
    DeltaError,
    DeltaParam,
    DeltaPayload,
    DeltaSpec,
    DeltaStatus,
    Refusal,
    dtype_from_str,
    host_values,
    maybe_zstd_decompress,
    read_safetensors,
    unxor,
    validate_payload,
)

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 512 << 20
DEFAULT_READ_WORKERS = 4


# ---------------------------------------------------------------- receiver state


@dataclasses.dataclass
class ReceiverState:
    """What an engine knows about its own weights; lives beside the model, not on the runner.

    (v0.5.23's ``WeightUpdater`` is a frozen slots dataclass and cannot hold new attributes.)
    """

    version: Optional[int] = None  # committed version; None until the first full sync
    pending: Optional[int] = None  # version whose flushes are being applied
    next_flush: int = 0
    dirty: bool = False
    outside_load: Optional[str] = None  # a plain weight load since the last sync broke the chain
    manifest: Optional[Dict[str, Tuple[List[int], str]]] = None
    pending_manifest: Dict[str, Tuple[List[int], str]] = dataclasses.field(default_factory=dict)
    max_payload_bytes: int = 0  # bound on one decompressed flush, from the model's size (see _max_file_bytes)
    recorder: Optional[fingerprint.FingerprintRecorder] = None  # watching the full sync being applied
    copies: Optional[dict] = None  # where the last full sync's HF tensors landed (fingerprint.engine_shares)
    direct: Optional[dict] = None  # name -> [_Direct]: params a delta writes through those views, no loader call
    last: tuple = (None, None, None)  # ([version, flush], refusal code or None, received) of the last request
    xor_ready: bool = False  # every param this rank loaded has direct views of its own dtype (xor_zstd bases)
    xor_raw: List[str] = dataclasses.field(default_factory=list)  # names this rank's loader never stored


_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, ReceiverState]" = weakref.WeakKeyDictionary()


def receiver_state(model: torch.nn.Module) -> ReceiverState:
    return _STATES.setdefault(model, ReceiverState())


def _runner(host):
    """The ModelRunner behind a hook site (v0.5.23 hooks sit on its WeightUpdater)."""
    get = getattr(host, "get_model_runner", None)
    return get() if get is not None else host


def _model(host) -> torch.nn.Module:
    get = getattr(host, "get_model", None)
    return get() if get is not None else host.model


def _device(host) -> torch.device:
    return torch.device(host.device) if isinstance(host.device, str) else host.device


def _server_arg(host, name: str, default):
    args = getattr(_runner(host), "server_args", None)
    value = getattr(args, name, None)
    return default if value is None else value


# ---------------------------------------------------------------- direct writes


def _contiguous_strides(sizes) -> Tuple[int, ...]:
    out, step = [], 1
    for n in reversed(sizes):
        out.append(step)
        step *= n
    return tuple(reversed(out))


@dataclasses.dataclass
class _Direct:
    """Where one recorded copy puts HF flat positions: ``flat`` (the param's whole storage) at
    ``doff + sum(i_d * dst_stride_d)`` for the multi-index ``i`` with ``p = soff + sum(i_d * src_stride_d)``."""

    flat: torch.Tensor
    soff: int
    doff: int
    numel: int  # elements the view spans in the HF tensor
    dims: List[Tuple[int, int, int]]  # (size, src stride, dst stride), outer to inner; [] = one contiguous block

    @classmethod
    def of(cls, c) -> Optional["_Direct"]:
        """None when the source view cannot be inverted by division (overlapping or interleaved strides)."""
        (_, dstr, doff), (ssz, sstr, soff) = c.dst, c.src
        if c.param.data_ptr() != c.ptr:
            return None  # the param's tensor was replaced after this copy: the recorded offsets are stale
        keep = [d for d in range(len(ssz)) if ssz[d] > 1]
        numel = math.prod(ssz)
        dense = _contiguous_strides(ssz)  # sizes are equal on both sides (the recorder checks)
        block = all(sstr[d] == dense[d] and dstr[d] == dense[d] for d in keep)
        dims = sorted(((ssz[d], sstr[d], dstr[d]) for d in keep), key=lambda x: -x[1])
        span = 1
        for size, stride, _ in reversed(dims):
            if stride < span:
                return None
            span += stride * (size - 1)
        storage = c.param.untyped_storage().nbytes() // c.param.element_size()
        flat = torch.as_strided(c.param.detach(), (storage,), (1,), 0)
        return cls(flat, soff, doff, numel, [] if block else dims)

    def targets(self, idx: torch.Tensor, whole: bool) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """(a mask of the entries of ``idx`` this view holds, or None for all; every entry's offset in ``flat``,
        meaningful where the mask holds). No host synchronization: the caller selects for a whole flush at once."""
        if not self.dims:
            offsets = idx + (self.doff - self.soff)
            return (None, offsets) if whole else ((idx >= self.soff) & (idx < self.soff + self.numel), offsets)
        rem = idx - self.soff
        ok = rem >= 0
        out = torch.full_like(idx, self.doff)
        for size, sstride, dstride in self.dims:
            i = torch.div(rem, sstride, rounding_mode="floor")
            ok &= (i >= 0) & (i < size)
            rem -= i * sstride
            out += i * dstride
        return ok & (rem == 0), out


def _direct_plan(model: torch.nn.Module, recorder: fingerprint.FingerprintRecorder) -> Dict[str, List[_Direct]]:
    """Names whose view copies can take deltas directly: all of them, if the full sync saw the loader write
    nothing else; none otherwise (then every delta goes through the loader)."""
    if getattr(model, "post_load_weights", None) is not None:
        logger.info("delta: the model post-processes loaded weights; deltas go through its loader")
        return {}
    if recorder.unexplained is not None:
        logger.info("delta: the loader wrote %s outside a view copy; deltas go through its loader",
                    recorder.unexplained)
        return {}
    plan = {}
    for name, copies in recorder.copies.items():
        targets = [_Direct.of(c) for c in copies]
        if all(t is not None for t in targets):
            plan[name] = targets
    return plan


def _write_direct(items) -> None:
    """Overwrite the changed elements of a flush's params in place, through every view their loader used.

    ``items``: ``(targets, positions, values, numel)`` per param. A view that holds all of an HF tensor is
    written at once; the views that hold part of one (TP shards) are selected together, with one
    ``nonzero`` and one host read for the whole flush, not one per param."""
    partial = []  # (view, mask, offsets, values)
    for targets, idx, values, numel in items:
        device = targets[0].flat.device
        idx, values = idx.to(device, non_blocking=True), values.to(device, non_blocking=True)
        for t in targets:
            mask, offsets = t.targets(idx, whole=t.soff == 0 and t.numel == numel)
            if mask is None:
                t.flat.index_copy_(0, offsets, values.to(t.flat.dtype))
            else:
                partial.append((t, mask, offsets, values))
    if not partial:
        return
    starts = [0]
    for _, mask, _, _ in partial:
        starts.append(starts[-1] + mask.numel())
    hits = torch.cat([m for _, m, _, _ in partial]).nonzero().squeeze(1)
    bounds = host_values(torch.searchsorted(hits, torch.tensor(starts, device=hits.device)))
    for (t, _, offsets, values), a, b, start in zip(partial, bounds, bounds[1:], starts):
        if b > a:
            sel = hits[a:b] - start
            t.flat.index_copy_(0, offsets[sel], values[sel].to(t.flat.dtype))


def _decode_delta_one_param(p: DeltaParam, idx: Optional[torch.Tensor], values: torch.Tensor,
                            device) -> torch.Tensor:
    """Full-shape source tensor for the loader: NaN where unchanged, the trainer's bytes elsewhere."""
    vals = values[p.val_start:p.val_end]
    if idx is None:
        return vals.to(device).view(p.shape)
    flat = torch.full((p.numel,), float("nan"), dtype=vals.dtype, device=device)
    flat.index_copy_(0, idx.to(device), vals.to(device))
    return flat.view(p.shape)


# ---------------------------------------------------------------- the shared apply path


def _check_version(state: ReceiverState, specs: Sequence[DeltaSpec], weight_version: Optional[str]) -> DeltaSpec:
    """One request = one (version, flush); refuse anything the version chain does not allow."""
    head = specs[0]
    key = (head.version, head.base_version, head.flush, head.full, head.encoding)
    for s in specs[1:]:
        if (s.version, s.base_version, s.flush, s.full, s.encoding) != key:
            raise DeltaError(f"files of one request disagree on (version, base_version, flush, full, encoding): "
                             f"{key} vs {(s.version, s.base_version, s.flush, s.full, s.encoding)}")
    if weight_version is not None and str(weight_version) != str(head.version):
        raise DeltaError(f"weight_version {weight_version!r} differs from the delta's version {head.version}")
    v, committed, reason = head.version, state.version, _full_reason(state)
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


def _check_xor_base(state: ReceiverState, head: DeltaSpec) -> None:
    """xor_zstd values are relative to ``base_version``'s bytes: only an engine committed exactly there can use them."""
    if head.full:
        raise DeltaError("a full sync cannot be xor_zstd (it has no base)")
    if state.version != head.base_version:
        raise DeltaError(f"xor_zstd values are relative to version {head.base_version}; this engine is at version "
                         f"{state.version}", Refusal.OFF_CHAIN)
    if not state.xor_ready:
        raise DeltaError("xor_zstd values need the committed bytes of every param, and this engine cannot read them "
                         "all through recorded views (send it planes_zstd)", Refusal.NO_BASE)


def _full_reason(state: ReceiverState) -> Optional[str]:
    """Why every delta is refused until a full sync (None: deltas are welcome)."""
    if state.manifest is None:
        return "fresh"
    if state.dirty:
        return "dirty"
    if state.outside_load:
        return "outside_load"
    return None


def delta_status(model: torch.nn.Module) -> DeltaStatus:
    """This rank's structured status (what the sender decides on)."""
    state = receiver_state(model)
    reason = _full_reason(state)
    request, code, received = state.last
    return DeltaStatus(version=state.version, needs_full=reason is not None, reason=reason, pending=state.pending,
                       request=request, code=code, received=received, max_request_bytes=_max_file_bytes(model),
                       xor=state.xor_ready and reason is None, xor_raw=list(state.xor_raw))


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


def _tp_group():
    """This engine's tensor-parallel group coordinator, or None when this rank is the whole engine."""
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except Exception:  # no model-parallel world (a bare model)
        return None
    return group if group.world_size > 1 else None


def _tp_agree(ok: bool, *same: int) -> bool:
    """True iff every tensor-parallel rank of this engine says ``ok`` and passes the same ``same`` integers
    (each rank runs every request, reading and checking on its own: one rank's unreadable file or failed
    write must stop all of them, not only itself)."""
    group = _tp_group()
    if group is None:
        return ok
    verdict = torch.tensor([int(ok)] + [x for v in same for x in (v, -v)], dtype=torch.int64)
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    mins = verdict.tolist()
    return bool(mins[0]) and all(mins[k] == -mins[k + 1] for k in range(1, len(mins), 2))


def _read_base(direct: Dict[str, List["_Direct"]], params, idxs, dtype, device, held_parts: list) -> torch.Tensor:
    """The committed values at ``idxs`` through each param's recorded views; appends, per param, the mask of the
    entries this rank holds (None: all of them) to ``held_parts``. Entries no view holds read as zero (a param no
    rank stores travels raw) or as anything (the caller refuses a param that is held only in part)."""
    vals = []
    for p, idx in zip(params, idxs):
        idx = torch.arange(p.numel, device=device) if idx is None else idx.to(device)
        v, h = None, torch.zeros(idx.numel(), dtype=torch.bool, device=device)
        for t in direct.get(p.name, ()):
            if t.flat.dtype != dtype:  # the engine keeps other bytes than the trainer sends: no base here
                continue
            mask, offsets = t.targets(idx, whole=t.soff == 0 and t.numel == p.numel)
            if mask is None:  # the whole HF tensor, and idx is clamped into it: every offset is in range
                v, h = t.flat[offsets], None
                break
            got = t.flat[offsets.clamp(0, max(t.flat.numel() - 1, 0))]  # entries outside this view are masked off
            v = got if v is None else torch.where(mask, got, v)
            h |= mask
        vals.append(torch.zeros(idx.numel(), dtype=dtype, device=device) if v is None else v)
        held_parts.append(h)
    return torch.cat(vals) if vals else torch.zeros(0, dtype=dtype, device=device)


def _rebuild_xor(state: ReceiverState, payloads: Sequence[DeltaPayload], device) -> List[DeltaPayload]:
    """``xor_zstd``: rebuild every flush's new values from this rank's committed bytes (see ``wire.unxor``).

    With tensor parallelism a rank holds only its shard of some params; the ranks rebuild together with
    two collectives over the flush's values (O(changed)): the lowest rank holding an element owns it,
    owners contribute its rebuilt bytes, every rank gets them all. The checksum then judges the whole
    flush on every rank. Called on every rank after the ranks agreed to rebuild, so the collectives match.
    """
    direct = state.direct or {}
    helds: list = []  # per param: None (all held) or a mask
    rebuilt = [unxor(pl, state.manifest, lambda ps, ix, pl=pl: _read_base(direct, ps, ix, pl.values.dtype, device, helds))
               for pl in payloads]
    params = [p for pl in rebuilt for p in pl.spec.params]
    group = _tp_group()
    if group is not None and params:
        world, rank = group.world_size, group.rank_in_group
        held = torch.cat([torch.ones(p.nnz, dtype=torch.bool, device=device) if h is None else h
                          for p, h in zip(params, helds)])
        owner = torch.where(held, rank, world).to(torch.int32)
        torch.distributed.all_reduce(owner, op=torch.distributed.ReduceOp.MIN, group=group.device_group)
        mine = owner == rank
        parts = [pl.values.view(torch.uint8).view(pl.values.numel(), pl.values.element_size()) for pl in rebuilt]
        raw = torch.cat([torch.where(m[:, None], b, 0) for m, b in zip(mine.split([p.shape[0] for p in parts]), parts)])
        torch.distributed.all_reduce(raw, op=torch.distributed.ReduceOp.SUM, group=group.device_group)  # disjoint bytes
        out, at = [], 0
        for pl, part in zip(rebuilt, parts):
            n = part.shape[0]
            out.append(dataclasses.replace(pl, values=raw[at:at + n].reshape(-1).view(pl.values.dtype)))
            at += n
        rebuilt = out
        helds = list((owner < world).split([p.nnz for p in params]))
    # A param no rank holds any of (the loader ignores it, e.g. a tied lm_head) travels raw: XOR zero. A param
    # held only in part cannot be rebuilt. One host read for the flush.
    partial = [(k, h) for k, h in enumerate(helds) if h is not None and h.numel()]
    if partial:
        some = torch.stack([h.any() & ~h.all() for _, h in partial])
        bad = host_values(some)
        if any(bad):
            name = params[partial[bad.index(True)][0]].name
            raise DeltaError(f"param {name!r}: xor_zstd values need its committed bytes, which this engine cannot read "
                             "all of through recorded views (send it planes_zstd)", Refusal.NO_BASE)
    return rebuilt


def _apply_delta_payload(self, payloads: Sequence[DeltaPayload], weight_version: Optional[str] = None,
                         failure: Optional[DeltaError] = None) -> Tuple[bool, str]:
    """Validate a whole request, agree on it across TP ranks, then write it; ``(False, message)`` leaves weights
    untouched. ``failure``: the request already failed on this rank (e.g. a file it could not read)."""
    model = _model(self)
    state = receiver_state(model)
    device = _device(self)
    # Each flush's blobs move to the engine's device once: positions decode and values are written there
    # (read from files, they arrive on the host; per-param copies would each wait for the device).
    payloads = [dataclasses.replace(p, positions=p.positions.to(device), values=p.values.to(device)) for p in payloads]
    head = payloads[0].spec if payloads else None
    request = [head.version, head.flush] if head is not None else None
    received = (payloads[0].source == "broadcast" or None) if payloads else None
    continuing = head is not None and state.pending == head.version and head.flush > 0
    xor = any(p.xored for p in payloads)
    error = failure
    if error is None:
        try:
            if not payloads:
                raise DeltaError("delta request holds no payload")
            _refuse_unsupported(self)
            head = _check_version(state, [p.spec for p in payloads], weight_version)
            manifest = state.manifest
            if xor:
                _check_xor_base(state, head)
            else:
                decoded = [validate_payload(p, manifest) for p in payloads]
            names = [q.name for p in payloads for q in p.spec.params]
            if len(set(names)) != len(names):
                raise DeltaError(f"param {next(n for n in names if names.count(n) > 1)!r} appears in two files of one request")
        except DeltaError as e:
            error = e
    peer = DeltaError("another tensor-parallel rank of this engine refused the request (its delta_status says why)",
                      Refusal.PEER)
    if not _tp_agree(error is None, int(xor), sum(p.values.numel() for p in payloads) if xor else 0) and error is None:
        error = peer
    if xor and error is None:  # every rank agreed to rebuild: the rebuild's collectives match on all of them
        try:
            payloads = _rebuild_xor(state, payloads, device)
            decoded = [validate_payload(p, manifest) for p in payloads]
        except DeltaError as e:
            error = e
        if not _tp_agree(error is None) and error is None:
            error = peer
    if error is not None:
        note = ""
        if continuing:  # earlier flushes of this version are written: the engine holds a mix
            state.dirty = True
            note = f"; engine is dirty (part of version {head.version} was written): it needs a full sync"
        return _refused(state, error, request, received, note)

    chunk_cap = int(_server_arg(self, "update_weight_delta_chunk_bytes", DEFAULT_CHUNK_BYTES))
    if head.flush == 0:
        state.pending_manifest = {}
        state.recorder = fingerprint.FingerprintRecorder(model_tensors(model)) if head.full else None
    state.pending, state.next_flush = head.version, head.flush + 1

    def load(chunk):
        if head.full:
            state.recorder.sources(chunk)
        model.load_weights(chunk)
        _kill_point()

    direct = {} if head.full else (state.direct or {})
    via_views, via_loader = [], []  # (param, positions or None, the flush's values on the device)
    for payload, idxs in zip(payloads, decoded):
        values = payload.values
        for p, idx in zip(payload.spec.params, idxs):
            if head.full:
                state.pending_manifest[p.name] = (list(p.shape), p.dtype)
            if idx is not None and not idx.numel():
                continue  # nothing of this param changed: no write at all
            (via_views if idx is not None and p.name in direct else via_loader).append((p, idx, values))
    try:
        with torch.no_grad():
            if via_views:
                _write_direct([(direct[p.name], idx, values[p.val_start:p.val_end], p.numel)
                               for p, idx, values in via_views])
                _kill_point()
        if via_loader:
            context = contextlib.ExitStack()
            if head.full:
                context.enter_context(full_sync_context(model, state.recorder))
            else:
                context.enter_context(delta_apply_context(model))
            with torch.no_grad(), context:
                chunk, chunk_bytes = [], 0
                for p, idx, values in via_loader:
                    size = p.numel * values.element_size()
                    if chunk and chunk_bytes + size > chunk_cap:
                        load(chunk)
                        chunk, chunk_bytes = [], 0
                    chunk.append((p.name, _decode_delta_one_param(p, idx, values, device)))
                    chunk_bytes += size
                if chunk:
                    load(chunk)
                    del chunk
        write_error = None
    except Exception as e:  # a write failed mid-way: some weights are written
        logger.exception("delta apply failed after writing")
        write_error = e
    if not _tp_agree(write_error is None):  # any rank's failed write leaves the engine as a whole inconsistent
        state.dirty = True
        state.pending = None
        code = Refusal.APPLY_FAILED if write_error is not None else Refusal.PEER
        state.last = (request, code.value, received)
        cause = repr(write_error) if write_error is not None else "another tensor-parallel rank's write failed"
        return False, f"delta apply failed after a partial write, engine is dirty and needs a full sync: {cause}"

    state.last = (request, None, received)
    nnz = sum(p.nnz for pl in payloads for p in pl.spec.params)
    if any(p.spec.final for p in payloads):
        state.version, state.pending, state.next_flush = head.version, None, 0
        if head.full:
            state.manifest, state.dirty, state.outside_load = state.pending_manifest, False, None
            state.direct = _direct_plan(model, state.recorder)
            state.xor_ready = all(n in state.direct and all(t.flat.dtype == dtype_from_str(d) for t in state.direct[n])
                                  for n, (_, d) in state.manifest.items() if n in state.recorder.copies)
            state.xor_raw = sorted(n for n in state.manifest if n not in state.recorder.copies)
            state.copies, state.recorder, state.pending_manifest = state.recorder.copies, None, {}
    kind = "full sync" if head.full else "delta"
    return True, (f"Succeeded to apply {kind} version {head.version} flush {head.flush} "
                  f"({len(names)} params, {nnz} values){' (final)' if state.pending is None else ''}.")


def fingerprint_payload(model: torch.nn.Module, parallelism_info=None) -> dict:
    """This rank's share of the weight fingerprint (``/weights_checker`` action ``delta_fingerprint``),
    shaped as SGLang's ``ChecksumInfo`` so the checker's TP gather and HTTP reply carry it unchanged."""
    state = receiver_state(model)
    if state.copies is None:
        raise DeltaError("no full sync has been applied yet: there is nothing to fingerprint")
    if state.pending is not None:
        raise DeltaError(f"version {state.pending} is being applied: fingerprint it after its final flush")
    with torch.no_grad():
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
    state = receiver_state(_model(host))
    if state.manifest is not None:
        state.outside_load = entry_point


def _refuse_unsupported(host) -> None:
    quant = getattr(getattr(host, "model_config", None), "quantization", None)
    if quant:
        raise DeltaError(f"quantized engines ({quant}) are not supported by delta weight sync", Refusal.UNSUPPORTED)
    spec = _server_arg(host, "speculative_algorithm", None)
    if spec:
        raise DeltaError(f"speculative decoding ({spec}) is not supported by delta weight sync: the draft model would "
                         "keep its old weights while the target moves on", Refusal.UNSUPPORTED)


# ---------------------------------------------------------------- transports


def _max_file_bytes(model: torch.nn.Module) -> int:
    """Bound on one decompressed flush: every element of the model dense, plus positions and header (once per model)."""
    state = receiver_state(model)
    if not state.max_payload_bytes:
        state.max_payload_bytes = 8 + HEADER_CAP + 8 * sum(p.numel() for p in model.parameters())
    return state.max_payload_bytes


def _read_delta_file(model_path: str, name: str, max_bytes: int) -> DeltaPayload:
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
        raise DeltaError(f"file {name!r}: must be a plain file name inside model_path")
    root = os.path.realpath(model_path)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.dirname(path) != root:
        raise DeltaError(f"file {name!r}: resolves outside model_path (symlink escape)")
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise DeltaError(f"file {name!r}: {size} bytes exceeds the {max_bytes}-byte bound")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DeltaError(f"file {name!r}: cannot read ({e.strerror})") from None
    return read_safetensors(maybe_zstd_decompress(data, max_bytes, name), name)


def _apply_delta(self, model_path: str, files: Optional[List[str]], weight_version: Optional[str] = None) -> Tuple[bool, str]:
    """Disk transport: read the announced files of one publish in parallel, then apply them as one request."""
    if not files:
        return _apply_delta_payload(self, [], weight_version, failure=DeltaError(
            "load_format 'delta' needs 'files' (the flush files of this publish)"))
    if not os.path.isdir(model_path):
        return _apply_delta_payload(self, [], weight_version, failure=DeltaError(
            f"model_path {model_path!r} is not a directory"))
    workers = int(_server_arg(self, "update_weight_delta_read_workers", DEFAULT_READ_WORKERS))
    max_bytes = _max_file_bytes(_model(self))
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            payloads = list(pool.map(lambda n: _read_delta_file(model_path, n, max_bytes), files))
    except DeltaError as e:  # this rank alone may have failed to read: the TP ranks still agree
        return _apply_delta_payload(self, [], weight_version, failure=e)
    return _apply_delta_payload(self, payloads, weight_version)


def receive_broadcast(self, names, dtypes, shapes, group_name: str) -> List[Tuple[str, torch.Tensor]]:
    """Receive one flush's two blobs on the weight-update group, in full, before anything is judged.

    Refused without receiving only when the request cannot say what to receive (no such group, not two
    blobs, an unknown dtype) or declares more than ``max_request_bytes`` — which the sender learns from
    this engine's status and never exceeds. The wait is bounded by the group timeout; a broadcast given
    up on aborts the group (the sender re-creates it; this engine's status decides what it gets next).
    """
    try:
        return _receive(self, names, dtypes, shapes, group_name)
    except DeltaError as e:  # v0.5.23 reports it as a failed receive: the status must say so as well
        receiver_state(_model(self)).last = (None, e.code.value, False)
        _tp_agree(False)  # the ranks that did receive refuse too (they agree before judging the blobs)
        raise


def _receive(self, names, dtypes, shapes, group_name: str) -> List[Tuple[str, torch.Tensor]]:
    groups = self._model_update_group
    if group_name not in groups:
        raise DeltaError(f"group {group_name!r} not in {list(groups)}; call init_weights_update_group first",
                         Refusal.NOT_RECEIVED)
    try:
        if list(names) != [POSITIONS, VALUES] or len(dtypes) != 2 or len(shapes) != 2:
            raise DeltaError(f"names must be {[POSITIONS, VALUES]} with two dtypes and shapes, got {list(names)}")
        pos_dtype, val_dtype = dtype_from_str(dtypes[0]), dtype_from_str(dtypes[1])
        n_pos, n_val = (int(math.prod(s)) for s in shapes)
    except (DeltaError, TypeError, ValueError) as e:
        raise DeltaError(f"malformed broadcast declaration: {e}", Refusal.NOT_RECEIVED) from None
    declared = n_pos * pos_dtype.itemsize + n_val * val_dtype.itemsize
    if min(n_pos, n_val) < 0 or declared > _max_file_bytes(_model(self)):
        raise DeltaError(f"broadcast of {n_pos} position and {n_val} value elements exceeds this engine's "
                         f"max_request_bytes {_max_file_bytes(_model(self))}", Refusal.NOT_RECEIVED)
    device = _device(self)
    received = [(POSITIONS, torch.empty(n_pos, dtype=pos_dtype, device=device)),
                (VALUES, torch.empty(n_val, dtype=val_dtype, device=device))]
    group = groups[group_name]
    try:
        works = [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for _, t in received]
        await_collectives(works, update_group_timeout(self).total_seconds())
    except Exception as e:
        if isinstance(e, CollectiveStuck):
            abort_group(group)
            del groups[group_name]
        raise DeltaError(f"broadcast on group {group_name!r} failed: {e}", Refusal.NOT_RECEIVED) from None
    return received


def _apply_delta_from_distributed(self, delta: Optional[str], names, dtypes, shapes, group_name: str,
                                  weight_version: Optional[str] = None) -> Tuple[bool, str]:
    """NCCL transport: receive both broadcasts first (see :func:`receive_broadcast`), then validate and apply."""
    try:
        received = receive_broadcast(self, names, dtypes, shapes, group_name)
    except DeltaError as e:
        return _refused(receiver_state(_model(self)), e, received=False)
    return _apply_received_delta(self, delta, received, weight_version)


def _apply_received_delta(self, delta: Optional[str], named_tensors, weight_version: Optional[str] = None) -> Tuple[bool, str]:
    """Apply the two received blobs of one flush (v0.5.23 receives them through :func:`receive_broadcast` too)."""
    try:
        tensors = dict(named_tensors)
        if list(tensors) != [POSITIONS, VALUES]:
            raise DeltaError(f"names must be {[POSITIONS, VALUES]}, got {list(tensors)}")
        if not delta:
            raise DeltaError("load_format 'delta' needs the 'delta' field (a DeltaSpec as JSON)")
        spec = DeltaSpec.from_json(delta)
    except DeltaError as e:
        return _apply_delta_payload(self, [], weight_version, failure=e)
    payload = DeltaPayload(spec, tensors[POSITIONS].reshape(-1), tensors[VALUES].reshape(-1), source="broadcast")
    return _apply_delta_payload(self, [payload], weight_version)


def update_group_timeout(self):
    """Explicit, short timeout for weight-update groups: a missing peer fails a sync instead of hanging it."""
    import datetime

    return datetime.timedelta(seconds=float(_server_arg(self, "update_weight_group_timeout", 120.0)))
