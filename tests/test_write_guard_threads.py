"""The loader is watched per thread: a loader's own worker threads are guarded, every other thread is left alone,
and a write into the model from another thread during an apply fails it closed.

Real SGLang Qwen2 through the real receiver. The model's ``load_weights`` is made to load each tensor on a
thread pool it creates (as the DeepSeek-V2/V3 loader does for host tensors) and copies one tensor from a
temporary (so deltas go through the loader, not the direct path) — the conditions under which a process-wide,
save-and-restore patch of ``copy_`` fails.
"""
import concurrent.futures
import threading

import torch

from cpu_harness import Host, delta_flushes, full_flushes, hf_config, nan_filled, rl_states, sglang_model
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta.receiver import receiver_state

NATIVE_COPY, NATIVE_FILL = torch.Tensor.copy_, torch.Tensor.fill_


def pooled_engine(cfg, hook=None, bypass=None):
    """A real SGLang model whose load_weights runs each tensor on a pool it creates; ``hook()`` runs first;
    ``bypass = (name, write)``: the worker loading ``name`` also calls ``write(params)``."""
    host = Host(nan_filled(sglang_model(cfg)))
    native = host.model.load_weights
    workers = set()

    def one(item):
        workers.add(threading.current_thread().name)
        if item[0] == "model.norm.weight":  # no view of the HF tensor to follow: keeps deltas on the loader path
            dict(host.model.named_parameters())[item[0]].copy_(item[1].clone())
        else:
            native([item])
        if bypass is not None and item[0] == bypass[0]:
            bypass[1](dict(host.model.named_parameters()))

    def load_weights(weights):
        if hook is not None:
            hook()
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="loader") as pool:
            list(pool.map(one, list(weights)))

    host.model.load_weights = load_weights
    return host, workers


def apply(host, payloads):
    return host.call("_apply_delta_payload", payloads)


def reference(cfg, state):
    ref = nan_filled(sglang_model(cfg))
    ref.load_weights(list(state.items()))
    return ref


def test_a_loader_on_its_own_thread_pool_is_masked_in_its_workers():
    cfg = hf_config("qwen2")
    states = rl_states(cfg, 2, seed=0)
    host, workers = pooled_engine(cfg)
    assert all(apply(host, [pl])[0] for pl in full_flushes(states[0], version=1))
    assert receiver_state(host.model).direct == {}  # the copy from a temporary: every delta goes through the loader
    for v in (2, 3):
        workers.clear()
        ok, msg = apply(host, delta_flushes(states[v - 2], states[v - 1], "deltas", version=v, base_version=v - 1))
        assert ok, msg
        assert workers and all(w.startswith("loader") for w in workers)  # the NaN sentinels met copy_ there
        assert_params_equal(host.model, reference(cfg, states[v - 1]))
    assert (torch.Tensor.copy_, torch.Tensor.fill_) == (NATIVE_COPY, NATIVE_FILL)  # nothing left installed


def test_a_write_that_bypasses_copy_in_a_loader_worker_is_refused():
    """The aten-level guard runs in the loader's worker threads too (a dispatch mode is per thread)."""
    cfg = hf_config("qwen2")
    states = rl_states(cfg, 1, seed=0)
    armed = [False]

    def scale(params):
        if armed[0]:
            params["model.norm.weight"].mul_(1.0)

    host, _ = pooled_engine(cfg, bypass=("model.norm.weight", scale))
    assert all(apply(host, [pl])[0] for pl in full_flushes(states[0], version=1))
    armed[0] = True
    state = dict(states[1])
    state["model.norm.weight"] = states[0]["model.norm.weight"].clone()
    state["model.norm.weight"].view(-1)[:3] += 0.5
    ok, msg = apply(host, delta_flushes(states[0], state, "deltas", version=2, base_version=1))
    assert not ok and "param 'model.norm.weight': the model's loader writes it with aten.mul_.Tensor outside the " \
        "NaN-masked copy_; refused before that write" in msg, msg
    assert receiver_state(host.model).dirty


def test_another_threads_write_into_the_model_fails_the_apply_closed():
    cfg = hf_config("qwen2")
    states = rl_states(cfg, 1, seed=0)
    go, done, armed = threading.Event(), threading.Event(), [False]

    def stray():  # started before the apply, writes into a weight while the apply runs
        go.wait(60)
        norm = dict(host.model.named_parameters())["model.norm.weight"]
        with torch.no_grad():
            norm.copy_(torch.full_like(norm, 7.0))
        done.set()

    def hook():
        if armed[0]:
            armed[0] = False
            go.set()
            done.wait(60)

    host, _ = pooled_engine(cfg, hook)
    assert all(apply(host, [pl])[0] for pl in full_flushes(states[0], version=1))
    t = threading.Thread(target=stray, name="stray-writer")
    t.start()
    armed[0] = True
    ok, msg = apply(host, delta_flushes(states[0], states[1], "deltas", version=2, base_version=1))
    t.join(60)
    assert not ok and "another thread wrote into the model during the apply (stray-writer: copy_ into " \
        "'model.norm.weight')" in msg and "engine is dirty and needs a full sync" in msg, msg
    st = receiver_state(host.model)
    assert st.dirty and st.version == 1
    assert all(apply(host, [pl])[0] for pl in full_flushes(states[1], version=3))  # the full sync restores
    assert_params_equal(host.model, reference(cfg, states[1]))


def test_other_threads_keep_native_ops_during_an_apply():
    """A thread outside the apply copies NaN into its own tensors: copied as is, not masked, apply unaffected."""
    cfg = hf_config("qwen2")
    states = rl_states(cfg, 1, seed=0)
    go, done, seen = threading.Event(), threading.Event(), {}

    def bystander():
        go.wait(60)
        dst = torch.zeros(8)
        dst.copy_(torch.full((8,), float("nan")))
        dst[:2].fill_(float("nan"))
        seen["nan"] = bool(torch.isnan(dst).all())
        done.set()

    def hook():
        if not go.is_set():
            go.set()
            done.wait(60)

    host, _ = pooled_engine(cfg)
    assert all(apply(host, [pl])[0] for pl in full_flushes(states[0], version=1))
    host.model.load_weights, native = None, host.model.load_weights

    def load_weights(weights):
        hook()
        return native(weights)

    host.model.load_weights = load_weights
    t = threading.Thread(target=bystander, name="bystander")
    t.start()
    ok, msg = apply(host, delta_flushes(states[0], states[1], "deltas", version=2, base_version=1))
    t.join(60)
    assert ok, msg
    assert seen["nan"] is True
    assert_params_equal(host.model, reference(cfg, states[1]))
