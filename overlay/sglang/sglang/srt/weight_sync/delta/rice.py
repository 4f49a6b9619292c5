"""Rice codes as bit streams, and the per-run int helpers of ``xor_ctx`` (:mod:`ctx`): every operation a fixed number
of tensor ops over all codes of a flush, the same on CPU and CUDA; host reads only where a name says so (a stream's
length, the chosen parameters).

A Rice code of ``v`` with parameter ``k``: the quotient ``v >> k`` in unary (zeros, then a one) in one stream, the low
``k`` bits in another; a quotient of ``ESC`` escapes to ``v`` in ``RAW`` bits. Bits are least significant first.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import torch

from sglang.srt.weight_sync.delta.ops import host_values, repeat_counts, to_device

ESC = 32  # a unary quotient of ESC means: the value follows raw in RAW bits
RAW = 32
K_MAX = 31


def pack(vals: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Fields (value, width <= 33) -> LSB-first bytes, in one scatter per byte of a field (fields never overlap)."""
    if not vals.numel():
        return torch.zeros(0, dtype=torch.uint8, device=vals.device)
    ends = torch.cumsum(widths, 0)
    total = host_values(ends[-1:])[0]
    off = ends - widths
    word = vals << (off & 7)
    at = off >> 3
    out = torch.zeros((total + 7) // 8 + 6, dtype=torch.int32, device=vals.device)  # a byte's fields add to <= 255
    for j in range(6):
        out.index_add_(0, at + j, ((word >> (8 * j)) & 0xFF).to(torch.int32))
    return out[:(total + 7) // 8].to(torch.uint8)


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """One bit per bool, LSB-first, the last byte zero-padded."""
    n = flags.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=flags.device)
    padded[:n] = flags
    return (padded.view(-1, 8) << torch.arange(8, dtype=torch.uint8, device=flags.device)).sum(1, dtype=torch.uint8)


def unpack(buf: torch.Tensor, widths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """LSB-first fields of ``widths`` (<= 32) -> (values, whether the fields use exactly ``buf``'s bytes and its
    padding bits are zero: a 0-d bool, read with the flush's other checks)."""
    ends = torch.cumsum(widths, 0)
    total = ends[-1] if widths.numel() else torch.zeros((), dtype=torch.int64, device=buf.device)
    exact = (total + 7) // 8 == buf.numel()
    padded = torch.cat([buf.to(torch.int64), buf.new_zeros(8, dtype=torch.int64)])
    if buf.numel():
        last = padded[torch.clamp((total - 1) // 8, 0, buf.numel() - 1)]
        exact &= (last >> (((total - 1) & 7) + 1)) == 0
    if not widths.numel():
        return widths.clone(), exact
    off = ends - widths
    at = torch.clamp(off >> 3, 0, buf.numel())
    word = padded[at]
    for j in range(1, 5):
        word |= padded[at + j] << (8 * j)
    return (word >> (off & 7)) & ((1 << widths) - 1), exact


def rice_fields(v: torch.Tensor, k: torch.Tensor):
    """Rice codes of ``v`` with per-code ``k``: (unary fields, remainder fields), each as (values, widths)."""
    q = torch.clamp(v >> k, max=ESC)
    esc = q == ESC
    rem = torch.where(esc, v, v & ((1 << k) - 1))
    return (torch.ones_like(q) << q, q + 1), (rem, torch.where(esc, RAW, k))


def rice_cost(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    q = v >> k
    return torch.where(q < ESC, q + 1 + k, ESC + 1 + RAW)


def best_k(v: torch.Tensor, counts: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Per run of ``counts`` codes: the Rice parameter of least total bits among four around its mean's, and those
    bits (exact, summed per run in one scatter per candidate)."""
    n = len(counts)
    if not n:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    run = rep(torch.arange(n, device=v.device), counts)
    sums = torch.zeros(n, dtype=torch.float64, device=v.device).index_add_(0, run, v.double())
    mean = sums / torch.tensor(np.maximum(counts, 1), device=v.device)
    k0 = torch.floor(torch.log2(mean + 1)).long() - 1
    costs = []
    for d in range(4):
        k = torch.clamp(k0 + d, 0, K_MAX)
        costs.append(torch.zeros(n, dtype=torch.int64, device=v.device).index_add_(0, run, rice_cost(v, k[run])))
    costs = torch.stack(costs)
    best = torch.argmin(costs, 0)
    k, c = host_values(torch.stack([torch.clamp(k0 + best, 0, K_MAX), costs.gather(0, best[None])[0]]))
    return np.array(k, np.int64), np.array(c, np.int64)


def rep(values: torch.Tensor, counts) -> torch.Tensor:
    """:func:`repeat_counts` for host counts held in numpy (one per table entry)."""
    return repeat_counts(values, np.asarray(counts, np.int64).tolist())


def slots(starts, counts, dev) -> torch.Tensor:
    """The indices ``starts[i] + 0..counts[i]-1`` of every run, in order (host-known runs, no host read)."""
    counts = np.asarray(counts, np.int64)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return torch.arange(int(counts.sum()), device=dev) + rep(
        to_device(np.asarray(starts, np.int64) - firsts, dev), counts)


def gaps(r: torch.Tensor, counts, dev) -> torch.Tensor:
    """Increasing ints per run -> gaps ``r[i] - r[i-1] - 1``, each run's first from -1."""
    prev = torch.cat([r.new_full((1,), -1), r[:-1]])
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])[np.asarray(counts) > 0]
    prev[to_device(firsts, dev)] = -1
    return r - prev - 1


def ungaps(g: torch.Tensor, counts, dev) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gaps per run -> the increasing ints, and each run's last (its largest) or -1 for an empty run."""
    c = torch.cumsum(g + 1, 0)
    counts = np.asarray(counts, np.int64)
    ends = np.cumsum(counts)
    before = torch.cat([c.new_zeros(1), c])[to_device(ends - counts, dev)]
    r = c - 1 - rep(before, counts)
    last = torch.cat([c.new_zeros(1), c])[to_device(ends, dev)] - before - 1
    return r, last


def bits_of(buf: torch.Tensor) -> torch.Tensor:
    """A byte stream's bits, least significant first, one uint8 each."""
    return ((buf[:, None] >> torch.arange(8, dtype=torch.uint8, device=buf.device)) & 1).reshape(-1)
