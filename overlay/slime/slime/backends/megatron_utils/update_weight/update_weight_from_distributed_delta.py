"""slime's sparse delta updater: the parent's gather + HF conversion feed the delta sender core.

``UpdateWeightFromDistributed`` already yields HF ``(name, tensor)`` chunks on the PP-source rank
(TP all-gather, EP gather, ``convert_to_hf``) and owns the ``slime-pp_{rank}`` group; this subclass
hands those chunks — cloned, since many are views of live params — to
``sglang.srt.weight_sync.delta.sender.DeltaSender`` over the NCCL group or a shared directory. The
sender commits its snapshot only after every engine acknowledged a sync (slime#2104) and gives a
dirty, timed-out or unreachable engine a full sync. Experts are published in ``_EXPERT_SUBPASSES``
segments so engines apply segment k while segment k+1 is encoded. With pipeline parallelism every stage's source
rank sends its own layers; stage 0 decides for all and, over disk, announces every stage's files in one request
per segment (``collectives.StageGroup``).
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager

import ray
import torch
import torch.distributed as dist
from megatron.core import mpu
from tqdm import tqdm

from slime.observability.timer import Timer
from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers
from slime.utils.delta_sync_args import with_delta_defaults
from slime.utils.distributed_utils import get_gloo_group
from sglang.srt.weight_sync.delta.collectives import StageGroup
from sglang.srt.weight_sync.delta.engine_api import DeltaEngine
from sglang.srt.weight_sync.delta.sender import _EXPERT_SUBPASSES, DeltaSender
from sglang.srt.weight_sync.delta.stage_first import Pauses
from sglang.srt.weight_sync.delta.store.manifest import StoreKey
from sglang.srt.weight_sync.delta.store.publish import NcclStoreTransport, StoreTransport
from sglang.srt.weight_sync.delta.transport import DiskTransport, NcclTransport
from sglang.srt.weight_sync.delta.wire import DeltaEncoding, DeltaStatus, zstd_level

from .delta_sharded import ShardDiffFailed, ShardedSync
from .update_weight_from_distributed import (
    UpdateWeightFromDistributed,
    connect_rollout_engines_from_distributed,
    disconnect_rollout_engines_from_distributed,
)

logger = logging.getLogger(__name__)


class _RayEngine(DeltaEngine):
    """The sender's engine interface over slime's ``SGLangEngine`` Ray actor."""

    def __init__(self, actor):
        self.actor = actor

    @staticmethod
    def _ack(ref) -> tuple[bool, str]:
        """(ok, message) of one request; what to do after a failure the sender reads from :meth:`status`."""
        try:
            out = ray.get(ref)
        except ray.exceptions.RayError as e:  # HTTP 400 (a refusal) or a dead server
            return False, str(e)[-2000:]
        if out is None:  # only node_rank 0 of a multi-node engine posts
            return True, ""
        return bool(out.get("success", True)), out.get("message", "")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, delta, weight_version):
        return self._ack(self.actor.update_weights_from_distributed.remote(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, weight_version=weight_version,
            load_format="delta", delta=delta))

    def update_weights_from_disk(self, model_path, files, weight_version, store=None):
        return self._ack(self.actor.update_weights_from_disk.remote(
            model_path, load_format="delta", weight_version=weight_version, files=files, store=store))

    def fingerprint(self):
        return ray.get(self.actor.check_weights.remote("delta_fingerprint"))["ranks"]

    def stage(self, request):
        return DeltaStatus.from_checker(ray.get(self.actor.check_weights.remote("delta_stage", delta=request))["ranks"])

    def status(self):
        return DeltaStatus.from_checker(ray.get(self.actor.check_weights.remote("delta_status"))["ranks"])


class UpdateWeightFromDistributedDelta(UpdateWeightFromDistributed):
    """``--update-weight-mode delta`` with our sparse encodings over ``--update-weight-transport nccl|disk``."""

    def __init__(self, args, model, weights_getter, *, model_name, quantization_config) -> None:
        method = (quantization_config or {}).get("quant_method")
        if method not in (None, "fp8"):  # FP8: slime's convert_to_hf quantizes, the engine checks its scheme
            raise ValueError(f"sparse delta sync serves bf16 and block-FP8 rollout engines, not {method!r} "
                             f"({quantization_config!r})")
        super().__init__(with_delta_defaults(args), model, weights_getter, model_name=model_name,
                         quantization_config=quantization_config)
        self._sender: DeltaSender | None = None
        self._disk = args.update_weight_transport == "disk"
        self._stages: StageGroup | None | bool = None  # False: created, and this rank is no stage's source
        self._sharded: ShardedSync | None = None  # --update-weight-delta-sharded: this rank's diff of its shard

    def connect_rollout_engines(self, rollout_engines, rollout_engine_lock, engine_gpu_counts=None,
                                engine_gpu_offsets=None, engine_parallel_configs=None) -> None:
        if self._disk:  # no device group: files on a shared directory, announced over HTTP
            self.rollout_engines, self.rollout_engine_lock = rollout_engines, rollout_engine_lock
            self._engine_gpu_counts = engine_gpu_counts
            self._is_pp_src_rank = (mpu.get_data_parallel_rank(with_context_parallel=True) == 0
                                    and mpu.get_tensor_model_parallel_rank() == 0)
            self._group_name = f"slime-pp_{mpu.get_pipeline_model_parallel_rank()}"
        else:
            super().connect_rollout_engines(rollout_engines, rollout_engine_lock, engine_gpu_counts,
                                            engine_gpu_offsets, engine_parallel_configs)
        stages = self._stage_group()
        if self.args.update_weight_delta_sharded and self._sharded is None:  # collective
            self._sharded = ShardedSync(self.args, self.model, self.model_name, self.quantization_config,
                                        self._is_pp_src_rank)
        if not self._is_pp_src_rank:
            return
        engines = [_RayEngine(e) for e in rollout_engines]
        store = self.args.update_weight_store
        level = self.args.update_weight_delta_zstd_level
        side = None
        if store:  # every sync a version of the store: late and restarted engines catch up from it
            side = StoreTransport(store, engines, stages=stages, key=StoreKey.from_file(
                                      self.args.update_weight_store_key_file), stage_timeout=self._stage_timeout(),
                                  # the store's files are compressed whatever the group carries
                                  zstd=zstd_level(self.args.update_weight_delta_encoding if self._disk
                                                  else DeltaEncoding.DELTAS_ZSTD.value, level),
                                  post_write_hook=self._post_write_hook() if self._disk else None,
                                  hf_dir=self.args.hf_checkpoint,
                                  head_refresh_s=self.args.update_weight_store_head_refresh_s)
        if self._disk:
            transport = side or DiskTransport(self.args.update_weight_disk_dir, engines, stages=stages,
                                              zstd=zstd_level(self.args.update_weight_delta_encoding, level),
                                              keep_files=self.args.update_weight_disk_keep_files,
                                              post_write_hook=self._post_write_hook(),
                                              stage_timeout=self._stage_timeout())
        else:
            group = dict(device=torch.device(torch.cuda.current_device()) if torch.cuda.is_available()
                         else torch.device("cpu"), reconnect=self._reconnect, guard=self._engine_lock)
            transport = NcclStoreTransport(self._model_update_groups, self._group_name, engines, side, **group) \
                if side is not None else NcclTransport(self._model_update_groups, self._group_name, engines, **group)
        if self._sender is not None:  # re-connected (an engine restarted, or after an offload): same snapshot
            self._sender.attach(transport, engines, stages)
            return
        self._sender = DeltaSender(transport, engines, encoding=self.args.update_weight_delta_encoding,
                                   buffer_bytes=self.args.update_weight_buffer_size,
                                   fingerprint_every=self.args.update_weight_delta_fingerprint_interval,
                                   stages=stages, repair_dirty=False,  # every rank repairs in step: _send_weights
                                   anchor_every=self.args.update_weight_store_anchor_every,
                                   draft_trained=bool(getattr(self.args, "enable_mtp_training", False)))
        self._sender.version = self.weight_version  # continue the engines' version chain

    def _stage_timeout(self) -> float:
        """Over disk (a directory or a store) the engines fetch a version while they generate (0: pause first)."""
        return float(self.args.update_weight_delta_stage_timeout) if self._disk else 0.0

    def _stage_group(self) -> StageGroup | None:
        """PP>1: a gloo group of the stages' source ranks, in stage order (``new_group`` is collective: every rank
        joins, once)."""
        pp = mpu.get_pipeline_model_parallel_world_size()
        if pp == 1:
            return None
        if self._stages is None:
            me = torch.tensor([int(self._is_pp_src_rank), mpu.get_pipeline_model_parallel_rank()], dtype=torch.int64)
            everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, me, group=get_gloo_group())
            sources = sorted((int(t[1]), rank) for rank, t in enumerate(everyone) if int(t[0]))
            ranks = [rank for _, rank in sources]
            if [stage for stage, _ in sources] != list(range(pp)) or ranks != sorted(ranks):
                raise RuntimeError(f"pipeline stage source ranks {sources} are not one per stage in rank order")
            group = dist.new_group(ranks, backend="gloo")
            self._stages = StageGroup(group, mpu.get_pipeline_model_parallel_rank(), pp) if self._is_pp_src_rank \
                else False
        return self._stages or None

    def _post_write_hook(self):
        path = getattr(self.args, "custom_update_weight_post_write_path", None)
        if not path:
            return None
        from slime.utils.misc import load_function

        hook = load_function(path)
        return lambda version_dir: hook(self.args, version_dir, self.rollout_engines)

    def _reconnect(self):
        """A failed broadcast leaves the group unusable: destroy and re-create it before the full re-sync."""
        try:
            disconnect_rollout_engines_from_distributed(self.args, self._group_name, self._model_update_groups,
                                                        self.rollout_engines)
        except Exception:
            logger.exception("destroying weight-update group %s failed; re-creating anyway", self._group_name)
        self._model_update_groups = connect_rollout_engines_from_distributed(
            self.args, self._group_name, self.rollout_engines, engine_gpu_counts=self._engine_gpu_counts)
        return self._model_update_groups

    @contextmanager
    def _engine_lock(self):
        while not ray.get(self.rollout_engine_lock.acquire.remote()):
            pass
        try:
            yield
        finally:
            ray.get(self.rollout_engine_lock.release.remote())

    @torch.no_grad()
    def update_weights(self) -> None:
        """The parent's pause → send → continue, pausing in ``--update-weight-pause-mode``. Only ``abort`` flushes
        before the sync; under ``retract``/``in_place`` requests wait in the engine (slime's flush would refuse),
        and the engine makes its prefix cache safe when the version commits (``delta.prefix_cache``)."""
        mode = self.args.update_weight_pause_mode
        if self._stage_timeout() > 0:
            return self._update_staged(mode)
        if mode == "abort":
            return super().update_weights()
        self.weight_version += 1
        if dist.get_rank() == 0:
            ray.get([engine.pause_generation.remote(mode) for engine in self.rollout_engines])
        dist.barrier(group=get_gloo_group())
        pbar = tqdm(desc=f"[{self._group_name}] Update weights", total=0) if self._is_pp_src_rank else None
        self._send_weights(pbar)
        if dist.get_rank() == 0:
            ray.get([engine.continue_generation.remote() for engine in self.rollout_engines])
        dist.barrier(group=get_gloo_group())

    def _update_staged(self, mode: str) -> None:
        """Stage, then commit: the sync runs while the engines generate and fetch each publish; rank 0 (stage 0's
        source, which announces) pauses them in ``mode`` only when the announcements are due (the transport's gate),
        and resumes them after the sync and any repair, or with a version store as soon as the engines pushed to
        took the version (the sender's release). ``abort`` flushes the cache as slime's own pause does."""
        self.weight_version += 1
        actors = self.rollout_engines

        def pause(engines):
            ray.get([actors[i].pause_generation.remote(mode) for i in engines])
            if mode == "abort":
                ray.get([actors[i].flush_cache.remote() for i in engines])
            return engines

        pauses = Pauses(len(actors), pause, lambda engines: ray.get([actors[i].continue_generation.remote()
                                                                     for i in engines]))
        sender = self._sender if self._sender is not None and dist.get_rank() == 0 else None
        if sender is not None:
            sender.transport.gate, sender.release = pauses.gate, pauses.release
        pbar = tqdm(desc=f"[{self._group_name}] Update weights", total=0) if self._is_pp_src_rank else None
        try:
            self._send_weights(pbar)
        finally:
            if sender is not None:
                sender.transport.gate, sender.release = None, None
            if dist.get_rank() == 0:  # paused by the gate and not yet released
                pauses.release()
        if pauses.seconds:  # how long generation stood still (rank 0)
            self.update_weight_metrics["perf/update_weights_pause_s"] = sum(pauses.seconds)
        dist.barrier(group=get_gloo_group())

    def disconnect_rollout_engines(self) -> None:
        if self._sender is not None:  # the sender (its snapshot) stays for the next connect
            self._sender.transport.close()
        if not self._disk:
            super().disconnect_rollout_engines()

    def _named_params(self):
        """The params the gather passes take: in a sharded delta sync only those the ranks cannot diff."""
        params = super()._named_params()
        sharded = self._sharded
        if sharded is None or sharded.last is None or sharded.last["gather"]:
            return params
        return ((n, p) for n, p in params if n in sharded.impure)

    def _segments(self):
        """Non-expert pass, then the expert pass in sub-passes; the parent's barriers close each pass. Sharded: the
        first pass starts with the source's plan, then either rebuilds the shard maps (a gather sync) or sends the
        changes the ranks found."""

        def non_expert():
            if self._sharded is not None:
                yield from self._sharded.start(list(named_params_and_buffers(self.args, self.model)),
                                               self._sender if self._is_pp_src_rank else None)
            for chunk in self._iter_non_expert_chunks():
                yield [(n, t.clone()) for n, t in chunk]
            dist.barrier(group=get_gloo_group())

        expert_iter = self._iter_expert_chunks()
        expert_bytes = sum(p.numel() * p.element_size() for n, p in self.model[0].named_parameters() if ".experts." in n)
        if not expert_bytes:
            def no_experts():
                yield from ()
                for _ in expert_iter:  # still joins the (empty) expert collectives
                    pass
                dist.barrier(group=get_gloo_group())

            # pipeline stages publish in lockstep: a stage without experts publishes as often as one with them
            padding = _EXPERT_SUBPASSES - 1 if mpu.get_pipeline_model_parallel_world_size() > 1 else 0
            return [non_expert, no_experts] + [lambda: iter(())] * padding
        ep = mpu.get_expert_model_parallel_world_size()
        per_segment = max(1, math.ceil(expert_bytes * ep / self.args.update_weight_buffer_size / _EXPERT_SUBPASSES))

        done = []  # the expert pass ends with one barrier on every rank, in whichever segment its chunks run out

        def expert_segment(last: bool):
            def run():
                n = 0
                for chunk in expert_iter:
                    yield [(name, t.clone()) for name, t in chunk]
                    n += 1
                    if n >= per_segment and not last:
                        return
                if not done:
                    done.append(True)
                    dist.barrier(group=get_gloo_group())

            return run

        return [non_expert] + [expert_segment(k == _EXPERT_SUBPASSES - 1) for k in range(_EXPERT_SUBPASSES)]

    def _send_weights(self, pbar) -> None:
        """One sync; an engine it left with wrong weights (dirty, or a fingerprint mismatch) gets its full sync now,
        before generation resumes: every rank runs the gathers again, so the source ranks' decision reaches all.
        Sharded: after each pass every rank learns its outcome (seed, commit or stage its part)."""
        results = self._send_once(self._sender.update if self._sender is not None else None)
        self._settle_shards()
        dirty = torch.tensor([len(self._sender.left_dirty) if self._sender is not None else 0])
        dist.all_reduce(dirty, op=dist.ReduceOp.MAX, group=get_gloo_group())
        if dirty.item():
            n = int(dirty.item())
            results = self._send_once((lambda segments: self._sender.repair(segments, n))
                                      if self._sender is not None else None)
            self._settle_shards()
        if self._sender is None:
            return
        self.weight_version = self._sender.version
        metrics = self._sender.pop_metrics()
        if self._sharded is not None:
            metrics.update(self._sharded.metrics())
        Timer().add("delta_encode", metrics["perf/update_weights_encode_s"])
        Timer().add("delta_finalize", metrics["perf/update_weights_finalize_s"])
        self.update_weight_metrics.update(metrics)
        for i, (ok, msg) in results.items():
            if not ok:
                logger.error("engine %d did not take weight version %d: %s", i, self._sender.version, msg)
        if pbar is not None:
            pbar.update(int(metrics["perf/update_weights_flushes"]))

    def _settle_shards(self) -> None:
        if self._sharded is not None and self._sharded.last is not None:
            self._sharded.settle(self._sender)
            self._sharded.last = None

    def _send_once(self, sync):
        """``sync(segments)`` on a stage's source rank; the other ranks join the gathers and barriers, send nothing."""
        segments = self._segments()
        if sync is None:
            try:
                for segment in segments:
                    for _ in segment():
                        pass
            except ShardDiffFailed:  # the source aborts its sync there too (nothing reached an engine)
                logger.exception("sharded delta sync v%d: a rank could not diff its shard", self.weight_version)
            return None
        return sync(segments)
