"""Speculative decoding: SGLang's own draft classes beside their targets (Qwen3-MoE MTP, DeepSeek-V3 NextN with MLA,
GLM-4.x MoE NextN), sharing the target's embedding and LM head as SGLang's EAGLE worker makes them share them, take
every sync with the target as one model (``draft.bind_draft``): both bit-identical to a plain load of both after a
full sync and delta syncs, derived MLA projections of both re-derived, nothing written twice to the shared tensors,
and an engine whose draft is not bound refused before any write."""
import copy

import pytest
import torch

from cpu_harness import Host, InProcessEngine, bf16_state, hf_config, hf_model, nan_filled, rl_steps, segments, \
    sglang_model, with_nextn
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


def eagle_engine(root, target, draft_model, **sender_args):
    """``target`` on an EAGLE engine in process, ``draft_model`` bound to it (None: not bound), and a disk sender to
    it under ``root``: (the pair or None, transport, sender)."""
    host = Host(target)
    host.server_args.speculative_algorithm = "EAGLE"
    pair = None if draft_model is None else draft.bind_draft(target, draft_model)
    engine = InProcessEngine(host)
    transport = DiskTransport(str(root), [engine], zstd=1)
    return pair, transport, DeltaSender(transport, [engine], **sender_args)


def mtp_states(steps: int) -> list:
    """The trainer's states at step 0..``steps`` (AdamW), each with its MTP layer (:func:`with_mtp`) moved too."""
    trainer = hf_model(CFG)
    return [with_mtp(s, k) for k, s in enumerate([bf16_state(trainer)] + list(rl_steps(trainer, steps)))]


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
    pair, transport, sender = eagle_engine(tmp_path, target, mtp, encoding=encoding, fingerprint_every=1)
    for k, state in enumerate(mtp_states(3)):
        ok, msg = sender.update(segments(state))[0]
        assert ok, msg
        m = sender.pop_metrics()
        assert (m["perf/update_weights_failures"], m["perf/update_weights_fingerprint_mismatches"],
                m["perf/update_weights_full_sync_engines"]) == (0, 0, int(k == 0)), m
        assert (k == 0) == ("perf/update_weights_draft_share" not in m), m  # the draft's names: learnt at the full
        assert k == 0 or 0 < m["perf/update_weights_draft_share"] < 1, m  # its MTP layer moves with the model
        assert_params_equal(pair, plain_load(monkeypatch, state))
    assert delta_status(target).applied == {"full": 1, "delta": 3}  # the target's status is the pair's
    assert mtp.model.embed_tokens.weight is target.model.embed_tokens.weight and mtp.lm_head.weight is \
        target.lm_head.weight
    transport.close()


def test_a_speculative_engine_whose_draft_is_not_bound_is_refused_before_any_write(monkeypatch, tmp_path):
    """``--speculative-algorithm`` set and no draft bound: the full sync is refused ``unsupported``, naming why, and
    no weight of the target is written (all still NaN)."""
    target, _ = target_and_draft(monkeypatch)
    _, transport, sender = eagle_engine(tmp_path, target, None, encoding="xor_zstd")
    ok, msg = sender.update(segments(with_mtp(bf16_state(hf_model(CFG)), 0)))[0]
    assert not ok and "speculative decoding (EAGLE): this engine's draft model is not bound" in msg, msg
    assert delta_status(target).code == "unsupported"
    assert all(torch.isnan(p.float()).all() for p in target.parameters() if p.dtype.is_floating_point)
    transport.close()


NEXTN = {"deepseek-v3": ("deepseek_nextn", "DeepseekV3ForCausalLMNextN"),
         "glm4-moe": ("glm4_moe_nextn", "Glm4MoeForCausalLMNextN")}


def nextn_pair(monkeypatch, arch):
    """SGLang's target and its NextN draft class, the draft holding the target's embedding and head; the trainer's
    model has one layer more, the NextN layer's. DeepSeek-V3's both re-derive MLA's ``w_kc``/``w_vc`` after loading."""
    import importlib

    from cpu_harness import _engine_config

    cfg = hf_config(arch)
    cfg.num_nextn_predict_layers = 1
    target = nan_filled(sglang_model(cfg))
    module, cls = NEXTN[arch]
    engine_cfg = _engine_config(copy.deepcopy(cfg), "DeepseekV3ForCausalLM") if arch == "deepseek-v3" else \
        copy.deepcopy(cfg)
    with torch.device("cpu"):
        nextn = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls)(engine_cfg)
    nextn = nan_filled(nextn.to(torch.bfloat16))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    nextn.set_embed_and_head(*target.get_embed_and_head())
    return cfg, target, nextn


def assert_same_pair(model, ref, mla: bool) -> None:
    """Params bit-identical, and with MLA every layer's derived ``w_kc``/``w_vc`` (the target's and the NextN's)."""
    assert_params_equal(model, ref)
    pairs = [(getattr(a, d), getattr(b, d)) for a, b in zip(model.modules(), ref.modules()) for d in ("w_kc", "w_vc")
             if getattr(b, d, None) is not None]
    assert len(pairs) == (2 * 3 if mla else 0)  # two target layers and the NextN's
    for x, y in pairs:
        assert x is not None and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


@pytest.mark.parametrize("arch, encoding", [("deepseek-v3", "deltas_zstd"), ("deepseek-v3", "xor_ctx"),
                                            ("glm4-moe", "xor_zstd")])
def test_a_nextn_draft_takes_every_sync_with_its_target(monkeypatch, tmp_path, arch, encoding):
    """DeepSeek-V3 or GLM-4.x MoE and its NextN draft, bound: a full sync then two AdamW steps leave both models'
    params (and DeepSeek's absorbed MLA projections, of both) bit-identical to a plain load of both. Each loader
    post-processes its own layers: DeepSeek's target below ``num_hidden_layers``, its NextN the one layer."""
    cfg, target, nextn = nextn_pair(monkeypatch, arch)
    pair, transport, sender = eagle_engine(tmp_path, target, nextn, encoding=encoding, fingerprint_every=1)
    trainer_cfg = copy.deepcopy(cfg)
    trainer_cfg.num_hidden_layers += 1
    trainer = hf_model(trainer_cfg)
    steps = rl_steps(trainer, 2)
    state = with_nextn(bf16_state(trainer), cfg.num_hidden_layers, 0)
    for k in range(3):
        ok, msg = sender.update(segments(state))[0]
        assert ok, msg
        m = sender.pop_metrics()
        assert (m["perf/update_weights_failures"], m["perf/update_weights_fingerprint_mismatches"]) == (0, 0), m
        _, ref_target, ref_nextn = nextn_pair(monkeypatch, arch)
        ref_target.load_weights(list(state.items()))
        ref_nextn.load_weights(list(state.items()))
        assert_same_pair(pair, draft.TargetAndDraft(ref_target, ref_nextn), mla=arch == "deepseek-v3")
        state = with_nextn(next(steps), cfg.num_hidden_layers, k + 1) if k < 2 else state
    assert delta_status(target).applied == {"full": 1, "delta": 2}
    assert nextn.lm_head.weight is target.lm_head.weight
    transport.close()


def test_a_full_sync_that_leaves_the_drafts_own_layer_unwritten_keeps_it_and_says_so(monkeypatch, tmp_path, caplog):
    """A trainer that sends nothing for the draft's own layer (slime without ``--enable-mtp-training``: the draft
    runs on its startup weights, as upstream) or names it otherwise than the draft's loader: the syncs land, the
    draft's own params stay as loaded (its shared embedding and head move with the target), and the engine says
    so, naming one."""
    target, mtp = target_and_draft(monkeypatch)
    with torch.no_grad():
        mtp.fc.weight.fill_(0.5)  # its startup weights
    pair, transport, sender = eagle_engine(tmp_path, target, mtp, encoding="xor_zstd", fingerprint_every=1)
    trainer = hf_model(CFG)
    steps = rl_steps(trainer, 1)
    for state in (bf16_state(trainer), next(steps)):
        with caplog.at_level("WARNING"):
            ok, msg = sender.update(segments(state))[0]
        assert ok, msg
        ref = plain_load(monkeypatch, state)
        for n, p in pair.named_parameters():
            if n.startswith("draft.") and n not in ("draft.model.embed_tokens.weight", "draft.lm_head.weight"):
                continue
            assert torch.equal(p.view(torch.int16), dict(ref.named_parameters())[n].view(torch.int16)), n
    assert bool((mtp.fc.weight == 0.5).all())
    assert "the full sync wrote nothing into 13 of the draft's own params ('fc.weight', ...)" in caplog.text
    transport.close()


def test_a_trainer_that_trains_the_draft_stops_when_its_names_do_not_reach_it(monkeypatch, tmp_path):
    """The same full sync from a trainer that trains the draft's layers (``draft_trained``: slime's
    ``--enable-mtp-training``), its MTP names not the draft loader's: the engine's status counts the draft's params
    it wrote nothing into, and the sender stops, naming the engine (the failure that drafts with stale weights and
    no wrong token); with the names the draft takes, the same sender goes on."""
    from sglang.srt.weight_sync.delta.wire import DeltaError

    for names_reach, state_of in ((False, lambda s: {n.replace("mtp.", "model.mtp."): t for n, t in s.items()}),
                                  (True, lambda s: s)):
        target, mtp = target_and_draft(monkeypatch)
        _, transport, sender = eagle_engine(tmp_path / str(names_reach), target, mtp, encoding="xor_zstd",
                                            draft_trained=True)
        state = state_of(with_mtp(bf16_state(hf_model(CFG)), 0))
        if names_reach:
            assert all(ok for ok, _ in sender.update(segments(state)).values())
            assert delta_status(target).draft_unwritten == 0
        else:
            with pytest.raises(DeltaError, match=r"engine\(s\) \[0\]: the full sync wrote nothing into 13 of the "
                                                 "speculative draft's own params while the trainer trains them"):
                sender.update(segments(state))
            assert delta_status(target).draft_unwritten == 13
        transport.close()

