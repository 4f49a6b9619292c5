"""The accelerator's branches (pinned memory, side streams, asynchronous copies, large hash blocks) run on CPU tensors
under ``SGLANG_DELTA_DEVICE_PATH=1`` and give the default path's bytes, on the wire and in the engine."""
import pytest
import torch

from cpu_harness import bf16_state, hf_config, hf_model, rl_steps, segments
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta import device, mix64, transport as transport_module
from sglang.srt.weight_sync.delta.files import maybe_zstd_decompress, read_safetensors
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.transport import DiskTransport
from sglang.srt.weight_sync.delta.wire import zstd_level
from test_sender import LocalEngine, reference


def test_the_checksum_sums_in_the_devices_large_blocks_to_the_same_numbers(monkeypatch):
    g = torch.Generator().manual_seed(5)
    blob = torch.randint(0, 256, ((1 << 22) * 8 + 8 * 5 + 3,), dtype=torch.uint8, generator=g)
    want = [int(x) for x in mix64.blob_sum(blob, 7, torch.bfloat16)]
    monkeypatch.setenv(device.SWITCH, "1")
    assert mix64._words_per_block(torch.device("cpu")) == 1 << 22
    assert [int(x) for x in mix64.blob_sum(blob, 7, torch.bfloat16)] == want


def _run(tmp_path, monkeypatch, arch, encoding, on):
    """Four syncs of a real training loop into an in-process engine: every flush file's spec and blobs, and the
    sender's host<->device byte counters."""
    if on:
        monkeypatch.setenv(device.SWITCH, "1")
    files, flush_file = [], transport_module.flush_file

    def kept(*a):  # safetensors writes its metadata in no fixed order: the decoded flush is what must match
        data = flush_file(*a)
        payload = read_safetensors(maybe_zstd_decompress(data, 1 << 30))
        files.append((payload.spec.to_json(), payload.positions.numpy().tobytes(), payload.values.view(-1).view(
            torch.uint8).numpy().tobytes()))
        return data

    monkeypatch.setattr(transport_module, "flush_file", kept)
    cfg = hf_config(arch)
    trainer = hf_model(cfg)
    engine = LocalEngine(cfg)
    tr = DiskTransport(str(tmp_path / ("on" if on else "off")), [engine], zstd=zstd_level(encoding))
    sender = DeltaSender(tr, [engine], encoding=encoding, buffer_bytes=4 << 10)
    state = bf16_state(trainer)
    assert sender.update(segments(state))[0][0]
    for state in rl_steps(trainer, 3):
        assert sender.update(segments(state))[0][0]
        assert_params_equal(engine.host.model, reference(cfg, state))
    tr.close()
    link = sender.state.link
    monkeypatch.undo()
    return files, (link.h2d_bytes, link.d2h_bytes)


@pytest.mark.parametrize("arch, encoding", [("qwen3-moe", "xor_zstd"), ("qwen3-tied", "deltas")])
def test_a_training_loop_on_the_device_path_sends_the_same_bytes(tmp_path, monkeypatch, arch, encoding):
    off, traffic_off = _run(tmp_path, monkeypatch, arch, encoding, on=False)
    on, traffic_on = _run(tmp_path, monkeypatch, arch, encoding, on=True)
    assert traffic_off == (0, 0) and min(traffic_on) > 0  # the device path prefetched and copied back
    assert len(on) == len(off) > 4 and on == off
