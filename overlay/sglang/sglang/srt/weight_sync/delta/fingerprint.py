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

The hashes run as :mod:`mix64`'s row sums (a key per row, so one call hashes the rows of many small tensors) and
stay on the device until one host read per fingerprint (:func:`read_shares`); the coverage signature is a closed
form of each view's geometry.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch._utils import _flatten_dense_tensors

from sglang.srt.weight_sync.delta import mix64
from sglang.srt.weight_sync.delta.mix64 import i64
from sglang.srt.weight_sync.delta.ops import INT_VIEW, host_values, to_device
from sglang.srt.weight_sync.delta.wire import DeltaError, dtype_from_str, dtype_to_str
from sglang.srt.weight_sync.delta.write_guard import RangeIndex

_M = 0xFFFFFFFFFFFFFFFF
_BLOCK = 1 << 22  # elements hashed at once: bounds the int64 temporaries to a few 32 MiB tensors
_COLS = 1 << 10  # a contiguous tensor is hashed as rows of this many elements: many rows keep every core busy


@functools.lru_cache(maxsize=1 << 18)  # a model's names come back every fingerprint
def name_seed(name: str) -> int:
    return i64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``values``: a view of the same shape and strides."""
    return values.view(INT_VIEW[values.element_size()])


def _block(values: torch.Tensor, shape) -> torch.Tensor:
    """A view's raw bits as a 2-D block in the view's element order (a view where the strides allow, else one copy
    at the values' own width)."""
    return _bits(values).reshape(shape)


def _mask(values: torch.Tensor) -> int:
    """The bits of one value (widening an int view sign-extends)."""
    return i64((1 << (8 * values.element_size())) - 1)


class Pending:
    """One name's share not read yet: element hashes as device tensors (the host reads every name of a fingerprint
    at once, :func:`read_shares`, not once per param), the coverage signature already on the host."""

    def __init__(self, dtype: str):
        self.parts: List[torch.Tensor] = []
        self.coverage = 0
        self.count = 0
        self.dtype = dtype

    def add(self, total: torch.Tensor, shape, strides, offset: int) -> None:
        self.parts.append(total)
        self.coverage = (self.coverage + mix64.coverage(shape, strides, offset)) & _M
        self.count += math.prod(shape)


def read_shares(pending: Dict[str, Pending]) -> Dict[str, "NameSum"]:
    """The pending shares read to the host together: per device, every part stacked once, summed per name in one
    ``index_add`` (int64 wraps: sums mod 2**64) and read once — a constant number of ops, whatever the name count."""
    out = {n: NameSum(coverage=p.coverage, count=p.count, dtype=p.dtype) for n, p in pending.items()}
    by_device: Dict[torch.device, Tuple[List[str], List[int], List[torch.Tensor]]] = {}
    for name, p in pending.items():
        for part in p.parts:
            names, ids, parts = by_device.setdefault(part.device, ([], [], []))
            if not names or names[-1] != name:
                names.append(name)
            ids.append(len(names) - 1)
            parts.append(part)
    for device, (names, ids, parts) in by_device.items():
        totals = torch.zeros(len(names), dtype=torch.int64, device=device)
        totals.index_add_(0, to_device(ids, device), torch.stack(parts))
        for name, total in zip(names, host_values(totals)):
            out[name].total = (out[name].total + total) & _M  # a name on two devices adds up
    return out


_JOIN = 1 << 16  # tensors and pieces of up to this many elements are joined with others of their kind into one call


def _batches(group: list, numel: Callable) -> Iterable[list]:
    """``group`` in order, as runs of small items of up to :data:`_BLOCK` elements in all and each large one alone."""
    batch, size = [], 0
    for item in group:
        n = numel(item)
        if n > _JOIN:
            yield [item]
            continue
        if batch and size + n > _BLOCK:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


def _hash(pieces: List[Tuple[Pending, torch.Tensor, int, Tuple[int, int], int]]) -> None:
    """Each 2-D block's element hashes into its name's share. A piece: (share, block of value bits, name seed, (row
    stride, column stride), offset) in HF flat indices. Blocks of one bit width, device, row length and column stride
    are hashed together (:func:`_hash_rows`): the small ones joined, each large one alone (no copy)."""
    kinds: Dict[tuple, list] = {}
    for piece in pieces:
        block, strides = piece[1], piece[3]
        kinds.setdefault((block.dtype, block.device, block.shape[1], strides[1]), []).append(piece)
    for group in kinds.values():
        for batch in _batches(group, lambda piece: piece[1].numel()):
            bits = batch[0][1] if len(batch) == 1 else torch.cat([b for _, b, *_ in batch])
            _hash_rows(bits, [(acc, b.shape, seed, strides, offset) for acc, b, seed, strides, offset in batch])


def _hash_rows(bits: torch.Tensor, blocks: list) -> None:
    """One call for the rows of ``blocks`` joined in ``bits`` (one bit width and column stride; a block: (share, its
    2-D shape, name seed, (row stride, column stride), offset)): a key per row tells their tensors apart, so the calls
    follow the bytes, not the tensor count; row sums added up per block on the device."""
    device, mask = bits.device, _mask(bits)
    col_key = mix64.fingerprint_keys((0, blocks[0][3][1]), 0, 0)[0][1]
    table, start = [], 0  # per block: the key its row 0 would have at row 0 of ``bits``, its key per row, its rows
    for _, shape, seed, strides, offset in blocks:
        (row_key, _), key0 = mix64.fingerprint_keys(strides, offset, seed)
        table.append((mix64.i64(key0 - start * row_key), row_key, shape[0]))
        start += shape[0]
    if len(blocks) == 1:
        base, row_key, rows = table[0]
        row_keys = torch.arange(rows, dtype=torch.int64, device=device) * row_key + base
    else:
        cols = to_device(table, device).T
        counts = cols[2]
        row_keys = torch.repeat_interleave(cols[0], counts, output_size=start) + torch.arange(
            start, dtype=torch.int64, device=device) * torch.repeat_interleave(cols[1], counts, output_size=start)
    sums = mix64.row_sums(bits, row_keys, col_key, mask)
    if len(blocks) == 1:
        totals = [sums.sum()]
    else:
        ids = torch.repeat_interleave(torch.arange(len(blocks), device=device), counts, output_size=start)
        totals = torch.zeros(len(blocks), dtype=torch.int64, device=device).index_add_(0, ids, sums).unbind(0)
    for (acc, shape, _, strides, offset), total in zip(blocks, totals):
        acc.add(total, shape, strides, offset)


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


def tensor_share(name: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Pending:
    """A whole HF tensor's share (the sender's side), hashed in ``dtype`` (the engine's) if given; not read yet."""
    return tensor_shares([(name, tensor)], dtype)[name]


def tensor_shares(items: Sequence[Tuple[str, torch.Tensor]], dtype: Optional[torch.dtype] = None) -> Dict[str, Pending]:
    """:func:`tensor_share` of many tensors (a trainer's chunk), hashed together: the small ones of whole rows (or less
    than one) joined by one C++ call per kind and hashed by one kernel call (:func:`_hash_rows`), no tensor op of
    their own. A name given twice keeps its last tensor, and only that one is hashed."""
    out: Dict[str, Pending] = {}
    pieces = []
    small: Dict[tuple, list] = {}  # (dtype, device, row length) -> [(share, tensor, seed, rows)]
    with torch.no_grad():
        for name, tensor in dict(items).items():
            n = tensor.numel()
            seed, share = name_seed(name), Pending(dtype_to_str(dtype or tensor.dtype))
            out[name] = share
            cols = _COLS if n % _COLS == 0 else n
            if 0 < n <= _JOIN and cols <= _COLS:
                small.setdefault((tensor.dtype, tensor.device, cols), []).append((share, tensor, seed, n // cols))
                continue
            t = tensor.reshape(-1).contiguous()  # a strided tensor may flatten to a strided view: _rows reads runs
            if dtype is not None and dtype != t.dtype:
                t = t.to(dtype)
            bits = _bits(t)
            for start in range(0, n, _BLOCK):
                pieces += _rows(share, bits, bits.storage_offset() + start, min(_BLOCK, n - start), seed, 1, start)
        for (_, _, cols), group in small.items():
            for batch in _batches(group, lambda item: item[1].numel()):
                flat = _flatten_dense_tensors([t for _, t, _, _ in batch])
                if dtype is not None and dtype != flat.dtype:
                    flat = flat.to(dtype)
                _hash_rows(_block(flat, (-1, cols)),
                           [(share, (rows, cols), seed, (cols, 1), 0) for share, _, seed, rows in batch])
        _hash(pieces)
    return out


def _rows(share: "Pending", bits: torch.Tensor, at: int, n: int, seed: int, step: int, offset: int) -> list:
    """``n`` values that lie in one run of memory from storage offset ``at`` of ``bits`` (their raw bits), at HF flat
    indices ``offset + i * step``, as :func:`_hash` pieces: rows of _COLS (many rows keep every thread of the kernel
    busy), then the rest as one row; one ``as_strided`` each."""
    rows, rest = divmod(n, _COLS)
    out = []
    if rows:
        out.append((share, bits.as_strided((rows, _COLS), (_COLS, 1), at), seed, (_COLS * step, step), offset))
    if rest:
        out.append((share, bits.as_strided((1, rest), (rest, 1), at + rows * _COLS), seed, (0, step),
                    offset + rows * _COLS * step))
    return out


def tensor_fingerprint(name: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> "NameSum":
    """:func:`tensor_share` read to the host."""
    return read_shares({name: tensor_share(name, tensor, dtype)})[name]


# ---------------------------------------------------------------- engine side


class _Copy(NamedTuple):
    """One recorded ``copy_``: a view of HF tensor ``name`` landed in a view of a parameter. (A tuple: one is made per
    copy of a full sync, ~19k of them for a MoE model.)"""

    param: torch.Tensor
    dst: Tuple[Tuple[int, ...], Tuple[int, ...], int]  # sizes, strides, storage offset (elements)
    src: Tuple[Tuple[int, ...], Tuple[int, ...], int]  # the same, in the HF tensor's flat index
    ptr: int  # the param's data_ptr when the full sync began (a later ``param.data = ...`` makes the views stale)


class FingerprintRecorder:
    """Records, while a full sync runs ``load_weights``, where each HF tensor's elements land."""

    def __init__(self, params: Iterable[torch.Tensor]):
        params = list(params)
        self._params = self._ranges((p.data_ptr(), p.nbytes, p) for p in params)  # items: (start, param)
        self._layout = [(id(p), p.data_ptr()) for p in params]
        self._sources = self._ranges(())
        self._joined: Dict[int, Tuple[torch.Tensor, int, list]] = {}  # cat of source views: ptr -> (out, dim, parts)
        self.copies: Dict[str, List[_Copy]] = {}
        self.unexplained: Optional[str] = None  # the first write into the model that no recorded copy explains

    def wrote_only_copies(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether every write of the full sync into the model was a recorded view copy (or a zero fill), and no param
        or buffer was replaced or added (``param.data = t``, a new ``Parameter``): then a name without copies wrote
        nothing on this rank."""
        return self.unexplained is None and [(id(p), p.data_ptr()) for p in params] == self._layout

    @staticmethod
    def _ranges(items) -> RangeIndex:
        """Rows ``(start, nbytes, *rest)``; each item is ``(start, *rest)``: a copy reads its owner's start from the
        index, not from the tensor again (each tensor attribute read costs about a microsecond, ~19k per sync)."""
        return RangeIndex((ptr, ptr + nbytes, (ptr, *rest)) for ptr, nbytes, *rest in items)

    def sources(self, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """The HF tensors handed to the next ``load_weights`` call."""
        self._sources = self._ranges((t.data_ptr(), t.nbytes, n, t.dtype, t.element_size(), t) for n, t in named)
        # items end with the tensor, held (unread) like the cat outputs: a freed source's address could come back
        self._joined = {}  # held until the next chunk: a freed cat output's address could come back

    def _view_of_source(self, t: torch.Tensor, ptr: int, shape):
        """(name, (sizes, strides, flat offset)) when ``t`` (at ``ptr``, of ``shape``) is a view of one source of this
        chunk."""
        source = self._sources.find(ptr)
        if source is None or t.dtype != source[2]:
            return None
        start, name, _, size, _ = source
        return name, (shape, t.stride(), (ptr - start) // size)

    def joined(self, out: torch.Tensor, parts: Sequence[torch.Tensor], dim: int) -> None:
        """``out = torch.cat(parts, dim)``: a loader fusing HF tensors before one copy (DeepSeek's
        ``fused_qkv_a_proj_with_mqa``). When every part is a view of a source, a later copy of ``out`` is
        recorded as one view copy per part."""
        views = [self._view_of_source(p, p.data_ptr(), tuple(p.shape)) if p.numel() else None for p in parts]
        if out.numel() and all(views) and out.is_contiguous():
            dim, starts = dim % out.dim(), [0]
            for p in parts:
                starts.append(starts[-1] + p.shape[dim])
            self._joined[out.data_ptr()] = (out, dim, [(v, a, b - a) for v, a, b in zip(views, starts, starts[1:])])

    def observe(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Record ``dst.copy_(src)`` if it copies a view of a source (or a cat of such views) into a param;
        True when recorded. Runs once per copy of a full sync: each tensor attribute is read once."""
        if not isinstance(src, torch.Tensor):
            return False
        owner = self._params.find(dst.data_ptr())
        shape = dst.shape
        if owner is None or shape != src.shape or not dst.numel():
            return False
        ptr = src.data_ptr()
        start, param = owner  # the param's start when the full sync began: Direct.of sees a replaced one
        joined = self._joined.get(ptr) if self._joined else None
        if joined is not None and self._observe_joined(dst, src, joined, param, start):
            return True
        view = self._view_of_source(src, ptr, shape)
        if view is None:
            return False
        entry = _Copy(param, (shape, dst.stride(), dst.storage_offset()), view[1], start)
        entries = self.copies.get(view[0])
        if entries is None:
            self.copies[view[0]] = [entry]
        else:
            entries.append(entry)
        return True

    def _observe_joined(self, dst: torch.Tensor, src: torch.Tensor, joined, param: torch.Tensor, start: int) -> bool:
        """:meth:`observe` of a copy from a recorded cat's output, as one view copy per part; False when ``src`` is
        not that output as recorded."""
        out, dim, parts = joined
        if out.shape != src.shape or out.stride() != src.stride() or out.dtype != src.dtype:
            return False
        for (name, geometry), at, n in parts:
            d = dst.narrow(dim, at, n)
            self.copies.setdefault(name, []).append(
                _Copy(param, (tuple(d.shape), tuple(d.stride()), d.storage_offset()), geometry, start))
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


def engine_shares(copies: Dict[str, List[_Copy]]) -> Dict[str, NameSum]:
    """This rank's share of every recorded name, read through the recorded views (one host read in all). A view that
    is one run of its param's memory (a whole expert of a fused MoE weight, a row shard) is cut into rows by one
    ``as_strided`` of the param's bits, made once per param; the others are copied into one run first."""
    pending: Dict[str, Pending] = {}
    pieces: list = []
    ints: Dict[int, torch.Tensor] = {}  # id(param) -> its bits
    for name, entries in copies.items():
        seed = name_seed(name)
        acc = pending[name] = Pending(dtype_to_str(entries[0].param.dtype))
        for c in entries:
            (dsz, dst, doff), (_, sst, soff) = c.dst, c.src  # equal sizes (observe checks)
            for sizes, dshift, sshift in _pieces(dsz, dst, sst):
                geometry = mix64.as_2d(sizes, sst, soff + sshift)
                if geometry is None:  # more than two dims that do not merge: hashed alone, eagerly
                    d = c.param.as_strided(sizes, dst, doff + dshift)
                    ks, k0 = mix64.fingerprint_keys(sst, soff + sshift, seed)
                    acc.add(mix64.view_sum(_block(d, (1, -1)).to(torch.int64).reshape(-1), sizes, ks, k0,
                                                    _mask(d)), sizes, sst, soff + sshift)
                    continue
                (rows, cols), s0, s1, off = geometry
                if _dense(sizes, dst):  # its values lie in one run of the param's memory: cut where they lie
                    bits = ints.get(id(c.param))
                    if bits is None:
                        bits = ints[id(c.param)] = _bits(c.param.detach())
                    at = doff + dshift
                else:  # a transposed or strided view: its bits copied into one run first
                    bits = _block(c.param.as_strided(sizes, dst, doff + dshift), (-1,)).contiguous()
                    at = bits.storage_offset()
                if rows > 1:
                    pieces.append((acc, bits.as_strided((rows, cols), (cols, 1), at), seed, (s0, s1), off))
                else:  # one long row: as the trainer's side cuts it
                    pieces += _rows(acc, bits, at, cols, seed, s1, off)
    _hash(pieces)
    return read_shares(pending)


def _dense(sizes, strides) -> bool:
    """Whether a view of these sizes and strides is one run of memory in its element order."""
    step = 1
    for n, st in zip(reversed(sizes), reversed(strides)):
        if n > 1 and st != step:
            return False
        step *= n
    return True


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
            if name not in tensors:  # hashed where it was found (a trainer's shard ranks), in its own dtype only
                uncovered.append(name)
                continue
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
