"""gpu-check's sharded-sender lane: slime's ``--update-weight-delta-sharded`` on the device (``scripts/gpu_check.py``
runs it where Megatron-core and the patched slime tree are on the path: the GPU bundle carries both; ``make
test-slime`` runs its dry run on the CPU, so CI keeps it working).

A Llama-shaped Megatron GPTModel at TP = the ranks (two GPUs: two ranks over NCCL, the changes going device to
device; one GPU: one rank), stepped with seeded gradients, syncs through the sharded sync's own steps as slime's
updater runs them (the source's plan, each rank's diff of its pinned slice, the maps rebuilt on a gathering sync, the
outcome settled on every rank) into SGLang's own model class in a process of its own, over disk with ``xor_zstd``
and again with ``xor_ctx`` (the ranks find their changes' class ranks together, ``delta_shard_facts``).
After every sync the engine equals slime's full HF conversion bit for bit; one publish corrupted on the way makes the
engine refuse it, every rank keeps its positions staged, and the next delta carries them. Figures: the host
synchronizations in each rank's diff, and a sharded delta's time against the gathering sync's.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from typing import Optional

import torch

from sglang.srt.weight_sync.delta.engine_api import DeltaEngine

SENDER_BUFFER = 64 << 20  # the source's flush buffer in this lane
SYNCS, REFUSED = 5, 2  # sync 0 gathers (full); the engine refuses sync 2's publish
ENCODINGS = ("xor_zstd", "xor_ctx")  # the disk default; the fewest bytes, whose ranks find their changes' classes


def _sizes(args) -> dict:
    """The Megatron model: the dry run's tiny one, else about the size of gpu-check's other lanes."""
    heads = max(4, args.hidden // 64)
    return dict(hidden=args.hidden, layers=args.layers, heads=heads, groups=heads // 2, ffn=2 * args.hidden,
                vocab=args.vocab)


def _hf_config(sizes):
    import transformers

    return transformers.LlamaConfig(hidden_size=sizes["hidden"], num_hidden_layers=sizes["layers"],
                                    num_attention_heads=sizes["heads"], num_key_value_heads=sizes["groups"],
                                    intermediate_size=sizes["ffn"], vocab_size=sizes["vocab"], rms_norm_eps=1e-5,
                                    max_position_embeddings=128, tie_word_embeddings=False)


class _PipeEngine(DeltaEngine):
    """The sender's engine interface, served by the engine process over a pipe (its own process: SGLang's
    in-process model wants a distributed world of its own, apart from the trainer's)."""

    def __init__(self, conn):
        self.conn = conn

    def call(self, *request):
        self.conn.send(request)
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"engine process: {value}")
        return value

    def update_weights_from_disk(self, model_path, files, weight_version, store=None):
        return self.call("update_weights_from_disk", model_path, files, weight_version, store)

    def fingerprint(self):
        return self.call("fingerprint")

    def status(self):
        return self.call("status")


def _engine(device_type: str, sizes, stubbed: bool, conn) -> None:
    """SGLang's LlamaForCausalLM on the first device behind the receiver; ``holds``: equal to a second one loaded in
    full with a saved HF state?"""
    try:
        if stubbed:
            from gpu_check import install_sgl_kernel_stub

            install_sgl_kernel_stub()
        from cpu_harness import InProcessEngine
        from gpu_check import engine_host, first_difference

        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)
        cfg = _hf_config(sizes)
        engine, ref = InProcessEngine(engine_host(cfg, device)), engine_host(cfg, device).model
        conn.send((True, None))
        while True:
            request = conn.recv()
            if request[0] == "stop":
                return
            try:
                if request[0] == "holds":
                    with torch.no_grad():
                        ref.load_weights(list(torch.load(request[1]).items()))
                    conn.send((True, first_difference(engine.host.model, ref)))
                else:
                    conn.send((True, getattr(engine, request[0])(*request[1:])))
            except Exception:
                conn.send((False, traceback.format_exc()))
    except BaseException:
        conn.send((False, traceback.format_exc()))


def _segments(sharded, sender, args, model, source: bool):
    """The sync as slime's updater runs it: the sharded sync's start (the plan, this rank's changes yielded by the
    source as found elsewhere, new maps on a gathering sync), then slime's gather + conversion of the params that
    take that path (every one on a gathering sync; slime's updater module itself needs Ray, which the bundle lacks)."""
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
    from slime.backends.megatron_utils.update_weight.common import all_gather_param, named_params_and_buffers

    def first():
        params = list(named_params_and_buffers(args, [model]))
        yield from sharded.start(params, sender if source else None)
        for name, param in params:
            if sharded.last["gather"] or name in sharded.impure:
                yield [(n, t.clone()) for n, t in convert_to_hf(args, "llama", name, all_gather_param(name, param),
                                                                None)]

    return [first]


def _rank(rank: int, ranks: int, device_type: str, port: int, root: str, sizes, stubbed: bool, encoding: str, conn,
          out) -> None:
    """One trainer rank; the source (rank 0) drives the sender and checks the engine after every sync."""
    try:
        if stubbed:
            from gpu_check import install_sgl_kernel_stub

            install_sgl_kernel_stub()
        import torch.distributed as dist

        import slime_harness as H
        from cpu_harness import SyncCounter, flip_a_value_bit
        from sglang.srt.weight_sync.delta.diff import changed_positions
        from sglang.srt.weight_sync.delta.sender import DeltaSender
        from sglang.srt.weight_sync.delta.transport import DiskTransport
        from sglang.srt.weight_sync.delta.wire import zstd_level
        from slime.backends.megatron_utils.update_weight.delta_sharded import ShardedSync

        cuda = device_type == "cuda"
        if not cuda:
            torch.set_num_threads(1)
        H.configure(sizes["hidden"], sizes["layers"], sizes["heads"], sizes["groups"], sizes["ffn"], sizes["vocab"])
        H.init_world(port, rank=rank, tp=ranks, backend="nccl" if cuda else "gloo")
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        model = H.build_model().to(device)
        trainer = H.StageTrainer(model, seed=rank, shared_seed=0)  # what TP does not split steps alike
        shared = os.path.join(root, "shared")
        args = H.make_args(update_weight_transport="disk", update_weight_disk_dir=shared,
                           update_weight_delta_encoding=encoding, update_weight_delta_sharded=True)
        source = rank == 0
        sender = corrupt = None
        if source:
            engine = _PipeEngine(conn)

            def hook(version_dir):  # a link that flips a bit once: the engine must refuse the publish
                if corrupt:
                    flip_a_value_bit(version_dir, "")

            transport = DiskTransport(shared, [engine], zstd=zstd_level(encoding), post_write_hook=hook)
            sender = DeltaSender(transport, [engine], encoding=encoding, buffer_bytes=SENDER_BUFFER, device=device,
                                 fingerprint_every=1, repair_dirty=False)
        lines, held, base = [], None, None
        from cpu_harness import PeakMemory
        from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers
        from slime.backends.megatron_utils.update_weight.delta_shard_map import (WORK_BYTES, block_elements,
                                                                                 build_shard_maps)

        gather = 2 * max(p.numel() * (ranks if getattr(p, "tensor_model_parallel", False) else 1)
                         for _, p in named_params_and_buffers(args, [model]))  # slime's bf16 gather, largest param
        with PeakMemory(device) as peak:
            build_shard_maps(args, [model], "llama")
        # a model this small: its working block is not negligible beside the gather
        modeled = 2 * gather + WORK_BYTES * block_elements(args, gather // 2)
        lines.append(("memory", peak.peak <= modeled,
                      f"rank {rank}: shard map build, device peak {peak.peak} B = {peak.peak / gather:.2f}x slime's "
                      f"own bf16 gather of the largest param ({gather} B); modeled at most {modeled} B (2x, and its "
                      "working block)"))
        sharded = ShardedSync(args, [model], "llama", None, source)
        for k in range(SYNCS):
            mine = {n: t.cpu() for n, t in H.hf_state(args, model).items()}  # collective: slime's own conversion
            corrupt = k == REFUSED
            segments = _segments(sharded, sender, args, model, source)
            if k == 1 and cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if k == 1:  # the host synchronizations of this rank's diff on its device, counted once
                real = sharded.differ.changes

                def counted(*a, **kw):
                    with SyncCounter() as syncs:
                        found = real(*a, **kw)
                    lines.append(("figure", f"rank {rank}: its diff of {len(sharded.differ.snapshot)} slices took "
                                            f"{len(syncs.ops)} host synchronizations"))
                    return found

                sharded.differ.changes = counted
            with PeakMemory(device) as sync_peak:
                if source:
                    ok, msg = sender.update(segments)[0]
                    m = sender.pop_metrics()
                else:
                    for segment in segments:
                        for _ in segment():
                            pass
            if cuda:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            if k == SYNCS - 1:  # a sharded delta: the device steps of docs/memory.md that coexist, at their bounds
                from slime.backends.megatron_utils.update_weight.delta_shard_rounds import MERGE_BYTES
                from slime.utils.delta_sync_args import shard_chunk_bytes

                buf = shard_chunk_bytes(args)  # the sharded steps' chunk (unset: the buffer)
                # a round: the chunk's worth of changes, or a piece that cannot be cut smaller, at most every element
                # of the largest param (``gather`` holds 2 B each) at MERGE_BYTES each (xor_ctx cuts at segments)
                modeled = 3 * buf + 2 * max(buf, MERGE_BYTES * gather // 2) + 2 * buf \
                    + (4 * max(SENDER_BUFFER, gather) if source else 0)
                lines.append(("figure",  # a figure, not a check: a model this small is its fixed costs
                              f"rank {rank}: a sharded delta sync ({encoding}), device peak {sync_peak.peak} B; "
                              f"modeled at most {modeled} B (diff chunks 3x the chunk, a round 2x, the facts 2x"
                              + (", the source's flush 4x its buffer)" if source else ")")))
            if k == 1:
                del sharded.differ.changes  # the instance's counted wrapper: back to the method
            outcome = sharded.settle(sender)
            sharded.last = None
            pinned = all(t.is_pinned() for t in sharded.differ.flat.values()) if cuda else True
            snap = torch.tensor([sharded.differ.snapshot_bytes])
            dist.all_reduce(snap, group=sharded.group)
            lines.append(("rank", k, sharded.differ.snapshot_bytes, pinned, outcome, seconds))
            if source:
                held_now = mine if ok else held
                path = os.path.join(root, "expected.pt")
                torch.save(held_now, path)
                bad = engine.call("holds", path)
                changed = sum(changed_positions(base[n], t).numel() for n, t in mine.items()) if base else 0
                model_bytes = sum(t.numel() * t.element_size() for t in mine.values())
                lines.append(("sync", k, ok, msg, bad, m["perf/update_weights_density"],
                              m["perf/update_weights_fingerprint_mismatches"], sharded.sent_bytes, changed,
                              int(snap), model_bytes, len(sender.state.snapshot), seconds,
                              m.get("perf/update_weights_ctx", 0)))
                held, base = held_now, mine if ok else base
            trainer.step()
        if source:
            conn.send(("stop",))
            transport.close()
        out.put((rank, lines, None))
    except BaseException:
        out.put((rank, [], traceback.format_exc()))


def check_sharded_sender(report, args, device, workdir: str, stubbed: bool, ranks: Optional[int] = None,
                         encoding: str = ENCODINGS[0]) -> None:
    """``ranks``: the trainer's TP width; by default two where there are two GPUs (or on the dry run), else one."""
    from cpu_harness import free_port

    cuda = device.type == "cuda"
    ranks = ranks or (min(2, torch.cuda.device_count()) if cuda else 2)
    sizes = _sizes(args)
    report.add(f"\nsharded-sender lane: slime's sharded delta sync, a Megatron GPTModel (hidden {sizes['hidden']}, "
               f"{sizes['layers']} layers) at TP={ranks}, one {'GPU' if cuda else 'CPU process'} per rank, "
               f"{'NCCL' if cuda and ranks > 1 else 'gloo'} between the ranks, `{encoding}` over disk into SGLang's "
               f"LlamaForCausalLM; sync {REFUSED}'s publish corrupted on the way")
    root = os.path.join(workdir, f"sharded-sender-{encoding}")
    os.makedirs(root)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ours, theirs = ctx.Pipe()
    engine = ctx.Process(target=_engine, args=(device.type, sizes, stubbed, theirs))
    engine.start()
    ok, error = ours.recv()
    if not ok:
        report.check(False, f"the engine process stopped:\n```\n{error}```")
        engine.join(60)
        return
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, ranks, device.type, port, root, sizes, stubbed, encoding,
                                             ours if r == 0 else None, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, lines, error = out.get(timeout=900)
            results[rank] = (lines, error)
    finally:
        for p in procs + [engine]:
            p.join(60)
    for rank in sorted(results):
        if results[rank][1]:
            report.check(False, f"rank {rank} stopped:\n```\n{results[rank][1]}```")
    if any(error for _, error in results.values()):
        return
    _report(report, results, ranks, cuda, encoding)


def _report(report, results, ranks: int, cuda: bool, encoding: str) -> None:
    """The source's checks per sync, every rank's snapshot share and outcomes, the figures."""
    syncs = [line[1:] for line in results[0][0] if line[0] == "sync"]
    times = {}
    for k, ok, msg, bad, density, mismatches, to_source, changed, snap, model_bytes, kept, seconds, coded in syncs:
        kind = "gathering (full) sync" if k == 0 else "refused publish" if k == REFUSED else \
            "delta carrying the staged positions" if k == REFUSED + 1 else "delta"
        want_ok = k != REFUSED
        good = ok == want_ok and bad is None and mismatches == 0 and snap == model_bytes and kept == 0
        if k and want_ok:  # xor_ctx: coded as asked (the engine's status says it decodes it), not fallen back
            good = good and 0 < density < 1 and coded == (encoding == "xor_ctx")
        if k and k != REFUSED + 1 and want_ok:  # positions + values + xor bases of the changed elements
            good = good and (0 < to_source <= 1.2 * changed * (4 + 2 + 2) + 1024 if ranks > 1 else to_source == 0)
        holds = "bit-identical to slime's conversion" if ok else "at the last acknowledged version, byte for byte"
        report.check(good, f"sharded sync {k} ({kind}): engine {holds}, fingerprint mismatches {int(mismatches)}, "
                           f"density {density:.2%}, {to_source} B to the source for {changed} changed elements, the "
                           f"ranks' snapshots {snap} B = the model's {model_bytes} B, the source keeps none ({kept} "
                           f"params)"
                           + ("" if good else f" — ok {ok}: {msg}; first differing param: {bad}"))
        times.setdefault("full" if k == 0 else "delta", []).append(seconds)
    model_bytes = syncs[-1][9]
    for rank in sorted(results):
        rows = [line[1:] for line in results[rank][0] if line[0] == "rank"]
        outcomes = [outcome for _, _, _, outcome, _ in rows]
        want = ["seed"] + ["commit"] * (REFUSED - 1) + ["stage"] + ["commit"] * (SYNCS - REFUSED - 1)
        share = rows[-1][1]
        report.check(outcomes == want and all(p for _, _, p, _, _ in rows) and share <= model_bytes // ranks + 4096,
                     f"rank {rank}: outcomes {outcomes}, snapshot share {share} B of the model's {model_bytes} B"
                     + (" in pinned host memory" if cuda else ""))
        for line in results[rank][0]:
            if line[0] == "figure":
                report.add(f"- {line[1]}")
            elif line[0] == "memory":
                report.check(line[1], line[2])
    full, delta = times["full"][0], min(times["delta"])
    report.add(f"- sync time on the source: gathering sync {1e3 * full:.1f} ms, sharded delta {1e3 * delta:.1f} ms "
               f"({full / delta:.2f}x)" + ("" if cuda else " (CPU dry run: not a figure)"))
