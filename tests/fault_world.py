"""A real patched SGLang server on CPU and the real sender core, with the means to break things between them.

Faults are injected on the real path: published files are corrupted after the writer's rename
(the transport's post-write hook), announcements are tampered with on their way to the server,
the engine's process can be killed between two loader calls (``SGLANG_DELTA_TEST_KILL_FILE``), and its element
write can set a wrong value (``SGLANG_DELTA_TEST_BAD_WRITE_FILE``, a test venv's shim).
"""
import glob
import json
import os
import struct
import time

import torch

from cpu_harness import Server, bf16_state, engine_mismatch, hf_config, hf_model, rl_steps, segments, write_hf_checkpoint
from sglang.srt.weight_sync.delta import fingerprint
from sglang.srt.weight_sync.delta.engine_api import DeltaEngine
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine
from sglang.srt.weight_sync.delta.files import read_safetensors, write_safetensors

SERVER_FLAGS = ["--update-weight-delta-chunk-bytes", "16384", "--update-weight-group-timeout", "5"]


class Tamperable(DeltaEngine):
    """The engine as the sender sees it: a real HttpEngine (it pauses generation around each sync, in its
    ``pause_mode``); a test may rewrite one announcement."""

    def __init__(self, url, pause_mode="abort"):
        self.http = HttpEngine(url, timeout=120, pause_mode=pause_mode)
        self.rewrite = None
        self.drop_full = False  # full syncs never reach the engine (a repair kept from it)

    def update_weights_from_disk(self, model_path, files, weight_version):
        if self.drop_full and os.path.basename(model_path.rstrip("/")) == "full":
            return False, "test: this full sync was kept from the engine"
        if self.rewrite is not None:
            model_path, files, weight_version = self.rewrite(model_path, files, weight_version)
            self.rewrite = None
        return self.http.update_weights_from_disk(model_path, files, weight_version)

    def update_weights_from_distributed(self, *args):
        return self.http.update_weights_from_distributed(*args)

    def pause_generation(self):
        return self.http.pause_generation()

    def continue_generation(self):
        return self.http.continue_generation()

    def fingerprint(self):
        return self.http.fingerprint()

    def status(self):
        return self.http.status()


class World:
    def __init__(self, root):
        self.root = root
        self.cfg = hf_config("llama", vocab=300)
        self.boot = write_hf_checkpoint(str(root / "boot"), self.cfg, bf16_state(hf_model(self.cfg, seed=2)))
        self.kill_file = root / "kill-engine"
        self.bad_write_file = root / "bad-write"  # tests/cpu_shims/delta_test_faults.py
        self.trainer = hf_model(self.cfg, seed=1)
        self.steps = rl_steps(self.trainer, 1 << 20)
        self.hook = None
        self.start_server()
        self.engine = Tamperable(self.server.url)
        self.transport = DiskTransport(str(root / "shared"), [self.engine], post_write_hook=self._hook)
        self.sender = DeltaSender(self.transport, [self.engine], encoding="indices", buffer_bytes=16 << 10)
        self.state = bf16_state(self.trainer)
        ok, msg = self.sender.update(segments(self.state))[0]
        assert ok, msg

    def start_server(self):
        self.server = Server(self.boot, str(self.root / f"server-{time.time():.0f}.log"), extra=SERVER_FLAGS,
                             env={"SGLANG_DELTA_TEST_KILL_FILE": str(self.kill_file),
                                  "SGLANG_DELTA_TEST_BAD_WRITE_FILE": str(self.bad_write_file)}).wait_healthy()

    def _hook(self, vdir):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook(vdir)

    def sync(self, state=None):
        state = state if state is not None else next(self.steps)
        ok, msg = self.sender.update(segments(state))[0]
        return ok, msg, state

    def engine_holds(self, state, version):
        """Bit-identity twice over: the engine's fingerprint, and every param read back over HTTP."""
        theirs = fingerprint.merge_ranks(fingerprint.check_version(self.engine.fingerprint(), version))
        differ, uncovered = fingerprint.compare(state, theirs)
        assert differ == [] and uncovered == [], (differ, uncovered)
        assert engine_mismatch(self.server, state) is None

    def recovers(self):
        """The next sync succeeds by itself and leaves the engine bit-identical to the trainer."""
        ok, msg, state = self.sync()
        assert ok, msg
        self.engine_holds(state, self.sender.version)
        self.state = state


def fault(world, expect, *, hook=None, rewrite=None, untouched=True):
    """Run one sync with the fault armed; the engine refuses it with ``expect`` and keeps its weights."""
    acked = world.sender.state.version
    world.hook, world.engine.rewrite = hook, rewrite
    ok, msg, _ = world.sync()
    world.hook = world.engine.rewrite = None
    assert not ok, "the fault went unnoticed"
    assert expect in msg, msg
    assert world.sender.state.version == acked  # nothing committed
    if untouched:
        world.engine_holds(world.state, acked)
    assert world.sender.pop_metrics()["perf/update_weights_failures"] == 1
    world.recovers()
    return msg


# ---------------------------------------------------------------- helpers on the published files


def first_file(vdir):
    """The first published file of this sync (delta files in the version dir, full-sync files under full/)."""
    files = sorted(glob.glob(os.path.join(vdir, "*.safetensors")) + glob.glob(os.path.join(vdir, "full", "*.safetensors")))
    return files[0]


def blob_range(path, key):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    start, end = json.loads(data[8:8 + n])[key]["data_offsets"]
    return 8 + n + start, 8 + n + end


def flip_bit(key):
    def hook(vdir):
        path = first_file(vdir)
        start, end = blob_range(path, key)
        assert end > start
        data = bytearray(open(path, "rb").read())
        data[(start + end) // 2] ^= 0x10
        open(path, "wb").write(bytes(data))
    return hook


def resigned(edit):
    """Rewrite the first file with ``edit(payload)`` applied and a *valid* checksum: only the check under test can fire."""
    def hook(vdir):
        path = first_file(vdir)
        pl = read_safetensors(open(path, "rb").read(), os.path.basename(path))
        pl.positions, pl.values = pl.positions.clone(), pl.values.clone()  # views of the file's bytes: edit copies
        edit(pl)
        pl.seal()
        open(path, "wb").write(write_safetensors(pl.spec, pl.positions, pl.values))
    return hook


def sparse_param(pl):
    return next(p for p in pl.spec.params if p.pos_width and p.nnz >= 2)


def positions_of(pl, p):
    return pl.positions[p.pos_start:p.pos_end].view(torch.int16 if p.pos_width == 2 else torch.int32)
