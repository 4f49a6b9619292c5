"""Host synchronizations per flush do not grow with the number of params (counted on CPU by a dispatch mode).

On a GPU every op that needs a device value on the host (``.item()``, ``nonzero``, ``unique``, boolean
indexing, a device-to-host copy) stalls the stream for tens of microseconds; done per param, that decides
the sync time of a model with tens of thousands of tensors. The same ops dispatch on CPU, so counting them
here proves the property the GPU needs: the engine's validation of a flush, the whole apply of a delta through
the direct path, and the sender's diff and encode synchronize a constant number of times however many params the
flush holds.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from delta_helpers import per_param
from cpu_harness import Host, SyncCounter, delta_flushes, full_flushes, hf_config, rl_states, sglang_model
from sglang.srt.weight_sync.delta import device
from sglang.srt.weight_sync.delta.diff import changed_positions, encode_flush
from sglang.srt.weight_sync.delta.validate import validate_payload


def _flush(n_params: int, encoding: str, numel: int = 4096, changed: int = 40, seed: int = 0):
    """One flush of ``n_params`` bf16 params with ``changed`` changed elements each (gaps past 65535 in one)."""
    g = torch.Generator().manual_seed(seed)
    entries = []
    for k in range(n_params):
        size = numel if k else 1 << 17  # the first param needs u32 gaps: both width groups are present
        old = torch.randn(size, generator=g).to(torch.bfloat16)
        new = old.clone()
        idx = torch.randperm(size, generator=g)[:changed].sort().values
        new[idx] = (new[idx].float() + 1).to(torch.bfloat16)
        entries.append((f"p{k}", new, changed_positions(old, new)))
    return encode_flush(entries, encoding, version=2, base_version=1)


def _count(fn):
    with SyncCounter() as c:
        fn()
    return c.ops


@pytest.mark.parametrize("encoding", ["indices", "deltas"])
def test_validating_a_flush_synchronizes_a_constant_number_of_times(encoding):
    few, many = _flush(4, encoding), _flush(400, encoding)
    ops_few = _count(lambda: validate_payload(few, None))
    ops_many = _count(lambda: validate_payload(many, None))
    assert ops_few == ops_many, (ops_few, ops_many)
    assert len(ops_many) <= 4, ops_many  # the checksum's two sums, the checks' flags: read once each


@pytest.mark.parametrize("device_path", [False, True])
def test_a_delta_apply_through_the_direct_path_synchronizes_a_constant_number_of_times(monkeypatch, device_path):
    """A real SGLang Qwen2 at two widths (the wider has the same params, more elements): the same count, on the
    default path and on the device path (``device.SWITCH``)."""
    if device_path:
        monkeypatch.setenv(device.SWITCH, "1")
    counts = []
    for layers in (2, 6):
        cfg = hf_config("qwen2", layers=layers)
        states = rl_states(cfg, 1, seed=0)
        host = Host(sglang_model(cfg))
        assert all(host.call("_apply_delta_payload", [pl])[0] for pl in full_flushes(states[0], version=1))
        (pl,) = delta_flushes(states[0], states[1], "deltas", version=2, base_version=1)
        assert len(pl.spec.params) > 10 * layers
        ops = _count(lambda: host.call("_apply_delta_payload", [pl]))
        counts.append(ops)
    assert counts[0] == counts[1] and len(counts[1]) <= 4, counts


class OpCounter(TorchDispatchMode):
    """Counts the ops that compute (not views), one kernel launch each on a GPU; ``only``: just these ops."""

    def __init__(self, only=None):
        super().__init__()
        self.n, self.only = 0, only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket is self.only if self.only is not None else not func.is_view
        return func(*args, **(kwargs or {}))


SCATTER = torch.ops.aten.index_copy_  # how direct writes and the snapshot fold write storage

@pytest.mark.parametrize("layers", [2, 6])
def test_direct_writes_scatter_once_per_destination_not_per_tensor(layers):
    """A real SGLang Qwen3-MoE: every expert's gate/up/down lands in one fused weight per layer, and a delta that
    changes all of them writes each fused weight with one scatter (a dense model: one per fused QKV/gate-up too)."""
    cfg = hf_config("qwen3-moe", layers=layers)
    states = rl_states(cfg, 1, seed=0)
    host = Host(sglang_model(cfg))
    assert all(host.call("_apply_delta_payload", [pl])[0] for pl in full_flushes(states[0], version=1))
    (pl,) = delta_flushes(states[0], states[1], "deltas", version=2, base_version=1)
    storages = {p.untyped_storage().data_ptr() for p in host.model.parameters()}
    assert len(pl.spec.params) > 2 * len(storages)  # far more HF tensors than destinations
    with OpCounter(SCATTER) as c:
        ok, msg = host.call("_apply_delta_payload", [pl])
    assert ok, msg
    assert c.n <= len(storages), (c.n, len(storages), len(pl.spec.params))


@pytest.mark.parametrize("n, slab", [(6, None), (300, None), (300, 1 << 10)])
def test_the_snapshot_folds_a_sync_in_once_per_slab_not_per_tensor(n, slab, monkeypatch):
    """The sender's snapshot is cut from shared slabs (exact sizes: no pinned power-of-two rounding per tensor), and
    a sync's changes go in with one scatter per slab and dtype, bit for bit, fp8 included; with small slabs, tensors
    larger than one get their own allocation."""
    from sglang.srt.weight_sync.delta import snapshot
    from sglang.srt.weight_sync.delta.snapshot import DeltaState

    if slab:
        monkeypatch.setattr(snapshot, "_SLAB", slab)

    g = torch.Generator().manual_seed(n)
    dtypes = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]
    old = {f"p{k}": torch.randn(7 + 3 * k, 5, generator=g).to(dtypes[k % 3]) for k in range(n)}
    state = DeltaState(torch.device("cpu"), fold_behind=False)  # folded in this thread, where the ops are counted
    state.record(list(old.items()), [])
    state.commit(1)
    groups = {(t.untyped_storage().data_ptr(), t.dtype) for t in state.snapshot.values()}
    storages = [t.untyped_storage().data_ptr() for t in state.snapshot.values()]
    big = [t.untyped_storage().data_ptr() for t in state.snapshot.values()
           if t.numel() * t.element_size() > snapshot._SLAB]
    assert len(set(storages)) == 1 if not slab else (0 < len(big) < n and len(set(storages)) < n)
    assert all(storages.count(ptr) == 1 for ptr in big)  # a tensor larger than a slab has its own allocation
    new = {}
    for name, t in old.items():
        t = t.clone()
        flat = t.view(-1).view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2
                               else torch.int32)
        flat[torch.randperm(flat.numel(), generator=g)[:3]] ^= 1
        new[name] = t
    chunk = list(new.items())
    state.record(chunk, state.changes(chunk, [state.snapshot[k] for k in new]))
    with OpCounter(SCATTER) as c:
        state.commit(2)
    assert c.n == len(groups) and (slab or c.n == len(dtypes))
    for name, t in new.items():
        assert torch.equal(state.snapshot[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("slab", [None, 4096])
def test_a_chunks_snapshot_is_fetched_with_one_copy_per_slab_range(monkeypatch, slab):
    """The CUDA prefetch's plan, run with host copies: a chunk recorded in one order is fetched with one copy per
    slab it lies in, in any order; a sparse pick of it copies each tensor alone (a span would move >2x its bytes);
    every fetched tensor is bit-identical to its snapshot, and a name without one stays None."""
    from sglang.srt.weight_sync.delta import snapshot
    from sglang.srt.weight_sync.delta.snapshot import DeltaState, _fetch

    if slab:
        monkeypatch.setattr(snapshot, "_SLAB", slab)
    g = torch.Generator().manual_seed(5)
    dtypes = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]
    state = DeltaState(torch.device("cpu"))
    state.record([(f"p{k}", torch.randn(3 + k, 9, generator=g).to(dtypes[k % 3])) for k in range(30)], [])
    state.commit(1)
    snap = state.snapshot
    cpu = torch.device("cpu")
    storages = {t.untyped_storage().data_ptr() for t in snap.values()}
    cases = [(list(snap), len(storages)), (list(snap)[::-1], len(storages))]
    if not slab:  # one slab: every third tensor spans ~3x its bytes
        cases.append((list(snap)[::3], 10))
    for names, copies_wanted in cases:
        hosts = [snap[n] for n in names] + [None]
        views, copies = _fetch(hosts, [cpu] * len(hosts), lambda src, device: src.clone())
        assert len(copies) == copies_wanted and views[-1] is None
        for t, v in zip(hosts, views):
            if t is not None:
                assert v.dtype == t.dtype and v.shape == t.shape and v.data_ptr() != t.data_ptr()
                assert torch.equal(v.view(torch.uint8), t.view(torch.uint8))


def test_the_diff_launches_a_constant_number_of_ops_per_batch():
    """The sender's diff: 10 or 100 params of two dtypes, one with staged positions, take the same ops — compare,
    gather and split per dtype and batch, never per param — and every param's positions and values are its own
    diff's."""
    from sglang.srt.weight_sync.delta import diff

    counts = []
    for n in (5, 50):
        g = torch.Generator().manual_seed(n)
        olds = [torch.randn(256, generator=g).bfloat16() for _ in range(n)] + \
            [torch.randn(64, generator=g) for _ in range(n)]
        news = [o.clone() for o in olds]
        for t in news[1:]:
            t[::7] += 1
        staged = [torch.tensor([1, 2])] + [None] * (2 * n - 1)
        with OpCounter() as c:
            got = diff.changes_many(list(zip(olds, news)), staged)
        counts.append(c.n)
        for k, (old, new, (idx, values, _)) in enumerate(zip(olds, news, per_param(got, len(olds)))):
            want = changed_positions(old, new) if k else torch.tensor([1, 2])
            assert torch.equal(idx, want) and torch.equal(values, new[want]), k
    assert counts[0] == counts[1], counts


def _synced_sender(tmp_path, layers: int, encoding: str):
    """A disk sender whose engine (a real Qwen3-MoE of ``layers`` layers, in process) took step 0 as its full sync;
    and the two states."""
    from cpu_harness import InProcessEngine
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport

    cfg = hf_config("qwen3-moe", layers=layers)
    states = rl_states(cfg, 1, seed=0)
    engine = InProcessEngine(Host(sglang_model(cfg)))
    sender = DeltaSender(DiskTransport(str(tmp_path / str(layers)), [engine]), [engine], encoding=encoding)
    assert sender.update([lambda: [list(states[0].items())]])[0][0]
    return sender, states


class AllOps(TorchDispatchMode):
    """Counts every op, views included, apart: host work per call even where no kernel runs."""

    def __init__(self):
        super().__init__()
        self.compute = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.compute += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("encoding", ["deltas", "xor_zstd"])
def test_a_cpu_senders_tensor_ops_do_not_follow_the_params(tmp_path, encoding):
    """The sender on CPU (numpy's diff) over a real Qwen3-MoE at 2 and 6 layers (~3x the tensors): the same count
    of computing ops, and views only from joining the chunk for its diff (two per param, inside one C++ call). A
    diff's params stay joined through bucket, encode and snapshot fold: nothing is cut, viewed or copied per param."""
    counts = []
    for layers in (2, 6):
        sender, states = _synced_sender(tmp_path, layers, encoding)
        with AllOps() as ops:
            assert sender.update([lambda: [list(states[1].items())]])[0][0]
        counts.append((len(states[1]), ops.compute, ops.views))
        sender.transport.close()
    (n2, compute2, views2), (n6, compute6, views6) = counts
    assert n6 > 2.5 * n2 and compute2 == compute6 and views6 - views2 <= 2 * (n6 - n2), counts


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("encoding", ["deltas", "xor_zstd"])
def test_the_sender_synchronizes_a_constant_number_of_times_per_chunk_and_flush(tmp_path, monkeypatch, encoding,
                                                                                device_path):
    """The sender's side of a delta sync (diff against the snapshot, bucket, encode) on a real Qwen3-MoE at 2 and 6
    layers (5x the tensors), one chunk and one flush per dtype: the same count of host synchronizations and of
    computing ops (a launch each on a GPU; ``xor_zstd``'s base values come out of the diff too), on the default path
    and on the device path (prefetch and copies back included). DiskTransport calls the engine on its threads (not
    counted)."""
    if device_path:
        monkeypatch.setenv(device.SWITCH, "1")
    counts = []
    for layers in (2, 6):
        sender, states = _synced_sender(tmp_path, layers, encoding)
        with OpCounter() as launches:
            ops = _count(lambda: sender.update([lambda: [list(states[1].items())]]))
        m = sender.pop_metrics()
        assert sender.state.version == 2 and 0 < m["perf/update_weights_density"] < 0.2, m
        counts.append((ops, launches.n))
        sender.transport.close()
    assert counts[0] == counts[1] and len(counts[1][0]) <= 4, counts  # the chunk's diff: 2; the flush's encode: 2


def _sharded_counts(rank, world, ep, port, out):
    """On one rank of a TP engine (``ep``: its MoE layers' expert-parallel width): the host syncs and computing ops of
    a delta's apply on a real Qwen3-MoE at (layers, experts) = (2, 4), (6, 4), (2, 16)."""
    try:
        torch.set_num_threads(1)
        from cpu_harness import init_sglang_inprocess

        init_sglang_inprocess(tp_rank=rank, tp_size=world, init_method=f"tcp://127.0.0.1:{port}", ep_size=ep)
        counts = {}
        for layers, experts in ((2, 4), (6, 4), (2, 16)):
            cfg = hf_config("qwen3-moe", layers=layers)
            cfg.num_experts = experts
            states = rl_states(cfg, 1, seed=0)
            host = Host(sglang_model(cfg))
            assert all(host.call("_apply_delta_payload", [pl])[0] for pl in full_flushes(states[0], version=1))
            (pl,) = delta_flushes(states[0], states[1], "deltas", version=2, base_version=1)
            with OpCounter() as launches:
                ops = _count(lambda: host.call("_apply_delta_payload", [pl]))
            counts[layers, experts] = (ops, launches.n, len(pl.spec.params))
        out.put((rank, counts))
    except BaseException:
        import traceback

        out.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("ep", [1, 2])
def test_a_sharded_engines_apply_does_not_follow_the_params(ep):
    """TP=2 (every expert row- and column-sharded over both ranks) and TP=2 with EP=2 (each rank holds half the
    experts whole, the attention sharded): on every rank, the host synchronizations of a delta's apply are the same
    at 2 and 6 layers, and its computing ops (a kernel launch each on a GPU) the same at 4 and 16 experts per layer
    (4x the HF tensors into the same storages): the shards are written per storage, not per param, and the other
    rank's experts cost nothing."""
    import multiprocessing as mp

    from cpu_harness import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_sharded_counts, args=(r, 2, ep, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, counts in got.items():
        assert not isinstance(counts, str), counts
        (syncs2, launches2, n2), (syncs6, _, n6), (syncs16, launches16, n16) = (counts[k] for k in ((2, 4), (6, 4), (2, 16)))
        assert n6 > 2.5 * n2 and n16 > 2.5 * n2, (n2, n6, n16)
        assert syncs2 == syncs6 == syncs16 and len(syncs2) <= 5, (rank, syncs2, syncs6, syncs16)
        assert launches2 == launches16, (rank, launches2, launches16)


def test_xor_ctx_codes_and_decodes_a_flush_with_a_constant_number_of_syncs_and_launches():
    """Its coder runs per flush and per segment of the flush's sparse params joined (small params share one), never
    per param: 100 params and 400 params cost the same host reads and the same kernel launches (both have classes of
    each kind: rank gaps of changed and of unchanged elements, dense and sparse steps)."""
    from sglang.srt.weight_sync.delta.files import flush_file, read_safetensors
    from sglang.srt.weight_sync.delta.validate import uncode

    def flush(n_params):
        g = torch.Generator().manual_seed(1)
        olds, entries = {}, []
        for k in range(n_params):
            old = (torch.randn(4096, generator=g) * 0.02).to(torch.bfloat16)
            new = old.clone()
            idx = torch.randperm(4096, generator=g)[:40].sort().values
            new[idx] = (new[idx].float() * 1.01).to(torch.bfloat16)
            olds[f"p{k}"] = old
            entries.append((f"p{k}", new, changed_positions(old, new)))
        return encode_flush(entries, "xor_ctx", bases=[olds[n] for n, _, _ in entries], version=2, base_version=1), olds

    counts = []
    for n in (100, 400):
        pl, olds = flush(n)
        names = [p.name for p in pl.spec.params]
        read = lambda pieces: torch.cat([olds[names[k]][a:a + m] for k, a, m in pieces])  # noqa: E731
        launches = OpCounter()
        with launches, SyncCounter() as enc:
            data = flush_file(pl)
        got = read_safetensors(data)
        decode_launches = OpCounter()
        with decode_launches, SyncCounter() as dec:
            out = uncode(got, None, read)
        validate_payload(out, None)
        counts.append((len(enc.ops), len(dec.ops), launches.n, decode_launches.n))
    assert counts[0] == counts[1], counts
    print(f"xor_ctx per flush: {counts[1][0]} host reads and {counts[1][2]} launches to code, {counts[1][1]} and "
          f"{counts[1][3]} to decode")
