"""``make bench``: full sync vs delta sync, side by side in one run, on a Qwen2.5-0.5B-shaped model in bf16.

Three phases, so the numbers share one process and the memory run repeats them exactly:

1. **states** — a Qwen2.5-0.5B-shaped HF model (494M params, tied embeddings; HF's init, std 0.02 as
   the released config's ``initializer_range``) takes real AdamW steps (fp32 master weights, lr 1e-6,
   forward/backward on random tokens); the bf16 state after each step is saved (cached under the
   work dir while the shape, steps and seed are unchanged).
2. **measure** (a subprocess, run twice) — per step and per encoding, the sender core diffs, encodes
   and advances its snapshot (``DeltaState`` + ``DeltaBucket``, the code the slime updater runs),
   disk encodings also serialize (safetensors, each encoding's zstd level as ``AsyncSafetensorsWriter``), and a
   real SGLang ``Qwen2ForCausalLM`` applies the very same flushes through the receiver
   (``_apply_delta_payload`` for tensors as a broadcast delivers them, each request's spec parsed from its JSON
   inside the clock; ``_apply_delta`` reading the files for the disk encodings). The first run checks every step
   and encoding bit-identical by the weight fingerprint. The second run sets ``MALLOC_MMAP_THRESHOLD_=65536`` so every tensor buffer is its own mapping and
   RSS follows live tensors; a 1 ms sampling thread records the peak RSS above the baseline before
   each phase (that run's times are inflated by page faults and are not used; the timing run samples nothing).
3. **report** — ``docs/benchmarks.md`` (tables + method) and ``docs/benchmarks.png``.

    python scripts/bench.py [--shape qwen2.5-0.5b|qwen3-30b-a3b-topology|qwen3-235b-a22b-topology|tiny] [--steps 4]
        [--workdir build/bench] [--out docs]

A ``*-topology`` shape writes its plot and its rows of ``docs/benchmarks-topology.md`` (``bench_topology.py``) instead.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from statistics import mean

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from md_pages import write_page  # noqa: E402  (beside this script)

SHAPES = {
    # Qwen2.5-0.5B's config.json (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, vocab 151936, tied)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02),
    # the same architecture, small enough for the test that keeps this script from rotting (widths: FP8 blocks of 128)
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True,
                 initializer_range=0.02),
    # Qwen3-30B-A3B's and Qwen3-235B-A22B's topology (48 / 94 layers of 128 experts, top-8: 18,867 / 36,945 HF
    # tensors) at narrow widths: the per-tensor cost that decides the sync time of large MoE models
    "qwen3-30b-a3b-topology": dict(_moe=True, hidden_size=64, intermediate_size=128, num_hidden_layers=48,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=128,
                                   num_experts_per_tok=8, moe_intermediate_size=32, vocab_size=2048,
                                   max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.02),
    "qwen3-235b-a22b-topology": dict(_moe=True, hidden_size=64, intermediate_size=128, num_hidden_layers=94,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=128,
                                     num_experts_per_tok=8, moe_intermediate_size=32, vocab_size=2048,
                                     max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.02),
}
ENCODINGS = ("indices", "deltas", "deltas_zstd", "planes_zstd", "xor_zstd", "xor_ctx")
TRANSPORT = {"indices": "nccl", "deltas": "nccl", "deltas_zstd": "disk", "planes_zstd": "disk",
             "xor_zstd": "disk", "xor_ctx": "disk"}  # the apply path each is measured on
BUFFER_BYTES = 512 << 20  # slime's default --update-weight-buffer-size
LINKS = {"300 MB/s": 300e6, "1 GB/s": 1e9}
# Published figures, quoted as their authors state them (see the seed article's references).
ANCHORS = [
    ("PULSE (arXiv 2602.03839)", "NCCL, sparse bf16 patch", "~79x on average, >100x typical"),
    ("SparrowRL (arXiv 2602.11456)", "Qwen3-8B payload", "79x"),
    ("TRL delta weight sync", "Qwen3-0.6B, Hub bucket", "1.2 GB -> 20-35 MB (34-60x)"),
    ("slime delta-weight-sync.md", "355B, ~3% density", "~5 GB per sync"),
]


def model_config(shape: str):
    import transformers

    fields = dict(SHAPES[shape])
    if fields.pop("_moe", False):
        return transformers.Qwen3MoeConfig(**fields)
    return transformers.Qwen2Config(**fields)


def doc_name(shape: str, ext: str) -> str:
    """benchmarks.md / .png; the topology shapes share one page (``bench_topology``), each with its own plot."""
    if shape.endswith("-topology"):
        return "benchmarks-topology.md" if ext == "md" else f"benchmarks-{shape}.{ext}"
    return f"benchmarks.{ext}"


# ---------------------------------------------------------------- phase 1: states


def train_states(shape: str, steps: int, workdir: str, seed: int = 1) -> list:
    """Paths of the bf16 states at steps 0..steps (safetensors), reused while shape, steps and seed are unchanged."""
    from safetensors.torch import save_file

    from cpu_harness import bf16_state, hf_model, rl_steps

    key = {"shape": SHAPES[shape], "steps": steps, "seed": seed, "lr": 1e-6, "torch": torch.__version__}
    paths = [os.path.join(workdir, f"state-{k}.safetensors") for k in range(steps + 1)]
    stamp = os.path.join(workdir, "states.json")
    if os.path.exists(stamp) and json.load(open(stamp)) == key and all(map(os.path.exists, paths)):
        print(f"states: reusing {len(paths)} saved bf16 states in {workdir}")
        return paths
    os.makedirs(workdir, exist_ok=True)
    cfg = model_config(shape)
    t0 = time.time()
    model = hf_model(cfg, seed=seed)

    def save(state, path):
        if cfg.tie_word_embeddings:  # a tied checkpoint holds the embedding once, as Qwen2.5-0.5B's does
            state.pop("lm_head.weight", None)
        save_file(state, path)

    save(bf16_state(model), paths[0])
    for k, state in enumerate(rl_steps(model, steps, lr=1e-6, seed=seed, batch=2, seq=32), start=1):
        save(state, paths[k])
        print(f"states: step {k}/{steps} trained and saved ({time.time() - t0:.0f}s)")
    json.dump(key, open(stamp, "w"))
    return paths


# ---------------------------------------------------------------- phase 2: measure


class PeakRSS:
    """Peak process RSS above the baseline while the block runs (1 ms sampling thread)."""

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra = self.peak - self.base


MEMORY_RUN = "MALLOC_MMAP_THRESHOLD_" in os.environ  # the second measuring run: its times are not used


def measured(fn, *args):
    """(result, seconds, peak extra RSS bytes) of ``fn(*args)``. RSS is sampled in the memory run only: in the timing
    run (whose memory figures are not used) the sampling thread's wake-ups would take the GIL from the clocked code."""
    if not MEMORY_RUN:
        t = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t, 0
    with PeakRSS() as m:
        t = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t
    return out, dt, m.extra


CHUNK_PARAMS = 128


def snapshot_of(state: dict) -> dict:
    """A copy of ``state`` laid out as the sender keeps its snapshot (tensors cut from shared slabs)."""
    from sglang.srt.weight_sync.delta.snapshot import HostLink

    link = HostLink(torch.device("cpu"))
    return {k: link.host_copy(v) for k, v in state.items()}


FOLD_S: list = []  # per sender_sync: the seconds its snapshot fold took after commit() returned


def sender_sync(snapshot, new, encoding: str, version: int, raw=(), bases=None):
    """One delta sync on the sender: diff vs the snapshot, encode into bounded buckets, advance the snapshot
    (``xor_zstd``: the snapshot's values at the changed positions go along; ``raw``: the engine's ``xor_raw``;
    ``xor_ctx``: ``bases``, the base state, which its files are coded against when serialized, after this fold).
    The fold into the snapshot, which ``DeltaSender`` leaves running behind its sync, is waited for here and its
    time appended to :data:`FOLD_S`."""
    from sglang.srt.weight_sync.delta.ops import gc_paused

    with gc_paused():  # as DeltaSender.update runs
        return _sender_sync(snapshot, new, encoding, version, raw, bases)


def _sender_sync(snapshot, new, encoding: str, version: int, raw, bases):
    from sglang.srt.weight_sync.delta.bucket import DeltaBucket
    from sglang.srt.weight_sync.delta.snapshot import DeltaState
    from sglang.srt.weight_sync.delta.files import as_parts

    state = DeltaState(torch.device("cpu"))
    state.snapshot = snapshot
    bucket, payloads, raw = DeltaBucket(encoding, BUFFER_BYTES), [], frozenset(raw)
    if encoding == "xor_ctx":  # as SyncRun does, whole bases (there the snapshot's, folded after the files are written)
        bucket.base_of = lambda name, numel, dtype: torch.zeros((), dtype=dtype).expand(numel) if name in raw \
            else bases[name].reshape(-1)
    items = list(new.items())
    xor = encoding == "xor_zstd"
    for at in range(0, len(items), CHUNK_PARAMS):  # the chunks a trainer hands over: one diff per chunk
        chunk = items[at:at + CHUNK_PARAMS]
        found = state.changes(chunk, [snapshot[name] for name, _ in chunk], olds=xor)
        if not (xor and not raw.isdisjoint(name for name, _ in chunk)) and bucket.add_chunk(chunk, found):
            state.record(chunk, found)  # as DeltaSender does: a one-run chunk below the bound goes in whole
            continue
        member = {k: (f, j) for f in found for j, k in enumerate(f.ks)}
        for k, (name, t) in enumerate(chunk):  # as DeltaSender does: unchanged params are left out
            f, j = member[k]
            if bucket.should_flush(name):
                payloads += bucket.take(version=version, base_version=version - 1)
            if not f.counts[j]:
                continue
            if xor and name in raw:
                idx, values, _ = f.share(j)
                bucket.add(name, t, idx, torch.zeros(idx.numel(), dtype=t.dtype), values)
            else:
                bucket.add_found(f, j, name, list(t.shape))
        state.record(chunk, found)
    payloads += bucket.take(version=version, base_version=version - 1)
    state.commit(version)
    t = time.perf_counter()
    state.settle()
    FOLD_S.append(time.perf_counter() - t)
    return as_parts(payloads)  # the bench applies them as one request (flush 0, final)


def serialize(payloads, encoding: str):
    """The file bytes of each flush, as the disk transport's writer produces them (the encoding's zstd level), with
    the cyclic collector paused as it is while the writer runs inside ``DeltaSender.update``: the plane layouts build
    a tuple per param, and a collection they set off here would scan the engine's whole heap."""
    from sglang.srt.weight_sync.delta.files import flush_file
    from sglang.srt.weight_sync.delta.ops import gc_paused
    from sglang.srt.weight_sync.delta.wire import zstd_level

    with gc_paused():
        return [flush_file(p, zstd_level(encoding)) for p in payloads]


def whole_tensor_xor_bytes(old, new) -> int:
    """Bytes of zstd level 1 over ``new ^ old`` per whole tensor: the scheme of slime's own ``xor`` delta, computed
    here on the same states (slime's updater itself runs in ``make bench-slime``)."""
    import zstandard

    from sglang.srt.weight_sync.delta.ops import INT_VIEW

    z = zstandard.ZstdCompressor(level=1)
    total = 0
    for k, b in new.items():
        a = old[k]
        iv = INT_VIEW[b.element_size()]
        total += len(z.compress(torch.bitwise_xor(a.reshape(-1).view(iv), b.reshape(-1).view(iv)).numpy().tobytes()))
    return total


def plain_load(model, state: dict):
    """Upstream ``model.load_weights`` of a whole state: the baseline every apply and full sync is compared with.
    The cyclic collector is paused, as it is while the receiver applies: a collection inside the load scans the
    engine's whole heap, and how many fall in it varies (measured on the 30B-A3B topology: 15-40% longer)."""
    from sglang.srt.weight_sync.delta.ops import gc_paused

    with gc_paused():
        return model.load_weights(list(state.items()))


def measure(paths: list, shape: str, out_json: str, check: bool) -> None:
    from safetensors.torch import load_file

    from cpu_harness import Host, SyncCounter, full_flushes, receiver_class, sglang_model
    from sglang.srt.weight_sync.delta import diff, fingerprint
    from sglang.srt.weight_sync.delta.receiver import delta_status, receiver_state
    from sglang.srt.weight_sync.delta.diff import changed_positions
    from sglang.srt.weight_sync.delta.ops import gc_paused
    from sglang.srt.weight_sync.delta.wire import DeltaPayload, DeltaSpec, received_params

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    states = [load_file(p) for p in paths]
    n = sum(t.numel() for t in states[0].values())
    full_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    model = sglang_model(model_config(shape))
    host = Host(model)
    res = {"params": n, "tensors": len(states[0]), "full_bytes": full_bytes, "steps": []}

    def received(payloads):
        """Requests as a broadcast delivers them: each flush with its spec's JSON, written by the sender."""
        return [(p.spec.to_json(), p) for p in payloads]

    def broadcast_apply(requests):
        """The engine parses each request's spec JSON first, with garbage collection paused from the parse on, and
        hashes its params' text as it arrived (as _apply_received_delta runs)."""
        with gc_paused():
            return host.call("_apply_delta_payload", [
                DeltaPayload(DeltaSpec.from_json(text), p.positions, p.values, params_text=received_params(text))
                for text, p in requests])

    receiver_class()  # imported before the clock starts: the one-time import of SGLang's runner is not a sync's cost
    full = [measured(broadcast_apply, received(full_flushes(states[0], version=v))) for v in (2, 3, 4)]
    assert all(ok for (ok, _), _, _ in full), full
    res["full_wire_s"] = statistics.median(t for _, t, _ in full)  # as the plain load below: median of three
    res["full_wire_mem"] = max(m for _, _, m in full)
    full = [measured(plain_load, model, states[0]) for _ in range(3)]
    res["full_load_s"] = statistics.median(t for _, t, _ in full)
    res["full_load_mem"] = max(m for _, _, m in full)
    items = list(states[0].items())
    with gc_paused():  # as the engine's checker action and the sender's update run
        _, res["fingerprint_engine_s"], res["fingerprint_engine_mem"] = measured(
            fingerprint.engine_shares, receiver_state(model).copies)
        _, res["fingerprint_trainer_s"], res["fingerprint_trainer_mem"] = measured(
            lambda: fingerprint.read_shares(fingerprint.tensor_shares(items)))  # as the sender does (per chunk there)
    version, wire_dir = 4, os.path.join(os.path.dirname(out_json), "wire")
    os.makedirs(wire_dir, exist_ok=True)

    def publish(payloads, files):
        """The file names the disk transport would announce, after writing them (outside the timed apply)."""
        names = [f"v{payloads[0].spec.version}-{k}.safetensors" for k in range(len(files))]
        for name, data in zip(names, files):
            with open(os.path.join(wire_dir, name), "wb") as f:
                f.write(data)
        return names

    def apply(payloads, names):
        if names:  # disk: the engine reads and decompresses the files the writer left in the shared dir
            return host.call("_apply_delta", wire_dir, names)
        return broadcast_apply(payloads)  # the specs' JSON was written by the sender, outside the clock

    def counted_apply(payloads, names):
        """The memory run (its times are not used) also counts the apply's host synchronizations."""
        with SyncCounter() as c:
            out = apply(payloads, names)
        counted_apply.syncs = len(c.ops)
        return out

    copies = {k: torch.empty_like(v) for k, v in states[-1].items()}  # the memcpy baseline's destination, reused
    for step in range(1, len(states)):
        old, new = states[step - 1], states[step]
        nnz = sum(changed_positions(old[k], new[k]).numel() for k in new)
        row = {"step": step, "density": nnz / n, "nnz": nnz, "enc": {},
               "whole_tensor_xor_bytes": whole_tensor_xor_bytes(old, new) if check else 0}
        trainer = {k: fingerprint.tensor_fingerprint(k, v) for k, v in new.items()} if check else None
        _, row["memcpy_s"], _ = measured(lambda: [copies[k].copy_(t) for k, t in new.items()])
        _, row["diff_s"], _ = measured(lambda: diff.changes_many([(old[k], new[k]) for k in new]))
        for i, encoding in enumerate(ENCODINGS):
            snapshot = snapshot_of(old)
            version += 1
            raw = delta_status(model).xor_raw  # names the engine never stores travel raw in xor_zstd
            payloads, t_enc, m_enc = measured(sender_sync, snapshot, new, encoding, version, raw, old)
            t_fold = FOLD_S[-1]
            assert all(torch.equal(snapshot[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
            files, t_ser, m_ser = measured(serialize, payloads, encoding)
            names = publish(payloads, files) if TRANSPORT[encoding] == "disk" else None
            request = [(p.spec.to_json(), p) for p in payloads]
            (ok, msg), t_apply, m_apply = measured(apply if check else counted_apply, request, names)
            assert ok, msg
            if check:
                engine = fingerprint.engine_shares(receiver_state(model).copies)
                mismatched, uncovered = fingerprint.compare_shares(trainer, engine, new)
                assert not mismatched and not uncovered, (encoding, step, mismatched[:3], uncovered[:3])
            row["enc"][encoding] = {
                "wire_bytes": sum(map(len, files)), "flushes": len(payloads), "encode_s": t_enc, "encode_mem": m_enc,
                "fold_s": t_fold,
                "serialize_s": t_ser if TRANSPORT[encoding] == "disk" else 0.0, "apply_s": t_apply,
                "apply_mem": m_apply, "tensors_sent": sum(len(p.spec.params) for p in payloads),
                "host_syncs": None if check else counted_apply.syncs}
            if i < len(ENCODINGS) - 1:  # back to the step's base for the next encoding (untimed)
                version += 1
                ok, msg = host.call("_apply_delta_payload", sender_sync({k: v.clone() for k, v in new.items()},
                                                                        old, "indices", version))
                assert ok, msg
        res["steps"].append(row)
        print(f"measure: step {step}/{len(states) - 1} density {row['density']:.2%}"
              + (", every encoding bit-identical on the engine" if check else ""), flush=True)
    res["overhead"] = measure_overhead(states[-1], version, apply, model if check else None)
    if not shape.endswith("-topology"):
        res["fp8"] = measure_fp8(states, shape, wire_dir, check)
    json.dump(res, open(out_json, "w"), indent=1)


def _pieces(state: dict, count: int) -> dict:
    """``state``'s bytes, per dtype, as about ``count`` tensors in all (flat, equal pieces)."""
    by: dict = {}
    for t in state.values():
        by.setdefault(t.dtype, []).append(t.reshape(-1))
    size = max(1, -(-sum(t.numel() for t in state.values()) // max(1, count)))
    return {f"{dt}.{j}": p.clone() for dt, ts in by.items() for j, p in enumerate(torch.cat(ts).split(size))}


def _one_bit_each(state: dict) -> dict:
    """``state`` with the lowest bit of every tensor's first element flipped (a finite float stays finite)."""
    from sglang.srt.weight_sync.delta.ops import INT_VIEW

    out = {k: t.clone() for k, t in state.items()}
    for t in out.values():
        t.view(-1)[:1].view(INT_VIEW[t.element_size()]).bitwise_xor_(1)
    return out


def measure_overhead(state: dict, version: int, apply, model=None) -> dict:
    """Per-tensor cost with the per-element work taken out, on the last step's state (the engine holds it).

    Sender (`deltas`, on the CPU diff and on the device diff's code run on CPU): the model's tensors against the same
    bytes as 1/32 as many tensors, the time difference per tensor left over. Engine: `deltas` syncs over the broadcast
    path that change one element of every tensor (back and forth), per tensor; with ``model`` each one is checked
    bit-identical by the fingerprint."""
    from sglang.srt.weight_sync.delta import fingerprint
    from sglang.srt.weight_sync.delta.receiver import receiver_state

    n = len(state)
    other = _one_bit_each(state)
    pieces = (_pieces(state, n // 32), _pieces(other, n // 32))
    out = {"tensors": n, "pieces": len(pieces[1]), "sender_s": 0.0, "sender_pieces_s": 0.0}
    for key, (old, new) in (("sender_s", (state, other)), ("sender_pieces_s", pieces)):
        out[key] = statistics.median(
            measured(sender_sync, snapshot_of(old), new, "deltas", version + 1)[1] for _ in range(3))
    times, held = [], state
    for _ in range(4):
        target = other if held is state else state
        version += 1
        payloads = sender_sync(snapshot_of(held), target, "deltas", version)
        assert sum(len(p.spec.params) for p in payloads) == n
        (ok, msg), t, _ = measured(apply, [(p.spec.to_json(), p) for p in payloads], None)
        assert ok, msg
        times.append(t)
        held = target
        if model is not None:
            mine = {name: fingerprint.tensor_fingerprint(name, v) for name, v in held.items()}
            theirs = fingerprint.engine_shares(receiver_state(model).copies)
            assert fingerprint.compare_shares(mine, theirs, held) == ([], [])
    out["engine_s"] = statistics.median(times)
    return out


FP8_ENCODINGS = ("deltas_zstd", "xor_zstd", "xor_ctx")


def measure_fp8(bf16_states: list, shape: str, wire_dir: str, check: bool) -> dict:
    """The same steps into an FP8 rollout engine: slime's block-FP8 conversion of each state (CPU reference of its
    kernel), a full FP8 sync, then each step's delta over disk; density in bytes of the quantized tensors."""
    from cpu_harness import FP8_BLOCK, Host, fp8_block_quantize, full_flushes, sglang_model
    from sglang.srt.weight_sync.delta import fingerprint
    from sglang.srt.weight_sync.delta.receiver import delta_status, receiver_state
    from sglang.srt.weight_sync.delta.diff import changed_positions

    states = [fp8_block_quantize(s) for s in bf16_states]
    model = sglang_model(model_config(shape), FP8_BLOCK)
    host = Host(model)
    fp8 = [k for k, v in states[0].items() if v.dtype == torch.float8_e4m3fn]
    out = {"full_bytes": sum(t.numel() * t.element_size() for t in states[0].values()),
           "fp8_elements": sum(states[0][k].numel() for k in fp8), "steps": []}
    for version in (1, 2):  # timed: the second (the first one in a process pays its one-time costs, ~6x a later one)
        flushes = full_flushes(states[0], version=version)  # one per dtype (bf16, fp8, fp32 scales), outside the clock
        results, out["full_wire_s"], _ = measured(lambda: [host.call("_apply_delta_payload", [pl]) for pl in flushes])
        assert all(ok for ok, _ in results), results
    out["full_load_s"] = statistics.median(measured(plain_load, model, states[0])[1] for _ in range(3))
    for step in range(1, len(states)):
        old, new = states[step - 1], states[step]
        changed = {k: changed_positions(old[k], new[k]).numel() for k in new}
        bf16_fp8 = sum(changed_positions(bf16_states[step - 1][k], bf16_states[step][k]).numel() for k in fp8)
        row = {"step": step, "fp8_density": sum(changed[k] for k in fp8) / out["fp8_elements"],
               "bf16_density_same_tensors": bf16_fp8 / out["fp8_elements"],
               "scales_changed": sum(changed[k.removesuffix("weight") + "weight_scale_inv"] for k in fp8), "enc": {}}
        for i, encoding in enumerate(FP8_ENCODINGS):
            version += 1
            payloads = sender_sync({k: v.clone() for k, v in old.items()}, new, encoding, version,
                                   delta_status(model).xor_raw, old)
            files = serialize(payloads, encoding)
            names = [f"fp8-v{version}-{k}.safetensors" for k in range(len(files))]
            for name, data in zip(names, files):
                with open(os.path.join(wire_dir, name), "wb") as f:
                    f.write(data)
            (ok, msg), t_apply, _ = measured(host.call, "_apply_delta", wire_dir, names)
            assert ok, msg
            if check:
                mine = {k: fingerprint.tensor_fingerprint(k, v) for k, v in new.items()}
                differ, missing = fingerprint.compare_shares(
                    mine, fingerprint.engine_shares(receiver_state(model).copies), new)
                assert not differ and not missing, (encoding, step, differ[:3], missing[:3])
            row["enc"][encoding] = {"wire_bytes": sum(map(len, files)), "apply_s": t_apply}
            if i < len(FP8_ENCODINGS) - 1:  # back to the step's base (untimed)
                version += 1
                ok, msg = host.call("_apply_delta_payload", sender_sync({k: v.clone() for k, v in new.items()}, old,
                                                                        "indices", version))
                assert ok, msg
        out["steps"].append(row)
        print(f"measure: fp8 step {step} density {row['fp8_density']:.3%}", flush=True)
    return out


# ---------------------------------------------------------------- phase 3: report


def summarize(t: dict, m: dict) -> dict:
    """Per-encoding means over the steps (times from the timing run, memory from the memory run)."""
    out = {}
    for e in ENCODINGS:
        tr = [s["enc"][e] for s in t["steps"]]
        mr = [s["enc"][e] for s in m["steps"]]
        out[e] = {"wire": mean(r["wire_bytes"] for r in tr), "encode": mean(r["encode_s"] for r in tr),
                  "serialize": mean(r["serialize_s"] for r in tr), "apply": mean(r["apply_s"] for r in tr),
                  "fold": mean(r.get("fold_s", 0.0) for r in tr), "encode_mem": max(r["encode_mem"] for r in mr), "apply_mem": max(r["apply_mem"] for r in mr),
                  "tensors_sent": mean(r["tensors_sent"] for r in tr),
                  "host_syncs": max((r.get("host_syncs") or 0) for r in mr)}
    return out


def faster(before: float, after: float) -> str:
    r = before / after
    return f"{r:.1f}x faster" if r >= 1 else f"{1 / r:.1f}x slower"


def modeled(full_bytes, full_load_s, s: dict, bw: float):
    """Seconds per sync, phases back to back (no overlap of encode, transfer and apply: an upper bound)."""
    full = full_bytes / bw + full_load_s
    delta = s["encode"] + s["serialize"] + s["wire"] / bw + s["apply"]
    return full, delta


def breakeven(t: dict, s: dict) -> float:
    """The link speed (bytes/s) below which this delta sync beats a full one, from the modeled phases."""
    compute = s["encode"] + s["serialize"] + s["apply"] - t["full_load_s"]
    return float("inf") if compute <= 0 else (t["full_bytes"] - s["wire"]) / compute


def _breakeven_words(link: float) -> str:
    if math.isinf(link):
        return "beats a full sync on any link (its encode and apply take less than the plain load alone)"
    return f"beats a full sync on links slower than {link / 1e6:,.0f} MB/s and loses on faster ones"


def plot(t: dict, summ: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps = [s["step"] for s in t["steps"]]
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.axhline(t["full_bytes"] / 1e6, color="gray", linestyle="--", label="full sync (bf16)")
    for e in ENCODINGS:
        a.plot(steps, [s["enc"][e]["wire_bytes"] / 1e6 for s in t["steps"]], marker="o", label=e)
    for s in t["steps"]:
        a.annotate(f"{s['density']:.2%}", (s["step"], s["enc"]["indices"]["wire_bytes"] / 1e6),
                   textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    a.set_yscale("log")
    a.set_xlabel("AdamW step (labels: changed bf16 elements)")
    a.set_ylabel("wire MB per sync (log)")
    a.set_title("wire bytes per sync")
    a.legend(fontsize=8)
    labels, encode, transfer, apply = [], [], [], []
    for link, bw in LINKS.items():
        labels.append(f"full\n{link}")
        encode.append(0)
        transfer.append(t["full_bytes"] / bw)
        apply.append(t["full_load_s"])
        for e in ENCODINGS:
            labels.append(f"{e}\n{link}")
            encode.append(summ[e]["encode"] + summ[e]["serialize"])
            transfer.append(summ[e]["wire"] / bw)
            apply.append(summ[e]["apply"])
    x = range(len(labels))
    b.bar(x, encode, label="sender diff + encode (+ serialize)")
    b.bar(x, transfer, bottom=encode, label="transfer")
    b.bar(x, apply, bottom=[p + q for p, q in zip(encode, transfer)], label="engine apply / load_weights")
    b.set_xticks(list(x), labels, fontsize=7)
    b.set_ylabel("seconds per sync (modeled)")
    b.set_title("modeled sync time, phases back to back")
    b.set_ylim(top=1.35 * max(p + q + r for p, q, r in zip(encode, transfer, apply)))
    b.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(t: dict, m: dict, args, env: str) -> str:
    from sglang.srt.weight_sync.delta.wire import zstd_level

    summ = summarize(t, m)
    full_bytes, n = t["full_bytes"], t["params"]
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    mb = lambda b: f"{b / 1e6:,.1f} MB"  # noqa: E731
    ms = lambda s: f"{1e3 * s:,.0f}"  # noqa: E731
    dens = [s["density"] for s in t["steps"]]
    memcpy = min(s["memcpy_s"] for s in t["steps"])  # the first copy also pays first-touch page faults
    L = [
        "# Benchmarks: full sync vs delta sync",
        "",
        f"Written by `make bench` (`scripts/bench.py`); one run on {env}. Model: "
        f"{'Qwen2.5-0.5B' if args.shape == 'qwen2.5-0.5b' else args.shape}-shaped, {n / 1e6:.0f}M params "
        f"({t['tensors']:,} tensors), "
        f"{mb(full_bytes)} in bf16 (a full sync). {len(t['steps'])} real AdamW steps at lr 1e-6 changed "
        f"{min(dens):.2%}–{max(dens):.2%} of bf16 elements (mean {mean(dens):.2%}). Figures are ratios within this run; "
        "absolute times depend on the machine.",
        "",
        f"![wire bytes and modeled sync time]({doc_name(args.shape, 'png')})",
        "",
        "## Wire bytes and sync time (mean over steps)",
        "",
        "| sync | path | wire bytes | vs full | sender ms | vs memcpy | engine ms | vs full load | "
        + " | ".join(f"modeled @ {k}" for k in LINKS) + " |",
        "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(LINKS),
    ]
    full_cells = [f"{modeled(full_bytes, t['full_load_s'], summ['indices'], bw)[0]:.2f} s" for bw in LINKS.values()]
    L.append(f"| full | bf16 tensors, `load_weights` | {mb(full_bytes)} | 1.0x | — | — | {ms(t['full_load_s'])} | — | "
             + " | ".join(full_cells) + " |")
    for e in ENCODINGS:
        s = summ[e]
        sender = s["encode"] + s["serialize"]
        cells = []
        for bw in LINKS.values():
            f, d = modeled(full_bytes, t["full_load_s"], s, bw)
            cells.append(f"{d:.2f} s ({faster(f, d)})")
        L.append(f"| delta `{e}` | {TRANSPORT[e]} | {mb(s['wire'])} | {full_bytes / s['wire']:.1f}x smaller | "
                 f"{ms(sender)} | {memcpy / sender:.2f}x | {ms(s['apply'])} | {faster(t['full_load_s'], s['apply'])} | "
                 + " | ".join(cells) + " |")
    L += [
        "",
        "- **sender ms**: diff against the snapshot + encode into ≤512 MiB buckets + advance the snapshot "
        "(`DeltaState`, `DeltaBucket`: the torch ops a GPU runs, batched per chunk, dtype and flush), "
        "plus for `disk` serializing the files (safetensors; zstd level "
        + ", ".join(f"{zstd_level(e)} for `{e}`" for e in ENCODINGS if zstd_level(e) is not None) + "). "
        f"**vs memcpy**: the throughput of that as a ratio to copying the same {mb(full_bytes)} into memory "
        f"allocated once (`Tensor.copy_`; {ms(memcpy)} ms here; higher is faster: a fresh `torch.clone` also pays "
        "the page faults of new memory, which vary several-fold between runs). The bytewise diff alone takes "
        f"{ms(mean(s['diff_s'] for s in t['steps']))} ms ({memcpy / mean(s['diff_s'] for s in t['steps']):.2f}x memcpy). "
        f"Of the sender's time the snapshot fold is {ms(summ['deltas']['fold'])} ms for `deltas`: `DeltaSender` runs "
        "it behind the sync, on a thread the next read of the snapshot waits for, so a `deltas` sync waits for "
        f"{ms(summ['deltas']['encode'] - summ['deltas']['fold'])} ms of diff + encode "
        f"({memcpy / (summ['deltas']['encode'] - summ['deltas']['fold']):.2f}x memcpy).",
        "- **engine ms**: the receiver applying that sync to the real SGLang model class on CPU — validate the "
        "whole request, then write the changed elements through the views the model's loader used in the full sync "
        "— from the received tensors (`nccl`) or by reading and decompressing the files (`disk`); "
        "**vs full load**: against upstream `model.load_weights` of the full state "
        f"({ms(t['full_load_s'])} ms; median of three, with the cyclic garbage collector paused as it is while the "
        "receiver applies: collections inside a load vary its time by tens of percent). After every apply the "
        "engine's weight fingerprint equals the trainer's (bit-identical, checked for every step and encoding).",
        "- **modeled**: encode + serialize + wire bytes / link + apply, back to back (the sender overlaps flushes, so "
        "real syncs are no slower); a full sync is wire bytes / link + `load_weights`. Common costs (gathering and "
        "converting params to HF names, pausing generation) are left out of both.",
        "",
        "**Reading it.** The wire shrinks by the ratios above at every step. Whether the whole sync gets faster "
        "depends on where the compute runs. On the engine, a delta apply touches only the changed elements, but it "
        "first decodes and checks every position, so on these CPU cores it takes "
        f"{summ['deltas']['apply'] / t['full_load_s']:.1f}x a full `load_weights`, which is one memory-speed copy. "
        "On the sender, the bytewise diff is a pass over the whole model and encoding gathers the changed values, "
        f"{sum(summ['deltas'][k] for k in ('encode', 'serialize')):.1f} s here for `deltas`. With these CPU "
        f"figures, `deltas` {_breakeven_words(breakeven(t, summ['deltas']))}. On a GPU the "
        "diff and the gathers run at device memory bandwidth (`make gpu-check` measures them), and the link term is "
        "what remains. Over a shared filesystem or a WAN, where full syncs are slowest, the wire bytes decide.",
        "",
        "## Per step",
        "",
        "| step | density | " + " | ".join(f"`{e}` bytes" for e in ENCODINGS) + " | " + " | ".join(f"`{e}` ratio" for e in ENCODINGS) + " |",
        "|---:|---:|" + "---:|" * (2 * len(ENCODINGS)),
    ]
    for s in t["steps"]:
        L.append(f"| {s['step']} | {s['density']:.2%} | "
                 + " | ".join(f"{s['enc'][e]['wire_bytes']:,}" for e in ENCODINGS) + " | "
                 + " | ".join(f"{full_bytes / s['enc'][e]['wire_bytes']:.1f}x" for e in ENCODINGS) + " |")
    L += [
        "",
        "## Bytes per changed element",
        "",
        "Wire bytes of a sync divided by the bf16 elements it changed (positions, values, headers, compression: "
        "everything). The last column compresses `new ^ old` of every whole tensor with zstd level 1 — the scheme of "
        "slime's own `xor` delta, computed here on the same states.",
        "",
        "| step | density | " + " | ".join(f"`{e}`" for e in ENCODINGS) + " | whole-tensor XOR, zstd-1 |",
        "|---:|---:|" + "---:|" * (len(ENCODINGS) + 1),
    ]
    for s in t["steps"]:
        L.append(f"| {s['step']} | {s['density']:.2%} | "
                 + " | ".join(f"{s['enc'][e]['wire_bytes'] / s['nnz']:.2f}" for e in ENCODINGS)
                 + f" | {s['whole_tensor_xor_bytes'] / s['nnz']:.2f} |")
    if "fp8" in t:
        f8 = t["fp8"]
        L += [
            "",
            "## FP8 rollout engine",
            "",
            "The same steps after slime's block-FP8 conversion (decoder linears to e4m3 in 128×128 blocks plus an fp32 "
            "`weight_scale_inv` each; a CPU reference of slime's kernel) into the same SGLang class built with "
            f"`Fp8Config`. A full FP8 sync is {mb(f8['full_bytes'])} ({f8['full_bytes'] / full_bytes:.2f}x the bf16 "
            f"one); through the wire it takes {ms(f8['full_wire_s'])} ms (the engine's second full sync) against "
            f"{ms(f8['full_load_s'])} ms for a plain `load_weights`. Density counts changed bytes of the e4m3 tensors; beside it, the bf16 density of the "
            "same tensors before quantization. Engine: disk apply (read, decompress, validate, direct writes) vs "
            "the plain FP8 `load_weights`. The engine's fingerprint equals the trainer's after every apply.",
            "",
            "| step | fp8 density | bf16 density, same tensors | scales changed | "
            + " | ".join(f"`{e}` bytes | vs full FP8 | engine vs load" for e in FP8_ENCODINGS) + " |",
            "|---:|---:|---:|---:|" + "---:|---:|---:|" * len(FP8_ENCODINGS),
        ]
        for s in f8["steps"]:
            L.append(f"| {s['step']} | {s['fp8_density']:.3%} | {s['bf16_density_same_tensors']:.2%} | "
                     f"{s['scales_changed']:,} | " + " | ".join(
                         f"{s['enc'][e]['wire_bytes']:,} | {f8['full_bytes'] / s['enc'][e]['wire_bytes']:.0f}x smaller"
                         f" | {s['enc'][e]['apply_s'] / f8['full_load_s']:.2f}x" for e in FP8_ENCODINGS) + " |")
    L += [
        "",
        "## Peak extra memory",
        "",
        "| side | what | peak extra |",
        "|---|---|---:|",
        f"| sender | snapshot of the last acknowledged version (held for the whole run; pinned host memory on CUDA) | "
        f"{mib(full_bytes)} (= the bf16 model) |",
    ]
    for e in ENCODINGS:
        L.append(f"| sender | one sync, `{e}` (diff, buckets, staged values) | {mib(summ[e]['encode_mem'])} |")
    L.append(f"| engine | full `load_weights` (upstream) | {mib(m['full_load_mem'])} |")
    for e in ENCODINGS:
        L.append(f"| engine | apply one sync, `{e}` ({TRANSPORT[e]}) | {mib(summ[e]['apply_mem'])} |")
    L += [
        f"| engine | weight fingerprint (all params) | {mib(m['fingerprint_engine_mem'])} |",
        "",
        "Measured as the peak RSS above the baseline just before the phase, sampled every millisecond, in a second run "
        "with `MALLOC_MMAP_THRESHOLD_=65536` (every tensor buffer is its own mapping and goes back to the OS when freed, "
        "so RSS follows live tensors). The received payload itself is counted on the engine side for `disk` (it reads "
        "the files) and not for `nccl` (the broadcast buffers exist before the apply starts).",
        "",
        "## Cost per tensor",
        "",
        f"The model has {t['tensors']:,} HF tensors. Per encoding, mean over the steps: the sender's and the engine's "
        "time divided by the model's tensor count (the sender visits every tensor; the engine every tensor the "
        "sync names), and the host synchronizations of one apply (counted by a dispatch mode in the memory run: "
        "value reads, data-dependent shapes, copies to the host — each a stall on a GPU). A full sync through the "
        f"wire (as a broadcast delivers it: the spec's parse, checksum, checks, recorder, write watch; median of "
        f"three, as the plain load) takes "
        f"{ms(t['full_wire_s'])} ms, "
        f"{t['full_wire_s'] / t['full_load_s']:.1f}x a plain `load_weights` of the same state (the `mix64` checksum "
        "and fingerprint in torch's integer ops, as a GPU runs them).",
        "",
        "| encoding | tensors named per sync | sender µs / tensor | engine µs / tensor | host syncs per apply |",
        "|---|---:|---:|---:|---:|",
    ]
    for e in ENCODINGS:
        s = summ[e]
        L.append(f"| `{e}` | {s['tensors_sent']:,.0f} | {1e6 * (s['encode'] + s['serialize']) / t['tensors']:,.1f} | "
                 f"{1e6 * s['apply'] / t['tensors']:,.1f} | {s['host_syncs']} |")
    o = t["overhead"]
    if args.shape.endswith("-topology"):  # not for a few hundred large tensors: there the difference is noise
        per = 1e6 * (o["sender_s"] - o["sender_pieces_s"]) / (o["tensors"] - o["pieces"])
        L += [
            "",
            "These figures include each tensor's share of the per-element work. Without it, on the last step's state "
            f"(`deltas`): the sender takes {ms(o['sender_s'])} ms for the model's {o['tensors']:,} tensors and "
            f"{ms(o['sender_pieces_s'])} ms for the same bytes as {o['pieces']:,} tensors, "
            f"**{per:.1f} µs per tensor** more (medians of three); the engine applies a sync that changes one element of every "
            f"tensor in {ms(o['engine_s'])} ms, **{1e6 * o['engine_s'] / o['tensors']:.1f} µs per tensor** (the spec's "
            "parse, the checks and the writes; median of four, each checked bit-identical by the fingerprint).",
        ]
    L += [
        "",
        "## Fingerprint (the periodic bit-identity check)",
        "",
        f"Engine side over all params: {ms(t['fingerprint_engine_s'])} ms "
        f"({t['fingerprint_engine_s'] / t['full_load_s']:.1f}x a full `load_weights`); trainer side: "
        f"{ms(t['fingerprint_trainer_s'])} ms. With `--update-weight-delta-fingerprint-interval 10` (the default) it "
        "runs every tenth sync.",
        "",
        "## Against published figures",
        "",
        "| who | setting | reported | this run |",
        "|---|---|---|---|",
        f"| **this bench** | {args.shape}, {mean(dens):.2%} mean density, bf16 | — | "
        + ", ".join(f"`{e}` {full_bytes / summ[e]['wire']:.0f}x" for e in ENCODINGS) + " |",
    ]
    for who, setting, figure in ANCHORS:
        L.append(f"| {who} (theirs) | {setting} | {figure} | — |")
    L += [
        "",
        "Their figures are quoted, not reproduced: other models, trained weights and their own encodings. Density is "
        "what moves the ratio: it depends on the learning rate and on the scale of each weight relative to its bf16 "
        "step. This bench uses random weights at the released config's init scale (std 0.02), so its density is "
        "indicative; `python -m sglang.srt.weight_sync.delta density OLD NEW` measures it on your own checkpoints.",
        "",
        "## Method",
        "",
        "```",
        f"make bench BENCH_ARGS='--shape {args.shape} --steps {args.steps}'   # = python scripts/bench.py ...",
        "```",
        "",
        ("The states come from a transformers `Qwen2ForCausalLM` at the shape of Qwen2.5-0.5B's `config.json` (HF "
         if not args.shape.endswith("-topology") else
         f"The states come from a transformers `Qwen3MoeForCausalLM` with the layer and expert counts of {args.shape} "
         "and narrow widths (hidden 64, expert intermediate 32; HF ")
        + "init, seed 1), trained with `torch.optim.AdamW(lr=1e-6, weight_decay=0)` on fp32 master weights, "
        "forward/backward on 2x32 random tokens per step; each step's bf16 cast is what the trainer ships. The "
        "engine is SGLang's own model class of the same architecture (patched tree, CPU, bf16). Times are wall-clock in one process "
        "with all cores; the memory figures come from a second identical run (see above).",
        "",
    ]
    return "\n".join(L)


def environment() -> str:
    import platform

    import sglang

    return (f"{platform.machine()}, {os.cpu_count()} CPU cores ({torch.backends.cpu.get_cpu_capability()} vectors), "
            f"torch {torch.__version__}, SGLang {sglang.__version__} (patched), {time.strftime('%Y-%m-%d')}")


def sharded(args, workdir: str) -> int:
    import bench_sharded

    if not args.report_only:
        paths = train_states(args.shape, args.steps, workdir)
        bench_sharded.run(args.shape, args.engine_tp, args.engine_ep, paths,
                          os.path.join(workdir, f"sharded-tp{args.engine_tp}-ep{args.engine_ep}.json"))
    text = bench_sharded.report(args.workdir, environment())
    os.makedirs(args.out, exist_ok=True)
    write_page(os.path.join(args.out, "benchmarks-sharded.md"), text)
    print(text)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--out", default="docs", help="where benchmarks.md and benchmarks.png go")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the last run's measurements")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # internal: the measuring subprocess writes this JSON
    ap.add_argument("--engine-tp", type=int, default=1, help="a sharded engine: one process per rank, per-rank report "
                    "in benchmarks-sharded.md (scripts/bench_sharded.py)")
    ap.add_argument("--engine-ep", type=int, default=1, help="of --engine-tp, the MoE layers' expert-parallel width")
    args = ap.parse_args()
    workdir = os.path.join(args.workdir, args.shape)
    if args.engine_tp > 1:
        return sharded(args, workdir)
    if args.measure:
        # the memory run repeats the timing run, which checked bit-identity
        measure(json.loads(os.environ["DELTA_BENCH_PATHS"]), args.shape, args.measure, check=not MEMORY_RUN)
        return 0
    paths = None if args.report_only else train_states(args.shape, args.steps, workdir)
    results = {}
    for run, extra_env in (("timing", {}), ("memory", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
        out = os.path.join(workdir, f"{run}.json")
        if paths:
            print(f"measure: {run} run", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--shape", args.shape, "--workdir",
                            args.workdir, "--measure", out], check=True,
                           env=dict(os.environ, DELTA_BENCH_PATHS=json.dumps(paths), **extra_env))
        results[run] = json.load(open(out))
    args.steps = len(results["timing"]["steps"])
    env = environment()
    os.makedirs(args.out, exist_ok=True)
    summ = summarize(results["timing"], results["memory"])
    plot(results["timing"], summ, os.path.join(args.out, doc_name(args.shape, "png")))
    if args.shape.endswith("-topology"):
        with open(os.path.join(workdir, "env.txt"), "w") as f:
            f.write(env)
        import bench_topology

        print(bench_topology.write(args.workdir, args.out))
        return 0
    text = report(results["timing"], results["memory"], args, env)
    path = os.path.join(args.out, doc_name(args.shape, "md"))
    from bench_slime import section_of, with_section

    with_section(path, text, section_of(open(path).read()) if os.path.exists(path) else None)  # keep bench-slime's
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
