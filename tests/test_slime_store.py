"""slime's patched updater publishing into a version store (SeaweedFS): the sharded sender at two pipeline stages
coding ``xor_ctx`` (the ranks find each change's class rank together; the store keeps the coded files),
an engine slime adds mid-run (as after its fault-tolerance restart) catching up from the store instead of a full
sync, and a compaction that checks the stages' merged fingerprint. Needs the patched slime checkout
(``make test-slime``)."""
import os

import pytest

SLIME = os.environ.get("SLIME_PATCHED_DIR")
pytestmark = pytest.mark.skipif(
    not SLIME, reason="slime tests need a patched slime checkout: run `make test-slime SLIME_DIR=/path/to/slime`")


def _store_stage(stage, port, ray_address, args, where, out):
    """One pipeline stage's source rank: four syncs after real steps; before the third, slime re-connects its engines
    with one more (a fresh server)."""
    import traceback

    try:
        import ray

        import slime_harness as H
        from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
            UpdateWeightFromDistributedDelta,
        )

        ray.init(address=ray_address, namespace="store-test", log_to_driver=False)
        engine, late, lock = (ray.get_actor(n) for n in ("store-engine", "store-late", "store-lock"))
        H.init_world(port, rank=stage, pp=2)
        model = H.build_model()
        trainer = H.StageTrainer(model, seed=stage)
        up = UpdateWeightFromDistributedDelta(args, [model], weights_getter=lambda: {}, model_name="llama",
                                              quantization_config=None)
        up.connect_rollout_engines([engine], lock)
        rows = []
        for k in range(4):
            if k == 2:
                up.disconnect_rollout_engines()
                up.connect_rollout_engines([engine, late], lock)
            state = H.hf_state(args, model)
            up.update_weights()
            m = up.pop_metrics()
            rows.append(dict(failures=m["perf/update_weights_failures"], full=m["perf/update_weights_full_sync_engines"],
                             catch_ups=m["perf/update_weights_catch_ups"], density=m["perf/update_weights_density"],
                             ctx=m.get("perf/update_weights_ctx", 0), version=up.weight_version,
                             sharded=m.get("perf/update_weights_sharded_snapshot_bytes", 0)))
            trainer.step()
        up.disconnect_rollout_engines()
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in state.items()}, f"{where}/stage{stage}.safetensors")
        out.put((stage, dict(rows=rows)))
    except BaseException:
        out.put((stage, traceback.format_exc()))


def test_the_sharded_sender_at_two_stages_publishes_into_the_store_and_slimes_added_engine_catches_up(tmp_path):
    import ray

    import slime_harness as H
    from cpu_harness import Server, bf16_state, engine_mismatch, free_port, hf_model, write_hf_checkpoint
    from slime.ray.utils import Lock
    from sglang.srt.weight_sync.delta.store.manifest import StoreKey
    from sglang.srt.weight_sync.delta.store.tools import log as store_log
    from sglang.srt.weight_sync.delta.tools import main
    from store_server import SeaweedS3

    import transformers

    s3 = SeaweedS3(str(tmp_path / "seaweed"))
    servers = []
    try:
        url = s3.url()
        key_file = tmp_path / "store.key"
        key_file.write_bytes(os.urandom(32).hex().encode())
        cfg = transformers.LlamaConfig(hidden_size=H.HIDDEN, num_hidden_layers=H.LAYERS, num_attention_heads=H.HEADS,
                                       num_key_value_heads=H.GROUPS, intermediate_size=H.FFN, vocab_size=H.VOCAB,
                                       rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False)
        boot = write_hf_checkpoint(str(tmp_path / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
        extra = ["--update-weight-store-key-file", str(key_file)]
        servers = [Server(boot, str(tmp_path / f"server{k}.log"), extra=extra) for k in range(2)]
        for s in servers:
            s.wait_healthy()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
        actors = [H.engine_actor_cls().options(name=n, namespace="store-test").remote(s.url)
                  for n, s in zip(("store-engine", "store-late"), servers)]
        actors.append(Lock.options(num_cpus=0, name="store-lock", namespace="store-test").remote())
        args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding="xor_ctx",
                           update_weight_store=url, update_weight_store_key_file=str(key_file),
                           update_weight_store_anchor_every=0, hf_checkpoint=boot, pipeline_model_parallel_size=2,
                           update_weight_delta_fingerprint_interval=2)
        try:
            got = H.run_ranks(_store_stage, 2, free_port(), ray.get_runtime_context().gcs_address, args,
                              str(tmp_path))
        finally:
            for actor in actors:
                ray.kill(actor)
            ray.shutdown()
        rows = got[0]["rows"]
        assert [r["failures"] for r in rows] == [0, 0, 0, 0], rows
        assert [r["full"] for r in rows] == [1, 0, 0, 0], rows  # the first: an anchor, loaded from the store
        assert [r["catch_ups"] for r in rows] == [0, 0, 1, 0], rows  # the added engine: from the store, no full sync
        assert [r["ctx"] for r in rows] == [0, 1, 1, 1] and all(0 < r["density"] < 0.2 for r in rows[1:]), rows
        assert all(r["sharded"] > 0 for r in rows), rows  # the ranks diffed their own slices
        from safetensors.torch import load_file

        stage0, stage1 = (load_file(str(tmp_path / f"stage{k}.safetensors")) for k in (0, 1))
        state = {**stage0, **stage1}
        assert len(state) == len(stage0) + len(stage1)
        for s in servers:
            assert engine_mismatch(s, state) is None
        assert main(["store", "compact", url, "--key-file", str(key_file)]) == 0  # version 4: both stages' prints
        lines = store_log(url, StoreKey.from_file(str(key_file)))
        assert any(line.startswith("v000004") and line.endswith("fingerprint anchor") for line in lines), lines
    finally:
        for s in servers:
            s.stop()
        s3.stop()
