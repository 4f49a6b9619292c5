"""The loader is watched per thread: a loader's own worker threads are guarded, every other thread is left alone,
and a write into the model from another thread during an apply fails it closed. The watch is handed the ops that can
write (a private dispatch key the watching threads include), or, where that key is taken, every op (a dispatch mode):
the ``watch`` fixture runs a test both ways.

Real SGLang Qwen2 through the real receiver. The model's ``load_weights`` is made to load each tensor on a
thread pool it creates (as the DeepSeek-V2/V3 loader does for host tensors) and copies one tensor from a
temporary (so deltas go through the loader, not the direct path) — the conditions under which a process-wide,
save-and-restore patch of ``copy_`` fails.
"""
import collections
import concurrent.futures
import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from cpu_harness import Host, delta_flushes, full_flushes, hf_config, nan_filled, rl_states, sglang_model
from delta_helpers import assert_params_equal, copy_from_a_temporary
from sglang.srt.weight_sync.delta import write_guard
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


def key_taken():
    """The op filter as it stands where another library holds its dispatch key: watches run as dispatch modes."""
    held = write_guard._OpFilter()
    held.taken = True
    return held


@pytest.fixture(params=["filter", "mode"])
def watch(request, monkeypatch):
    """``filter``: the watch is handed the ops that can write; ``mode``: the filter key is taken, it sees every op."""
    write_guard._FILTER.sync()
    assert write_guard._FILTER.key is not None  # nothing in this process holds the key
    if request.param == "mode":
        monkeypatch.setattr(write_guard, "_FILTER", key_taken())
    return request.param


def test_a_write_that_bypasses_copy_in_a_loader_worker_is_refused(watch):
    """The aten-level guard runs in the loader's worker threads too (a watch is per thread)."""
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


@pytest.mark.parametrize("arch", ["qwen2", "qwen3-moe", "deepseek-v3"])
def test_the_watch_is_handed_the_writes_not_the_views(arch):
    """A full sync's watch is handed only ops whose schema writes (and ``cat``): never the views and ``.data``
    detaches a loader runs per tensor, nor the copies the recorder explains. It still sees every other write the
    dispatch mode sees (more: the copies inside a composite op such as ``to``), and the verdict is the same."""
    cfg = hf_config(arch)
    state = rl_states(cfg, 0, seed=0)[0]
    native, seen = write_guard.FullSyncWatch.__torch_dispatch__, {}

    def counted(self, func, types, args=(), kwargs=None):
        seen[path].append(func)
        return native(self, func, types, args, kwargs)

    for path in ("filter", "mode"):
        seen[path] = []
        host = Host(nan_filled(sglang_model(cfg)))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(write_guard.FullSyncWatch, "__torch_dispatch__", counted)
            if path == "mode":
                mp.setattr(write_guard, "_FILTER", key_taken())
            assert all(apply(host, [pl])[0] for pl in full_flushes(state, version=1))
        seen[path + " direct"] = sorted(receiver_state(host.model).direct)
    writes = {p: collections.Counter(str(f) for f in seen[p] if write_guard._writes(f) or f is torch.ops.aten.cat.default)
              for p in ("filter", "mode")}
    assert sum(writes["filter"].values()) == len(seen["filter"])  # nothing else handed over
    assert writes["filter"]["aten.copy_.default"] < len(state) // 2 < writes["mode"]["aten.copy_.default"]
    writes["mode"].pop("aten.copy_.default")
    assert writes["mode"] and not writes["mode"] - writes["filter"]  # the fills and cats
    assert len(seen["mode"]) >= 5 * len(seen["filter"])  # the views, detaches, reads and copies the mode is handed
    assert seen["filter direct"] == seen["mode direct"] and seen["filter direct"]


def native_style_op(name: str):
    """A custom op that writes its argument as a native kernel does: no aten op inside."""

    @torch.library.custom_op(name, mutates_args=("x",))
    def op(x: torch.Tensor) -> None:
        bits = x.detach().view(torch.int16).numpy()
        bits[:] = bits

    return op


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_write_by_an_op_registered_after_the_filter_is_seen(watch, when):
    """An op the filter did not know when it was set up (a kernel library loaded later) that a loader writes a param
    with keeps the model off the direct path. Registered before the full sync, it gets its kernel when the scope
    opens; registered while the loader runs, it is not watched under the filter, and the full sync learns of it when
    its scope closes."""
    name = f"delta_test::scale_{watch}_{when}"
    ops = [native_style_op(name)] if when == "before" else []
    cfg = hf_config("qwen2")
    state = rl_states(cfg, 0, seed=0)[0]
    host = Host(nan_filled(sglang_model(cfg)))
    native = host.model.load_weights

    def load_weights(weights):
        native(weights)
        if not ops:
            ops.append(native_style_op(name))
        ops[0](dict(host.model.named_parameters())["model.norm.weight"])

    host.model.load_weights = load_weights
    assert all(apply(host, [pl])[0] for pl in full_flushes(state, version=1))
    assert receiver_state(host.model).direct == {}
    assert_params_equal(host.model, reference(cfg, state))


def test_a_delta_apply_during_which_an_op_that_writes_is_registered_fails_closed():
    """The delta apply's guard cannot mask what it did not see: the apply fails, the engine is dirty, and the next
    (full) sync restores it."""
    cfg = hf_config("qwen2")
    states = rl_states(cfg, 1, seed=0)
    host = copy_from_a_temporary(Host(nan_filled(sglang_model(cfg))))
    assert all(apply(host, [pl])[0] for pl in full_flushes(states[0], version=1))
    native = host.model.load_weights

    def load_weights(weights):
        @torch.library.custom_op("delta_test::late_fill_", mutates_args=("x",))
        def late_fill_(x: torch.Tensor) -> None:
            pass

        return native(weights)

    host.model.load_weights = load_weights
    ok, msg = apply(host, delta_flushes(states[0], states[1], "deltas", version=2, base_version=1))
    assert not ok and "delta_test::late_fill_ can write and was registered while the loader ran, unwatched: a NaN " \
        "sentinel may have reached the model" in msg, msg
    assert receiver_state(host.model).dirty
    host.model.load_weights = native
    assert all(apply(host, [pl])[0] for pl in full_flushes(states[1], version=3))
    assert_params_equal(host.model, reference(cfg, states[1]))


def test_other_threads_trace_fake_tensors_while_a_loader_is_watched(watch):
    """The filter's registrations change nothing for a thread that does not watch: fake-tensor tracing and
    ``torch.compile`` in another thread, while a full sync's loader runs, behave as always."""
    cfg = hf_config("qwen2")
    state = rl_states(cfg, 0, seed=0)[0]
    go, done, seen = threading.Event(), threading.Event(), {}

    def bystander():
        go.wait(60)
        try:
            with FakeTensorMode():
                seen["narrow"] = type(torch.empty(4, 4).narrow(0, 1, 2).add_(1))
            seen["compiled"] = torch.compile(lambda a: (a * 2).sum(), backend="eager")(torch.ones(3)).item()
        finally:
            done.set()

    host = Host(nan_filled(sglang_model(cfg)))
    native = host.model.load_weights

    def load_weights(weights):
        go.set()
        done.wait(120)
        return native(weights)

    host.model.load_weights = load_weights
    t = threading.Thread(target=bystander, name="bystander")
    t.start()
    assert all(apply(host, [pl])[0] for pl in full_flushes(state, version=1))
    t.join(60)
    assert seen == {"narrow": FakeTensor, "compiled": 6.0}
    assert receiver_state(host.model).direct
    assert_params_equal(host.model, reference(cfg, state))


def test_a_torch_without_the_filter_key_watches_with_a_mode(monkeypatch):
    """Where the filter cannot be set up (here: a key this torch does not know), the watches run as dispatch modes
    and the full sync records the direct path as before; nothing is left unwatched."""
    cfg = hf_config("qwen2")
    state = rl_states(cfg, 0, seed=0)[0]
    unknown = write_guard._OpFilter()
    unknown.NAME = "NoSuchDispatchKey"
    monkeypatch.setattr(write_guard, "_FILTER", unknown)
    host = Host(nan_filled(sglang_model(cfg)))
    assert all(apply(host, [pl])[0] for pl in full_flushes(state, version=1))
    assert unknown.taken and unknown.key is None
    assert receiver_state(host.model).direct
    assert_params_equal(host.model, reference(cfg, state))


def test_a_step_below_the_filter_key_leaves_the_thread_as_it_found_it():
    """A recorded copy and a watched op run below the key by flipping this thread's excluded state: the state
    comes back when the op raises, and a step nested in another (the watch running its op) leaves the outer
    exclusion in place."""
    write_guard._FILTER.sync()
    key = write_guard._FILTER.key
    assert key is not None  # this torch has the key free: the filter, not the mode fallback
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
    assert not excluded(key)
    seen = []

    def failing():
        seen.append(excluded(key))
        raise ValueError("the op failed")

    with pytest.raises(ValueError, match="the op failed"):
        write_guard._below_key(key, failing)
    assert seen == [True] and not excluded(key)

    def nested():
        write_guard._below_key(key, lambda: seen.append(excluded(key)))
        return excluded(key)

    assert write_guard._below_key(key, nested) is True
    assert seen == [True, True] and not excluded(key)
