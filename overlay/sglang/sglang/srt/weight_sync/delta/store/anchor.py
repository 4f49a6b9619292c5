"""Anchors: a full version as a standard HF checkpoint (safetensors shards + ``model.safetensors.index.json``), which
SGLang (from a directory or ``s3://``) and transformers load as they are.

A full sync's flush holds params of one dtype whose values tile its blob in order, so its shard is that blob behind
a safetensors header: written without a copy of the tensors. An engine that catches up from an anchor reads each
shard back as the same dense flushes and applies them as a full sync (the model's own ``load_weights``, recorded).
"""

from __future__ import annotations

import json
import struct
from typing import Dict, List, Sequence

import torch

from sglang.srt.weight_sync.delta.files import _ST_DTYPES, _ST_NAMES, _raw_bytes
from sglang.srt.weight_sync.delta.wire import (
    HEADER_CAP,
    DeltaError,
    DeltaParam,
    DeltaPayload,
    DeltaSpec,
    Refusal,
    dtype_from_str,
    dtype_to_str,
)

INDEX = "model.safetensors.index.json"
# what an HF model directory holds beside its weights (copied into an anchor from the trainer's checkpoint)
CONFIG_SUFFIXES = (".json", ".txt", ".model", ".py", ".jinja", ".tiktoken")


def hf_shard(payload: DeltaPayload) -> bytes:
    """A full flush (every param dense, one dtype) as a safetensors shard: its header, then its values blob."""
    spec, values = payload.spec, payload.values.detach().reshape(-1).to("cpu").contiguous()
    size = values.element_size()
    header: Dict[str, dict] = {"__metadata__": {"format": "pt"}}
    for p in spec.params:
        if p.pos_width:
            raise DeltaError(f"param {p.name!r}: an anchor shard holds dense params only")
        header[p.name] = {"dtype": _ST_NAMES[dtype_from_str(p.dtype)], "shape": list(p.shape),
                          "data_offsets": [p.val_start * size, p.val_end * size]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the body starts aligned, as the library's writer does
    return struct.pack("<Q", len(text)) + text + values.view(torch.uint8).numpy().tobytes()


def shard_names(data: bytes) -> List[str]:
    """The tensor names a shard holds (for the index)."""
    (n,) = struct.unpack("<Q", data[:8])
    return [k for k in json.loads(data[8:8 + n]) if k != "__metadata__"]


def index_json(weight_map: Dict[str, str], total_size: int) -> bytes:
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
                      indent=2).encode()


def read_hf_shard(data: bytes, name: str, *, version: int, first_flush: int) -> List[DeltaPayload]:
    """One shard as the dense flushes of a full sync at ``version`` (one per dtype, numbered from ``first_flush``,
    none final: the caller marks the last). Offsets are checked to tile the body before any byte is used."""
    tag = f"anchor shard {name!r}"
    if len(data) < 8:
        raise DeltaError(f"{tag}: truncated", Refusal.UNVERIFIED)
    (n,) = struct.unpack("<Q", data[:8])
    if n > HEADER_CAP or n > len(data) - 8:
        raise DeltaError(f"{tag}: header length {n} does not fit", Refusal.UNVERIFIED)
    try:
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)
        entries = sorted(((t["data_offsets"][0], t["data_offsets"][1], k, _ST_DTYPES[t["dtype"]], list(t["shape"]))
                          for k, t in header.items()), key=lambda e: e[:2])
    except (ValueError, KeyError, TypeError) as e:
        raise DeltaError(f"{tag}: malformed header ({e!r})", Refusal.UNVERIFIED) from None
    body = _raw_bytes(data)[8 + n:]
    at = 0
    by_dtype: Dict[torch.dtype, list] = {}
    for start, end, key, dtype, shape in entries:
        size = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        if start != at or end - start != numel * size:
            raise DeltaError(f"{tag}: tensor {key!r} does not tile the body", Refusal.UNVERIFIED)
        at = end
        t = body[start:end]
        t = (t.clone() if start % size else t).view(dtype).view(shape)
        by_dtype.setdefault(dtype, []).append((key, t, None))
    if at != body.numel():
        raise DeltaError(f"{tag}: {body.numel() - at} bytes after its last tensor", Refusal.UNVERIFIED)
    return [_dense_flush(items, version, first_flush + k)
            for k, (_, items) in enumerate(sorted(by_dtype.items(), key=lambda kv: str(kv[0])))]


def _dense_flush(items, version: int, flush: int) -> DeltaPayload:
    """Tensors of one dtype as one flush of a full sync: every param dense, their values back to back, sealed."""
    params, at = [], 0
    for name, t, _ in items:
        params.append(DeltaParam(name, dtype_to_str(t.dtype), list(t.shape), 0, 0, 0, at, at + t.numel()))
        at += t.numel()
    spec = DeltaSpec(encoding="indices", params=params, full=True, base_version=version, version=version,
                     flush=flush, final=False)
    values = torch.cat([t.reshape(-1) for _, t, _ in items])
    return DeltaPayload(spec, torch.empty(0, dtype=torch.uint8), values).seal()


def config_files(hf_dir: str) -> Sequence[str]:
    """The non-weight files of an HF model directory an anchor carries (config, tokenizer, remote code)."""
    import os

    return sorted(f for f in os.listdir(hf_dir) if f.endswith(CONFIG_SUFFIXES) and f != INDEX
                  and os.path.isfile(os.path.join(hf_dir, f)))
