"""`make bench-memory`: the peak tensor memory of every transient of a sync, measured at small scale on this box,
against the reference that bounds it -> one line per component on stdout and a section of docs/benchmarks.md.

A component's peak is the bytes of tensor storage it creates and holds at once (``cpu_harness.LiveBytes``: storage
that existed before, such as the weights or the sender's snapshot, is not counted). Each flush-bounded component is
measured on two model depths with the same number of changed elements: it is ``ok`` when its peak is within budget on
both and does not grow with the model. slime's shard map build and sharded diff run on two gloo ranks at TP=2 with a
real Megatron GPTModel; the engine's components on a real SGLang model class, in process.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import textwrap

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_pages import write_page  # noqa: E402  (beside this script)

GROWTH = 1.25  # the most a flush-bounded peak may grow from one model depth to twice it
MARK = ("<!-- bench-memory:begin -->", "<!-- bench-memory:end -->")


def _slime_rank(rank, port, sizes, flush, changed, out):
    """One TP rank: the shard map build at ``flush`` and at slime's largest scripted buffer (reference: slime's own
    bf16 gather of the largest param), one sharded diff of ``changed`` elements with their base values, and
    ``xor_ctx``'s facts of them found by both ranks (reference: the shard chunk, ``flush``)."""
    import traceback

    try:
        import slime_harness as H
        from cpu_harness import LiveBytes
        from megatron.core import mpu
        from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers
        from sglang.srt.weight_sync.delta import ctx
        from slime.backends.megatron_utils.update_weight.delta_shard_diff import ShardDiffer
        from slime.backends.megatron_utils.update_weight.delta_shard_rounds import MERGE_BYTES, send_changes
        from slime.backends.megatron_utils.update_weight.delta_shard_facts import find_facts
        from slime.backends.megatron_utils.update_weight.delta_shard_map import build_shard_maps

        torch.set_num_threads(1)
        H.configure(*sizes)
        H.init_world(port, rank=rank, tp=2)
        model = H.build_model()
        args = H.make_args(update_weight_buffer_size=flush)
        params = list(named_params_and_buffers(args, [model]))
        tp = mpu.get_tensor_model_parallel_world_size()
        gathered = max(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for _, p in params)
        with LiveBytes() as built:
            maps = build_shard_maps(args, [model], "llama")
        assert all(m.pure for m in maps.values()), [(m.name, m.why) for m in maps.values() if not m.pure]
        with LiveBytes() as built_big:  # at the 4 GiB buffer of slime's scripts: the working blocks follow the param
            build_shard_maps(H.make_args(update_weight_buffer_size=4 << 30), [model], "llama")
        differ = ShardDiffer(maps, flush)
        differ.seed(params)
        name, emb = next((n, p) for n, p in params if "word_embeddings" in n)
        with torch.no_grad():  # a fixed number of changed elements, whatever the depth
            flat = emb.data.view(-1)
            at = torch.arange(changed, dtype=torch.int64) * (flat.numel() // changed)
            flat[at] = (flat[at].view(torch.int16) ^ 1).view(flat.dtype)
        with LiveBytes() as diffed:
            found = differ.changes(params, olds=True)
        assert sum(sum(b[1]) for b in found.blocks) == changed, name
        at_source = [p for got, _ in send_changes(found, 0) for p in got or []]
        with LiveBytes() as facts:
            wrong, _ = find_facts(differ, at_source if rank == 0 else None, 0, None, None, ctx.seg_log2_for(flush),
                                  torch.device("cpu"))
        assert wrong is None and (rank or at_source[0].run.facts is not None), wrong
        del found, at_source
        with torch.no_grad():  # as many changes again, beside the first: what each change adds
            flat[at + 1] = (flat[at + 1].view(torch.int16) ^ 1).view(flat.dtype)
        with LiveBytes() as diffed2:
            differ.changes(params, olds=True)
        differ.commit()
        # the source's rounds: changes spread over every param (so rounds cut between names), then twice as many,
        # then four times as many in the embedding alone (its changes split by position); a round holds at most
        # ``rounds`` changes, or one piece's
        rounds = max(1, changed // 4)
        owned = [p for n, p in params if n in differ.snapshot and p.is_floating_point()]
        merges, refs = [], []
        for k in range(3):
            with torch.no_grad():
                for p in owned if k < 2 else [emb]:
                    flat = p.data.view(-1)
                    per = min(flat.numel(), max(1, changed // len(owned)) if k < 2 else 4 * changed)
                    at = torch.arange(per, dtype=torch.int64) * (flat.numel() // per) + k
                    at = at[at < flat.numel()]
                    flat[at] = (flat[at].view(torch.int16) ^ 1).view(flat.dtype)
            found, largest = differ.changes(params, olds=True), 0
            with LiveBytes() as merged:
                for got, _ in send_changes(found, 0, round_changes=rounds):  # each dropped once taken, as the sender
                    largest = max([largest] + [max(p.run.counts, default=0) for p in got or []])  # does
            merges.append(merged.peak)
            refs.append(max(rounds, largest) * MERGE_BYTES if rank == 0 else 0)
        out.put((rank, dict(build=max(built.peak, built_big.peak), gather=2 * gathered, diff=diffed.peak,
                            facts=facts.peak,
                            diff_per_change=(diffed2.peak - diffed.peak) / changed, merge=merges[0],
                            merge2=max(merges[1:]), round=max(refs))))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def slime_components(layers: int, flush: int, changed: int) -> dict:
    import slime_harness as H
    from cpu_harness import free_port

    sizes = (256, layers, 4, 2, 512, 64000)  # hidden, layers, heads, groups, ffn, vocab: the embedding dominates
    got = H.run_ranks(_slime_rank, 2, free_port(), sizes, flush, changed)
    return {k: max(r[k] for r in got.values())
            for k in ("build", "gather", "diff", "facts", "diff_per_change", "merge", "merge2", "round")}


def engine_components(layers: int, flush: int, changed: int, workdir: str, device="cpu") -> dict:
    """The sender's delta sync, and the engine's apply (``deltas_zstd``), xor rebuild (``xor_zstd``), full sync and
    fingerprint, each on its own model on ``device``, with ``flush`` as the sender's buffer and the engine's chunk.
    The sender's engine sits on the CPU, so a device's figures are the sender's alone."""
    from cpu_harness import (Host, InProcessEngine, PeakMemory, bf16_state, delta_flushes, full_flushes, hf_config,
                             hf_model, nan_filled, publish_request, sglang_model)
    from sglang.srt.weight_sync.delta import fingerprint
    from sglang.srt.weight_sync.delta.ctx import seg_log2_for
    from sglang.srt.weight_sync.delta.receiver import fingerprint_payload
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport

    device = torch.device(device)
    workdir = tempfile.mkdtemp(dir=workdir)  # this call's files, removed at its end
    cfg = hf_config("qwen2", vocab=32000, hidden=256, layers=layers)
    old = bf16_state(hf_model(cfg))
    new = {n: t.clone() for n, t in old.items()}
    per = max(1, changed // len(new))
    for t in new.values():  # the same number of changed elements per param at every depth
        flat = t.view(-1)
        at = torch.arange(min(per, flat.numel()), dtype=torch.int64) * max(1, flat.numel() // per)
        flat[at] = (flat[at].view(torch.int16) ^ 1).view(flat.dtype)
    out = {"changed": sum(int((a.view(torch.int16) != b.view(torch.int16)).sum())
                          for a, b in zip(old.values(), new.values())),
           "model": sum(t.numel() * t.element_size() for t in old.values()),
           "flush or param": max(flush, max(t.nbytes for t in old.values()))}

    def request(version, payloads, zstd):
        """(version dir, its files) of one disk request."""
        vdir = publish_request(tempfile.mkdtemp(dir=workdir), version, payloads, zstd)
        return vdir, sorted(os.listdir(vdir))

    def engine(on, full=True):
        host = Host(nan_filled(sglang_model(cfg).to(on)), chunk_bytes=flush)
        host.device = on
        e = InProcessEngine(host)
        if full:
            ok, msg = e.update_weights_from_disk(*request(1, full_flushes(old, version=1, max_params=8), False), "1")
            assert ok, msg
        return e

    def segments(state):  # chunks of at most the flush buffer, or one larger param alone (as slime's gather hands
        chunks, chunk, size = [], [], 0  # them over, bucketed by --update-weight-buffer-size)
        for item in state.items():
            if chunk and size + item[1].nbytes > flush:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(item)
            size += item[1].nbytes
        return [lambda: chunks + [chunk]]

    for encoding, key in (("deltas_zstd", "sender flush"), ("xor_ctx", "sender xor_ctx flush")):
        sink = engine("cpu")
        transport = DiskTransport(os.path.join(workdir, "sender"), [sink], zstd=1)
        sender = DeltaSender(transport, [sink], encoding=encoding, buffer_bytes=flush, device=device)
        assert sender.update(segments({n: t.to(device) for n, t in old.items()}))[0][0]
        live = {n: t.to(device) for n, t in new.items()}
        with PeakMemory(device) as m:
            assert sender.update(segments(live))[0][0]
        assert sender.pop_metrics()["perf/update_weights_ctx"] == (encoding == "xor_ctx")
        out[key] = m.peak
        transport.close()
    for encoding, key in (("deltas_zstd", "engine apply"), ("xor_zstd", "engine xor rebuild"),
                          ("xor_ctx", "engine xor_ctx decode")):
        e = engine(device)
        payloads = delta_flushes(old, new, encoding, version=2, base_version=1, max_params=8)
        for p in payloads:  # as the sender's bucket sets them from its buffer
            p.seg_log2 = seg_log2_for(flush)
        vdir, files = request(2, payloads, True)
        with PeakMemory(device) as m:
            ok, msg = e.update_weights_from_disk(vdir, files, "2")
        assert ok, msg
        out[key] = m.peak
    fresh = engine(device, full=False)
    vdir, files = request(1, full_flushes(old, version=1, max_params=8), False)
    with PeakMemory(device) as m:
        ok, msg = fresh.update_weights_from_disk(vdir, files, "1")
    assert ok, msg
    out["engine full sync"] = m.peak
    with PeakMemory(device) as m:
        fingerprint_payload(fresh.host.model)
    out["fingerprint"] = m.peak
    out["fingerprint block"] = fingerprint._BLOCK * 8  # its int64 words
    shutil.rmtree(workdir, ignore_errors=True)
    return out


# component -> (budget, reference: "flush" (the flush buffer and the engine's chunk), "chunk" (the sharded sender's,
# here the flush buffer's size) or its key in the figures)
BUDGETS = {"shard map build": (2.0, "gather"), "sharded diff": (3.0, "chunk"), "sharded xor_ctx facts": (2.0, "chunk"),
           "sharded source round": (2.0, "round"),
           "sender flush": (4.0, "flush or param"), "sender xor_ctx flush": (4.0, "flush or param"),
           "engine apply": (4.0, "flush"), "engine xor rebuild": (4.0, "flush"), "engine xor_ctx decode": (4.0, "flush"),
           "engine full sync": (4.0, "flush"),
           "fingerprint": (4.0, "fingerprint block")}
# what grows with the changed elements, not with a setting: (budget in bytes per change, figure, whose changes)
PER_CHANGE = {"sharded diff per change": (40, "diff_per_change", "of the rank's slices")}
WORDS = {"round": "the largest round (chunk / 64 B changes, or one piece's) x 64 B",
         "gather": "slime's own bf16 gather of the largest param", "fingerprint block": "its block of int64 words",
         "flush or param": "the flush buffer or the largest param (a chunk)"}


def judge(name: str, peaks, figures: dict, flush: int):
    """(line, ok) of one component: its largest peak against budget x reference; with two depths, not growing."""
    budget, key = BUDGETS[name]
    ref = flush if key in ("flush", "chunk") else figures[key]
    words = {"flush": f"the flush buffer ({flush} B)", "chunk": f"the shard chunk ({flush} B)"}.get(key) or WORDS[key]
    peak = max(peaks)
    grows = key != "gather" and len(peaks) > 1 and peaks[1] > GROWTH * peaks[0]
    ok = peak <= budget * ref and not grows
    line = f"memory: {name}: peak {peak} B = {peak / ref:.2f}x {words}; budget {budget:g}x; {'ok' if ok else 'OVER'}"
    if grows:
        line += f" (grew {peaks[1] / max(1, peaks[0]):.2f}x with twice the layers)"
    return line, ok, ref


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="build/bench-memory")
    p.add_argument("--flush", type=int, default=4 << 20, help="the sender's buffer and the engine's chunk (bytes)")
    p.add_argument("--changed", type=int, default=20000, help="changed elements per sync")
    p.add_argument("--layers", type=int, default=2, help="the smaller depth (the other: twice it)")
    p.add_argument("--doc", default="docs/benchmarks.md")
    a = p.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(0)
    depths = (a.layers, 2 * a.layers)
    eng = [engine_components(d, a.flush, a.changed, a.workdir) for d in depths]
    print(f"memory: (engine side measured at {depths[0]} and {depths[1]} layers)", file=sys.stderr, flush=True)
    sl = [slime_components(d, a.flush, a.changed) for d in depths]
    rows, bad = [], 0
    for name in BUDGETS:
        figures = sl if name.startswith(("shard", "sharded")) else eng
        key = {"shard map build": "build", "sharded diff": "diff", "sharded xor_ctx facts": "facts",
               "sharded source round": "merge"}.get(name, name)
        peaks = [f[key] for f in figures]
        if name == "sharded source round":  # the stage's changes, then twice them: in rounds, not growing
            peaks = [sl[-1]["merge"], sl[-1]["merge2"]]
        line, ok, ref = judge(name, peaks, figures[-1], a.flush)
        print(line, flush=True)
        rows.append((name, peaks, ref, line))
        bad += not ok
    for name, (budget, key, words) in PER_CHANGE.items():  # O(changed): what memory.md multiplies out at scale
        per = max(f[key] for f in sl)
        ok = per <= budget
        line = f"memory: {name}: {per:.1f} B per changed element {words} (O(changed)); budget {budget:g} B; " \
               f"{'ok' if ok else 'OVER'}"
        print(line, flush=True)
        rows.append((name, None, None, line))
        bad += not ok
    _report(a, rows, eng, depths)
    return 1 if bad else 0


def _report(a, rows, eng, depths) -> None:
    table = ["| component | peak at %d layers | peak at %d layers | reference | ratio | budget |" % depths,
             "|---|---|---|---|---|---|"]
    for name, peaks, ref, _ in rows:
        if peaks is None:
            continue
        table.append(f"| {name} | {peaks[0]:,} B | {peaks[1]:,} B | {ref:,} B | {max(peaks) / ref:.2f}x | "
                     f"{BUDGETS[name][0]:g}x |")
    intro = textwrap.fill(
        "Tensor bytes each component creates and holds at once (storage that existed before — weights, the sender's "
        "snapshot — not counted), on this CPU box, at two depths with the same number of changed elements "
        f"({eng[0]['changed']:,}): a flush-bounded component must not grow with the model. Flush buffer, engine "
        f"chunk and shard chunk: {a.flush:,} B. Shard map build, sharded diff, the source's rounds and xor_ctx's "
        "facts: two gloo ranks at TP=2, a Megatron GPTModel with a 64,000 x 256 embedding (the map build: the larger "
        "peak at that buffer and at 4 GiB, slime's largest; the source's rounds: at 4 layers, with "
        "changes spread over every param, then twice as many, then four times as many in the embedding alone, in "
        "rounds of a quarter of the first); the others: a "
        "Qwen2-shaped SGLang model, in process. `make gpu-check` reports the same components' device peaks on a GPU.",
        118, break_long_words=False, break_on_hyphens=False)
    text = "\n".join([
        MARK[0],
        "## Peak memory of each transient (`make bench-memory`)",
        "",
        intro,
        "",
        *table,
        "",
        "```",
        *[line for *_, line in rows],
        "```",
        MARK[1],
    ])
    doc = open(a.doc).read() if os.path.exists(a.doc) else ""
    pattern = re.compile(re.escape(MARK[0]) + ".*?" + re.escape(MARK[1]), re.S)
    doc = pattern.sub(lambda _: text, doc) if pattern.search(doc) else doc.rstrip("\n") + "\n\n" + text + "\n"
    write_page(a.doc, doc)


if __name__ == "__main__":
    sys.exit(main())
