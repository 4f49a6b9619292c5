"""The delta tools on real HF checkpoints: diff -> apply is bit-identical; bad input is refused with one line."""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cpu_harness import hf_config, rl_states, write_hf_checkpoint
from sglang.srt.weight_sync.delta.tools import main


class Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def tool(*args):
    """The CLI's ``main`` in-process (importing SGLang once); ``test_the_module_runs`` covers ``python -m``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return Run(rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    cfg = hf_config("qwen3")
    states = rl_states(cfg, 2, seed=0)
    return root, [write_hf_checkpoint(str(root / f"step{i}"), cfg, s) for i, s in enumerate(states)], states


def tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.parametrize("encoding", ["indices", "deltas", "deltas_zstd", "planes_zstd", "xor_zstd", "xor_ctx"])
def test_diff_then_apply_is_bit_identical(ckpts, encoding):
    root, (c0, c1, _), _ = ckpts
    out = root / f"delta-{encoding}"
    r = tool("diff", c0, c1, "--out", out, "--encoding", encoding, "--buffer-size", 4096)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "delta.json").read_text())
    assert len(manifest["files"]) > 1 and 0 < manifest["changed"] < manifest["elements"] * 0.2
    r = tool("apply", c0, out, "--out", root / f"rebuilt-{encoding}")
    assert r.returncode == 0, r.stderr
    want, got = tensors(c1), tensors(root / f"rebuilt-{encoding}")
    assert want.keys() == got.keys()
    for n in want:
        assert want[n].dtype == got[n].dtype and torch.equal(want[n].view(torch.int16), got[n].view(torch.int16)), n
    assert (root / f"rebuilt-{encoding}" / "config.json").exists()
    r = tool("inspect", out)
    assert r.returncode == 0 and "final" in r.stdout and "checksum" in r.stdout, r.stdout
    assert (f"unverified ({encoding}: apply checks it against the base)" if encoding.startswith("xor")
            else " ok") in r.stdout


def test_apply_refuses_the_wrong_base(ckpts):
    root, (c0, c1, c2), _ = ckpts
    out = root / "delta-12"
    assert tool("diff", c1, c2, "--out", out).returncode == 0
    r = tool("apply", c0, out, "--out", root / "never")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "is not the base these deltas were made from" \
        in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (root / "never").exists()


def test_a_corrupted_delta_file_is_refused(ckpts):
    root, (c0, c1, _), _ = ckpts
    out = root / "delta-corrupt"
    assert tool("diff", c0, c1, "--out", out, "--encoding", "deltas").returncode == 0
    f = out / json.loads((out / "delta.json").read_text())["files"][0]
    data = bytearray(f.read_bytes())
    data[-3] ^= 1
    f.write_bytes(bytes(data))
    r = tool("apply", c0, out, "--out", root / "never2")
    assert r.returncode == 2 and "checksum mismatch" in r.stderr, r.stderr
    r = tool("inspect", f)
    assert r.returncode == 1 and "refused" in r.stdout and "checksum mismatch" in r.stdout, r.stdout


def test_density_reports_layers_and_wire_sizes(ckpts):
    root, (c0, c1, _), _ = ckpts
    r = tool("density", c0, c1, "--json", "--plot", root / "density.png")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert 0 < report["density"] < 0.2 and set(report["layers"]) == {"0", "1"}
    assert report["wire_bytes"]["deltas"] < report["wire_bytes"]["indices"] < report["wire_bytes"]["full"]
    assert (root / "density.png").stat().st_size > 1000


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    r = tool("diff", tmp_path / "nope", tmp_path / "nope2", "--out", tmp_path / "o")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "no *.safetensors files" in r.stderr


def test_the_module_runs(ckpts):
    root, (c0, c1, _), _ = ckpts
    r = subprocess.run([sys.executable, "-m", "sglang.srt.weight_sync.delta", "density", str(c0), str(c1)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("density "), r.stderr
