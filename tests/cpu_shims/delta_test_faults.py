"""Test venvs only: a write kernel that sets a wrong value, inside a real server's scheduler process.

When ``$SGLANG_DELTA_TEST_BAD_WRITE_FILE`` is set, the delta receiver's element write (``views._write_bits``) is
wrapped after import (through ``sgl_cpu_shim``'s import hook, so spawned schedulers get it too): while the named file
exists, the next write flips the low bit of its first element after writing it, as a buggy kernel would, and consumes
the file. Never installed into an image.
"""
import os

_FILE = os.environ.get("SGLANG_DELTA_TEST_BAD_WRITE_FILE")


def _wrap(module):
    write = module._write_bits

    def buggy(flat, offsets, bits):
        write(flat, offsets, bits)
        if offsets.numel() and os.path.exists(_FILE):
            os.remove(_FILE)
            k = int(offsets[0])
            flat[k] ^= 1

    module._write_bits = buggy


if _FILE:
    import sgl_cpu_shim

    sgl_cpu_shim._AFTER_IMPORT["sglang.srt.weight_sync.delta.views"] = _wrap
