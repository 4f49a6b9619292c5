"""Where each element of a trainer rank's Megatron shard lands in the HF tensors the rollout engines load.

Derived from slime's own conversion, never re-implemented per model: every param's local shard is replaced by a
tensor of element ids (float64: integers are exact below 2**53), which goes through slime's real ``all_gather_param``
and ``convert_to_hf``; where an id lands is where that element lands. The result is kept as runs (local start, HF
target, HF start, length), so a rank turns the positions it changed into HF names and positions without gathering
anything. A conversion that is not a pure permutation of elements (arithmetic, a cast, FP8 quantization where a scale
block spans shards, an element placed twice) is detected here and that param keeps slime's gather path.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Dict, List, Tuple

import torch
from megatron.core import mpu

from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
from slime.backends.megatron_utils.update_weight.common import all_gather_param, named_params_and_buffers

logger = logging.getLogger(__name__)

IDS = torch.float64
_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "parallel_mode")


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


def _id_param(name: str, param: torch.Tensor) -> torch.nn.Parameter:
    """The param's shard as element ids (this rank's offset in its TP group first), with the attributes slime's
    gather reads."""
    n = param.numel()
    ids = torch.nn.Parameter((torch.arange(n, dtype=IDS, device=param.device) + _tp_rank(name) * n).view(param.shape),
                             requires_grad=False)
    for a in _ATTRS:
        if hasattr(param, a):
            setattr(ids, a, getattr(param, a))
    return ids


def _invert(name: str, shape, offset: int, ids: Tuple[int, int], hf: List[Tuple[str, torch.Tensor]]) -> ParamMap:
    """Runs from the converted id tensors. Impure when a target lost the ids' dtype, or the targets together hold
    anything but distinct ids of the gathered param (``ids``: its first id and count): a non-integer, an id out of
    range (an integral shift or scale), an id placed twice (checked over every rank's ids, not only this rank's)."""
    targets = [(n, tuple(t.shape)) for n, t in hf]
    empty = torch.zeros(0, 4, dtype=torch.int64)
    n = math.prod(shape)
    for hf_name, t in hf:
        if t.dtype != IDS:
            return ParamMap(name, tuple(shape), targets, empty, False, f"{hf_name}: converted to {t.dtype}")
    every = torch.cat([t.detach().reshape(-1) for _, t in hf]) if hf else torch.zeros(0, dtype=IDS)
    if not bool(torch.equal(every, every.round())):
        return ParamMap(name, tuple(shape), targets, empty, False, "not a permutation (arithmetic on the ids)")
    every = torch.sort(every.to(torch.int64)).values
    if every.numel() and (int(every[0]) < ids[0] or int(every[-1]) >= ids[0] + ids[1]):
        return ParamMap(name, tuple(shape), targets, empty, False, "not a permutation (ids out of range)")
    if every.numel() > 1 and bool((every[1:] == every[:-1]).any()):
        return ParamMap(name, tuple(shape), targets, empty, False, "an element lands in two places")
    locs, tgts, hfs = [], [], []
    for j, (hf_name, t) in enumerate(hf):
        local = t.detach().reshape(-1).to(torch.int64) - offset
        mine = ((local >= 0) & (local < n)).nonzero().squeeze(1)
        locs.append(local[mine])
        hfs.append(mine)
        tgts.append(torch.full_like(mine, j))
    loc, tgt, hpos = torch.cat(locs), torch.cat(tgts), torch.cat(hfs)
    order = torch.argsort(loc)
    loc, tgt, hpos = loc[order], tgt[order], hpos[order]
    if not loc.numel():
        return ParamMap(name, tuple(shape), targets, empty)
    step = (loc[1:] == loc[:-1] + 1) & (hpos[1:] == hpos[:-1] + 1) & (tgt[1:] == tgt[:-1])
    first = torch.cat([torch.ones(1, dtype=torch.bool), ~step]).nonzero().squeeze(1)
    lengths = torch.diff(torch.cat([first, torch.tensor([loc.numel()])]))
    runs = torch.stack([loc[first], tgt[first], hpos[first], lengths], dim=1)
    return ParamMap(name, tuple(shape), targets, runs)


def build_shard_maps(args, model, model_name: str, quantization_config=None) -> Dict[str, ParamMap]:
    """Every local param's map, through slime's own gather and conversion (collective: every rank of the stage
    calls it, in the same param order, as slime's own update does). Rebuild after each full sync and whenever a
    shape changes."""
    maps: Dict[str, ParamMap] = {}
    with torch.no_grad():
        for name, param in named_params_and_buffers(args, model):
            ids = _id_param(name, param)
            full = all_gather_param(name, ids)
            offset = _tp_rank(name) * param.numel()
            try:
                hf = convert_to_hf(args, model_name, name, full, quantization_config)
            except Exception as e:  # a converter that cannot take ids does arithmetic on them: not a permutation
                maps[name] = ParamMap(name, tuple(param.shape), [], torch.zeros(0, 4, dtype=torch.int64), False,
                                      f"conversion failed on ids: {e!r}")
                continue
            first = int(full.min()) if full.numel() else 0  # the gathered ids: a contiguous range
            maps[name] = _invert(name, tuple(param.shape), offset, (first, full.numel()), hf)
            maps[name].replicated = full.data_ptr() == ids.data_ptr() and full.shape == ids.shape
    impure = [m for m in maps.values() if not m.pure]
    if impure:
        logger.warning("%d param(s) keep slime's gather path (their conversion is not a permutation), e.g. %s: %s",
                       len(impure), impure[0].name, impure[0].why)
    return maps

