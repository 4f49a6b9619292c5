"""The weight fingerprint's hashes: against the documented definition and through the views an engine records; the
coverage signature's closed form against its sum."""
import hashlib
import random

import pytest
import torch

from cpu_harness import SyncCounter
from sglang.srt.weight_sync.delta import fingerprint, mix64
from test_checksum import C1, C2, C3, M, ref_mix  # the mix, as docs/wire-format.md defines it
from test_sync_counts import AllOps

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int64]


def ref_fingerprint(name: str, t: torch.Tensor):
    """(total, coverage) from the module docstring: ``sum_i mix((i * C1 + seed) ^ (bits_i * C2))``, ``sum_i i (i + C3)``."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    size = t.element_size()
    raw = t.contiguous().view(torch.uint8).reshape(-1, size).tolist()
    total = sum(ref_mix(((i * C1 + seed) & M) ^ ((int.from_bytes(bytes(b), "little") * C2) & M))
                for i, b in enumerate(raw)) & M
    return total, sum(i * (i + C3) for i in range(len(raw))) & M


def sample(dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-(1 << 63), (1 << 63) - 1, (n,), generator=g, dtype=torch.int64)
    t = torch.randn(n, generator=g).to(dtype)
    t.view(-1)[:3] = torch.tensor([-0.0, float("inf"), -float("inf")]).to(dtype)  # sign bits, all-ones exponents
    return t


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_documented_definition(dtype):
    t = sample(dtype, 3 * 1024 + 21)  # whole rows of the trainer's 2-D blocks and a rest
    share = fingerprint.tensor_fingerprint("model.layers.0.mlp.down_proj.weight", t.reshape(3, -1))
    assert (share.total, share.coverage, share.count) == (*ref_fingerprint("model.layers.0.mlp.down_proj.weight", t),
                                                          t.numel())


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_tensors_are_hashed_by_their_values(dtype):
    """A trainer's tensor that is a strided view (every other element; a transposed matrix), large and small: the
    numbers of its values, not of the memory around them."""
    base = sample(dtype, 2 * (3 * 1024 + 21), 7)
    items = [("every_other", base[::2]), ("every_other_small", base[:2 * 700:2]),
             ("transposed", base[:96 * 64].reshape(96, 64).t())]
    got = fingerprint.read_shares(fingerprint.tensor_shares(items))
    for name, t in items:
        assert (got[name].total, got[name].coverage) == ref_fingerprint(name, t), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_engine_reading_through_recorded_views_gets_the_trainers_numbers(dtype):
    """A param filled through views the way loaders do (a transposed copy, a TP-style column shard, rows of a fused
    param, a permuted source that no 2-D geometry covers, a 1-D tensor into a column): the recorded views give back every HF tensor's share; a
    flipped bit inside one view changes that name alone, one outside every view changes none."""
    hf = {"t": sample(dtype, 48 * 40, 1).reshape(48, 40), "shard": sample(dtype, 30 * 64, 2).reshape(30, 64),
          "rows": sample(dtype, 7 * 40, 3).reshape(7, 40), "cube": sample(dtype, 4 * 6 * 10, 4).reshape(4, 6, 10),
          "column": sample(dtype, 1100, 5)}
    param = torch.zeros(200, 40, dtype=dtype)
    other = torch.zeros(30, 128, dtype=dtype)
    cube = torch.zeros(6, 4, 10, dtype=dtype)
    column = torch.zeros(1100, 3, dtype=dtype)  # a strided run longer than a row of the trainer's blocks
    rec = fingerprint.FingerprintRecorder([param, other, cube, column])
    rec.sources(list(hf.items()))
    copies = [(param[:48].view(40, 48).t(), hf["t"]), (other[:, 64:], hf["shard"]), (param[100:107], hf["rows"]),
              (cube, hf["cube"].permute(1, 0, 2)), (column[:, 1], hf["column"])]
    for dst, src in copies:
        assert rec.observe(dst, src)
        dst.copy_(src)
    assert mix64.as_2d(*rec.copies["cube"][0].src) is None and mix64.as_2d(*rec.copies["t"][0].src) is not None
    engine = fingerprint.engine_shares(rec.copies)
    trainer = {n: fingerprint.tensor_fingerprint(n, t) for n, t in hf.items()}
    assert {n: (s.total, s.coverage, s.count) for n, s in engine.items()} == \
        {n: (s.total, s.coverage, s.count) for n, s in trainer.items()}
    bits = {n: t.view(fingerprint.INT_VIEW[t.element_size()]) for n, t in (("param", param), ("other", other))}
    bits["param"][107, 3] ^= 1
    assert fingerprint.compare_shares(trainer, fingerprint.engine_shares(rec.copies), hf) == ([], [])
    bits["other"][0, 64] ^= 1
    assert fingerprint.compare_shares(trainer, fingerprint.engine_shares(rec.copies), hf) == (["shard"], [])


def recorded_in_one_store(hf):
    """A recorder that saw ``hf``'s bf16 tensors copied one after another into one param, as a fused MoE weight holds
    its experts."""
    store = torch.zeros(sum(t.numel() for t in hf.values()), dtype=torch.bfloat16)
    rec = fingerprint.FingerprintRecorder([store])
    rec.sources(list(hf.items()))
    at = 0
    for t in hf.values():
        dst = store[at:at + t.numel()].view(t.shape)
        assert rec.observe(dst, t)
        dst.copy_(t)
        at += t.numel()
    return rec


@pytest.mark.parametrize("params", [3, 300])
def test_a_fingerprint_reads_the_host_once_whatever_the_param_count(params):
    """Both sides: every name's sum stays on the device until one read (a per-param read is a stall each on a GPU)."""
    hf = {f"layers.{k}.w": sample(torch.bfloat16, 64 * 8 + k, k).reshape(-1, 1) for k in range(params)}
    rec = recorded_in_one_store(hf)
    with SyncCounter() as trainer:
        mine = fingerprint.read_shares({n: fingerprint.tensor_share(n, t) for n, t in hf.items()})
    with SyncCounter() as engine:
        theirs = fingerprint.engine_shares(rec.copies)
    assert len(trainer.ops) == len(engine.ops) == 1, (trainer.ops, engine.ops)
    assert fingerprint.compare_shares(mine, theirs, hf) == ([], [])


def test_a_fingerprints_ops_follow_the_bytes_not_the_tensor_count():
    """Both sides, 3 and 300 small tensors (whole rows, and less than one row) in one store: small tensors of one
    kind are joined, so the computing ops are as many for 300 as for 3. Views: the trainer's one per tensor inside
    the C++ call that joins them, the engine's one per recorded copy (its rows in the param's bits)."""
    ops = {}
    for params in (3, 300):
        hf = {f"layers.{k}.w{j}": sample(torch.bfloat16, n, k * 2 + j).reshape(-1, 16)
              for k in range(params) for j, n in enumerate((2 * 1024, 16))}
        rec = recorded_in_one_store(hf)
        with AllOps() as trainer_ops:
            mine = fingerprint.tensor_shares(list(hf.items()))
        with AllOps() as engine_ops:
            theirs = fingerprint.engine_shares(rec.copies)
        assert fingerprint.compare_shares(fingerprint.read_shares(mine), theirs, hf) == ([], [])
        ops[params] = (trainer_ops.compute, trainer_ops.views - len(hf), engine_ops.compute, engine_ops.views - len(hf))
    assert ops[3] == ops[300], ops


def test_the_coverage_closed_form_equals_the_sum():
    rng = random.Random(11)
    for _ in range(300):
        dims = rng.randint(0, 4)
        shape = [rng.choice([0, 1, 2, 3, 7, 64]) for _ in range(dims)]
        strides = [rng.choice([0, 1, 5, 4096, 1 << 31, (1 << 40) + 3]) for _ in range(dims)]
        offset = rng.choice([0, 9, 1 << 33, (1 << 62) + 1])
        idx = mix64.flat_index(shape, strides, offset, "cpu").tolist() if all(shape) else []
        want = sum(i * (i + C3) for i in idx) & M
        assert mix64.coverage(shape, strides, offset) == want, (shape, strides, offset)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_the_row_sums_are_the_view_sum_whatever_the_thread_count(threads):
    """Each row's sum with its own key adds up to the hash of the whole 2-D view, on any thread count."""
    bits = sample(torch.bfloat16, (1 << 18) + 1024, threads).view(torch.int16).reshape(-1, 1024)
    (ka, kb), key0 = mix64.fingerprint_keys((1024, 1), 5, 77)
    row_keys = torch.arange(bits.shape[0]) * ka + key0
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = mix64.row_sums(bits, row_keys, kb, 0xFFFF)
    finally:
        torch.set_num_threads(was)
    assert int(got.sum()) == int(mix64.view_sum(bits.to(torch.int64).reshape(-1), bits.shape, (ka, kb), key0, 0xFFFF))


def test_misaligned_and_odd_rows_give_the_documented_numbers():
    """bf16 rows of an even and an odd length, a tensor whose memory starts off a 4-byte boundary, a large one
    hashed where it lies and small ones joined into new memory: every split gives the documented numbers."""
    whole = sample(torch.bfloat16, 5 * 1024 + 7, 3)
    shifted = sample(torch.bfloat16, 2 * 1024 + 1, 4)[1:]
    row = sample(torch.bfloat16, 1024, 6)
    large = sample(torch.bfloat16, (fingerprint._JOIN // 1024 + 1) * 1024 + 1, 5)[1:]
    items = [("a", whole), ("b", shifted), ("c", large), ("d", row)]
    got = fingerprint.read_shares(fingerprint.tensor_shares(items))
    for name, t in items:
        assert (got[name].total, got[name].coverage) == ref_fingerprint(name, t)


def test_a_chunk_hashed_together_gives_each_tensor_its_own_numbers():
    """A trainer's chunk of mixed bit widths, one name given twice: each name's share is that of its last tensor alone."""
    items = [(f"w{k}", sample(dtype, 1024 * (k + 1) + 5 * k, k)) for k, dtype in enumerate(DTYPES)]
    items.append(("w0", sample(DTYPES[0], 77, 99)))
    got = fingerprint.read_shares(fingerprint.tensor_shares(items))
    assert list(got) == [n for n, _ in items[:-1]]
    for name, t in dict(items).items():
        assert (got[name].total, got[name].coverage, got[name].count) == (*ref_fingerprint(name, t), t.numel())
