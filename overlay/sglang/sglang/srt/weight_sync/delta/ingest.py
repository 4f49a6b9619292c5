"""How a request's blobs arrive at an engine: flush files read from a shared directory, or two broadcasts
received on the weight-update group — every size bounded before anything is read or allocated."""

from __future__ import annotations

import concurrent.futures
import math
import os
from typing import List, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta.collectives import (
    CollectiveStuck,
    abort_group,
    await_collectives,
    broadcast_json,
    tp_agree,
    tp_group,
)
from sglang.srt.weight_sync.delta.engine_state import host_device, host_model, receiver_state, server_arg
from sglang.srt.weight_sync.delta.files import maybe_zstd_decompress, read_safetensors
from sglang.srt.weight_sync.delta.wire import (
    HEADER_CAP,
    POSITIONS,
    VALUES,
    DeltaEncoding,
    DeltaError,
    DeltaPayload,
    DeltaSpec,
    Refusal,
    broadcastable,
    dtype_from_str,
    dtype_to_str,
    received_params,
    spec_json,
)

DEFAULT_READ_WORKERS = 4


def max_request_bytes(model: torch.nn.Module) -> int:
    """Bound on one decompressed flush: every element of the model dense, plus positions and header (once per model)."""
    state = receiver_state(model)
    if not state.max_payload_bytes:
        state.max_payload_bytes = 8 + HEADER_CAP + 8 * sum(p.numel() for p in model.parameters())
    return state.max_payload_bytes


def request_bytes(payloads: Sequence[DeltaPayload]) -> int:
    """A request's blobs, as a stage holds them."""
    return sum(p.positions.numel() * p.positions.element_size() + p.values.numel() * p.values.element_size()
               for p in payloads)


def resolve_file(model_path: str, name: str) -> str:
    """The path of an announced file: a plain name inside ``model_path``, never a symlink out of it."""
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
        raise DeltaError(f"file {name!r}: must be a plain file name inside model_path")
    root = os.path.realpath(model_path)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.dirname(path) != root:
        raise DeltaError(f"file {name!r}: resolves outside model_path (symlink escape)")
    return path


def read_delta_file(model, model_path: str, name: str, max_bytes: int) -> DeltaPayload:
    """One announced file, parsed: fetched while the engine served (``fetch``) if it is still the file that was read,
    else read now."""
    from sglang.srt.weight_sync.delta import fetch

    path = resolve_file(model_path, name)
    try:
        staged = fetch.take(model, path, fetch.file_tag(path))
        if staged is not None:
            return staged
        size = os.path.getsize(path)
        if size > max_bytes:
            raise DeltaError(f"file {name!r}: {size} bytes exceeds the {max_bytes}-byte bound")
        with open(path, "rb") as f:
            data = f.read()
        fetch.count_read(model, len(data))
    except OSError as e:
        raise DeltaError(f"file {name!r}: cannot read ({e.strerror})") from None
    return read_safetensors(maybe_zstd_decompress(data, max_bytes, name), name)


def read_files(host, model_path: str, files: List[str]) -> List[DeltaPayload]:
    """The announced files of one publish, read and decompressed in parallel (``DeltaError`` names the first bad one)."""
    if not files:
        raise DeltaError("load_format 'delta' needs 'files' (the flush files of this publish)")
    if not os.path.isdir(model_path):
        raise DeltaError(f"model_path {model_path!r} is not a directory")
    workers = int(server_arg(host, "update_weight_delta_read_workers", DEFAULT_READ_WORKERS))
    model = host_model(host)
    max_bytes = max_request_bytes(model)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda n: read_delta_file(model, model_path, n, max_bytes), files))


def read_files_once(host, model_path: str, files: List[str], reader=None) -> List[DeltaPayload]:
    """:func:`read_files` (or ``reader()``: files from a version store), once per engine: with tensor parallelism the
    first TP rank reads and decompresses, then broadcasts each flush's spec and blobs over the TP group (on the
    engine's device, where they go anyway); the other ranks never touch the filesystem. A failed read raises the
    same ``DeltaError`` on every rank."""
    read = reader or (lambda: read_files(host, model_path, files))
    group = tp_group()
    if group is None:
        return read()
    first, payloads, error = group.rank_in_group == 0, [], None
    if first:
        try:
            payloads = read()
        except DeltaError as e:
            error = e
    header = broadcast_json(group, (
        {"error": [str(error), error.code.value]} if error is not None else
        {"flushes": [[spec_json(p), p.source, dtype_to_str(p.values.dtype), p.positions.numel(), p.values.numel()]
                     for p in payloads]}) if first else None)
    if "error" in header:
        raise DeltaError(header["error"][0], Refusal(header["error"][1]))
    device, out = host_device(host), []
    for k, (spec, source, dtype, n_pos, n_val) in enumerate(header["flushes"]):
        if first:
            pos, val = payloads[k].positions.to(device).contiguous(), payloads[k].values.to(device).contiguous()
        else:
            pos = torch.empty(n_pos, dtype=torch.uint8, device=device)
            val = torch.empty(n_val, dtype=dtype_from_str(dtype), device=device)
        for t in (pos, val):
            torch.distributed.broadcast(broadcastable(t), src=group.first_rank, group=group.device_group)
        text, spec = spec, DeltaSpec.from_json(spec)
        out.append(DeltaPayload(spec, pos, val, source=source, params_text=received_params(text),
                                xored=DeltaEncoding(spec.encoding) is DeltaEncoding.XOR_ZSTD,
                                coded=DeltaEncoding(spec.encoding) is DeltaEncoding.XOR_CTX))
    return out


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
        receiver_state(host_model(self)).last = (None, e.code.value, False)
        tp_agree(False)  # the ranks that did receive refuse too (they agree before judging the blobs)
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
    if min(n_pos, n_val) < 0 or declared > max_request_bytes(host_model(self)):
        raise DeltaError(f"broadcast of {n_pos} position and {n_val} value elements exceeds this engine's "
                         f"max_request_bytes {max_request_bytes(host_model(self))}", Refusal.NOT_RECEIVED)
    device = host_device(self)
    received = [(POSITIONS, torch.empty(n_pos, dtype=pos_dtype, device=device)),
                (VALUES, torch.empty(n_val, dtype=val_dtype, device=device))]
    group = groups[group_name]
    try:
        works = [torch.distributed.broadcast(broadcastable(t), src=0, group=group, async_op=True) for _, t in received]
        await_collectives(works, update_group_timeout(self).total_seconds())
    except Exception as e:
        if isinstance(e, CollectiveStuck):
            abort_group(group)
            del groups[group_name]
        raise DeltaError(f"broadcast on group {group_name!r} failed: {e}", Refusal.NOT_RECEIVED) from None
    return received


def update_group_timeout(self):
    """Explicit, short timeout for weight-update groups: a missing peer fails a sync instead of hanging it."""
    import datetime

    return datetime.timedelta(seconds=float(server_arg(self, "update_weight_group_timeout", 120.0)))
