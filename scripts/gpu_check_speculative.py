"""gpu-check's speculative lane (``scripts/gpu_check.py`` runs it): a real ``sglang.launch_server`` with EAGLE and
slime's speculative flags, on a GLM-4.x MoE whose checkpoint carries its NextN draft layer (SGLang loads the draft
from the same checkpoint, as for slime's GLM-4.7 and R1 recipes). The trainer moves both the model and the draft
layer; after every sync the engine's fingerprint (target and draft, one model to the receiver) equals the
trainer's. Then a full sync of the same state from a fresh sender: the same greedy request gives the same text and
the same draft acceptance as after the delta syncs. Needs SGLang's own CUDA kernels: EAGLE does not run on the CPU
or on the bundle's import stub (the dry run says so and skips it).
"""
from __future__ import annotations

import copy
import os

FLAGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4"]  # slime's recipes
PROMPT = {"input_ids": list(range(3, 35)), "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                              "ignore_eos": True}}


def _served(server) -> tuple:
    """(ok, text, accepted drafts, verify steps) of one greedy request."""
    r = server.post("/generate", PROMPT)
    if r.status_code != 200:
        return False, r.text[:200], None, None
    out = r.json()
    meta = out["meta_info"]
    return meta["completion_tokens"] == 48, out["text"], meta.get("spec_accepted_drafts"), meta.get("spec_verify_ct")


def check_speculative_server(report, args, device, workdir, stubbed: bool) -> None:
    from cpu_harness import Server, bf16_state, hf_config, hf_model, rl_steps, segments, with_nextn, \
        write_hf_checkpoint
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine

    what = f"a real launch_server with EAGLE ({' '.join(FLAGS[1::2])}) and a NextN draft through {args.steps} syncs"
    if device.type != "cuda" or stubbed:
        report.skip(what, "EAGLE runs on SGLang's own CUDA kernels: a GPU host with SGLang installed")
        return
    report.add(f"\nspeculative lane: {what}")
    cfg = hf_config("glm4-moe", vocab=args.vocab, hidden=args.hidden, layers=args.layers)
    cfg.num_nextn_predict_layers = 1
    trainer_cfg = copy.deepcopy(cfg)
    trainer_cfg.num_hidden_layers += 1  # its last layer: the draft's decoder layer
    layer = cfg.num_hidden_layers
    root = os.path.join(workdir, "speculative")
    boot = write_hf_checkpoint(os.path.join(root, "boot"), cfg,
                               with_nextn(bf16_state(hf_model(trainer_cfg, seed=2)), layer, 100))
    trainer = hf_model(trainer_cfg, seed=1)
    states = [bf16_state(trainer)] + list(rl_steps(trainer, args.steps, lr=1e-6, batch=2, seq=64))
    states = [with_nextn(s, layer, k) for k, s in enumerate(states)]
    server = Server(boot, os.path.join(root, "server.log"), extra=FLAGS, device=device.type)
    try:
        server.wait_healthy(timeout=900)
        engine = HttpEngine(server.url)
        transport = DiskTransport(os.path.join(root, "shared"), [engine], zstd=1)
        sender = DeltaSender(transport, [engine], encoding="xor_zstd", fingerprint_every=1)
        for step, state in enumerate(states):
            ok, msg = sender.update(segments(state))[0]
            m = sender.pop_metrics()
            served = _served(server)
            good = ok and served[0] and m["perf/update_weights_fingerprint_mismatches"] == 0
            report.check(good, f"speculative step {step} ({'full sync' if not step else 'delta'}): fingerprint of "
                               f"target and draft equal, a request served after it"
                               + ("" if good else f" — {msg}; served {served[:2]}"))
        after_deltas = served
        transport.close()
        fresh = DiskTransport(os.path.join(root, "shared-full"), [engine], zstd=1)
        ok, msg = DeltaSender(fresh, [engine], encoding="xor_zstd", fingerprint_every=1).update(
            segments(states[-1]))[0]
        after_full = _served(server)
        fresh.close()
        same = ok and after_full == after_deltas and after_deltas[2] is not None
        rate = (f"{after_deltas[2]} drafts accepted in {after_deltas[3]} verify steps" if after_deltas[2] is not None
                else "no acceptance figures in meta_info")
        report.check(same, f"speculative: after a full sync of the same state, the same text and draft acceptance "
                           f"as after the delta syncs ({rate})"
                           + ("" if same else f" — {msg}; deltas {after_deltas[2:]}, full {after_full[2:]}"))
    finally:
        server.stop()
