"""Where each element of a trainer rank's Megatron shard lands in the HF tensors the rollout engines load.

Derived from slime's own conversion, never re-implemented per model: every param's local shard is replaced by its
elements' ids, which go through slime's real ``all_gather_param`` and ``convert_to_hf``; where an id lands is where
that element lands. The ids travel as uint8 digits, one gather per digit, so a pass holds half the bytes of slime's
own bf16 gather of that param, and between passes only two bits per gathered element are kept:

1. the digit passes find the runs: HF positions whose id is their predecessor's plus one (digit by digit, the carry
   kept as a bit);
2. the same passes again read each run's first id, at its first position only;
3. a check pass sends a hash byte of every id and compares each HF position with the hash of the id its run says.

Runs in range and disjoint in id space make the targets a placement of distinct elements; the check pass rules out
arithmetic on the values (a shift, a scale). A conversion that is not a pure permutation (a cast, arithmetic, FP8
quantization where a scale block spans shards, an element placed twice) is detected and that param keeps the gather
path. Arithmetic that is the identity on every byte value (a multiple of 256 added) cannot show through byte ids.
Each pass works through the targets in blocks of a bounded number of elements.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core import mpu

from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
from slime.backends.megatron_utils.update_weight.common import all_gather_param, named_params_and_buffers
from slime.utils.delta_sync_args import shard_chunk_bytes

logger = logging.getLogger(__name__)

DIGIT = torch.uint8
_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "parallel_mode")
_RUN_BYTES = 32  # a run's row in the table (4 x int64): a map with more bytes of runs than the param's bf16 bytes
#                  (a transposing conversion: runs of one element) keeps the gather path
WORK_BYTES = 64  # at most this many bytes of temporaries per element of a working block, beside the gathers


def block_elements(args, gathered: int) -> int:
    """Elements a build works on at once for a param slime gathers to ``gathered`` elements: at most a 128th of the
    sharded sender's chunk (:func:`shard_chunk_bytes`) and a 512th of the param, so the block's temporaries stay
    within a 16th of slime's own bf16 gather of it whatever the chunk; at least 16 Ki; a multiple of 8 (the kept
    bits are packed by the byte)."""
    return max(1 << 14, min(shard_chunk_bytes(args) // 128, gathered // 512)) // 8 * 8


@dataclasses.dataclass
class ParamMap:
    """One Megatron param's local shard, mapped: ``runs[k] = (local start, target, hf start, length)``, sorted by
    local start; local elements in no run (vocab padding) reach no HF tensor. ``pure`` False: the gather path."""

    name: str
    shape: Tuple[int, ...]
    targets: List[Tuple[str, Tuple[int, ...]]]  # HF (name, shape)
    runs: torch.Tensor  # int64 [R, 4]
    pure: bool = True
    why: str = ""
    replicated: bool = False  # every rank of its TP group holds all of it (slime's gather returns it as is)

    def locate(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(target index, HF flat position, mapped mask) of sorted local flat ``positions``."""
        return locate(self.runs, positions)


def locate(runs: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor = None
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target, HF flat position, mapped mask) of ``positions`` through ``runs`` (sorted by local start; ``starts``:
    their first column, contiguous, when the caller keeps it): one search over the runs, no per-element host work.
    Positions in no run (vocab padding) are not mapped."""
    starts = runs[:, 0].contiguous() if starts is None else starts
    k = torch.searchsorted(starts, positions, right=True) - 1
    kc = k.clamp(min=0)
    mapped = (k >= 0) & (positions < starts[kc] + runs[kc, 3])
    return runs[kc, 1], runs[kc, 2] + positions - starts[kc], mapped


def _tp_rank(name: str) -> int:
    return mpu.get_expert_tensor_parallel_rank() if ".experts." in name else mpu.get_tensor_model_parallel_rank()


def _tp_size(name: str) -> int:
    return mpu.get_expert_tensor_parallel_world_size() if ".experts." in name \
        else mpu.get_tensor_model_parallel_world_size()


def _hash(ids: torch.Tensor) -> torch.Tensor:
    """A byte of each id that every byte value takes, for the check pass (exact in int64 below 2**47 ids)."""
    return (((ids * 40503) >> 7) & 255).to(DIGIT)


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """bool [m] -> uint8 [ceil(m / 8)], bit i of byte k: element 8k + i."""
    pad = torch.nn.functional.pad(bits.to(DIGIT), (0, -bits.numel() % 8)).view(-1, 8)
    return (pad << torch.arange(8, dtype=DIGIT, device=bits.device)).sum(1, dtype=DIGIT)


def _unpack(packed: torch.Tensor, m: int) -> torch.Tensor:
    return ((packed[:, None] >> torch.arange(8, dtype=DIGIT, device=packed.device)) & 1).view(-1)[:m].bool()


class _Pass:
    """One param through slime's gather and conversion with a uint8 fill of its ids (``fill(ids) -> uint8``)."""

    def __init__(self, args, model_name: str, name: str, param: torch.Tensor, qcfg, block: int):
        self.args, self.model_name, self.name, self.param, self.qcfg, self.block = \
            args, model_name, name, param, qcfg, block
        self.n, self.base = param.numel(), _tp_rank(name) * param.numel()
        self.targets: Optional[List[Tuple[str, Tuple[int, ...]]]] = None
        self.gathered = 0
        self.replicated = False

    def __call__(self, fill: Callable[[torch.Tensor], torch.Tensor]) -> List[torch.Tensor]:
        """The converted targets, flat (raises ``_Impure``)."""
        flat = torch.empty(self.n, dtype=DIGIT, device=self.param.device)
        for s in range(0, self.n, self.block):  # the ids exist a block at a time
            e = min(self.n, s + self.block)
            flat[s:e] = fill(torch.arange(self.base + s, self.base + e, dtype=torch.int64, device=flat.device))
        ids = torch.nn.Parameter(flat.view(self.param.shape), requires_grad=False)
        for a in _ATTRS:
            if hasattr(self.param, a):
                setattr(ids, a, getattr(self.param, a))
        full = all_gather_param(self.name, ids)
        self.gathered = full.numel()
        self.replicated = full.data_ptr() == ids.data_ptr() and full.shape == ids.shape
        try:
            hf = convert_to_hf(self.args, self.model_name, self.name, full, self.qcfg)
        except Exception as e:  # a converter that cannot take ids does arithmetic on them: not a permutation
            raise _Impure(f"conversion failed on ids: {e!r}", []) from None
        targets = [(n, tuple(t.shape)) for n, t in hf]
        if self.targets is None:
            self.targets = targets
        for n, t in hf:
            if t.dtype != DIGIT:
                raise _Impure(f"{n}: converted to {t.dtype}", targets)
        if targets != self.targets:
            raise _Impure("the conversion names other targets from one pass to the next", targets)
        return [t.detach().reshape(-1) for _, t in hf]


class _Impure(Exception):
    def __init__(self, why: str, targets):
        super().__init__(why)
        self.why, self.targets = why, targets


def _runs(run: _Pass, digits: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per target: (first HF position of each run, its first id). Passes 1 and 2 of the module docstring."""
    ok: List[torch.Tensor] = []  # per target, packed: position p's id is p-1's plus one, in the digits seen so far
    low: List[torch.Tensor] = []  # per target, packed: the digits seen so far of p's id are all zero (the carry)
    block = run.block
    for k in range(digits):
        outs = run(lambda ids, k=k: ((ids >> (8 * k)) & 255).to(DIGIT))
        for j, t in enumerate(outs):
            if k == 0:
                ok.append(torch.empty((t.numel() + 7) // 8, dtype=DIGIT, device=t.device))
                low.append(torch.empty_like(ok[-1]))
            for s in range(0, t.numel(), block):
                e = min(t.numel(), s + block)
                d = t[s:e].to(torch.int16)
                prev = torch.cat([d[:1] - 1, d[:-1]]) if s == 0 else t[s - 1:e - 1].to(torch.int16)
                bits = slice(s // 8, (e + 7) // 8)
                zero = d == 0
                if k == 0:
                    ok[j][bits] = _pack((d - prev - 1) % 256 == 0)
                    low[j][bits] = _pack(zero)
                else:
                    carry = _unpack(low[j][bits], e - s).to(torch.int16)
                    ok[j][bits] &= _pack((d - prev - carry) % 256 == 0)
                    low[j][bits] &= _pack(zero)
        del outs
    starts = []
    for j, packed in enumerate(ok):
        m = math.prod(run.targets[j][1])
        found = [torch.zeros(1, dtype=torch.int64, device=packed.device)] if m else []
        for s in range(0, m, block):
            e = min(m, s + block)
            breaks = (~_unpack(packed[s // 8:(e + 7) // 8], e - s)).nonzero().squeeze(1) + s
            found.append(breaks[breaks > 0])
        starts.append(torch.cat(found) if found else torch.zeros(0, dtype=torch.int64, device=packed.device))
    del ok, low
    total = sum(s.numel() for s in starts)
    if total * _RUN_BYTES > 2 * run.gathered and total > len(starts):
        raise _Impure(f"fragmented: {total} runs for {run.gathered} elements", run.targets)
    firsts = [torch.zeros_like(s) for s in starts]
    for k in range(digits):
        outs = run(lambda ids, k=k: ((ids >> (8 * k)) & 255).to(DIGIT))
        for j, t in enumerate(outs):
            firsts[j] |= t[starts[j]].to(torch.int64) << (8 * k)
        del outs
    return list(zip(starts, firsts))


def _check(run: _Pass, found: List[Tuple[torch.Tensor, torch.Tensor]], first: int, count: int) -> None:
    """Runs in ``[first, first + count)`` and disjoint (distinct elements); then pass 3: every position's hash byte."""
    sizes = [math.prod(shape) for _, shape in run.targets]
    lengths = [torch.diff(s, append=torch.tensor([m], device=s.device)) for (s, _), m in zip(found, sizes)]
    ids = torch.cat([f for _, f in found]) if found else torch.zeros(0, dtype=torch.int64)
    lens = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < first or int((ids + lens).max()) > first + count):
        raise _Impure("not a permutation (ids out of range)", run.targets)
    order = torch.argsort(ids)
    if ids.numel() > 1 and bool((ids[order][1:] < (ids + lens)[order][:-1]).any()):
        raise _Impure("an element lands in two places", run.targets)
    outs = run(_hash)
    for (starts, firsts), t in zip(found, outs):
        for s in range(0, t.numel(), run.block):
            pos = torch.arange(s, min(t.numel(), s + run.block), dtype=torch.int64, device=t.device)
            r = torch.searchsorted(starts, pos, right=True) - 1
            if not torch.equal(t[s:s + pos.numel()], _hash(firsts[r] + pos - starts[r])):
                raise _Impure("not a permutation (arithmetic on the ids)", run.targets)


def _map(args, model_name: str, name: str, param: torch.Tensor, qcfg) -> ParamMap:
    gathered = param.numel() * (_tp_size(name) if getattr(param, "tensor_model_parallel", False) else 1)
    run = _Pass(args, model_name, name, param, qcfg, block_elements(args, gathered))
    shape, n = tuple(param.shape), param.numel()
    empty = torch.zeros(0, 4, dtype=torch.int64)
    try:
        digits = max(1, ((_tp_size(name) * n - 1).bit_length() + 7) // 8)
        found = _runs(run, digits)
        first = run.base if run.replicated else 0  # a gathered param: every rank's ids, from rank 0's
        _check(run, found, first, run.gathered)
    except _Impure as e:
        return ParamMap(name, shape, e.targets, empty, False, e.why, run.replicated)
    rows = []
    for j, ((starts, firsts), (_, tshape)) in enumerate(zip(found, run.targets)):
        ends = torch.cat([starts[1:], torch.tensor([math.prod(tshape)], device=starts.device)])
        lo = firsts.clamp(min=run.base)
        hi = (firsts + ends - starts).clamp(max=run.base + n)
        mine = lo < hi  # the part of each run this rank holds
        rows.append(torch.stack([lo - run.base, torch.full_like(lo, j), starts + lo - firsts, hi - lo], 1)[mine])
    runs = torch.cat(rows).cpu() if rows else empty
    runs = runs[torch.argsort(runs[:, 0])] if runs.numel() else empty
    return ParamMap(name, shape, run.targets, runs, replicated=run.replicated)


def build_shard_maps(args, model, model_name: str, quantization_config=None) -> Dict[str, ParamMap]:
    """Every local param's map, through slime's own gather and conversion (collective: every rank of the stage
    calls it, in the same param order, as slime's own update does). Rebuild after each full sync and whenever a
    shape changes. Working blocks: :func:`block_elements`."""
    maps: Dict[str, ParamMap] = {}
    with torch.no_grad():
        for name, param in named_params_and_buffers(args, model):
            maps[name] = _map(args, model_name, name, param, quantization_config)
    impure = [m for m in maps.values() if not m.pure]
    if impure:
        logger.warning("%d param(s) keep slime's gather path (their conversion is not a permutation), e.g. %s: %s",
                       len(impure), impure[0].name, impure[0].why)
    return maps
