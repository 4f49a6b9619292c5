"""``--update-weight-delta-sharded``: every trainer rank of a pipeline stage diffs the slice of its own shard it owns
and sends the stage's source rank only what changed; no rank holds or scans the whole stage.

The source rank's :class:`~sglang.srt.weight_sync.delta.sender.DeltaSender` still decides every sync. Its decision
reaches the stage's ranks at the start of the sync (:meth:`ShardedSync.plan`): while the slices hold the base of
the engines that take a delta, the ranks diff them and the source yields the changes as found elsewhere; a sync that
gives some engine a full sync (or the first, one after an unacknowledged full sync, one after a rank found a map that
no longer fits its param) also gathers every param as slime does, for the full targets only, and rebuilds the shard
maps; any other sync gathers only the params whose conversion is not a permutation (``delta_shard_map``). After the
sync the outcome reaches them too (:meth:`ShardedSync.settle`): seed the snapshots, commit the diff, or keep its
positions staged; so ack before advance holds on every rank.
"""

from __future__ import annotations

import logging
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import mpu

from sglang.srt.weight_sync.delta.diff import Prediffed
from sglang.srt.weight_sync.delta.wire import DeltaEncoding
from slime.backends.megatron_utils.update_weight.delta_shard_diff import ShardDiffer, StaleShardMap
from slime.backends.megatron_utils.update_weight.delta_shard_rounds import MERGE_BYTES, data_device, send_changes
from slime.backends.megatron_utils.update_weight.delta_shard_facts import find_facts
from slime.backends.megatron_utils.update_weight.delta_shard_map import build_shard_maps
from slime.utils.delta_sync_args import shard_chunk_bytes
from slime.utils.distributed_utils import get_gloo_group

logger = logging.getLogger(__name__)

_OUTCOMES = ("seed", "drop", "commit", "stage")


class ShardDiffFailed(RuntimeError):
    """Some trainer rank could not find its changes: raised on every rank of every stage, before any byte moves."""


def stage_groups(source: bool) -> Tuple[object, object, int]:
    """(gloo group, data group, source's global rank) of this rank's pipeline stage (collective: every rank creates
    every stage's groups, in stage order). The data group is the default backend's (NCCL on GPUs): the changed
    bytes go device to device; the gloo one carries the small decisions."""
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    me = torch.tensor([pp_rank, int(source)], dtype=torch.int64)
    every = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, me, group=get_gloo_group())
    mine = None
    for stage in range(mpu.get_pipeline_model_parallel_world_size()):
        ranks = [r for r, t in enumerate(every) if int(t[0]) == stage]
        sources = [r for r in ranks if int(every[r][1])]
        if len(sources) != 1:
            raise RuntimeError(f"pipeline stage {stage} has source ranks {sources}, not one")
        gloo = dist.new_group(ranks, backend="gloo")
        data = dist.new_group(ranks) if dist.get_backend() != "gloo" else gloo
        if stage == pp_rank:
            mine = (gloo, data, sources[0])
    return mine


class ShardedSync:
    """One rank's part of sharded delta syncs: its shard maps and :class:`ShardDiffer`, and the stage's decisions."""

    def __init__(self, args, model, model_name: str, quantization_config, source: bool):
        self.args, self.model, self.model_name = args, model, model_name
        self.qcfg, self.source = quantization_config, source
        self.group, self.data_group, self.src = stage_groups(source)
        self.differ: Optional[ShardDiffer] = None
        self.seeded = False
        self.impure: frozenset = frozenset()  # Megatron names that keep slime's gather path
        self.last: Optional[dict] = None  # this pass's plan
        self.sent_bytes = 0
        self.facts_bytes = 0  # xor_ctx: what this rank's part of the facts' exchange moved, the last sync
        self._warned: set = set()  # names a round was once raised for (a piece with more changes than a round)

    def _share(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def plan(self, sender) -> dict:
        """The source's decision for this sync, on every rank of the stage: whether the ranks diff their slices (some
        engine or a version store takes a delta and the slices hold its base), whether it gathers every param (some engine gets a full
        sync, or the slices hold no base), checks fingerprints, sends xor bases, finds ``xor_ctx``'s facts in the
        segments its flushes code in (``sender``: the source's, inside its sync; None elsewhere)."""
        mine = None
        if self.source:
            run = sender.run
            ctx_on = run.encodings.get("delta") == DeltaEncoding.XOR_CTX.value and "delta" in run.buckets
            mine = {"diff": "delta" in run.buckets and self.seeded, "gather": run.gathers or not self.seeded,
                    "fingerprint": run.fingerprints is not None,
                    "xor": run.encodings.get("delta") == DeltaEncoding.XOR_ZSTD.value, "ctx": ctx_on,
                    # the segments the flushes will code in (the bucket's bound may be below the buffer)
                    "seg_log2": run.buckets["delta"].seg_log2 if ctx_on else None,
                    # names never split over rounds: an engine's loader takes them whole, or none is written
                    # through views; None: some engine writes some name through its loader, so none is split
                    "whole": sorted(run.dense | run.xor_raw)
                    if all(sender.status[i].xor for i in run.targets["delta"]) else None}
        self.last = self._share(mine)
        return self.last

    def start(self, params: Sequence[Tuple[str, torch.Tensor]], sender) -> Iterator[Prediffed]:
        """A sync's first steps on every rank of the stage: the source's plan; this rank's changes, which the source
        yields as found elsewhere (for the engines that take a delta); new maps on a gathering sync (after the diff:
        it reads the slices of the old ones)."""
        plan = self.plan(sender)
        if plan["diff"]:
            yield from self.found(params, sender)
        if plan["gather"]:
            self.rebuild(params, sender)

    def rebuild(self, params: Sequence[Tuple[str, torch.Tensor]], sender) -> None:
        """New shard maps through slime's own conversion (a gather sync: shapes may have changed); a param is
        pure only if it is so on every rank of the stage (a rank whose map disagrees sends it the gather way). The
        source's sender stops keeping a snapshot of what the ranks now keep."""
        maps = build_shard_maps(self.args, self.model, self.model_name, self.qcfg)
        pure = torch.tensor([int(maps[n].pure) for n, _ in params], dtype=torch.int64)
        dist.all_reduce(pure, op=dist.ReduceOp.MIN, group=self.group)
        for (name, _), ok in zip(params, pure.tolist()):
            if not ok and maps[name].pure:
                maps[name].pure, maps[name].why = False, "impure on another rank of the stage"
        self.impure = frozenset(n for n, m in maps.items() if not m.pure)
        self.differ = ShardDiffer(maps, shard_chunk_bytes(self.args))
        names = ({hf for m in maps.values() if m.pure for hf, _ in m.targets},
                 {hf for m in maps.values() if not m.pure for hf, _ in m.targets})
        every = [None] * dist.get_world_size(self.group)  # other EP ranks' experts too
        dist.all_gather_object(every, names, group=self.group)
        pure, impure = set().union(*(p for p, _ in every)), set().union(*(i for _, i in every))
        if pure & impure:
            raise RuntimeError(f"HF names filled by a pure and an impure param: {sorted(pure & impure)[:3]}")
        if self.source:
            sender.state.keep_elsewhere(pure)
        if self.impure:
            logger.warning("sharded delta sync: %d param(s) keep slime's gather path, e.g. %s", len(self.impure),
                           sorted(self.impure)[:3])

    def found(self, params: Sequence[Tuple[str, torch.Tensor]], sender=None) -> Iterator[Prediffed]:
        """This rank's changes (and fingerprint shares, when the plan checks them) to the source, round by round
        (:func:`send_changes`: the source holds one round, never the stage's whole change): what the source yields
        as found elsewhere (nothing on the other ranks); with ``xor_ctx`` each round's facts too (:func:`find_facts`).
        A rank that cannot diff fails the sync on every rank before a byte moves; a round whose facts fail ends the
        stage's rounds there, and the sync then fails on every rank of every stage (the engines never commit it)."""
        plan, error = self.last, None
        try:
            changes = self.differ.changes(params, olds=plan["xor"] or plan["ctx"])
            shares = self.differ.shares(params) if plan["fingerprint"] else None
        except Exception as e:  # every rank of every stage learns it here: no engine gets a byte of this sync
            logger.exception("sharded delta sync: this rank could not diff its shard")
            error = e
        failed = torch.tensor([0 if error is None else 2 if isinstance(error, StaleShardMap) else 1])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=get_gloo_group())  # the passes' barriers span the stages
        if int(failed) == 2:  # a map no longer fits its param on some rank: the next sync gathers and rebuilds
            self.seeded = False
        if int(failed):
            raise ShardDiffFailed(f"a trainer rank could not diff its shard{f': {error!r}' if error else ''}")
        sent, self.facts_bytes, error, failed = 0, 0, None, torch.tensor([0])
        limit = max(1, shard_chunk_bytes(self.args) // MERGE_BYTES)
        align = 1 << plan["seg_log2"] if plan["ctx"] else 1  # a segment's changes in one piece of a split name
        for out, n in send_changes(changes, self.src, self.group, self.data_group, shares, limit,
                                   None if plan["whole"] is None else frozenset(plan["whole"]), align,
                                   self._raised):
            sent += n
            error = self._facts(out, sender) if plan["ctx"] else None
            failed = torch.tensor([int(error is not None)])
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)  # the stage's ranks stop alike
            if int(failed):
                break
            yield from out or []
        total = torch.tensor([sent], dtype=torch.int64)
        dist.all_reduce(total, group=self.group)
        self.sent_bytes = int(total)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=get_gloo_group())  # every stage, once per sync
        if int(failed):
            raise ShardDiffFailed(f"the trainer ranks could not find the xor_ctx facts{f': {error}' if error else ''}")

    def _facts(self, out: Optional[List[Prediffed]], sender) -> Optional[str]:
        """``xor_ctx``: the source leaves out the changes it cannot code (steps of 0: re-sent positions back at the
        base), then every rank of the stage finds the facts of the rest. Why it failed on this rank (a rank's
        error, or on the source segments the ranks do not hold once together), or None."""
        try:
            if self.source:
                raw = sender.run.xor_raw
                for p in out:
                    if p.names:  # (a block of shares only has no changes)
                        p.run = p.run.moved([n in raw for n in p.names])
            wrong, moved = find_facts(self.differ, out, self.src, self.group, self.data_group,
                                      self.last["seg_log2"], data_device(self.data_group))
            self.facts_bytes += moved
            return wrong
        except Exception as e:  # noqa: BLE001 - every rank of every stage learns it in found()
            logger.exception("sharded delta sync: this rank could not find the xor_ctx facts of its shard")
            return repr(e)

    def _raised(self, name: str, changes: int, limit: int) -> None:
        """A piece with more changes than a round holds (a name an engine loads whole, or one position range of a
        split name) is a round alone: said once per name, on the source."""
        if self.source and name not in self._warned:
            self._warned.add(name)
            logger.warning("sharded delta sync: %s has %d changes in one piece, more than a round of %d "
                           "(--update-weight-delta-shard-chunk-bytes / %d B): its round is raised to hold them, and "
                           "the source holds about %d B for it", name, changes, limit, MERGE_BYTES,
                           2 * changes * MERGE_BYTES)

    def settle(self, sender) -> str:
        """After a sync's pass: the source's outcome on every rank — ``seed`` (a gather sync every engine took),
        ``drop`` (one some engine did not: the next gathers again), ``commit`` or ``stage`` (a sharded delta)."""
        outcome = None
        if self.source:
            acked = sender.state.version == sender.version
            outcome = ("seed" if acked else "drop") if self.last["gather"] else ("commit" if acked else "stage")
        outcome = self._share(outcome)
        if outcome not in _OUTCOMES:
            raise RuntimeError(f"unknown sharded sync outcome {outcome!r}")
        if outcome == "seed":
            from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers

            self.differ.seed(list(named_params_and_buffers(self.args, self.model)))
        elif outcome == "commit":
            self.differ.commit()
        elif outcome == "stage":
            self.differ.stage()
        self.seeded = outcome == "seed" or (self.seeded and outcome in ("commit", "stage"))
        return outcome

    def metrics(self) -> Dict[str, float]:
        p = "perf/update_weights_sharded_"
        return {p + "gather_params": float(len(self.impure)), p + "bytes_to_source": float(self.sent_bytes),
                p + "facts_bytes": float(self.facts_bytes),
                p + "snapshot_bytes": float(self.differ.snapshot_bytes if self.differ else 0)}
