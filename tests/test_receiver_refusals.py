"""Every bad input is refused whole, with an error naming the cause, and leaves the weights untouched."""
import os

import pytest
import torch
import zstandard

from cpu_harness import Host, delta_flushes, full_flushes, hf_config, rl_states, sglang_model
from sglang.srt.weight_sync.delta.receiver import receiver_state
from sglang.srt.weight_sync.delta.diff import changed_positions, encode_flush
from sglang.srt.weight_sync.delta.files import as_parts, write_safetensors
from sglang.srt.weight_sync.delta.wire import DeltaParam

_STATES = {}


def states():
    if not _STATES:
        cfg = hf_config("qwen2")
        _STATES["cfg"], _STATES["s"] = cfg, rl_states(cfg, 2, seed=0)
    return _STATES["cfg"], _STATES["s"]


@pytest.fixture
def engine(tmp_path):
    """A real SGLang Qwen2 at committed version 1 (full sync of step 0 applied)."""
    cfg, s = states()
    host = Host(sglang_model(cfg))
    ok, msg = host.call("_apply_delta_payload", full_flushes(s[0], version=1))
    assert ok, msg
    host.tmp = tmp_path
    return host


def weights(host):
    return {n: p.detach().clone() for n, p in host.model.named_parameters()}


def assert_untouched(host, before):
    for n, p in host.model.named_parameters():
        assert torch.equal(p.detach().view(torch.int16), before[n].view(torch.int16)), f"{n} was written"


def good_delta(version=2, base=1, encoding="indices"):
    _, s = states()
    return delta_flushes(s[0], s[1], encoding, version=version, base_version=base)[0]


def reseal(pl):
    return pl.seal()


def write_file(host, data: bytes, name="rank0000_flush000000.safetensors", vdir="weight_v000002"):
    d = host.tmp / vdir
    d.mkdir(exist_ok=True)
    (d / name).write_bytes(data)
    return str(d), name


def first_sparse(pl) -> DeltaParam:
    return next(p for p in pl.spec.params if p.pos_width and p.nnz >= 2)


def _flip_position_bit(pl):
    pl.positions[3] ^= 0x10
    return pl


def _flip_value_bit(pl):
    pl.values.view(torch.int16)[5] ^= 1
    return pl


def _swap_values(pl):
    p = first_sparse(pl)
    v = pl.values
    i, j = p.val_start, p.val_start + 1
    v[[i, j]] = v[[j, i]]
    return pl


def _out_of_range(pl):
    p = first_sparse(pl)
    pl.positions[p.pos_end - 4:p.pos_end] = torch.tensor(list((p.numel + 7).to_bytes(4, "little")), dtype=torch.uint8)
    return reseal(pl)


def _duplicate(pl):
    p = first_sparse(pl)
    pl.positions[p.pos_start + 4:p.pos_start + 8] = pl.positions[p.pos_start:p.pos_start + 4]
    return reseal(pl)


def _nan_value(pl):
    pl.values[first_sparse(pl).val_start] = float("nan")
    return reseal(pl)


def _unknown_name(pl):
    pl.spec.params[0].name = "model.layers.9.mlp.secret.weight"
    return reseal(pl)


def _shape_mismatch(pl):
    p = first_sparse(pl)
    p.shape = [p.numel]
    return reseal(pl)


def _not_tiled(pl):
    last = pl.spec.params[-1]  # one value (and its position) left over at the end of both blobs
    last.val_end -= 1
    last.pos_end -= last.pos_width
    return reseal(pl)


def _sparse_in_full(pl):
    pl.spec.full = True
    return reseal(pl)


def _sparse_int():
    t = torch.arange(10, dtype=torch.int32)
    pl = encode_flush([("model.norm.weight", t, None)], "indices", version=2, base_version=1)
    pl.spec.params[0].pos_width = 4
    pl.spec.params[0].pos_end = 4
    pl.positions = torch.zeros(4, dtype=torch.uint8)
    pl.values = t[:1].clone()
    pl.spec.params[0].val_end = 1
    return reseal(pl)


def _sign_bit_pair(pl):
    """Two values whose sign bit is bit 63 of their u64 word (index 3 mod 4): a linear sum missed this."""
    v = pl.values.view(torch.int16)
    v[3] ^= -0x8000
    v[7] ^= -0x8000
    return pl


def _same_shape_pair(pl):
    by_shape = {}
    for p in pl.spec.params:
        by_shape.setdefault((tuple(p.shape), p.dtype), []).append(p)
    return next(ps for ps in by_shape.values() if len(ps) >= 2)[:2]


def _swap_names(pl):
    a, b = _same_shape_pair(pl)
    a.name, b.name = b.name, a.name
    return pl


def _shift_offsets(pl):
    """Every param of the flush reads the next one's blob ranges: still tiles, still in the manifest."""
    ps = pl.spec.params
    ranges = [(p.pos_start, p.pos_end, p.pos_width, p.val_start, p.val_end) for p in ps]
    for p, r in zip(ps, ranges[1:] + ranges[:1]):
        p.pos_start, p.pos_end, p.pos_width, p.val_start, p.val_end = r
    return pl


REFUSALS = [
    (lambda: _sign_bit_pair(good_delta()), "checksum mismatch"),
    (lambda: _swap_names(good_delta()), "checksum mismatch"),
    (lambda: _shift_offsets(good_delta()), "checksum mismatch"),
    (lambda: _flip_position_bit(good_delta()), "checksum mismatch"),
    (lambda: _flip_value_bit(good_delta()), "checksum mismatch"),
    (lambda: _swap_values(good_delta()), "checksum mismatch"),
    (lambda: _out_of_range(good_delta()), "out of range for"),
    (lambda: _duplicate(good_delta()), "duplicate position"),
    (lambda: _nan_value(good_delta()), "NaN among values"),
    (lambda: _unknown_name(good_delta()), "unknown parameter name"),
    (lambda: _shape_mismatch(good_delta()), "differ from the manifest"),
    (lambda: _not_tiled(good_delta()), "blobs must be tiled exactly"),
    (lambda: _sparse_in_full(good_delta()), "a full sync must send every param dense"),
    (_sparse_int, "cannot travel sparse"),
    (lambda: good_delta(version=1, base=0), "duplicate, replayed or out-of-order"),
    (lambda: good_delta(version=3, base=2), "cannot apply to an engine at committed version 1"),
]


@pytest.mark.parametrize("make, message", REFUSALS)
def test_refused_in_memory_and_on_disk(engine, make, message):
    before = weights(engine)
    ok, msg = engine.call("_apply_delta_payload", [make()])
    assert not ok and message in msg, msg
    pl = make()
    vdir, name = write_file(engine, write_safetensors(pl.spec, pl.positions, pl.values))
    ok, msg = engine.call("_apply_delta", vdir, [name], None)
    assert not ok and message in msg, msg
    assert_untouched(engine, before)
    assert receiver_state(engine.model).version == 1 and not receiver_state(engine.model).dirty
    ok, msg = engine.call("_apply_delta_payload", [good_delta()])  # the engine still takes the good delta
    assert ok, msg


def test_replay_after_commit_and_out_of_order_flush(engine):
    _, s = states()
    flushes = delta_flushes(s[0], s[1], "deltas", version=2, base_version=1, max_params=5)
    assert engine.call("_apply_delta_payload", [flushes[0]])[0]
    ok, msg = engine.call("_apply_delta_payload", [flushes[2]])
    assert not ok and "flush 2 of version 2 is out of order (expected flush 1)" in msg
    # a refusal after part of a sync was written leaves the engine dirty: only a full sync is accepted
    assert receiver_state(engine.model).dirty
    ok, msg = engine.call("_apply_delta_payload", [flushes[1]])
    assert not ok and "engine is dirty" in msg
    assert engine.call("_apply_delta_payload", full_flushes(s[1], version=2))[0]
    assert not receiver_state(engine.model).dirty
    ok, msg = engine.call("_apply_delta_payload", full_flushes(s[1], version=2))
    assert not ok and "full sync version 2 is not newer than the committed version 2 (replayed?)" in msg


def test_first_sync_must_be_full(tmp_path):
    cfg, _ = states()
    host = Host(sglang_model(cfg))
    ok, msg = host.call("_apply_delta_payload", [good_delta()])
    assert not ok and "the first sync must be full" in msg


def test_weight_version_must_match(engine):
    ok, msg = engine.call("_apply_delta_payload", [good_delta()], "7")
    assert not ok and "weight_version '7' differs from the delta's version 2" in msg


def test_file_refusals(engine, tmp_path):
    before = weights(engine)
    pl = good_delta()
    data = write_safetensors(pl.spec, pl.positions, pl.values)
    vdir, name = write_file(engine, data)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(data)
    os.symlink(outside, os.path.join(vdir, "link.safetensors"))
    write_file(engine, data[:-7], name="truncated.safetensors")
    write_file(engine, (1 << 40).to_bytes(8, "little") + data[8:], name="header.safetensors")
    write_file(engine, zstandard.ZstdCompressor(level=1).compress(b"\0" * (128 << 20)), name="bomb.safetensors")
    write_file(engine, b"\x28\xb5\x2f\xfd" + b"\x01" * 40, name="badzstd.safetensors")
    cases = [
        (["../weight_v000002/" + name], "must be a plain file name"),
        (["link.safetensors"], "resolves outside model_path (symlink escape)"),
        (["missing.safetensors"], "cannot read"),
        (["truncated.safetensors"], "truncated"),
        (["header.safetensors"], "safetensors header length 1099511627776 exceeds the 67108864-byte cap"),
        (["bomb.safetensors"], "zstd output exceeds"),
        (["badzstd.safetensors"], "bad zstd frame"),
        ([], "needs 'files'"),
        ([name, name], "parts [0, 0]: one is missing or repeated"),
    ]
    for files, message in cases:
        ok, msg = engine.call("_apply_delta", vdir, files, None)
        assert not ok and message in msg, (files, msg)
    assert_untouched(engine, before)
    ok, msg = engine.call("_apply_delta", vdir, [name], "2")
    assert ok, msg


def test_a_flush_in_another_dtype_than_the_manifest_is_refused(engine):
    """Self-consistent (values, spec and checksum agree on float16) but the first full sync had bfloat16."""
    _, s = states()
    name = "model.norm.weight"
    new = s[1][name].clone()
    new.view(-1)[:4] += 1
    as_f16 = new.to(torch.float16)
    old = s[0][name].to(torch.float16)
    pl = encode_flush([(name, as_f16, changed_positions(old, as_f16))], "deltas", version=2, base_version=1)
    before = weights(engine)
    ok, msg = engine.call("_apply_delta_payload", [pl])
    assert not ok and f"param {name!r}: shape/dtype {list(new.shape)} float16 differ from the manifest's " \
        f"{list(new.shape)} bfloat16" in msg, msg
    assert_untouched(engine, before)
    assert receiver_state(engine.model).last[1] == "manifest"


def test_speculative_engine_refused(engine):
    before = weights(engine)
    engine.server_args.speculative_algorithm = "EAGLE"  # what a server launched with --speculative-algorithm has
    ok, msg = engine.call("_apply_delta_payload", [good_delta()])
    assert not ok and "speculative decoding (EAGLE): this engine's draft model is not bound to delta weight sync" \
        in msg, msg
    assert_untouched(engine, before)
    assert receiver_state(engine.model).last[1] == "unsupported"


def test_a_param_in_two_files_of_one_request(engine):
    """A param may come in pieces over a request's files only as a sparse delta written through recorded views,
    each piece past the last: the same positions twice are refused before a write, as is a param twice in a full
    sync's request (a loader would take each file's as the whole param)."""
    before = weights(engine)
    ok, msg = engine.call("_apply_delta_payload", as_parts([good_delta(), good_delta()]))
    assert not ok and "its pieces in the files of one request overlap or come out of order" in msg, msg
    assert_untouched(engine, before)
    _, s = states()
    ok, msg = engine.call("_apply_delta_payload", as_parts(full_flushes(s[1], version=2) +
                                                           full_flushes(s[1], version=2)))
    assert not ok and "appears in two files of one request, which only a sparse delta" in msg, msg
    assert_untouched(engine, before)


def test_pieces_of_a_param_this_rank_does_not_hold_are_taken():
    """Pieces of a param this rank does not hold (a tied lm_head here; another rank's experts at EP > 1, which a
    sender splits as it splits any param every engine writes through views): taken, and nothing of them written."""
    cfg = hf_config("qwen3-tied")
    s = rl_states(cfg, 1, seed=0)
    host = Host(sglang_model(cfg))
    assert host.call("_apply_delta_payload", full_flushes(s[0], version=1))[0]
    name = "lm_head.weight"
    assert receiver_state(host.model).unheld == {name}
    before = weights(host)
    at = changed_positions(s[0][name], s[1][name])
    half = at.numel() // 2
    pieces = [encode_flush([(name, s[1][name], part)], "indices", version=2, base_version=1)
              for part in (at[:half], at[half:])]
    ok, msg = host.call("_apply_delta_payload", as_parts(pieces))
    assert ok, msg
    assert_untouched(host, before)


def _updater():
    """SGLang's ``WeightUpdater`` module where this pin has one (0.5.23), else None (0.5.15 has no weight cache and no
    derived-weight caches: nothing for a delta to guard against)."""
    import importlib

    try:
        return importlib.import_module("sglang.srt.model_executor.model_runner_components.weight_updater")
    except ImportError:
        import sglang.srt.model_executor.model_runner as runner

        assert "weight_cache" not in open(runner.__file__).read()
        return None


def test_a_delta_is_refused_where_upstream_refuses_an_in_place_update(engine):
    """Each condition upstream checks before an in-place update (``_assert_weight_cache_inactive``,
    ``_unsupported_derived_weight_cache_error``), forced on a real engine: the delta is refused before its first write
    with code ``unsupported`` and upstream's message, and lands once the condition is gone."""
    updater = _updater()
    if updater is None:
        ok, msg = engine.call("_apply_delta_payload", [good_delta()])
        assert ok, msg
        return
    from sglang.srt import runtime_context

    layer = engine.model.model.layers[0]
    conditions = {
        "the weight cache is active (--weight-cache-mode shared)": (
            lambda: runtime_context.get_model()._set("weight_cache_mode", "shared"),
            lambda: runtime_context.get_model()._set("weight_cache_mode", "off"),
            "is not supported while the weight cache is active (--weight-cache-mode shared)"),
        "compensated mHC weight splits": (
            lambda: setattr(layer, "_hc_attn_tf32_parts", torch.zeros(1)),
            lambda: delattr(layer, "_hc_attn_tf32_parts"),
            "Online weight updates are not supported while compensated mHC weight splits are active"),
        "a model-owned derived-weight cache": (
            lambda: setattr(layer, "_derived_weight_cache_error", "the DSA indexer keeps a derived copy"),
            lambda: delattr(layer, "_derived_weight_cache_error"),
            "the DSA indexer keeps a derived copy"),
    }
    for what, (force, lift, message) in conditions.items():
        before = weights(engine)
        force()
        try:
            ok, msg = engine.call("_apply_delta_payload", [good_delta()])
        finally:
            lift()
        assert not ok and message in msg, (what, msg)
        assert_untouched(engine, before)
        assert receiver_state(engine.model).last[1] == "unsupported", what
    ok, msg = engine.call("_apply_delta_payload", [good_delta()])
    assert ok, msg
