"""Test-only parts: bit-identity assertions and a gloo sender in its own process.

Nothing here stands in for the code under test: the transport is a real two-process gloo group.
"""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import sglang
from cpu_harness import free_port
from sglang.srt.weight_sync.delta.wire import DeltaPayload, broadcastable

SGLANG_VERSION = sglang.__version__
ARCHS = ["qwen2", "qwen3", "qwen3-tied", "llama"]

def copy_from_a_temporary(host, name: str = "model.norm.weight"):
    """Make the model's loader copy ``name`` from a temporary: no view of the HF tensor left to follow, so the full
    sync turns the direct path off and every delta goes through the loader."""
    params, native = dict(host.model.named_parameters()), host.model.load_weights

    def load_weights(weights):
        rest = []
        for n, t in weights:
            if n == name:
                params[n].copy_(t.clone())
            else:
                rest.append((n, t))
        return native(rest)

    host.model.load_weights = load_weights
    return host


def per_param(found, n: int) -> list:
    """``diff.changes_many``'s runs cut back per pair: ``[(positions, values, olds)]`` in pair order (None where no
    run covers a pair)."""
    out = [None] * n
    for f in found:
        for j, k in enumerate(f.ks):
            assert out[k] is None, f"pair {k} is in two runs"
            out[k] = f.share(j)
    return out


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
        self.inbox.put([broadcastable(payload.positions.contiguous()), broadcastable(payload.values.contiguous())])

    def wait_sent(self) -> None:
        assert self.outbox.get(timeout=60) == "sent"

    def close(self) -> None:
        self.inbox.put(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def gloo_fixture(group_name: str):
    """A module-scoped fixture: a gloo sender process and this process's receiving group. Each module names its
    own group: process groups outlive the module that made them."""

    @pytest.fixture(scope="module")
    def gloo():
        sender = GlooSender(group_name=group_name)
        pg = sender.join_as_receiver()
        yield sender, pg
        sender.close()

    return gloo
