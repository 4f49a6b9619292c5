"""TP=2 on two gloo ranks: the first rank reads the global delta files once and broadcasts them, each rank's loader
narrows its own shard; the ranks agree on every verdict, so a failed read stops both before any write."""
import multiprocessing as mp
import os
import traceback

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpu_harness import delta_flushes, free_port, full_flushes, hf_config, rl_states
from sglang.srt.weight_sync.delta.ctx import SEG_LOG2_MIN
from sglang.srt.weight_sync.delta.files import as_parts, flush_file

TP = 2


def _rank_main(rank, init_method, root, n_syncs, encoding, arch, raw, run, errors):
    try:
        from cpu_harness import Host, SyncCounter, init_sglang_inprocess, nan_filled, sglang_model
        from sglang.srt.weight_sync.delta import positions
        from sglang.srt.weight_sync.delta.receiver import delta_status, receiver_state

        if run:  # flushes larger than a decode run: each run selects its own shard's entries (one host read each)
            positions._DECODE_RUN = run
        from sglang.srt.weight_sync.delta import ctx

        passes = []  # xor_ctx: the segments whose base pass this rank ran

        class Counted(ctx._Segment):
            def __init__(self, *a):
                passes.append(1)
                super().__init__(*a)

        ctx._Segment = Counted

        init_sglang_inprocess(tp_rank=rank, tp_size=TP, init_method=init_method)
        cfg = hf_config(arch, hidden=128)
        host = Host(nan_filled(sglang_model(cfg)), chunk_bytes=32 << 10)
        def holds(v):
            ref = nan_filled(sglang_model(cfg))
            ref.load_weights(list(load_file(os.path.join(root, f"state{v}.safetensors")).items()))
            for (n, a), (_, b) in zip(host.model.named_parameters(), ref.named_parameters()):
                assert not torch.isnan(b).any() and torch.equal(a.view(torch.int16), b.view(torch.int16)), \
                    f"rank {rank} v{v}: {n} differs"

        for v in range(1, n_syncs + 1):
            vdir = os.path.join(root, f"weight_v{v:06d}")
            files = sorted(f for f in os.listdir(vdir) if f.endswith(".safetensors"))
            if v == n_syncs:  # first, a file the reading rank cannot read (say, not yet visible on its node)
                late = ["late.safetensors"] if rank == 0 else ["not-read-here.safetensors"]  # rank 1 reads nothing
                ok, msg = host.call("_apply_delta", vdir, files + late, str(v))
                assert not ok and "file 'late.safetensors': cannot read" in msg, f"rank {rank}: {msg}"
                holds(v - 1)  # untouched on both ranks
                st = receiver_state(host.model)
                assert st.version == v - 1 and not st.dirty and st.last[1] == "malformed"
            with SyncCounter() as syncs:
                ok, msg = host.call("_apply_delta", vdir, files, str(v))
            assert ok, f"rank {rank} v{v}: {msg}"
            assert receiver_state(host.model).xor_raw == raw  # what the status tells the sender to send raw
            # per file: checksum + checks, and how many of its entries each storage of the shard holds; per request:
            # two TP agreements; xor_zstd: the check that every element was rebuilt (its base reads hold no host
            # read); xor_ctx: the decode's three per file (none per segment), and the check of the ranges some rank
            # holds
            xor = encoding == "xor_zstd" and v > 1
            segs = int(open(os.path.join(vdir, "segments")).read()) if encoding == "xor_ctx" and v > 1 else 0
            assert run or len(syncs.ops) <= (3 + 3 * bool(segs)) * len(files) + 2 + xor + bool(segs), \
                (len(files), segs, syncs.ops)
            if v > 1:
                assert delta_status(host.model).ctx  # the sender reads this and may send xor_ctx
            if segs:  # the ranks split the base passes: each ran its share (every other segment of a flush)
                with open(os.path.join(root, f"passes-v{v}-rank{rank}"), "w") as f:
                    f.write(str(len(passes)))
                passes.clear()
            holds(v)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


@pytest.mark.parametrize("arch, encoding, run", [("qwen2", "deltas", 0), ("qwen2", "xor_zstd", 0),
                                               ("qwen3-tied", "xor_zstd", 0), ("qwen2", "indices", 40),
                                               ("qwen2", "xor_ctx", 0), ("qwen3-tied", "xor_ctx", 0)])
def test_tp2_each_rank_narrows_the_global_delta(tmp_path, arch, encoding, run):
    """xor_zstd: each rank holds only its shard of the base, so the ranks rebuild the new values together; xor_ctx:
    they share each changed segment's base and decode together (tied: in aligned flushes, as the sharded sender
    codes them); the tied lm_head, which no rank stores, travels raw (coded against zero)."""
    cfg = hf_config(arch, hidden=128)
    raw = ["lm_head.weight"] if cfg.tie_word_embeddings else []  # the loader skips the tied head on every rank
    states = rl_states(cfg, 3, seed=0)
    for v, state in enumerate(states, start=1):
        save_file(state, str(tmp_path / f"state{v}.safetensors"))
        payloads = full_flushes(state, version=1, max_params=9) if v == 1 else \
            delta_flushes(states[v - 2], state, encoding, version=v, base_version=v - 1, max_params=9, raw=raw)
        vdir = tmp_path / f"weight_v{v:06d}"
        vdir.mkdir()
        for pl in payloads:  # one publish: every flush file of the sync in one request
            pl.spec.flush, pl.spec.final = 0, True
        if v > 1 and encoding == "xor_ctx":  # the smallest segments: several per flush; at most this many change
            aligned = arch == "qwen3-tied"  # each param starts a segment, as the sharded sender's flushes
            for pl in payloads:
                pl.seg_log2 = SEG_LOG2_MIN
                if aligned:  # facts beside whole bases: the bases code (the same bytes), in an aligned space
                    n = sum(p.nnz for p in pl.spec.params if not p.dense)
                    pl.facts = (torch.zeros(2, n, dtype=torch.int64), torch.zeros(n, dtype=pl.values.dtype))
            (vdir / "segments").write_text(str(sum(
                sum(-(-p.numel >> SEG_LOG2_MIN) for p in pl.spec.params if not p.dense) if aligned else
                -(-sum(p.numel for p in pl.spec.params if not p.dense) >> SEG_LOG2_MIN) for pl in payloads)))
        for k, pl in enumerate(as_parts(payloads)):
            (vdir / f"rank0000_flush{k:06d}.safetensors").write_bytes(
                flush_file(pl, 1 if v > 1 and encoding.startswith("xor") else None))
    _run_ranks(_rank_main, str(tmp_path), len(states), encoding, arch, raw, run)
    for v in range(2, len(states) + 1) if encoding == "xor_ctx" else ():
        files = len([f for f in os.listdir(tmp_path / f"weight_v{v:06d}") if f.endswith(".safetensors")])
        passes = [int((tmp_path / f"passes-v{v}-rank{r}").read_text()) for r in range(TP)]
        assert min(passes) > 0 and max(passes) - min(passes) <= files, passes


def _wrong_base_rank(rank, init_method, root, errors):
    try:
        from cpu_harness import Host, init_sglang_inprocess, nan_filled, sglang_model
        from sglang.srt.weight_sync.delta.receiver import receiver_state

        init_sglang_inprocess(tp_rank=rank, tp_size=TP, init_method=init_method)
        host = Host(nan_filled(sglang_model(hf_config("qwen2", hidden=128))), chunk_bytes=32 << 10)
        ok, msg = host.call("_apply_delta", os.path.join(root, "weight_v000001"), ["rank0000_flush000000.safetensors"],
                            "1")
        assert ok, msg
        before = {n: p.detach().clone() for n, p in host.model.named_parameters()}
        ok, msg = host.call("_apply_delta", os.path.join(root, "weight_v000002"), ["rank0000_flush000000.safetensors"],
                            "2")
        st = receiver_state(host.model)
        # every rank decodes the same shared base, so each refuses by itself, naming the same param
        assert not ok and st.last[1] == "malformed" and "param 'model.embed_tokens.weight'" in msg, msg
        assert st.version == 1 and not st.dirty
        assert all(torch.equal(p, before[n]) for n, p in host.model.named_parameters())
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


def test_a_tensor_parallel_engine_refuses_xor_ctx_coded_against_another_base_untouched(tmp_path):
    """The ranks decode against the base they share; a flush coded against a later one does not fit it (its
    classes' ranks, or else the checksum), and both ranks refuse it before a write."""
    cfg = hf_config("qwen2", hidden=128)
    states = rl_states(cfg, 2, seed=0)
    for v, payloads in ((1, full_flushes(states[0], version=1)),
                        (2, delta_flushes(states[1], states[2], "xor_ctx", version=2, base_version=1))):
        vdir = tmp_path / f"weight_v{v:06d}"
        vdir.mkdir()
        for pl in payloads:
            pl.spec.flush, pl.spec.final = 0, True
        (vdir / "rank0000_flush000000.safetensors").write_bytes(flush_file(as_parts(payloads)[0], 1))
    _run_ranks(_wrong_base_rank, str(tmp_path))


def _run_ranks(target, *args):
    """``target(rank, init_method, *args, errors)`` on TP spawned ranks; every rank's traceback fails the test."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(r, init_method, *args, errors)) for r in range(TP)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
