"""slime's patched updater (UpdateWeightFromDistributedDelta) with a tiny Megatron model into a real patched server.

Needs a slime checkout at the pin, patched by scripts/apply_patches.sh, plus Megatron and Ray:
``make test-slime SLIME_DIR=...`` provides all three, and serves from the image's SGLang tree
(slime's own SGLang patches, then ours), so slime's own xor delta path runs too. Without them this
module is skipped.
"""
import os
import time

import pytest

SLIME = os.environ.get("SLIME_PATCHED_DIR")
pytestmark = pytest.mark.skipif(
    not SLIME, reason="slime tests need a patched slime checkout: run `make test-slime SLIME_DIR=/path/to/slime`")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import ray

    import slime_harness as H
    from cpu_harness import Server, bf16_state, free_port, hf_model, write_hf_checkpoint
    from slime.ray.utils import Lock

    root = tmp_path_factory.mktemp("slime")
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=H.HIDDEN, num_hidden_layers=H.LAYERS, num_attention_heads=H.HEADS,
                                   num_key_value_heads=H.GROUPS, intermediate_size=H.FFN, vocab_size=H.VOCAB,
                                   rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False)
    boot = write_hf_checkpoint(str(root / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    server = Server(boot, str(root / "server.log"),  # tests/cpu_shims/delta_test_faults.py: a wrong write, a slow
                    env={"SGLANG_DELTA_TEST_BAD_WRITE_FILE": str(root / "bad-write"),  # engine, on demand
                         "SGLANG_DELTA_TEST_SLOW_FILE": str(root / "slow")}).wait_healthy()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    H.init_world(free_port())
    model = H.build_model()
    engines = [H.engine_actor_cls().remote(server.url)]
    lock = Lock.options(num_cpus=0).remote()
    yield dict(root=root, boot=boot, server=server, model=model, trainer=H.Trainer(model), engines=engines, lock=lock)
    ray.shutdown()
    server.stop()


def engine_has(server, state):
    from cpu_harness import engine_mismatch

    name = engine_mismatch(server, state)
    assert name is None, f"{name} differs on the engine"


def run_syncs(world, args, start_version, n=3, xor=False):
    import slime_harness as H
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    up = UpdateWeightFromDistributedDelta(args, [world["model"]], weights_getter=lambda: {}, model_name="llama",
                                          quantization_config=None)
    up.weight_version = start_version
    up.connect_rollout_engines(world["engines"], world["lock"])
    densities = []
    for _ in range(n):
        up.update_weights()
        m = up.pop_metrics()
        densities.append(m["perf/update_weights_density"])
        assert m["perf/update_weights_failures"] == 0 and m["perf/update_weights_fingerprint_mismatches"] == 0
        assert m["perf/update_weights_fingerprint_uncovered"] == 0  # the engine's fingerprint covered every name
        assert m["perf/update_weights_xor"] == (xor and len(densities) > 1)  # after the full sync: xor_zstd
        if args.update_weight_delta_sharded:  # the default: the rank's own slices, none kept by the sender
            assert m["perf/update_weights_sharded_snapshot_bytes"] > 0 and not up._sender.state.snapshot, m
        else:
            assert "perf/update_weights_sharded_snapshot_bytes" not in m and up._sender.state.snapshot
        engine_has(world["server"], H.hf_state(args, world["model"]))
        world["trainer"].step()
    up.disconnect_rollout_engines()
    return up, densities


def test_nccl_transport_over_gloo(world):
    import slime_harness as H

    up, densities = run_syncs(world, H.make_args(update_weight_transport="nccl", update_weight_delta_encoding="indices"), 0)
    assert densities[0] == 1.0 and all(0 < d < 0.2 for d in densities[1:]), densities  # full first, then deltas
    world["version"] = up.weight_version


@pytest.mark.parametrize("transport", ["nccl", "disk"])
def test_a_reconnect_keeps_the_snapshot(world, tmp_path, transport):
    """slime re-connects its engines after one restarted (and around every offload): the sender keeps its snapshot,
    so the next sync is still a delta, not every param again."""
    import slime_harness as H
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    args = H.make_args(update_weight_transport=transport, update_weight_delta_encoding="deltas",
                       update_weight_disk_dir=str(tmp_path))
    up = UpdateWeightFromDistributedDelta(args, [world["model"]], weights_getter=lambda: {}, model_name="llama",
                                          quantization_config=None)
    up.weight_version = world.get("version", 0)
    up.connect_rollout_engines(world["engines"], world["lock"])
    densities, full = [], []
    try:
        for reconnect in (False, False, True, False):
            if reconnect:
                up.disconnect_rollout_engines()
                up.connect_rollout_engines(world["engines"], world["lock"])
            up.update_weights()
            m = up.pop_metrics()
            assert m["perf/update_weights_failures"] == 0, m
            densities.append(m["perf/update_weights_density"])
            full.append(m["perf/update_weights_full_sync_engines"])
            engine_has(world["server"], H.hf_state(args, world["model"]))
            world["trainer"].step()
    finally:
        up.disconnect_rollout_engines()
        world["version"] = up.weight_version
    assert densities[0] == 1.0 and full == [1, 0, 0, 0], (densities, full)  # a new sender starts with a full sync
    assert all(0 < d < 0.2 for d in densities[1:]), densities  # ... and a re-connected one goes on with deltas


def test_a_restarted_engine_gets_its_full_sync_while_the_other_takes_a_delta(world, tmp_path):
    """Sharded (the default), over disk: slime re-connects its engines after one restarted (a fresh server from the
    boot checkpoint). That sync gathers every param for the restarted engine only; the running one takes the changes
    the ranks found, as in any delta — the sync's bytes are a full sync's plus a delta's, not two full syncs' — and
    both end bit-identical to slime's conversion."""
    import slime_harness as H
    from cpu_harness import Server
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding="deltas_zstd",
                       update_weight_disk_dir=str(tmp_path / "shared"), update_weight_delta_zstd_level=1)
    up = UpdateWeightFromDistributedDelta(args, [world["model"]], weights_getter=lambda: {}, model_name="llama",
                                          quantization_config=None)
    up.weight_version = world.get("version", 0)
    up.connect_rollout_engines(world["engines"], world["lock"])
    fresh = None
    try:
        up.update_weights()  # a new sender: a full sync
        full_bytes = up.pop_metrics()["perf/update_weights_wire_bytes"]
        fresh = Server(world["boot"], str(tmp_path / "fresh.log")).wait_healthy()
        up.disconnect_rollout_engines()
        up.connect_rollout_engines(world["engines"] + [H.engine_actor_cls().remote(fresh.url)], world["lock"])
        for full in (1, 0):
            world["trainer"].step()
            up.update_weights()
            m = up.pop_metrics()
            assert (m["perf/update_weights_failures"], m["perf/update_weights_full_sync_engines"]) == (0, full), m
            assert m["perf/update_weights_density"] < 0.2, m  # the running engine's part: a delta
            assert m["perf/update_weights_wire_bytes"] < (1.3 if full else 0.3) * full_bytes, (m, full_bytes)
            state = H.hf_state(args, world["model"])
            engine_has(world["server"], state)
            engine_has(fresh, state)
    finally:
        up.disconnect_rollout_engines()
        world["version"] = up.weight_version
        if fresh is not None:
            fresh.stop()


def test_a_stranded_broadcast_is_recovered_by_slimes_reconnect(world):
    """The engine loses its weight-update group (as a restarted engine would): it refuses the next request
    unreceived, the sender aborts its pending broadcast at once, and the sync after re-creates the group
    through slime's own ``_reconnect`` and lands bit-identically, as a delta (the engine's status allows it)."""
    import time

    import slime_harness as H
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    args = H.make_args(update_weight_transport="nccl", update_weight_delta_encoding="deltas")
    up = UpdateWeightFromDistributedDelta(args, [world["model"]], weights_getter=lambda: {}, model_name="llama",
                                          quantization_config=None)
    up.weight_version = world.get("version", 0)
    up.connect_rollout_engines(world["engines"], world["lock"])
    up.update_weights()
    assert up.pop_metrics()["perf/update_weights_failures"] == 0
    world["trainer"].step()
    r = world["server"].post("/destroy_weights_update_group", {"group_name": up._group_name})
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    up.update_weights()
    m = up.pop_metrics()
    assert m["perf/update_weights_failures"] == 1 and time.monotonic() - t0 < 60, m
    up.update_weights()
    m = up.pop_metrics()
    assert m["perf/update_weights_failures"] == 0 and m["perf/update_weights_failures_total"] == 1, m
    assert m["perf/update_weights_full_sync_engines"] == 0, m
    assert up._sender.transport.reconnects == 1
    engine_has(world["server"], H.hf_state(args, world["model"]))
    world["trainer"].step()
    up.disconnect_rollout_engines()
    world["version"] = up.weight_version


@pytest.mark.parametrize("encoding, sharded", [("deltas_zstd", True), ("planes_zstd", True), ("xor_zstd", True),
                                               ("xor_zstd", False)])
def test_disk_transport(world, encoding, sharded):
    """Each disk encoding, sharded (the default) and gathered (``--no-update-weight-delta-sharded``)."""
    import slime_harness as H

    args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding=encoding,
                       update_weight_disk_dir=str(world["root"] / "shared"), update_weight_delta_zstd_level=1,
                       update_weight_delta_sharded=sharded)
    up, densities = run_syncs(world, args, world.get("version", 0), xor=encoding == "xor_zstd")
    assert densities[0] == 1.0 and all(0 < d < 0.2 for d in densities[1:]), densities
    world["version"] = up.weight_version


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_over_disk_the_engine_fetches_while_it_generates_and_pauses_only_to_commit(world, mode):
    """Stage, then commit (``--update-weight-delta-stage-timeout``, on by default over disk): slime's updater has the
    engine fetch each publish through ``SGLangEngine.check_weights('delta_stage', delta=...)`` while it generates,
    and pauses it in its pause mode only to commit: every version's files were taken from the stage (none read inside
    the pause), bit-identical, and the pause is timed apart from the stage. With ``retract`` the requests streaming
    through the syncs finish in full. A sync that begins with nothing in flight pauses at once and stages nothing."""
    import slime_harness as H
    from cpu_harness import StreamedRequest
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
        _RayEngine,
    )

    args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding="xor_zstd",
                       update_weight_disk_dir=str(world["root"] / f"staged-{mode}"), update_weight_delta_zstd_level=1,
                       update_weight_pause_mode=mode)
    up = UpdateWeightFromDistributedDelta(args, [world["model"]], weights_getter=lambda: {}, model_name="llama",
                                          quantization_config=None)
    assert args.update_weight_delta_stage_timeout == 300.0  # the default, as slime's parser gives it
    up.weight_version = world.get("version", 0)
    up.connect_rollout_engines(world["engines"], world["lock"])
    (st,) = _RayEngine(world["engines"][0]).status()
    fresh = st.version is None  # run alone: the engine's first sync, which it reads inside the pause
    flights = []
    (world["root"] / "slow").touch()  # each request stays in flight through its sync, however fast this machine
    for k in range(3):
        flights.append(StreamedRequest(world["server"], [5, 9, 11, 13], 100))  # in flight when the sync begins
        flights[-1].start()
        assert flights[-1].started.wait(300) and flights[-1].meta is not None
        up.update_weights()
        m = up.pop_metrics()
        assert m["perf/update_weights_failures"] == 0 and m["perf/update_weights_staged"] == 1, m
        assert m["perf/update_weights_stage_ready_engines"] == 1, m
        assert 0 < m["perf/update_weights_pause_s"] and m["perf/update_weights_stage_s"] >= 0, m
        (st,) = _RayEngine(world["engines"][0]).status()
        assert st.version == up.weight_version, st
        if k or not fresh:
            assert st.timing["in_pause_bytes"] == 0 and st.timing["staged_bytes"] > 0, st
        engine_has(world["server"], H.hf_state(args, world["model"]))
        world["trainer"].step()
    (world["root"] / "slow").unlink()
    for flight in flights:  # retract holds them through the pause; abort returned them at its gate
        flight.join(600)
        assert flight.meta is not None
        if mode == "retract":
            assert flight.meta["finish_reason"]["type"] == "length" and flight.meta["completion_tokens"] == 100
    deadline = time.time() + 60  # the scheduler's loop clears its last batch after the last token went out
    while not _RayEngine(world["engines"][0]).status()[0].idle and time.time() < deadline:
        time.sleep(0.05)
    up.update_weights()  # nothing in flight: paused at once, every publish announced as written
    m = up.pop_metrics()
    assert m["perf/update_weights_failures"] == 0 and m["perf/update_weights_staged"] == 0, m
    assert 0 < m["perf/update_weights_pause_s"] and "perf/update_weights_stage_s" not in m, m
    engine_has(world["server"], H.hf_state(args, world["model"]))
    up.disconnect_rollout_engines()
    world["version"] = up.weight_version


def test_a_param_that_no_longer_fits_its_shard_map_stops_the_sync_before_any_send(world):
    """A Megatron param whose shape changed since its shard map was built (its slice would land on other HF
    elements): the sync stops before a byte reaches the engine, which keeps the last version, and names the param;
    the next sync gathers every param (new maps) and the engine holds the trainer's state again."""
    import slime_harness as H
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding="deltas_zstd",
                       update_weight_disk_dir=str(world["root"] / "shared"), update_weight_delta_zstd_level=1)
    assert args.update_weight_delta_sharded  # the default
    up = UpdateWeightFromDistributedDelta(args, [world["model"]], weights_getter=lambda: {}, model_name="llama",
                                          quantization_config=None)
    up.weight_version = world.get("version", 0)
    up.connect_rollout_engines(world["engines"], world["lock"])
    up.update_weights()  # a new sender: a full sync, then the maps and slices
    assert up.pop_metrics()["perf/update_weights_failures"] == 0
    held = H.hf_state(args, world["model"])
    world["trainer"].step()
    name, param = next((n, p) for n, p in world["model"].named_parameters() if p.dim() == 2 and p.shape[0] != p.shape[1])
    shape = param.shape
    param.data = param.data.view(shape[1], shape[0])  # same elements, another shape
    up.update_weights()
    m = up.pop_metrics()
    assert m["perf/update_weights_failures"] == 1, m
    engine_has(world["server"], held)  # not a byte of that sync
    param.data = param.data.view(shape)
    up.update_weights()
    m = up.pop_metrics()
    assert m["perf/update_weights_failures"] == 0 and m["perf/update_weights_density"] == 1.0, m  # gathered
    engine_has(world["server"], H.hf_state(args, world["model"]))
    world["trainer"].step()
    up.update_weights()  # and sharded deltas again
    m = up.pop_metrics()
    assert m["perf/update_weights_failures"] == 0 and 0 < m["perf/update_weights_density"] < 0.2, m
    engine_has(world["server"], H.hf_state(args, world["model"]))
    up.disconnect_rollout_engines()
    world["version"] = up.weight_version


def test_a_wrong_write_is_repaired_before_generation_resumes(world):
    """The engine's element write sets a wrong bit during a delta (a buggy kernel, injected in the server): the
    read-back refuses the apply, every rank runs slime's gathers again, and the engine gets its full sync inside the
    same ``update_weights``, before slime resumes generation."""
    import slime_harness as H
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding="deltas_zstd",
                       update_weight_disk_dir=str(world["root"] / "shared"), update_weight_delta_zstd_level=1)
    up = UpdateWeightFromDistributedDelta(args, [world["model"]], weights_getter=lambda: {}, model_name="llama",
                                          quantization_config=None)
    up.weight_version = world.get("version", 0)
    up.connect_rollout_engines(world["engines"], world["lock"])
    up.update_weights()  # a new sender: a full sync
    assert up.pop_metrics()["perf/update_weights_failures"] == 0
    world["trainer"].step()
    bad = world["root"] / "bad-write"
    bad.write_text("")
    up.update_weights()
    m = up.pop_metrics()
    assert not bad.exists()  # the fault fired
    assert (m["perf/update_weights_failures"], m["perf/update_weights_repairs"],
            m["perf/update_weights_full_sync_engines"]) == (1, 1, 1), m
    engine_has(world["server"], H.hf_state(args, world["model"]))
    assert up.weight_version == up._sender.status[0].version  # the repair's version, acknowledged
    up.disconnect_rollout_engines()
    world["version"] = up.weight_version


def test_slime_xor_updater_is_still_selected_and_lands(world):
    """xor|overwrite keep slime's own updater; on the same server it still syncs bit-identically."""
    import slime_harness as H
    from slime.backends.megatron_utils.update_weight.update_weight_from_disk_delta import UpdateWeightFromDiskDelta
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )
    from slime.utils.delta_sync_args import sparse_delta_updater_cls

    for enc in ("indices", "deltas", "deltas_zstd", "planes_zstd", "xor_zstd"):
        assert sparse_delta_updater_cls(H.make_args(update_weight_delta_encoding=enc)) is UpdateWeightFromDistributedDelta
    for mode, enc in (("delta", "xor"), ("delta", "overwrite"), ("full", "indices")):
        assert sparse_delta_updater_cls(H.make_args(update_weight_mode=mode, update_weight_delta_encoding=enc)) is None

    root = world["root"]
    args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding="xor",
                       update_weight_disk_dir=str(root / "xor"), update_weight_local_checkpoint_dir=str(root / "local"),
                       hf_checkpoint=world["boot"], update_weight_delta_checksum="adler32")
    class OnCPU(UpdateWeightFromDiskDelta):
        """slime snapshots ``tensor.cpu()``, a copy from a GPU but the live param itself on CPU: copy as a GPU would."""

        def _iter_hf_tensors(self):
            return ((name, t.clone()) for name, t in super()._iter_hf_tensors())

    up = OnCPU(args, [world["model"]], weights_getter=lambda: {}, model_name="llama", quantization_config=None)
    up.connect_rollout_engines([H.engine_actor_cls().remote(world["server"].url, args)], world["lock"])
    up.update_weights()  # slime's first call only captures its baseline (the boot checkpoint)
    densities = []
    for _ in range(3):
        world["trainer"].step()
        up.update_weights()
        densities.append(up.update_weight_metrics["perf/update_weights_density"])
        engine_has(world["server"], H.hf_state(args, world["model"]))
    assert densities[0] > 0.5 and all(0 < d < 0.2 for d in densities[1:]), densities  # vs boot, then one step


def test_the_example_parses_with_slimes_own_arguments():
    """examples/delta_gsm8k.py through slime's real (patched) argument definitions, both transports."""
    import argparse
    import shlex
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from delta_gsm8k import train_args
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )
    from slime.utils.arguments import get_slime_extra_args_provider
    from slime.utils.delta_sync_args import sparse_delta_updater_cls, validate_sparse_delta_args

    parser = argparse.ArgumentParser()
    parser = get_slime_extra_args_provider()(parser) or parser
    for transport, encoding in (("disk", "xor_zstd"), ("nccl", "deltas")):
        ns, _ = parser.parse_known_args(shlex.split(train_args(transport, "/shared", 4)))
        assert (ns.update_weight_mode, ns.update_weight_transport, ns.update_weight_delta_encoding) == \
            ("delta", transport, encoding)
        assert ns.update_weight_delta_fingerprint_interval == 1 and not ns.colocate
        ns.pipeline_model_parallel_size = 1  # a Megatron flag, not in slime's own provider
        validate_sparse_delta_args(ns)
        assert sparse_delta_updater_cls(ns) is UpdateWeightFromDistributedDelta
    argv = shlex.split(train_args("nccl", "/shared", 4))
    ns, _ = parser.parse_known_args(argv + ["--update-weight-encoding", "deltas_zstd"])  # the seed's spelling
    ns.pipeline_model_parallel_size = 1
    with pytest.raises(ValueError, match="use --update-weight-delta-encoding=deltas"):
        validate_sparse_delta_args(ns)
    with pytest.raises(SystemExit):
        parser.parse_known_args(argv + ["--update-weight-delta-encoding", "lz4"])
    # the sharded sender's chunk: unset, the buffer; set, apart from it; not positive, refused by name
    from slime.utils.delta_sync_args import resolve_delta_args, shard_chunk_bytes, validate_delta_args

    for extra, chunk in (([], ns.update_weight_buffer_size),
                         (["--update-weight-delta-shard-chunk-bytes", "65536"], 65536)):
        ns, _ = parser.parse_known_args(argv + extra)
        resolve_delta_args(ns)
        assert shard_chunk_bytes(ns) == chunk, (extra, shard_chunk_bytes(ns))
    ns, _ = parser.parse_known_args(argv + ["--update-weight-delta-shard-chunk-bytes", "0"])
    resolve_delta_args(ns)
    with pytest.raises(ValueError, match=r"--update-weight-delta-shard-chunk-bytes=0: give a positive number"):
        validate_delta_args(ns)


def test_the_stage_timeout_parses_with_slimes_own_arguments_and_is_refused_where_nothing_stages():
    """``--update-weight-delta-stage-timeout``: over disk the engines fetch while they generate (default 300 s; 0
    pauses first); over nccl nothing stages yet, so setting it there is refused by name, as a negative value is."""
    import argparse
    import shlex
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from delta_gsm8k import train_args
    from slime.utils.arguments import get_slime_extra_args_provider
    from slime.utils.delta_sync_args import resolve_delta_args, validate_delta_args

    parser = argparse.ArgumentParser()
    parser = get_slime_extra_args_provider()(parser) or parser
    for transport, extra, error in (("disk", [], None), ("disk", ["0"], None), ("disk", ["-1"], "give seconds"),
                                    ("nccl", ["30"], "used only with a sparse encoding over --update-weight-transport "
                                                     "disk")):
        argv = shlex.split(train_args(transport, "/shared", 4))
        ns, _ = parser.parse_known_args(argv + (["--update-weight-delta-stage-timeout", *extra] if extra else []))
        assert ns.update_weight_delta_stage_timeout == (float(extra[0]) if extra else 300.0)
        resolve_delta_args(ns)
        if error is None:
            validate_delta_args(ns)
        else:
            with pytest.raises(ValueError, match=error):
                validate_delta_args(ns)


def test_the_engines_staging_flags_pass_through_slimes_own_sglang_arguments():
    """The engine flags staging adds reach slime's engines as slime passes every SGLang flag: ``--sglang-<flag>``,
    through slime's own argument definitions for SGLang."""
    import argparse

    from slime.backends.sglang_utils.arguments import add_sglang_arguments

    parser = argparse.ArgumentParser()
    parser = add_sglang_arguments(parser) or parser
    ns, _ = parser.parse_known_args(["--sglang-update-weight-delta-stage-bytes", "1048576",
                                     "--sglang-update-weight-store-no-stage"])
    assert (ns.sglang_update_weight_delta_stage_bytes, ns.sglang_update_weight_store_no_stage) == (1048576, True)
    ns, _ = parser.parse_known_args([])
    assert (ns.sglang_update_weight_delta_stage_bytes, ns.sglang_update_weight_store_no_stage) == (4 << 30, False)


@pytest.mark.parametrize("transport", ["nccl", "disk"])
def test_slimes_glm_example_runs_our_encodings(transport):
    """slime's own GLM-4.7-Flash delta script as examples/glm47_flash_delta.py rewrites it: every argument array it
    hands to train.py, expanded by bash (nothing runs), through slime's real (patched) argument definitions; our
    updater is selected and our argument rules pass. The unmodified script still selects slime's own updater."""
    import argparse
    import re
    import subprocess
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from glm47_flash_delta import UPSTREAM, rewrite
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )
    from slime.utils.arguments import get_slime_extra_args_provider
    from slime.utils.delta_sync_args import resolve_delta_args, sparse_delta_updater_cls, validate_sparse_delta_args

    upstream = open(os.path.join(SLIME, UPSTREAM)).read()
    parser = argparse.ArgumentParser()
    parser = get_slime_extra_args_provider()(parser) or parser

    def parsed(script):
        arrays = re.findall(r"^([A-Z_]+_ARGS)=\(\n.*?^\)\n", script, re.M | re.S)
        defs = "".join(re.findall(r"^[A-Z_]+_ARGS=\(\n.*?^\)\n", script, re.M | re.S))
        out = subprocess.run(["bash", "-c", defs + "printf '%s\\n' " + " ".join(f'"${{{a}[@]}}"' for a in arrays)],
                             capture_output=True, text=True, check=True,
                             env={"PATH": os.environ["PATH"], "MODEL_DIR": "/root/models/GLM-4.7-Flash",
                                  "DATA_PATH": "/root/datasets/dapo-math-17k.jsonl"})
        argv = out.stdout.split()
        ns, _ = parser.parse_known_args(argv)
        ns.pipeline_model_parallel_size = int(argv[argv.index("--pipeline-model-parallel-size") + 1])  # a Megatron flag
        resolve_delta_args(ns)
        return ns

    ns = parsed(upstream)
    assert (ns.update_weight_mode, ns.update_weight_delta_encoding, ns.update_weight_delta_sharded) == \
        ("delta", "xor", False)
    assert sparse_delta_updater_cls(ns) is None  # slime's own UpdateWeightFromDiskDelta
    ns = parsed(rewrite(upstream, transport, "/shared/fs/glm47-delta"))
    want = {"nccl": ("nccl", "deltas", 2), "disk": ("disk", "xor_zstd", 2)}[transport]  # the script's PP=2 stays
    assert (ns.update_weight_transport, ns.update_weight_delta_encoding, ns.pipeline_model_parallel_size) == want
    assert ns.update_weight_delta_sharded is True  # the default wherever it runs
    validate_sparse_delta_args(ns)
    assert sparse_delta_updater_cls(ns) is UpdateWeightFromDistributedDelta


def test_the_single_gpu_example_attaches_to_an_external_patched_server(world):
    """The example's one-GPU variant: slime discovers a real patched server by its address, and a plain launch of
    that server passes slime's own sanity check of external engines (the fields it compares)."""
    import argparse
    import shlex
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from delta_gsm8k import train_args
    from slime.backends.sglang_utils.arguments import add_sglang_arguments
    from slime.backends.sglang_utils.external import apply_external_engine_info_to_args, get_server_info
    from slime.backends.sglang_utils.sglang_engine import _compute_server_args
    from slime.utils.arguments import get_slime_extra_args_provider

    server = world["server"]
    addr = f"127.0.0.1:{server.port}"
    argv = shlex.split(train_args("disk", "/shared", 4, external_engine=addr))
    parser = argparse.ArgumentParser()
    parser = get_slime_extra_args_provider()(parser) or parser
    ns, _ = parser.parse_known_args(argv)
    sglang_parser = argparse.ArgumentParser(add_help=False)  # slime parses its --sglang-* flags apart
    add_sglang_arguments(sglang_parser)
    vars(ns).update(vars(sglang_parser.parse_known_args(argv)[0]))
    assert ns.rollout_external_engine_addrs == [addr] and ns.update_weight_transport == "disk"
    apply_external_engine_info_to_args(ns)
    assert (ns.rollout_num_engines, ns.rollout_num_gpus) == (1, 1)
    ns.seed, ns.fp16, ns.num_gpus_per_node = 1234, False, 1  # Megatron's flags and the launcher's
    ns.offload_rollout = False  # what slime's validation resolves for a non-colocated run
    expect, fields = _compute_server_args(ns, 0, addr, None, "127.0.0.1", server.port, base_gpu_id=0,
                                          num_gpus_per_engine=1)
    actual = get_server_info(server.url)
    assert fields and all(actual.get(f) == expect.get(f) for f in fields), \
        [(f, expect.get(f), actual.get(f)) for f in fields]
    with pytest.raises(SystemExit, match="use --transport disk"):
        train_args("nccl", "/shared", 4, external_engine=addr)


def test_unset_flags_say_which_delta_runs():
    """An unset encoding: 'deltas' over nccl; over disk refused, naming this project's encodings and slime's own. An unset
    ``--update-weight-delta-sharded``: on with the sparse encodings, off with slime's own; set where it cannot run,
    refused with the reason."""
    import slime_harness as H
    from slime.utils.delta_sync_args import resolve_delta_args, validate_delta_args

    args = H.make_args(update_weight_transport="nccl", update_weight_delta_encoding=None,
                       update_weight_delta_sharded=None)
    resolve_delta_args(args)
    assert (args.update_weight_delta_encoding, args.update_weight_delta_sharded) == ("deltas", True)
    args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding=None,
                       update_weight_delta_sharded=None)
    resolve_delta_args(args)
    with pytest.raises(ValueError, match=r"needs --update-weight-delta-encoding: xor_ctx or xor_zstd \(this project.*"
                                         r"or xor \(slime's own delta"):
        validate_delta_args(args)
    args = H.make_args(update_weight_mode="full", update_weight_transport="disk", update_weight_delta_encoding=None,
                       update_weight_delta_sharded=None)
    resolve_delta_args(args)  # no delta runs: slime's own default stands
    assert (args.update_weight_delta_encoding, args.update_weight_delta_sharded) == ("xor", False)
    args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding="deltas_zstd",
                       update_weight_delta_sharded=False)  # --no-update-weight-delta-sharded
    resolve_delta_args(args)
    assert (args.update_weight_delta_encoding, args.update_weight_delta_sharded) == ("deltas_zstd", False)
    for over in ({"update_weight_delta_encoding": "xor"}, {"update_weight_mode": "full"}):
        args = H.make_args(update_weight_transport="disk", update_weight_delta_sharded=True, **over)
        resolve_delta_args(args)
        with pytest.raises(ValueError, match="--update-weight-delta-sharded=True is used only with --update-weight-mode "
                                             "delta and a sparse encoding"):
            validate_delta_args(args)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_requests_in_flight_keep_going_through_slimes_pause_mode(world, mode):
    """``--update-weight-pause-mode``: slime's updater pauses the engines in that mode (its own flush, which would
    refuse under queued or running requests, is skipped); the requests in flight finish in full, none aborted."""
    import slime_harness as H
    from cpu_harness import StreamedRequest
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    args = H.make_args(update_weight_transport="nccl", update_weight_delta_encoding="deltas",
                       update_weight_pause_mode=mode)
    up = UpdateWeightFromDistributedDelta(args, [world["model"]], weights_getter=lambda: {}, model_name="llama",
                                          quantization_config=None)
    up.weight_version = world.get("version", 0)
    up.connect_rollout_engines(world["engines"], world["lock"])
    for _ in range(2):
        flights = [StreamedRequest(world["server"], [5 + i, 9, 11, 13], 100) for i in range(3)]
        for f in flights:
            f.start()
        for f in flights:
            assert f.started.wait(300) and f.meta is not None
        up.update_weights()
        assert up.pop_metrics()["perf/update_weights_failures"] == 0
        for f in flights:
            f.join(600)
            assert f.meta["finish_reason"]["type"] == "length" and f.meta["completion_tokens"] == 100, f.meta
        engine_has(world["server"], H.hf_state(args, world["model"]))
        world["trainer"].step()
    up.disconnect_rollout_engines()
    world["version"] = up.weight_version


def test_argument_rules():
    import argparse

    from slime.utils.delta_sync_args import validate_sparse_delta_args

    base = dict(colocate=False, update_weight_transport="nccl", pipeline_model_parallel_size=1)
    validate_sparse_delta_args(argparse.Namespace(**base, update_weight_delta_encoding="indices"))
    with pytest.raises(ValueError, match="use --update-weight-delta-encoding=deltas"):
        validate_sparse_delta_args(argparse.Namespace(**base, update_weight_delta_encoding="deltas_zstd"))
    with pytest.raises(ValueError, match="not supported with --colocate"):
        validate_sparse_delta_args(argparse.Namespace(**{**base, "colocate": True}, update_weight_delta_encoding="deltas"))


def _pp_stage_main(stage, port, ray_address, url, args, out):
    import traceback

    try:
        import ray
        import requests

        import slime_harness as H
        from cpu_harness import engine_mismatch
        from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
            UpdateWeightFromDistributedDelta,
        )

        ray.init(address=ray_address, namespace="pp-test", log_to_driver=False)
        engine, lock = ray.get_actor("pp-engine"), ray.get_actor("pp-lock")
        H.init_world(port, rank=stage, pp=2)
        model = H.build_model()
        trainer = H.StageTrainer(model, seed=stage)
        up = UpdateWeightFromDistributedDelta(args, [model], weights_getter=lambda: {}, model_name="llama",
                                              quantization_config=None)
        up.connect_rollout_engines([engine], lock)

        class _Server:
            def post(self, path, body):
                return requests.post(url + path, json=body, timeout=60)
        rows, held = [], None
        for k in range(4):
            if k == 2 and stage == 0 and args.update_weight_transport == "disk":
                open(args.corrupt_marker, "w").close()
            mine = H.hf_state(args, model)
            up.update_weights()
            m = up.pop_metrics()
            holds = engine_mismatch(_Server(), mine if m["perf/update_weights_failures"] == 0 else held) is None
            if m["perf/update_weights_failures"] == 0:
                held = mine
            rows.append([m["perf/update_weights_failures"], m["perf/update_weights_full_sync_engines"],
                         m["perf/update_weights_density"], m.get("perf/update_weights_fingerprint_mismatches", 0),
                         holds, up._sender.state.version, len(mine)])
            trainer.step()
        up.disconnect_rollout_engines()
        out.put((stage, rows))
    except BaseException:
        out.put((stage, traceback.format_exc()))


@pytest.mark.parametrize("transport", ["disk", "nccl"])
def test_two_pipeline_stages(world, tmp_path, transport):
    """A real two-stage Megatron model (one process per stage, gloo): each stage's source rank sends its own layers
    through slime's updater into one real server, bit-identical after every sync. Over disk stage 0 announces every
    stage's files in one request; a corrupt file of stage 1 is refused with nothing applied, and the next sync
    recovers as a delta. Over disk the ranks diff their own params (the default), over nccl the source ranks the
    gathered ones (``--no-update-weight-delta-sharded``) with a version store beside the group: each stage files its
    own requests, and a compaction off the trainer replays them in stage order to the trainer's fingerprint."""

    import ray

    import slime_harness as H
    from cpu_harness import free_port
    from slime.ray.utils import Lock

    actors = [H.engine_actor_cls().options(name="pp-engine", namespace="pp-test").remote(world["server"].url),
              Lock.options(num_cpus=0, name="pp-lock", namespace="pp-test").remote()]  # held: named, not detached
    encoding = "deltas_zstd" if transport == "disk" else "deltas"
    args = H.make_args(update_weight_transport=transport, update_weight_delta_encoding=encoding,
                       update_weight_disk_dir=str(tmp_path / "shared"), pipeline_model_parallel_size=2,
                       update_weight_delta_fingerprint_interval=2, update_weight_delta_sharded=transport == "disk",
                       custom_update_weight_post_write_path="slime_harness.corrupt_stage1_file",
                       corrupt_marker=str(tmp_path / "corrupt-next"), hf_checkpoint=None,
                       update_weight_store=str(tmp_path / "store") if transport == "nccl" else None)
    if transport == "nccl":
        os.makedirs(args.update_weight_store)
    try:
        got = H.run_ranks(_pp_stage_main, 2, free_port(), ray.get_runtime_context().gcs_address, world["server"].url,
                          args)
    finally:
        for actor in actors:
            ray.kill(actor)
    failures = [0, 0, 1, 0] if transport == "disk" else [0, 0, 0, 0]
    for stage, rows in got.items():
        assert [r[0] for r in rows] == failures, (stage, rows)
        assert [r[4] for r in rows] == [True] * 4, (stage, rows)  # the engine holds the last acknowledged version
        assert [r[1] for r in rows[1:]] == [0, 0, 0], (stage, rows)  # deltas after the first (dense) sync
        assert rows[0][2] == 1.0 and all(0 < r[2] < 0.2 for r in rows[1:]) and rows[3][3] == 0, (stage, rows)
    if transport == "nccl":
        from sglang.srt.weight_sync.delta.store.manifest import StoreKey
        from sglang.srt.weight_sync.delta.store.tools import log as store_log
        from sglang.srt.weight_sync.delta.tools import main

        assert main(["store", "compact", args.update_weight_store]) == 0
        lines = store_log(args.update_weight_store, StoreKey(None))
        # HEAD, then the 4 versions newest first; the newest fingerprinted one (of the top two) is now an anchor
        assert len(lines) == 5 and any(line.endswith("fingerprint anchor") for line in lines[1:3]), lines
        assert rows[0][6] > 0
    assert got[0][0][6] + got[1][0][6] == len(H.hf_state(H.make_args(), world["model"]))  # the stages split the model
    world.pop("version", None)  # the engine's chain moved on: a later sender learns it from the engine's status


def _sharded_rank(rank, layout, port, ray_address, url, args, out):
    """One trainer rank of a sharded delta sync: real syncs into the server after real steps, the engine checked
    against slime's own conversion by the stage's source, a diff failure injected on one rank once."""
    import traceback

    try:
        import ray
        import torch
        import torch.distributed as dist

        import slime_harness as H
        from megatron.core import mpu
        from sglang.srt.weight_sync.delta.diff import changed_positions
        from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
            UpdateWeightFromDistributedDelta,
        )

        torch.set_num_threads(1)
        ray.init(address=ray_address, namespace="sharded-test", log_to_driver=False)
        engine, lock = ray.get_actor("sharded-engine"), ray.get_actor("sharded-lock")
        H.init_world(port, rank=rank, **layout)
        moe = "ep" in layout
        model, model_name = (H.build_moe_model(), "qwen3moe") if moe else (H.build_model(), "llama")
        stage, tp_rank = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
        trainer = H.StageTrainer(model, seed=100 * stage + tp_rank, shared_seed=stage)  # replicas step alike
        up = UpdateWeightFromDistributedDelta(args, [model], weights_getter=lambda: {}, model_name=model_name,
                                              quantization_config=None)
        up.connect_rollout_engines([engine], lock)
        source = up._is_pp_src_rank
        rows, held, old = [], None, None
        for k in range(5):
            mine = H.hf_state(args, model, model_name)  # collective over the stage's TP (and EP) groups
            ctx = args.update_weight_delta_encoding == "xor_ctx"
            what = "held_counts" if ctx else "changes"
            if k == 3 and rank == 1:  # this rank's diff fails once (xor_ctx: its map holds an element twice, as
                real = getattr(up._sharded.differ, what)  # its counts say): no engine may get a byte of that sync

                def twice(*a, **kw):
                    rows = real(*a, **kw)
                    rows[2, :1] += 1
                    return rows

                setattr(up._sharded.differ, what, twice if ctx else
                        lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("injected")))
            up.update_weights()
            if k == 3 and rank == 1:
                setattr(up._sharded.differ, what, real)
            m = up.pop_metrics()
            snap = torch.tensor([up._sharded.differ.snapshot_bytes])
            dist.all_reduce(snap, group=up._sharded.group)
            if source:
                ok = m["perf/update_weights_failures"] == 0
                holds = H.engine_holds(url, mine if ok else held)
                changed = sum(changed_positions(old[n], t).numel() for n, t in mine.items()) if old else 0
                held = mine if ok else held
                old = mine if ok else old
                rows.append(dict(failures=m["perf/update_weights_failures"], holds=holds,
                                 full=m["perf/update_weights_full_sync_engines"],
                                 density=m["perf/update_weights_density"], changed=changed,
                                 to_source=m["perf/update_weights_sharded_bytes_to_source"],
                                 gather_params=m["perf/update_weights_sharded_gather_params"],
                                 mismatches=m.get("perf/update_weights_fingerprint_mismatches", 0),
                                 xor=m.get("perf/update_weights_xor", 0), ctx=m.get("perf/update_weights_ctx", 0),
                                 snapshot=int(snap), model=sum(t.numel() * t.element_size() for t in mine.values()),
                                 sender_snapshot=len(up._sender.state.snapshot),
                                 bound=min(st.max_request_bytes for st in up._sender.status.values()),
                                 raised=len(up._sharded._warned)))
            share = up._sharded.differ.snapshot_bytes
            stage_bytes = torch.tensor([sum(t.numel() * t.element_size() for t in mine.values()) if source else 0])
            dist.all_reduce(stage_bytes, group=up._sharded.group)
            ranks = dist.get_world_size(up._sharded.group)
            assert share <= int(stage_bytes) // ranks + 4096, (k, share, int(stage_bytes), ranks)
            trainer.step()
        up.disconnect_rollout_engines()
        out.put((rank, rows))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _dying_rank(rank, phase, port, ray_address, url, args, out):
    """One trainer rank at TP=2. Phase 0: two syncs, then rank 1's process dies inside its diff of the third (the
    source reports what the engine holds, then exits as a crashed job's ranks do). Phase 1: a restarted trainer
    (fresh processes, a fresh model): two syncs."""
    import os
    import traceback

    def leave(code, what):
        out.put((rank, what))
        out.close()
        out.join_thread()
        os._exit(code)

    try:
        import ray
        import torch

        import slime_harness as H
        from sglang.srt.weight_sync.delta.transport import HttpEngine
        from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
            UpdateWeightFromDistributedDelta,
        )

        torch.set_num_threads(1)
        ray.init(address=ray_address, namespace="dying-test", log_to_driver=False)
        engine, lock = ray.get_actor("dying-engine"), ray.get_actor("dying-lock")
        H.init_world(port, rank=rank, tp=2, timeout_s=120)
        model = H.build_model()
        trainer = H.StageTrainer(model, seed=rank, shared_seed=phase)
        up = UpdateWeightFromDistributedDelta(args, [model], weights_getter=lambda: {}, model_name="llama",
                                              quantization_config=None)
        up.connect_rollout_engines([engine], lock)
        rows, held = [], None
        for k in range(3 if phase == 0 else 2):
            mine = H.hf_state(args, model)
            if phase == 0 and k == 2:
                if rank == 1:
                    up._sharded.differ.changes = lambda *a, **kw: leave(17, {"died": True})
                try:  # the source: its sync stops where the dead rank's answer is missing
                    up.update_weights()
                    error = None
                except Exception as e:  # the job fails there (a later collective of the stage)
                    error = repr(e)
                m = up.pop_metrics() if error is None else {}
                (st,) = HttpEngine(url).status()
                leave(0, dict(rows=rows, error=error, failures=m.get("perf/update_weights_failures"),
                              holds_last=H.engine_holds(url, held), version=st.version, needs_full=st.needs_full,
                              pending=st.pending))
            up.update_weights()
            m = up.pop_metrics()
            if up._is_pp_src_rank:
                rows.append(dict(failures=m["perf/update_weights_failures"], holds=H.engine_holds(url, mine),
                                 full=m["perf/update_weights_full_sync_engines"], version=up.weight_version))
            held = mine
            trainer.step()
        up.disconnect_rollout_engines()
        out.put((rank, rows))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_a_rank_that_dies_mid_sync_leaves_the_engine_untouched_and_a_restarted_trainer_recovers(world, tmp_path):
    """A trainer rank's process dies inside its diff (TP=2, sharded, disk): no byte of that sync reaches the engine,
    which keeps the last acknowledged version exactly; a restarted trainer (new processes, no snapshot) gives it a
    full sync that continues its version chain, then deltas, bit-identical to slime's conversion."""
    import ray

    import slime_harness as H
    from cpu_harness import free_port
    from slime.ray.utils import Lock

    actors = [H.engine_actor_cls().options(name="dying-engine", namespace="dying-test").remote(world["server"].url),
              Lock.options(num_cpus=0, name="dying-lock", namespace="dying-test").remote()]
    args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding="deltas_zstd",
                       update_weight_disk_dir=str(tmp_path / "shared"), update_weight_delta_zstd_level=1)
    gcs = ray.get_runtime_context().gcs_address
    try:
        crashed = H.run_ranks(_dying_rank, 2, 0, free_port(), gcs, world["server"].url, args)
        restarted = H.run_ranks(_dying_rank, 2, 1, free_port(), gcs, world["server"].url, args)
    finally:
        for actor in actors:
            ray.kill(actor)
    assert crashed[1] == {"died": True}, crashed
    src = crashed[0]
    assert [(r["failures"], r["holds"], r["full"]) for r in src["rows"]] == [(0, True, 1), (0, True, 0)], src
    assert src["holds_last"] and src["version"] == src["rows"][-1]["version"], src  # not a byte of that sync
    assert not src["needs_full"] and src["pending"] is None, src
    assert src["error"] is not None or src["failures"] == 1, src  # the sync did not pass as done
    rows = restarted[0]
    assert [(r["failures"], r["holds"], r["full"]) for r in rows] == [(0, True, 1), (0, True, 0)], rows
    assert rows[0]["version"] > src["version"], (rows, src)  # the chain continues
    world.pop("version", None)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    """A Qwen3-MoE-shaped engine, started once for the sharded sender's MoE layouts (each trainer starts it over with a
    full sync, as a restarted trainer does)."""
    import slime_harness as H
    from cpu_harness import Server, bf16_state, hf_config, hf_model, write_hf_checkpoint

    root = tmp_path_factory.mktemp("moe")
    cfg = hf_config("qwen3-moe", vocab=H.VOCAB, hidden=H.HIDDEN, layers=H.LAYERS)
    assert (cfg.num_experts, cfg.moe_intermediate_size) == (H.EXPERTS, H.MOE_FFN)
    server = Server(write_hf_checkpoint(str(root / "moe"), cfg, bf16_state(hf_model(cfg, seed=2))),
                    str(root / "moe-server.log")).wait_healthy()
    yield server
    server.stop()


@pytest.mark.parametrize("layout, transport, encoding", [(dict(tp=2, dp=2, ep=2), "disk", "xor_ctx"),
                                                         (dict(tp=2, pp=2), "nccl", "deltas"),
                                                         (dict(pp=2, dp=2, ep=2), "disk", "xor_zstd")],
                         ids=["moe-tp2-ep2-dp2-disk-xor_ctx", "tp2-pp2-nccl-deltas", "moe-pp2-ep2-dp2-disk-xor_zstd"])
def test_sharded_sender(world, request, tmp_path, layout, transport, encoding):
    """``--update-weight-delta-sharded`` on real Megatron models (one process per rank, gloo) into a real server: a
    Qwen3-MoE-shaped one at TP=2 x EP=2 (its dense params TP=2 x DP=2) and at PP=2 x EP=2 (each stage's experts
    diffed by its own ranks) over disk, a dense one at TP=2 x PP=2 over NCCL. The first sync gathers (full), later
    ones send only the changes each rank found in its own slice (with ``xor_zstd`` and ``xor_ctx`` their base values
    too; with ``xor_ctx`` the ranks then find each change's class rank together, no base moving); the engine equals
    slime's own full HF conversion after every sync; each rank's snapshot is its share of its stage; the bytes moved
    to the source follow the changed elements; a rank whose diff fails (or, ``xor_ctx``, whose counts say it holds
    an element twice) makes the sync fail with no engine touched, and the next sync recovers as a delta.

    ``xor_ctx`` runs with a buffer above the engine's bound on a request, which then bounds the source's flushes
    and the segments they code in (the ranks count their facts in the segments the plan names), and with a shard
    chunk far below the buffer (rounds of 256 changes, some names larger than a round)."""

    import ray

    import slime_harness as H
    from cpu_harness import free_port
    from slime.ray.utils import Lock

    server = request.getfixturevalue("moe_server") if "ep" in layout else world["server"]  # a Qwen3-MoE engine
    actors = [H.engine_actor_cls().options(name="sharded-engine", namespace="sharded-test").remote(server.url),
              Lock.options(num_cpus=0, name="sharded-lock", namespace="sharded-test").remote()]
    xor, ctx = encoding in ("xor_zstd", "xor_ctx"), encoding == "xor_ctx"
    args = H.make_args(update_weight_transport=transport, update_weight_delta_encoding=encoding,
                       update_weight_disk_dir=str(tmp_path / "shared"), update_weight_delta_sharded=True,
                       update_weight_delta_fingerprint_interval=2, pipeline_model_parallel_size=layout.get("pp", 1),
                       num_experts=H.EXPERTS if "ep" in layout else None)
    if ctx:
        args.update_weight_buffer_size, args.update_weight_delta_shard_chunk_bytes = 512 << 20, 16 << 10
    n = layout.get("tp", 1) * layout.get("dp", 1) * layout.get("pp", 1)
    try:
        got = H.run_ranks(_sharded_rank, n, layout, free_port(), ray.get_runtime_context().gcs_address, server.url,
                          args)
    finally:
        for actor in actors:
            ray.kill(actor)
    sources = {r: rows for r, rows in got.items() if rows}
    assert len(sources) == layout.get("pp", 1), sorted(sources)
    for r, rows in sources.items():
        assert [row["failures"] for row in rows] == [0, 0, 0, 1, 0], (r, rows)
        assert all(row["holds"] for row in rows), (r, rows)  # the last acknowledged version, bit for bit
        assert [row["full"] for row in rows] == [1, 0, 0, 0, 0], (r, rows)  # the failed sync left no engine dirty
        assert rows[0]["density"] == 1.0 and all(0 < row["density"] < 0.2 for row in rows[1:3]), (r, rows)
        assert all(row["mismatches"] == 0 and row["gather_params"] == 0 for row in rows), (r, rows)
        assert all(row["snapshot"] == row["model"] for row in rows), (r, rows)  # the ranks' slices: the stage once
        assert all(row["sender_snapshot"] == 0 for row in rows), (r, rows)  # the source keeps no stage snapshot
        assert [rows[i]["xor"] for i in (0, 1, 2, 4)] == [0, xor, xor, xor], (r, rows)  # after the full sync
        assert [rows[i]["ctx"] for i in (0, 1, 2, 4)] == [0, ctx, ctx, ctx], (r, rows)
        if ctx:  # the engine's bound on a request, not the buffer, bounds the flushes (and their segments)
            assert 0 < rows[1]["bound"] < args.update_weight_buffer_size // 4, (r, rows)
            assert rows[-1]["raised"] > 0, (r, rows)  # names with more changes than a round: raised, said, sent
        for row in rows[1:3]:  # positions and values (and with xor the base values) of the changed elements
            assert 0 < row["to_source"] <= 1.2 * row["changed"] * (4 + 2 + 2 * xor) + 1024, (r, row)
    world.pop("version", None)  # the engine's chain moved on


def test_xor_ctx_takes_the_sharded_sender_by_default():
    """xor_ctx with the sharded sender: unset, it is on, as with the other sparse encodings."""
    import types

    from slime.utils.delta_sync_args import resolve_delta_args, runs_sparse_delta

    ns = types.SimpleNamespace(update_weight_mode="delta", update_weight_transport="disk",
                               update_weight_delta_encoding="xor_ctx")
    resolve_delta_args(ns)
    assert ns.update_weight_delta_sharded is True and runs_sparse_delta(ns)


def test_slimes_own_full_mode_on_a_patched_tree_lands_and_leaves_no_stale_prefix(world):
    """slime's own ``UpdateWeightFromDistributed`` (``--update-weight-mode full``), which our patches leave as
    upstream wrote it (pause, flush the cache, broadcast every param, continue), into the patched server over gloo:
    each sync lands bit-identically, and a prompt the cache held before it is computed afresh after it."""
    import slime_harness as H
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed import UpdateWeightFromDistributed
    from slime.utils.delta_sync_args import sparse_delta_updater_cls

    args = H.make_args(update_weight_mode="full", update_weight_delta_encoding="xor")
    assert sparse_delta_updater_cls(args) is None  # slime's own selection stands
    up = UpdateWeightFromDistributed(args, [world["model"]], weights_getter=lambda: {}, model_name="llama",
                                     quantization_config=None)
    up.connect_rollout_engines(world["engines"], world["lock"])
    req = {"input_ids": list(range(3, 40)), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    try:
        for _ in range(2):
            world["server"].post("/generate", req)
            cached = world["server"].post("/generate", req).json()["meta_info"]["cached_tokens"]
            assert cached > 0  # the prompt is in the radix cache
            world["trainer"].step()
            up.update_weights()
            engine_has(world["server"], H.hf_state(args, world["model"]))
            after = world["server"].post("/generate", req).json()["meta_info"]["cached_tokens"]
            assert after == 0, after  # no prefix computed with the old weights is served with the new ones
    finally:
        up.disconnect_rollout_engines()
