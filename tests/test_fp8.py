"""FP8 rollout engines (slime's block-FP8 checkpoints) on real SGLang classes in-process: e4m3 weights travel sparse
in byte space and land through the views the full sync recorded, scales travel as fp32 params; an engine whose
after-loading step transforms its weights is refused before the first write."""
import pytest
import torch

from cpu_harness import FP8_BLOCK, Host, InProcessEngine, delta_flushes, fp8_block_quantize, full_flushes, hf_config, \
    nan_filled, rl_states, sglang_model
from delta_helpers import assert_params_equal, copy_from_a_temporary, gloo_fixture
from sglang.srt.weight_sync.delta.receiver import delta_status, receiver_state
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport
from sglang.srt.weight_sync.delta.wire import zstd_level
from test_receiver_inprocess import CASES, make_transport

ARCHS = ["qwen3", "qwen3-moe"]
_STATES = {}


gloo = gloo_fixture("delta-fp8-test")  # the fixture make_transport asks for


def fp8_states(arch):
    """bf16 trainer states of three AdamW steps, and the same states after slime's block-FP8 conversion."""
    if arch not in _STATES:
        cfg = hf_config(arch, hidden=256)  # 128x128 blocks: several per weight
        bf16 = rl_states(cfg, 2, seed=0)
        _STATES[arch] = (cfg, bf16, [fp8_block_quantize(s) for s in bf16])
    return _STATES[arch]


def engine(cfg, quant=FP8_BLOCK):
    return Host(nan_filled(sglang_model(cfg, quant)), chunk_bytes=64 << 10)


def reference(cfg, state):
    ref = nan_filled(sglang_model(cfg, FP8_BLOCK))
    ref.load_weights(list(state.items()))
    return ref


def apply(host, payloads):
    return [host.call("_apply_delta_payload", [pl]) for pl in payloads]


def full_sync(host, state):
    results = apply(host, full_flushes(state, version=1, max_params=7))
    assert all(ok for ok, _ in results), results


def weights(host):
    return {n: p.detach().clone() for n, p in host.model.named_parameters()}


def assert_untouched(host, before):
    for n, p in host.model.named_parameters():
        assert torch.equal(p.detach().view(torch.uint8), before[n].view(torch.uint8)), f"{n} was written"


@pytest.mark.parametrize("kind, encoding", CASES)
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_deltas_are_bit_identical_to_a_full_load(request, tmp_path, arch, kind, encoding):
    cfg, _, states = fp8_states(arch)
    transport = make_transport(request, kind, tmp_path)
    host = engine(cfg)
    assert all(ok for ok, _ in transport.apply(host, full_flushes(states[0], version=1, max_params=7), encoding))
    assert_params_equal(host.model, reference(cfg, states[0]))
    state = receiver_state(host.model)
    assert state.dense == [] and set(state.direct) == set(state.copies)  # every fp8 weight and scale: direct
    for v in (2, 3):
        old, new = states[v - 2], states[v - 1]
        payloads = delta_flushes(old, new, encoding, version=v, base_version=v - 1, max_params=5)
        sparse_fp8 = [p for pl in payloads for p in pl.spec.params if p.dtype == "float8_e4m3fn" and not p.dense]
        assert sparse_fp8 and all(p.nnz < p.numel for p in sparse_fp8)  # 1-byte values, byte positions
        results = transport.apply(host, payloads, encoding)
        assert all(ok for ok, _ in results), results
        assert_params_equal(host.model, reference(cfg, new))


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_deltas_never_call_the_loader_and_stay_sparse(arch):
    """The direct path is taken: no ``load_weights`` call in a delta; fp8 density is measured beside bf16's."""
    cfg, bf16, states = fp8_states(arch)
    host = engine(cfg)
    full_sync(host, states[0])
    native, calls = host.model.load_weights, []
    host.model.load_weights = lambda w: calls.append([n for n, _ in w]) or native(w)
    results = apply(host, delta_flushes(states[0], states[1], "deltas", version=2, base_version=1))
    assert all(ok for ok, _ in results) and calls == [], (results, calls)
    assert_params_equal(host.model, reference(cfg, states[1]))

    def density(a, b, names):
        return sum(int((a[n].view(-1).view(torch.uint8 if a[n].element_size() == 1 else torch.int16)
                        != b[n].view(-1).view(torch.uint8 if b[n].element_size() == 1 else torch.int16)).sum())
                   for n in names) / sum(b[n].numel() for n in names)

    fp8 = [n for n in states[1] if states[1][n].dtype == torch.float8_e4m3fn]
    d8, d16 = density(states[0], states[1], fp8), density(bf16[0], bf16[1], fp8)
    assert 0 < d8 < d16, (d8, d16)  # e4m3 has 3 mantissa bits: most of an RL step stays inside one fp8 step


@pytest.mark.parametrize("quant, transform", [
    ("online", "online FP8 quantization"),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}, "per-tensor FP8 scales"),
    ("ue8m0", "UE8M0"),
])
def test_engines_that_transform_weights_after_loading_are_refused_before_any_write(quant, transform):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    cfg, bf16, states = fp8_states("qwen3")
    if quant == "online":  # --quantization fp8 over a bf16 checkpoint
        host, state = engine(cfg, Fp8Config(is_checkpoint_fp8_serialized=False, activation_scheme="dynamic")), bf16[0]
    elif quant == "ue8m0":  # what DeepGEMM's scale requantization leaves on each scale (Blackwell)
        host, state = engine(cfg), states[0]
        host.model.model.layers[1].mlp.down_proj.weight_scale_inv.format_ue8m0 = True
    else:
        host, state = engine(cfg, quant), states[0]
    before = weights(host)
    ok, msg = host.call("_apply_delta_payload", full_flushes(state, version=1)[:1])
    assert not ok and transform in msg and "layer 'model.layers." in msg, msg
    assert delta_status(host.model).code == "unsupported"
    assert_untouched(host, before)


def test_an_fp8_nan_value_is_refused_and_nothing_is_written():
    cfg, _, states = fp8_states("qwen3")
    host = engine(cfg)
    full_sync(host, states[0])
    name = "model.layers.0.mlp.down_proj.weight"
    new = states[1][name].clone()
    new.view(torch.uint8).view(-1)[5] = 0x7F  # e4m3fn NaN: never a quantizer's output
    before = weights(host)
    ok, msg = apply(host, delta_flushes({name: states[0][name]}, {name: new}, "deltas", version=2, base_version=1))[0]
    assert not ok and "NaN among values" in msg and name in msg, msg
    assert_untouched(host, before)


def test_a_block_scale_without_its_weight_is_refused():
    cfg, _, states = fp8_states("qwen3")
    host = engine(cfg)
    full_sync(host, states[0])
    new = dict(states[0])
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    new[name] = new[name] * 2  # rescales every byte of its blocks: a silently wrong layer if applied
    before = weights(host)
    results = apply(host, delta_flushes(states[0], new, "deltas", version=2, base_version=1))
    assert not results[-1][0] and f"{name!r} changed in version 2 without" in results[-1][1], results
    assert_untouched(host, before)


def loader_path_engine(cfg):
    """An FP8 engine without direct path (its loader copies one weight from a temporary): every fp8 param must
    travel dense to it."""
    return copy_from_a_temporary(engine(cfg))


def test_sparse_fp8_to_an_engine_without_views_is_refused_and_dense_lands():
    cfg, _, states = fp8_states("qwen3")
    host = loader_path_engine(cfg)
    full_sync(host, states[0])
    dense = delta_status(host.model).dense
    assert dense and all(states[0][n].dtype == torch.float8_e4m3fn for n in dense)
    before = weights(host)
    fp8 = lambda s: {n: s[n] for n in dense}  # noqa: E731  (one request: nothing written before the refusal)
    ok, msg = apply(host, delta_flushes(fp8(states[0]), fp8(states[1]), "deltas", version=2, base_version=1))[0]
    assert not ok and "status lists it under 'dense'" in msg and delta_status(host.model).code == "needs_dense", msg
    assert_untouched(host, before)
    results = apply(host, delta_flushes(states[0], states[1], "deltas", version=2, base_version=1, dense=dense))
    assert all(ok for ok, _ in results), results
    assert_params_equal(host.model, reference(cfg, states[1]))


@pytest.mark.parametrize("encoding", ["deltas_zstd", "xor_zstd"])
def test_the_sender_diffs_quantized_bytes_into_fp8_engines(tmp_path, encoding):
    """slime's updater hands the sender the converted (quantized) tensors: it diffs their bytes, learns after the
    full sync which engine takes fp8 only dense, and the fingerprint covers fp8 weights and scales."""
    cfg, _, states = fp8_states("qwen3-moe")
    engines = [InProcessEngine(engine(cfg)), InProcessEngine(loader_path_engine(cfg))]
    sender = DeltaSender(DiskTransport(str(tmp_path), engines, zstd=zstd_level(encoding)), engines,
                         encoding=encoding, buffer_bytes=64 << 10, fingerprint_every=1)
    for v, state in enumerate(states, start=1):
        chunks = list(state.items())
        results = sender.update([lambda: (chunks[i:i + 9] for i in range(0, len(chunks), 9))])
        assert all(ok for ok, _ in results.values()), results
        m = sender.pop_metrics()
        # all but the one param the second engine's loader copies from a temporary (model.norm.weight)
        assert m["perf/update_weights_fingerprint_uncovered"] == 1 and m["perf/update_weights_fingerprint_mismatches"] == 0
        if v > 1:
            assert m["perf/update_weights_full_sync_engines"] == 0 and 0 < m["perf/update_weights_density"] < 0.05
        for e in engines:
            assert_params_equal(e.host.model, reference(cfg, state))
    assert sender.status[1].dense and not sender.status[0].dense


@pytest.mark.parametrize("encoding", ["xor_zstd", "xor_ctx"])
def test_an_fp8_engine_rebuilds_xor_deltas_of_e4m3_bytes_and_fp32_scales(tmp_path, encoding):
    """An FP8 engine whose params all have recorded views takes the XOR encodings: ``xor_ctx`` codes the e4m3 bytes and
    the fp32 scales with their own contexts (each dtype's exponent field)."""
    cfg, _, states = fp8_states("qwen3-moe")
    engines = [InProcessEngine(engine(cfg))]
    sender = DeltaSender(DiskTransport(str(tmp_path), engines, zstd=zstd_level(encoding)), engines,
                         encoding=encoding, buffer_bytes=64 << 10)
    for v, state in enumerate(states, start=1):
        chunks = list(state.items())
        results = sender.update([lambda: (chunks[i:i + 9] for i in range(0, len(chunks), 9))])
        assert all(ok for ok, _ in results.values()), results
        m = sender.pop_metrics()
        if v > 1:
            assert m["perf/update_weights_xor"] == 1 and m["perf/update_weights_ctx"] == (encoding == "xor_ctx"), m
        assert_params_equal(engines[0].host.model, reference(cfg, state))
