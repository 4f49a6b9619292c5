"""An ``xor_ctx`` flush file written from docs/wire-format.md alone (a writer of the test's own: numpy, struct, json,
safetensors, zstd; the checksum's reference from the same page, ``test_checksum.ref_checksum``), applied by an engine
at its base: what the page states is enough to write what an engine takes, and a file that departs from it in one
stated detail is refused with nothing written."""
import json
import os
import struct

import numpy as np
import torch
import zstandard
from safetensors.torch import save

from cpu_harness import Host, InProcessEngine, bf16_state, hf_config, hf_model, nan_filled, rl_steps, segments, \
    sglang_model
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta.receiver import delta_status
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport
from test_checksum import ref_checksum

HALF = 1 << 15  # bf16: b = 16 bits, m = 7 mantissa bits


def key(x: np.ndarray) -> np.ndarray:
    """``x`` if the sign bit is clear, else ``-(x & (2**(b-1) - 1)) - 1``."""
    x = x.astype(np.int64)
    return np.where(x < HALF, x, -(x & (HALF - 1)) - 1)


class Bits:
    """Bits least significant first, from bit 0 of byte 0 on; padded with zero bits to a byte."""

    def __init__(self):
        self.bits = []

    def put(self, v: int, width: int) -> None:
        self.bits += [(v >> i) & 1 for i in range(width)]

    def bytes(self) -> bytes:
        return np.packbits(np.array(self.bits, np.uint8), bitorder="little").tobytes() if self.bits else b""


def rice(u: Bits, r: Bits, v: int, k: int) -> None:
    q = v >> k
    if q < 32:
        u.bits += [0] * q + [1]
        r.put(v, k)
    else:  # the escape
        u.bits += [0] * 32 + [1]
        r.put(v, 32)


def k_for(values) -> int:
    return min(31, int(np.log2(np.mean(values) + 1))) if len(values) else 0


def xor_ctx_file(olds: dict, news: dict, base_version: int, version: int, seg_log2: int = 16, sign_when=-1):
    """The flush's file bytes. ``sign_when``: the step sign an S bit of 1 stands for (the page: negative)."""
    names, pos_blob, val_blob, cols = [], b"", b"", {c: [] for c in (
        "name", "dtype", "shape", "pos_start", "pos_end", "pos_width", "val_start", "val_end")}
    space_base, space_new = [], []
    for name in news:
        a = olds[name].reshape(-1).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        b = news[name].reshape(-1).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        idx = np.flatnonzero(a != b)
        if not len(idx):
            continue  # a flush names what changed
        gaps = np.diff(np.concatenate([[-1], idx])) - 1
        width = 2 if gaps.max() <= 65535 else 4
        pos = gaps.astype("<u2" if width == 2 else "<u4").tobytes()
        vals = b[idx].astype("<u2").tobytes()
        for c, v in (("name", name), ("dtype", "bfloat16"), ("shape", list(olds[name].shape)),
                     ("pos_start", len(pos_blob)), ("pos_end", len(pos_blob) + len(pos)), ("pos_width", width),
                     ("val_start", len(val_blob) // 2), ("val_end", len(val_blob) // 2 + len(idx))):
            cols[c].append(v)
        pos_blob, val_blob = pos_blob + pos, val_blob + vals
        names.append(name)
        space_base.append(a)
        space_new.append(b)
    # the joined space (not aligned): every sparse param's elements in spec order
    base, new = np.concatenate(space_base), np.concatenate(space_new)
    x = np.arange(len(base))
    klass = (x >> seg_log2) * 256 + ((base & (HALF - 1)) >> 7)  # (segment, context)
    order = np.argsort(klass, kind="stable")  # members of each class in position order
    rank = np.empty(len(base), np.int64)
    starts = np.searchsorted(klass[order], klass[order], side="left")
    rank[order] = np.arange(len(base)) - starts
    changed = np.flatnonzero(base != new)
    step = key(new[changed]) - key(base[changed])
    table, u, r, signs = [], Bits(), Bits(), []
    entries = sorted(set(klass[changed].tolist()))
    per_entry = []
    for c in entries:
        mine = changed[klass[changed] == c]  # ascending positions are ascending ranks within a class
        ranks = rank[mine]
        st = step[klass[changed] == c]
        rgaps = np.diff(np.concatenate([[-1], ranks])) - 1
        kp, k1 = k_for(rgaps), k_for(np.abs(st) - 1)
        table.append((c // 256, c % 256, len(mine), len(mine), 0, 0, kp, k1, 0))
        per_entry.append((rgaps, st, kp, k1))
    for rgaps, _, kp, _ in per_entry:  # P
        for g in rgaps:
            rice(u, r, int(g), kp)
    for _, st, _, k1 in per_entry:  # A
        for s in st:
            rice(u, r, int(abs(s)) - 1, k1)
    for _, st, _, _ in per_entry:  # S
        signs += [int(np.sign(s) == sign_when) for s in st]
    s_bits = Bits()
    s_bits.bits = signs
    ub, rb, sb = u.bytes(), r.bytes(), s_bits.bytes()
    n = len(table)
    head = struct.pack("<4sBBHIQQQ", b"XCTX", 1, seg_log2, 0, n, len(ub), len(rb), len(sb))
    columns = b"".join(np.array([row[i] for row in table], dtype=t).tobytes()
                       for i, t in enumerate(("<u4", "<u2", "<u4", "<u4", "<u4", "u1", "u1", "u1", "u1")))
    streams = head + columns + ub + rb + sb
    scalars = {"encoding": "xor_ctx", "checksum_algo": "mix64", "full": False, "base_version": base_version,
               "version": version, "flush": 0, "final": True, "source": 0, "sources": 1, "part": 0, "last_part": True}
    spec = dict(scalars, params=cols, checksum="")
    checksum = ref_checksum(json.dumps(spec), pos_blob, val_blob)
    metadata = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in scalars.items()}
    metadata["checksum"] = checksum
    metadata["params"] = json.dumps(cols, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    data = save({"__positions__": torch.frombuffer(bytearray(streams), dtype=torch.uint8),
                 "__values__": torch.zeros(0, dtype=torch.bfloat16)}, metadata=metadata)  # no dense param: empty
    return zstandard.ZstdCompressor(level=1).compress(data)


def test_an_xor_ctx_flush_written_from_the_docs_alone_is_applied_and_a_departure_refused(tmp_path):
    """An engine at version 1 (a full sync over disk) takes version 2 as one ``xor_ctx`` file from the page's writer,
    bit-identical to a plain load of the new state; the same file with the sign bit's meaning turned round is refused
    (a step that leaves the dtype's range: ``malformed``) and the engine stays at version 1, untouched."""
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    engine = InProcessEngine(Host(nan_filled(sglang_model(cfg))))
    transport = DiskTransport(str(tmp_path / "sync"), [engine], zstd=1)
    old = bf16_state(trainer)
    assert DeltaSender(transport, [engine], encoding="xor_zstd").update(segments(old))[0][0]
    transport.close()
    status = delta_status(engine.host.model)
    assert status.version == 1 and status.ctx, status
    new = next(rl_steps(trainer, 1))
    d = tmp_path / "weight_v000002"
    os.makedirs(d)
    for sign_when, ok_expected in ((1, False), (-1, True)):
        name = f"rank0000_flush00000{int(ok_expected)}.safetensors"
        (d / name).write_bytes(xor_ctx_file(old, new, 1, 2, sign_when=sign_when))
        ok, msg = engine.update_weights_from_disk(str(d), [name], "2")
        status = delta_status(engine.host.model)
        assert ok is ok_expected and status.version == (2 if ok_expected else 1), (msg, status)
        assert status.code == (None if ok_expected else "malformed"), (msg, status)  # a step past the dtype
        ref = nan_filled(sglang_model(cfg))
        ref.load_weights(list((new if ok_expected else old).items()))
        assert_params_equal(engine.host.model, ref)
