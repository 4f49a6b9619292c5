"""Direct writes batched per destination storage land exactly as one write per param, in spec order, would."""
import random

import pytest
import torch

from sglang.srt.weight_sync.delta import wire
from sglang.srt.weight_sync.delta.views import Direct, block_plan, write_direct, write_run
from sglang.srt.weight_sync.delta.wire import encode_flush, validate_payload


def storages():
    return {"a": torch.zeros(400, dtype=torch.bfloat16), "b": torch.zeros(200, dtype=torch.bfloat16),
            "c": torch.zeros(60, dtype=torch.bfloat16), "d": torch.zeros(70, dtype=torch.float32)}


# name: (elements, [(storage, block start)]); q0/q1 overlap in "b", u has two views, t sits at an offset in "c"
LAYOUT = {"p0": (100, [("a", 0)]), "q0": (100, [("b", 0)]), "t": (50, [("c", 10)]), "p1": (100, [("a", 100)]),
          "u": (60, [("c", 0), ("d", 5)]), "q1": (100, [("b", 80)]), "p2": (150, [("a", 200)]),
          "p3": (50, [("a", 350)])}


@pytest.mark.parametrize("run", [1, 1 << 20])
@pytest.mark.parametrize("below", [0, 40, 1 << 30])
@pytest.mark.parametrize("seed", range(4))
def test_writes_batched_per_storage_land_as_one_write_per_param_in_order(monkeypatch, seed, below, run):
    monkeypatch.setattr(wire, "CPU_BATCH_BELOW", below)  # large ones alone, all batched, or all alone
    monkeypatch.setattr(wire, "_DECODE_RUN", run)  # positions kept, or decoded again a param at a time
    rng = random.Random(seed)
    entries, want, got = [], storages(), storages()
    for name, (numel, views) in LAYOUT.items():
        n = rng.choice([0, 1, 7, numel // 2, numel])
        idx = torch.tensor(sorted(rng.sample(range(numel), n)), dtype=torch.int64)
        new = torch.zeros(numel, dtype=torch.bfloat16)
        new[idx] = torch.randn(n).to(torch.bfloat16)
        entries.append((name, new, idx))
        for s, at in views:  # the reference: one write per view, params in spec order (q1 wins where it overlaps q0)
            want[s][at:at + numel][idx] = new[idx].to(want[s].dtype)
    payload = encode_flush(entries, "deltas", version=2, base_version=1)
    manifest = {name: ([numel], "bfloat16") for name, (numel, _) in LAYOUT.items()}
    direct = {name: [Direct(got[s], 0, at, numel, []) for s, at in views] for name, (numel, views) in LAYOUT.items()}
    blocks = block_plan(direct, manifest)
    assert set(blocks.at) == {"p0", "p1", "p2", "p3", "t"}  # overlapping blocks and two views: one write each
    positions = validate_payload(payload, manifest)
    rest = []
    for r in positions.runs([p for p in payload.spec.params if p.nnz]):
        write_run(blocks, direct, r, payload.values, rest)
        if not positions.kept:
            write_direct(rest)
            rest = []
    write_direct(rest)
    for s in want:
        assert torch.equal(got[s].view(torch.int16 if got[s].dtype == torch.bfloat16 else torch.int32),
                           want[s].view(torch.int16 if want[s].dtype == torch.bfloat16 else torch.int32)), s
