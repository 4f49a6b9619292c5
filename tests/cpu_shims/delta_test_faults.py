"""Test venvs only: a write kernel that sets a wrong value, and a slow engine, inside a real server's scheduler
process.

When ``$SGLANG_DELTA_TEST_BAD_WRITE_FILE`` is set, the delta receiver's element write (``views._write_bits``) is
wrapped after import (through ``sgl_cpu_shim``'s import hook, so spawned schedulers get it too): while the named file
exists, the next write flips the low bit of its first element after writing it, as a buggy kernel would, and consumes
the file. When ``$SGLANG_DELTA_TEST_SLOW_FILE`` is set, while the named file exists every batch the scheduler runs
takes 50 ms longer: a test's request stays in flight through a whole sync however fast the machine. Never installed
into an image.
"""
import os
import time

_FILE = os.environ.get("SGLANG_DELTA_TEST_BAD_WRITE_FILE")
_SLOW = os.environ.get("SGLANG_DELTA_TEST_SLOW_FILE")


def _wrap(module):
    write = module._write_bits

    def buggy(flat, offsets, bits):
        write(flat, offsets, bits)
        if offsets.numel() and os.path.exists(_FILE):
            os.remove(_FILE)
            k = int(offsets[0])
            flat[k] ^= 1

    module._write_bits = buggy


def _slow(module):
    run_batch = module.Scheduler.run_batch

    def slow(self, *args, **kwargs):
        if os.path.exists(_SLOW):
            time.sleep(0.05)
        return run_batch(self, *args, **kwargs)

    module.Scheduler.run_batch = slow


if _FILE or _SLOW:
    import sgl_cpu_shim

    if _FILE:
        sgl_cpu_shim._AFTER_IMPORT["sglang.srt.weight_sync.delta.views"] = _wrap
    if _SLOW:
        sgl_cpu_shim._AFTER_IMPORT["sglang.srt.managers.scheduler"] = _slow
