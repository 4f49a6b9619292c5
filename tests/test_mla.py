"""Post-processing models on the direct path: SGLang's DeepSeek-V3 and GLM-4.7-Flash classes (the DeepSeek-V2/V3
weight loader of DeepSeek-V3/R1, Kimi-K2, GLM-4.7-Flash) in-process. Its loader fuses ``q_a_proj`` and ``kv_a_proj_with_mqa`` with a
``torch.cat`` before one copy, and ``post_load_weights`` derives each layer's ``w_kc``/``w_vc`` from ``kv_b_proj``:
deltas are written through the recorded views and the derivation re-runs for the touched layers only."""
import pytest
import torch

from cpu_harness import FP8_BLOCK, Host, InProcessEngine, delta_flushes, fp8_block_quantize, full_flushes, hf_config, \
    nan_filled, rl_states, sglang_model
from delta_helpers import assert_params_equal, gloo_fixture
from sglang.srt.weight_sync.delta.receiver import receiver_state
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport
from test_receiver_inprocess import make_transport

_STATES = {}


gloo = gloo_fixture("delta-mla-test")  # the fixture make_transport asks for


def states(arch, dtype):
    """Three AdamW steps of a transformers DeepSeek-V3 / GLM-4.7-Flash (experts split into the checkpoint's
    per-expert names), as bf16 or after slime's block-FP8 conversion."""
    if (arch, dtype) not in _STATES:
        cfg = hf_config(arch, hidden=256)  # FP8 blocks of 128 fit every projection
        bf16 = rl_states(cfg, 2, seed=0)
        _STATES[arch, dtype] = (cfg, bf16 if dtype == "bf16" else [fp8_block_quantize(s) for s in bf16])
    return _STATES[arch, dtype]


def reference(cfg, state, quant):
    ref = nan_filled(sglang_model(cfg, quant))
    ref.load_weights(list(state.items()))
    return ref


def assert_same_model(model, ref):
    """Params bit-identical, and the tensors ``post_load_weights`` derived from them."""
    assert_params_equal(model, ref)
    for a, b in zip(model.model.layers, ref.model.layers):
        for derived in ("w_kc", "w_vc"):
            x, y = getattr(a.self_attn, derived), getattr(b.self_attn, derived)
            assert x.stride() == y.stride() and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), derived


QUANTS = {"bf16": None, "fp8": FP8_BLOCK}
ARCHS = ["deepseek-v3", "glm4.7-flash"]


@pytest.mark.parametrize("kind, encoding", [("disk", "deltas_zstd"), ("disk", "planes_zstd"), ("disk", "xor_zstd"),
                                            ("distributed", "deltas")])
@pytest.mark.parametrize("dtype", sorted(QUANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_mla_deltas_take_the_direct_path_and_rederive_touched_layers(request, tmp_path, arch, dtype, kind, encoding):
    quant = QUANTS[dtype]
    cfg, seq = states(arch, dtype)
    transport = make_transport(request, kind, tmp_path)
    host = Host(nan_filled(sglang_model(cfg, quant)), chunk_bytes=64 << 10)
    # one flush per dtype: the loader fuses q_a/kv_a only within one call (the sender test splits by module)
    assert all(ok for ok, _ in transport.apply(host, full_flushes(seq[0], version=1), encoding))
    state = receiver_state(host.model)
    assert set(state.direct) == set(seq[0]) and state.dense == []  # the fused q_a/kv_a halves included
    model = host.model
    native_load, native_post, loads, posts = model.load_weights, model.post_load_weights, [], []
    model.load_weights = lambda w: loads.append([n for n, _ in w]) or native_load(w)

    def post_load_weights(is_nextn=False, weight_names=None):
        posts.append(weight_names)
        return native_post(is_nextn=is_nextn, weight_names=weight_names)

    model.post_load_weights = post_load_weights
    for v in (2, 3):
        old, new = seq[v - 2], seq[v - 1]
        payloads = delta_flushes(old, new, encoding, version=v, base_version=v - 1, max_params=9,
                                 raw=state.xor_raw)
        del posts[:]
        assert all(ok for ok, _ in transport.apply(host, payloads, encoding))
        assert loads == []  # not one param through the loader
        assert posts and all(names for names in posts)  # re-derived per request, for the names written only
        changed = {n for pl in payloads for p in pl.spec.params if p.nnz for n in [p.name]}
        assert {n for names in posts for n in names} == changed
        assert_same_model(model, reference(cfg, new, quant))



@pytest.mark.parametrize("dtype", sorted(QUANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_the_sender_keeps_fused_siblings_in_one_flush(tmp_path, arch, dtype):
    """A bucket of a few KiB flushes after almost every param; it still never separates q_a_proj from
    kv_a_proj_with_mqa (SGLang's DeepSeek loader drops a pair split across two load_weights calls), so the full sync
    lands whole, the fingerprint covers every name, and the deltas that follow are bit-identical."""
    quant = QUANTS[dtype]
    cfg, seq = states(arch, dtype)
    engine = InProcessEngine(Host(nan_filled(sglang_model(cfg, quant))))
    sender = DeltaSender(DiskTransport(str(tmp_path), [engine]), [engine], encoding="deltas",
                         buffer_bytes=4 << 10, fingerprint_every=1)
    for state in seq:
        names = list(state)  # one segment per layer: each layer's files are one request, in many flushes
        layers = sorted({n.split(".")[2] for n in names if n.startswith("model.layers.")})
        groups = [[n for n in names if not n.startswith("model.layers.")]] + \
            [[n for n in names if n.startswith(f"model.layers.{k}.")] for k in layers]
        results = sender.update([lambda g=g: ([(n, state[n])] for n in g) for g in groups])
        assert results[0][0], results
        m = sender.pop_metrics()
        assert m["perf/update_weights_fingerprint_uncovered"] == 0 and m["perf/update_weights_fingerprint_mismatches"] == 0
        assert_same_model(engine.host.model, reference(cfg, state, quant))
