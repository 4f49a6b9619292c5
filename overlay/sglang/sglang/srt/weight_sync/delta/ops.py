"""Tensor ops both sides share: host ints to the device, repeats and shifted joins for one scatter per storage, bit
views for index ops, NaN from the bits, and the one way flush code reads the host.

Every op here runs the same on CPU and CUDA and needs no host synchronization unless its name says it reads the host.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from typing import Optional, Sequence

import numpy as np
import torch

from sglang.srt.weight_sync.delta.device import device_path, pinned
from sglang.srt.weight_sync.delta.mix64 import NAN_BITS


def to_device(values: Sequence, device: torch.device) -> torch.Tensor:
    """Host ints (or rows of them) as an int64 tensor on ``device``, in a copy that does not wait for the device
    (pinned on CUDA). Through numpy: ``torch.tensor`` of a list costs several times as much per call (the decode and
    the writes make a few per run of params)."""
    t = torch.from_numpy(np.array(list(values), dtype=np.int64))
    if device_path(device):
        return (t.pin_memory() if pinned(device) else t).to(device, non_blocking=True)
    return t.to(device)


def repeat_counts(values: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``torch.repeat_interleave(values, counts)`` for int64 ``values`` and host-known ``counts``: each value's step
    from the one before added where its run starts, then one cumsum: no host read."""
    total = sum(counts)
    if not counts:
        return values.new_empty(0)
    out = torch.zeros(total + 1, dtype=torch.int64, device=values.device)  # empty runs at the end land past it
    starts = to_device(itertools.accumulate(counts[:-1], initial=0), values.device)
    out.index_add_(0, starts, torch.diff(values, prepend=values.new_zeros(1)))  # an empty run's step adds to the next
    return out[:total].cumsum_(0)


def shifted_cat(idxs: Sequence[torch.Tensor], shifts: Sequence[int], device: torch.device,
                counts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``cat([idx + shift ...])`` for host-known shifts, with no host read: how both sides turn many tensors' offsets
    into one storage's, for one scatter or gather per storage instead of one per tensor. ``counts``: how many of the
    joined positions each shift applies to, in order (a run of several params' positions per tensor); default one
    shift per tensor."""
    counts = [i.numel() for i in idxs] if counts is None else counts
    return torch.cat(list(idxs)).add_(repeat_counts(to_device(shifts, device), counts))


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection while a sync runs: a sync makes a few Python objects per param (no cycles), and
    in a process holding a model's worth of objects each collection they trigger scans that whole heap."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def host_values(t: torch.Tensor) -> list:
    """How flush code reads tensor values on the host: a device-to-host copy (the synchronization on CUDA), made
    explicit on CPU too so that a dispatch mode can count it."""
    return t.to("cpu", copy=True).tolist()


INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def nan_mask(t: torch.Tensor) -> torch.Tensor:
    """``isnan`` from the raw bits (|bits| above the largest finite/inf pattern): integer ops, defined for fp8 on
    every device."""
    if t.dtype not in NAN_BITS:
        return torch.isnan(t)
    int_dtype, abs_mask, inf_bits = NAN_BITS[t.dtype]
    return (t.view(int_dtype) & abs_mask) > inf_bits


def any_nan(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds a NaN, as a 0-d bool tensor (read with the flush's other flags: no synchronization here)."""
    return nan_mask(t).any()


def gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``flat[idx]`` through an integer view: the same bits, and index kernels that lack fp8 on some devices."""
    return take(flat.view(INT_VIEW[flat.element_size()]), idx).view(flat.dtype)


def take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` for a 1-D ``t`` and int64 positions: ``index_select``, the plain gather on every device (advanced
    indexing adds a general-purpose pass on CPU that costs milliseconds at any size)."""
    return torch.index_select(t, 0, idx)
