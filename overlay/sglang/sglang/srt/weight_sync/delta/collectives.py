"""Bounded waits on weight-update broadcasts, for the sender and the engine alike.

``Work.wait()`` is no bound: on NCCL it only orders the current stream after the collective and
returns at once (a later host read then blocks for as long as a missing peer stays away), and on
gloo it waits for the group's timeout. Here a collective is polled with ``is_completed()`` —
non-blocking on both backends — until it completes, a deadline passes, or the caller learns that a
peer will never join (every engine already answered). A group whose collective was given up on is
aborted; its owner re-creates it before the next use. Also: the trainer's pipeline stages agreeing on a sync
(:class:`StageGroup`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

_POLL_S = 0.0005


class CollectiveStuck(RuntimeError):
    """A collective did not complete in time, or a peer will never join it; its group must be re-created."""


def await_collectives(works: Sequence, timeout_s: float, peers_gone: Optional[Callable[[], bool]] = None,
                      grace_s: float = 1.0) -> None:
    """Return once every work completed (re-raising its error); raise :class:`CollectiveStuck` at the deadline,
    or ``grace_s`` after ``peers_gone()`` first says that no peer is still on its way."""
    deadline = time.monotonic() + timeout_s
    gone_since = None
    while not all(w.is_completed() for w in works):
        now = time.monotonic()
        if peers_gone is not None and gone_since is None and peers_gone():
            gone_since = now
        if gone_since is not None and now - gone_since > grace_s:
            raise CollectiveStuck("every engine answered but the broadcast did not complete (a peer never joined it)")
        if now > deadline:
            raise CollectiveStuck(f"the broadcast did not complete within {timeout_s:g} s")
        time.sleep(_POLL_S)
    for w in works:
        w.wait()  # a failed collective raises its own error here


def group_named(name: str):
    """This process's group of that name, if any (re-creating a group needs the old one gone first)."""
    from torch.distributed import distributed_c10d as c10d

    return next((pg for pg, n in c10d._world.pg_names.items() if n == name), None)


def abort_group(group) -> None:
    """Tear a group down without waiting on its pending collectives (NCCL aborts its communicators; gloo's
    pending work ends at the group's own timeout). Never raises: the caller re-creates the group anyway."""
    if group is None:
        return
    try:
        from torch.distributed import distributed_c10d as c10d

        if hasattr(c10d, "_abort_process_group"):
            c10d._abort_process_group(group)
        elif hasattr(group, "abort"):
            group.abort()
    except Exception:  # a group that is already gone, or a backend without abort
        logger.warning("aborting a weight-update group failed; dropping it", exc_info=True)
    finally:
        try:
            torch.distributed.destroy_process_group(group)
        except Exception:
            pass


def tp_group():
    """This engine's tensor-parallel group coordinator, or None when this rank is the whole engine."""
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except Exception:  # no model-parallel world (a bare model)
        return None
    return group if group.world_size > 1 else None


def tp_agree(ok: bool, *same: int) -> bool:
    """True iff every tensor-parallel rank of this engine says ``ok`` and passes the same ``same`` integers
    (each rank runs every request, reading and checking on its own: one rank's unreadable file or failed
    write must stop all of them, not only itself)."""
    group = tp_group()
    if group is None:
        return ok
    verdict = torch.tensor([int(ok)] + [x for v in same for x in (v, -v)], dtype=torch.int64)
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    mins = verdict.tolist()
    return bool(mins[0]) and all(mins[k] == -mins[k + 1] for k in range(1, len(mins), 2))


def _json_bytes(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)


def _json_load(data: torch.Tensor):
    return json.loads(bytes(data.numpy()).decode())


def broadcast_json(group, obj=None):
    """The first rank's JSON-able ``obj`` on every rank of an SGLang group coordinator, as bytes over its CPU group
    (plain bytes, never an object); the other ranks pass nothing."""
    first = group.rank_in_group == 0
    data = _json_bytes(obj) if first else None
    size = torch.tensor([data.numel() if first else 0], dtype=torch.int64)
    torch.distributed.broadcast(size, src=group.first_rank, group=group.cpu_group)
    if not first:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    torch.distributed.broadcast(data, src=group.first_rank, group=group.cpu_group)
    return _json_load(data)


class StageGroup:
    """The source ranks of a trainer's pipeline stages, one sender each (every stage holds its own layers).

    Stage 0 decides for all (which engines get a full sync, the version, the encoding) and the others adopt it;
    an engine acknowledged a sync only if every stage's part of it was acknowledged. Small JSON objects travel over
    ``group`` (gloo, one rank per stage, in stage order); callers use it from one thread at a time.
    """

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    @property
    def first(self) -> bool:
        return self.rank == 0

    def exchange(self, obj) -> list:
        """Every stage's ``obj`` (JSON-able), in stage order, on every stage."""
        data = _json_bytes(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        torch.distributed.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=self.group)
        mine = torch.zeros(max(int(s[0]) for s in sizes), dtype=torch.uint8)
        mine[:data.numel()] = data
        bufs = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.all_gather(bufs, mine, group=self.group)
        return [_json_load(b[:int(s[0])]) for b, s in zip(bufs, sizes)]

    def share(self, obj):
        """Stage 0's ``obj`` on every stage."""
        return self.exchange(obj if self.first else None)[0]
