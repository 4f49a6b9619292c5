"""Weight fingerprint: proves, cheaply and without moving weights, that an engine holds the trainer's bytes.

Defined in HF coordinates, so trainer and engine compute it independently: per HF name,
``sum_i mix((i * C1 + seed(name)) ^ (bits(value_i) * C2)) mod 2**64`` over the flat index ``i`` of
the HF tensor (``mix``: splitmix64's finalizer, a bijection, so for a fixed ``i`` distinct bits give
distinct terms). A sum of a non-linear mix is order-sensitive (swapped values change it) and
additive, so TP shards add up. Integer tensor ops only: the same numbers on CPU and CUDA.

The engine cannot name its storage in HF coordinates by itself (fused QKV, gate/up, TP shards).
During every full sync, :class:`FingerprintRecorder` watches the model's own ``load_weights``:
each ``copy_`` of a view of an HF tensor into a parameter records both geometries (sizes,
strides, offsets), so the fingerprint later reads the parameter through the same views. Names
whose loader transforms the tensor before copying (no view left to follow) are reported as
uncovered and the sender leaves them out of the comparison, naming them.

Replicated params (norms, or KV heads shared by several TP ranks) appear on several ranks; each
rank also reports an additive signature of the indices it covers, and :func:`merge_ranks`
counts every distinct coverage once (the signature is ``sum_i i * (i + C3)``, additive as well).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.delta.mix64 import C1, C2, C3, i64, mix64_
from sglang.srt.weight_sync.delta.wire import INT_VIEW, DeltaError, dtype_from_str, dtype_to_str
from sglang.srt.weight_sync.delta.write_guard import RangeIndex

_M = 0xFFFFFFFFFFFFFFFF
_BLOCK = 1 << 22  # elements hashed at once: bounds the int64 scratch to a few 32 MiB tensors


class Scratch:
    """Reused int64 buffers: in-place ops on them run ~2x faster on CPU than fresh tensors per op."""

    def __init__(self):
        self.bufs: List[torch.Tensor] = []

    def take(self, n: int, device, k: int = 2) -> List[torch.Tensor]:
        if len(self.bufs) < k or self.bufs[0].numel() < n or self.bufs[0].device != torch.device(device):
            self.bufs = [torch.empty(max(n, 1), dtype=torch.int64, device=device) for _ in range(k)]
        return [b[:n] for b in self.bufs[:k]]


def name_seed(name: str) -> int:
    return i64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def _sum_block(seed: int, idx: torch.Tensor, values: torch.Tensor, scratch: Scratch,
               coverage: bool = False) -> Tuple[int, int]:
    """(sum of element hashes, coverage signature or 0) of one block, both mod 2**64."""
    z, t = scratch.take(idx.numel(), idx.device)
    torch.mul(idx, i64(C1), out=z)
    z += seed
    size = values.element_size()
    t.copy_(values.reshape(-1).view(INT_VIEW[size]))  # sign-extends: mask back to the raw bits
    if size < 8:
        t &= (1 << (8 * size)) - 1
    t *= i64(C2)
    z ^= t
    total = int(mix64_(z, t).sum()) & _M
    if not coverage:
        return total, 0
    torch.add(idx, i64(C3), out=t)
    t *= idx
    return total, int(t.sum()) & _M


@dataclasses.dataclass
class NameSum:
    """One name's share on one rank: value sum, coverage signature, elements covered, dtype hashed."""

    total: int = 0
    coverage: int = 0
    count: int = 0
    dtype: str = ""

    def add(self, total: int, coverage: int, count: int) -> None:
        self.total = (self.total + total) & _M
        self.coverage = (self.coverage + coverage) & _M
        self.count += count

    def to_str(self) -> str:
        return f"{self.total:016x}:{self.coverage:016x}:{self.count}:{self.dtype}"

    @classmethod
    def from_str(cls, v: str) -> "NameSum":
        total, coverage, count, dtype = v.split(":")
        return cls(int(total, 16), int(coverage, 16), int(count), dtype)


def tensor_fingerprint(name: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None,
                       scratch: Optional[Scratch] = None) -> NameSum:
    """A whole HF tensor's share (the sender's side), hashed in ``dtype`` (the engine's) if given."""
    t = tensor.detach().reshape(-1)
    if dtype is not None and dtype != t.dtype:
        t = t.to(dtype)
    scratch = scratch or Scratch()
    seed, out = name_seed(name), NameSum(dtype=dtype_to_str(t.dtype))
    idx_buf = torch.empty(min(t.numel(), _BLOCK), dtype=torch.int64, device=t.device)
    for start in range(0, t.numel(), _BLOCK):
        block = t[start:start + _BLOCK]
        idx = torch.arange(start, start + block.numel(), dtype=torch.int64, device=t.device, out=idx_buf[:block.numel()])
        out.add(*_sum_block(seed, idx, block, scratch), block.numel())
    return out


# ---------------------------------------------------------------- engine side


@dataclasses.dataclass
class _Copy:
    """One recorded ``copy_``: a view of HF tensor ``name`` landed in a view of a parameter."""

    param: torch.Tensor
    dst: Tuple[Tuple[int, ...], Tuple[int, ...], int]  # sizes, strides, storage offset (elements)
    src: Tuple[Tuple[int, ...], Tuple[int, ...], int]  # the same, in the HF tensor's flat index
    ptr: int = 0  # the param's data_ptr when recorded (a later ``param.data = ...`` makes the views stale)


class FingerprintRecorder:
    """Records, while a full sync runs ``load_weights``, where each HF tensor's elements land."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self._params = self._ranges((p.data_ptr(), p.numel() * p.element_size(), p) for p in params)
        self._sources = self._ranges(())
        self._joined: Dict[int, Tuple[torch.Tensor, int, list]] = {}  # cat of source views: ptr -> (out, dim, parts)
        self.copies: Dict[str, List[_Copy]] = {}
        self._tls = threading.local()  # per loader thread: inside a recorded copy_ (its aten write is explained)
        self.unexplained: Optional[str] = None  # the first write into the model that no recorded copy explains

    def in_copy(self) -> bool:
        return getattr(self._tls, "in_copy", False)

    @contextlib.contextmanager
    def copying(self, recorded: bool):
        """Mark this thread as inside a ``copy_`` the recorder explains (when ``recorded``)."""
        self._tls.in_copy = recorded
        try:
            yield
        finally:
            self._tls.in_copy = False

    @staticmethod
    def _ranges(items) -> RangeIndex:
        return RangeIndex((ptr, ptr + nbytes, rest) for ptr, nbytes, *rest in items)

    def sources(self, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """The HF tensors handed to the next ``load_weights`` call."""
        self._sources = self._ranges((t.data_ptr(), t.numel() * t.element_size(), n, t) for n, t in named)
        self._joined = {}  # held until the next chunk: a freed cat output's address could come back

    def _view_of_source(self, t: torch.Tensor):
        """(name, (sizes, strides, flat offset)) when ``t`` is a view of one source of this chunk, else None."""
        source = self._sources.find(t.data_ptr())
        if source is None or t.dtype != source[1].dtype:
            return None
        offset = (t.data_ptr() - source[1].data_ptr()) // t.element_size()
        return source[0], (tuple(t.shape), tuple(t.stride()), offset)

    def joined(self, out: torch.Tensor, parts: Sequence[torch.Tensor], dim: int) -> None:
        """``out = torch.cat(parts, dim)``: a loader fusing HF tensors before one copy (DeepSeek's
        ``fused_qkv_a_proj_with_mqa``). When every part is a view of a source, a later copy of ``out`` is
        recorded as one view copy per part."""
        views = [self._view_of_source(p) if p.numel() else None for p in parts]
        if out.numel() and all(views) and out.is_contiguous():
            dim, starts = dim % out.dim(), [0]
            for p in parts:
                starts.append(starts[-1] + p.shape[dim])
            self._joined[out.data_ptr()] = (out, dim, [(v, a, b - a) for v, a, b in zip(views, starts, starts[1:])])

    def observe(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Record ``dst.copy_(src)`` if it copies a view of a source (or a cat of such views) into a param;
        True when recorded."""
        if not isinstance(src, torch.Tensor) or dst.shape != src.shape or not dst.numel():
            return False
        owner = self._params.find(dst.data_ptr())
        if owner is None:
            return False
        joined = self._joined.get(src.data_ptr())
        if joined is not None and joined[0].shape == src.shape and joined[0].stride() == src.stride() \
                and joined[0].dtype == src.dtype:
            _, dim, parts = joined
            pieces = [(name, dst.narrow(dim, start, n), geometry) for (name, geometry), start, n in parts]
        else:
            view = self._view_of_source(src)
            if view is None:
                return False
            pieces = [(view[0], dst, view[1])]
        for name, d, geometry in pieces:
            self.copies.setdefault(name, []).append(_Copy(
                owner[0], (tuple(d.shape), tuple(d.stride()), d.storage_offset()), geometry, owner[0].data_ptr()))
        return True


def _pieces(sizes, dst_strides, src_strides):
    """Split a view along its first dim into pieces of about _BLOCK elements: (sizes, dst shift, src shift)."""
    if not sizes:
        yield (), 0, 0
        return
    inner = 1
    for n in sizes[1:]:
        inner *= n
    step = max(1, _BLOCK // max(inner, 1))
    for s in range(0, sizes[0], step):
        yield (min(step, sizes[0] - s),) + tuple(sizes[1:]), s * dst_strides[0], s * src_strides[0]


def _flat_index(sizes, strides, offset, device) -> torch.Tensor:
    idx = torch.full((), offset, dtype=torch.int64, device=device)
    for d, (n, st) in enumerate(zip(sizes, strides)):
        shape = [1] * len(sizes)
        shape[d] = n
        idx = idx + (torch.arange(n, dtype=torch.int64, device=device) * st).view(shape)
    return idx.reshape(-1)


def engine_shares(copies: Dict[str, List[_Copy]]) -> Dict[str, NameSum]:
    """This rank's share of every recorded name, read through the recorded views."""
    out: Dict[str, NameSum] = {}
    scratch = Scratch()
    for name, entries in copies.items():
        seed, acc = name_seed(name), NameSum(dtype=dtype_to_str(entries[0].param.dtype))
        for c in entries:
            (dsz, dst, doff), (_, sst, soff) = c.dst, c.src  # equal sizes (observe checks)
            for sizes, dshift, sshift in _pieces(dsz, dst, sst):
                d = c.param.as_strided(sizes, dst, doff + dshift)
                idx = _flat_index(sizes, sst, soff + sshift, d.device)
                acc.add(*_sum_block(seed, idx, d, scratch, coverage=True), d.numel())
        out[name] = acc
    return out


VERSION_KEY = "__delta_version__"  # rides in SGLang's per-rank checksum map beside the names


def rank_payload(shares: Dict[str, NameSum], version: Optional[int], parallelism_info) -> dict:
    """One rank's reply in the shape of SGLang's ``ChecksumInfo`` (name -> string), so its checker relays it."""
    checksums = {n: s.to_str() for n, s in shares.items()}
    checksums[VERSION_KEY] = str(version)
    total = sum(s.total for s in shares.values()) & _M
    return {"checksums": checksums, "per_gpu_checksum": f"{total:016x}", "parallelism_info": parallelism_info}


def merge_ranks(ranks: Sequence[Dict[str, NameSum]]) -> Dict[str, NameSum]:
    """Sum the ranks' shares per name, counting identical coverages (replicas) once."""
    seen: Dict[str, set] = {}
    out: Dict[str, NameSum] = {}
    for rank in ranks:
        for name, share in rank.items():
            if share.coverage in seen.setdefault(name, set()):
                continue
            seen[name].add(share.coverage)
            acc = out.setdefault(name, NameSum(dtype=share.dtype))
            acc.add(share.total, share.coverage, share.count)
    return out


def compare(trainer: Dict[str, torch.Tensor], engine: Dict[str, NameSum]) -> Tuple[List[str], List[str]]:
    """(names whose bytes differ, names the engine could not cover) of a trainer state vs merged engine shares."""
    return compare_shares({n: tensor_fingerprint(n, t) for n, t in trainer.items()}, engine, trainer)


def compare_shares(trainer: Dict[str, NameSum], engine: Dict[str, NameSum],
                   tensors: Dict[str, torch.Tensor]) -> Tuple[List[str], List[str]]:
    """As :func:`compare`, from the trainer's shares; ``tensors`` re-hashes a name the engine stores in another dtype."""
    differ, uncovered = [], []
    for name, mine in trainer.items():
        share = engine.get(name)
        if share is None or share.count != mine.count:
            uncovered.append(name)
            continue
        if share.dtype != mine.dtype:
            mine = tensor_fingerprint(name, tensors[name], dtype_from_str(share.dtype))
        if mine.total != share.total:
            differ.append(name)
    return differ, uncovered


def check_version(ranks: Sequence[dict], version: int) -> List[Dict[str, NameSum]]:
    """The per-rank shares of an engine's ``/weights_checker`` reply, refusing a reply about another version."""
    out = []
    for r in ranks:
        checksums = dict(r["checksums"])
        got = checksums.pop(VERSION_KEY, None)
        if got != str(version):
            raise DeltaError(f"engine fingerprint is of version {got}, expected {version}")
        out.append({n: NameSum.from_str(v) for n, v in checksums.items()})
    return out
