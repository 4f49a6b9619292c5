"""`make gpu-check` rehearsed on the CPU (the script's own dry-run: every check, tiny model), and its refusal
to pretend without CUDA."""
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def test_dry_run_passes_every_check(tmp_path):
    report = tmp_path / "report.md"
    r = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--report", str(report)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = report.read_text()
    assert "FAIL" not in text and text.rstrip().splitlines()[-1].startswith("all checks passed")
    for lane in ("indices", "deltas", "deltas_zstd", "planes_zstd", "xor_zstd", "xor_ctx", "broadcast:gloo"):
        assert f"PASS: step 3 {lane}: delta v4" in text
    assert "PASS: broadcast:gloo: a request refused unreceived aborts the pending broadcast" in text
    assert "PASS: broadcast:gloo: the next sync re-creates the group and lands bit-identically" in text
    assert "skipped (no device): mix64 blob sums equal on CPU and device" in text and "delta apply `deltas`" in text
    assert "- sender snapshot in host memory: " in text
    assert "- `xor_ctx` file making (diffed, zstd incl.) " in text and "- `xor_zstd` file making" in text
    assert "PASS: mix64" not in text and "PASS: weight fingerprint equal on CPU" not in text
    for enc in ("deltas_zstd", "xor_zstd"):  # the FP8 rollout lane
        assert f"PASS: fp8 step 3 {enc}: delta, e4m3 density" in text
    for rank in (0, 1):  # the sharded lane: TP=2 x EP=2 ranks (CPU processes, gloo)
        for v, kind in ((1, "full sync"), (2, "deltas_zstd"), (3, "xor_zstd")):
            assert f"PASS: rank {rank} v{v} {kind}: bit-identical to a plain load on the rank" in text
        assert f"PASS: rank {rank}: no loader call in a delta" in text
    for step in range(4):  # the real server lane (SGLang's CPU flags here)
        assert f"PASS: server step {step} " in text
    assert "- skipped (EAGLE runs on SGLang's own CUDA kernels: a GPU host with SGLang installed): a real " \
        "launch_server with EAGLE" in text  # the speculative lane: GPU only (EAGLE needs CUDA kernels)
    # the sharded-sender lane needs Megatron and slime: its dry run is in test_slime_shard_map (make test-slime)
    assert "- skipped (no Megatron-core or patched slime tree on the path): slime's sharded sender" in text


def test_without_cuda_it_fails_and_says_why(tmp_path):
    assert not torch.cuda.is_available()
    r = subprocess.run([sys.executable, SCRIPT, "--report", str(tmp_path / "r.md")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2
    assert "gpu-check: CUDA is not available here" in r.stderr
