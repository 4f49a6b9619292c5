"""Real SGLang model classes in-process (gloo TP=1): full sync, then delta syncs, bit-identical to a full load."""
import os

import pytest
import torch

from cpu_harness import Host, delta_flushes, full_flushes, hf_config, nan_filled, rl_states, sglang_model
from delta_helpers import ARCHS, assert_params_equal, copy_from_a_temporary, gloo_fixture
from sglang.srt.weight_sync.delta.receiver import receiver_state
from sglang.srt.weight_sync.delta.files import flush_file
from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES, DeltaEncoding, dtype_to_str

ENCODINGS = ["indices", "deltas", "deltas_zstd", "planes_zstd", "xor_zstd", "xor_ctx"]
_TRAINED = {}


def trained(arch):
    """Three consecutive trainer states of a tiny model: step 0, 1, 2 of AdamW at lr 1e-6."""
    if arch not in _TRAINED:
        cfg = hf_config(arch)
        _TRAINED[arch] = (cfg, rl_states(cfg, 2, seed=0))
    return _TRAINED[arch]


class DiskTransport:
    def __init__(self, root):
        self.root = root

    def apply(self, host, payloads, encoding):
        results = []
        for pl in payloads:
            vdir = os.path.join(self.root, f"weight_v{pl.spec.version:06d}")
            os.makedirs(vdir, exist_ok=True)
            name = f"rank0000_flush{pl.spec.flush:06d}.safetensors"
            data = flush_file(pl, 1 if DeltaEncoding(encoding).disk_only else None)
            with open(os.path.join(vdir, name), "wb") as f:
                f.write(data)
            results.append(host.call("_apply_delta", vdir, [name], str(pl.spec.version)))
        return results


class DistributedTransport:
    def __init__(self, sender, pg):
        self.sender, self.pg = sender, pg

    def apply(self, host, payloads, encoding):
        host._model_update_group[self.sender.group_name] = self.pg
        results = []
        for pl in payloads:
            self.sender.send(pl)
            results.append(host.call("_apply_delta_from_distributed", pl.spec.to_json(), [POSITIONS, VALUES],
                                     ["uint8", dtype_to_str(pl.values.dtype)],
                                     [[pl.positions.numel()], [pl.values.numel()]], self.sender.group_name,
                                     str(pl.spec.version)))
            self.sender.wait_sent()
        return results


gloo = gloo_fixture("delta-test")


# the *_zstd encodings are disk-only by contract (file-level compression): they have no distributed case.
CASES = [("disk", e) for e in ENCODINGS] + [("distributed", e) for e in ("indices", "deltas")]


def make_transport(request, kind, tmp_path):
    return DiskTransport(str(tmp_path)) if kind == "disk" else DistributedTransport(*request.getfixturevalue("gloo"))


def reference(cfg, state):
    ref = nan_filled(sglang_model(cfg))
    ref.load_weights(list(state.items()))
    return ref


@pytest.mark.parametrize("kind, encoding", CASES)
@pytest.mark.parametrize("arch", ARCHS)
def test_delta_sync_bit_identical(request, tmp_path, arch, kind, encoding):
    transport = make_transport(request, kind, tmp_path)
    cfg, states = trained(arch)
    host = Host(nan_filled(sglang_model(cfg)), chunk_bytes=64 << 10)  # small cap: several load_weights chunks
    results = transport.apply(host, full_flushes(states[0], version=1, max_params=7), encoding)
    assert all(ok for ok, _ in results), results
    assert_params_equal(host.model, reference(cfg, states[0]))
    for v in (2, 3):
        old, new = states[v - 2], states[v - 1]
        changed = sum(int((old[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in new)
        total = sum(t.numel() for t in new.values())
        assert 0 < changed < 0.2 * total, f"unrealistic density {changed / total:.4f}"
        raw = receiver_state(host.model).xor_raw  # what the engine's status tells the sender (tied lm_head)
        results = transport.apply(host, delta_flushes(old, new, encoding, version=v, base_version=v - 1, max_params=5,
                                                      raw=raw), encoding)
        assert all(ok for ok, _ in results), results
        assert_params_equal(host.model, reference(cfg, new))
    assert receiver_state(host.model).version == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_params_loaded_by_view_copies_alone_take_deltas_directly(arch):
    """The full sync records each loader's view copies; those params skip densify + loader on a delta."""
    cfg, states = trained(arch)
    host = Host(nan_filled(sglang_model(cfg)))
    ok, msg = host.call("_apply_delta_payload", full_flushes(states[0], version=1))
    assert ok, msg
    state = receiver_state(host.model)
    assert state.direct and set(state.direct) == set(state.copies), sorted(set(state.copies) - set(state.direct))
    native, calls = host.model.load_weights, []
    host.model.load_weights = lambda weights: calls.append([n for n, _ in weights]) or native(weights)
    ok, msg = host.call("_apply_delta_payload", delta_flushes(states[0], states[1], "deltas", version=2, base_version=1))
    assert ok, msg
    assert all(n not in state.direct for c in calls for n in c), calls  # only names off the direct path
    assert_params_equal(host.model, reference(cfg, states[1]))


def test_a_loader_copying_a_transformed_tensor_keeps_deltas_on_the_loader_path():
    """A copy from a temporary (no view of the HF tensor left to follow) turns the direct path off: every delta
    goes through the loader and the NaN mask, and lands bit-identically."""
    cfg, states = trained("qwen3")
    host = copy_from_a_temporary(Host(nan_filled(sglang_model(cfg)), chunk_bytes=64 << 10))
    for pl in full_flushes(states[0], version=1, max_params=7):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    assert receiver_state(host.model).direct == {}
    new = dict(states[1])
    new["model.norm.weight"] = states[0]["model.norm.weight"].clone()
    new["model.norm.weight"].view(-1)[:3] += 0.5
    ok, msg = host.call("_apply_delta_payload", delta_flushes(states[0], new, "deltas", version=2, base_version=1))
    assert ok, msg
    assert_params_equal(host.model, reference(cfg, new))


@pytest.mark.parametrize("encoding", ["deltas", "xor_zstd"])
def test_direct_writes_and_base_reads_batched_per_storage_land_bit_identical(tmp_path, encoding):
    """Writes and ``xor_zstd`` base reads, batched per storage over a tied model's params, bit-identical."""
    cfg, states = trained("qwen3-tied")
    transport = DiskTransport(str(tmp_path))
    host = Host(nan_filled(sglang_model(cfg)))
    assert all(ok for ok, _ in transport.apply(host, full_flushes(states[0], version=1), encoding))
    for v in (2, 3):
        raw = receiver_state(host.model).xor_raw
        results = transport.apply(host, delta_flushes(states[v - 2], states[v - 1], encoding, version=v,
                                                      base_version=v - 1, raw=raw), encoding)
        assert all(ok for ok, _ in results), results
        assert_params_equal(host.model, reference(cfg, states[v - 1]))


@pytest.mark.parametrize("run", [1, 300])
@pytest.mark.parametrize("arch, encoding", [("qwen2", "indices"), ("qwen3-tied", "deltas")])
def test_a_flush_decoded_again_run_by_run_lands_bit_identical(monkeypatch, arch, encoding, run):
    """A flush larger than one decode run is checked in one pass, then decoded run by run into one buffer as the
    writes take it (CPU): runs of one param and of many, through the direct path and the loader's."""
    from sglang.srt.weight_sync.delta import positions

    monkeypatch.setattr(positions, "_DECODE_RUN", run)
    cfg, states = trained(arch)
    host = Host(nan_filled(sglang_model(cfg)))
    ok, msg = host.call("_apply_delta_payload", full_flushes(states[0], version=1))
    assert ok, msg
    direct = receiver_state(host.model).direct
    loader_only = sorted(direct)[::5]  # some params off the direct path: their positions are decoded one by one
    for name in loader_only:
        del direct[name]
    for v in (2, 3):
        ok, msg = host.call("_apply_delta_payload", delta_flushes(states[v - 2], states[v - 1], encoding, version=v,
                                                                  base_version=v - 1))
        assert ok, msg
        assert_params_equal(host.model, reference(cfg, states[v - 1]))


def test_an_xor_flush_is_rebuilt_a_run_at_a_time(tmp_path, monkeypatch):
    """``xor_zstd`` reads each run's base at its positions and rebuilds that run before the next: no int64 tensor of
    the whole flush's positions exists during the apply (the largest stays near one run), every param bit-identical."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sglang.srt.weight_sync.delta import positions

    class Largest(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.int64:
                    Largest.n = max(Largest.n, t.numel())
            return out

    run = 100
    monkeypatch.setattr(positions, "_DECODE_RUN", run)
    cfg, states = trained("qwen3-tied")
    transport = DiskTransport(str(tmp_path))
    host = Host(nan_filled(sglang_model(cfg)))
    assert all(ok for ok, _ in transport.apply(host, full_flushes(states[0], version=1), "xor_zstd"))
    payloads = delta_flushes(states[0], states[1], "xor_zstd", version=2, base_version=1,
                             raw=receiver_state(host.model).xor_raw)
    total = sum(p.nnz for pl in payloads for p in pl.spec.params if not p.dense)
    biggest = max(p.nnz for pl in payloads for p in pl.spec.params)
    with Largest():
        results = transport.apply(host, payloads, "xor_zstd")
    assert all(ok for ok, _ in results), results
    assert_params_equal(host.model, reference(cfg, states[1]))
    assert Largest.n <= 2 * (run + biggest) < total, (Largest.n, run, biggest, total)
