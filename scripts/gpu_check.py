"""``make gpu-check``: the CUDA paths of delta sync on one GPU, checked and measured in one short run.

Checks (each PASS or FAIL in the report; any FAIL exits 1):

* the ``mix64`` checksum and the weight fingerprint give the same numbers on the CPU and the GPU.
* The sender on CUDA — diff on the device, pinned host snapshot prefetched one chunk ahead on its
  own stream, changed values copied back on another, events ordering them — drives a receiver on
  the GPU (SGLang's own ``Qwen3ForCausalLM``, in-process) over the disk transport for every
  encoding, and over the broadcast transport (NCCL to an engine on a second GPU where there is
  one, else gloo), for several AdamW steps: after every sync every engine param equals, bit for
  bit, a second SGLang model loaded in full with the trainer's weights, and the sender's
  fingerprint check agrees.

* slime's sharded sender (``gpu_check_slime``): each trainer rank of a Megatron model diffs its own pinned slice on
  its device, the changes go to the source over NCCL, into an engine over disk; a refused publish staged and carried.
* Sharded engines (``gpu_check_sharded``): a TP=2 x EP=2 Qwen3-MoE engine on two GPUs, every rank bit-identical to
  its own plain load after each delta; and a real ``launch_server`` (``--tp 2`` on two GPUs) with CUDA graphs and the
  overlap scheduler on, through a training loop with the fingerprint checked after every sync.
* Speculative decoding (``gpu_check_speculative``): a real server with EAGLE and a NextN draft, target and draft
  synced as one; after a full sync of the same state, the same text and draft acceptance as after the deltas.

Figures: diff + encode throughput against a device copy of the same bytes; host<->device bytes
per delta sync against the 4N bytes of copying whole chunks both ways; the overlap of the
snapshot prefetch with the diff kernels (profiler trace); a delta apply against a full
``load_weights``.

Where SGLang is not installed (a lent GPU machine), ``--bundle build/gpu-bundle/site.zip`` (made by
``make gpu-bundle``) supplies the patched SGLang and the packages its import path needs; SGLang's
CUDA kernels package ``sgl_kernel`` is replaced by an import stub that fails any call, since only
the load path runs. Without CUDA the script exits 2; ``--dry-run`` runs the same code on the CPU
with a tiny model (CI does, so the script cannot rot; the CUDA-only figures then read n/a).

    python scripts/gpu_check.py [--bundle build/gpu-bundle/site.zip] [--report build/gpu-check/report.md] [--dry-run]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import types
import zipfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ENCODINGS = ("indices", "deltas", "deltas_zstd", "planes_zstd", "xor_zstd", "xor_ctx")


# ---------------------------------------------------------------- environment


def use_bundle(path: str, workdir: str) -> None:
    """Extract the bundle once (keyed by its size and mtime) and put it first on sys.path."""
    st = os.stat(path)
    site = os.path.join(workdir, f"site-{st.st_size}-{int(st.st_mtime)}")
    if not os.path.isdir(site):
        with zipfile.ZipFile(path) as z:
            z.extractall(site + ".tmp")
        os.replace(site + ".tmp", site)
    sys.path.insert(0, site)


class _SglKernelStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """SGL_KERNEL_STUB: stands in for ``sgl_kernel`` (and its submodules) when it is not installed.
    SGLang's CUDA layers import kernels from it at module level; the load path never calls them,
    and any call fails loudly naming the kernel."""

    def find_spec(self, name, path=None, target=None):
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+gpu-check-stub"

        def missing(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def kernel(*args, **kwargs):
                raise RuntimeError(f"SGL_KERNEL_STUB: {spec.name}.{attr} called; gpu-check runs only the load path")

            return kernel

        module.__getattr__ = missing
        return module

    def exec_module(self, module):
        pass


def install_sgl_kernel_stub() -> bool:
    try:
        import sgl_kernel  # noqa: F401
        return False
    except ImportError:
        sys.meta_path.insert(0, _SglKernelStub())
        return True


def update_group(host, backend: str, name: str):
    """Both ranks of one weight-update group in this process: rank 0 (the trainer's, returned) here, rank 1
    (the engine's, stored on the host as SGLang's init_weights_update_group does) in a thread beside it."""
    import threading

    from cpu_harness import free_port
    from sglang.srt.utils.common import init_custom_process_group

    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import _unregister_process_group

    init, box, lock, local = f"tcp://127.0.0.1:{free_port()}", {}, threading.Lock(), threading.local()
    for rank in (0, 1):  # a group re-created under the same name (after an abort) replaces the old one
        try:
            _unregister_process_group(f"{name}:rank{rank}")
        except Exception:
            pass
    register = c10d._register_process_group

    def register_per_rank(group_name, pg):
        """A group name is registered once per process: each rank's group is registered as ``name:rankN``, in
        whichever order the two finish connecting."""
        with lock:
            register(f"{group_name}:rank{local.rank}" if group_name == name else group_name, pg)

    def create(rank):
        local.rank = rank
        try:
            pg = init_custom_process_group(backend=backend, init_method=init, world_size=2, rank=rank, group_name=name)
        except Exception as e:  # the peer thread's failure is reported by the caller, not lost with the thread
            box[rank] = e
            raise
        c10d._world.pg_names[pg] = f"{name}:rank{rank}"
        box[rank] = pg

    c10d._register_process_group = register_per_rank
    try:
        peer = threading.Thread(target=create, args=(1,))
        peer.start()
        create(0)
        peer.join(120)
    finally:
        c10d._register_process_group = register
    if box.get(1) is None or isinstance(box[1], Exception):
        raise RuntimeError(f"update group {name!r} ({backend}, {init}): the engine rank's side failed: {box.get(1)!r}")
    host._model_update_group[name] = box[1]
    return box[0]


def engine_host(cfg, device, quant=None):
    """An in-process engine: SGLang's own model class on ``device`` behind the runner attributes the receiver reads."""
    from cpu_harness import Host, nan_filled, sglang_model

    host = Host(nan_filled(sglang_model(cfg, quant).to(device)))  # NaN: a name the loader skipped would show
    host.device = device
    return host


def first_difference(model, ref):
    """The first param whose bytes differ between two SGLang models of one class, else None."""
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        q = theirs[name].detach().to(p.device)  # the broadcast lane's engine may sit on a second GPU
        if p.shape != q.shape or not torch.equal(p.detach().view(torch.uint8), q.view(torch.uint8)):
            return name
    return None


# ---------------------------------------------------------------- timing


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn, device, repeats=5):
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def overlap_us(trace_events) -> tuple:
    """(us of host->device copies running while a kernel ran, us of those copies) from profiler device events."""
    copies = [(e.time_range.start, e.time_range.end) for e in trace_events if "HtoD" in e.name]
    kernels = sorted((e.time_range.start, e.time_range.end) for e in trace_events
                     if "Memcpy" not in e.name and "Memset" not in e.name)
    merged = []
    for s, e in kernels:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    both = sum(max(0, min(e, ke) - max(s, ks)) for s, e in copies for ks, ke in merged)
    return both, sum(e - s for s, e in copies)


# ---------------------------------------------------------------- checks


class Report:
    """Checks and figures, printed as they come and, with ``path``, appended to the report file at once: a run cut
    short (a time limit, a lost machine) still leaves every section it finished."""

    def __init__(self, path: str = ""):
        self.lines, self.failed, self.path = [], False, path
        if path:
            open(path, "w").close()

    def check(self, ok: bool, what: str) -> None:
        self.failed |= not ok
        self.add(f"- {'PASS' if ok else 'FAIL'}: {what}")

    def skip(self, what: str, why: str) -> None:
        self.add(f"- skipped ({why}): {what}")

    def add(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def _sums_and_flags(device) -> tuple:
    """(blob sums equal on CPU and device, the NaN flags on the device) for fixed blobs."""
    from sglang.srt.weight_sync.delta.wire import blob_sums, checked_sums

    g = torch.Generator().manual_seed(0)
    same = True
    for n in (0, 1, 7, 8, 1001, (1 << 22) * 8 + 5):  # empty, sub-word, one word, odd, past one CUDA block
        pos = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        val = torch.randn(n // 2 + 1, generator=g).to(torch.bfloat16)
        same &= blob_sums(pos, val) == blob_sums(pos.to(device), val.to(device))
    val = torch.randn((1 << 22) * 4 + 3, generator=g).to(torch.bfloat16)
    pos = torch.zeros(8, dtype=torch.uint8)
    flags = [bool(checked_sums(pos, val.to(device))[1])]
    for i in (0, val.numel() // 2, val.numel() - 1):
        bad = val.clone()
        bad[i] = float("nan")
        flags.append(bool(checked_sums(pos, bad.to(device))[1]))
    return same, flags == [False, True, True, True]


def check_hashes(report, device) -> None:
    """The checksum and the fingerprint give the host's numbers on the device (nothing to compare on a CPU run), and
    their throughput there: the figures that decide whether a compiled kernel would be worth having."""
    from sglang.srt.weight_sync.delta import fingerprint, mix64

    what = ("mix64 blob sums equal on CPU and device (empty, partial-word, odd and multi-block blobs)",
            "weight fingerprint equal on CPU and device (a large tensor, and 600 small ones hashed together)",
            "the checksum pass's NaN flag on the device (a NaN in the first, a middle and the last value)")
    if device.type == "cpu":
        for w in what:
            report.skip(w, "no device")
        return
    same, flags = _sums_and_flags(device)
    report.check(same, what[0])
    report.check(flags, what[2])
    g = torch.Generator().manual_seed(1)
    # one large tensor (hashed alone) and many small ones, whole rows and less than one (joined, a key per row)
    items = [("w", torch.randn(3000, 257, generator=g).to(torch.bfloat16))] + [
        (f"e{k}.{n}", torch.randn(n, generator=g).to(torch.bfloat16)) for k in range(300) for n in (2048, 16)]

    def shares(device):
        got = fingerprint.read_shares(fingerprint.tensor_shares([(n, t.to(device)) for n, t in items]))
        return {n: (s.total, s.coverage) for n, s in got.items()}

    report.check(shares(device) == shares(torch.device("cpu")), what[1])
    blob = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device=device)
    weight = blob.view(torch.bfloat16).view(-1, 4096)
    for label, fn in (("checksum (mix64 + NaN pass)", lambda: mix64.blob_sum(blob, 5, torch.bfloat16)),
                      ("fingerprint (bf16)", lambda: fingerprint.read_shares(fingerprint.tensor_shares([("w", weight)])))):
        fn()  # warm-up
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        report.add(f"- {label} over 1 GiB on the device: {1e3 * dt:.2f} ms ({1 / dt:.0f} GiB/s)")


def check_stranded_broadcast(report, cfg, device, backend, engine_device, states, ref) -> None:
    """The engine refuses a request before receiving it: the sender aborts its pending broadcast at once (NCCL:
    the communicator, whose kernel would spin forever), re-creates the group through ``reconnect`` and the next
    sync lands bit-identically."""
    from cpu_harness import InProcessEngine, segments
    from sglang.srt.weight_sync.delta.collectives import abort_group
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import NcclTransport

    class Refusing(InProcessEngine):
        wrong_group = False

        def update_weights_from_distributed(self, names, dtypes, shapes, group_name, delta, weight_version):
            group_name, self.wrong_group = ("no-such-group" if self.wrong_group else group_name), False
            return super().update_weights_from_distributed(names, dtypes, shapes, group_name, delta, weight_version)

    host, name = engine_host(cfg, engine_device), "gpu-check-stranded"
    engine = Refusing(host)

    def connect():
        abort_group(host._model_update_group.pop(name, None))
        return update_group(host, backend, name)

    transport = NcclTransport(connect(), name, [engine], device=device if backend == "nccl" else torch.device("cpu"),
                              reconnect=connect, timeout_s=60)
    sender = DeltaSender(transport, [engine], encoding="indices", buffer_bytes=16 << 20, device=device)
    first_ok = sender.update(segments(states[0]))[0][0]
    engine.wrong_group = True
    t0 = time.perf_counter()
    ok, msg = sender.update(segments(states[1]))[0]
    aborted_s = time.perf_counter() - t0
    report.check(first_ok and not ok and "every engine answered but the broadcast did not complete" in msg
                 and aborted_s < 15, f"broadcast:{backend}: a request refused unreceived aborts the pending broadcast "
                 f"in {aborted_s:.1f} s (deadline 60 s)" + ("" if not ok else " — it was not refused"))
    recovered = sender.update(segments(states[1]))[0]
    with torch.no_grad():
        ref.load_weights(list(states[1].items()))
    bad = first_difference(host.model, ref)
    report.check(recovered[0] and transport.reconnects == 1 and bad is None,
                 f"broadcast:{backend}: the next sync re-creates the group and lands bit-identically"
                 + ("" if recovered[0] and bad is None else f" — {recovered[1]}; first differing param: {bad}"))
    transport.close()


def check_fp8(report, args, device, workdir) -> None:
    """The FP8 rollout lane: a Qwen3-MoE trained in bf16, converted to block FP8 as slime's rollout does, into
    SGLang's class built with ``Fp8Config`` on ``device``; full sync then deltas (sparse e4m3 bytes written through
    the recorded views), every param bit-identical to a full FP8 load, fingerprint equal."""
    from cpu_harness import FP8_BLOCK, InProcessEngine, bf16_state, fp8_block_quantize, hf_config, hf_model, \
        rl_steps, segments, sglang_model
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport
    from sglang.srt.weight_sync.delta.diff import changed_positions
    from sglang.srt.weight_sync.delta.wire import zstd_level

    hidden = max(256, args.hidden // 128 * 128)  # 128x128 blocks must tile every projection
    cfg = hf_config("qwen3-moe", vocab=args.vocab, hidden=hidden, layers=args.layers)
    trainer = hf_model(cfg, seed=2).to(device)
    bf16 = [bf16_state(trainer)] + list(rl_steps(trainer, args.steps, lr=1e-6, batch=2, seq=64))
    states = [fp8_block_quantize(s) for s in bf16]
    fp8 = [k for k, v in states[0].items() if v.dtype == torch.float8_e4m3fn]
    report.add(f"\nFP8 lane: Qwen3-MoE-shaped, hidden {hidden}, block FP8 (128x128, slime's conversion) on {device}")
    for enc in ("deltas_zstd", "xor_zstd"):
        host = engine_host(cfg, device, FP8_BLOCK)
        engine = InProcessEngine(host)
        transport = DiskTransport(os.path.join(workdir, f"fp8-{enc}"), [engine], zstd=zstd_level(enc))
        sender = DeltaSender(transport, [engine], encoding=enc, buffer_bytes=64 << 20, device=device,
                             fingerprint_every=1)
        for step, state in enumerate(states):
            ref = sglang_model(cfg, FP8_BLOCK).to(device)
            with torch.no_grad():
                ref.load_weights(list(state.items()))
            results = sender.update(segments(state))
            m = sender.pop_metrics()
            bad = first_difference(host.model, ref)
            ok = results[0][0] and bad is None and m["perf/update_weights_fingerprint_mismatches"] == 0 \
                and m["perf/update_weights_fingerprint_uncovered"] == 0 and \
                (not step or m["perf/update_weights_xor"] == (enc == "xor_zstd"))
            density = ""
            if step:
                d8 = sum(changed_positions(states[step - 1][k], state[k]).numel() for k in fp8)
                d16 = sum(changed_positions(bf16[step - 1][k], bf16[step][k]).numel() for k in fp8)
                n = sum(state[k].numel() for k in fp8)
                density = f", e4m3 density {d8 / n:.3%} (bf16 {d16 / n:.2%}), {m['perf/update_weights_wire_bytes']:,.0f} B"
            report.check(ok, f"fp8 step {step} {enc}: {'full sync' if not step else 'delta'}{density}, every param "
                             "bit-identical to a full FP8 load" + ("" if ok else f" — {results[0][1]}; first "
                                                                   f"differing param: {bad}"))
        transport.close()


def check_ctx_coding(report, old, new, device, nbytes: int, t_copy: float) -> None:
    """``xor_ctx``'s coder on the device against ``xor_zstd``'s file making and rebuild, the same step: its encode and
    decode include the pass over the base of every changed segment, which is what a GPU decides."""
    from cpu_harness import delta_flushes
    from sglang.srt.weight_sync.delta.files import flush_file, maybe_zstd_decompress, read_safetensors
    from sglang.srt.weight_sync.delta.validate import uncode, unxor, validate_payload

    for enc in ("xor_zstd", "xor_ctx"):
        payloads = delta_flushes(old, new, enc, version=2, base_version=1)
        files = [flush_file(p, 1) for p in payloads]
        t_enc = median_s(lambda: [flush_file(p, 1) for p in payloads], device)

        def decode():
            for data in files:
                pl = read_safetensors(maybe_zstd_decompress(data, 1 << 40))
                pl = dataclasses.replace(pl, positions=pl.positions.to(device), values=pl.values.to(device))
                names = [p.name for p in pl.spec.params]
                if pl.coded:
                    pl = uncode(pl, None, lambda pcs: torch.cat(
                        [old[names[k]].reshape(-1)[a:a + n] for k, a, n in pcs]))
                else:
                    pl = unxor(pl, None, lambda ps, ix: torch.cat(
                        [old[p.name].reshape(-1)[i] for p, i in zip(ps, ix)]))
                validate_payload(pl, None)
        t_dec = median_s(decode, device)
        report.add(f"- `{enc}` file making (diffed, zstd incl.) {1e3 * t_enc:.2f} ms, rebuild + checks "
                   f"{1e3 * t_dec:.2f} ms ({nbytes / (t_enc + t_dec) / 1e9:.1f} GB/s of weights, "
                   f"{t_copy / (t_enc + t_dec):.3f}x the copy), {sum(map(len, files)) / 1e6:.2f} MB")


def check_memory(report, args, device, workdir: str) -> None:
    """Each transient's device peak next to its modeled bound (``make bench-memory``'s components and budgets)."""
    from bench_memory import BUDGETS, engine_components, judge

    flush = 16 << 20
    report.add(f"\nmemory: device peak of each transient on {device} (a Qwen2-shaped model, {args.layers} layers; "
               f"flush buffer and engine chunk {flush} B)")
    figures = engine_components(args.layers, flush, 20000, workdir, device)
    for name in ("sender flush", "sender xor_ctx flush", "engine apply", "engine xor rebuild", "engine xor_ctx decode",
                 "engine full sync", "fingerprint"):
        line, ok, ref = judge(name, [figures[name]], figures, flush)
        report.check(ok, f"{line.removeprefix('memory: ')}: device peak {figures[name]} B, modeled at most "
                         f"{BUDGETS[name][0] * ref:.0f} B")


def run(args, device, report, stubbed: bool) -> None:
    from cpu_harness import InProcessEngine, bf16_state, delta_flushes, full_flushes, hf_config, hf_model, rl_steps, \
        segments, sglang_model
    from sglang.srt.weight_sync.delta import receiver
    from sglang.srt.weight_sync.delta.bucket import DeltaBucket
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.transport import DiskTransport, NcclTransport
    from sglang.srt.weight_sync.delta.diff import changed_positions, changes_many
    from sglang.srt.weight_sync.delta.wire import zstd_level
    from gpu_check_sharded import check_server, check_sharded_ranks
    from gpu_check_speculative import check_speculative_server

    check_hashes(report, device)
    cfg = hf_config("qwen3", vocab=args.vocab, hidden=args.hidden, layers=args.layers)
    trainer = hf_model(cfg, seed=1).to(device)
    n_params = sum(p.numel() for p in trainer.parameters())
    report.add(f"\nmodel: Qwen3-shaped, {n_params / 1e6:.1f}M params, bf16 on {device}; {args.steps} AdamW steps "
               f"at lr 1e-6; encodings {', '.join(ENCODINGS)} over the disk transport")
    ref = sglang_model(cfg).to(device)
    workdir = tempfile.mkdtemp(prefix="delta-gpu-check-")
    lanes = {}
    for enc in ENCODINGS:
        host = engine_host(cfg, device)
        engine = InProcessEngine(host)
        transport = DiskTransport(os.path.join(workdir, enc), [engine], zstd=zstd_level(enc))
        lanes[enc] = (host, DeltaSender(transport, [engine], encoding=enc, buffer_bytes=64 << 20, device=device,
                                        fingerprint_every=1), transport)
    # The broadcast transport: NCCL between two GPUs (the engine on the second), else gloo.
    two = device.type == "cuda" and torch.cuda.device_count() > 1
    backend, engine_device = ("nccl", torch.device("cuda", 1)) if two else ("gloo", device)
    host = engine_host(cfg, engine_device)
    engine = InProcessEngine(host)
    transport = NcclTransport(update_group(host, backend, "gpu-check"), "gpu-check", [engine],
                              device=device if backend == "nccl" else torch.device("cpu"))
    lanes[f"broadcast:{backend}"] = (host, DeltaSender(transport, [engine], encoding="indices",
                                                       buffer_bytes=16 << 20, device=device, fingerprint_every=1),
                                     transport)
    states, per_sync = [bf16_state(trainer)], {enc: [] for enc in lanes}
    steps = rl_steps(trainer, args.steps, lr=1e-6, batch=2, seq=64)
    for step in range(args.steps + 1):
        if step:
            states.append(next(steps))
        state = states[-1]
        with torch.no_grad():
            ref.load_weights(list(state.items()))
        for enc, (host, sender, _) in lanes.items():
            results = sender.update(segments(state))
            m = sender.pop_metrics()
            bad = first_difference(host.model, ref)
            ok = results[0][0] and bad is None and m["perf/update_weights_fingerprint_mismatches"] == 0 \
                and m["perf/update_weights_fingerprint_uncovered"] == 0
            per_sync[enc].append(m)
            if enc in ("xor_zstd", "xor_ctx") and step:  # the engine rebuilt the values from its own device memory
                ok = ok and m["perf/update_weights_xor"] == 1 and m["perf/update_weights_ctx"] == (enc == "xor_ctx")
            report.check(ok, f"step {step} {enc}: {'full sync' if not step else 'delta'} v{sender.version}, density "
                             f"{m['perf/update_weights_density']:.2%}, every param bit-identical to a full load"
                             + ("" if ok else f" — {results[0][1]}; first differing param: {bad}"))
    for _, _, transport in lanes.values():
        transport.close()
    check_stranded_broadcast(report, cfg, device, backend, engine_device, states[-2:], ref)

    old, new = states[-2], states[-1]
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    report.add(f"\nfigures (last step, {nbytes / 1e6:.0f} MB of bf16 weights, on {device}):")
    t_copy = median_s(lambda: [t.clone() for t in new.values()], device)
    t_diff = median_s(lambda: [changed_positions(old[k], new[k]) for k in new], device)
    report.add(f"- device copy of the same bytes: {1e3 * t_copy:.2f} ms ({nbytes / t_copy / 1e9:.1f} GB/s)")
    report.add(f"- bytewise diff: {1e3 * t_diff:.2f} ms ({nbytes / t_diff / 1e9:.1f} GB/s, {t_copy / t_diff:.2f}x the copy)")
    chunk = list(new.items())
    for enc in ("indices", "deltas"):
        def encode():  # the sender's path: one joined diff per batch of params, its runs kept joined to the flush
            bucket = DeltaBucket(enc, 1 << 62)
            for f in changes_many([(old[k], t) for k, t in chunk]):
                for j, k in enumerate(f.ks):
                    if f.counts[j]:
                        bucket.add_found(f, j, chunk[k][0], list(chunk[k][1].shape))
            for payload in bucket.take(version=2, base_version=1):
                payload.seal(spec_only=True)
        t = median_s(encode, device)
        report.add(f"- diff + encode `{enc}` (joined diff, checksum incl.): {1e3 * t:.2f} ms ({nbytes / t / 1e9:.1f} "
                   f"GB/s, {t_copy / t:.2f}x the copy)")
    check_ctx_coding(report, old, new, device, nbytes, t_copy)
    for enc, ms in per_sync.items():
        if enc not in ENCODINGS:
            continue
        h2d = [b["perf/update_weights_h2d_bytes"] - a["perf/update_weights_h2d_bytes"] for a, b in zip(ms, ms[1:])]
        d2h = [b["perf/update_weights_d2h_bytes"] - a["perf/update_weights_d2h_bytes"] for a, b in zip(ms, ms[1:])]
        moved = statistics.mean(x + y for x, y in zip(h2d, d2h))
        report.add(f"- host<->device per delta sync, `{enc}`: {moved / 1e6:.1f} MB "
                   f"(h2d {statistics.mean(h2d) / 1e6:.1f} + d2h {statistics.mean(d2h) / 1e6:.1f}) = "
                   f"{moved / (2 * nbytes):.2f} of the 4N = {2 * nbytes / 1e6:.0f} MB of whole chunks both ways"
                   + (" (CPU: no host link)" if device.type != "cuda" else ""))
    held = lanes["deltas"][1].state.host_bytes()
    report.add(f"- sender snapshot in host memory{' (pinned)' if device.type == 'cuda' else ''}: {held / 1e6:.1f} MB "
               f"for {nbytes / 1e6:.1f} MB of weights ({held / nbytes:.2f}x; whole slabs: the last one's tail is unused)")
    if device.type == "cuda":
        host, sender, _ = lanes["deltas"]
        sender.transport = DiskTransport(os.path.join(workdir, "profiled"), sender.engines)
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                sender.update(segments(new))  # nothing changed since the last sync: all prefetch + diff
                sync(device)
            both, total = overlap_us([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])
            report.add(f"- snapshot prefetch overlapping diff kernels: {both / 1e3:.2f} of {total / 1e3:.2f} ms of "
                       f"host->device copies ({both / max(total, 1e-9):.0%}) in a profiled sync")
        except Exception as e:  # a profiler that cannot trace here is a missing figure, not a failed check
            report.add(f"- stream overlap: n/a ({e!r})")
        finally:
            sender.transport.close()
    else:
        report.add("- stream overlap: n/a on CPU (one synchronous path)")
    host = engine_host(cfg, device)
    ok, msg = receiver._apply_delta_payload(host, full_flushes(old, version=1))
    sync(device)
    payloads = delta_flushes(old, new, "deltas", version=2, base_version=1)
    t0 = time.perf_counter()
    ok2, msg2 = receiver._apply_delta_payload(host, payloads)
    sync(device)
    t_apply = time.perf_counter() - t0
    items = list(new.items())
    with torch.no_grad():
        t_full = median_s(lambda: host.model.load_weights(items), device, repeats=3)
    ratio = f"{t_full / t_apply:.2f}x faster" if t_apply <= t_full else f"{t_apply / t_full:.2f}x slower"
    report.check(ok and ok2, f"delta apply `deltas` {1e3 * t_apply:.2f} ms vs full load_weights {1e3 * t_full:.2f} ms "
                             f"({ratio})" + ("" if ok and ok2 else f" — {msg} / {msg2}"))
    check_memory(report, args, device, workdir)
    check_fp8(report, args, device, workdir)
    check_sharded_ranks(report, args, device, workdir, stubbed)
    check_server(report, args, device, workdir, stubbed)
    check_speculative_server(report, args, device, workdir, stubbed)
    if importlib.util.find_spec("megatron") and importlib.util.find_spec("slime"):
        from gpu_check_slime import ENCODINGS as LANE_ENCODINGS, check_sharded_sender

        for encoding in LANE_ENCODINGS:
            check_sharded_sender(report, args, device, workdir, stubbed, encoding=encoding)
    else:  # the bundle carries both; on the CPU, `make test-slime` runs this lane's dry run
        report.skip("slime's sharded sender", "no Megatron-core or patched slime tree on the path")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="run on the CPU with a tiny model (CI)")
    ap.add_argument("--bundle", help="site.zip from `make gpu-bundle`, used when SGLang is not installed")
    ap.add_argument("--report", default="build/gpu-check/report.md")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--vocab", type=int)
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: CUDA is not available here (torch sees no GPU); use --dry-run for the CPU rehearsal",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = dict(hidden=64, layers=2, vocab=512) if args.dry_run else dict(hidden=1024, layers=8, vocab=32000)
    for k, v in shape.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    if importlib.util.find_spec("sglang") is None:  # found, not imported: the kernel stub must come first
        if not args.bundle or not os.path.exists(args.bundle):
            print("gpu-check: SGLang is not installed and no --bundle (make gpu-bundle) was given", file=sys.stderr)
            return 2
        use_bundle(args.bundle, tempfile.gettempdir())
    stubbed = install_sgl_kernel_stub() if device.type == "cuda" else False
    report = Report(args.report)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    t0 = time.time()
    try:
        import sglang  # a missing dependency on a bare GPU host shows up in the report

        report.add(f"# gpu-check: {name}; torch {torch.__version__}; SGLang {sglang.__version__} "
                   f"(patched){'; sgl_kernel: import stub' if stubbed else ''}\n")
        run(args, device, report, stubbed)
    except Exception as e:
        import traceback

        report.check(False, f"the check stopped: {e!r}")
        report.add("```\n" + traceback.format_exc() + "```")
    report.add(f"\n{'FAILED' if report.failed else 'all checks passed'} in {time.time() - t0:.0f} s")
    print(f"report: {args.report}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
