"""The in-process ``sglang.Engine`` takes delta syncs through its own methods (files=, delta=, weight_version=).

The Engine spawns its scheduler, so the scenario runs as this file's ``__main__`` in a child
process; the test asserts on its exit status and output.
"""
import os
import subprocess
import sys
import threading


def scenario(root: str) -> None:
    import torch

    import sglang
    from cpu_harness import bf16_state, delta_flushes, free_port, full_flushes, hf_config, hf_model, rl_states, write_hf_checkpoint
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.delta.files import write_safetensors
    from sglang.srt.weight_sync.delta.wire import POSITIONS, VALUES, dtype_to_str

    cfg = hf_config("llama", vocab=300)
    states = rl_states(cfg, 3)
    boot = write_hf_checkpoint(os.path.join(root, "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    eng = sglang.Engine(model_path=boot, device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                        mem_fraction_static=0.1, max_total_tokens=2048, sampling_backend="pytorch",
                        grammar_backend="none", skip_server_warmup=True, tp_size=1, log_level="warning")
    sessions = hasattr(eng, "begin_weight_update")

    def check(state, tag):
        for n, want in state.items():
            got = torch.tensor(eng.get_weights_by_name(n, truncate_size=1 << 20), dtype=torch.float32)
            got = got.to(torch.bfloat16)[: want.shape[0]]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{tag}: {n} differs"
        print(f"{tag}: bit-identical", flush=True)

    try:
        for v in (1, 2):
            payloads = full_flushes(states[0], version=1) if v == 1 else \
                delta_flushes(states[0], states[1], "deltas", version=2, base_version=1)
            vdir = os.path.join(root, f"weight_v{v:06d}")
            os.makedirs(vdir)
            for pl in payloads:
                name = f"rank0000_flush{pl.spec.flush:06d}.safetensors"
                with open(os.path.join(vdir, name), "wb") as f:
                    f.write(write_safetensors(pl.spec, pl.positions, pl.values))
                ok, msg, _ = eng.update_weights_from_disk(vdir, load_format="delta", files=[name], weight_version=str(v))
                assert ok, msg
            check(states[v - 1], f"disk v{v}")
        port, box = free_port(), {}
        t = threading.Thread(target=lambda: box.setdefault("pg", init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name="eng")))
        t.start()
        ok, msg = eng.init_weights_update_group("127.0.0.1", port, 1, 2, "eng", backend="gloo")
        t.join(60)
        assert ok, msg
        for v in (3, 4):
            for pl in delta_flushes(states[v - 2], states[v - 1], "indices", version=v, base_version=v - 1):
                if sessions:
                    eng.begin_weight_update()
                t = threading.Thread(target=lambda: [torch.distributed.broadcast(x, src=0, group=box["pg"])
                                                     for x in (pl.positions, pl.values)])
                t.start()
                ok, msg = eng.update_weights_from_distributed(
                    [POSITIONS, VALUES], ["uint8", dtype_to_str(pl.values.dtype)],
                    [[pl.positions.numel()], [pl.values.numel()]], group_name="eng", load_format="delta",
                    delta=pl.spec.to_json(), weight_version=str(v))
                t.join(60)
                if sessions:
                    eng.end_weight_update()
                assert ok, msg
            check(states[v - 1], f"distributed v{v}")
        ok, msg, _ = eng.update_weights_from_disk(boot)  # a plain load: the chain is broken until a full sync
        assert ok, msg
        vdir = os.path.join(root, "weight_v000005")
        os.makedirs(vdir)
        for kind, payloads in (("delta", delta_flushes(states[2], states[3], "deltas", version=5, base_version=4)),
                               ("full", full_flushes(states[3], version=5))):
            assert len(payloads) == 1
            name = f"{kind}_flush000000.safetensors"
            with open(os.path.join(vdir, name), "wb") as f:
                f.write(write_safetensors(payloads[0].spec, payloads[0].positions, payloads[0].values))
            ok, msg, _ = eng.update_weights_from_disk(vdir, load_format="delta", files=[name], weight_version="5")
            if kind == "delta":
                assert not ok and "weights were replaced by update_weights_from_disk since version 4: the engine " \
                    "needs a full sync" in msg, msg
                check(bf16_state(hf_model(cfg, seed=2)), "plain load, delta refused")
            else:
                assert ok, msg
        check(states[3], "full after plain load")
        print("ENGINE OK", flush=True)
    finally:
        eng.shutdown()


def test_engine_delta_sync(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.join(os.path.dirname(here), "scripts")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=500)
    assert r.returncode == 0 and "ENGINE OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    for tag in ("disk v1", "disk v2", "distributed v3", "distributed v4", "plain load, delta refused",
                "full after plain load"):
        assert f"{tag}: bit-identical" in r.stdout


if __name__ == "__main__":
    scenario(sys.argv[1])
