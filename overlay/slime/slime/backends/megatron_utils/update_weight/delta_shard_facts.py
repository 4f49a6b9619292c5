"""``xor_ctx`` with the sharded sender: a change is coded by its rank among the elements of its class (its segment's
elements with its base exponent), and no trainer rank holds a param's whole base. In an aligned space (every param
starts a segment) a class lies in one param, so the stage's ranks find each change's rank and class size together:
the source broadcasts the changes (positions and base values) in batches, every rank counts what it holds of each
change's class and segment (one sort of its owned elements), and a sum reduces the counts to the source. The bases
never move; what travels is O(changed), and each rank's pass over its own slices is O(model / ranks).

The segment counts check the ranks' maps: every element of a changed segment must be held by exactly one rank, or
no change of the sync is sent (every rank raises, as for a failed diff).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from sglang.srt.weight_sync.delta import ctx
from sglang.srt.weight_sync.delta.diff import Prediffed
from sglang.srt.weight_sync.delta.ops import host_values, repeat_counts, to_device
from slime.backends.megatron_utils.update_weight.delta_shard_diff import ShardDiffer

_PER_CHANGE = 128  # bytes a change of a batch holds on every rank: positions, base, counts and the searches


def find_facts(differ: ShardDiffer, found: Optional[Sequence[Prediffed]], src: int, group, data_group,
               seg_log2: int, device: torch.device) -> Tuple[Optional[str], int]:
    """Every rank of the stage: the facts of the changes the source ``found`` (its Prediffed, None elsewhere) go to
    their runs, in batches of at most a 128th of the differ's chunk in changes. Returns on the source why a
    changed segment is not covered once by the ranks (None when it is), and on every rank the bytes it took part
    in moving (each batch's broadcast and its counts' reduce)."""
    me = dist.get_rank()
    plan = None
    if me == src:
        plan = [(str(p.run.values.dtype).removeprefix("torch."), p.names, [int(np.prod(s)) for s in p.shapes],
                 list(p.run.counts)) for p in found]
    box = [plan]
    dist.broadcast_object_list(box, src=src, group=group)
    batch = max(1, differ.chunk_bytes // _PER_CHANGE)
    wrong, moved = None, 0
    for k, (dtype, names, numels, counts) in enumerate(box[0]):
        dt = getattr(torch, dtype)
        offs = ctx.aligned_starts(numels, seg_log2)
        ends = np.cumsum(counts)
        total = int(ends[-1]) if len(ends) else 0
        if me == src:
            run = found[k].run
            idx = run.idx.to(device)
            qx = idx + repeat_counts(to_device(offs[:-1], device), counts)
            qbase = run.olds.to(device)
        rows = []
        for a in range(0, total, batch):
            b = min(total, a + batch)
            n = b - a
            if me == src:  # one broadcast of bytes per batch: the positions, then the base values
                wire = torch.cat([qx[a:b].view(torch.uint8), qbase[a:b].reshape(-1).view(torch.uint8)])
            else:
                wire = torch.empty(n * (8 + dt.itemsize), dtype=torch.uint8, device=device)
            dist.broadcast(wire, src, group=data_group)
            q, qb = wire[:n * 8].view(torch.int64), wire[n * 8:].view(dt)
            j0, j1 = int(np.searchsorted(ends, a, side="right")), int(np.searchsorted(ends, b - 1, side="right"))
            part = differ.held_counts({names[j]: int(offs[j]) for j in range(j0, j1 + 1)}, q, qb, seg_log2)
            moved += wire.numel() + part.numel() * part.element_size()
            dist.reduce(part, src, group=data_group)
            if me == src:
                rows.append(part)
        if me == src and total:
            rows = torch.cat(rows, dim=1)
            wrong = wrong or _uncovered(names, numels, counts, idx, rows[2], seg_log2)
            found[k].run.facts = rows[:2].clone()
    return wrong, moved


def _uncovered(names: List[str], numels: List[int], counts: List[int], idx: torch.Tensor, held: torch.Tensor,
               seg_log2: int) -> Optional[str]:
    """Why some change's segment is not held once by the ranks together (its length against their count)."""
    n = repeat_counts(to_device(numels, idx.device), counts)
    seg = idx >> seg_log2
    length = torch.clamp(n - (seg << seg_log2), max=1 << seg_log2)
    bad = host_values(torch.nonzero(held != length)[:1, 0])  # the one host read when every segment is held once
    if not bad:
        return None
    i = bad[0]
    got, at, want = host_values(torch.stack([held[i].long(), seg[i], length[i]]))
    j = int(np.searchsorted(np.cumsum(counts), i, side="right"))
    return f"the trainer ranks hold {got} elements of segment {at} of {names[j]} together, not its {want}: their " \
        "shard maps do not cover it once"
