"""Direct writes batched per destination storage land exactly as one write per param, in spec order, would."""
import random

import pytest
import torch

from cpu_harness import Host, delta_flushes, full_flushes, hf_config, nan_filled, rl_states, sglang_model
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta import positions as positions_module, views as views_module
from sglang.srt.weight_sync.delta.receiver import receiver_state
from sglang.srt.weight_sync.delta.views import Direct, ReadBack, write_plan, write_run
from sglang.srt.weight_sync.delta.diff import encode_flush
from sglang.srt.weight_sync.delta.validate import validate_payload


def storages():
    return {"a": torch.zeros(400, dtype=torch.bfloat16), "b": torch.zeros(200, dtype=torch.bfloat16),
            "c": torch.zeros(60, dtype=torch.bfloat16), "d": torch.zeros(70, dtype=torch.float32)}


# name: (elements, [(storage, block start)]); q0/q1 overlap in "b", u has two views, t sits at an offset in "c", f is a
# block of an fp32 storage (its bf16 values are cast as the loader's copy does)
LAYOUT = {"p0": (100, [("a", 0)]), "q0": (100, [("b", 0)]), "t": (50, [("c", 10)]), "p1": (100, [("a", 100)]),
          "u": (60, [("c", 0), ("d", 5)]), "q1": (100, [("b", 80)]), "p2": (150, [("a", 200)]),
          "p3": (50, [("a", 350)]), "f": (5, [("d", 65)])}


@pytest.mark.parametrize("run", [1, 1 << 20])
@pytest.mark.parametrize("seed", range(8))
def test_writes_batched_per_storage_land_as_one_write_per_param_in_order(monkeypatch, seed, run):
    """Whole-block params batched per storage, the others (overlapping blocks, two views, a block at an offset)
    through their views, positions kept or decoded again run by run; a dense param (written elsewhere) between them
    shifts the values the later ones pair with."""
    monkeypatch.setattr(positions_module, "_DECODE_RUN", run)  # positions kept, or decoded again a param at a time
    rng = random.Random(seed)
    entries, want, got = [], storages(), storages()
    for name, (numel, views) in LAYOUT.items():
        n = min(numel, rng.choice([0, 1, 7, numel // 2, numel]))
        idx = torch.tensor(sorted(rng.sample(range(numel), n)), dtype=torch.int64)
        new = torch.zeros(numel, dtype=torch.bfloat16)
        new[idx] = torch.randn(n).to(torch.bfloat16)
        entries.append((name, new, idx))
        if name == "t" and seed % 2:
            entries.append(("dense", torch.randn(9).to(torch.bfloat16), None))
        for s, at in views:  # the reference: one write per view, params in spec order (q1 wins where it overlaps q0)
            want[s][at:at + numel][idx] = new[idx].to(want[s].dtype)
    payload = encode_flush(entries, "deltas", version=2, base_version=1)
    manifest = {name: ([numel], "bfloat16") for name, (numel, _) in LAYOUT.items()} | {"dense": ([9], "bfloat16")}
    direct = {name: [Direct(got[s], 0, at, numel, []) for s, at in views] for name, (numel, views) in LAYOUT.items()}
    plan = write_plan(direct, manifest)
    ids = {s: k for k, s in enumerate(dict.fromkeys(s for _, views in LAYOUT.values() for s, _ in views))}
    assert plan.ordered == {ids["b"], ids["c"]}  # q0/q1 overlap in b, t and u in c: one write each, in order
    positions = validate_payload(payload, manifest)
    check = ReadBack()
    live = [p for p in payload.spec.params if p.nnz and not p.dense]
    for r in positions.runs(live):
        write_run(plan, r, payload.values, check)
    assert check.verdict() is None
    for s in want:
        assert torch.equal(got[s].view(torch.int16 if got[s].dtype == torch.bfloat16 else torch.int32),
                           want[s].view(torch.int16 if want[s].dtype == torch.bfloat16 else torch.int32)), s


def synced(steps: int):
    """(config, states, engine): a qwen3 engine after a full sync of the first of ``steps`` + 1 trained states."""
    cfg = hf_config("qwen3")
    states = rl_states(cfg, steps, seed=0)
    host = Host(nan_filled(sglang_model(cfg)))
    for pl in full_flushes(states[0], version=1):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    plan = receiver_state(host.model).plan
    assert any(row[1] == views_module._WHOLE for rows in plan.rows.values() for row in rows)  # whole blocks
    return cfg, states, host


def assert_holds(cfg, host, state) -> None:
    ref = nan_filled(sglang_model(cfg))
    ref.load_weights(list(state.items()))
    assert_params_equal(host.model, ref)


def test_a_write_that_fails_part_way_leaves_the_engine_dirty_until_a_full_sync(monkeypatch):
    """Writes run after the whole flush was checked. One that fails part-way (a storage written, then an error, as a
    device fault would leave it) fails the apply: the engine is dirty, refuses deltas, takes a full sync, and the
    next delta lands bit-identical."""
    cfg, states, host = synced(2)
    write, calls = views_module._write_bits, []

    def fail_second(flat, offsets, bits):
        calls.append(offsets.numel())
        if len(calls) == 2:
            raise RuntimeError("the write broke mid-way")
        write(flat, offsets, bits)

    monkeypatch.setattr(views_module, "_write_bits", fail_second)
    (pl,) = delta_flushes(states[0], states[1], "deltas", version=2, base_version=1)
    ok, msg = host.call("_apply_delta_payload", [pl])
    assert not ok and "engine is dirty and needs a full sync: RuntimeError('the write broke mid-way')" in msg, msg
    assert receiver_state(host.model).dirty and len(calls) == 2
    monkeypatch.setattr(views_module, "_write_bits", write)
    (pl,) = delta_flushes(states[1], states[2], "deltas", version=3, base_version=2)
    ok, msg = host.call("_apply_delta_payload", [pl])
    assert not ok and "dirty" in msg, msg
    for pl in full_flushes(states[1], version=3):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    (pl,) = delta_flushes(states[1], states[2], "deltas", version=4, base_version=3)
    ok, msg = host.call("_apply_delta_payload", [pl])
    assert ok, msg
    assert_holds(cfg, host, states[2])
