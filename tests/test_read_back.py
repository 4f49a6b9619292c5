"""Read-back after write: a write that lands other bits than it meant fails the apply closed (code ``verify``, the
param named, the engine dirty until a full sync), on every path that writes: whole blocks batched per storage,
overlapping blocks one by one, params with several views, part-of-a-param (TP shard) views, FP8 bytes and
``xor_zstd`` values rebuilt from the base."""
import pytest
import torch

from cpu_harness import Host, delta_flushes, full_flushes, hf_config, nan_filled, rl_states, sglang_model
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta import views as views_module
from sglang.srt.weight_sync.delta.diff import encode_flush
from sglang.srt.weight_sync.delta.receiver import delta_status, receiver_state
from sglang.srt.weight_sync.delta.validate import validate_payload
from sglang.srt.weight_sync.delta.views import Direct, ReadBack, write_plan, write_run
from test_receiver_inprocess import DiskTransport


def corrupting(monkeypatch, at: int, which: int = 0):
    """``_write_bits`` that writes, then flips the low bit of one element its ``at``-th call wrote (a buggy kernel):
    the ``which``-th of them (negative: from the end); returns the list of calls, each (flat, offsets)."""
    write, calls = views_module._write_bits, []

    def buggy(flat, offsets, bits):
        write(flat, offsets, bits)
        calls.append((flat, offsets.clone()))
        if len(calls) - 1 == at and offsets.numel():
            k = int(offsets[which])
            flat[k] ^= 1

    monkeypatch.setattr(views_module, "_write_bits", buggy)
    return calls


# name: (elements, [(storage, block start, first element of the param the view holds, elements it holds)])
LAYOUT = {"p0": (100, [("a", 0, 0, 100)]), "q0": (100, [("b", 0, 0, 100)]), "p1": (100, [("a", 100, 0, 100)]),
          "u": (60, [("c", 0, 0, 60), ("d", 5, 0, 60)]), "q1": (100, [("b", 80, 0, 100)]),
          "h": (80, [("e", 0, 0, 40), ("f", 0, 40, 40)])}  # h: two TP-style shards, each part of the param


def test_every_write_path_is_read_back_and_a_wrong_element_names_its_param(monkeypatch):
    g = torch.Generator().manual_seed(1)
    entries = []
    for name, (numel, _) in LAYOUT.items():
        idx = torch.randperm(numel, generator=g)[:numel // 3].sort().values
        new = torch.zeros(numel, dtype=torch.bfloat16)
        new[idx] = torch.randn(idx.numel(), generator=g).to(torch.bfloat16)
        entries.append((name, new, idx))
    payload = encode_flush(entries, "deltas", version=2, base_version=1)
    manifest = {name: ([numel], "bfloat16") for name, (numel, _) in LAYOUT.items()}

    def write_all(check):
        stores = {s: torch.zeros(200, dtype=torch.bfloat16) for s in "abcdef"}
        direct = {n: [Direct(stores[s], soff, at, span, []) for s, at, soff, span in v] for n, (_, v) in LAYOUT.items()}
        plan = write_plan(direct, manifest)
        positions = validate_payload(payload, manifest)
        for r in positions.runs([p for p in payload.spec.params if p.nnz]):
            write_run(plan, r, payload.values, check)
        return stores, plan

    clean = ReadBack()
    _, plan = write_all(clean)
    assert clean.verdict() is None and len(plan.ordered) == 1  # q0/q1 overlap in b
    whole = {n for n, rows in plan.rows.items() if any(r[1] == views_module._WHOLE for r in rows)}
    assert whole == {"p0", "p1", "q0", "q1", "u"}  # h: two row shards
    calls = corrupting(monkeypatch, -1)
    write_all(ReadBack())
    writes = len(calls)
    monkeypatch.undo()
    named = set()
    for k in range(writes):  # the k-th write corrupted at its first and last element: the verdict names that param
        for which in (0, -1):
            corrupting(monkeypatch, k, which)
            check = ReadBack()
            write_all(check)
            why = check.verdict()
            monkeypatch.undo()
            assert why is not None and why.startswith("param '") and "reads back other bits than" in why, (k, why)
            named.add(why.split("'")[1])
    assert named == set(LAYOUT), named  # every param's write path was read back: batched, alone, several views, shards


@pytest.mark.parametrize("encoding", ["deltas", "xor_zstd"])
def test_a_wrong_write_fails_the_apply_closed_and_a_full_sync_recovers(tmp_path, monkeypatch, encoding):
    cfg = hf_config("qwen3-tied")
    states = rl_states(cfg, 3, seed=0)
    host = Host(nan_filled(sglang_model(cfg)))
    transport = DiskTransport(str(tmp_path))
    assert all(ok for ok, _ in transport.apply(host, full_flushes(states[0], version=1), encoding))
    raw = receiver_state(host.model).xor_raw
    corrupting(monkeypatch, 1)
    results = transport.apply(host, delta_flushes(states[0], states[1], encoding, version=2, base_version=1, raw=raw),
                              encoding)
    monkeypatch.undo()
    assert not results[0][0] and "read-back after write: param '" in results[0][1], results
    status = delta_status(host.model)
    assert status.code == "verify" and status.needs_full and status.reason == "dirty", status
    results = transport.apply(host, delta_flushes(states[1], states[2], encoding, version=3, base_version=2, raw=raw),
                              encoding)
    assert not results[0][0] and "dirty" in results[0][1], results
    assert all(ok for ok, _ in transport.apply(host, full_flushes(states[1], version=3), encoding))
    raw = receiver_state(host.model).xor_raw
    assert all(ok for ok, _ in transport.apply(
        host, delta_flushes(states[1], states[2], encoding, version=4, base_version=3, raw=raw), encoding))
    ref = nan_filled(sglang_model(cfg))
    ref.load_weights(list(states[2].items()))
    assert_params_equal(host.model, ref)


def test_a_wrong_fp8_write_is_caught(monkeypatch):
    from test_fp8 import apply, engine, fp8_states, full_sync, reference

    cfg, _, states = fp8_states("qwen3")
    host = engine(cfg)
    full_sync(host, states[0])
    corrupting(monkeypatch, 0)
    results = apply(host, delta_flushes(states[0], states[1], "deltas", version=2, base_version=1))
    monkeypatch.undo()
    assert not results[0][0] and "read-back after write: param '" in results[0][1], results
    assert delta_status(host.model).reason == "dirty"  # later flushes of that sync were refused: needs_full
    full = full_flushes(states[1], version=3, max_params=7)
    assert all(ok for ok, _ in apply(host, full))
    assert_params_equal(host.model, reference(cfg, states[1]))
