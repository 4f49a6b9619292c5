"""A trainer with pipeline stages: every stage's source rank sends its own layers, the engine commits a version only
once every stage's part of it arrived, and a disk request is one transaction across stages."""
import dataclasses
import multiprocessing as mp
import os
import traceback

import pytest
import torch

from cpu_harness import (Host, Server, bf16_state, delta_flushes, engine_mismatch, flip_a_value_bit, free_port,
                         full_flushes, hf_config, hf_model, rl_states, segments, sglang_model, write_hf_checkpoint)
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta.receiver import receiver_state
from sglang.srt.weight_sync.delta.files import as_parts

STAGES = 2


def stage_names(state, stage: int, stages: int = STAGES):
    """A pipeline split: embeddings with the first layers, the last layers with the final norm and the head."""
    layers = sorted({int(n.split(".")[2]) for n in state if n.startswith("model.layers.")})
    per = -(-len(layers) // stages)
    mine = set(layers[stage * per:(stage + 1) * per])

    def owner(n):
        if n.startswith("model.layers."):
            return int(n.split(".")[2]) in mine
        return (n.startswith("model.embed_tokens.")) == (stage == 0)
    return [n for n in state if owner(n)]


def as_stage(payloads, stage: int):
    for p in payloads:
        p.spec.source, p.spec.sources = stage, STAGES
        p.seal(spec_only=True)
    return payloads


def stage_flushes(old, new, stage, version):
    names = stage_names(new, stage)
    return as_stage(delta_flushes({n: old[n] for n in names}, {n: new[n] for n in names}, "deltas",
                                  version=version, base_version=version - 1, max_params=4), stage)


@pytest.fixture(scope="module")
def trained():
    cfg = hf_config("qwen2", layers=4)
    return cfg, rl_states(cfg, 2, seed=0)


@pytest.fixture
def engine(trained):
    cfg, s = trained
    host = Host(sglang_model(cfg))
    ok, msg = host.call("_apply_delta_payload", full_flushes(s[0], version=1))
    assert ok, msg
    return host


def reference(cfg, state):
    ref = sglang_model(cfg)
    ref.load_weights(list(state.items()))
    return ref


def test_stages_interleaved_commit_only_when_every_stage_is_final(trained, engine):
    """Two stages' requests interleave (as two NCCL groups deliver them); the version commits with the last one."""
    cfg, s = trained
    a, b = stage_flushes(s[0], s[1], 0, 2), stage_flushes(s[0], s[1], 1, 2)
    assert len(a) > 1 and len(b) > 1
    order = [dataclasses.replace(pl, source="broadcast")  # as the engine receives them over a weight-update group
             for pl in [pl for pair in zip(a, b) for pl in pair] + a[len(b):] + b[len(a):]]
    state = receiver_state(engine.model)
    for k, pl in enumerate(order):
        ok, msg = engine.call("_apply_delta_payload", [pl])
        assert ok, msg
        assert state.version == (2 if k == len(order) - 1 else 1), (k, state.version, msg)
    assert_params_equal(engine.model, reference(cfg, s[1]))


def test_a_stage_that_goes_on_after_its_final_request_is_refused(trained, engine):
    _, s = trained
    a = stage_flushes(s[0], s[1], 0, 2)
    a = [dataclasses.replace(pl, source="broadcast") for pl in a]
    for pl in a:
        assert engine.call("_apply_delta_payload", [pl])[0]
    ok, msg = engine.call("_apply_delta_payload", [a[-1]])
    assert not ok and f"flush {len(a) - 1} of version 2 from source(s) [0], which already sent their final" in msg, msg
    assert receiver_state(engine.model).dirty  # part of version 2 is written and it cannot complete


def test_a_disk_request_without_every_stage_is_refused_untouched(trained, engine, tmp_path):
    """Over disk one request carries a segment of every stage: a stage's files missing is a refusal, not a version
    committed with that stage's layers left behind."""
    from sglang.srt.weight_sync.delta.files import flush_file

    _, s = trained
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    names = []
    for stage in range(STAGES):
        payloads = stage_flushes(s[0], s[1], stage, 2)
        for p in payloads:
            p.spec.flush, p.spec.final = 0, True
        for k, p in enumerate(as_parts(payloads)):
            names.append(f"rank{stage:04d}_flush{k:06d}.safetensors")
            (tmp_path / names[-1]).write_bytes(flush_file(p))
    stage0 = [n for n in names if n.startswith("rank0000")]
    ok, msg = engine.call("_apply_delta", str(tmp_path), stage0, "2")
    assert not ok and "sources [1] of 2 are missing (a pipeline stage's files were not published)" in msg, msg
    for n, p in engine.model.named_parameters():
        assert torch.equal(p.detach().view(torch.int16), before[n].view(torch.int16)), n
    assert not receiver_state(engine.model).dirty
    ok, msg = engine.call("_apply_delta", str(tmp_path), names, "2")
    assert ok and receiver_state(engine.model).version == 2, msg


# ---------------------------------------------------------------- two stage processes into a real server


def _stage_main(stage, init_method, url, root, states_path, out):
    try:
        import requests

        from sglang.srt.weight_sync.delta.collectives import StageGroup
        from sglang.srt.weight_sync.delta.sender import DeltaSender
        from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine

        torch.distributed.init_process_group("gloo", init_method=init_method, world_size=STAGES, rank=stage)
        states = torch.load(states_path)
        corrupt = {}

        def hook(vdir):  # stage 0 announces: break one of stage 1's files of the armed version
            if corrupt.pop("armed", False):
                flip_a_value_bit(vdir, "rank0001_")

        engine = HttpEngine(url)
        stages = StageGroup(torch.distributed.group.WORLD, stage, STAGES)
        sender = DeltaSender(DiskTransport(os.path.join(root, "shared"), [engine], stages=stages, post_write_hook=hook),
                             [engine], encoding="deltas_zstd", buffer_bytes=8 << 10, fingerprint_every=2)

        class _Server:
            def post(self, path, body):
                return requests.post(url + path, json=body, timeout=60)
        rows = []
        for k, state in enumerate(states):
            corrupt["armed"] = k == 2
            mine = {n: state[n] for n in stage_names(state, stage)}
            ok, msg = sender.update(segments(mine, chunk_params=3))[0]
            m = sender.pop_metrics()
            torch.distributed.barrier()
            holds = engine_mismatch(_Server(), states[k - 1 if k == 2 else k]) is None if stage == 0 else None
            rows.append([ok, msg, m["perf/update_weights_full_sync_engines"], m["perf/update_weights_density"],
                         m.get("perf/update_weights_fingerprint_mismatches", 0), holds, sender.state.version])
            torch.distributed.barrier()
        out.put((stage, rows))
    except BaseException:
        out.put((stage, traceback.format_exc()))


def test_two_stages_over_disk_into_a_real_server(tmp_path):
    """Each stage writes its own files, stage 0 announces every stage's files in one request; a corrupt file of
    stage 1 is refused with nothing applied and the next sync recovers as a delta, bit-identical throughout."""
    cfg = hf_config("llama", vocab=300, layers=4)
    boot = write_hf_checkpoint(str(tmp_path / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    states = rl_states(cfg, 3, seed=0)
    torch.save(states, tmp_path / "states.pt")
    server = Server(boot, str(tmp_path / "server.log")).wait_healthy()
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [ctx.Process(target=_stage_main, args=(k, init, server.url, str(tmp_path), str(tmp_path / "states.pt"),
                                                        out)) for k in range(STAGES)]
        for p in procs:
            p.start()
        got = dict(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(60)
        for k, rows in got.items():
            assert not isinstance(rows, str), f"stage {k}:\n{rows}"
        for stage, rows in got.items():
            oks = [r[0] for r in rows]
            assert oks == [True, True, False, True], (stage, rows)
            assert "checksum mismatch" in rows[2][1] and "pipeline stage 0" in rows[2][1], rows[2][1]
            assert [r[2] for r in rows] == [1, 0, 0, 0], rows  # one full sync, then deltas (also after the refusal)
            assert rows[0][3] == 1.0 and all(0 < r[3] < 0.2 for r in rows[1:]), rows
            assert [r[6] for r in rows] == [1, 2, 2, 4], rows  # both snapshots advance together
            assert rows[3][4] == 0, rows  # v4 fingerprint-checked on both stages' layers
        assert [r[5] for r in got[0]] == [True] * 4, got[0]  # v3 refused: the engine still holds v2's bytes
        assert engine_mismatch(server, states[3]) is None
    finally:
        server.stop()
