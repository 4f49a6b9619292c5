"""``make bench-slime SLIME_DIR=...``: slime's own disk delta and ours, side by side, on the same Megatron training steps.

One process, one real patched SGLang server on CPU (the image's tree: slime's SGLang patches, then ours). A
Megatron ``GPTModel`` (Llama-shaped, bf16 params, fp32 AdamW master weights at lr 1e-6) is reset to the same
step-0 weights and optimizer state for every method, so every method ships the very same steps:

* slime's ``UpdateWeightFromDiskDelta`` with ``xor`` and ``overwrite`` (its per-tensor zstd-1 files, each
  host's ``/pull_weights`` patching a local checkpoint, then a reload);
* our ``UpdateWeightFromDistributedDelta`` over ``disk`` with ``deltas_zstd``, ``planes_zstd`` and ``xor_zstd``
  (files applied in place by the engine).

Per step and method: wire bytes, bytes per changed bf16 element, sender time, engine time, total sync time,
and bit-identity of every engine param with slime's own HF conversion of the trainer's params. The result
goes into ``docs/benchmarks.md`` between the ``bench-slime`` markers (``make bench`` keeps that section).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_pages import write_page  # noqa: E402  (beside this script)

SIZE = dict(hidden=512, layers=4, heads=8, groups=2, ffn=1536, vocab=8192)
METHODS = (("slime", "xor"), ("slime", "overwrite"), ("ours", "deltas_zstd"), ("ours", "planes_zstd"),
           ("ours", "xor_zstd"))
BEGIN, END = "<!-- bench-slime:begin -->", "<!-- bench-slime:end -->"


def changed_elements(old: dict, new: dict) -> int:
    return sum(int((old[k].reshape(-1).view(torch.int16) != new[k].reshape(-1).view(torch.int16)).sum()) for k in new)


def run(steps: int, root: str) -> dict:
    import ray
    import requests
    import transformers

    import slime_harness as H
    from cpu_harness import Server, engine_mismatch, free_port, write_hf_checkpoint
    from slime.backends.megatron_utils.update_weight.update_weight_from_disk_delta import UpdateWeightFromDiskDelta
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )
    from slime.ray.utils import Lock

    H.configure(**SIZE)
    H.init_world(free_port())
    model = H.build_model(seed=1)
    start = [p.detach().clone() for p in model.parameters()]
    args0 = H.make_args()
    cfg = transformers.LlamaConfig(hidden_size=H.HIDDEN, num_hidden_layers=H.LAYERS, num_attention_heads=H.HEADS,
                                   num_key_value_heads=H.GROUPS, intermediate_size=H.FFN, vocab_size=H.VOCAB,
                                   rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False)
    boot = write_hf_checkpoint(os.path.join(root, "boot"), cfg, H.hf_state(args0, model))  # step 0 = slime's base
    server = Server(boot, os.path.join(root, "server.log")).wait_healthy()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    lock = Lock.options(num_cpus=0).remote()
    n_elems = sum(t.numel() for t in H.hf_state(args0, model).values())
    out = {"params": n_elems, "full_bytes": 2 * n_elems, "size": SIZE, "methods": {}}

    class SlimeOnCPU(UpdateWeightFromDiskDelta):
        """slime snapshots ``tensor.cpu()``, a copy from a GPU but the live param itself on CPU: copy as a GPU
        would; the two phases are timed (publish = sender, reload = every host's /pull_weights + reload)."""

        def _iter_hf_tensors(self):
            return ((name, t.clone()) for name, t in super()._iter_hf_tensors())

        def _publish(self):
            t0 = time.perf_counter()
            super()._publish()
            self.sender_s = time.perf_counter() - t0

        def _reload_engines(self):
            t0 = time.perf_counter()
            super()._reload_engines()
            self.engine_s = time.perf_counter() - t0

    try:
        for who, enc in METHODS:
            with torch.no_grad():  # the same step-0 weights and optimizer for every method: the same steps
                for p, s0 in zip(model.parameters(), start):
                    p.copy_(s0)
            trainer = H.Trainer(model, seed=0)
            r = requests.post(f"{server.url}/update_weights_from_disk", json={"model_path": boot}, timeout=300)
            assert r.json().get("success"), r.text  # the engine back at step 0 (ours then re-syncs in full)
            work = os.path.join(root, f"{who}-{enc}")
            if who == "slime":
                args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding=enc,
                                   update_weight_disk_dir=os.path.join(work, "shared"),
                                   update_weight_local_checkpoint_dir=os.path.join(work, "local"),
                                   hf_checkpoint=boot, update_weight_delta_checksum="adler32")
                up = SlimeOnCPU(args, [model], weights_getter=lambda: {}, model_name="llama", quantization_config=None)
                up.connect_rollout_engines([H.engine_actor_cls().remote(server.url, args)], lock)
            else:
                args = H.make_args(update_weight_transport="disk", update_weight_delta_encoding=enc,
                                   update_weight_disk_dir=os.path.join(work, "shared"),
                                   update_weight_buffer_size=512 << 20, update_weight_delta_fingerprint_interval=0)
                up = UpdateWeightFromDistributedDelta(args, [model], weights_getter=lambda: {}, model_name="llama",
                                                      quantization_config=None)
                up.weight_version = 1000 * (len(out["methods"]) + 1)  # above the chain of the method before
                up.connect_rollout_engines([H.engine_actor_cls().remote(server.url)], lock)
            up.update_weights()  # slime: captures its baseline (the boot checkpoint); ours: the full sync
            if who == "ours":
                up.pop_metrics()
            rows, before = [], H.hf_state(args, model)
            for _ in range(steps):
                trainer.step()
                after = H.hf_state(args, model)
                t0 = time.perf_counter()
                up.update_weights()
                total = time.perf_counter() - t0
                if who == "slime":
                    m = dict(up.update_weight_metrics)
                    row = {"wire": m["perf/update_weights_wire_bytes"], "sender_s": up.sender_s,
                           "engine_s": up.engine_s}
                else:
                    m = up.pop_metrics()
                    assert m["perf/update_weights_failures"] == 0 and m["perf/update_weights_full_sync_engines"] == 0, m
                    row = {"wire": m["perf/update_weights_wire_bytes"], "sharded": args.update_weight_delta_sharded,
                           "sender_s": m["perf/update_weights_encode_s"], "engine_s": m["perf/update_weights_apply_s"]}
                    if enc == "xor_zstd":
                        assert m["perf/update_weights_xor"] == 1, m
                row.update(total_s=total, changed=changed_elements(before, after))
                name = engine_mismatch(server, after)
                assert name is None, f"{who} {enc}: {name} differs on the engine"
                rows.append(row)
                before = after
            up.disconnect_rollout_engines()
            out["methods"][f"{who}:{enc}"] = rows
            print(f"bench-slime: {who} {enc}: " + ", ".join(f"{r['wire'] / r['changed']:.2f} B/elem" for r in rows)
                  + ", bit-identical after every step", flush=True)
    finally:
        ray.shutdown()
        server.stop()
    return out


def with_section(path: str, doc: str, section) -> None:
    """Write ``doc`` to ``path`` with ``section`` (text between the markers, or None) as its last part, replacing
    the one it held: ``make bench`` rewrites the rest of the file and keeps this section, this script the reverse."""
    if BEGIN in doc:
        doc = doc[:doc.index(BEGIN)] + doc[doc.index(END) + len(END):]
    doc = doc.rstrip("\n") + "\n"
    write_page(path, doc + ("\n" + section.strip("\n") + "\n" if section else ""))


def section_of(doc: str):
    """The ``bench-slime`` section of a benchmarks file, or None."""
    return doc[doc.index(BEGIN):doc.index(END) + len(END)] if BEGIN in doc and END in doc else None


def section(res: dict, env: str) -> str:
    first = res["methods"]["slime:xor"]
    L = [
        BEGIN,
        "## Side by side with slime's own disk delta",
        "",
        f"Written by `make bench-slime SLIME_DIR=...` (`scripts/bench_slime.py`); one run on {env}. A Megatron "
        f"`GPTModel` (Llama-shaped: hidden {res['size']['hidden']}, {res['size']['layers']} layers, vocab "
        f"{res['size']['vocab']}; {res['params'] / 1e6:.1f}M params, {res['full_bytes'] / 1e6:.1f} MB in bf16) takes "
        f"the same {len(first)} AdamW steps (lr 1e-6, fp32 master weights) for every method, each synced into one "
        "real patched SGLang server on CPU (slime's SGLang patches, then ours). After every step every engine param "
        "equals slime's own HF conversion of the trainer's params, for every method.",
        "",
        "| method | files | bytes per changed element | wire bytes | sender ms | engine ms | total sync ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, rows in res["methods"].items():
        who, enc = key.split(":")
        what = {"slime": "slime's `UpdateWeightFromDiskDelta` (zstd-1 per tensor; /pull_weights + reload)",
                "ours": f"ours over `disk`{', sharded sender' if rows[0].get('sharded') else ''} (applied in place)"}[who]
        bpe = [r["wire"] / r["changed"] for r in rows]
        L.append(f"| `{enc}` | {what} | {min(bpe):.2f}–{max(bpe):.2f} | {min(r['wire'] for r in rows) / 1e6:.2f}–"
                 f"{max(r['wire'] for r in rows) / 1e6:.2f} MB | {1e3 * min(r['sender_s'] for r in rows):,.0f} | "
                 f"{1e3 * min(r['engine_s'] for r in rows):,.0f} | {1e3 * min(r['total_s'] for r in rows):,.0f} |")
    dens = [r["changed"] / res["params"] for r in first]
    L += [
        "",
        f"Density of the steps: {min(dens):.2%}–{max(dens):.2%} of bf16 elements. **bytes per changed element**: the "
        "sync's files (slime: its `model-*.safetensors`; ours: every flush file) over the bf16 elements the step "
        "changed (range over the steps). **sender**: slime's `_publish` (gather, diff, compress, write) / our `encode_s` "
        "(sharded, the default: the trainer rank's diff of its own slices, the changes to the source, encode; "
        "files are written beside it); **engine**: slime's `_reload_engines` (every host's `/pull_weights` "
        "patching its local checkpoint, then `update_weights_from_disk` of the whole model) / our slowest engine's "
        "read + apply; **total**: the updater's `update_weights()` wall time (also pausing and resuming generation). "
        "Times are the best step of the run: on this 2-core machine (trainer, Ray and the server share it) a step's "
        "time is bimodal, 0.05–0.1 s or 0.3–0.5 s, for every method alike; per-step rows are in the run's "
        "`result.json`. CPU, so the ratios, not the milliseconds, carry over.",
        END,
    ]
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--workdir", default="build/bench-slime")
    ap.add_argument("--out", default="docs")
    ap.add_argument("--report-only", action="store_true", help="rewrite the section from the last run's result.json")
    ap.add_argument("--tp", type=int, default=1, help="with --ep/--pp/--moe: the sharded sender against "
                    "gather-then-diff on that trainer layout (scripts/bench_slime_sharded.py)")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--encoding", default="deltas_zstd", help="the sharded comparison's encoding (another than "
                    "deltas_zstd: its own section of the page)")
    args = ap.parse_args()
    if args.tp > 1 or args.ep > 1 or args.pp > 1 or args.moe:
        import bench_slime_sharded

        return bench_slime_sharded.main(args)
    os.makedirs(args.workdir, exist_ok=True)
    result = os.path.join(args.workdir, "result.json")
    if args.report_only:
        res = json.load(open(result))
    else:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        res = run(args.steps, tempfile.mkdtemp(dir=os.path.abspath(args.workdir)))
        json.dump(res, open(result, "w"), indent=1)
    import platform

    env = f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    text = section(res, env)
    path = os.path.join(args.out, "benchmarks.md")
    with_section(path, open(path).read() if os.path.exists(path) else "", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
