"""The sharded sender's map from a trainer rank's Megatron shard to HF names and positions, derived from slime's own
``all_gather_param`` + ``convert_to_hf`` on element ids (``delta_shard_map``): on a real Megatron GPTModel at TP=2
(one process per rank, gloo), every element a rank holds lands exactly where slime's real conversion of the gathered
param puts it, bit for bit, and the ranks together cover every HF element once (replicated params: once per rank). A
conversion that is not a permutation (FP8 quantization, an integral shift of every element) is named and keeps the
gather path; so do arithmetic on the ids (a bit flipped, a scale), a cast and an element placed twice, while rows
reversed map every element where they land (reversed vectors: runs of one element, the gather path). And the sharded
diff (``delta_shard_diff``) at TP=2 and at CP=2 (DP=2 and EP=2: the sharded sender's tests in ``test_slime_sender``):
each rank's snapshot is its own slice (together: the model once), and after real AdamW steps the changes the ranks send the source equal, position for position and bit for
bit, the diff of slime's full conversion before and after (the same in chunks of 4 KiB on the device, params cut
across them), in bytes that follow the changed elements; a diff left
unacknowledged is carried again by the next; the ranks' fingerprint shares add up to each HF tensor's; and one
diff with its commit runs as many kernels and host reads at 6 layers as at 2. A model with Megatron's MTP block
(``--mtp-num-layers``) through slime's GLM-4.x conversion: its MTP layer maps and travels as the NextN draft's layer
when it trains, and sends nothing when it does not. Also ``make gpu-check``'s
sharded-sender lane as its CPU dry run. Runs in ``make test-slime`` (needs Megatron and a patched slime checkout).""" 
import multiprocessing as mp
import os
import traceback

import pytest

SLIME = os.environ.get("SLIME_PATCHED_DIR")
EMBED = "model.embed_tokens.weight"  # the HF name slime's conversion gives the embedding
pytestmark = pytest.mark.skipif(
    not SLIME, reason="slime tests need a patched slime checkout: run `make test-slime SLIME_DIR=/path/to/slime`")


def _scatter(m, values):
    """The HF tensors this rank's shard fills through the map (unmapped elements NaN), and a mask of what it filled."""
    import torch

    flat = values.reshape(-1)
    tgt, hpos, mapped = m.locate(torch.arange(flat.numel()))
    out = []
    for j, (name, shape) in enumerate(m.targets):
        t = torch.full(shape, float("nan"), dtype=values.dtype)
        hit = torch.zeros(shape, dtype=torch.int32)
        sel = mapped & (tgt == j)
        t.view(-1)[hpos[sel]] = flat[sel]
        hit.view(-1)[hpos[sel]] = 1
        out.append((name, t, hit))
    return out


def _rank(rank, tp, port, errors):
    try:
        import torch
        import torch.distributed as dist

        import slime_harness as H
        from megatron.core import mpu
        from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
        from slime.backends.megatron_utils.update_weight.common import all_gather_param, named_params_and_buffers
        from slime.backends.megatron_utils.update_weight.delta_shard_map import build_shard_maps

        torch.set_num_threads(1)
        H.init_world(port, rank=rank, tp=tp)
        model = H.build_model()
        args = H.make_args()
        maps = build_shard_maps(args, [model], "llama")
        params = list(named_params_and_buffers(args, [model]))
        assert set(maps) == {n for n, _ in params} and all(m.pure for m in maps.values()), \
            [(m.name, m.why) for m in maps.values() if not m.pure]
        sharded = 0
        for name, param in params:
            m = maps[name]
            want = dict(convert_to_hf(args, "llama", name, all_gather_param(name, param), None))
            assert [n for n, _ in m.targets] == list(want), (name, m.targets, list(want))
            for hf_name, got, hit in _scatter(m, param.detach()):
                ref = want[hf_name]
                assert got.shape == ref.shape, (hf_name, got.shape, ref.shape)
                sel = hit.bool()
                assert torch.equal(got[sel].view(torch.int16), ref[sel].view(torch.int16)), hf_name
                dist.all_reduce(hit, group=mpu.get_tensor_model_parallel_group())
                replicated = not getattr(param, "tensor_model_parallel", False) or tp == 1
                assert bool((hit == (tp if replicated else 1)).all()), (hf_name, hit.unique())
                sharded += not replicated
            assert m.runs.shape[0] <= max(1, param.shape[0]) * len(m.targets) * 2, (name, m.runs.shape)  # runs, not elements
        assert sharded > 0 or tp == 1
        # slime's FP8 rollout conversion quantizes: not a permutation of elements
        fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        impure = [m for m in build_shard_maps(args, [model], "llama", fp8).values() if not m.pure]
        assert impure and all(m.why for m in impure), [(m.name, m.why) for m in impure]
        # a converter that shifts every element by one place (integral arithmetic: still distinct integers) maps
        # nothing: checked over the whole gathered param, so no rank takes the shift for a permutation
        from slime.backends.megatron_utils.update_weight import delta_shard_map

        real = delta_shard_map.convert_to_hf
        delta_shard_map.convert_to_hf = lambda *a, **k: [(n, t + 1) for n, t in real(*a, **k)]
        try:
            shifted = build_shard_maps(args, [model], "llama")
        finally:
            delta_shard_map.convert_to_hf = real
        assert all(not m.pure and "out of range" in m.why for m in shifted.values()), \
            [(m.name, m.why) for m in shifted.values() if m.pure]
        # the ids travel as bytes: what an adversarial converter does to them is named, and a real permutation
        # (rows reversed) still maps every element where it lands
        import itertools

        def each(f):
            return lambda hf: [(n, f(t)) for n, t in hf]

        calls = itertools.count()  # a converter that is not the same from one call to the next: every other flips
        for convert, why in ((each(lambda t: t ^ 1), ""), (each(lambda t: t * 3), ""),
                             (each(lambda t: t.to(torch.int16)), "converted to torch.int16"),
                             (each(lambda t: torch.cat([t.reshape(-1), t.reshape(-1)[:1]])), "two places"),
                             (lambda hf: hf if next(calls) % 2 else [(n, t.flip(0)) for n, t in hf], ""),
                             (each(lambda t: t.flip(0)), None)):
            delta_shard_map.convert_to_hf = lambda *a, convert=convert, **k: convert(real(*a, **k))
            try:
                got = build_shard_maps(args, [model], "llama")
            finally:
                delta_shard_map.convert_to_hf = real
            if why is not None:
                assert all(not m.pure and why in m.why for m in got.values()), [(m.name, m.why) for m in got.values()]
                continue
            for name, param in params:  # flipped: every element where the flipped conversion puts it
                want = {n: t.flip(0) for n, t in convert_to_hf(args, "llama", name, all_gather_param(name, param), None)}
                if any(len(t.shape) < 2 for t in want.values()):
                    assert "fragmented" in got[name].why, (name, got[name].why)
                    continue
                assert got[name].pure, (name, got[name].why)
                for hf_name, value, hit in _scatter(got[name], param.detach()):
                    sel = hit.bool()
                    assert torch.equal(value[sel].view(torch.int16), want[hf_name][sel].view(torch.int16)), hf_name
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


def _spawn(target, ranks: int, *args):
    """``target(rank, *args, port, errors)`` in one process per rank; every rank's failure, reported."""
    from cpu_harness import free_port

    ctx = mp.get_context("spawn")
    errors, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, *args, port, errors)) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    failures = [errors.get() for _ in range(errors.qsize())]
    assert not failures and all(p.exitcode == 0 for p in procs), "\n".join(failures)


def test_every_element_of_a_shard_lands_where_slimes_conversion_puts_it():
    _spawn(_rank, 2, 2)  # TP=2: split and replicated params (TP=1 maps every param whole: the sharded sender's tests)


def _merged(found):
    """The source's changes as {HF name: (positions, values)}, names with a change only; a name that came in pieces
    joined in their order, each piece's positions in its range, past the last piece's."""
    import torch

    out, upto = {}, {}
    for p in found:
        for j, name in enumerate(p.names):
            pos, val, _ = p.run.share(j)
            lo, hi = (p.ranges or {}).get(name, (0, 1 << 62))
            assert name not in upto or (name in (p.ranges or {}) and lo >= upto[name]), (name, lo, upto.get(name))
            assert not pos.numel() or lo <= int(pos.min()) <= int(pos.max()) < hi, (name, lo, hi)
            upto[name] = hi
            if pos.numel():
                was = out.get(name)
                out[name] = (pos, val) if was is None else (torch.cat([was[0], pos]), torch.cat([was[1], val]))
    return out


class _Ops:
    """Counts the ops that run kernels (views are free): what a sync launches on a device."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self.n = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not func.is_view and func.__name__.split(".")[0] not in ("detach", "alias"):
                    outer.n += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _counts(args, layers):
    """(kernel ops, host synchronizations) of one sharded diff and its commit on a model of ``layers`` layers; then
    of this rank's share of xor_ctx's facts of those changes (``held_counts``, in an aligned space)."""
    import torch

    import slime_harness as H
    from cpu_harness import SyncCounter
    from sglang.srt.weight_sync.delta import ctx
    from sglang.srt.weight_sync.delta.ops import repeat_counts
    from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers
    from slime.backends.megatron_utils.update_weight.delta_shard_diff import ShardDiffer
    from slime.backends.megatron_utils.update_weight.delta_shard_map import build_shard_maps

    H.configure(H.HIDDEN, layers, H.HEADS, H.GROUPS, H.FFN, H.VOCAB)
    model = H.build_model()
    params = list(named_params_and_buffers(args, [model]))
    differ = ShardDiffer(build_shard_maps(args, [model], "llama"))
    differ.seed(params)
    H.StageTrainer(model, seed=0).step()
    with _Ops() as ops, SyncCounter() as syncs:
        changes = differ.changes(params, olds=True)
    names, counts, pos, _, olds = changes.blocks[0]
    offs = ctx.aligned_starts([int(torch.tensor(changes.shapes[n]).prod()) for n in names], ctx.SEG_LOG2_MIN)
    qx = pos + repeat_counts(torch.from_numpy(offs[:-1]), counts)
    with _Ops() as facts_ops, SyncCounter() as facts_syncs:
        differ.held_counts(dict(zip(names, offs.tolist())), qx, olds, ctx.SEG_LOG2_MIN)
    with _Ops() as commit_ops, SyncCounter() as commit_syncs:
        differ.commit()
    return ops.n + commit_ops.n, len(syncs.ops) + len(commit_syncs.ops), facts_ops.n, len(facts_syncs.ops)


def _by_name(changes):
    """One rank's changes per HF name: (sorted positions, values), whichever blocks and chunks they came in."""
    import torch

    parts = {}
    for names, counts, pos, val, _ in changes.blocks:
        for name, p, v in zip(names, pos.split(counts), val.split(counts)):
            parts.setdefault(name, []).append((p, v))
    out = {}
    for name, ps in parts.items():
        p, v = torch.cat([a for a, _ in ps]), torch.cat([b for _, b in ps])
        order = torch.argsort(p)
        out[name] = (p[order], v[order])
    return out


def _rank_diff(rank, tp, dp, cp, port, errors):
    try:
        import torch
        import torch.distributed as dist

        import slime_harness as H
        from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers
        from slime.backends.megatron_utils.update_weight.delta_shard_diff import ShardDiffer
        from slime.backends.megatron_utils.update_weight.delta_shard_rounds import send_changes
        from slime.backends.megatron_utils.update_weight.delta_shard_map import build_shard_maps
        from sglang.srt.weight_sync.delta.diff import changed_positions
        from sglang.srt.weight_sync.delta.fingerprint import tensor_fingerprint

        torch.set_num_threads(1)
        if cp == 2:  # the GPU's branches on CPU tensors: the found changes copied to host off the default stream
            os.environ["SGLANG_DELTA_DEVICE_PATH"] = "1"
        H.init_world(port, rank=rank, tp=tp, dp=dp, cp=cp)
        model = H.build_model()
        args = H.make_args()
        params = list(named_params_and_buffers(args, [model]))
        differ = ShardDiffer(build_shard_maps(args, [model], "llama"))
        differ.seed(params)
        small = ShardDiffer(build_shard_maps(args, [model], "llama"), chunk_bytes=4096)  # chunks; large params cut
        small.seed(params)
        old = H.hf_state(args, model)  # collective: every rank
        model_bytes = sum(t.numel() * t.element_size() for t in old.values())
        mine = torch.tensor([differ.snapshot_bytes])
        dist.all_reduce(mine)
        assert int(mine) == model_bytes, (int(mine), model_bytes)  # the ranks' slices: the model, once
        assert differ.snapshot_bytes <= model_bytes // (tp * dp * cp) + 4096, (differ.snapshot_bytes, model_bytes)
        trainer = H.StageTrainer(model, seed=0)  # one seed: replicas step alike
        carried = {}  # positions a staged (unacknowledged) diff sent: the next one carries them again
        split = set()  # names some sync sent in pieces
        for step in range(3):
            trainer.step()
            new = H.hf_state(args, model)
            changes = differ.changes(params)
            got, want_local = _by_name(small.changes(params)), _by_name(changes)
            assert got.keys() == want_local.keys() and all(torch.equal(got[n][0], want_local[n][0]) and torch.equal(
                got[n][1].view(torch.int16), want_local[n][1].view(torch.int16)) for n in got), step
            # in rounds of a few hundred changes (the source holds one at a time): a name with more is split by
            # position into pieces (ascending and disjoint: _merged checks), unless an engine loads it whole (the
            # embedding, at step 2); a piece with more is a round alone, and said (the sync goes on)
            raised, whole = [], frozenset({EMBED} if step == 2 else ())
            rounds = list(send_changes(changes, dst=0, shares=differ.shares(params), round_changes=300, whole=whole,
                                       raised=lambda *a: raised.append(a)))
            sent = sum(n for _, n in rounds)
            if rank == 0:
                assert len(rounds) > 1 and all(got is not None for got, _ in rounds), len(rounds)
                found = [p for got, _ in rounds for p in got]
                for got, _ in rounds:
                    held = [(n, c) for p in got for n, c in zip(p.names, p.run.counts)]
                    assert len({n for n, _ in held}) == len(held), held  # a name once per round
                    assert sum(c for _, c in held) <= 300 or (len(held) == 1 and (*held[0], 300) in raised), held
                now = {n for p in found for n in p.ranges or {}}
                assert not now & whole, now & whole
                split |= now
                embed = sum(c for p in found for n, c in zip(p.names, p.run.counts) if n == EMBED)
                assert ((EMBED, embed, 300) in raised) == (step == 2 and embed > 300), (raised, embed)
            total = torch.tensor([sent])
            dist.all_reduce(total)
            if rank == 0:
                merged, changed, shares = _merged(found), 0, found[0].shares
                for name, t in new.items():
                    want = changed_positions(old[name], t)
                    changed += want.numel()
                    if name in carried:
                        want = torch.unique(torch.cat([want, carried[name]]))
                    pos, val = merged.pop(name, (torch.zeros(0, dtype=torch.int64), t.new_zeros(0)))
                    assert torch.equal(pos, want), (step, name, pos.numel(), want.numel())
                    assert torch.equal(val.view(torch.int16), t.reshape(-1)[want].view(torch.int16)), (step, name)
                    carried[name] = want
                    ref = tensor_fingerprint(name, t)  # the ranks' fingerprint shares add up to the HF tensor's
                    assert (shares[name].total, shares[name].count) == (ref.total, ref.count), (step, name)
                assert not merged, sorted(merged)  # no name without a change
                assert set(shares) == set(new), sorted(set(new) - set(shares))
                assert changed > 0 and int(total) <= 1.2 * changed * (4 + 2) * (1 + (step == 2)) + 1024, \
                    (int(total), changed)
            if step == 1:  # not acknowledged: its positions stay staged and the next diff sends them again
                differ.stage()
                small.stage()
                continue
            differ.commit()
            small.commit()
            old, carried = new, {}
        assert rank or split, split  # some name had more changes than a round
        if tp == 2:  # per sync a constant number of kernels and host reads, whatever the layer count (the diff, and
            # xor_ctx's facts of its changes)
            assert _counts(args, 2) == _counts(args, 6), (_counts(args, 2), _counts(args, 6))
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


def test_each_rank_sends_what_changed_in_its_own_slice():
    _spawn(_rank_diff, 2, 2, 1, 1)  # TP=2; data-parallel replicas: test_slime_sender's sharded tests (DP=2)


def test_context_parallel_ranks_split_what_they_hold_alike():
    _spawn(_rank_diff, 2, 1, 1, 2)  # CP=2: both ranks hold every param whole; each diffs and keeps half (and takes
    # the device path's branches: SGLANG_DELTA_DEVICE_PATH)


def _rank_mtp(rank, tp, trained, port, errors):
    """A GPTModel with Megatron's MTP block (``--mtp-num-layers 1``) through slime's GLM-4.x conversion, which names the
    MTP layer as the checkpoint's layer past the last (the NextN draft's). Its shard maps land every element where
    slime's conversion puts it; the sharded diff after AdamW steps is the diff of slime's full conversion, name for
    name, MTP layer included when it trains (``--enable-mtp-training``) and absent when it does not."""
    try:
        import torch
        import torch.distributed as dist

        import slime_harness as H
        from megatron.core import mpu
        from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
        from slime.backends.megatron_utils.update_weight.common import all_gather_param, named_params_and_buffers
        from slime.backends.megatron_utils.update_weight.delta_shard_diff import ShardDiffer
        from slime.backends.megatron_utils.update_weight.delta_shard_map import build_shard_maps
        from slime.backends.megatron_utils.update_weight.delta_shard_rounds import send_changes
        from sglang.srt.weight_sync.delta.diff import changed_positions

        torch.set_num_threads(1)
        H.init_world(port, rank=rank, tp=tp)
        model = H.build_model(mtp_layers=1)
        args = H.make_args()
        params = list(named_params_and_buffers(args, [model]))
        maps = build_shard_maps(args, [model], "glm4moe")
        assert any(".mtp.layers.0." in n for n, _ in params) and all(maps[n].pure for n, _ in params), \
            [(m.name, m.why) for m in maps.values() if not m.pure]
        for name, param in params:
            want = dict(convert_to_hf(args, "glm4moe", name, all_gather_param(name, param), None))
            assert [n for n, _ in maps[name].targets] == list(want), (name, maps[name].targets, list(want))
            for hf_name, got, hit in _scatter(maps[name], param.detach()):
                assert torch.equal(got[hit.bool()].view(torch.int16), want[hf_name][hit.bool()].view(torch.int16))
                dist.all_reduce(hit, group=mpu.get_tensor_model_parallel_group())
                assert bool((hit > 0).all()), hf_name  # the ranks together: every element
        differ = ShardDiffer(maps)
        differ.seed(params)
        trainer = H.StageTrainer(model, seed=0)
        if not trained:  # no MTP loss: its layer gets no gradient, and AdamW leaves it as it is
            keep = [i for i, (n, _) in enumerate(model.named_parameters()) if ".mtp." not in n]
            trainer.params, trainer.master = [trainer.params[i] for i in keep], [trainer.master[i] for i in keep]
        mtp_prefix = f"model.layers.{H.LAYERS}."
        old = H.hf_state(args, model, "glm4moe")
        assert any(n.startswith(mtp_prefix + "eh_proj") for n in old), sorted(old)
        for step in range(2):
            trainer.step()
            new = H.hf_state(args, model, "glm4moe")
            rounds = list(send_changes(differ.changes(params), dst=0, shares=differ.shares(params),
                                       round_changes=1 << 30, whole=frozenset(), raised=lambda *a: None))
            if rank == 0:
                merged = _merged([p for got, _ in rounds for p in got])
                want = {n: changed_positions(old[n], t) for n, t in new.items()}
                want = {n: w for n, w in want.items() if w.numel()}
                assert set(merged) == set(want), sorted(set(merged) ^ set(want))
                for name, w in want.items():
                    pos, val = merged[name]
                    assert torch.equal(pos, w) and torch.equal(
                        val.view(torch.int16), new[name].reshape(-1)[w].view(torch.int16)), (step, name)
                sent_mtp = sorted(n for n in merged if n.startswith(mtp_prefix))
                assert bool(sent_mtp) == trained, (trained, sent_mtp)
                if trained:  # the draft's own projections and norms, and its decoder layer
                    assert {mtp_prefix + s for s in ("eh_proj.weight", "self_attn.q_proj.weight",
                                                     "mlp.down_proj.weight")} <= set(sent_mtp), sent_mtp
            differ.commit()
            old = new
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


@pytest.mark.parametrize("trained", [True, False], ids=["mtp-trained", "mtp-frozen"])
def test_mtp_layers_travel_through_the_sharded_sender_when_they_train(trained):
    _spawn(_rank_mtp, 2, 2, trained)  # TP=2: the MTP layer's projections split like the decoder's


@pytest.mark.parametrize("ranks, encoding", [(1, "xor_zstd"), (2, "xor_ctx")])
def test_gpu_checks_sharded_sender_lane_rehearsed_on_the_cpu(tmp_path, ranks, encoding):
    """`make gpu-check`'s sharded-sender lane (scripts/gpu_check_slime.py) as its dry run: gloo ranks instead of GPUs
    (one: what a one-GPU host runs, TP=1; two: NCCL's layout, TP=2), the same code, every check passing (the GPU
    bundle carries Megatron-core and this slime tree); the lane runs each of its encodings on a GPU, here each
    layout takes one (xor_ctx: its syncs coded as asked, the ranks' facts exchanged)."""
    import argparse

    import torch

    from gpu_check import Report
    from gpu_check_slime import SYNCS, check_sharded_sender

    report = Report()
    check_sharded_sender(report, argparse.Namespace(hidden=64, layers=2, vocab=512), torch.device("cpu"),
                         str(tmp_path), stubbed=False, ranks=ranks, encoding=encoding)
    text = "\n".join(report.lines)
    assert not report.failed, text
    for k in range(SYNCS):
        assert f"- PASS: sharded sync {k} (" in text, text
    assert f"at TP={ranks}, one CPU process per rank" in text and f"`{encoding}` over disk" in text, text
    for rank in range(ranks):
        assert f"- PASS: rank {rank}: outcomes ['seed', 'commit', 'stage', 'commit', 'commit']" in text, text
        assert f"- rank {rank}: its diff of " in text, text
