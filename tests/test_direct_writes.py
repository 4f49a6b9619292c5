"""Direct writes batched per destination storage land exactly as one write per param, in spec order, would."""
import random

import pytest
import torch

import types

from cpu_harness import Host, delta_flushes, full_flushes, hf_config, nan_filled, rl_states, sglang_model
from delta_helpers import assert_params_equal, sparse_kernels
from sglang.srt.weight_sync.delta import kernels, native, wire
from sglang.srt.weight_sync.delta.receiver import receiver_state
from sglang.srt.weight_sync.delta.views import Direct, block_plan, write_direct, write_off_wire, write_run
from sglang.srt.weight_sync.delta.wire import encode_flush, validate_payload


def storages():
    return {"a": torch.zeros(400, dtype=torch.bfloat16), "b": torch.zeros(200, dtype=torch.bfloat16),
            "c": torch.zeros(60, dtype=torch.bfloat16), "d": torch.zeros(70, dtype=torch.float32)}


# name: (elements, [(storage, block start)]); q0/q1 overlap in "b", u has two views, t sits at an offset in "c", f is a
# block of an fp32 storage (its bf16 values are cast as the loader's copy does)
LAYOUT = {"p0": (100, [("a", 0)]), "q0": (100, [("b", 0)]), "t": (50, [("c", 10)]), "p1": (100, [("a", 100)]),
          "u": (60, [("c", 0), ("d", 5)]), "q1": (100, [("b", 80)]), "p2": (150, [("a", 200)]),
          "p3": (50, [("a", 350)]), "f": (5, [("d", 65)])}


@pytest.mark.parametrize("native_write", [False, True])
@pytest.mark.parametrize("run", [1, 1 << 20])
@pytest.mark.parametrize("below", [0, 40, 1 << 30])
@pytest.mark.parametrize("seed", range(4))
def test_writes_batched_per_storage_land_as_one_write_per_param_in_order(monkeypatch, seed, below, run, native_write):
    """``native_write``: the whole-block params first straight off the wire (``write_off_wire``, the native kernel),
    the rest through the runs."""
    sparse_kernels(monkeypatch, native_write)
    monkeypatch.setattr(wire, "CPU_BATCH_BELOW", below)  # large ones alone, all batched, or all alone
    monkeypatch.setattr(wire, "_DECODE_RUN", run)  # positions kept, or decoded again a param at a time
    rng = random.Random(seed)
    entries, want, got = [], storages(), storages()
    for name, (numel, views) in LAYOUT.items():
        n = min(numel, rng.choice([0, 1, 7, numel // 2, numel]))
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
    assert set(blocks.at) == {"p0", "p1", "p2", "p3", "t", "f"}  # overlapping blocks and two views: one write each
    positions = validate_payload(payload, manifest)
    rest = []
    live = [p for p in payload.spec.params if p.nnz]
    left = write_off_wire(blocks, live, positions, payload.values)
    off_wire = {"p0", "p1", "p2", "p3", "t"} if native_write else set()  # blocks of the values' dtype
    assert [p.name for p in left] == [p.name for p in live if p.name not in off_wire]
    for r in positions.runs(left):
        write_run(blocks, direct, r, payload.values, rest)
        if not positions.kept:
            write_direct(rest)
            rest = []
    write_direct(rest)
    for s in want:
        assert torch.equal(got[s].view(torch.int16 if got[s].dtype == torch.bfloat16 else torch.int32),
                           want[s].view(torch.int16 if want[s].dtype == torch.bfloat16 else torch.int32)), s


def synced_with_native_write(monkeypatch, steps: int, write):
    """(config, states, engine): a qwen3 engine after a full sync of the first of ``steps`` + 1 trained states, with
    the native kernels ready and their direct write replaced by ``write``."""
    sparse_kernels(monkeypatch, True)
    cfg = hf_config("qwen3")
    states = rl_states(cfg, steps, seed=0)
    host = Host(nan_filled(sglang_model(cfg)))
    for pl in full_flushes(states[0], version=1):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    assert receiver_state(host.model).blocks.at  # whole-block views: the native write takes them
    monkeypatch.setitem(kernels.KERNELS.runner, ("sparse", "cpu"),
                        types.SimpleNamespace(**{**vars(native.SPARSE), "write": write}))
    return cfg, states, host


def assert_holds(cfg, host, state) -> None:
    ref = nan_filled(sglang_model(cfg))
    ref.load_weights(list(state.items()))
    assert_params_equal(host.model, ref)


def test_a_native_write_refused_before_writing_leaves_the_params_to_the_torch_ops(monkeypatch):
    """A native write that refuses its arguments has written nothing: the same apply writes every param through
    the torch ops (bit-identical, the engine clean), and the kernel is not used again."""
    def refuse(*a):
        raise ValueError("native write: the params do not fit their storages, the blob or the values")

    cfg, states, host = synced_with_native_write(monkeypatch, 1, refuse)
    (pl,) = delta_flushes(states[0], states[1], "deltas", version=2, base_version=1)
    ok, msg = host.call("_apply_delta_payload", [pl])
    assert ok, msg
    assert receiver_state(host.model).version == 2 and not receiver_state(host.model).dirty
    assert kernels.kernel_state("cpu", wire.SPARSE).startswith("failed: ValueError: native write")
    assert_holds(cfg, host, states[1])


def test_a_native_write_that_fails_leaves_the_engine_dirty_and_the_torch_ops_write_after_a_full_sync(monkeypatch):
    """The native kernel writes whole-block params straight off the wire, after the flush was checked. One that
    fails part-way (half its params written) fails the apply: the engine is dirty, takes only a full sync, and the
    kernel is not used again; the next delta, through the torch ops, lands bit-identical."""
    def half_then_fail(flats, sid, *rest):
        k = len(sid) // 2
        native.write_runner(flats, sid[:k], *(r[:k] if isinstance(r, tuple) else r for r in rest))
        raise RuntimeError("the kernel broke mid-way")

    cfg, states, host = synced_with_native_write(monkeypatch, 2, half_then_fail)
    (pl,) = delta_flushes(states[0], states[1], "deltas", version=2, base_version=1)
    ok, msg = host.call("_apply_delta_payload", [pl])
    assert not ok and "engine is dirty and needs a full sync: RuntimeError('the kernel broke mid-way')" in msg, msg
    assert receiver_state(host.model).dirty
    assert kernels.kernel_state("cpu", wire.SPARSE).startswith("failed: RuntimeError: the kernel broke mid-way")
    monkeypatch.setenv(kernels.MODE_ENV, "auto")  # as a server runs: a kernel that failed is not built again
    (pl,) = delta_flushes(states[1], states[2], "deltas", version=3, base_version=2)
    ok, msg = host.call("_apply_delta_payload", [pl])
    assert not ok and "dirty" in msg, msg
    for pl in full_flushes(states[1], version=3):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    (pl,) = delta_flushes(states[1], states[2], "deltas", version=4, base_version=3)
    ok, msg = host.call("_apply_delta_payload", [pl])
    assert ok, msg
    assert kernels.kernel_state("cpu", wire.SPARSE).startswith("failed")
    assert_holds(cfg, host, states[2])
