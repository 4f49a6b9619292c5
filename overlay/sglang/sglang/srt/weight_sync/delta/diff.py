"""The sender's diff and encode: which elements of each param changed (bytes compared, no arithmetic), and a flush
made from what changed.

On every device the diff joins a batch of params per dtype and runs a constant number of ops and two host reads for
the batch, whatever its param count: a per-param op would be a kernel launch each, a per-param ``nonzero`` a host
synchronization each. Engines never import this module.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from sglang.srt.weight_sync.delta.ops import (
    INT_VIEW,
    gather,
    host_values,
    repeat_counts,
    shifted_cat,
    take,
    to_device,
)
from sglang.srt.weight_sync.delta.positions import encode_positions_many
from sglang.srt.weight_sync.delta.wire import (
    DeltaEncoding,
    DeltaError,
    DeltaParam,
    DeltaPayload,
    DeltaSpec,
    blob_sums,
    dtype_to_str,
    sparse_allowed,
)

def _cat(ts: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.cat`` of flat tensors that takes no tensor too; always new memory (a flush's blobs never alias what the
    sender keeps or the caller's tensors)."""
    if not ts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(list(ts))


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    """A diff compares like with like: the same shape and dtype on both sides, else a clear refusal."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise DeltaError(f"cannot diff {old.dtype} {list(old.shape)} against {new.dtype} {list(new.shape)}")


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions whose bytes differ (dtype-agnostic, no arithmetic: -0.0 vs 0.0 and NaN payloads count)."""
    _check_pair(old, new)
    iv = INT_VIEW[new.element_size()]
    a, b = old.detach().reshape(-1).view(iv), new.detach().reshape(-1).view(iv)
    return torch.nonzero(a != b).reshape(-1)


@dataclasses.dataclass
class ChangeRun:
    """What one diff found for params it compared together (``ks``: their indices among the pairs): each param's
    changed positions (from 0) and ``new``'s values there, joined in ``ks`` order, ``counts`` per param; ``olds``:
    ``old``'s values at the same positions (``xor_zstd``'s bases), when asked for. The sender keeps a run joined from
    diff to flush (:class:`FlushEntry`): cutting it per param costs a view each, and joining again a copy each."""

    ks: List[int]
    counts: List[int]
    idx: torch.Tensor
    values: torch.Tensor
    olds: Optional[torch.Tensor] = None
    facts: Optional[torch.Tensor] = None  # xor_ctx found elsewhere: per change its class rank and size (2 rows)

    @functools.cached_property
    def starts(self) -> List[int]:
        """Where each param's share begins in ``idx``/``values`` (one past the last at the end)."""
        return list(itertools.accumulate(self.counts, initial=0))

    def share(self, j: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The ``j``-th param's (positions, values, olds): views."""
        a, b = self.starts[j], self.starts[j + 1]
        return self.idx[a:b], self.values[a:b], None if self.olds is None else self.olds[a:b]

    def moved(self, zero: Sequence[bool]) -> "ChangeRun":
        """The run less the positions whose new bytes equal the base (``olds``; zero for a param flagged in
        ``zero``): a position an unacknowledged sync sent that is back at the base, which ``xor_ctx`` (a step from
        the base, never 0) cannot carry and an engine at the base does not need. One host read."""
        iv = INT_VIEW[self.values.element_size()]
        dev = self.values.device
        ids = repeat_counts(torch.arange(len(self.counts), device=dev), self.counts)
        olds = self.olds.view(iv)
        if any(zero):
            olds = torch.where(to_device(list(map(int, zero)), dev).bool()[ids], torch.zeros_like(olds), olds)
        keep = self.values.view(iv) != olds
        counts = host_values(torch.zeros(len(self.counts), dtype=torch.int64, device=dev).index_add_(0, ids,
                                                                                                   keep.long()))
        return ChangeRun(self.ks, counts, self.idx[keep], self.values[keep], self.olds[keep])


@dataclasses.dataclass
class Prediffed:
    """Changes of HF params found outside the sender (a trainer's ranks diff their own shards), which the sender keeps
    no snapshot of: ``names`` with their ``shapes``, and ``run`` (its ``ks`` index ``names``, sorted positions and the
    new values; with ``xor_zstd`` base_version's values as ``olds``). ``shares``: their weight-fingerprint shares
    (name -> ``fingerprint.NameSum``), when the sync checks fingerprints. ``ranges``: a name whose changes come in
    pieces (one per Prediffed, in position order) -> the HF flat positions ``[lo, hi)`` this piece covers."""

    names: List[str]
    shapes: List[List[int]]
    run: ChangeRun
    shares: Optional[dict] = None
    ranges: Optional[Dict[str, Tuple[int, int]]] = None


_SHAPE, _DTYPE, _NBYTES = operator.attrgetter("shape"), operator.attrgetter("dtype"), operator.attrgetter("nbytes")


def like_pairs(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> bool:
    """Whether each ``olds[k]`` has ``news[k]``'s shape and dtype, in C-level maps (a chunk of a MoE model holds
    thousands of tensors: a Python call per pair costs more than the diff of a small one)."""
    return list(map(_SHAPE, olds)) == list(map(_SHAPE, news)) and list(map(_DTYPE, olds)) == list(map(_DTYPE, news))


_JOIN_BYTES = 64 << 20  # device diff: params are compared joined in batches of about this many bytes per side


def changes_many(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                 extra: Optional[Sequence[Optional[torch.Tensor]]] = None, want_olds: bool = False,
                 alike: bool = False) -> List[ChangeRun]:
    """What changed in each ``(old, new)`` pair: the positions whose bytes differ, united with its ``extra``
    positions (sorted, unique), ``new``'s values there, and with ``want_olds`` ``old``'s (for ``xor_zstd``) — as
    :class:`ChangeRun` runs that cover every pair once. Per batch of params (:func:`_joined_diff`): a constant number of
    ops and two host reads, whatever the params' count — a per-param op is a kernel launch each, a per-param
    ``nonzero`` a host synchronization each. ``alike``: the caller found every pair alike in shape and dtype
    (:func:`like_pairs`)."""
    extra = list(extra) if extra is not None else [None] * len(pairs)
    if not pairs:
        return []
    olds, news = zip(*pairs)
    if not alike and not like_pairs(olds, news):
        for old, new in pairs:  # the first that differs, refused by name
            _check_pair(old, new)
    out: List[ChangeRun] = []
    ends = np.cumsum(np.fromiter(map(_NBYTES, news), dtype=np.int64, count=len(news)))
    start = 0
    while start < len(pairs):  # batches bound the joined copies' memory (a large param goes alone)
        stop = max(start + 1, int(np.searchsorted(ends, (ends[start - 1] if start else 0) + _JOIN_BYTES)) + 1)
        out += _joined_diff(pairs, list(range(start, min(stop, len(pairs)))), extra, want_olds)
        start = stop
    return out


def _joined(ts: Sequence[torch.Tensor], iv: torch.dtype) -> torch.Tensor:
    """Tensors of one dtype flat and joined, as same-width integers: a view where they already lie end to end in one
    storage (:func:`_adjacent`), else one C++ call for all of them (the flatten that PyTorch's and Megatron's
    bucketing use) — a flat integer view per tensor from Python costs three dispatched ops each, ~19k tensors per
    side on a MoE model."""
    if len(ts) == 1:
        return ts[0].detach().reshape(-1).view(iv)
    run = _adjacent(ts)
    if run is not None:
        return run.view(iv)
    with torch.no_grad():
        return _flatten_dense_tensors(ts).view(iv)


def _adjacent(ts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """``ts`` (one dtype, none empty) as one flat view where each starts where the one before ends, inside the first
    one's storage: the sender's snapshot slabs hold a chunk's tensors so, and a loaded file or a bucketed param
    buffer often does. Joining them is then no copy (on the 30B-A3B topology the join was a quarter of the sender's
    per-tensor time). None otherwise."""
    first = ts[0]
    if ts[1].data_ptr() != first.data_ptr() + first.nbytes:  # separate allocations fail here, at no cost per tensor
        return None
    n = len(ts)
    ptrs = np.fromiter(map(torch.Tensor.data_ptr, ts), dtype=np.uint64, count=n)
    sizes = np.fromiter(map(torch.Tensor.numel, ts), dtype=np.int64, count=n)
    size = first.element_size()
    if not sizes.all() or not (np.diff(ptrs).astype(np.int64) == sizes[:-1] * size).all():
        return None
    if not all(map(torch.Tensor.is_contiguous, ts)):
        return None
    total, start = int(sizes.sum()), first.storage_offset()
    if (start + total) * size > first.untyped_storage().nbytes():
        return None
    return torch.as_strided(first.detach(), (total,), (1,), start)


def _joined_diff(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], batch: List[int],
                 extra: Sequence[Optional[torch.Tensor]], want_olds: bool) -> List[ChangeRun]:
    """The ``batch`` of :func:`changes_many` on a device. Per values dtype: the olds and the news joined, one compare,
    one gather of the new values at the hits (and of the old ones, ``want_olds``); for the batch: staged positions
    filled in with one scatter, one ``nonzero``, one host read of where each param's hits start. One :class:`ChangeRun`
    per dtype, cut from those, so no op runs per param."""
    device = pairs[batch[0]][1].device
    groups: Dict[torch.dtype, List[int]] = {}
    for k in batch:
        groups.setdefault(pairs[k][1].dtype, []).append(k)
    order = [k for ks in groups.values() for k in ks]  # params in the joined order
    masks, joined, starts = [], [], [0]
    for dtype, ks in groups.items():
        iv = INT_VIEW[dtype.itemsize]
        old, new = _joined([pairs[k][0] for k in ks], iv), _joined([pairs[k][1] for k in ks], iv)
        masks.append(old != new)
        joined.append((old, new))
        for k in ks:
            starts.append(starts[-1] + pairs[k][1].numel())
    mask = masks[0] if len(masks) == 1 else torch.cat(masks)
    staged = [(j, extra[k]) for j, k in enumerate(order) if extra[k] is not None and extra[k].numel()]
    if staged:  # positions an unacknowledged sync sent (kept on the host): carried again, whatever their bytes
        cpu = torch.device("cpu")
        at = shifted_cat([m.cpu() for _, m in staged], [starts[j] for j, _ in staged], cpu)
        mask.index_fill_(0, at.to(device, non_blocking=True), True)
    hits = mask.nonzero().reshape(-1)
    bounds = host_values(torch.searchsorted(hits, to_device(starts, device)))
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    local = hits - repeat_counts(to_device(starts[:-1], device), counts)
    out: List[ChangeRun] = []
    j = 0
    for (dtype, ks), (old, new) in zip(groups.items(), joined):
        lo, hi = bounds[j], bounds[j + len(ks)]
        at = hits[lo:hi] - starts[j]
        out.append(ChangeRun(ks, counts[j:j + len(ks)], local[lo:hi], take(new, at).view(dtype),
                         take(old, at).view(dtype) if want_olds else None))
        j += len(ks)
    return out


@dataclasses.dataclass
class FlushEntry:
    """Params of one dtype as a sender holds them until their flush: their changed positions and values only, joined
    (``idx`` None: dense, ``values`` the whole tensors) — never a reference to the whole tensor of a sparse param.
    A run of one diff's params stays one entry (views of its :class:`ChangeRun`), so a flush joins runs, not params."""

    names: List[str]
    shapes: List[List[int]]
    counts: List[int]  # values per param
    values: torch.Tensor  # flat, joined, in the params' dtype
    idx: Optional[torch.Tensor]  # joined, each param's own positions (from 0)
    base: Optional[torch.Tensor] = None  # xor_zstd: base_version's values beside ``values`` (xor_ctx: with facts)
    wholes: Optional[List[torch.Tensor]] = None  # xor_ctx: each param's whole base (references, not copies)
    facts: Optional[torch.Tensor] = None  # xor_ctx found elsewhere: class rank and size beside ``values`` (2 rows)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, idx: Optional[torch.Tensor],
           values: Optional[torch.Tensor] = None, base: Optional[torch.Tensor] = None,
           whole: Optional[torch.Tensor] = None) -> "FlushEntry":
        """One param; ``values``: ``tensor`` at ``idx``, when the caller already gathered them."""
        if idx is None or values is None:
            flat = tensor.detach().reshape(-1)
            values = flat if idx is None else gather(flat, idx)
        return cls([name], [list(tensor.shape)], [values.numel()], values, idx,
                   None if base is None else base.reshape(-1), None if whole is None else [whole.reshape(-1)])


def encode_flush(entries: Sequence[Tuple[str, torch.Tensor, Optional[torch.Tensor]]], encoding: str,
                 bases: Optional[Sequence[torch.Tensor]] = None, **spec_fields) -> DeltaPayload:
    """``[(hf_name, new_tensor, changed_positions or None for dense)]`` -> one flush (see :func:`encode_gathered`);
    ``bases``: per entry, for ``xor_zstd`` (its values' bases) or ``xor_ctx`` (its whole base)."""
    if bases is not None and len(bases) != len(entries):
        raise DeltaError("xor_zstd needs base_version's values of every param (bases)")
    bases = bases if bases is not None else [None] * len(entries)
    key = "whole" if DeltaEncoding(encoding) is DeltaEncoding.XOR_CTX else "base"
    return encode_gathered([FlushEntry.of(*e, **{key: b}) for e, b in zip(entries, bases)], encoding, **spec_fields)


def encode_gathered(items: Sequence[FlushEntry], encoding: str, sealed: bool = True, **spec_fields) -> DeltaPayload:
    """Params gathered as :class:`FlushEntry` -> one flush.

    All values must share one dtype (the sender groups by dtype); they are the tensors' own bytes, raw, so the
    receiver writes the trainer's exact bytes. ``xor_zstd`` needs every item's ``base``: base_version's values at
    its positions (gathered like the values). ``sealed=False``: only the blob sums, for a caller that sets more
    spec fields and then seals (``seal(spec_only=True)``) — the spec is serialized for the checksum once, not twice.
    """
    xor = DeltaEncoding(encoding) is DeltaEncoding.XOR_ZSTD
    if xor and any(g.base is None for g in items):
        raise DeltaError("xor_zstd needs base_version's values of every param (bases)")
    ctx = DeltaEncoding(encoding) is DeltaEncoding.XOR_CTX
    if ctx and any(g.facts is None and (g.wholes is None or len(g.wholes) != len(g.names)) for g in items):
        raise DeltaError("xor_ctx needs base_version's whole tensor of every param (wholes)")
    if ctx and any(g.facts is not None and (g.idx is None or g.base is None) for g in items):
        raise DeltaError("xor_ctx facts come with the changes' positions and base values")
    for g in items:  # the spec is made from counts the checksum then signs: a count off its blobs is caught here
        n = g.values.numel()
        if not len(g.names) == len(g.shapes) == len(g.counts):
            raise DeltaError(f"params {g.names[:3]}: {len(g.names)} names, {len(g.shapes)} shapes and "
                             f"{len(g.counts)} counts do not pair")
        if sum(g.counts) != n or any(t is not None and t.numel() != n for t in (g.idx, g.base)):
            raise DeltaError(f"params {g.names[:3]}: counts {sum(g.counts)}, values {n}, positions "
                             f"{None if g.idx is None else g.idx.numel()} and bases "
                             f"{None if g.base is None else g.base.numel()} do not pair")
    dtypes = {g.values.dtype for g in items}
    if len(dtypes) > 1:
        raise DeltaError(f"one flush holds one values dtype, got {sorted(map(dtype_to_str, dtypes))}")
    dtype = dtypes.pop() if dtypes else torch.bfloat16
    device = items[0].values.device if items else torch.device("cpu")
    name = dtype_to_str(dtype)
    sparse = [g for g in items if g.idx is not None]
    if sparse and not sparse_allowed(dtype):
        raise DeltaError(f"param {sparse[0].names[0]!r}: {name} params travel dense")
    positions, ranges = encode_positions_many([g.idx for g in sparse], encoding, device, [g.counts for g in sparse])
    rows, at, pos_at = [], 0, 0  # (pos_start, pos_end, pos_width) per param: items are runs, not params
    for g in items:
        k = len(g.names)
        if g.idx is None:  # a dense param has no positions: an empty range where the last sparse one ended
            rows += [(pos_at, pos_at, 0)] * k
        elif k:
            rows += ranges[at:at + k]
            at, pos_at = at + k, ranges[at + k - 1][1]
    counts = list(itertools.chain.from_iterable(g.counts for g in items))
    val_ends = list(itertools.accumulate(counts))
    params = list(itertools.starmap(DeltaParam, zip(
        itertools.chain.from_iterable(g.names for g in items), [name] * len(counts),
        itertools.chain.from_iterable(g.shapes for g in items), *(zip(*rows) if rows else ((), (), ())),
        [0, *val_ends][:-1], val_ends, strict=True)))
    values = _cat([g.values for g in items], dtype, device)
    base = None
    if xor:
        base = _cat([g.base.to(device) for g in items], dtype, device)
        if base.dtype != values.dtype:
            raise DeltaError(f"xor_zstd bases: {base.dtype} do not pair with the values {values.dtype}")
    spec = DeltaSpec(encoding=DeltaEncoding(encoding).value, params=params, **spec_fields)
    payload = DeltaPayload(spec, positions, values, base=base)
    if ctx:
        payload.wholes = list(itertools.chain.from_iterable(g.wholes or [None] * len(g.names) for g in items))
        payload.idx = torch.cat([g.idx for g in sparse]) if sparse else torch.zeros(0, dtype=torch.int64)
        if any(g.facts is not None for g in sparse):  # an aligned space: facts where the ranks found them
            payload.facts = (torch.cat([g.facts if g.facts is not None else g.idx.new_zeros(2, g.idx.numel())
                                        for g in sparse], dim=1),
                             torch.cat([g.base if g.facts is not None else g.values for g in sparse]))
    if not sealed:
        payload.sums = blob_sums(positions, values)
        return payload
    return payload.seal()
