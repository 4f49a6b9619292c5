"""The accelerator's code path, and the switch that runs it on CPU tensors.

A GPU deployment takes a few branches a CPU never would: pinned host memory, side streams with events between them,
asynchronous copies, large hash blocks. ``SGLANG_DELTA_DEVICE_PATH=1`` sends CPU tensors down those same branches
(streams and events become no-ops there, memory is not pinned), so the tests run every branch a GPU runs and compare
it with the default path bit for bit.
"""

from __future__ import annotations

import contextlib
import os

import torch

SWITCH = "SGLANG_DELTA_DEVICE_PATH"


def device_path(device: torch.device) -> bool:
    """Whether work on ``device`` takes the accelerator's branches: on CUDA always, on CPU only under the switch."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get(SWITCH) == "1")


def pinned(device: torch.device) -> bool:
    """Whether host memory that ``device`` copies from and to is pinned (only CUDA can pin)."""
    return device.type == "cuda"


class _HostStream:
    """What a CPU on the device path has for a stream and an event: ordering is program order, so nothing to wait
    for."""

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


def new_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else _HostStream()


def new_event(device: torch.device):
    return torch.cuda.Event() if device.type == "cuda" else _HostStream()


def current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else _HostStream()


def on_stream(stream):
    """Make ``stream`` current for the block (a CUDA stream), or nothing (the CPU's stand-in)."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def record_stream(t: torch.Tensor, stream) -> None:
    """Tell the caching allocator that ``stream`` uses ``t`` (CUDA memory only)."""
    if t.is_cuda:
        t.record_stream(stream)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
