"""Speculative decoding through SGLang's own classes: the scheduler's weight-update manager, its EAGLE worker and its
model runners (built without their GPU start-up: the EAGLE worker's kernels, attention backends and CUDA graphs do
not run on CPU; a real EAGLE server is ``make gpu-check``'s). The draft is bound where the scheduler creates the
worker (``draft.bind_engine``), shares the target's embedding and head through the worker's own ``init_lm_head``,
and a delta request dispatched by the manager reaches the target's runner alone, whose apply takes the draft with
it: bit-identical to a plain load of both, the draft's runner never called. What cannot be served is refused by
name, before any write."""
import sys
import types

import pytest
import torch

from cpu_harness import Host, bf16_state, hf_model, nan_filled, receiver_class, segments
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta import draft
from sglang.srt.weight_sync.delta.engine_api import DeltaEngine
from sglang.srt.weight_sync.delta.receiver import delta_status
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport
from test_speculative import CFG, mtp_states, plain_load, target_and_draft, with_mtp


def runner(model, algorithm="EAGLE", **args):
    """SGLang's ModelRunner around ``model`` (the attributes the receiver reads), with v0.5.23's WeightUpdater."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    host = Host(model)
    host.server_args.speculative_algorithm = algorithm
    for k, v in args.items():
        setattr(host.server_args, k, v)
    r = ModelRunner.__new__(ModelRunner)
    for k, v in vars(host).items():
        setattr(r, k, v)
    r.model_config = types.SimpleNamespace(dtype=torch.bfloat16, quantization=None, model_path="dummy", revision=None)
    r.load_config = None
    updater = receiver_class()
    if updater.__name__ == "WeightUpdater":
        r.weight_updater = updater(tp_rank=0, device="cpu", gpu_id=0, model_config=r.model_config,
                                   custom_weight_loaders={}, get_model=lambda: r.model, update_model_fields=None,
                                   recapture_cuda_graph=None, get_model_runner=lambda: r)
    return r


def eagle_worker(target_runner, draft_runners, multi=False):
    """SGLang's EAGLE worker (or its multi-layer one) over the target's TpModelWorker, sharing the target's embedding
    and head with the draft through its own ``init_lm_head``."""
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.speculative import eagle_worker_v2, multi_layer_eagle_worker_v2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    tp = TpModelWorker.__new__(TpModelWorker)
    tp._model_runner = target_runner
    mod = multi_layer_eagle_worker_v2 if multi else eagle_worker_v2
    outer = (mod.MultiLayerEagleWorkerV2 if multi else mod.EAGLEWorkerV2).__new__(
        mod.MultiLayerEagleWorkerV2 if multi else mod.EAGLEWorkerV2)
    inner_cls = mod.MultiLayerEagleDraftWorker if multi else mod.EagleDraftWorker
    inner = inner_cls.__new__(inner_cls)
    inner.target_worker, inner.hot_token_id = tp, None
    inner.speculative_algorithm = SpeculativeAlgorithm.EAGLE
    if multi:
        inner.draft_runner_list = draft_runners
    else:
        inner.draft_runner = draft_runners[0]
        inner.init_lm_head()
    outer._target_worker, outer._draft_worker = tp, inner
    return tp, outer


def manager(tp, spec_worker):
    """SGLang's scheduler-side weight-update manager over the two workers (its fields set as the scheduler sets
    them; the flush after an update runs on a scheduler with nothing in flight)."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    scheduler = type("Scheduler", (), {})()
    scheduler.__dict__.update(tp_worker=tp, waiting_queue=[], chunked_req=None, last_batch=None,
                              running_batch=types.SimpleNamespace(is_empty=lambda: True), flush_cache=lambda **_: True,
                              record_weight_version_change=lambda **_: None)
    m = SchedulerWeightUpdaterManager.__new__(SchedulerWeightUpdaterManager)
    fields = dict(tp_worker=tp, draft_worker=spec_worker, memory_saver_adapter=None, flush_cache=scheduler.flush_cache,
                  is_fully_idle=lambda **_: True, scheduler=scheduler, metrics_collector=None, offload_tags=set(),
                  stashed_model_static_state=None, tp_cpu_group=None, _session=None)
    for k in SchedulerWeightUpdaterManager.__slots__:
        setattr(m, k, fields[k])
    return m


class ManagerEngine(DeltaEngine):
    """An engine as the sender's disk transport calls it: SGLang's own request object through the manager."""

    def __init__(self, m):
        self.m = m

    def update_weights_from_disk(self, model_path, files, weight_version, store=None):
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        req = UpdateWeightFromDiskReqInput(model_path=model_path, load_format="delta", files=files,
                                           weight_version=weight_version, store=store)
        out = self.m.update_weights_from_disk(req)
        return out.success, out.message

    def fingerprint(self):
        from sglang.srt.weight_sync.delta import receiver

        return [receiver.fingerprint_payload(self.m.tp_worker.model_runner.model)]

    def status(self):
        return [delta_status(self.m.tp_worker.model_runner.model)]


class NotCalled:
    """A draft runner's entry points: a delta must never reach them."""

    def __getattr__(self, name):
        raise AssertionError(f"the draft's runner was called ({name}): the target's apply takes the draft")

    def __call__(self, *a, **k):
        raise AssertionError("the draft's runner was called: the target's apply takes the draft")


def test_the_manager_sends_a_delta_to_the_target_runner_whose_apply_takes_the_bound_draft(monkeypatch, tmp_path):
    target, mtp = target_and_draft(monkeypatch)
    nan_filled(target)  # init_lm_head shares the (NaN) embedding and head again below
    t_runner, d_runner = runner(target), runner(mtp)
    tp, worker = eagle_worker(t_runner, [d_runner])
    pair = draft.bind_engine(tp, worker, t_runner.server_args)
    assert isinstance(pair, draft.TargetAndDraft) and pair.draft is mtp
    for name in ("weight_updater", "update_weights_from_disk", "_apply_delta"):
        monkeypatch.setattr(d_runner, name, NotCalled(), raising=False)
    engine = ManagerEngine(manager(tp, worker))
    transport = DiskTransport(str(tmp_path), [engine], zstd=1)
    sender = DeltaSender(transport, [engine], encoding="xor_zstd", fingerprint_every=1)
    for state in mtp_states(2):
        ok, msg = sender.update(segments(state))[0]
        assert ok, msg
        assert_params_equal(pair, plain_load(monkeypatch, state))
    assert delta_status(mtp).applied == delta_status(target).applied == {"full": 1, "delta": 2}
    assert mtp.lm_head.weight is target.lm_head.weight
    transport.close()


REFUSALS = [
    (dict(speculative_draft_model_path="/ckpt/eagle3-head"), False,
     "EAGLEWorkerV2: the draft loads its own checkpoint (/ckpt/eagle3-head)"),
    (dict(speculative_token_map="/ckpt/hot.pt"), False,
     "EAGLEWorkerV2: --speculative-token-map gives the draft an LM head gathered from the target's rows"),
    ({}, True, "MultiLayerEagleWorkerV2: 2 draft model runners (one per draft step)"),
    (dict(dtype=torch.float16), False, "EAGLEWorkerV2: the draft runs dtype torch.float16, the target torch.bfloat16"),
    (dict(quantization="fp8"), False, "EAGLEWorkerV2: the draft runs quantization fp8, the target None"),
]


@pytest.mark.parametrize("args, multi, why", REFUSALS, ids=["own-checkpoint", "token-map", "multi-layer", "dtype",
                                                            "quantization"])
def test_a_draft_that_cannot_take_deltas_is_refused_by_name_before_any_write(monkeypatch, tmp_path, args, multi, why):
    target, mtp = target_and_draft(monkeypatch)
    config = {k: args.pop(k) for k in ("dtype", "quantization") if k in args}
    t_runner = runner(target, **args)
    d_runners = [runner(mtp) for _ in range(2 if multi else 1)]
    for k, v in config.items():
        setattr(d_runners[0].model_config, k, v)
    tp, worker = eagle_worker(t_runner, d_runners, multi)
    assert draft.bind_engine(tp, worker, t_runner.server_args) is None
    engine = ManagerEngine(manager(tp, worker))
    transport = DiskTransport(str(tmp_path), [engine], zstd=1)
    ok, msg = DeltaSender(transport, [engine], encoding="xor_zstd").update(
        segments(with_mtp(bf16_state(hf_model(CFG)), 0)))[0]
    assert not ok and f"speculative decoding (EAGLE): {why}" in msg, msg
    assert delta_status(target).code == "unsupported"
    assert all(torch.isnan(p.float()).all() for p in target.parameters() if p.dtype.is_floating_point)
    transport.close()


def test_ngram_drafts_without_a_model_and_takes_deltas_as_a_plain_engine(monkeypatch, tmp_path):
    """NGRAM's drafts come from a token corpus: no weight of it can go stale, so its engine takes syncs. (Its module
    imports a GPU kernel at the top, which a CPU build lacks: a stand-in module for that import alone.)"""
    from sglang.srt.managers.tp_worker import TpModelWorker

    kernel = types.ModuleType("sgl_kernel.speculative")
    kernel.reconstruct_indices_from_tree_mask = None
    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    monkeypatch.setitem(sys.modules, "sgl_kernel.speculative", kernel)
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    target, _ = target_and_draft(monkeypatch)
    t_runner = runner(target, algorithm="NGRAM")
    tp = TpModelWorker.__new__(TpModelWorker)
    tp._model_runner = t_runner
    worker = NGRAMWorker.__new__(NGRAMWorker)
    worker._target_worker = tp
    assert draft.bind_engine(tp, worker, t_runner.server_args) is None
    engine = ManagerEngine(manager(tp, worker))
    transport = DiskTransport(str(tmp_path), [engine], zstd=1)
    state = bf16_state(hf_model(CFG))
    ok, msg = DeltaSender(transport, [engine], encoding="xor_zstd").update(segments(state))[0]
    assert ok, msg
    transport.close()


@pytest.mark.parametrize("selector", ["target", "draft"])
def test_a_broadcast_delta_whose_selector_leaves_the_draft_out_is_refused_before_any_write(monkeypatch, selector):
    """v0.5.23's update request names the runners it reaches (``selector``): a delta for the target alone, or the
    draft alone, would split the engine's version; refused ``unsupported`` through the target's WeightUpdater (on
    v0.5.15, whose requests carry no selector, through the receiver's entry point), nothing written."""
    from cpu_harness import full_flushes
    from sglang.srt.weight_sync.delta import receiver
    from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES

    target, mtp = target_and_draft(monkeypatch)
    t_runner = runner(target)
    tp, worker = eagle_worker(t_runner, [runner(mtp)])
    draft.bind_engine(tp, worker, t_runner.server_args)
    (pl,) = full_flushes(with_mtp(bf16_state(hf_model(CFG)), 0), version=1)
    tensors = [(POSITIONS, pl.positions), (VALUES, pl.values)]
    updater = getattr(t_runner, "weight_updater", None)
    if updater is not None:
        ok, msg = updater.load_weights_from_distributed(tensors, pl.spec.to_json(), "1", selector)
    else:
        ok, msg = receiver._apply_received_delta(t_runner, pl.spec.to_json(), tensors, "1", selector)
    assert not ok and f"selector {selector!r}: a delta reaches the draft model only together with its target" in msg
    assert delta_status(target).code == "unsupported"
    assert all(torch.isnan(p.float()).all() for p in target.parameters() if p.dtype.is_floating_point)
