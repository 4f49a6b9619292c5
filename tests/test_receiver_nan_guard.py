"""NaN-leak guard (slime#2209): writes into weights that bypass the masked ``copy_`` during a delta apply.

Real SGLang MoE classes: their unquantized expert loads go through ``copy_``; their scale loaders
index-assign (``FusedMoE._load_per_tensor_weight_scale``, ``_load_single_value``), called here the
way the model calls them, with NaN sentinels in the loaded tensor. Loader bypasses the guard cannot
see (``param.data = …``) or must not run (in-place arithmetic) fail the sync loudly, and the full
sync that follows restores the weights bit-identically.
"""
import pytest
import torch

from cpu_harness import Host, delta_flushes, full_flushes, hf_config, nan_filled, rl_states, sglang_model
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta.receiver import receiver_state
from sglang.srt.weight_sync.delta.write_guard import delta_apply_context


def synced(arch):
    cfg = hf_config(arch)
    states = rl_states(cfg, 1, seed=0)
    host = Host(nan_filled(sglang_model(cfg)))
    for pl in full_flushes(states[0], version=1):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    return cfg, states, host


def with_nan_sentinels(new: torch.Tensor, every: int = 3) -> torch.Tensor:
    out = new.clone()
    out.view(-1)[::every] = float("nan")
    return out


@pytest.mark.parametrize("arch", ["qwen2-moe", "qwen3-moe"])
@pytest.mark.parametrize("loader", ["_load_per_tensor_weight_scale", "_load_single_value"])
def test_moe_index_assigning_loaders_are_masked(arch, loader):
    _, _, host = synced(arch)
    experts = host.model.model.layers[0].mlp.experts
    param = experts.w2_weight
    before = param.detach().clone()
    new = torch.randn_like(param[1])
    sent = with_nan_sentinels(new)
    kwargs = dict(shard_id="w2") if loader == "_load_per_tensor_weight_scale" else {}
    with torch.no_grad(), delta_apply_context(host.model) as guard:
        getattr(experts, loader)(param=param, loaded_weight=sent, expert_id=1, **kwargs)
    assert sum(guard.caught.values()) == 1, guard.caught  # the index-assignment bypassed copy_ and was masked
    keep = torch.isnan(sent)
    assert not torch.isnan(param).any()
    assert torch.equal(param[1][keep], before[1][keep]) and torch.equal(param[1][~keep], new[~keep])
    assert torch.equal(param[0], before[0]) and torch.equal(param[2:], before[2:])


def bypassing_loader(host, target, write):
    """The model's own load_weights, except that ``target`` is written by ``write(param, tensor)``."""
    params = dict(host.model.named_parameters())
    native = host.model.load_weights

    def load_weights(weights):
        rest = []
        for name, t in weights:
            if name == target[0]:
                write(params[target[1]], t)
            else:
                rest.append((name, t))
        return native(rest)

    host.model.load_weights = load_weights
    return lambda: setattr(host.model, "load_weights", native)


@pytest.mark.parametrize("write, error", [
    (lambda p, t: setattr(p, "data", t.clone()),
     "param 'model.norm.weight': the loader replaced its tensor (param.data = ...) with unmasked NaN sentinels"),
    (lambda p, t: p.mul_(1.0),
     "param 'model.norm.weight': the model's loader writes it with aten.mul_.Tensor outside the NaN-masked copy_; "
     "refused before that write"),
])
def test_loader_bypasses_fail_the_sync_then_a_full_sync_restores(write, error):
    # The bypassing loader is the model's from the start: the full sync sees it (no recorded view copy
    # for the norm), so the delta goes through the loader, where the guard must catch it.
    cfg = hf_config("qwen3")
    states = rl_states(cfg, 1, seed=0)
    host = Host(nan_filled(sglang_model(cfg)))
    restore = bypassing_loader(host, ("model.norm.weight", "model.norm.weight"), write)
    for pl in full_flushes(states[0], version=1):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    st = receiver_state(host.model)
    assert "model.norm.weight" not in st.direct and not st.unheld  # a name stored unseen is never skipped as not held
    state = dict(states[1])
    state["model.norm.weight"] = states[0]["model.norm.weight"].clone()
    state["model.norm.weight"].view(-1)[:3] += 0.5  # a sparse change: the rest travels as NaN sentinels
    (pl,) = delta_flushes(states[0], state, "deltas", version=2, base_version=1)
    ok, msg = host.call("_apply_delta_payload", [pl])
    restore()
    assert not ok and error in msg and "engine is dirty and needs a full sync" in msg, msg
    assert receiver_state(host.model).dirty
    for pl in full_flushes(state, version=3):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    ref = nan_filled(sglang_model(cfg))
    ref.load_weights(list(state.items()))
    assert_params_equal(host.model, ref)


def test_a_param_replaced_after_its_copy_takes_deltas_through_the_loader():
    # The loader copies into the norm, then replaces its tensor: the view the full sync recorded points into memory the
    # param no longer holds, so the direct plan leaves the norm out and its deltas go through the loader.
    cfg = hf_config("qwen3")
    states = rl_states(cfg, 1, seed=0)
    host = Host(nan_filled(sglang_model(cfg)))

    def copy_then_replace(p, t):
        p.data.copy_(t)
        p.data = p.data.clone()

    restore = bypassing_loader(host, ("model.norm.weight", "model.norm.weight"), copy_then_replace)
    for pl in full_flushes(states[0], version=1):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    direct = receiver_state(host.model).direct
    assert "model.norm.weight" not in direct and "model.layers.0.self_attn.q_proj.weight" in direct
    state = dict(states[1])
    state["model.norm.weight"] = states[0]["model.norm.weight"].clone()
    state["model.norm.weight"].view(-1)[:3] += 0.5
    for pl in delta_flushes(states[0], state, "deltas", version=2, base_version=1):
        ok, msg = host.call("_apply_delta_payload", [pl])
        assert ok, msg
    restore()
    ref = nan_filled(sglang_model(cfg))
    ref.load_weights(list(state.items()))
    assert_params_equal(host.model, ref)
