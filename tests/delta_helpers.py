"""Shared test parts: tiny HF models trained at RL learning rates, in-process SGLang models, a gloo sender.

Nothing here stands in for the code under test: models are real transformers / SGLang classes,
updates come from real AdamW steps, the transport is a real two-process gloo group.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from typing import Optional

import torch

import sglang
from cpu_harness import free_port
from sglang.srt.weight_sync.delta.wire import DeltaPayload

SGLANG_VERSION = sglang.__version__
ARCHS = ["qwen2", "qwen3", "qwen3-tied", "llama"]


# ---------------------------------------------------------------- in-process SGLang


_DIST_READY = False


def init_sglang_inprocess() -> None:
    """gloo TP=1 world + the server-args/topology globals the model classes read (per SGLang era)."""
    global _DIST_READY
    if _DIST_READY:
        return
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    args = ServerArgs(model_path="dummy", tp_size=1, device="cpu")
    era_b = False
    try:
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context  # v0.5.23

        reset_context()
        publish(args, role="test", ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    except ImportError:
        from sglang.srt.server_args import set_global_server_args_for_scheduler  # v0.5.15

        set_global_server_args_for_scheduler(args)
        era_b = True
    initialize_model_parallel(backend="gloo")
    if era_b:  # v0.5.15: ModelRunner sets the dp-attention globals; only hidden_size/dtype are read
        import types

        from sglang.srt.layers.dp_attention import initialize_dp_attention

        initialize_dp_attention(args, types.SimpleNamespace(hf_config=types.SimpleNamespace(), hidden_size=64,
                                                            dtype=torch.get_default_dtype()))
    _DIST_READY = True


def sglang_model(cfg):
    init_sglang_inprocess()
    arch = cfg.architectures[0] if cfg.architectures else type(cfg).__name__.replace("Config", "ForCausalLM")
    import importlib

    mod = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[arch]
    cls = getattr(importlib.import_module(f"sglang.srt.models.{mod}"), arch)
    with torch.device("cpu"):
        model = cls(cfg).to(torch.bfloat16)
    return model


def nan_filled(model):
    """Fill every param with NaN, so a name a loader silently skips shows up in the comparison."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
    return model


class Host:
    """The runner attributes the receiver reads: the model, its device, server args, update groups.

    The receiver functions are called through the *patched* upstream class (``receiver_method``),
    so the test also proves the patch bound them.
    """

    def __init__(self, model, chunk_bytes: Optional[int] = None, read_workers: int = 4):
        from sglang.srt.server_args import ServerArgs

        self.model = model
        self.device = "cpu"
        self.server_args = ServerArgs(model_path="dummy", device="cpu")
        if chunk_bytes is not None:
            self.server_args.update_weight_delta_chunk_bytes = chunk_bytes
        self.server_args.update_weight_delta_read_workers = read_workers
        self._model_update_group = {}
        self.model_config = None

    def call(self, name: str, *args, **kwargs):
        return getattr(receiver_class(), name)(self, *args, **kwargs)


def receiver_class():
    """Where the patch set binds the receiver: ModelRunner (v0.5.15) or its WeightUpdater (v0.5.23)."""
    try:
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        return WeightUpdater
    except ImportError:
        from sglang.srt.model_executor.model_runner import ModelRunner

        return ModelRunner


def assert_params_equal(model, reference) -> None:
    got, want = dict(model.named_parameters()), dict(reference.named_parameters())
    assert got.keys() == want.keys()
    for n in got:
        a, b = got[n].detach(), want[n].detach()
        assert not torch.isnan(b).any(), f"{n}: reference load left NaN (a name was skipped)"
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), f"{n} differs"


# ---------------------------------------------------------------- gloo sender process


def _sender_main(init_method: str, group_name: str, world_size: int, inbox: mp.Queue, outbox: mp.Queue):
    from sglang.srt.utils.common import init_custom_process_group

    pg = init_custom_process_group(backend="gloo", init_method=init_method, world_size=world_size, rank=0,
                                   group_name=group_name)
    outbox.put("ready")
    while True:
        item = inbox.get()
        if item is None:
            break
        for t in item:
            torch.distributed.broadcast(t, src=0, group=pg)
        outbox.put("sent")


class GlooSender:
    """Rank 0 of a real gloo weight-update group, in its own process (the trainer's role)."""

    def __init__(self, group_name: str = "delta-test", world_size: int = 2):
        ctx = mp.get_context("spawn")
        self.port = free_port()
        self.init_method = f"tcp://127.0.0.1:{self.port}"
        self.group_name = group_name
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_sender_main, args=(self.init_method, group_name, world_size, self.inbox, self.outbox),
                                daemon=True)
        self.proc.start()

    def join_as_receiver(self, rank: int = 1, world_size: int = 2):
        from sglang.srt.utils.common import init_custom_process_group

        pg = init_custom_process_group(backend="gloo", init_method=self.init_method, world_size=world_size, rank=rank,
                                       group_name=self.group_name)
        assert self.outbox.get(timeout=60) == "ready"
        return pg

    def send(self, payload: DeltaPayload) -> None:
        self.inbox.put([payload.positions.contiguous(), payload.values.contiguous()])

    def wait_sent(self) -> None:
        assert self.outbox.get(timeout=60) == "sent"

    def close(self) -> None:
        self.inbox.put(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
