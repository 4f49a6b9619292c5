"""Speculative decoding: an MTP draft (SGLang's own ``Qwen3MoeForCausalLMMTP``) beside its Qwen3-MoE target, sharing
the target's embedding and LM head as SGLang's EAGLE worker makes it share them, takes every sync with the target as
one model (``draft.bind_draft``): both bit-identical to a plain load of both after a full sync and delta syncs in
every disk encoding, nothing written twice to the shared tensors, and an engine whose draft is not bound refused
before any write."""
import copy

import pytest
import torch

from cpu_harness import Host, InProcessEngine, bf16_state, hf_config, hf_model, nan_filled, rl_steps, segments, \
    sglang_model
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta import draft
from sglang.srt.weight_sync.delta.receiver import delta_status
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport

CFG = hf_config("qwen3-moe")


def target_and_draft(monkeypatch):
    """A target, and its MTP draft holding the target's embedding and head (``set_embed_and_head``, SGLang's own;
    its CUDA cache calls are no-ops here)."""
    from sglang.srt.models.qwen3_moe_mtp import Qwen3MoeForCausalLMMTP

    target = nan_filled(sglang_model(CFG))
    with torch.device("cpu"):
        mtp = nan_filled(Qwen3MoeForCausalLMMTP(copy.deepcopy(CFG)).to(torch.bfloat16))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    mtp.set_embed_and_head(*target.get_embed_and_head())
    return target, mtp


def with_mtp(state: dict, seed: int) -> dict:
    """The trainer's state with an MTP layer (``mtp.*``, as the checkpoints of MTP models name it) that moves too."""
    g = torch.Generator().manual_seed(seed)
    out, h = dict(state), CFG.hidden_size
    for n, t in state.items():
        if n.startswith("model.layers.0."):
            out["mtp.layers.0." + n[len("model.layers.0."):]] = \
                (t.float() + 1e-3 * torch.randn(t.shape, generator=g)).to(t.dtype)
    out["mtp.fc.weight"] = (torch.randn(h, 2 * h, generator=g) * 0.02).to(torch.bfloat16)
    for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        out[n] = (1 + 1e-2 * torch.randn(h, generator=g)).to(torch.bfloat16)
    return out


def plain_load(monkeypatch, state):
    target, mtp = target_and_draft(monkeypatch)
    target.load_weights(list(state.items()))
    mtp.load_weights(list(state.items()))
    return draft.TargetAndDraft(target, mtp)


@pytest.mark.parametrize("encoding", ["deltas_zstd", "xor_zstd", "xor_ctx"])
def test_an_mtp_draft_takes_every_sync_with_its_target(monkeypatch, tmp_path, encoding):
    """A full sync then three AdamW steps (the MTP layer moving as well): target and draft bit-identical to a plain
    load of both after each, the fingerprint of both equal to the trainer's at every sync, and the draft's
    embedding and head still the target's own tensors. ``xor_*`` values applied twice to a shared tensor would
    revert it: bit-identity after every step shows each was written once."""
    target, mtp = target_and_draft(monkeypatch)
    host = Host(target)
    host.server_args.speculative_algorithm = "EAGLE"
    pair = draft.bind_draft(target, mtp)
    engine = InProcessEngine(host)
    transport = DiskTransport(str(tmp_path), [engine], zstd=1)
    sender = DeltaSender(transport, [engine], encoding=encoding, fingerprint_every=1)
    trainer = hf_model(CFG)
    state = with_mtp(bf16_state(trainer), 0)
    steps = rl_steps(trainer, 3)
    for k in range(4):
        ok, msg = sender.update(segments(state))[0]
        assert ok, msg
        m = sender.pop_metrics()
        assert (m["perf/update_weights_failures"], m["perf/update_weights_fingerprint_mismatches"],
                m["perf/update_weights_full_sync_engines"]) == (0, 0, int(k == 0)), m
        assert_params_equal(pair, plain_load(monkeypatch, state))
        state = with_mtp(next(steps), k + 1) if k < 3 else state
    assert delta_status(target).applied == {"full": 1, "delta": 3}  # the target's status is the pair's
    assert mtp.model.embed_tokens.weight is target.model.embed_tokens.weight and mtp.lm_head.weight is \
        target.lm_head.weight
    transport.close()


def test_a_speculative_engine_whose_draft_is_not_bound_is_refused_before_any_write(monkeypatch, tmp_path):
    """``--speculative-algorithm`` set and no draft bound: the full sync is refused ``unsupported``, naming why, and
    no weight of the target is written (all still NaN)."""
    target, _ = target_and_draft(monkeypatch)
    host = Host(target)
    host.server_args.speculative_algorithm = "EAGLE"
    engine = InProcessEngine(host)
    transport = DiskTransport(str(tmp_path), [engine], zstd=1)
    ok, msg = DeltaSender(transport, [engine], encoding="xor_zstd").update(
        segments(with_mtp(bf16_state(hf_model(CFG)), 0)))[0]
    assert not ok and "speculative decoding (EAGLE): this engine's draft model is not bound" in msg, msg
    assert delta_status(target).code == "unsupported"
    assert all(torch.isnan(p.float()).all() for p in target.parameters() if p.dtype.is_floating_point)
    transport.close()


def test_a_pair_whose_loaders_post_process_is_refused_naming_them(tmp_path):
    """DeepSeek-V3 and its NextN draft (SGLang's classes): both re-derive MLA's absorbed projections after loading,
    which a bound pair does not run yet: ``unsupported``, naming both classes, before any write."""
    from cpu_harness import _engine_config
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN

    cfg = hf_config("deepseek-v3")
    target = nan_filled(sglang_model(cfg))
    with torch.device("cpu"):
        nextn = DeepseekV3ForCausalLMNextN(_engine_config(copy.deepcopy(cfg), "DeepseekV3ForCausalLM"))
    draft.bind_draft(target, nextn.to(torch.bfloat16))
    host = Host(target)
    host.server_args.speculative_algorithm = "EAGLE"
    engine = InProcessEngine(host)
    transport = DiskTransport(str(tmp_path), [engine], zstd=1)
    ok, msg = DeltaSender(transport, [engine], encoding="xor_zstd").update(segments(bf16_state(hf_model(cfg))))[0]
    assert not ok and ("speculative decoding: DeepseekV3ForCausalLM, DeepseekV3ForCausalLMNextN re-derive params "
                       "after loading") in msg, msg
    assert delta_status(target).code == "unsupported"
    assert all(torch.isnan(p.float()).all() for p in target.parameters() if p.dtype.is_floating_point)
    transport.close()
